"""Compress a converted program record by record, without coremltools loading it.

coremltools' ``palettize_weights`` loads the whole program (every weight in memory), counts the
unique values of each weight, builds new ops in Python and serializes everything again: for a 3B
model that is its 6 GB of float16 weights held twice and most of an hour. What it produces is
simple, though: each compressed ``const`` becomes a ``constexpr_lut_to_dense`` named like it
plus ``_palettized``, in the same place, reading its packed indices and its palette from two
blob records; every other record is copied. ``linear_quantize_weights`` likewise makes each a
``constexpr_blockwise_shift_scale`` named ``_quantized``, reading its integers and its float16
scales. This module writes exactly that (tests compare it byte for byte with coremltools'
output): the spec is edited in place and the blob is streamed, each weight read from the source
blob, compressed and written before the next one is read. The k-means of the next weights runs
on the other core meanwhile. Linear integers are coremltools' own, or error-compensated ones
with calibration text (``compress.quantize``).

Anything this does not handle the way coremltools would (a weight coremltools splits otherwise,
a non-float16 weight it would compress, a scale small enough to be stored inline) returns False
before writing, and the caller compresses with coremltools instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapterpack.compress.palettes import PaletteStore, grouped_rows, pack_bits
from adapterpack.compress.quantize import pack_signed, stored_quantized
from adapterpack.config.compression import Compression
from adapterpack.formats.mlpackage.blob import BlobWriter, record_metadata
from adapterpack.formats.mlpackage.spec import MODEL_PATH_PREFIX, load_spec_file, op_values, spec_path, walk_ops
from adapterpack.quiet import import_coreml_proto

# (weight name, shape) -> its compression, None when it stays float16 (config.compression.weight_setting).
SettingOf = Callable[[str, tuple[int, ...]], Compression | None]

log = logging.getLogger(__name__)

# The ops whose weights coremltools reads as (output channels, input channels) when it picks
# linear quantization's blocks (``optimize._utils.select_input_output_channel_axis``); a weight
# any other op reads is left to coremltools.
LINEAR_LAYOUT_READERS = frozenset({"linear", "gather"})
# coremltools stores a constant of fewer values than this inline in the spec, not in the blob.
INLINE_VALUES = 10


@dataclass
class _Weight:
    """One const op to compress: where it is, its shape, and where its value lies in the source blob."""

    block: object  # the proto Block holding it
    position: int  # index in block.operations
    name: str
    shape: tuple[int, ...]
    file: str  # BlobFileValue.fileName
    offset: int
    setting: Compression  # its own (config.compression.weight_setting: per-layer exceptions apply)


def _op_name(op) -> str:
    named = op.attributes.get("name")
    if named is not None and named.immediateValue.tensor.strings.values:
        return named.immediateValue.tensor.strings.values[0]
    return op.outputs[0].name


def _blocks(spec) -> Iterator[object]:
    for function in spec.mlProgram.functions.values():
        yield from function.block_specializations.values()


def _readers(spec) -> dict[str, set[str]]:
    """Each value's name -> the types of the ops that read it (nested blocks included)."""
    readers: dict[str, set[str]] = {}
    for block in _blocks(spec):
        for op in walk_ops(block):
            for argument in op.inputs.values():
                for binding in argument.arguments:
                    if binding.WhichOneof("binding") == "name":
                        readers.setdefault(binding.name, set()).add(op.type)
    return readers


