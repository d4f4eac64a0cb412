"""Linear algebra, reductions and normalization."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from adapterpack.formats.mlpackage.executor.elementwise import _eps, _per_channel, _softmax
from adapterpack.formats.mlpackage.executor.registry import (
    Args,
    Handler,
    _axes,
    _axis,
    _bool,
    _f32,
    _int,
    _register,
)

# --------------------------------------------------------------------------- linear algebra


# A float16 weight larger than this is widened to float32 a slice of output rows at a time:
# widening a 3B model's 128256 x 3072 lm_head whole would hold 1.6 GB for one product.
WIDEN_SLICE_VALUES = 1 << 24
# float16 x float16 products in torch's kernel (see _times_weight); False widens them in numpy,
# as the executor did before (benchmarks/build_time.py --verify-previous compares the two).
FLOAT16_PRODUCTS_IN_TORCH = True


def _times_weight(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x @ weight.T (+ bias)`` for a (out, in) weight, accumulated in float32 (see ``_f32``).

    float16 activations times a float16 weight, every projection of a float16 program, run in
    torch's CPU kernel: it widens each element as it multiplies, sums in float32 and rounds the
    result (bias included) to float16 once, the float32 product this function otherwise
    computes, rounded as the op's output is. It needs no float32 copy of the weight (widening
    the weights on every call was most of verify's time at 1B) and uses every core. A product
    that leaves float16's range is computed again in float32, so that the overflow is reported
    with its size. Otherwise float16 weights are widened a slice at a time.
    """
    x = np.asarray(x)
    both_float16 = x.dtype == np.float16 and weight.dtype == np.float16 and (bias is None or bias.dtype == np.float16)
    if FLOAT16_PRODUCTS_IN_TORCH and both_float16 and weight.ndim == 2:
        product = _float16_product(x, weight, bias)
        if np.isfinite(product).all():
            return product
    x = _f32(x)
    if weight.dtype != np.float16 or weight.ndim != 2 or weight.size <= WIDEN_SLICE_VALUES:
        y = np.matmul(x, _f32(weight).T)
    else:
        rows = max(1, WIDEN_SLICE_VALUES // weight.shape[1])
        y = np.empty(x.shape[:-1] + (weight.shape[0],), np.float32)
        for start in range(0, weight.shape[0], rows):
            y[..., start : start + rows] = np.matmul(x, weight[start : start + rows].astype(np.float32).T)
    return y if bias is None else y + _f32(bias)


def _float16_product(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    import torch

    with torch.no_grad():
        found = torch.nn.functional.linear(
            torch.from_numpy(np.ascontiguousarray(x)),
            torch.from_numpy(np.ascontiguousarray(weight)),
            None if bias is None else torch.from_numpy(np.ascontiguousarray(bias)),
        )
    return found.numpy()


@_register("linear", "x weight bias")
def _linear(a: Args) -> np.ndarray:
    bias = a.get("bias")
    return _times_weight(a["x"], np.asarray(a["weight"]), None if bias is None else np.asarray(bias))


@_register("matmul", "x y transpose_x transpose_y")
def _matmul(a: Args) -> np.ndarray:
    x, y = a["x"], np.asarray(a["y"])
    if _bool(a.get("transpose_y")) and y.ndim == 2 and not _bool(a.get("transpose_x")):
        return _times_weight(x, y)  # x @ W.T, as lm_heads tied to the embedding are written
    x, y = _f32(x), _f32(y)
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


