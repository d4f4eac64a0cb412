"""The op registry of the numpy ML Program executor: each op type with the parameters it
interprets, and the small helpers its kernels share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


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


