"""Shape manipulation, gather and scatter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adapterpack.formats.mlpackage.executor.registry import (
    Args,
    UnsupportedOp,
    _axes,
    _axis,
    _bool,
    _bools,
    _f32,
    _int,
    _ints,
    _register,
    _str,
)

# --------------------------------------------------------------------------- shape manipulation


@_register("reshape", "x shape")
def _reshape(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    shape = list(_ints(a["shape"]))
    k = len(shape)
    for i, s in enumerate(shape):
        if s == 0:  # iOS17 rule: 0 copies the input dim aligned from the right, else 1
            j = x.ndim - (k - i)
            shape[i] = x.shape[j] if 0 <= j < x.ndim else 1
    return x.reshape(shape)


@_register("expand_dims", "x axes")
def _expand_dims(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    out_rank = x.ndim + len(_ints(a["axes"]))
    return np.expand_dims(x, tuple(_axis(ax, out_rank) for ax in _ints(a["axes"])))


@_register("squeeze", "x axes")
def _squeeze(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    axes = _axes(a.get("axes"), x.ndim)
    return np.squeeze(x) if axes is None else np.squeeze(x, axis=axes)


@_register("transpose", "x perm")
def _transpose(a: Args) -> np.ndarray:
    return np.transpose(a["x"], _ints(a["perm"]))


@_register("flatten2d", "x axis")
def _flatten2d(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    axis = _axis(_int(a.get("axis"), 1), x.ndim)
    return x.reshape(int(np.prod(x.shape[:axis])), -1)


@_register("concat", "values axis interleave")
def _concat(a: Args) -> np.ndarray:
    values = [np.atleast_1d(np.asarray(v)) for v in a["values"]]
    axis = _axis(_int(a["axis"]), values[0].ndim)
    if _bool(a.get("interleave")):
        # Equal-shaped inputs alternate slice by slice along ``axis``.
        stacked = np.stack(values, axis=axis + 1)
        shape = list(values[0].shape)
        shape[axis] *= len(values)
        return stacked.reshape(shape)
    return np.concatenate(values, axis=axis)


@_register("stack", "values axis")
def _stack(a: Args) -> np.ndarray:
    values = [np.asarray(v) for v in a["values"]]
    return np.stack(values, axis=_axis(_int(a["axis"]), values[0].ndim + 1))


@_register("split", "x num_splits split_sizes axis")
def _split(a: Args) -> tuple[np.ndarray, ...]:
    x = np.asarray(a["x"])
    axis = _axis(_int(a["axis"]), x.ndim)
    if a.get("split_sizes") is not None:
        points = np.cumsum(_ints(a["split_sizes"]))[:-1]
        return tuple(np.split(x, points, axis=axis))
    return tuple(np.split(x, _int(a["num_splits"]), axis=axis))


@_register("tile", "x reps")
def _tile(a: Args) -> np.ndarray:
    return np.tile(a["x"], _ints(a["reps"]))


@_register("reverse", "x axes")
def _reverse(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    axes = _axes(a.get("axes"), x.ndim)
    return np.flip(x, axis=axes)


@_register("shape", "x")
def _shape(a: Args) -> np.ndarray:
    return np.array(np.shape(a["x"]), dtype=np.int32)


@_register("range_1d", "end start step")
def _range_1d(a: Args) -> np.ndarray:
    start, end, step = (np.asarray(a[k]).item() for k in ("start", "end", "step"))
    dtype = np.result_type(np.asarray(a["start"]), np.asarray(a["end"]), np.asarray(a["step"]))
    return np.arange(start, end, step).astype(dtype)


@_register("fill", "shape value")
def _fill(a: Args) -> np.ndarray:
    value = np.asarray(0.0 if a.get("value") is None else a["value"])
    return np.full(_ints(a["shape"]), value, dtype=value.dtype)


@_register("fill_like", "ref_tensor value")
def _fill_like(a: Args) -> np.ndarray:
    value = np.asarray(0.0 if a.get("value") is None else a["value"])
    return np.full(np.shape(a["ref_tensor"]), value, dtype=value.dtype)


def _index(shape: tuple[int, ...], a: Args) -> tuple[Any, ...]:
    """numpy index for MIL ``slice_by_index`` / ``slice_update`` (squeezed axes become ints)."""
    rank = len(shape)
    begin, end = list(_ints(a["begin"])), list(_ints(a["end"]))
    stride = list(_ints(a["stride"])) if a.get("stride") is not None else [1] * rank
    begin_mask = _bools(a.get("begin_mask"), rank)
    end_mask = _bools(a.get("end_mask"), rank)
    squeeze_mask = _bools(a.get("squeeze_mask"), rank)
    index: list[Any] = []
    for i in range(rank):
        if squeeze_mask[i]:
            index.append(begin[i])
        else:
            index.append(
                slice(None if begin_mask[i] else begin[i], None if end_mask[i] else end[i], stride[i])
            )
    return tuple(index)


@_register("slice_by_index", "x begin end stride begin_mask end_mask squeeze_mask")
def _slice_by_index(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    return x[_index(x.shape, a)]


@_register("slice_update", "x update begin end stride begin_mask end_mask squeeze_mask")
def _slice_update(a: Args) -> np.ndarray:
    return update_slice_in_place({**a, "x": np.array(a["x"], copy=True)})


def update_slice_in_place(a: Args) -> np.ndarray:
    """``slice_update`` written into ``a["x"]`` itself (the interpreter decides when it may)."""
    x = a["x"]
    index = _index(x.shape, a)
    x[index] = np.reshape(a["update"], x[index].shape)
    return x


@_register("slice_by_size", "x begin size")
def _slice_by_size(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    index = tuple(
        slice(b, None if s == -1 else b + s) for b, s in zip(_ints(a["begin"]), _ints(a["size"]))
    )
    return x[index]


@_register("pad", "x pad mode constant_val")
def _pad(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    pad = _ints(a["pad"])
    n = len(pad) // 2  # pads the last n dims: (before, after) pairs
    width = [(0, 0)] * (x.ndim - n) + [(pad[2 * i], pad[2 * i + 1]) for i in range(n)]
    mode = _str(a.get("mode"), "constant")
    if mode == "constant":
        value = 0.0 if a.get("constant_val") is None else np.asarray(a["constant_val"]).item()
        return np.pad(x, width, mode="constant", constant_values=value)
    if mode == "reflect":
        return np.pad(x, width, mode="reflect")
    if mode == "replicate":
        return np.pad(x, width, mode="edge")
    raise UnsupportedOp(f"pad mode {mode!r} is not supported")


@_register("band_part", "x lower upper")
def _band_part(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    lower, upper = _int(a.get("lower"), -1), _int(a.get("upper"), -1)
    m = np.arange(x.shape[-2])[:, None]
    n = np.arange(x.shape[-1])[None, :]
    keep = ((lower < 0) | (m - n <= lower)) & ((upper < 0) | (n - m <= upper))
    return np.where(keep, x, np.zeros((), x.dtype))


@_register("cumsum", "x axis exclusive reverse")
def _cumsum(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    axis = _axis(_int(a.get("axis"), 0), x.ndim)
    y = np.flip(x, axis) if _bool(a.get("reverse")) else x
    out = np.cumsum(_f32(y), axis=axis)
    if _bool(a.get("exclusive")):
        out = out - _f32(y)
    return np.flip(out, axis) if _bool(a.get("reverse")) else out


@_register("one_hot", "indices one_hot_vector_size axis on_value off_value")
def _one_hot(a: Args) -> np.ndarray:
    indices = np.asarray(a["indices"])
    size = _int(a["one_hot_vector_size"])
    on = np.asarray(1 if a.get("on_value") is None else a["on_value"])
    off = np.asarray(0 if a.get("off_value") is None else a["off_value"])
    axis = _axis(_int(a.get("axis"), -1), indices.ndim + 1)
    hot = np.expand_dims(indices, axis) == np.arange(size).reshape(
        [-1 if i == axis else 1 for i in range(indices.ndim + 1)]
    )
    return np.where(hot, on, off)


@_register("argsort", "x axis ascending")
def _argsort(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    axis = _int(a.get("axis"), -1)
    key = x if _bool(a.get("ascending")) else -x  # MIL sorts descending by default
    return np.argsort(key, axis=axis, kind="stable").astype(np.int32)


@_register("topk", "x k axis ascending sort return_indices output_indices_dtype")
def _topk(a: Args) -> tuple[np.ndarray, np.ndarray] | np.ndarray:
    # Results are always sorted (a valid order when ``sort`` is False too).
    x = np.asarray(a["x"])
    axis = _axis(_int(a.get("axis"), -1), x.ndim)
    k = _int(a.get("k"), 1)
    key = _f32(x) if _bool(a.get("ascending")) else -_f32(x)
    idx = np.take(np.argsort(key, axis=axis, kind="stable"), np.arange(k), axis=axis)
    values = np.take_along_axis(x, idx, axis=axis)
    if not _bool(a.get("return_indices"), True):
        return values
    return values, idx.astype(np.int32)


@_register("non_zero", "x")
def _non_zero(a: Args) -> np.ndarray:
    return np.argwhere(np.asarray(a["x"])).astype(np.int32)


# --------------------------------------------------------------------------- gather / scatter


@_register("gather", "x indices axis batch_dims validate_indices")
def _gather(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    indices = np.asarray(a["indices"]).astype(np.int64)
    axis = _axis(_int(a.get("axis"), 0), x.ndim)
    batch_dims = _int(a.get("batch_dims"), 0)
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    if batch_dims == 0:
        return np.take(x, indices, axis=axis)
    batch = x.shape[:batch_dims]
    xb = x.reshape((-1,) + x.shape[batch_dims:])
    ib = indices.reshape((-1,) + indices.shape[batch_dims:])
    out = np.stack([np.take(xb[i], ib[i], axis=axis - batch_dims) for i in range(xb.shape[0])])
    return out.reshape(batch + out.shape[1:])


@_register("gather_along_axis", "x indices axis validate_indices")
def _gather_along_axis(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    axis = _axis(_int(a.get("axis"), 0), x.ndim)
    indices = np.asarray(a["indices"]).astype(np.int64)
    indices = np.where(indices < 0, indices + x.shape[axis], indices)
    return np.take_along_axis(x, indices, axis=axis)


@_register("gather_nd", "x indices batch_dims validate_indices")
def _gather_nd(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    indices = np.asarray(a["indices"]).astype(np.int64)
    batch_dims = _int(a.get("batch_dims"), 0)
    if batch_dims == 0:
        return x[tuple(np.moveaxis(indices, -1, 0))]
    batch = x.shape[:batch_dims]
    xb = x.reshape((-1,) + x.shape[batch_dims:])
    ib = indices.reshape((-1,) + indices.shape[batch_dims:])
    out = np.stack([xb[i][tuple(np.moveaxis(ib[i], -1, 0))] for i in range(xb.shape[0])])
    return out.reshape(batch + out.shape[1:])


_SCATTER_MODES: dict[str, Callable[..., None] | None] = {
    "update": None,
    "add": np.add.at,
    "sub": np.subtract.at,
    "mul": np.multiply.at,
    "div": np.divide.at,
    "max": np.maximum.at,
    "min": np.minimum.at,
}


def _scatter_into(data: np.ndarray, index: tuple[Any, ...], updates: np.ndarray, mode: str) -> np.ndarray:
    if mode not in _SCATTER_MODES:
        raise UnsupportedOp(f"scatter mode {mode!r} is not supported")
    out = np.array(data, copy=True)
    at = _SCATTER_MODES[mode]
    if at is None:
        out[index] = updates
    else:
        at(out, index, updates)
    return out


@_register("scatter", "data indices updates axis mode validate_indices")
def _scatter(a: Args) -> np.ndarray:
    data = np.asarray(a["data"])
    axis = _axis(_int(a.get("axis"), 0), data.ndim)
    indices = np.asarray(a["indices"]).astype(np.int64).reshape(-1)
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    # updates: data.shape[:axis] + (len(indices),) + data.shape[axis + 1:]
    moved = np.moveaxis(data, axis, 0)
    updates = np.moveaxis(np.asarray(a["updates"]), axis, 0)
    out = _scatter_into(moved, (indices,), updates, _str(a.get("mode"), "add"))
    return np.moveaxis(out, 0, axis)


@_register("scatter_along_axis", "data indices updates axis mode validate_indices")
def _scatter_along_axis(a: Args) -> np.ndarray:
    data = np.asarray(a["data"])
    axis = _axis(_int(a.get("axis"), 0), data.ndim)
    indices = np.asarray(a["indices"]).astype(np.int64)
    indices = np.where(indices < 0, indices + data.shape[axis], indices)
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = indices
    return _scatter_into(data, tuple(grid), np.asarray(a["updates"]), _str(a.get("mode"), "add"))


@_register("scatter_nd", "data indices updates mode validate_indices")
def _scatter_nd(a: Args) -> np.ndarray:
    data = np.asarray(a["data"])
    indices = np.asarray(a["indices"]).astype(np.int64)
    index = tuple(np.moveaxis(indices, -1, 0))
    return _scatter_into(data, index, np.asarray(a["updates"]), _str(a.get("mode"), "add"))