def _weights_to_compress(spec, setting_of: SettingOf) -> list[_Weight] | None:
    """The const ops stored in the blob that ``setting_of(name, shape)`` compresses (the rule of
    ``config.compression.weight_setting``), or None when one of them is not something this module
    writes the way coremltools does."""
    data_types = import_coreml_proto().MIL_pb2.DataType
    weights: list[_Weight] = []
    readers: dict[str, set[str]] | None = None
    for block in _blocks(spec):
        for position, op in enumerate(block.operations):
            if op.type != "const":
                continue
            value = op.attributes["val"]
            if value.WhichOneof("value") != "blobFileValue":
                continue
            tensor = value.type.tensorType
            if any(d.WhichOneof("dimension") != "constant" for d in tensor.dimensions):
                return None
            shape = tuple(d.constant.size for d in tensor.dimensions)
            name = _op_name(op)
            setting = setting_of(name, shape)
            if setting is None:
                continue
            if tensor.dataType != data_types.FLOAT16:
                log.debug("%s: %s weight: compressing through coremltools", name, tensor.dataType)
                return None
            if setting.method == "linear":
                readers = _readers(spec) if readers is None else readers
                if not _quantizes_here(shape, setting, readers.get(op.outputs[0].name, set())):
                    log.debug("%s: %s weight of shape %s: quantizing through coremltools", name, setting.granularity, shape)
                    return None
                file = value.blobFileValue
                weights.append(_Weight(block, position, name, shape, file.fileName, file.offset, setting))
                continue
            if setting.method != "palettize":
                return None
            rows = shape[0] if setting.granularity == "per_tensor" else setting.group_size
            # coremltools stores a palette of fewer than 10 values inline, not in the blob
            small_palette = (shape[0] // rows if rows else 0) << setting.nbits < 10
            if not rows or shape[0] % rows or small_palette:
                log.debug("%s: %s weight of shape %s: palettizing through coremltools", name, tensor.dataType, shape)
                return None
            file = value.blobFileValue
            weights.append(_Weight(block, position, name, shape, file.fileName, file.offset, setting))
    return weights


def _quantizes_here(shape: tuple[int, ...], setting: Compression, readers: set[str]) -> bool:
    """Whether a linear-quantized weight is laid out as this module writes it: a matrix read as
    (output, input) channels, blocks tiling its inputs, its scales stored in the blob."""
    if len(shape) != 2 or not readers or not readers <= LINEAR_LAYOUT_READERS:
        return False
    if setting.granularity == "per_block":
        return shape[1] % setting.block_size == 0 and shape[0] * (shape[1] // setting.block_size) >= INLINE_VALUES
    return setting.granularity == "per_channel" and shape[0] >= INLINE_VALUES


def index_blob_dtype(nbits: int) -> str:
    """The blob data type of ``nbits``-bit palette indices (uint8 for 8 bits, else uintN)."""
    return "uint8" if nbits == 8 else f"uint{nbits}"


def pack_indices(indices: np.ndarray, nbits: int) -> np.ndarray:
    """Palette indices packed ``nbits`` each, least significant bits first (the blob's uintN
    layout, as coremltools' ``pack_elements_into_bits``), as uint8."""
    if 8 % nbits:
        from coremltools.optimize._utils import pack_elements_into_bits

        return pack_elements_into_bits(np.ascontiguousarray(indices, dtype=np.uint8).reshape(-1), nbits)
    return pack_bits(indices, nbits)


def _local_path(package: Path, file_name: str) -> Path:
    if not file_name.startswith(MODEL_PATH_PREFIX):
        raise ValueError(f"weight file {file_name} is not inside the package")
    return spec_path(package).parent / file_name[len(MODEL_PATH_PREFIX) :]


def compress_program(
    source: Path,
    target: Path,
    compression: Compression,
    palettes: PaletteStore,
    *,
    setting_of: SettingOf,
    progress: Callable[[int, int], None] | None = None,
) -> bool:
    """Write ``target``: the program of package ``source`` with its weights compressed as
    ``compression`` says (``setting_of(name, shape)``: each weight's own setting, None for weights
    left alone), exactly as coremltools would (linear integers error-compensated where
    ``palettes``' importance has their layer's Gram). Returns False, writing nothing, when
    coremltools has to do it instead.

    ``progress(done, total)``: weight values written so far, after each weight.
    """
    spec = load_spec_file(spec_path(source))
    weights = _weights_to_compress(spec, setting_of)
    if weights is None:
        return False
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=lambda folder, names: [n for n in names if n.endswith(".bin")])
    try:
        _write(source, target, spec, weights, palettes, progress)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    log.debug("compressed %d weights (%s)", len(weights), compression.describe())
    return True


def _write(source, target, spec, weights, palettes, progress) -> None:
    proto = import_coreml_proto().MIL_pb2
    by_place = {(id(w.block), w.position): i for i, w in enumerate(weights)}
    writers: dict[str, BlobWriter] = {}
    copied: dict[tuple[str, int], int] = {}

    def raw(file_name: str, offset: int) -> tuple[str, np.ndarray]:
        # Read, not memory-mapped: mapped pages of a 6 GB source blob would all count as this
        # process's memory by the end; read records are freed once written.
        with _local_path(source, file_name).open("rb") as handle:
            _, dtype, data_offset, size = record_metadata(handle, offset)
            handle.seek(data_offset)
            return dtype, np.fromfile(handle, dtype=np.uint8, count=size)

    def writer(file_name: str) -> BlobWriter:
        if file_name not in writers:
            path = _local_path(target, file_name)
            path.parent.mkdir(parents=True, exist_ok=True)
            writers[file_name] = BlobWriter(path)
        return writers[file_name]

    def value_of(weight: _Weight) -> np.ndarray:
        _, data = raw(weight.file, weight.offset)
        return data.view(np.float16).reshape(weight.shape)

    palettized = [w for w in weights if w.setting.method == "palettize"]
    done, total = 0, sum(math.prod(w.shape) for w in weights)
    clustered = palettes.in_order(
        [math.prod(w.shape) for w in palettized],
        lambda index: grouped_rows(value_of(palettized[index]), palettized[index].setting),
        lambda index: palettized[index].setting.nbits,
        named=lambda index: (palettized[index].name, palettized[index].shape),
    )
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [w.close() for w in writers.values()])
        stack.callback(clustered.close)
        for block in _blocks(spec):
            renamed: dict[str, str] = {}
            for position, op in enumerate(block.operations):
                _rename_inputs(op, renamed)
                index = by_place.get((id(block), position))
                if index is None:
                    for inner in op.blocks:
                        _rename_inside(inner, renamed)
                    for held in [op, *(o for inner in op.blocks for o in walk_ops(inner))]:
                        for _, value in op_values(held):
                            if value.WhichOneof("value") == "blobFileValue":
                                key = (value.blobFileValue.fileName, value.blobFileValue.offset)
                                if key not in copied:
                                    copied[key] = writer(key[0]).write(*raw(*key))
                                value.blobFileValue.offset = copied[key]
                    continue
                weight = weights[index]
                if weight.setting.method == "linear":
                    replacement = _quantized_op(proto, weight, value_of(weight), writer(weight.file), palettes)
                else:
                    replacement = _palettized_op(proto, weight, next(clustered), writer(weight.file))
                output = op.outputs[0]
                compressed = replacement.outputs[0].name
                renamed[output.name] = compressed
                replacement.outputs[0].type.CopyFrom(output.type)
                name = replacement.attributes["name"]
                name.type.tensorType.dataType = proto.DataType.STRING
                name.immediateValue.tensor.strings.values.append(compressed)
                op.CopyFrom(replacement)
                done += math.prod(weight.shape)
                if progress is not None:
                    progress(done, total)
            _rename_outputs(block, renamed)
    # coremltools does not carry the program's buildInfo attribute through its reload: neither
    # does this, so both ways give the same program.
    spec.mlProgram.attributes.pop("buildInfo", None)
    spec_path(target).write_bytes(spec.SerializeToString())


