"""Where the bytes of a multifunction package go: per function, per tensor, per compression kind.

The merge stores a weight once when it is identical across functions, so the size of
the package on disk says neither what one function costs nor how much the sharing saved. This
module answers both from the package itself, with no Core ML runtime: it walks the weight blob
record by record and maps every record to the functions and constant ops (tensors) whose
``BlobFileValue`` names it. Every byte on disk is accounted for exactly once: record data, blob
headers and padding (``overhead_bytes``), and the other files (model spec, Manifest.json).

Weight blob format (coremltools ``mlmodel/src/MILBlob/Blob/StorageFormat.hpp``): a 64-byte header
(uint32 count, uint32 version = 2, reserved), then per record a 64-byte metadata block (uint32
sentinel 0xDEADBEEF, uint32 blob dtype, uint64 sizeInBytes, uint64 absolute data offset,
reserved) and the data, each starting on a 64-byte boundary. A ``BlobFileValue.offset`` in the
spec is the offset of the record's metadata block.

Where the spec references blobs (as coremltools' ``milproto/load.py`` reads them): in a const
op's ``attributes`` (``val``; iOS 16 constexpr ops keep all their tensors there) and in the
``inputs`` of iOS 18 constexpr ops, as arguments bound to a value rather than a name.

"Alone" size of a function, as defined here: what a package holding only that function would take
= the record data it references + the blob overhead those records need alone (64-byte file header,
64-byte metadata and alignment padding per record) + the bytes its function occupies in the model
spec (its program and its description, measured by removing it) + the non-weight bytes every
package carries whatever its functions (Manifest.json and the package-level part of the spec).
For a one-function package the alone size equals the package size, so the dedup ratio (sum of
alone sizes / actual size) is 1 there and grows with the sharing.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapterpack.config.device_rules import package_findings
from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.blob import HEADER_BYTES, BlobRecord, read_blob_records
from adapterpack.formats.mlpackage.spec import (
    MODEL_PATH_PREFIX,
    function_names_of_spec,
    load_spec_file,
    op_values,
    spec_path,
    value_dims,
    value_dtype_name,
    walk_ops,
)
from adapterpack.quiet import import_coreml_proto
from adapterpack.report.memory import ModelShape

UNREFERENCED = "unreferenced"


@dataclass
class _Use:
    """One op of one function that reads blob records (a stored tensor)."""

    function: str
    name: str
    op_type: str
    kind: str
    dtype: str
    shape: list[int | None]
    refs: list[tuple[str, str, int, str]]  # (parameter, file, offset, dtype)


@dataclass
class TensorReport:
    """A stored tensor: the records one constant op reads, with every op/function that reads them."""

    names: list[str]
    functions: list[str]
    bytes: int
    dtype: str  # of the tensor the op produces (e.g. float16 for a palettized weight)
    shape: list[int | None]
    kind: str  # float16, palettized 4-bit, linear int8, sparse, ...
    storage: list[str]  # "parameter: stored dtype" per record, e.g. "indices: uint4"


@dataclass
class FunctionReport:
    name: str
    unique_bytes: int  # record data only this function reads
    shared_bytes: int  # record data it reads that other functions read too
    referenced_bytes: int  # unique + shared
    overhead_bytes: int  # blob headers and padding its records would need in a package of their own
    spec_bytes: int  # bytes of its program and description in the model spec
    alone_bytes: int  # see the module docstring
    bytes_by_kind: dict[str, int]
    tensors: int
    default: bool = False


@dataclass
class PackageReport:
    path: Path
    default_function: str
    functions: list[FunctionReport]
    tensors: list[TensorReport]  # largest first
    files: dict[str, int]  # every file of the package -> bytes on disk
    weight_files: list[str]
    weight_data_bytes: int  # sum of sizeInBytes over all records
    overhead_bytes: int  # file headers + record metadata + padding
    shared_bytes: int  # data of records read by two or more functions, counted once
    unreferenced_bytes: int  # data of records no function reads
    bytes_by_kind: dict[str, int]  # record data by compression kind, each record once
    records: int
    shape: ModelShape | None = None
    device_findings: list = field(default_factory=list)  # device_rules.Finding: rules the package breaks

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def weight_bytes(self) -> int:
        return sum(self.files[name] for name in self.weight_files)

    @property
    def other_files(self) -> dict[str, int]:
        return {name: size for name, size in self.files.items() if name not in self.weight_files}

    @property
    def other_bytes(self) -> int:
        return self.total_bytes - self.weight_bytes

    @property
    def common_bytes(self) -> int:
        """Non-weight bytes no single function owns (Manifest.json, the spec's package-level part)."""
        return self.other_bytes - sum(f.spec_bytes for f in self.functions)

    @property
    def sum_alone_bytes(self) -> int:
        return sum(f.alone_bytes for f in self.functions)

    @property
    def dedup_ratio(self) -> float:
        return self.sum_alone_bytes / self.total_bytes if self.total_bytes else 1.0

    def function(self, name: str) -> FunctionReport:
        for report in self.functions:
            if report.name == name:
                return report
        raise KeyError(name)

    @property
    def largest_function(self) -> FunctionReport:
        """The function that references the most weight bytes (what an app loads at most)."""
        return max(self.functions, key=lambda f: f.referenced_bytes)

    def largest(self, n: int) -> list[TensorReport]:
        return self.tensors[: max(n, 0)]

    def as_json(self, top: int | None = None) -> dict[str, Any]:
        """Machine-readable report; ``top`` limits ``largest_tensors`` (all tensors are under ``tensors``)."""
        return {
            "package": str(self.path),
            "default_function": self.default_function,
            "total_bytes": self.total_bytes,
            "weight_bytes": self.weight_bytes,
            "weight_data_bytes": self.weight_data_bytes,
            "overhead_bytes": self.overhead_bytes,
            "other_bytes": self.other_bytes,
            "other_files": self.other_files,
            "weight_files": {name: self.files[name] for name in self.weight_files},
            "records": self.records,
            "shared_bytes": self.shared_bytes,
            "unreferenced_bytes": self.unreferenced_bytes,
            "common_bytes": self.common_bytes,
            "sum_alone_bytes": self.sum_alone_bytes,
            "dedup_ratio": self.dedup_ratio,
            "bytes_by_kind": self.bytes_by_kind,
            "functions": [asdict(f) for f in self.functions],
            "largest_tensors": [asdict(t) for t in (self.tensors if top is None else self.largest(top))],
            "tensors": [asdict(t) for t in self.tensors],
            "shape": asdict(self.shape) if self.shape else None,
            "device_rules": [asdict(f) for f in self.device_findings],
        }


def inspect_package(package: Path | str) -> PackageReport:
    """Account for every byte of a ``.mlpackage``; BadInput when it is missing or unreadable."""
    package = Path(package)
    if not package.exists():
        raise BadInput(f"{package}: package not found")
    if not package.is_dir():
        raise BadInput(f"{package}: not a .mlpackage folder")
    spec_file = spec_path(package)
    spec = load_spec_file(spec_file)
    if spec.WhichOneof("Type") != "mlProgram":
        raise BadInput(f"{package}: not an ML Program (model type {spec.WhichOneof('Type')})")
    model_folder = spec_file.parent

    function_names = function_names_of_spec(spec)
    default = spec.description.defaultFunctionName or function_names[0]
    uses = [use for name in function_names for use in _blob_uses(spec, name, package, model_folder)]

    files = {
        path.relative_to(package).as_posix(): path.stat().st_size
        for path in sorted(package.rglob("*"))
        if path.is_file()
    }
    referenced_files = sorted({ref[1] for use in uses for ref in use.refs})
    records: dict[tuple[str, int], BlobRecord] = {}
    weight_files: list[str] = []
    for name in referenced_files:
        if name not in files:
            raise BadInput(f"{package}: the model references {name}, which is missing")
        records.update({(name, r.offset): r for r in read_blob_records(package, name)})
        weight_files.append(name)
    weights_folder = (model_folder / "weights").relative_to(package).as_posix() + "/"
    for name in files:
        # A blob file no function names is still weight storage: count it as such when it parses.
        if name.startswith(weights_folder) and name not in weight_files:
            try:
                found = read_blob_records(package, name)
            except BadInput:
                continue
            records.update({(name, r.offset): r for r in found})
            weight_files.append(name)

    for use in uses:
        for parameter, file, offset, _ in use.refs:
            record = records.get((file, offset))
            if record is None:
                raise BadInput(
                    f"{package}: {use.function}/{use.name} ({parameter}) points at byte {offset} of {file}, "
                    "where no weight record starts"
                )
            record.functions.add(use.function)
            record.names.add(use.name)
            record.kind_by_function.setdefault(use.function, use.kind)

    functions = _function_reports(spec, function_names, default, records, uses, files, weight_files)
    data_bytes = sum(r.size for r in records.values())
    by_kind: dict[str, int] = defaultdict(int)
    for record in records.values():
        kind = next(iter(record.kind_by_function.values()), UNREFERENCED)
        by_kind[kind] += record.size
    return PackageReport(
        path=package,
        default_function=default,
        functions=functions,
        tensors=_tensor_reports(uses, records),
        files=files,
        weight_files=weight_files,
        weight_data_bytes=data_bytes,
        # Counted from the parsed layout (not as file size minus data), so the sum is a real check.
        overhead_bytes=HEADER_BYTES * len(weight_files) + sum(r.overhead for r in records.values()),
        shared_bytes=sum(r.size for r in records.values() if len(r.functions) > 1),
        unreferenced_bytes=sum(r.size for r in records.values() if not r.functions),
        bytes_by_kind=dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        records=len(records),
        shape=_model_shape(spec, default),
        device_findings=package_findings(spec),
    )


def _nbits(dtype: str) -> int | None:
    match = re.fullmatch(r"u?int(\d+)", dtype)
    return int(match.group(1)) if match else None


def _kind(op, values: dict[str, Any]) -> str:
    """Compression kind of a constant op: float16, palettized N-bit, linear intN, sparse, ..."""
    op_type = op.type

    def dtype(parameter: str) -> str:
        return value_dtype_name(values[parameter].type) if parameter in values else "?"

    if op_type == "const":
        return dtype("val")
    if op_type == "constexpr_lut_to_dense":
        if "shape" in values:  # iOS 16 form: indices packed into uint8, a per-tensor lut of 2**n entries
            entries = math.prod(d or 1 for d in value_dims(values["lut"].type)) if "lut" in values else 0
            bits = int(math.log2(entries)) if entries > 1 else None
        else:  # iOS 18 form: the indices carry their bit width (uint4, uint6, ...)
            bits = _nbits(dtype("indices"))
        return f"palettized {bits}-bit" if bits else "palettized"
    if op_type == "constexpr_blockwise_shift_scale":
        return f"linear {dtype('data')}"
    if op_type == "constexpr_affine_dequantize":
        return f"linear {dtype('quantized_data')}"
    if op_type == "constexpr_sparse_to_dense":
        return "sparse"
    if op_type == "constexpr_lut_to_sparse":
        bits = _nbits(dtype("indices_nonzero"))
        return f"sparse + palettized {bits}-bit" if bits else "sparse + palettized"
    if op_type == "constexpr_sparse_blockwise_shift_scale":
        return f"sparse + linear {dtype('nonzero_data')}"
    if op_type == "constexpr_cast":
        return f"{dtype('source_val')} (cast)"
    return op_type


def _blob_file(file_name: str, package: Path, model_folder: Path) -> str:
    """Package-relative path of the blob a BlobFileValue names (``@model_path/weights/weight.bin``)."""
    relative = file_name[len(MODEL_PATH_PREFIX):] if file_name.startswith(MODEL_PATH_PREFIX) else file_name
    return (model_folder / relative).relative_to(package).as_posix()


def _blob_uses(spec, function: str, package: Path, model_folder: Path) -> list[_Use]:
    uses = []
    program = spec.mlProgram.functions[function]
    for block in program.block_specializations.values():
        for op in walk_ops(block):
            values = dict(op_values(op))
            refs = [
                (name, _blob_file(value.blobFileValue.fileName, package, model_folder),
                 int(value.blobFileValue.offset), value_dtype_name(value.type))
                for name, value in op_values(op)
                if value.WhichOneof("value") == "blobFileValue"
            ]
            if not refs:
                continue
            output = op.outputs[0] if op.outputs else None
            uses.append(
                _Use(
                    function=function,
                    name=output.name if output else op.type,
                    op_type=op.type,
                    kind=_kind(op, values),
                    dtype=value_dtype_name(output.type) if output else "?",
                    shape=value_dims(output.type) if output else [],
                    refs=refs,
                )
            )
    return uses


def _spec_bytes_by_function(spec, names: list[str]) -> dict[str, int]:
    """Bytes the spec would shrink by without each function (its program and its description)."""

    Model_pb2 = import_coreml_proto().Model_pb2  # noqa: N806 (the generated module's name)
    full = spec.ByteSize()
    sizes = {}
    for name in names:
        reduced = Model_pb2.Model()
        reduced.CopyFrom(spec)
        del reduced.mlProgram.functions[name]
        described = [i for i, f in enumerate(reduced.description.functions) if f.name == name]
        for index in reversed(described):
            del reduced.description.functions[index]
        sizes[name] = full - reduced.ByteSize()
    return sizes


def _function_reports(
    spec,
    names: list[str],
    default: str,
    records: dict[tuple[str, int], BlobRecord],
    uses: list[_Use],
    files: dict[str, int],
    weight_files: list[str],
) -> list[FunctionReport]:
    spec_bytes = _spec_bytes_by_function(spec, names)
    weight_total = sum(files[name] for name in weight_files)
    # What every function alone would carry whatever it holds: the non-weight files minus the
    # parts of the spec that belong to one function.
    common = sum(files.values()) - weight_total - sum(spec_bytes.values())
    tensors_by_function: dict[str, set] = defaultdict(set)
    for use in uses:
        tensors_by_function[use.function].add(tuple(sorted((ref[1], ref[2]) for ref in use.refs)))
    reports = []
    for name in names:
        mine = [r for r in records.values() if name in r.functions]
        unique = sum(r.size for r in mine if len(r.functions) == 1)
        shared = sum(r.size for r in mine if len(r.functions) > 1)
        overhead = HEADER_BYTES * len({r.file for r in mine}) + sum(r.overhead for r in mine)
        by_kind: dict[str, int] = defaultdict(int)
        for record in mine:
            by_kind[record.kind_by_function[name]] += record.size
        reports.append(
            FunctionReport(
                name=name,
                unique_bytes=unique,
                shared_bytes=shared,
                referenced_bytes=unique + shared,
                overhead_bytes=overhead,
                spec_bytes=spec_bytes[name],
                alone_bytes=unique + shared + overhead + spec_bytes[name] + common,
                bytes_by_kind=dict(sorted(by_kind.items(), key=lambda item: -item[1])),
                tensors=len(tensors_by_function[name]),
                default=name == default,
            )
        )
    return reports


def _tensor_reports(uses: list[_Use], records: dict[tuple[str, int], BlobRecord]) -> list[TensorReport]:
    """One entry per distinct set of records an op reads, however many ops/functions read it."""
    grouped: dict[tuple, TensorReport] = {}
    for use in uses:
        key = tuple(sorted((ref[1], ref[2]) for ref in use.refs))
        tensor = grouped.get(key)
        if tensor is None:
            tensor = TensorReport(
                names=[],
                functions=[],
                bytes=sum(records[k].size for k in key),
                dtype=use.dtype,
                shape=use.shape,
                kind=use.kind,
                storage=[f"{parameter}: {dtype}" for parameter, _, _, dtype in use.refs],
            )
            grouped[key] = tensor
        if use.name not in tensor.names:
            tensor.names.append(use.name)
        if use.function not in tensor.functions:
            tensor.functions.append(use.function)
    return sorted(grouped.values(), key=lambda t: (-t.bytes, t.names[0]))


# Bytes per element of a state's ArrayFeatureType data type (FLOAT16, FLOAT32).
_STATE_DTYPE_BYTES = {65552: 2, 65568: 4}


def _model_shape(spec, function: str) -> ModelShape | None:
    """Layers, kv heads, head_dim and max_context from the keyCache state; vocab/hidden when readable.

    keyCache is (layers, 1, kv_heads, max_context, head_dim), the layout convert.export_decoder writes.
    """
    description = next((f for f in spec.description.functions if f.name == function), spec.description)
    states = {s.name: s for s in description.state}
    key_cache = states.get("keyCache")
    if key_cache is None:
        return None
    array = key_cache.type.stateType.arrayType
    dims = list(array.shape)
    if len(dims) != 5:
        return None
    dtype_bytes = _STATE_DTYPE_BYTES.get(array.dataType, 2)
    other = 0
    for name, state in states.items():
        if name not in ("keyCache", "valueCache"):
            array_type = state.type.stateType.arrayType
            other += math.prod(int(d) for d in array_type.shape) * _STATE_DTYPE_BYTES.get(array_type.dataType, 2)
    shape = ModelShape(
        n_layers=int(dims[0]), n_kv_heads=int(dims[2]), head_dim=int(dims[4]), max_context=int(dims[3]),
        kv_dtype_bytes=dtype_bytes, other_state_bytes=other,
    )
    _read_decoder_sizes(spec, function, shape)
    return shape


def _read_decoder_sizes(spec, function: str, shape: ModelShape) -> None:
    """vocab (logits' last dim), hidden (the logits projection's weight), heads and MLP width from the program."""
    program = spec.mlProgram.functions[function]
    block = next(iter(program.block_specializations.values()), None)
    if block is None or not block.outputs:
        return
    producers = {}
    for op in walk_ops(block):
        for output in op.outputs:
            producers[output.name] = op
    logits_name = "logits" if "logits" in producers else block.outputs[0]
    logits_op = producers.get(logits_name)
    if logits_op is not None:
        vocab = value_dims(logits_op.outputs[0].type)[-1:] or [None]
        shape.vocab = vocab[0]
        weight = logits_op.inputs.get("weight")
        if weight is not None and weight.arguments and weight.arguments[0].WhichOneof("binding") == "name":
            weight_op = producers.get(weight.arguments[0].name)
            if weight_op is not None:
                dims = [d for d in value_dims(weight_op.outputs[0].type) if d is not None]
                others = [d for d in dims if d != shape.vocab]
                if len(dims) == 2 and others:
                    shape.hidden = others[0]
    widths = []
    for op in walk_ops(block):
        if op.type == "scaled_dot_product_attention" and op.outputs:
            dims = value_dims(op.outputs[0].type)
            if len(dims) == 4 and dims[1]:
                shape.n_heads = dims[1]
        if op.type == "linear" and op is not logits_op and op.outputs:
            last = value_dims(op.outputs[0].type)[-1:]
            if last and last[0]:
                widths.append(last[0])
    # The widest projection other than the logits is the MLP's intermediate size in every supported family.
    if widths:
        shape.intermediate = max(widths)
