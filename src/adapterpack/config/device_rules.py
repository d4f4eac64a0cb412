"""Rules a package meets on a device that Linux cannot run, checked from the package's spec.

Each rule cites the public source it comes from; none is a guess at a limit. Findings are
warnings (``build`` and ``inspect`` print them; ``--strict`` makes them errors) because a
package that breaks one still converts and may still run, only not where or how the user
expects. Reading the spec is cheap and needs no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Every Core ML state dimension we size (the cache length and the key/value width) should be a
# multiple of this: stateful models fail on the Neural Engine otherwise, while CPU and GPU run them.
NEURAL_ENGINE_STATE_MULTIPLE = 32

ANE_STATE_SOURCE = "apple/coremltools#2631 (stateful model fails on the Neural Engine when a state dimension is not a multiple of 32)"
SWIFT_CLIENT_SOURCE = "huggingface/swift-transformers Sources/Models/LanguageModel.swift (LanguageModelWithStatefulKVCache)"
CORE_ML_STATE_SOURCE = "coremltools converters/mil/backend/mil/load.py (Core ML states are fixed-shape float16)"
MULTIFUNCTION_SOURCE = "coremltools models/utils.py save_multifunction (multifunction models need iOS 18 / macOS 15)"

# Specification version of iOS 18 / macOS 15, the first that holds states and several functions.
IOS18_SPECIFICATION = 9
FLOAT16 = 65552  # ArrayFeatureType.FLOAT16
INT32 = 131104  # ArrayFeatureType.INT32


@dataclass(frozen=True)
class Finding:
    """One broken rule: where, what, how to fix it, and who says so."""

    rule: str
    where: str
    problem: str
    fix: str
    source: str

    def line(self) -> str:
        return f"{self.where}: {self.problem}; {self.fix} (see {self.source})"


def cache_length_findings(max_context: int, head_dim: int, where: str) -> list[Finding]:
    """The Neural Engine rule for the states this tool exports, from the sizes alone (before a build)."""
    findings = []
    if max_context % NEURAL_ENGINE_STATE_MULTIPLE:
        lower = max_context // NEURAL_ENGINE_STATE_MULTIPLE * NEURAL_ENGINE_STATE_MULTIPLE
        findings.append(
            Finding(
                "ane-state-multiple", where,
                f"max_context {max_context} is not a multiple of {NEURAL_ENGINE_STATE_MULTIPLE}, and it sizes every state",
                f"use max_context: {max(lower, NEURAL_ENGINE_STATE_MULTIPLE)} (or {lower + NEURAL_ENGINE_STATE_MULTIPLE}) "
                "to run on the Neural Engine",
                ANE_STATE_SOURCE,
            )
        )
    if head_dim % NEURAL_ENGINE_STATE_MULTIPLE:
        findings.append(
            Finding(
                "ane-state-multiple", where,
                f"head_dim {head_dim} (the width of keyCache/valueCache) is not a multiple of {NEURAL_ENGINE_STATE_MULTIPLE}",
                "expect this model's states to run on CPU/GPU only; the width comes from the base and cannot be changed here",
                ANE_STATE_SOURCE,
            )
        )
    return findings


def _array(feature) -> tuple[int, list[int]]:
    array = feature.type.multiArrayType
    return array.dataType, list(array.shape)


def _ranges(feature) -> list[tuple[int, int]] | None:
    """(lower, upper) per dimension of a flexible input; None when the shape is fixed."""
    array = feature.type.multiArrayType
    if array.WhichOneof("ShapeFlexibility") != "shapeRange":
        return None
    return [(int(r.lowerBound), int(r.upperBound)) for r in array.shapeRange.sizeRanges]


def _output_rank(spec, function: str, name: str) -> int | None:
    """The rank the ML Program declares for output ``name`` (the description leaves flexible
    outputs unshaped)."""
    program = spec.mlProgram.functions.get(function) if spec.WhichOneof("Type") == "mlProgram" else None
    if program is None:
        return None
    block = program.block_specializations[program.opset]
    for op in block.operations:
        for output in op.outputs:
            if output.name == name and output.type.WhichOneof("type") == "tensorType":
                return int(output.type.tensorType.rank)
    return None


def _function_findings(spec, description, function: str) -> Iterable[Finding]:
    """The swift-transformers contract and Core ML's state rules for one function."""
    where = f"function {function}"
    inputs = {f.name: f for f in description.input}
    outputs = {f.name: f for f in description.output}
    states = {s.name: s for s in description.state}

    def contract(problem: str, fix: str) -> Finding:
        return Finding("swift-contract", where, problem, fix, SWIFT_CLIENT_SOURCE)

    missing_states = [name for name in ("keyCache", "valueCache") if name not in states]
    if missing_states:
        yield contract(
            f"no state {' / '.join(missing_states)}: the client uses LanguageModelWithStatefulKVCache only "
            "when both keyCache and valueCache exist",
            "export with adapterpack's stateful decoder",
        )
    for name, state in states.items():
        array = state.type.stateType.arrayType
        if array.dataType != FLOAT16:
            yield Finding(
                "state-float16", where, f"state {name} is not float16", "Core ML states must be float16",
                CORE_ML_STATE_SOURCE,
            )
        last = int(array.shape[-1]) if array.shape else 0
        if last % NEURAL_ENGINE_STATE_MULTIPLE:
            yield Finding(
                "ane-state-multiple", where,
                f"state {name} {tuple(int(d) for d in array.shape)} has a last dimension {last} that is not a "
                f"multiple of {NEURAL_ENGINE_STATE_MULTIPLE}",
                "size it to a multiple of 32 (max_context) to run on the Neural Engine",
                ANE_STATE_SOURCE,
            )

    ids = inputs.get("inputIds")
    if ids is None:
        yield contract("no input inputIds", "export with adapterpack's stateful decoder")
    else:
        dtype, shape = _array(ids)
        ranges = _ranges(ids)
        if dtype != INT32 or len(shape) != 2:
            yield contract("inputIds must be int32 of shape (1, q)", "export with adapterpack's stateful decoder")
        elif ranges is None or ranges[-1][1] - ranges[-1][0] <= 1:
            yield contract(
                "inputIds' query length is not a range wider than 2 (the client stops with 'Expecting ranged query "
                "sequence length.')",
                "export with a RangeDim query length and max_context >= 3",
            )
    mask = inputs.get("causalMask")
    if mask is not None:
        dtype, shape = _array(mask)
        ranges = _ranges(mask)
        if dtype != FLOAT16 or len(shape) != 4:
            yield contract("causalMask must be float16 of rank 4", "export with adapterpack's stateful decoder")
        elif ranges is None or ranges[2][0] > 1:
            yield contract(
                "causalMask must accept one query row: the client always sends (1, 1, 1, tokenCount + 1)",
                "export with a flexible query axis on causalMask",
            )
    logits = outputs.get("logits")
    if logits is None:
        yield contract("no output logits", "name the output logits")
    else:
        shape = list(logits.type.multiArrayType.shape)
        rank = len(shape) if shape else _output_rank(spec, function, "logits")
        if rank is not None and rank != 3:
            yield contract(
                f"logits must have rank 3 (1, q, vocab), not {rank}: the client asserts it", "export logits as (1, q, vocab)"
            )


def package_findings(spec) -> list[Finding]:
    """Every device rule this module knows, checked on a package's spec (all functions)."""
    findings: list[Finding] = []
    functions = list(spec.description.functions)
    if len(functions) > 1 and spec.specificationVersion < IOS18_SPECIFICATION:
        findings.append(
            Finding(
                "multifunction-ios18", "package", f"{len(functions)} functions in specification version "
                f"{spec.specificationVersion}", "build for iOS18 or later", MULTIFUNCTION_SOURCE,
            )
        )
    described = functions or [spec.description]
    for description in described:
        name = getattr(description, "name", "") or "main"
        findings.extend(_function_findings(spec, description, name))
    return findings
