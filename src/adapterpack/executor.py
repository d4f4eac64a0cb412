"""Run a Core ML ML Program on the CPU with numpy, so numerics can be checked without Core ML.

Linux has no Core ML runtime: ``MLModel.predict`` is unavailable there, yet CI must verify that
the packages adapterpack writes (stateful KV-cache decoders, palettized / quantized / pruned
weights, several functions in one multifunction ``.mlpackage``) compute what the PyTorch model
computes. This module reads the package's MIL program with coremltools' own milproto loader and
interprets it op by op.

Every op is implemented here in numpy instead of relying on coremltools' ``value_inference``:
those are written for constant folding at conversion time, assume concrete shapes (symbolic
``RangeDim`` dims break ``reshape``/``expand_dims``), do not cover the state ops, and return
numpy-2 scalars that some reductions reject. The program's declared types are still used: each
op's result is cast to the dtype its output var declares, so a float16 program is evaluated in
float16 the way Core ML would run it (see ``_f32`` for where we deliberately widen).

Loading checks that every op of every function is supported (``UnsupportedOp`` otherwise, naming
the op type and the function). Each function is then compiled once, on first use: everything
that depends only on constants -- ``const``, the ``constexpr_*`` decompression ops and whatever
is computed from them -- is evaluated at that point, so repeated ``predict`` calls only run the
input-dependent ops.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SUPPORTED_OPS", "DeclaredTypeMismatch", "ProgramExecutor", "UnsupportedOp"]


class UnsupportedOp(Exception):
    """The program uses an op type (or an op parameter) this executor does not implement."""


class DeclaredTypeMismatch(Exception):
    """An op computed a value whose dtype, rank or a static dimension differs from the type the
    program declares for it. Core ML compiles the declared program on the device, so such a
    package may be refused or mis-executed there even though this interpreter could run it."""


Args = dict[str, Any]
Handler = Callable[[Args], Any]


@dataclass(frozen=True)
class _OpImpl:
    fn: Handler
    params: frozenset[str]


_OPS: dict[str, _OpImpl] = {}

# Ops that touch the model state; they are executed by the interpreter loop itself.
_STATE_OPS = frozenset({"read_state", "coreml_update_state"})


def _register(names: str | Sequence[str], params: str) -> Callable[[Handler], Handler]:
    """Register ``fn`` for op type(s) ``names`` accepting the space-separated ``params``.

    Declaring the parameters lets compilation reject an op that carries one we do not
    interpret (e.g. a flag added in a newer opset) instead of silently ignoring it.
    """

    def deco(fn: Handler) -> Handler:
        for name in [names] if isinstance(names, str) else names:
            _OPS[name] = _OpImpl(fn, frozenset(params.split()))
        return fn

    return deco


# --------------------------------------------------------------------------- small helpers


def _int(v: Any, default: int | None = None) -> int:
    if v is None:
        if default is None:
            raise ValueError("missing required integer parameter")
        return default
    return int(np.asarray(v).reshape(-1)[0])


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in np.asarray(v).reshape(-1))


def _bool(v: Any, default: bool = False) -> bool:
    # Parameters arrive as numpy-2 ``np.bool`` scalars, which numpy's own ``keepdims=`` rejects.
    return default if v is None else bool(np.asarray(v).reshape(-1)[0])


def _bools(v: Any, n: int) -> list[bool]:
    return [False] * n if v is None else [bool(b) for b in np.asarray(v).reshape(-1)]


def _str(v: Any, default: str = "") -> str:
    if v is None:
        return default
    return v if isinstance(v, str) else str(np.asarray(v).item())


def _f32(x: np.ndarray) -> np.ndarray:
    """Widen float16 to float32 for an op evaluated as one fused kernel.

    Precision model: elementwise arithmetic runs in the declared dtype (numpy's float16 ufuncs
    round every result to float16, as Core ML's fp16 units do). Ops with an internal reduction
    or a multi-step formula (matmul/linear, softmax, norms, reductions, composite activations)
    are computed in float32 and rounded once to the declared output dtype, because Core ML
    runs float16 programs with float32 accumulation on most compute units. Rounding per op
    tracks what a device computes much more closely than a float32 evaluation of the whole
    program would, while float16 accumulation would be needlessly pessimistic.
    """
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _axes(v: Any, rank: int) -> tuple[int, ...] | None:
    return None if v is None else tuple(_axis(a, rank) for a in _ints(v))


_CAST_DTYPES = {
    "bool": np.bool_,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "int64": np.int64,
    "fp16": np.float16,
    "fp32": np.float32,
    "fp64": np.float64,
}


# --------------------------------------------------------------------------- elementwise

_BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "real_div": np.true_divide,
    "floor_div": np.floor_divide,
    "mod": np.mod,
    "pow": np.power,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "less": np.less,
    "less_equal": np.less_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "logical_and": np.logical_and,
    "logical_or": np.logical_or,
    "logical_xor": np.logical_xor,
}


def _binary(ufunc: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Handler:
    def run(a: Args) -> np.ndarray:
        return ufunc(np.asarray(a["x"]), np.asarray(a["y"]))

    return run


for _name, _ufunc in _BINARY.items():
    _register(_name, "x y")(_binary(_ufunc))


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf and scipy is not a
    # dependency; this is far below float16 resolution.
    x = np.asarray(x, dtype=np.float64)
    s = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return s * (1.0 - poly * np.exp(-x * x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    x = _f32(x)
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "abs": np.abs,
    "acos": np.arccos,
    "asin": np.arcsin,
    "atan": np.arctan,
    "atanh": np.arctanh,
    "ceil": np.ceil,
    "cos": np.cos,
    "cosh": np.cosh,
    "exp": np.exp,
    "exp2": np.exp2,
    "floor": np.floor,
    "logical_not": np.logical_not,
    "round": np.round,  # half to even, as MIL documents (0.5 -> 0)
    "sign": np.sign,
    "sin": np.sin,
    "sinh": np.sinh,
    "sqrt": np.sqrt,
    "square": np.square,
    "tan": np.tan,
    "tanh": np.tanh,
    "identity": lambda x: x,
    "relu": lambda x: np.maximum(x, np.zeros((), x.dtype)),
    "relu6": lambda x: np.clip(x, 0, 6).astype(x.dtype),
    "erf": lambda x: _erf(x),
    "sigmoid": _sigmoid,
    "silu": lambda x: _f32(x) * _sigmoid(x),
    "softplus": lambda x: np.logaddexp(0.0, _f32(x)),
    "softsign": lambda x: _f32(x) / (1.0 + np.abs(_f32(x))),
}


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Handler:
    def run(a: Args) -> np.ndarray:
        return fn(np.asarray(a["x"]))

    return run


for _name, _fn in _UNARY.items():
    _register(_name, "x")(_unary(_fn))


def _eps(a: Args, default: float) -> np.ndarray:
    return np.float32(default) if a.get("epsilon") is None else _f32(a["epsilon"])


@_register("rsqrt", "x epsilon")
def _rsqrt(a: Args) -> np.ndarray:
    return 1.0 / np.sqrt(_f32(a["x"]) + _eps(a, 1e-12))


@_register("inverse", "x epsilon")
def _inverse(a: Args) -> np.ndarray:
    return 1.0 / (_f32(a["x"]) + _eps(a, 1e-4))


@_register("log", "x epsilon")
def _log(a: Args) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(_f32(a["x"]) + _eps(a, 1e-45))


@_register("clip", "x alpha beta")
def _clip(a: Args) -> np.ndarray:
    return np.minimum(np.maximum(a["x"], a["alpha"]), a["beta"])


@_register("threshold", "x alpha")
def _threshold(a: Args) -> np.ndarray:
    return np.maximum(a["x"], a["alpha"])


@_register("cast", "x dtype")
def _cast(a: Args) -> np.ndarray:
    name = _str(a["dtype"])
    if name not in _CAST_DTYPES:
        raise UnsupportedOp(f"cast to dtype {name!r} is not supported")
    x = np.asarray(a["x"])
    if np.issubdtype(_CAST_DTYPES[name], np.integer) and np.issubdtype(x.dtype, np.floating):
        x = np.trunc(x)  # float -> int truncates toward zero
    return x.astype(_CAST_DTYPES[name])


@_register("select", "cond a b")
def _select(a: Args) -> np.ndarray:
    return np.where(np.asarray(a["cond"]).astype(bool), a["a"], a["b"])


# --------------------------------------------------------------------------- activations


@_register("gelu", "x mode")
def _gelu(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    mode = _str(a.get("mode"), "EXACT")
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x * _sigmoid(1.702 * x)
    if mode == "EXACT":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    raise UnsupportedOp(f"gelu mode {mode!r} is not supported")


@_register("leaky_relu", "x alpha")
def _leaky_relu(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    return np.where(x >= 0, x, x * _f32(a["alpha"]))


@_register("elu", "x alpha")
def _elu(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    return np.where(x > 0, x, _f32(a["alpha"]) * np.expm1(np.minimum(x, 0)))


@_register("thresholded_relu", "x alpha")
def _thresholded_relu(a: Args) -> np.ndarray:
    x = np.asarray(a["x"])
    return np.where(x < a["alpha"], np.zeros((), x.dtype), x)


@_register("clamped_relu", "x alpha beta")
def _clamped_relu(a: Args) -> np.ndarray:
    x, alpha, beta = _f32(a["x"]), _f32(a["alpha"]), _f32(a["beta"])
    return np.minimum(np.maximum(x, 0), beta) + np.minimum(np.minimum(x, 0) * alpha, beta)


@_register("linear_activation", "x alpha beta")
def _linear_activation(a: Args) -> np.ndarray:
    return _f32(a["alpha"]) * _f32(a["x"]) + _f32(a["beta"])


@_register("scaled_tanh", "x alpha beta")
def _scaled_tanh(a: Args) -> np.ndarray:
    return _f32(a["alpha"]) * np.tanh(_f32(a["x"]) * _f32(a["beta"]))


@_register("sigmoid_hard", "x alpha beta")
def _sigmoid_hard(a: Args) -> np.ndarray:
    return np.clip(_f32(a["alpha"]) * _f32(a["x"]) + _f32(a["beta"]), 0.0, 1.0)


def _per_channel(p: np.ndarray, rank: int) -> np.ndarray:
    # (C,) -> (1, C, 1, ...) so it broadcasts over axis 1 of an NC... tensor.
    return _f32(p).reshape((1, -1) + (1,) * (rank - 2))


@_register("prelu", "x alpha")
def _prelu(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    return np.where(x >= 0, x, x * _per_channel(a["alpha"], x.ndim))


@_register("softplus_parametric", "x alpha beta")
def _softplus_parametric(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    alpha, beta = _per_channel(a["alpha"], x.ndim), _per_channel(a["beta"], x.ndim)
    return alpha * np.logaddexp(0.0, beta * x)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    x = _f32(x)
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    return e / np.sum(e, axis=axis, keepdims=True)


@_register("softmax", "x axis")
def _softmax_op(a: Args) -> np.ndarray:
    return _softmax(a["x"], _int(a.get("axis"), -1))


# --------------------------------------------------------------------------- linear algebra


@_register("linear", "x weight bias")
def _linear(a: Args) -> np.ndarray:
    y = np.matmul(_f32(a["x"]), _f32(a["weight"]).T)
    if a.get("bias") is not None:
        y = y + _f32(a["bias"])
    return y


@_register("matmul", "x y transpose_x transpose_y")
def _matmul(a: Args) -> np.ndarray:
    x, y = _f32(a["x"]), _f32(a["y"])
    if _bool(a.get("transpose_x")) and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if _bool(a.get("transpose_y")) and y.ndim >= 2:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


@_register("scaled_dot_product_attention", "query key value attn_mask")
def _sdpa(a: Args) -> np.ndarray:
    q = np.asarray(a["query"])
    dtype = q.dtype
    k, v = a["key"], a["value"]
    # Rounded to the program dtype where the decomposed graph (matmul -> add mask -> softmax
    # -> matmul) would round; the products themselves accumulate in float32 (see _f32).
    scores = (np.matmul(_f32(q), np.swapaxes(_f32(k), -1, -2)) / math.sqrt(q.shape[-1])).astype(dtype)
    mask = a.get("attn_mask")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            scores = np.where(mask, scores, np.array(-np.inf, dtype))
        else:
            scores = (scores + mask).astype(dtype)
    weights = _softmax(scores, -1).astype(dtype)
    return np.matmul(_f32(weights), _f32(v))


# --------------------------------------------------------------------------- reductions


def _reduction(fn: Callable[..., np.ndarray], widen: bool = True) -> Handler:
    def run(a: Args) -> np.ndarray:
        x = np.asarray(a["x"])
        if widen:
            x = _f32(x)
        return fn(x, axis=_axes(a.get("axes"), x.ndim), keepdims=_bool(a.get("keep_dims")))

    return run


def _log_sum_exp(x: np.ndarray, axis: tuple[int, ...] | None, keepdims: bool) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


_REDUCTIONS: dict[str, Callable[..., np.ndarray]] = {
    "reduce_sum": np.sum,
    "reduce_mean": np.mean,
    "reduce_prod": np.prod,
    "reduce_max": np.max,
    "reduce_min": np.min,
    "reduce_l1_norm": lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims),
    "reduce_l2_norm": lambda x, axis, keepdims: np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims)),
    "reduce_sum_square": lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims),
    "reduce_log_sum": lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims)),
    "reduce_log_sum_exp": _log_sum_exp,
}

for _name, _fn in _REDUCTIONS.items():
    _register(_name, "x axes keep_dims")(_reduction(_fn, widen=_name not in ("reduce_max", "reduce_min")))


def _arg_reduction(fn: Callable[..., np.ndarray]) -> Handler:
    def run(a: Args) -> np.ndarray:
        x = np.asarray(a["x"])
        axis = _axis(_int(a.get("axis"), -1), x.ndim)
        out = fn(x, axis=axis)
        return np.expand_dims(out, axis) if _bool(a.get("keep_dims")) else out

    return run


# ``output_dtype`` (iOS17+) is honoured through the declared output type.
_register("reduce_argmax", "x axis keep_dims output_dtype")(_arg_reduction(np.argmax))
_register("reduce_argmin", "x axis keep_dims output_dtype")(_arg_reduction(np.argmin))


# --------------------------------------------------------------------------- normalization


@_register("layer_norm", "x axes gamma beta epsilon")
def _layer_norm(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    axes = _axes(a.get("axes"), x.ndim)
    axes = tuple(range(x.ndim)) if axes is None else axes
    mean = np.mean(x, axis=axes, keepdims=True)
    var = np.mean(np.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + _eps(a, 1e-5))
    # gamma/beta have the shape of the normalized axes, which are trailing in practice.
    if a.get("gamma") is not None:
        y = y * _f32(a["gamma"])
    if a.get("beta") is not None:
        y = y + _f32(a["beta"])
    return y


@_register("batch_norm", "x mean variance gamma beta epsilon")
def _batch_norm(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    mean, var = _per_channel(a["mean"], x.ndim), _per_channel(a["variance"], x.ndim)
    y = (x - mean) / np.sqrt(var + _eps(a, 1e-5))
    if a.get("gamma") is not None:
        y = y * _per_channel(a["gamma"], x.ndim)
    if a.get("beta") is not None:
        y = y + _per_channel(a["beta"], x.ndim)
    return y


@_register("instance_norm", "x gamma beta epsilon")
def _instance_norm(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    axes = tuple(range(2, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    var = np.mean(np.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + _eps(a, 1e-5))
    if a.get("gamma") is not None:
        y = y * _per_channel(a["gamma"], x.ndim)
    if a.get("beta") is not None:
        y = y + _per_channel(a["beta"], x.ndim)
    return y


@_register("l2_norm", "x epsilon")
def _l2_norm(a: Args) -> np.ndarray:
    x = _f32(a["x"])
    # MIL normalizes over the last three dims; leading dims are batch.
    axes = tuple(range(x.ndim - 3, x.ndim))
    return x / np.sqrt(np.sum(x * x, axis=axes, keepdims=True) + _eps(a, 1e-6))


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
    x = np.array(a["x"], copy=True)
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


def _lut_to_dense_ios18(indices: np.ndarray, lut: np.ndarray, vector_axis: Any) -> np.ndarray:
    indices = np.asarray(indices).astype(np.intp)
    lut = np.asarray(lut)
    rank = indices.ndim
    picked = lut[tuple(_block_index(indices.shape, lut.shape[:rank])) + (indices,)]  # S + (V,)
    vector_size = lut.shape[-1]
    if vector_size == 1:
        return picked[..., 0]
    axis = _axis(_int(vector_axis), rank)
    shape = list(indices.shape)
    shape[axis] *= vector_size
    return np.moveaxis(picked, -1, axis + 1).reshape(shape)


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


SUPPORTED_OPS: frozenset[str] = frozenset(_OPS) | {"const"} | _STATE_OPS


# --------------------------------------------------------------------------- interpreter

_READ, _WRITE, _CALL = 0, 1, 2


@dataclass
class _Step:
    kind: int
    op_type: str
    label: str  # first output name, for error messages
    fn: Handler | None
    args: tuple[tuple[str, int | tuple[int, ...]], ...]
    outs: tuple[int, ...]
    dtypes: tuple[Any, ...]
    state: str = ""
    declared: tuple["_Declared | None", ...] = ()


@dataclass(frozen=True)
class _Declared:
    """The type a program declares for one value: dtype, rank and dims (None where symbolic)."""

    dtype: Any  # numpy dtype, or None when the declaration is not a plain tensor type
    dims: tuple[int | None, ...]

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.dtype} rank {len(self.dims)} ({dims})"

    def mismatch(self, value: np.ndarray) -> str | None:
        """Why ``value`` does not fit this declaration, or None when it does."""
        if len(value.shape) != len(self.dims) or any(
            want is not None and want != got for want, got in zip(self.dims, value.shape)
        ):
            return "shape"
        # The interpreter widens float16 to float32 inside fused kernels (see ``_f32``), so a
        # float is checked as a float, an integer as an integer and a bool as a bool.
        if self.dtype is not None and _dtype_family(value.dtype) != _dtype_family(self.dtype):
            return "dtype"
        return None


def _dtype_family(dtype: Any) -> str:
    kind = np.dtype(dtype).kind
    return {"f": "float", "i": "integer", "u": "integer", "b": "bool"}.get(kind, kind)


# MIL proto data types -> numpy (the ones a tensor value of a program can have).
_PROTO_DTYPES = {
    "FLOAT16": np.float16, "FLOAT32": np.float32, "FLOAT64": np.float64, "BOOL": np.bool_,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
}


def _declared_in_spec(spec: Any, functions: Sequence[str]) -> dict[str, dict[str, _Declared]]:
    """{function: {value name: declared type}} as the saved program states them: the device
    compiles these, not the types coremltools infers again when it loads the program."""
    from coremltools.proto import MIL_pb2

    declared: dict[str, dict[str, _Declared]] = {}
    for name in functions:
        function = spec.mlProgram.functions[name]
        block = function.block_specializations[function.opset]
        found: dict[str, _Declared] = {}
        for op in block.operations:
            for output in op.outputs:
                if output.type.WhichOneof("type") != "tensorType":
                    continue
                tensor = output.type.tensorType
                dims = tuple(
                    int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None
                    for d in tensor.dimensions
                )
                if len(dims) != tensor.rank:  # a rank without dimensions: nothing to compare but the rank
                    dims = (None,) * tensor.rank
                dtype = _PROTO_DTYPES.get(MIL_pb2.DataType.Name(tensor.dataType))
                found[output.name] = _Declared(np.dtype(dtype) if dtype is not None else None, dims)
        declared[name] = found
    return declared


def _declared_of_var(var: Any) -> _Declared | None:
    """The declared type of a var of an in-memory program (no saved spec to read)."""
    from coremltools.converters.mil.mil import types

    if not types.is_tensor(var.sym_type) and not types.is_scalar(var.sym_type):
        return None
    dims = tuple(d if isinstance(d, (int, np.integer)) else None for d in var.shape)
    return _Declared(_declared_dtype(var), dims)


@dataclass
class _InputSpec:
    name: str
    slot: int
    dtype: Any
    shape: tuple[int | None, ...]  # None for a flexible (RangeDim) dim


@dataclass
class _Compiled:
    steps: list[_Step]
    env: list[Any]
    inputs: list[_InputSpec]
    states: dict[str, tuple[tuple[int, ...], Any]]
    state_slots: dict[int, str]
    outputs: list[tuple[str, int]] = field(default_factory=list)


def _declared_dtype(var: Any) -> Any:
    from coremltools.converters.mil.mil import types

    try:
        if types.is_str(var.dtype):
            return None
        return np.dtype(types.nptype_from_builtin(var.dtype))
    except Exception:  # list / tuple types, unknown builtins: leave the result as computed
        return None


def _concrete_shape(shape: Sequence[Any]) -> tuple[int | None, ...]:
    return tuple(d if isinstance(d, (int, np.integer)) else None for d in shape)


def _const_value(var: Any) -> Any:
    val = var.val
    if isinstance(val, str):
        return val
    arr = np.asarray(val)
    dtype = _declared_dtype(var)
    return arr.astype(dtype) if dtype is not None and arr.dtype != dtype else arr


def _label(op: Any) -> str:
    return op.outputs[0].name if op.outputs else op.name


def _check_supported(op: Any, function: str) -> None:
    """Raise ``UnsupportedOp`` for an op (or op parameter) the interpreter cannot run."""
    where = f"op type {op.op_type!r} ({_label(op)!r}) in function {function!r}"
    if op.blocks:
        raise UnsupportedOp(f"{where}: control flow is not supported by the numpy executor")
    if op.op_type == "const" or op.op_type in _STATE_OPS:
        return
    impl = _OPS.get(op.op_type)
    if impl is None:
        raise UnsupportedOp(f"{where} is not supported by the numpy executor")
    unknown = set(op.inputs) - impl.params
    if unknown:
        raise UnsupportedOp(f"{where} has parameters {sorted(unknown)} the numpy executor does not interpret")


def _program_spec(path: str):
    """The model spec of a package, which must hold an ML Program."""
    import coremltools as ct

    spec = ct.utils.load_spec(path)
    if spec.WhichOneof("Type") != "mlProgram":
        raise ValueError(f"{path} is not an ML Program (found {spec.WhichOneof('Type')!r})")
    return spec


# float32 copies of float16 matmul weights made ahead of time (see ``_widen_static_operands``).
WIDEN_BUDGET_BYTES = 1 << 30


class ProgramExecutor:
    """numpy interpreter for the ML Program functions of one ``.mlpackage``."""

    def __init__(
        self,
        program: Any,
        default_function: str | None = None,
        declared: dict[str, dict[str, _Declared]] | None = None,
    ) -> None:
        self._program = program
        # Declared types from the saved spec (``load``); without one, the program's own var types.
        self._declared = declared or {}
        names = list(program.functions)
        if default_function not in names:
            default_function = "main" if "main" in names else names[0]
        self._default = default_function
        self._compiled: dict[str, _Compiled] = {}
        # Fail at load time, before any work: callers decide up front whether this package can
        # be checked here at all.
        for name, func in program.functions.items():
            for op in func.operations:
                _check_supported(op, name)

    @classmethod
    def load(cls, package_path: str | Path, functions: Sequence[str] | None = None) -> "ProgramExecutor":
        """Load the MIL program of an ``.mlpackage``: all functions, or only ``functions``
        (only their weights are read: one function of a 1B model instead of all of them)."""
        from coremltools.converters.mil.frontend.milproto.load import load as load_milproto
        from coremltools.models.utils import _try_get_weights_dir_path

        path = str(package_path)
        spec = _program_spec(path)
        if functions is not None:
            missing = set(functions) - set(spec.mlProgram.functions)
            if missing:
                raise KeyError(f"no function {sorted(missing)} in {path}; it has {sorted(spec.mlProgram.functions)}")
            for name in list(spec.mlProgram.functions):
                if name not in functions:
                    del spec.mlProgram.functions[name]
            kept = [f for f in spec.description.functions if f.name in functions]
            del spec.description.functions[:]
            spec.description.functions.extend(kept)
            if kept and spec.description.defaultFunctionName not in functions:
                spec.description.defaultFunctionName = functions[0]
        weights_dir = _try_get_weights_dir_path(path) or str(Path(path) / "Data" / "com.apple.CoreML" / "weights")
        declared = _declared_in_spec(spec, list(spec.mlProgram.functions))
        try:
            program = load_milproto(spec, spec.specificationVersion, file_weights_dir=weights_dir)
        except AssertionError as error:
            # coremltools infers every op's type again while loading and asserts it equals the saved one.
            if "var types" not in str(error):
                raise
            raise DeclaredTypeMismatch(
                f"{path}: function(s) {', '.join(spec.mlProgram.functions)}: the saved program declares types "
                f"that coremltools' own type inference does not give ({error})"
            ) from None
        return cls(program, spec.description.defaultFunctionName or None, declared)

    @staticmethod
    def function_names_of(package_path: str | Path) -> list[str]:
        """The functions of a package, from its spec alone (no weights read)."""
        return list(_program_spec(str(package_path)).mlProgram.functions)

    @property
    def function_names(self) -> list[str]:
        return list(self._program.functions)

    @property
    def default_function(self) -> str:
        return self._default

    def _function(self, function: str | None) -> tuple[str, Any]:
        name = function or self._default
        if name not in self._program.functions:
            raise KeyError(f"no function {name!r}; the package has {self.function_names}")
        return name, self._program.functions[name]

    def op_types(self, function: str | None = None) -> set[str]:
        """Op types used by ``function`` (default function when None), nested blocks included."""
        _, func = self._function(function)
        found: set[str] = set()

        def walk(block: Any) -> None:
            for op in block.operations:
                found.add(op.op_type)
                for inner in op.blocks:
                    walk(inner)

        walk(func)
        return found

    def make_state(self, function: str | None = None) -> dict[str, np.ndarray]:
        """Fresh zero-filled state arrays for ``function``, keyed by state name."""
        compiled = self._compile(function)
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in compiled.states.items()}

    def predict(
        self,
        inputs: dict[str, np.ndarray],
        state: dict[str, np.ndarray] | None = None,
        function: str | None = None,
    ) -> dict[str, np.ndarray]:
        """Run ``function`` on ``inputs``; ``state`` arrays are overwritten with the new state."""
        name, _ = self._function(function)
        compiled = self._compile(name)
        if state is None:
            state = self.make_state(name)
        missing = set(compiled.states) - set(state)
        if missing:
            raise KeyError(f"state for function {name!r} lacks {sorted(missing)}")

        env = list(compiled.env)
        for spec in compiled.inputs:
            if spec.name not in inputs:
                raise KeyError(f"function {name!r} needs input {spec.name!r}")
            env[spec.slot] = self._check_input(name, spec, inputs[spec.name])

        live: dict[str, np.ndarray] = {}
        for key, (shape, dtype) in compiled.states.items():
            live[key] = np.asarray(state[key]).astype(dtype, copy=False)
            if live[key].shape != shape:
                raise ValueError(f"state {key!r} of function {name!r} has shape {live[key].shape}, expected {shape}")
        written: set[str] = set()
        for step in compiled.steps:
            if step.kind == _READ:
                env[step.outs[0]] = live[step.state]
                continue
            if step.kind == _WRITE:
                value = np.asarray(env[step.args[0][1]])  # type: ignore[index]
                shape, dtype = compiled.states[step.state]
                if value.shape != shape:  # Core ML writes a state whole: the shapes must agree
                    raise DeclaredTypeMismatch(
                        f"function {name!r}: {step.op_type!r} -> {step.label!r} writes {value.shape} "
                        f"into state {step.state!r} of shape {shape}"
                    )
                value = value.astype(dtype, copy=False)
                live[step.state] = value
                written.add(step.state)
                env[step.outs[0]] = value
                continue
            self._run_step(step, env, name)

        for key in written:
            if state[key].shape == live[key].shape and state[key].dtype == live[key].dtype:
                np.copyto(state[key], live[key])  # keep the caller's arrays
            else:
                state[key] = np.array(live[key])
        return {out_name: np.asarray(env[slot]) for out_name, slot in compiled.outputs}

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_input(function: str, spec: _InputSpec, value: Any) -> np.ndarray:
        arr = np.asarray(value)
        if len(arr.shape) != len(spec.shape) or any(
            want is not None and want != got for want, got in zip(spec.shape, arr.shape)
        ):
            shown = tuple("?" if d is None else d for d in spec.shape)
            raise ValueError(
                f"input {spec.name!r} of function {function!r} has shape {arr.shape}, expected {shown}"
            )
        return arr.astype(spec.dtype, copy=False) if spec.dtype is not None else arr

    @staticmethod
    def _run_step(step: _Step, env: list[Any], function: str) -> None:
        args: Args = {}
        for param, ref in step.args:
            args[param] = [env[i] for i in ref] if isinstance(ref, tuple) else env[ref]
        try:
            result = step.fn(args)  # type: ignore[misc]
        except UnsupportedOp as exc:
            raise UnsupportedOp(f"{exc} (op {step.op_type!r} -> {step.label!r} in function {function!r})") from None
        except Exception as exc:
            exc.add_note(f"while running op {step.op_type!r} -> {step.label!r} in function {function!r}")
            raise
        results = result if len(step.outs) > 1 else (result,)
        for index, (slot, value, dtype) in enumerate(zip(step.outs, results, step.dtypes)):
            value = np.asarray(value)
            declared = step.declared[index] if index < len(step.declared) else None
            if declared is not None and declared.mismatch(value) is not None:
                raise DeclaredTypeMismatch(
                    f"function {function!r}: op {step.op_type!r} -> {step.label!r} declares "
                    f"{declared.describe()} but computes {value.dtype} rank {value.ndim} {tuple(value.shape)}"
                )
            if dtype is not None and value.dtype != dtype:
                value = value.astype(dtype)
            env[slot] = value

    def _compile(self, function: str | None) -> _Compiled:
        """Resolve slots, fold every constant-only op (constexpr included) once, and cache."""
        from coremltools.converters.mil.mil import types

        name, func = self._function(function)
        if name in self._compiled:
            return self._compiled[name]

        slots: dict[int, int] = {}
        env: list[Any] = []
        static: set[int] = set()

        def slot_of(var: Any) -> int:
            key = id(var)
            if key not in slots:
                slots[key] = len(env)
                env.append(None)
            return slots[key]

        inputs: list[_InputSpec] = []
        states: dict[str, tuple[tuple[int, ...], Any]] = {}
        state_slots: dict[int, str] = {}
        for in_name, var in func.inputs.items():
            slot = slot_of(var)
            if types.is_state(var.sym_type):
                wrapped = var.sym_type.wrapped_type()
                dtype = np.dtype(types.nptype_from_builtin(wrapped.get_primitive()))
                states[in_name] = (tuple(int(d) for d in wrapped.get_shape()), dtype)
                state_slots[slot] = in_name
            else:
                inputs.append(_InputSpec(in_name, slot, _declared_dtype(var), _concrete_shape(var.shape)))

        in_spec = self._declared.get(name)

        def declared_of(var: Any) -> _Declared | None:
            if in_spec is not None:
                return in_spec.get(var.name)
            return _declared_of_var(var)

        steps: list[_Step] = []
        for op in func.operations:
            label = _label(op)
            _check_supported(op, name)
            if op.op_type == "const":
                slot = slot_of(op.outputs[0])
                env[slot] = _const_value(op.outputs[0])
                static.add(slot)
                continue
            if op.op_type in _STATE_OPS:
                state_var = op.inputs["input"] if op.op_type == "read_state" else op.inputs["state"]
                state_name = state_slots.get(slots.get(id(state_var), -1))
                if state_name is None:
                    raise UnsupportedOp(f"{op.op_type} ({label!r}) in function {name!r} does not act on a state input")
                args: tuple[tuple[str, Any], ...] = ()
                if op.op_type == "coreml_update_state":
                    args = (("value", slot_of(op.inputs["value"])),)
                kind = _READ if op.op_type == "read_state" else _WRITE
                declared = declared_of(op.outputs[0])
                state_shape, state_dtype = states[state_name]
                if declared is not None and declared.mismatch(np.empty(state_shape, state_dtype)) is not None:
                    raise DeclaredTypeMismatch(
                        f"function {name!r}: op {op.op_type!r} -> {label!r} declares {declared.describe()} "
                        f"for state {state_name!r} of {state_dtype} {state_shape}"
                    )
                steps.append(_Step(kind, op.op_type, label, None, args, (slot_of(op.outputs[0]),), (None,), state_name))
                continue
            impl = _OPS[op.op_type]
            arg_list: list[tuple[str, Any]] = []
            for param, value in op.inputs.items():
                if isinstance(value, (list, tuple)):
                    arg_list.append((param, tuple(slot_of(v) for v in value)))
                else:
                    arg_list.append((param, slot_of(value)))
            step = _Step(
                _CALL,
                op.op_type,
                label,
                impl.fn,
                tuple(arg_list),
                tuple(slot_of(o) for o in op.outputs),
                tuple(_declared_dtype(o) for o in op.outputs),
                declared=tuple(declared_of(o) for o in op.outputs),
            )
            refs = [r for _, ref in arg_list for r in (ref if isinstance(ref, tuple) else (ref,))]
            if all(r in static for r in refs):
                # Depends on constants only (constexpr decompression, casts of weights, shape
                # arithmetic on constants): evaluate once here instead of on every call.
                self._run_step(step, env, name)
                static.update(step.outs)
            else:
                steps.append(step)

        outputs = [(var.name, slot_of(var)) for var in func.outputs]
        self._widen_static_operands(steps, env, static)

        # Drop folded intermediates nobody reads at run time (e.g. the compressed blobs).
        needed = {r for s in steps for _, ref in s.args for r in (ref if isinstance(ref, tuple) else (ref,))}
        needed |= {slot for _, slot in outputs}
        env = [v if (i in needed or i not in static) else None for i, v in enumerate(env)]

        compiled = _Compiled(steps, env, inputs, states, state_slots, outputs)
        self._compiled[name] = compiled
        return compiled

    @staticmethod
    def _widen_static_operands(steps: list[_Step], env: list[Any], static: set[int]) -> None:
        """Pre-convert float16 constant matmul operands to float32 once, up to a memory budget.

        linear/matmul widen their operands anyway (see ``_f32``, exact for float16), so the
        result is the same either way; doing it for the weights here keeps that per-call
        conversion off the hot path. Past ``WIDEN_BUDGET_BYTES`` of float32 copies (a 1B model's
        would be 5 GB) the weights stay float16 and are widened per call.
        """
        widened: dict[int, int] = {}
        spent = 0
        for step in steps:
            if step.op_type not in ("linear", "matmul"):
                continue
            new_args = []
            for param, ref in step.args:
                if isinstance(ref, int) and ref in static and getattr(env[ref], "dtype", None) == np.float16:
                    if ref not in widened and spent + env[ref].size * 4 <= WIDEN_BUDGET_BYTES:
                        widened[ref] = len(env)
                        env.append(env[ref].astype(np.float32))
                        static.add(widened[ref])
                        spent += env[ref].size * 4
                    ref = widened.get(ref, ref)
                new_args.append((param, ref))
            step.args = tuple(new_args)