def palettized_records(luts: np.ndarray, indices: np.ndarray, nbits: int) -> list[tuple[str, np.ndarray]]:
    """The blob records of a palettized weight, in order: (blob dtype, values) of its packed
    indices and its float16 palettes (also what a fused weight's patch looks for)."""
    return [(index_blob_dtype(nbits), pack_indices(indices, nbits)), ("float16", np.ascontiguousarray(luts, dtype=np.float16))]


def quantized_records(data: np.ndarray, scale: np.ndarray, nbits: int) -> list[tuple[str, np.ndarray]]:
    """The blob records of a linear-quantized weight, in order: its packed integers and its
    float16 scales."""
    return [(f"int{nbits}", pack_signed(data, nbits)), ("float16", np.ascontiguousarray(scale, dtype=np.float16))]


def _palettized_op(proto, weight: _Weight, palettes, blob: BlobWriter):
    """A ``constexpr_lut_to_dense`` for ``weight``, its indices and palettes written to ``blob``."""
    luts, indices = palettes
    (index_dtype, packed), (_, lut) = palettized_records(luts, indices, weight.setting.nbits)
    indices_at = blob.write(index_dtype, packed)
    lut_at = blob.write("float16", lut)
    op = proto.Operation(type="constexpr_lut_to_dense")
    lut_shape = (luts.shape[0],) + (1,) * (len(weight.shape) - 1) + (luts.shape[1], 1)
    op.inputs["lut"].arguments.add().value.CopyFrom(_file_value(proto, proto.DataType.FLOAT16, lut_shape, weight.file, lut_at))
    op.inputs["indices"].arguments.add().value.CopyFrom(
        _file_value(proto, getattr(proto.DataType, index_dtype.upper()), weight.shape, weight.file, indices_at)
    )
    op.outputs.add(name=f"{weight.name}_palettized")
    return op


