"""Elementwise ops and activations."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from adapterpack.formats.mlpackage.executor.registry import (
    _CAST_DTYPES,
    Args,
    Handler,
    UnsupportedOp,
    _f32,
    _int,
    _register,
    _str,
)

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


