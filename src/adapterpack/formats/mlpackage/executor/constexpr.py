"""Compressed-weight ops (constexpr_*): palettized, quantized and sparse weights materialized."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adapterpack.formats.mlpackage.executor.registry import (
    _CAST_DTYPES,
    Args,
    _axis,
    _int,
    _ints,
    _register,
    _str,
)

# --------------------------------------------------------------------------- constexpr (compressed weights)
#
# Layouts, as coremltools 9 writes them (the milproto loader already unpacks sub-byte blobs
# into one int8/uint8 element per value; the iOS16 ops keep their own bit-packed uint8 bytes):
#   iOS18 constexpr_lut_to_dense(indices[S], lut[B0..Bk-1, 2^nbits, V], vector_axis?):
#       one palette per block of indices (block = S[i] / B[i]); V > 1 writes V consecutive
#       elements along vector_axis.
#   iOS18 constexpr_blockwise_shift_scale(data[S], scale[B], offset[B]?):
#       scale * (data - offset) with scale/offset repeated over blocks S[i] / B[i].
#   iOS18 constexpr_sparse_to_dense(nonzero_data[N], mask[S] uint1): values in row-major order.
#   iOS16 constexpr_lut_to_dense(lut[2^nbits], indices packed LSB-first, shape),
#   iOS16 constexpr_sparse_to_dense(nonzero_data, mask packed LSB-first, shape),
#   iOS16 constexpr_affine_dequantize(quantized_data, zero_point, scale, axis): per-axis vectors.


def _block_index(shape: tuple[int, ...], blocks: tuple[int, ...]) -> list[np.ndarray]:
    """Per-axis broadcastable arrays mapping an element position to its block number."""
    rank = len(shape)
    out = []
    for i, (n, b) in enumerate(zip(shape, blocks)):
        if n % b:
            raise ValueError(f"dim {i} of size {n} is not divisible into {b} blocks")
        out.append((np.arange(n) // (n // b)).reshape([-1 if j == i else 1 for j in range(rank)]))
    return out


# Values a palette lookup of rows gathers at a time (its int64 indices are 8 bytes each).
GATHER_CHUNK_VALUES = 1 << 22
# Palettes that split rows only are looked up by a gather along rows (``_rows_looked_up``);
# False takes numpy's indexing for every layout (benchmarks/build_time.py --verify-previous).
ROW_LOOKUPS = True


def _lut_to_dense_ios18(indices: np.ndarray, lut: np.ndarray, vector_axis: Any) -> np.ndarray:
    lut = np.asarray(lut)
    rank = np.ndim(indices)
    if ROW_LOOKUPS and lut.shape[-1] == 1 and all(b == 1 for b in lut.shape[1:rank]) and rank >= 1:
        return _rows_looked_up(np.asarray(indices), lut)
    indices = np.asarray(indices).astype(np.intp)
    picked = lut[tuple(_block_index(indices.shape, lut.shape[:rank])) + (indices,)]  # S + (V,)
    vector_size = lut.shape[-1]
    if vector_size == 1:
        return picked[..., 0]
    axis = _axis(_int(vector_axis), rank)
    shape = list(indices.shape)
    shape[axis] *= vector_size
    return np.moveaxis(picked, -1, axis + 1).reshape(shape)


def _rows_looked_up(indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """The palette lookup of weights whose palettes split the first axis only (one per output
    channel or group of channels, or one for the tensor: what adapterpack writes), as a gather
    along each row in torch's kernel, a chunk of rows at a time: the general path's numpy fancy
    indexing builds an index per axis and element and took a tenth of a 3B model's verify."""
    import torch

    rows = indices.shape[0]
    table = torch.from_numpy(np.ascontiguousarray(lut.reshape(lut.shape[0], -1)))
    if rows % table.shape[0]:
        raise ValueError(f"dim 0 of size {rows} is not divisible into {table.shape[0]} blocks")
    flat = torch.from_numpy(np.ascontiguousarray(indices).reshape(rows, -1))
    # The weights in numpy's memory, torch writing into it: held by torch's allocator, a 3B
    # model's weights kept 1.3 GiB more resident than numpy's (measured after one function).
    dense = np.empty(flat.shape, dtype=lut.dtype)
    out = torch.from_numpy(dense)
    per_block, step = rows // table.shape[0], max(1, GATHER_CHUNK_VALUES // max(1, flat.shape[1]))
    for first in range(0, rows, step):
        last = min(rows, first + step)
        block_rows = table[first // per_block : (last - 1) // per_block + 1].repeat_interleave(per_block, dim=0)
        offset = first - (first // per_block) * per_block
        torch.gather(block_rows[offset : offset + last - first], 1, flat[first:last].long(), out=out[first:last])
    return dense.reshape(indices.shape)


def _sparse_to_dense_ios18(nonzero_data: np.ndarray, mask: np.ndarray) -> np.ndarray:
    nonzero_data = np.asarray(nonzero_data)
    out = np.zeros(np.shape(mask), dtype=nonzero_data.dtype)
    out[np.asarray(mask) != 0] = nonzero_data
    return out


def _shift_scale(data: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    # Evaluated in the scale's dtype (the op's output dtype): integer data and offsets are
    # exact in float16, so only the final multiply rounds.
    scale = np.asarray(scale)
    data = np.asarray(data).astype(scale.dtype)
    blocks = _block_index(data.shape, scale.shape)
    if offset is not None:
        data = data - np.asarray(offset).astype(scale.dtype)[tuple(blocks)]
    return data * scale[tuple(blocks)]


def _unpack_bits(packed: np.ndarray, nbits: int, count: int) -> np.ndarray:
    """Unpack ``count`` unsigned ``nbits`` values stored LSB-first in uint8 bytes (iOS16 layout)."""
    bits = np.unpackbits(np.asarray(packed).astype(np.uint8).reshape(-1), bitorder="little")
    bits = bits[: count * nbits].reshape(count, nbits).astype(np.int64)
    return (bits << np.arange(nbits)).sum(axis=1)


@_register("constexpr_lut_to_dense", "indices lut vector_axis shape")
def _constexpr_lut_to_dense(a: Args) -> np.ndarray:
    if a.get("shape") is not None:  # iOS16: flat lut, bit-packed indices
        shape = _ints(a["shape"])
        lut = np.asarray(a["lut"]).reshape(-1)
        nbits = int(round(math.log2(lut.size)))
        return lut[_unpack_bits(a["indices"], nbits, int(np.prod(shape)))].reshape(shape)
    return _lut_to_dense_ios18(a["indices"], a["lut"], a.get("vector_axis"))


@_register("constexpr_sparse_to_dense", "nonzero_data mask shape")
def _constexpr_sparse_to_dense(a: Args) -> np.ndarray:
    if a.get("shape") is not None:  # iOS16: bit-packed mask
        shape = _ints(a["shape"])
        mask = _unpack_bits(a["mask"], 1, int(np.prod(shape))).reshape(shape)
        return _sparse_to_dense_ios18(a["nonzero_data"], mask)
    return _sparse_to_dense_ios18(a["nonzero_data"], a["mask"])


@_register("constexpr_blockwise_shift_scale", "data scale offset")
def _constexpr_blockwise_shift_scale(a: Args) -> np.ndarray:
    return _shift_scale(a["data"], a["scale"], a.get("offset"))


@_register("constexpr_affine_dequantize", "quantized_data zero_point scale axis")
def _constexpr_affine_dequantize(a: Args) -> np.ndarray:
    q = np.asarray(a["quantized_data"])
    scale = np.asarray(a["scale"])
    axis = _axis(_int(a["axis"]), q.ndim)
    shape = [-1 if i == axis else 1 for i in range(q.ndim)]

    def per_axis(p: np.ndarray) -> np.ndarray:
        p = np.asarray(p).astype(np.float32)
        return p if p.ndim == 0 else p.reshape(shape)

    out = (q.astype(np.float32) - per_axis(a["zero_point"])) * per_axis(scale)
    return out.astype(scale.dtype)


@_register("constexpr_cast", "source_val output_dtype")
def _constexpr_cast(a: Args) -> np.ndarray:
    return np.asarray(a["source_val"]).astype(_CAST_DTYPES[_str(a["output_dtype"])])


@_register("constexpr_lut_to_sparse", "indices_mask indices_nonzero_data lut vector_axis")
def _constexpr_lut_to_sparse(a: Args) -> tuple[np.ndarray, np.ndarray]:
    mask = np.asarray(a["indices_mask"])
    dense = _lut_to_dense_ios18(_sparse_to_dense_ios18(a["indices_nonzero_data"], mask), a["lut"], a.get("vector_axis"))
    vector_size = np.shape(a["lut"])[-1]
    if vector_size > 1:
        mask = np.repeat(mask, vector_size, axis=_int(a["vector_axis"]))
    return mask, dense[mask != 0]


@_register("constexpr_sparse_blockwise_shift_scale", "data_mask nonzero_data scale offset")
def _constexpr_sparse_blockwise_shift_scale(a: Args) -> tuple[np.ndarray, np.ndarray]:
    mask = np.asarray(a["data_mask"])
    dense = _shift_scale(_sparse_to_dense_ios18(a["nonzero_data"], mask), a["scale"], a.get("offset"))
    return mask, dense[mask != 0]


