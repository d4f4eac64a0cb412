"""Export the decoder with ``torch.export`` and write every function into ONE Core AI ``.aimodel``.

The same export wrapper as the ``.mlpackage`` (``ExportDecoder``): inputs ``inputIds`` int32
(1, q) and ``causalMask`` (1, 1, q, end), states ``keyCache``/``valueCache``/``writtenSlots``,
output ``logits``; an app switches formats without changing its calling code. All functions are
added to one converter session and converted together: bit-identical constants (the base's
weights, compressed once) are stored once in the asset.

Core AI keeps no upper bound on a dynamic dimension (it becomes ``?``), and ``torch.export``
specialises a cache slice whose end may equal the cache length (``cache[..., :end, :]`` with
``end == max_context`` is the whole buffer). The asset's cache therefore has one slot more than
``max_context``, which no call reaches: a request up to ``max_context`` tokens, either mask
convention, reads and writes exactly what the ``.mlpackage`` does.

    session = AssetSession(max_context=512)
    session.add("code", model)          # once per function, the model as it should run
    session.save(Path("demo.aimodel"), metadata={...})
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn import functional as F

from adapterpack.convert.export_decoder import CAUSAL_MASK, INPUT_IDS, LOGITS, STATE_NAMES, AppleDecoder, ExportDecoder
from adapterpack.errors import BadInput
from adapterpack.formats.aimodel.asset import EXTRA_MISSING, METADATA_FILE, METADATA_KEY
from adapterpack.quiet import captured_output

log = logging.getLogger(__name__)

# Core AI assets need iOS/macOS 27 (OSVersion.v27): the only value this format is written for.
MINIMUM_OS = "v27"
# Apple's contract (export.contract: apple), names as Apple's exporter gives them
# (apple/coreai-models 86b363d, python/src/coreai_models/models/base.py, export_*_names); the
# Swift engines take inputs and outputs by position and bind every state by its name.
APPLE_INPUTS = ("input_ids", "position_ids")
APPLE_STATES = ("key_cache", "value_cache")
APPLE_OUTPUTS = ("logits",)
# (inputs, states, outputs) each contract's functions declare, in order.
SIGNATURES = {
    "swift-transformers": ((INPUT_IDS, CAUSAL_MASK), tuple(STATE_NAMES), (LOGITS,)),
    "apple": (APPLE_INPUTS, APPLE_STATES, APPLE_OUTPUTS),
}


def import_coreai_torch():
    try:
        with captured_output():
            from coreai_torch import converter
    except ImportError:
        raise BadInput(EXTRA_MISSING) from None
    return converter


class _Float32Linear(torch.nn.Module):
    """A float16 linear layer computing in float32 (its weight stays stored as float16)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:  # peft reads its LoRA layers' weight dtype
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.linear.bias
        return F.linear(x.float(), self.linear.weight.float(), None if bias is None else bias.float())


class _Float32Output(torch.nn.Module):
    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x).float()