def _quantized_op(proto, weight: _Weight, value: np.ndarray, blob: BlobWriter, palettes: PaletteStore):
    """A ``constexpr_blockwise_shift_scale`` for ``weight`` (symmetric: no offset), its integers
    and scales written to ``blob``."""
    found = stored_quantized(value, weight.setting, weight.name, palettes)
    if found is None:  # checked before writing (_quantizes_here)
        raise ValueError(f"{weight.name}: cannot be quantized as {weight.setting.describe()}")
    data, scale = found
    (data_dtype, packed), (_, scales) = quantized_records(data, scale, weight.setting.nbits)
    data_at = blob.write(data_dtype, packed)
    scale_at = blob.write("float16", scales)
    op = proto.Operation(type="constexpr_blockwise_shift_scale")
    op.inputs["data"].arguments.add().value.CopyFrom(
        _file_value(proto, getattr(proto.DataType, data_dtype.upper()), weight.shape, weight.file, data_at)
    )
    op.inputs["scale"].arguments.add().value.CopyFrom(_file_value(proto, proto.DataType.FLOAT16, scale.shape, weight.file, scale_at))
    op.outputs.add(name=f"{weight.name}_quantized")
    return op


def _rename_inputs(op, renamed: dict[str, str]) -> None:
    """Point ``op``'s inputs at the palettized weights' new names."""
    for argument in op.inputs.values():
        for binding in argument.arguments:
            if binding.WhichOneof("binding") == "name" and binding.name in renamed:
                binding.name = renamed[binding.name]


def _rename_outputs(block, renamed: dict[str, str]) -> None:
    for i, output in enumerate(block.outputs):
        block.outputs[i] = renamed.get(output, output)


def _rename_inside(block, renamed: dict[str, str]) -> None:
    for op in walk_ops(block):
        _rename_inputs(op, renamed)
    _rename_outputs(block, renamed)


def _file_value(proto, data_type, shape, file_name: str, offset: int):
    value = proto.Value()
    tensor = value.type.tensorType
    tensor.dataType = data_type
    tensor.rank = len(shape)
    for size in shape:
        tensor.dimensions.add().constant.size = size
    value.blobFileValue.fileName = file_name
    value.blobFileValue.offset = offset
    return value