@contextmanager
def swapped_modules(model: torch.nn.Module, replacements: dict[str, torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """``model`` with each named submodule replaced; the originals are back on exit."""
    swapped = []
    try:
        for name, replacement in replacements.items():
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            swapped.append((parent, attribute, getattr(parent, attribute)))
            setattr(parent, attribute, replacement)
        yield model
    finally:
        for parent, attribute, module in reversed(swapped):
            setattr(parent, attribute, module)


def float32_compute(model: torch.nn.Module):
    """``model`` computing in float32 from its float16 weights (a context manager): every linear
    layer upcasts its weight as it runs and the embedding's output is float32 (norms then stay
    float32 too)."""
    replacements: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            replacements[name] = _Float32Linear(module)
        elif name.endswith("embed_tokens"):
            replacements[name] = _Float32Output(module)
    return swapped_modules(model, replacements)


def export_program(
    model: torch.nn.Module,
    *,
    max_context: int,
    settle=lambda tensor: tensor.detach().clone(),
    compute: str = "float16",
    contract: str = "swift-transformers",
):
    """``torch.export`` of the decoder over ``model`` for 1..max_context tokens per call, under
    ``contract``.

    The program refers to the model's parameters, which fusing the next adapter changes in
    place: ``settle(parameter)`` gives the tensor the program keeps instead (a copy).
    """
    if compute == "float32":
        with float32_compute(model):
            return export_program(model, max_context=max_context, settle=settle, contract=contract)
    # Logits are float16 whatever the compute precision: the contract's output type.
    # The model's own norms: coreai-torch keeps their float32 upcast, so massive activations do
    # not overflow there. On SmolLM2-135M (shout, float16 compute, Core AI's CPU runtime) the
    # scaled form gave cosine 0.9954 and this one 0.9971 against float32 peft; the rest of that
    # gap is the runtime's float16 arithmetic elsewhere, not the norms.
    if contract == "apple":
        decoder = AppleDecoder(model, max_context=max_context, logits_dtype=torch.float16, scaled_norms=False).eval()
        example, dynamic = _apple_example(decoder, max_context)
    else:
        decoder = ExportDecoder(
            model, max_context=max_context + 1, cache_dtype=torch.float16, logits_dtype=torch.float16, scaled_norms=False
        ).eval()
        tokens = torch.export.Dim("tokens", min=1, max=max_context)
        end = torch.export.Dim("end", min=1, max=max_context)
        # q > 1 and end > q, as for the .mlpackage's trace: neither is specialised away.
        example = (torch.zeros((1, 2), dtype=torch.int32), torch.zeros((1, 1, 2, min(5, max_context)), dtype=torch.float16))
        dynamic = {INPUT_IDS: {1: tokens}, CAUSAL_MASK: {2: tokens, 3: end}}
    with torch.no_grad(), captured_output():
        program = torch.export.export(decoder, example, dynamic_shapes=dynamic, strict=False).run_decompositions()
    for key, value in list(program.state_dict.items()):
        if isinstance(value, torch.nn.Parameter):
            program.state_dict[key] = settle(value)
    return program


def _apple_example(decoder: AppleDecoder, max_context: int):
    """Example arguments and dynamic dimensions of Apple's contract: token ids (1, q), position
    ids (1, end), caches (layers, 1, kv heads, capacity, head dim) float16 whose capacity the
    runtime chooses (``GrowingNDArrayState``: 256 first, doubled, at most max_context)."""
    shape = decoder.shape
    capacity = min(8, max_context)
    cache = (shape.n_layers, 1, shape.n_kv_heads, capacity, shape.head_dim)
    # q > 1, end > q and capacity > end, so that none of them is specialised away.
    example = (
        torch.zeros((1, 2), dtype=torch.int32),
        torch.arange(min(5, capacity - 1), dtype=torch.int32)[None],
        torch.zeros(cache, dtype=torch.float16),
        torch.zeros(cache, dtype=torch.float16),
    )
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    end = torch.export.Dim("end", min=1, max=max_context)
    slots = torch.export.Dim("slots", min=2, max=max_context)
    names = (*APPLE_INPUTS, *APPLE_STATES)
    return example, dict(zip(names, ({1: tokens}, {1: end}, {3: slots}, {3: slots})))


def stable_resource_names(program) -> int:
    """Name every weight blob of ``program`` by its content; returns how many constants were renamed.

    The converter names a blob by a hash seeded per process, and the name is written into the
    asset: two builds of the same inputs would differ in those bytes alone. A content-derived
    name makes the asset reproducible; identical blobs keep sharing one (one attribute per
    content). coreai-core exposes no blob reader but the one its own optimization passes use.
    """
    import math

    import numpy as np
    from coreai._compiler._mlir_libs._coreaiIR import _bindings
    from coreai._compiler.ir import DenseResourceElementsAttr, WalkResult

    named: dict[str, object] = {}
    renamed = 0

    def rename(op):
        nonlocal renamed
        if op.name != "coreai.constant" or "value" not in op.attributes:
            return WalkResult.ADVANCE
        if not DenseResourceElementsAttr.isinstance(op.attributes["value"]):
            return WalkResult.ADVANCE
        kind = op.result.type
        data = np.zeros(math.ceil(math.prod(kind.shape) * kind.element_type.width / 8), np.uint8)
        _bindings.compiler.copy_constant_value_to_array(constant_op=op, destination=data)
        digest = hashlib.sha256(memoryview(data))
        digest.update(str(kind).encode())
        key = digest.hexdigest()[:32]
        if key not in named:
            named[key] = DenseResourceElementsAttr.get_from_buffer(data, f"w{key}", kind, context=op.context)
        op.attributes["value"] = named[key]
        renamed += 1
        return WalkResult.ADVANCE

    program._module._mlir_module.operation.walk(rename)
    return renamed


class AssetSession:
    """One converter session: functions in, one ``.aimodel`` out."""

    def __init__(self, *, max_context: int, compute: str = "float16", contract: str = "swift-transformers"):
        self.max_context = int(max_context)
        self.compute = compute
        self.contract = contract
        converter = import_coreai_torch()
        # Release mode: operation ids only, no torch stack traces (file paths of this machine).
        self._converter = converter.TorchConverter(mode=converter.TorchConverter.Mode.RELEASE)
        self.functions: list[str] = []
        self._settled: dict[str, torch.Tensor] = {}

    def _settle(self, parameter: torch.Tensor) -> torch.Tensor:
        # One copy per distinct content: a base weight left uncompressed is held once, not once
        # per function.
        value = parameter.detach()
        digest = hashlib.sha256(memoryview(value.contiguous().reshape(-1).view(torch.uint8).numpy()))
        digest.update(f"{tuple(value.shape)}|{value.dtype}".encode())
        key = digest.hexdigest()
        if key not in self._settled:
            self._settled[key] = value.clone()
        return self._settled[key]

    def add(self, name: str, model: torch.nn.Module) -> None:
        program = export_program(
            model, max_context=self.max_context, settle=self._settle, compute=self.compute, contract=self.contract
        )
        inputs, states, outputs = SIGNATURES[self.contract]
        with captured_output():
            self._converter.add_exported_program(
                program, input_names=list(inputs), output_names=list(outputs), state_names=list(states), entrypoint_name=name
            )
        self.functions.append(name)

    def save(self, path: Path, *, metadata: dict, description: str = "") -> None:
        """Convert every function added and write the asset at ``path`` (a ``.aimodel`` folder)."""
        from coreai.authoring.asset import OSVersion
        from coreai_torch.debugging.debug_info import strip_debug_info

        with captured_output():
            program = self._converter.to_coreai()
            # What remains of debug info is op ids and source names: not needed to run, and not
            # part of what a release should depend on.
            strip_debug_info(program)
            stable_resource_names(program)
            asset = program.save_asset(path, minimum_os=getattr(OSVersion, MINIMUM_OS))

        def stamp(m) -> None:
            # No creation time: identical inputs give an identical asset (release reproducibility).
            m.creation_date = None
            m.model_description = description
            m.set_custom(METADATA_KEY, metadata)

        asset.update_metadata(stamp)
        # coreai-core writes the custom keys in no fixed order: rewrite the file with sorted keys.
        written = path / METADATA_FILE
        written.write_text(json.dumps(json.loads(written.read_text()), indent=2, sort_keys=True) + "\n")
