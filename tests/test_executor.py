"""Tests for the numpy ML Program executor (``adapterpack.formats.mlpackage.executor``).

Every supported op gets a tiny MIL program that is converted, saved as an ``.mlpackage`` and run
back through the executor, so the whole path (proto serialization, milproto loading, blob
weights, the interpreter) is exercised, not just the numpy kernels. References are computed
independently with numpy / torch / coremltools' own decompression.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

ct = pytest.importorskip("coremltools")

from coremltools.converters.mil import Builder as mb  # noqa: E402
from coremltools.converters.mil.mil import Function, Program, types  # noqa: E402

from adapterpack.formats.mlpackage.executor import SUPPORTED_OPS, ProgramExecutor, UnsupportedOp  # noqa: E402

IOS18 = ct.target.iOS18
IOS16 = ct.target.iOS16

_MB_DTYPES = {
    np.dtype(np.float32): types.fp32,
    np.dtype(np.float16): types.fp16,
    np.dtype(np.int32): types.int32,
}


@pytest.fixture(autouse=True, scope="module")
def _no_gc_in_convert():
    """Skip the full ``gc.collect()`` ct.convert runs after every conversion.

    With torch and transformers imported it costs ~0.25 s per call, which would dominate the
    ~100 tiny conversions below; it frees nothing these tests need.
    """
    from types import SimpleNamespace

    from coremltools.converters import _converters_entry

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_converters_entry, "gc", SimpleNamespace(collect=lambda *a: 0))
        yield


def convert_and_load(prog: Program, path: Path, target=IOS18) -> ProgramExecutor:
    """Serialize ``prog`` as an mlpackage and load it back through the executor.

    The empty pass pipeline keeps the program exactly as built: the default pipeline would fold
    or fuse some of the single ops under test away (and insert fp16 casts).
    """
    model = ct.convert(
        prog,
        convert_to="mlprogram",
        minimum_deployment_target=target,
        pass_pipeline=ct.PassPipeline.EMPTY,
        skip_model_load=True,
    )
    model.save(str(path))
    return ProgramExecutor.load(path)


def build_program(inputs: dict[str, np.ndarray], body: Callable, target=IOS18) -> Program:
    """One-function program whose inputs are typed after the given example arrays."""
    specs = {
        name: mb.TensorSpec(shape=arr.shape, dtype=_MB_DTYPES[arr.dtype]) for name, arr in inputs.items()
    }
    with Function(specs, opset_version=target) as func:
        outs = body(**func.inputs)
        func.set_outputs(list(outs) if isinstance(outs, (list, tuple)) else [outs])
    prog = Program()
    prog.add_function("main", func)
    return prog


# --------------------------------------------------------------------------- op cases

rng = np.random.default_rng(0)
X = rng.standard_normal((2, 3, 4)).astype(np.float32)
Y = rng.standard_normal((3, 4)).astype(np.float32)
POS = (np.abs(X) + 0.5).astype(np.float32)
UNIT = rng.uniform(-0.9, 0.9, (2, 3, 4)).astype(np.float32)
IX = rng.integers(-3, 4, (2, 3, 4)).astype(np.int32)
IY = rng.integers(-3, 4, (3, 4)).astype(np.int32)
X16 = X.astype(np.float16)
X4 = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)


@dataclass
class Case:
    op: str
    build: Callable
    ref: Callable
    inputs: dict[str, np.ndarray]
    id: str = ""
    rtol: float = 1e-5
    atol: float = 1e-6
    extra_ops: tuple[str, ...] = field(default_factory=tuple)


CASES: list[Case] = []


def case(op: str, build: Callable, ref: Callable, inputs: dict[str, np.ndarray], **kw) -> None:
    CASES.append(Case(op, build, ref, inputs, **kw))


def to_i32(v):
    return mb.cast(x=v, dtype="int32")


# elementwise binary
for name, fn, xs in [
    ("add", np.add, (X, Y)),
    ("sub", np.subtract, (X, Y)),
    ("mul", np.multiply, (X, Y)),
    ("real_div", np.divide, (X, POS[0])),
    ("floor_div", np.floor_divide, (X * 4, POS[0])),
    ("mod", np.mod, (X * 4, POS[0])),
    ("pow", np.power, (POS, Y)),
    ("maximum", np.maximum, (X, Y)),
    ("minimum", np.minimum, (X, Y)),
]:
    case(name, lambda x, y, _n=name: getattr(mb, _n)(x=x, y=y), fn, {"x": xs[0], "y": xs[1]}, rtol=1e-5, atol=1e-5)

case("add", lambda x, y: mb.add(x=x, y=y), np.add, {"x": IX, "y": IY}, id="add-int32")
case("mul", lambda x, y: mb.mul(x=x, y=y), lambda x, y: x.astype(np.float64) * y, {"x": X16, "y": Y.astype(np.float16)},
     id="mul-fp16", rtol=1e-3, atol=1e-3)

# Core ML has no bool model inputs/outputs: comparisons are cast to int32 inside the program.
for name, fn in [
    ("equal", np.equal),
    ("not_equal", np.not_equal),
    ("less", np.less),
    ("less_equal", np.less_equal),
    ("greater", np.greater),
    ("greater_equal", np.greater_equal),
]:
    case(name, lambda x, y, _n=name: to_i32(getattr(mb, _n)(x=x, y=y)), lambda x, y, _f=fn: _f(x, y).astype(np.int32),
         {"x": IX, "y": IY}, extra_ops=("cast",))

for name, fn in [("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)]:
    case(name, lambda x, y, _n=name: to_i32(getattr(mb, _n)(x=mb.greater(x=x, y=0), y=mb.greater(x=y, y=0))),
         lambda x, y, _f=fn: _f(x > 0, y > 0).astype(np.int32), {"x": IX, "y": IY}, extra_ops=("cast", "greater"))
case("logical_not", lambda x: to_i32(mb.logical_not(x=mb.greater(x=x, y=0))), lambda x: (x <= 0).astype(np.int32),
     {"x": IX}, extra_ops=("cast", "greater"))


def _erf(x):
    return np.vectorize(math.erf)(x.astype(np.float64))


def _sig(x):
    return 1 / (1 + np.exp(-x.astype(np.float64)))


# elementwise unary
for name, fn, x in [
    ("abs", np.abs, X),
    ("acos", np.arccos, UNIT),
    ("asin", np.arcsin, UNIT),
    ("atan", np.arctan, X),
    ("atanh", np.arctanh, UNIT),
    ("ceil", np.ceil, X * 3),
    ("cos", np.cos, X),
    ("cosh", np.cosh, X),
    ("exp", np.exp, X),
    ("exp2", np.exp2, X),
    ("floor", np.floor, X * 3),
    ("round", np.round, np.round(X * 4) / 2),  # includes exact .5 halves
    ("sign", np.sign, np.round(X)),
    ("sin", np.sin, X),
    ("sinh", np.sinh, X),
    ("sqrt", np.sqrt, POS),
    ("square", np.square, X),
    ("tan", np.tan, UNIT),
    ("tanh", np.tanh, X),
    ("identity", lambda v: v, X),
    ("relu", lambda v: np.maximum(v, 0), X),
    ("relu6", lambda v: np.clip(v, 0, 6), X * 5),
    ("erf", _erf, X),
    ("sigmoid", _sig, X),
    ("silu", lambda v: v * _sig(v), X),
    ("softplus", lambda v: np.log1p(np.exp(v.astype(np.float64))), X),
    ("softsign", lambda v: v / (1 + np.abs(v)), X),
]:
    case(name, lambda x, _n=name: getattr(mb, _n)(x=x), fn, {"x": x}, rtol=1e-5, atol=1e-5)

case("silu", lambda x: mb.silu(x=x), lambda v: v * _sig(v), {"x": X16}, id="silu-fp16", rtol=2e-3, atol=1e-3)
case("rsqrt", lambda x: mb.rsqrt(x=x, epsilon=1e-3), lambda v: 1 / np.sqrt(v + 1e-3), {"x": POS})
case("rsqrt", lambda x: mb.rsqrt(x=x), lambda v: 1 / np.sqrt(v.astype(np.float64)), {"x": POS.astype(np.float16)},
     id="rsqrt-fp16", rtol=2e-3)
case("inverse", lambda x: mb.inverse(x=x, epsilon=1e-2), lambda v: 1 / (v + 1e-2), {"x": POS})
case("log", lambda x: mb.log(x=x), np.log, {"x": POS}, atol=1e-5)
case("clip", lambda x: mb.clip(x=x, alpha=-0.5, beta=0.5), lambda v: np.clip(v, -0.5, 0.5), {"x": X})
case("threshold", lambda x: mb.threshold(x=x, alpha=0.1), lambda v: np.maximum(v, 0.1), {"x": X})
for dtype, src, want in [("int32", X * 3, lambda v: np.trunc(v).astype(np.int32)),
                         ("fp16", IX, lambda v: v.astype(np.float16)),
                         ("fp32", X16, lambda v: v.astype(np.float32))]:
    case("cast", lambda x, _d=dtype: mb.cast(x=x, dtype=_d), want, {"x": src}, id=f"cast-{src.dtype}-{dtype}", atol=0)
case("select", lambda x, y: mb.select(cond=mb.greater(x=x, y=0.0), a=x, b=y), lambda x, y: np.where(x > 0, x, y),
     {"x": X, "y": Y}, extra_ops=("greater",))

# activations
for mode, fn in [
    ("EXACT", lambda v: 0.5 * v * (1 + _erf(v / math.sqrt(2)))),
    ("TANH_APPROXIMATION", lambda v: 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))),
    ("SIGMOID_APPROXIMATION", lambda v: v * _sig(1.702 * v)),
]:
    case("gelu", lambda x, _m=mode: mb.gelu(x=x, mode=_m), fn, {"x": X}, id=f"gelu-{mode}", atol=1e-5)
case("leaky_relu", lambda x: mb.leaky_relu(x=x, alpha=0.1), lambda v: np.where(v >= 0, v, 0.1 * v), {"x": X})
case("elu", lambda x: mb.elu(x=x, alpha=0.7), lambda v: np.where(v > 0, v, 0.7 * np.expm1(v)), {"x": X})
case("thresholded_relu", lambda x: mb.thresholded_relu(x=x, alpha=0.3), lambda v: np.where(v >= 0.3, v, 0), {"x": X})
case("clamped_relu", lambda x: mb.clamped_relu(x=x, alpha=0.2, beta=0.8),
     lambda v: np.where(v >= 0, np.minimum(v, 0.8), np.minimum(0.2 * v, 0.8)), {"x": X})
case("linear_activation", lambda x: mb.linear_activation(x=x, alpha=2.0, beta=-1.0), lambda v: 2 * v - 1, {"x": X})
case("scaled_tanh", lambda x: mb.scaled_tanh(x=x, alpha=1.5, beta=0.5), lambda v: 1.5 * np.tanh(0.5 * v), {"x": X})
case("sigmoid_hard", lambda x: mb.sigmoid_hard(x=x, alpha=0.2, beta=0.5), lambda v: np.clip(0.2 * v + 0.5, 0, 1),
     {"x": X})
ALPHA3 = np.array([0.1, 0.2, 0.3], np.float32)
case("prelu", lambda x: mb.prelu(x=x, alpha=ALPHA3), lambda v: np.where(v >= 0, v, v * ALPHA3[:, None, None]),
     {"x": X4})
case("softplus_parametric", lambda x: mb.softplus_parametric(x=x, alpha=ALPHA3 * 10, beta=ALPHA3 * 5),
     lambda v: (ALPHA3 * 10)[:, None] * np.log1p(np.exp((ALPHA3 * 5)[:, None] * v)), {"x": X}, atol=1e-5)


def _np_softmax(v, axis):
    e = np.exp(v - v.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


case("softmax", lambda x: mb.softmax(x=x, axis=1), lambda v: _np_softmax(v.astype(np.float64), 1), {"x": X})
case("softmax", lambda x: mb.softmax(x=x), lambda v: _np_softmax(v.astype(np.float64), -1), {"x": X16},
     id="softmax-fp16", rtol=2e-3, atol=1e-3)

# linear algebra
W = rng.standard_normal((5, 4)).astype(np.float32)
B = rng.standard_normal(5).astype(np.float32)
case("linear", lambda x: mb.linear(x=x, weight=W, bias=B), lambda v: v @ W.T + B, {"x": X})
case("linear", lambda x: mb.linear(x=x, weight=W.astype(np.float16)), lambda v: v.astype(np.float64) @ W.T,
     {"x": X16}, id="linear-fp16", rtol=3e-3, atol=3e-3)
M = rng.standard_normal((2, 4, 5)).astype(np.float32)
case("matmul", lambda x, y: mb.matmul(x=x, y=y), lambda x, y: x @ y, {"x": X, "y": M})
case("matmul", lambda x, y: mb.matmul(x=x, y=y, transpose_x=True, transpose_y=True),
     lambda x, y: np.swapaxes(x, -1, -2) @ np.swapaxes(y, -1, -2), {"x": X, "y": M.swapaxes(1, 2)[:, :, :3].copy()},
     id="matmul-transposed")
case("matmul", lambda x, y: mb.matmul(x=x, y=y), lambda x, y: x.astype(np.float64) @ y,
     {"x": X16, "y": M.astype(np.float16)},
     id="matmul-fp16", rtol=3e-3, atol=3e-3)

Q = rng.standard_normal((1, 2, 3, 8)).astype(np.float16)
K = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
V = rng.standard_normal((1, 2, 5, 8)).astype(np.float16)
FMASK = np.where(np.arange(5)[None, :] <= np.arange(3)[:, None] + 2, 0, -1e4).astype(np.float16)[None, None]


def _torch_sdpa(q, k, v, mask=None):
    def t(a):
        return torch.from_numpy(a if a.dtype == bool else np.asarray(a, np.float32))

    return torch.nn.functional.scaled_dot_product_attention(
        t(q), t(k), t(v), attn_mask=None if mask is None else t(mask)
    ).numpy()


case("scaled_dot_product_attention",
     lambda q, k, v, m: mb.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=m),
     lambda q, k, v, m: _torch_sdpa(q, k, v, m), {"q": Q, "k": K, "v": V, "m": FMASK}, id="sdpa-float-mask",
     rtol=1e-2, atol=5e-3)
case("scaled_dot_product_attention",
     lambda q, k, v, m: mb.scaled_dot_product_attention(query=q, key=k, value=v,
                                                        attn_mask=mb.equal(x=m, y=np.float16(0))),
     lambda q, k, v, m: _torch_sdpa(q, k, v, m == 0), {"q": Q, "k": K, "v": V, "m": FMASK}, id="sdpa-bool-mask",
     rtol=1e-2, atol=5e-3, extra_ops=("equal",))
case("scaled_dot_product_attention", lambda q, k, v: mb.scaled_dot_product_attention(query=q, key=k, value=v),
     lambda q, k, v: _torch_sdpa(q, k, v), {"q": Q, "k": K, "v": V}, id="sdpa-no-mask",
     rtol=1e-2, atol=5e-3)

# reductions
for name, fn in [
    ("reduce_sum", np.sum),
    ("reduce_mean", np.mean),
    ("reduce_prod", np.prod),
    ("reduce_max", np.max),
    ("reduce_min", np.min),
    ("reduce_l1_norm", lambda v, axis, keepdims: np.sum(np.abs(v), axis=axis, keepdims=keepdims)),
    ("reduce_l2_norm", lambda v, axis, keepdims: np.sqrt(np.sum(v * v, axis=axis, keepdims=keepdims))),
    ("reduce_sum_square", lambda v, axis, keepdims: np.sum(v * v, axis=axis, keepdims=keepdims)),
    ("reduce_log_sum", lambda v, axis, keepdims: np.log(np.sum(v, axis=axis, keepdims=keepdims))),
    ("reduce_log_sum_exp", lambda v, axis, keepdims: np.log(np.sum(np.exp(v), axis=axis, keepdims=keepdims))),
]:
    src = POS if name == "reduce_log_sum" else X
    case(name, lambda x, _n=name: getattr(mb, _n)(x=x, axes=[-1, 0], keep_dims=True),
         lambda v, _f=fn: _f(v.astype(np.float64), axis=(0, 2), keepdims=True), {"x": src}, id=f"{name}-keep",
         atol=1e-5)
    case(name, lambda x, _n=name: getattr(mb, _n)(x=x, axes=[1]),
         lambda v, _f=fn: _f(v.astype(np.float64), axis=1, keepdims=False), {"x": src}, id=f"{name}-drop", atol=1e-5)
case("reduce_mean", lambda x: mb.reduce_mean(x=x, axes=[-1], keep_dims=True),
     lambda v: v.astype(np.float64).mean(-1, keepdims=True), {"x": X16}, id="reduce_mean-fp16", rtol=2e-3, atol=1e-3)
case("reduce_sum", lambda x: mb.reduce_sum(x=x), lambda v: np.sum(v), {"x": X}, id="reduce_sum-all", atol=1e-5)
case("reduce_argmax", lambda x: mb.reduce_argmax(x=x, axis=1), lambda v: np.argmax(v, 1).astype(np.int32), {"x": X})
case("reduce_argmin", lambda x: mb.reduce_argmin(x=x, axis=-1, keep_dims=True),
     lambda v: np.argmin(v, -1)[..., None].astype(np.int32), {"x": X})


# normalization
def _ln(v, axes, eps=1e-5):
    v = v.astype(np.float64)
    m = v.mean(axis=axes, keepdims=True)
    return (v - m) / np.sqrt(v.var(axis=axes, keepdims=True) + eps)


G4 = rng.standard_normal(4).astype(np.float32)
case("layer_norm", lambda x: mb.layer_norm(x=x, axes=[-1], gamma=G4, beta=G4 / 2, epsilon=1e-5),
     lambda v: _ln(v, -1) * G4 + G4 / 2, {"x": X}, atol=1e-5)
case("layer_norm", lambda x: mb.layer_norm(x=x, axes=[1, 2]), lambda v: _ln(v, (1, 2)), {"x": X}, id="layer_norm-2axes",
     atol=1e-5)
case("batch_norm",
     lambda x: mb.batch_norm(x=x, mean=ALPHA3, variance=ALPHA3 + 1, gamma=ALPHA3 * 2, beta=-ALPHA3, epsilon=1e-3),
     lambda v: (v - ALPHA3[:, None, None]) / np.sqrt(ALPHA3[:, None, None] + 1 + 1e-3) * (ALPHA3 * 2)[:, None, None]
     - ALPHA3[:, None, None], {"x": X4}, atol=1e-5)
case("instance_norm", lambda x: mb.instance_norm(x=x, gamma=ALPHA3, beta=ALPHA3, epsilon=1e-5),
     lambda v: _ln(v, (2, 3)) * ALPHA3[:, None, None] + ALPHA3[:, None, None], {"x": X4}, atol=1e-5)
case("l2_norm", lambda x: mb.l2_norm(x=x, epsilon=1e-3),
     lambda v: v / np.sqrt(np.sum(v.astype(np.float64) ** 2, axis=(1, 2, 3), keepdims=True) + 1e-3), {"x": X4})

# shape manipulation
# iOS17+ semantics: a 0 copies the input dim aligned from the right, so [0, -1] keeps dim 1.
case("reshape", lambda x: mb.reshape(x=x, shape=[0, -1]), lambda v: v.reshape(3, 8), {"x": X})
case("reshape", lambda x: mb.reshape(x=x, shape=[1, 0, -1, 0]), lambda v: v.reshape(1, 2, 3, 4), {"x": X},
     id="reshape-zeros-right-aligned")
case("expand_dims", lambda x: mb.expand_dims(x=x, axes=[0, -1]), lambda v: v[None, ..., None], {"x": X})
case("squeeze", lambda x: mb.squeeze(x=x, axes=[0, -2]), lambda v: v.reshape(3, 4), {"x": X[:1, :, None, :]})
case("squeeze", lambda x: mb.squeeze(x=x), lambda v: v.reshape(3, 4), {"x": X[:1, :, None, :]}, id="squeeze-all")
case("transpose", lambda x: mb.transpose(x=x, perm=[2, 0, 1]), lambda v: v.transpose(2, 0, 1), {"x": X})
case("flatten2d", lambda x: mb.flatten2d(x=x, axis=-1), lambda v: v.reshape(6, 4), {"x": X})
case("concat", lambda x, y: mb.concat(values=[x, mb.expand_dims(x=y, axes=[0]), x], axis=0),
     lambda x, y: np.concatenate([x, y[None], x]), {"x": X, "y": Y}, extra_ops=("expand_dims",))
case("concat", lambda x: mb.concat(values=[x, mb.mul(x=x, y=2.0)], axis=1, interleave=True),
     lambda v: np.stack([v, 2 * v], axis=2).reshape(2, 6, 4), {"x": X}, id="concat-interleave", extra_ops=("mul",))
case("stack", lambda x: mb.stack(values=[x, x], axis=-1), lambda v: np.stack([v, v], -1), {"x": X})
case("split", lambda x: mb.split(x=x, num_splits=2, axis=-1), lambda v: tuple(np.split(v, 2, -1)), {"x": X})
case("split", lambda x: mb.split(x=x, split_sizes=[1, 3], axis=2), lambda v: (v[..., :1], v[..., 1:]), {"x": X},
     id="split-sizes")
case("tile", lambda x: mb.tile(x=x, reps=[1, 2, 3]), lambda v: np.tile(v, (1, 2, 3)), {"x": X})
case("reverse", lambda x: mb.reverse(x=x, axes=[0, -1]), lambda v: v[::-1, :, ::-1], {"x": X})
case("shape", lambda x: mb.shape(x=x), lambda v: np.array(v.shape, np.int32), {"x": X})
case("range_1d", lambda n: mb.range_1d(start=1, end=mb.squeeze(x=n), step=2),
     lambda n: np.arange(1, n[0], 2).astype(np.int32),
     {"n": np.array([9], np.int32)}, extra_ops=("squeeze",))
case("fill", lambda x: mb.fill(shape=mb.shape(x=x), value=2.5), lambda v: np.full(v.shape, 2.5, np.float32), {"x": X},
     extra_ops=("shape",))
case("fill_like", lambda x: mb.fill_like(ref_tensor=x, value=-1.5), lambda v: np.full(v.shape, -1.5, np.float32),
     {"x": X})
case("slice_by_index",
     lambda x: mb.slice_by_index(x=x, begin=[1, 0, 3], end=[2, 3, 0], stride=[1, 2, -1], end_mask=[False, False, True],
                                 squeeze_mask=[True, False, False]),
     lambda v: v[1, 0:3:2, 3::-1], {"x": X})
case("slice_by_index",
     lambda x: mb.slice_by_index(x=x, begin=[0, 1, 0], end=[0, 0, -1], begin_mask=[True, False, False],
                                                    end_mask=[True, True, False]),
     lambda v: v[:, 1:, :-1], {"x": X}, id="slice_by_index-masks")
case("slice_update",
     lambda x, u: mb.slice_update(x=x, update=u, begin=[0, 1, 0], end=[2, 3, 4], stride=[1, 1, 2]),
     lambda x, u: (lambda o: (o.__setitem__((slice(0, 2), slice(1, 3), slice(0, 4, 2)), u), o)[1])(x.copy()),
     {"x": X, "u": rng.standard_normal((2, 2, 2)).astype(np.float32)})
case("slice_update",
     lambda x, u: mb.slice_update(x=x, update=u, begin=[1, 0, 0], end=[2, 3, 4], squeeze_mask=[True, False, False]),
     lambda x, u: (lambda o: (o.__setitem__(1, u), o)[1])(x.copy()), {"x": X, "u": Y}, id="slice_update-squeeze")
case("slice_by_size", lambda x: mb.slice_by_size(x=x, begin=[1, 0, 1], size=[1, -1, 2]), lambda v: v[1:2, :, 1:3],
     {"x": X})
for mode, np_mode in [("constant", "constant"), ("reflect", "reflect"), ("replicate", "edge")]:
    kw = {"constant_val": 0.5} if mode == "constant" else {}
    case("pad", lambda x, _m=mode, _kw=kw: mb.pad(x=x, pad=[1, 2, 2, 1], mode=_m, **_kw),
         lambda v, _m=np_mode, _kw=kw: np.pad(v, [(0, 0), (1, 2), (2, 1)], mode=_m,
                                              **({"constant_values": 0.5} if _kw else {})), {"x": X}, id=f"pad-{mode}")
case("band_part", lambda x: mb.band_part(x=x, lower=1, upper=0),
     lambda v: v * (np.tril(np.ones((3, 4)), 0) - np.tril(np.ones((3, 4)), -2)), {"x": X})
case("cumsum", lambda x: mb.cumsum(x=x, axis=1), lambda v: np.cumsum(v, 1), {"x": X})
case("cumsum", lambda x: mb.cumsum(x=x, axis=-1, exclusive=True, reverse=True),
     lambda v: np.flip(np.cumsum(np.flip(v, -1), -1), -1) - v, {"x": X}, id="cumsum-exclusive-reverse", atol=1e-5)
case("one_hot", lambda i: mb.one_hot(indices=i, one_hot_vector_size=4, axis=0, on_value=2.0, off_value=-1.0),
     lambda i: np.where(np.arange(4)[:, None, None] == i[None], 2.0, -1.0),
     {"i": np.array([[0, 3, 1], [2, 2, 0]], np.int32)})
case("argsort", lambda x: mb.argsort(x=x, axis=1), lambda v: np.argsort(-v, 1, kind="stable").astype(np.int32),
     {"x": X})
case("argsort", lambda x: mb.argsort(x=x, ascending=True), lambda v: np.argsort(v, -1, kind="stable").astype(np.int32),
     {"x": X}, id="argsort-ascending")
case("topk", lambda x: mb.topk(x=x, k=2, axis=1),
     lambda v: (np.sort(v, 1)[:, ::-1][:, :2], np.argsort(-v, 1, kind="stable")[:, :2].astype(np.int32)), {"x": X})
case("topk", lambda x: mb.topk(x=x, k=3, ascending=True),
     lambda v: (np.sort(v, -1)[..., :3], np.argsort(v, -1, kind="stable")[..., :3].astype(np.int32)), {"x": X},
     id="topk-ascending")
case("topk", lambda x: mb.topk(x=x, k=2, return_indices=False), lambda v: np.sort(v, -1)[..., ::-1][..., :2], {"x": X},
     id="topk-values-only")
case("non_zero", lambda x: mb.non_zero(x=x), lambda v: np.argwhere(v).astype(np.int32), {"x": np.maximum(IX, 0)})

# gather / scatter
case("gather", lambda x, i: mb.gather(x=x, indices=i, axis=1), lambda x, i: np.take(x, i % 3, axis=1),
     {"x": X, "i": np.array([[2, -1], [0, 1]], np.int32)})
case("gather", lambda x, i: mb.gather(x=x, indices=i, axis=1, batch_dims=1),
     lambda x, i: np.stack([x[b][i[b]] for b in range(2)]), {"x": X, "i": np.array([[2, 0], [1, 1]], np.int32)},
     id="gather-batch_dims")
case("gather_along_axis", lambda x, i: mb.gather_along_axis(x=x, indices=i, axis=2),
     lambda x, i: np.take_along_axis(x, i, 2), {"x": X, "i": rng.integers(0, 4, (2, 3, 2)).astype(np.int32)})
case("gather_nd", lambda x, i: mb.gather_nd(x=x, indices=i), lambda x, i: x[i[..., 0], i[..., 1]],
     {"x": X, "i": np.array([[0, 2], [1, 0], [1, 1]], np.int32)})
case("gather_nd", lambda x, i: mb.gather_nd(x=x, indices=i, batch_dims=1),
     lambda x, i: np.stack([x[b][i[b, :, 0]] for b in range(2)]),
     {"x": X, "i": np.array([[[2], [0]], [[1], [1]]], np.int32)}, id="gather_nd-batch_dims")
U2 = rng.standard_normal((2, 2, 4)).astype(np.float32)


def _scatter_add_axis1(x, u, idx):
    out = x.copy().astype(np.float64)
    for j, i in enumerate(idx):
        out[:, i] += u[:, j]
    return out


case("scatter", lambda x, u: mb.scatter(data=x, indices=np.array([2, 2], np.int32), updates=u, axis=1, mode="add"),
     lambda x, u: _scatter_add_axis1(x, u, [2, 2]), {"x": X, "u": U2}, atol=1e-5)
case("scatter", lambda x, u: mb.scatter(data=x, indices=np.array([0, 2], np.int32), updates=u, axis=1, mode="update"),
     lambda x, u: (lambda o: (o.__setitem__((slice(None), [0, 2]), u), o)[1])(x.copy()), {"x": X, "u": U2},
     id="scatter-update")
IA = rng.integers(0, 4, (2, 3, 2)).astype(np.int32)


def _scatter_along(x, u):
    out = x.copy().astype(np.float64)
    for a, b, c in itertools.product(range(2), range(3), range(2)):
        out[a, b, IA[a, b, c]] = max(out[a, b, IA[a, b, c]], u[a, b, c])
    return out


case("scatter_along_axis", lambda x, u: mb.scatter_along_axis(data=x, indices=IA, updates=u, axis=-1, mode="max"),
     _scatter_along, {"x": X, "u": rng.standard_normal((2, 3, 2)).astype(np.float32)})
case("scatter_nd",
     lambda x, u: mb.scatter_nd(data=x, indices=np.array([[0, 1], [1, 2]], np.int32), updates=u, mode="update"),
     lambda x, u: (lambda o: (o.__setitem__(([0, 1], [1, 2]), u), o)[1])(x.copy()), {"x": X, "u": U2[0]})


TESTED_OPS: set[str] = {c.op for c in CASES} | {
    "const",  # every program
    "read_state",
    "coreml_update_state",  # test_state_ops
    "constexpr_lut_to_dense",
    "constexpr_blockwise_shift_scale",
    "constexpr_sparse_to_dense",  # test_compressed_weights + test_constexpr_ios18_direct
    "constexpr_lut_to_sparse",
    "constexpr_sparse_blockwise_shift_scale",  # test_constexpr_ios18_direct
    "constexpr_affine_dequantize",
    "constexpr_cast",  # test_constexpr_ios16
}


def _case_id(c: Case) -> str:
    return c.id or c.op


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_op(c: Case, tmp_path: Path) -> None:
    ex = convert_and_load(build_program(c.inputs, c.build), tmp_path / "op.mlpackage")
    present = ex.op_types()
    assert c.op in present
    assert present <= SUPPORTED_OPS, present - SUPPORTED_OPS
    out = list(ex.predict(dict(c.inputs)).values())
    want = c.ref(*c.inputs.values())
    want = list(want) if isinstance(want, tuple) else [want]
    assert len(out) == len(want)
    for got, ref in zip(out, want):
        ref = np.asarray(ref)
        assert got.shape == ref.shape
        if np.issubdtype(ref.dtype, np.integer) or ref.dtype == bool:
            np.testing.assert_array_equal(got, ref)
        else:
            np.testing.assert_allclose(got.astype(np.float64), ref, rtol=c.rtol, atol=c.atol)


def test_op_outputs_keep_declared_dtype(tmp_path: Path) -> None:
    # fp16 programs stay fp16 end to end (no silent widening to float32 in the outputs).
    inputs = {"x": X16}
    body = lambda x: (mb.softmax(x=x), mb.linear(x=x, weight=W.astype(np.float16)))  # noqa: E731
    ex = convert_and_load(build_program(inputs, body), tmp_path / "m.mlpackage")
    assert [v.dtype for v in ex.predict(inputs).values()] == [np.float16, np.float16]


# --------------------------------------------------------------------------- state


def test_state_ops(tmp_path: Path) -> None:
    specs = {"cache": mb.StateTensorSpec((2, 3), dtype=types.fp16), "x": mb.TensorSpec((2, 3), dtype=types.fp16)}
    with Function(specs, opset_version=IOS18) as func:
        acc = mb.add(x=mb.read_state(input=func.inputs["cache"]), y=func.inputs["x"])
        # Using coreml_update_state's result makes the saved program re-read the state after the
        # write (write_state + read_state in the proto), which the loader folds back.
        updated = mb.coreml_update_state(state=func.inputs["cache"], value=acc)
        func.set_outputs([mb.mul(x=updated, y=np.float16(2))])
    prog = Program()
    prog.add_function("main", func)
    ex = convert_and_load(prog, tmp_path / "state.mlpackage")
    assert {"read_state", "coreml_update_state"} <= ex.op_types()

    state = ex.make_state()
    assert list(state) == ["cache"] and state["cache"].dtype == np.float16 and not state["cache"].any()
    cache = state["cache"]
    x = np.arange(6, dtype=np.float16).reshape(2, 3)
    for step in (1, 2, 3):
        (out,) = ex.predict({"x": x}, state).values()
        np.testing.assert_array_equal(state["cache"], step * x)
        np.testing.assert_array_equal(out, 2 * step * x)
    assert state["cache"] is cache  # updated in place

    # Without a state argument each call starts from zeros.
    (out,) = ex.predict({"x": x}).values()
    np.testing.assert_array_equal(out, 2 * x)


def _cache_update_program(tmp_path: Path, reader: str) -> ProgramExecutor:
    """A state updated by read_state -> slice_update -> coreml_update_state, with one more
    reader of the cache as it was before the update: a slice taken before it (a view of the
    array the update would write into: ``reader="view"``) or the state read again between
    the update and the write (``reader="read"``). Either must see the old values."""
    specs = {"cache": mb.StateTensorSpec((4, 3), dtype=types.fp16), "x": mb.TensorSpec((1, 3), dtype=types.fp16)}
    with Function(specs, opset_version=IOS18) as func:
        cache = mb.read_state(input=func.inputs["cache"])
        before = mb.slice_by_index(x=cache, begin=[0, 0], end=[2, 3]) if reader == "view" else None
        updated = mb.slice_update(x=cache, update=func.inputs["x"], begin=[0, 0], end=[1, 3])
        if reader == "read":
            before = mb.slice_by_index(x=mb.read_state(input=func.inputs["cache"]), begin=[0, 0], end=[2, 3])
        mb.coreml_update_state(state=func.inputs["cache"], value=updated)
        func.set_outputs([mb.add(x=before, y=np.float16(0))])
    prog = Program()
    prog.add_function("main", func)
    return convert_and_load(prog, tmp_path / f"{reader}.mlpackage")


@pytest.mark.parametrize("reader", ["view", "read"])
def test_cache_updates_never_change_what_another_reader_sees(reader: str, tmp_path: Path) -> None:
    ex = _cache_update_program(tmp_path, reader)
    state = {"cache": np.arange(12, dtype=np.float16).reshape(4, 3)}
    (out,) = ex.predict({"x": np.full((1, 3), 100, np.float16)}, state).values()
    np.testing.assert_array_equal(out, np.arange(6, dtype=np.float16).reshape(2, 3))  # the cache before the update
    np.testing.assert_array_equal(state["cache"][0], [100, 100, 100])
    np.testing.assert_array_equal(state["cache"][1:], np.arange(3, 12, dtype=np.float16).reshape(3, 3))


def test_kv_cache_updates_in_place_compute_what_copies_compute(llama, monkeypatch) -> None:
    """A decoder's cache updates write into the cache (no copy of it per layer) and give the
    logits and states that copying updates give."""
    from adapterpack.formats.mlpackage.executor import interpreter

    path, ids, _ = llama
    ex = ProgramExecutor.load(path)
    monkeypatch.setattr(interpreter, "STATE_UPDATES_IN_PLACE", False)
    copied = run_decoder(ex, ids)
    in_place = []
    updated = interpreter._InPlaceUpdates.updated
    monkeypatch.setattr(interpreter._InPlaceUpdates, "updated", lambda self, step, env: in_place.append(step) or updated(self, step, env))
    monkeypatch.setattr(interpreter, "STATE_UPDATES_IN_PLACE", True)
    np.testing.assert_array_equal(run_decoder(ex, ids), copied)
    updates = sum(step.op_type == "slice_update" for step in ex._compile("main").steps)
    assert updates >= 4 and len(in_place) == updates * (ids.shape[1] - PREFILL + 1)  # every update of every call


# --------------------------------------------------------------------------- compressed weights

WC = rng.standard_normal((64, 64)).astype(np.float32)
XC = rng.standard_normal((3, 64)).astype(np.float32)


@pytest.fixture(scope="module")
def dense_weight_model(tmp_path_factory):
    """Program with one 64x64 weight used by a linear and exposed as an output (``mul`` by 1)."""
    prog = build_program(
        {"x": XC, "one": np.ones((1, 1), np.float32)},
        lambda x, one: (mb.linear(x=x, weight=WC), mb.mul(x=WC, y=one)),
    )
    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=IOS18,
                       compute_precision=ct.precision.FLOAT16, skip_model_load=True)
    return model


def _palettize(model, **cfg):
    from coremltools.optimize import coreml as cto

    return cto.palettize_weights(model, cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(**cfg)))


def _quantize(model, **cfg):
    from coremltools.optimize import coreml as cto

    return cto.linear_quantize_weights(model, cto.OptimizationConfig(global_config=cto.OpLinearQuantizerConfig(**cfg)))


def _prune(model, **cfg):
    from coremltools.optimize import coreml as cto

    return cto.prune_weights(model, cto.OptimizationConfig(global_config=cto.OpMagnitudePrunerConfig(**cfg)))


# Palettization uses the "uniform" LUT mode: coremltools' k-means needs scikit-learn for groups this
# small, and the LUT values do not matter here, only the constexpr layout they are stored in.
COMPRESSIONS = {
    "palettize-4bit-grouped": (lambda m: _palettize(m, mode="uniform", nbits=4, granularity="per_grouped_channel",
                                                    group_size=16), "constexpr_lut_to_dense", 0.25),
    "palettize-4bit-tensor": (lambda m: _palettize(m, mode="uniform", nbits=4, granularity="per_tensor"),
                              "constexpr_lut_to_dense", 0.25),
    "quantize-int4-block32": (lambda m: _quantize(m, dtype="int4", granularity="per_block", block_size=32),
                              "constexpr_blockwise_shift_scale", 0.35),
    "quantize-int8-channel": (lambda m: _quantize(m, dtype="int8", granularity="per_channel"),
                              "constexpr_blockwise_shift_scale", 0.05),
    "prune-0.4": (lambda m: _prune(m, target_sparsity=0.4), "constexpr_sparse_to_dense", 0.8),
}


@pytest.mark.parametrize("name", list(COMPRESSIONS))
def test_compressed_weights(name: str, dense_weight_model, tmp_path: Path) -> None:
    from coremltools.optimize import coreml as cto

    compress, op_type, rel_tol = COMPRESSIONS[name]
    compressed = compress(dense_weight_model)
    compressed.save(str(tmp_path / "c.mlpackage"))
    # coremltools' own decompression (materialized_val_inference) is the independent reference.
    cto.decompress_weights(compressed).save(str(tmp_path / "d.mlpackage"))
    ex = ProgramExecutor.load(tmp_path / "c.mlpackage")
    assert op_type in ex.op_types()
    ref_ex = ProgramExecutor.load(tmp_path / "d.mlpackage")
    assert not any(t.startswith("constexpr_") for t in ref_ex.op_types())

    inputs = {"x": XC, "one": np.ones((1, 1), np.float32)}
    y, w = ex.predict(inputs).values()
    y_ref, w_ref = ref_ex.predict(inputs).values()
    # fp32 model I/O: the fp16 pass casts the (float16) weight back to float32 at the output.
    np.testing.assert_array_equal(w, w.astype(np.float16))
    np.testing.assert_array_equal(w, w_ref)  # materialization is bit exact
    np.testing.assert_array_equal(y, y_ref)

    # ...and the compressed weight is an approximation of the dense one.
    assert np.linalg.norm(w - WC) / np.linalg.norm(WC) < rel_tol
    y_dense = XC @ WC.T
    assert np.linalg.norm(y - y_dense) / np.linalg.norm(y_dense) < rel_tol
    if name == "palettize-4bit-grouped":
        for g in range(0, 64, 16):
            assert len(np.unique(w[g:g + 16])) <= 16
    if name == "prune-0.4":
        assert abs((w == 0).mean() - 0.4) < 0.02


@pytest.mark.parametrize("shape, blocks", [((24, 10), 24), ((24, 10), 6), ((24, 10), 1), ((12, 5, 1, 1), 3)])
@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_row_palettes_are_looked_up_as_indexing_does(shape, blocks, chunk, monkeypatch) -> None:
    """Palettes splitting the first axis only (per channel, per group of channels, per tensor)
    are looked up by a gather along rows, a chunk at a time (chunks that split a group of rows
    included): each weight is its palette's entry, as numpy's indexing picks it."""
    from adapterpack.formats.mlpackage.executor import constexpr

    monkeypatch.setattr(constexpr, "GATHER_CHUNK_VALUES", chunk)
    indices = rng.integers(0, 16, shape).astype(np.uint8)
    lut = rng.standard_normal((blocks,) + (1,) * (len(shape) - 1) + (16, 1)).astype(np.float16)
    rows = lut.reshape(blocks, 16)[np.arange(shape[0]) // (shape[0] // blocks)]
    expected = np.take_along_axis(rows, indices.reshape(shape[0], -1).astype(np.int64), axis=1).reshape(shape)
    got = constexpr._lut_to_dense_ios18(indices, lut, None)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, expected)


def _pack_lsb_first(values: np.ndarray, nbits: int) -> np.ndarray:
    bits = ((values.reshape(-1, 1) >> np.arange(nbits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(bits, bitorder="little")


def test_constexpr_ios16(tmp_path: Path) -> None:
    q = rng.integers(0, 256, (4, 6)).astype(np.uint8)
    zp = np.array([120, 128, 130, 0], np.uint8)
    scale = np.array([0.01, 0.02, 0.03, 0.04], np.float32)
    lut = np.array([-1.5, -0.25, 0.5, 2.0], np.float32)
    idx = rng.integers(0, 4, (4, 6))
    mask = rng.random((4, 6)) < 0.5
    nonzero = rng.standard_normal(int(mask.sum())).astype(np.float32)
    src16 = rng.standard_normal((4, 6)).astype(np.float16)

    def body(x):
        w1 = mb.constexpr_affine_dequantize(quantized_data=q, zero_point=zp, scale=scale, axis=0)
        w2 = mb.constexpr_lut_to_dense(lut=lut, indices=_pack_lsb_first(idx, 2), shape=np.array([4, 6], np.uint32))
        packed_mask = _pack_lsb_first(mask.reshape(-1).astype(np.int64), 1)
        w3 = mb.constexpr_sparse_to_dense(nonzero_data=nonzero, mask=packed_mask, shape=np.array([4, 6], np.uint32))
        w4 = mb.constexpr_cast(source_val=src16, output_dtype="fp32")
        return [mb.mul(x=w, y=x) for w in (w1, w2, w3, w4)]

    prog = build_program({"x": np.ones((1, 1), np.float32)}, body, IOS16)
    ex = convert_and_load(prog, tmp_path / "c16.mlpackage", IOS16)
    assert {"constexpr_affine_dequantize", "constexpr_lut_to_dense", "constexpr_sparse_to_dense",
            "constexpr_cast"} <= ex.op_types()
    w1, w2, w3, w4 = ex.predict({"x": np.ones((1, 1), np.float32)}).values()
    np.testing.assert_allclose(w1, (q.astype(np.float32) - zp[:, None]) * scale[:, None], rtol=1e-6)
    np.testing.assert_array_equal(w2, lut[idx])
    dense = np.zeros((4, 6), np.float32)
    dense[mask] = nonzero
    np.testing.assert_array_equal(w3, dense)
    np.testing.assert_array_equal(w4, src16.astype(np.float32))


def test_constexpr_ios18_direct(tmp_path: Path) -> None:
    """Layouts the optimize APIs above do not produce: vector LUTs, int4 offsets, joint sparse ops."""
    idx = rng.integers(0, 4, (4, 3)).astype(np.uint8)
    lut = rng.standard_normal((2, 1, 4, 2)).astype(np.float16)  # 2 row blocks, 2-bit, vectors of 2
    data = rng.integers(-8, 8, (4, 8)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (2, 2)).astype(np.float16)
    offset = rng.integers(-2, 3, (2, 2)).astype(np.int8)
    mask = (rng.random((4, 8)) < 0.6).astype(np.uint8)
    sp_idx = rng.integers(0, 4, int(mask.sum())).astype(np.uint8)
    sp_data = rng.integers(-8, 8, int(mask.sum())).astype(np.int8)
    plut = rng.standard_normal((1, 1, 4, 1)).astype(np.float16)

    def body(x):
        w1 = mb.constexpr_lut_to_dense(indices=idx.astype(types.np_uint2_dtype), lut=lut, vector_axis=1)
        w2 = mb.constexpr_blockwise_shift_scale(data=data.astype(types.np_int4_dtype), scale=scale,
                                                offset=offset.astype(types.np_int4_dtype))
        m3, v3 = mb.constexpr_lut_to_sparse(indices_mask=mask.astype(types.np_uint1_dtype),
                                            indices_nonzero_data=sp_idx.astype(types.np_uint2_dtype), lut=plut)
        w3 = mb.constexpr_sparse_to_dense(nonzero_data=v3, mask=m3)
        m4, v4 = mb.constexpr_sparse_blockwise_shift_scale(
            data_mask=mask.astype(types.np_uint1_dtype), nonzero_data=sp_data.astype(types.np_int4_dtype), scale=scale
        )
        w4 = mb.constexpr_sparse_to_dense(nonzero_data=v4, mask=m4)
        return [mb.mul(x=w, y=x) for w in (w1, w2, w3, w4)]

    ones = {"x": np.ones((1, 1), np.float16)}
    ex = convert_and_load(build_program(ones, body), tmp_path / "c18.mlpackage")
    assert {"constexpr_lut_to_dense", "constexpr_blockwise_shift_scale", "constexpr_lut_to_sparse",
            "constexpr_sparse_blockwise_shift_scale", "constexpr_sparse_to_dense"} <= ex.op_types()
    w1, w2, w3, w4 = ex.predict(ones).values()

    want1 = np.zeros((4, 6), np.float16)  # element (i, j) -> vector lut[i // 2, 0, idx[i, j]] along axis 1
    for i, j in itertools.product(range(4), range(3)):
        want1[i, 2 * j:2 * j + 2] = lut[i // 2, 0, idx[i, j]]
    np.testing.assert_array_equal(w1, want1)
    sc = np.repeat(np.repeat(scale, 2, 0), 4, 1)  # one scale/offset per 2x4 block of the 4x8 data
    off = np.repeat(np.repeat(offset, 2, 0), 4, 1)
    want2 = (data.astype(np.float16) - off.astype(np.float16)) * sc
    np.testing.assert_array_equal(w2, want2)
    want3 = np.zeros((4, 8), np.float16)
    want3[mask != 0] = plut[0, 0, sp_idx, 0]
    np.testing.assert_array_equal(w3, want3)
    want4 = np.zeros((4, 8), np.float16)
    want4[mask != 0] = (sp_data.astype(np.float16) * sc[mask != 0])
    np.testing.assert_array_equal(w4, want4)


# --------------------------------------------------------------------------- errors


def test_unsupported_op_names_op_and_function(tmp_path: Path) -> None:
    w = rng.standard_normal((3, 2, 3)).astype(np.float32)
    x = rng.standard_normal((1, 2, 8)).astype(np.float32)
    assert "conv" not in SUPPORTED_OPS
    with pytest.raises(UnsupportedOp, match=r"'conv'.*'main'"):
        convert_and_load(build_program({"x": x}, lambda x: mb.conv(x=x, weight=w)), tmp_path / "conv.mlpackage")


def test_declared_type_that_lies_is_refused(tmp_path: Path) -> None:
    """``torch.where`` on scalars under a flexible shape: coremltools declares ``select``'s result
    rank 0 while it computes a matrix. The device compiles the declared types; so must we check."""
    from adapterpack.formats.mlpackage.executor import DeclaredTypeMismatch

    class ScalarWhere(torch.nn.Module):
        def forward(self, x):
            return torch.where(x > 0, torch.zeros(()), torch.full((), -1.0)) + x

    flex = ct.RangeDim(1, 8, default=2)
    traced = torch.jit.trace(ScalarWhere().eval(), torch.ones(2, 3))
    model = ct.convert(
        traced, inputs=[ct.TensorType("x", shape=(flex, 3), dtype=np.float32)], minimum_deployment_target=IOS18,
        compute_precision=ct.precision.FLOAT32, skip_model_load=True,
    )
    model.save(str(tmp_path / "where.mlpackage"))
    ex = ProgramExecutor.load(tmp_path / "where.mlpackage")
    assert "select" in ex.op_types()
    with pytest.raises(DeclaredTypeMismatch, match=r"function 'main': op 'select' .* declares float32 rank 0 \(\) but computes float32 rank 2 \(4, 3\)"):
        ex.predict({"x": np.ones((4, 3), np.float32)})

    # The same computation with full-shaped operands declares what it computes and runs.
    class FullWhere(torch.nn.Module):
        def forward(self, x):
            return (x > 0).to(torch.float32) - 1.0 + x

    traced = torch.jit.trace(FullWhere().eval(), torch.ones(2, 3))
    model = ct.convert(
        traced, inputs=[ct.TensorType("x", shape=(flex, 3), dtype=np.float32)], minimum_deployment_target=IOS18,
        compute_precision=ct.precision.FLOAT32, skip_model_load=True,
    )
    model.save(str(tmp_path / "full.mlpackage"))
    x = np.array([[1, -1, 2], [0, 3, -2], [1, 1, 1], [-1, 0, 5]], np.float32)
    out = ProgramExecutor.load(tmp_path / "full.mlpackage").predict({"x": x})
    np.testing.assert_array_equal(next(iter(out.values())), np.where(x > 0, 0.0, -1.0) + x)


def test_bad_inputs(tmp_path: Path) -> None:
    ex = convert_and_load(build_program({"x": X}, lambda x: mb.relu(x=x)), tmp_path / "r.mlpackage")
    with pytest.raises(KeyError, match="'x'"):
        ex.predict({})
    with pytest.raises(ValueError, match="shape"):
        ex.predict({"x": X[0]})
    with pytest.raises(KeyError, match="nope"):
        ex.predict({"x": X}, function="nope")


# --------------------------------------------------------------------------- end to end: tiny Llama

MAX_CONTEXT = 32
PREFILL = 6
DECODE = 4


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )
    return LlamaForCausalLM(cfg).eval()


def convert_decoder(hf_model, path: Path) -> None:
    """ExportDecoder -> Core ML exactly as the packaging pipeline does it (fp16, its states)."""
    from adapterpack.convert.export_decoder import ExportDecoder
    from adapterpack.formats.mlpackage.conversion import STATE_NAMES

    dec = ExportDecoder(hf_model, MAX_CONTEXT).eval()
    with torch.no_grad():
        traced = torch.jit.trace(dec, (torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 5)))
    flex = ct.RangeDim(1, MAX_CONTEXT, default=1)
    model = ct.convert(
        traced,
        inputs=[
            ct.TensorType("inputIds", shape=(1, flex), dtype=np.int32),
            ct.TensorType("causalMask", shape=(1, 1, ct.RangeDim(1, MAX_CONTEXT, default=1),
                                               ct.RangeDim(1, MAX_CONTEXT, default=1)), dtype=np.float16),
        ],
        outputs=[ct.TensorType("logits", dtype=np.float16)],
        states=[
            ct.StateType(wrapped_type=ct.TensorType(shape=getattr(dec, name).shape, dtype=np.float16), name=name)
            for name in STATE_NAMES
        ],
        minimum_deployment_target=IOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    model.save(str(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = _tiny_llama()
    path = tmp_path_factory.mktemp("llama") / "llama.mlpackage"
    convert_decoder(hf, path)
    ids = torch.randint(0, 300, (1, PREFILL + DECODE), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].numpy().astype(np.float64)
    return path, ids.numpy().astype(np.int32), ref


def run_decoder(
    ex: ProgramExecutor, ids: np.ndarray, full_mask: bool = False, function: str | None = None
) -> np.ndarray:
    """Prefill ``PREFILL`` tokens, then decode the rest one by one through the state."""
    state = ex.make_state(function)
    if full_mask:
        allowed = np.arange(PREFILL)[None, :] <= np.arange(PREFILL)[:, None]
        mask = np.where(allowed, 0, -np.inf).astype(np.float16)[None, None]
    else:
        mask = np.zeros((1, 1, 1, PREFILL), np.float16)
    outs = [ex.predict({"inputIds": ids[:, :PREFILL], "causalMask": mask}, state, function)["logits"][0]]
    for end in range(PREFILL + 1, ids.shape[1] + 1):
        step = {"inputIds": ids[:, end - 1:end], "causalMask": np.zeros((1, 1, 1, end), np.float16)}
        outs.append(ex.predict(step, state, function)["logits"][0])
    return np.concatenate(outs, axis=0)


def test_llama_end_to_end(llama) -> None:
    path, ids, ref = llama
    ex = ProgramExecutor.load(path)
    assert ex.function_names == ["main"] and ex.default_function == "main"
    assert set(ex.make_state()) == {"keyCache", "valueCache", "writtenSlots"}
    got = run_decoder(ex, ids)
    assert got.dtype == np.float16 and got.shape == ref.shape
    got = got.astype(np.float64)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.999, cos
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))

    # A caller-supplied additive causal mask on top of the internal one changes nothing.
    np.testing.assert_array_equal(run_decoder(ex, ids, full_mask=True).astype(np.float64), got)


def test_llama_ops_are_all_tested(llama) -> None:
    ex = ProgramExecutor.load(llama[0])
    assert ex.op_types() <= TESTED_OPS, ex.op_types() - TESTED_OPS


def test_supported_ops_all_have_tests() -> None:
    assert SUPPORTED_OPS == TESTED_OPS, (SUPPORTED_OPS ^ TESTED_OPS)


def test_multifunction_package(llama, tmp_path: Path) -> None:
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    path, ids, _ = llama
    quantized = tmp_path / "q.mlpackage"
    base = ct.models.MLModel(str(path), skip_model_load=True)
    _quantize(base, dtype="int8", granularity="per_channel").save(str(quantized))
    desc = MultiFunctionDescriptor()
    desc.add_function(str(path), src_function_name="main", target_function_name="chat")
    desc.add_function(str(quantized), src_function_name="main", target_function_name="code")
    desc.default_function_name = "code"
    multi = tmp_path / "multi.mlpackage"
    save_multifunction(desc, str(multi))

    ex = ProgramExecutor.load(multi)
    assert sorted(ex.function_names) == ["chat", "code"]
    assert ex.default_function == "code"
    assert "constexpr_blockwise_shift_scale" in ex.op_types("code")
    assert "constexpr_blockwise_shift_scale" not in ex.op_types("chat")

    chat = run_decoder(ex, ids, function="chat")
    code = run_decoder(ex, ids, function="code")
    np.testing.assert_array_equal(chat, run_decoder(ProgramExecutor.load(path), ids))
    np.testing.assert_array_equal(code, run_decoder(ProgramExecutor.load(quantized), ids))
    np.testing.assert_array_equal(code, run_decoder(ex, ids))  # default function
    assert not np.array_equal(chat, code)

    # One function loaded alone (verification does this, to hold one function's weights)
    alone = ProgramExecutor.load(multi, functions=["chat"])
    assert alone.function_names == ["chat"] and alone.default_function == "chat"
    np.testing.assert_array_equal(chat, run_decoder(alone, ids, function="chat"))
    assert ProgramExecutor.function_names_of(multi) == ex.function_names
    with pytest.raises(KeyError):
        ProgramExecutor.load(multi, functions=["nope"])


def test_float16_products_are_the_float32_products_rounded_once() -> None:
    """A float16 projection (bias included) runs in torch's kernel: each output is the float32
    sum rounded to float16 once, as the numpy path gives it; they may differ in the last place
    only where the two sum in different orders. A product past float16's range comes back in
    float32, so that the overflow is reported with its size."""
    from adapterpack.formats.mlpackage.executor import linalg

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 7, 256)).astype(np.float16)
    weight = (rng.standard_normal((384, 256)) * 0.1).astype(np.float16)
    bias = rng.standard_normal(384).astype(np.float16)
    got = linalg._linear({"x": x, "weight": weight, "bias": bias})
    assert got.dtype == np.float16
    exact = (x.astype(np.float64) @ weight.astype(np.float64).T + bias).astype(np.float16)
    numpy_path = (x.astype(np.float32) @ weight.astype(np.float32).T + bias.astype(np.float32)).astype(np.float16)
    def ulps(found):  # float16 steps from the exactly rounded product (float32 sums of cancelling terms miss a few)
        return np.abs(found.view(np.int16).astype(np.int32) - exact.view(np.int16).astype(np.int32))

    assert ulps(got).max() <= ulps(numpy_path).max() + 1, (ulps(got).max(), ulps(numpy_path).max())
    assert (got != exact).mean() <= (numpy_path != exact).mean() + 0.01
    large = np.full((1, 1, 256), 200.0, np.float16)
    overflowing = linalg._linear({"x": large, "weight": np.full((2, 256), 2.0, np.float16)})
    assert overflowing.dtype == np.float32 and np.isfinite(overflowing).all() and overflowing.max() > 65504


def test_llama_decode_is_fast(llama) -> None:
    import time

    path, ids, _ = llama
    ex = ProgramExecutor.load(path)
    run_decoder(ex, ids)  # compile + fold constants once
    start = time.perf_counter()
    run_decoder(ex, ids)
    # Generous bound (typically a few ms): guards against per-call re-materialization of weights.
    assert time.perf_counter() - start < 1.0


# --------------------------------------------------------------------------- other decoder families (slow)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_end_to_end(family: str, tmp_path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    if family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    elif family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    else:
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **common)).eval()
    path = tmp_path / f"{family}.mlpackage"
    convert_decoder(hf, path)
    ex = ProgramExecutor.load(path)
    assert ex.op_types() <= SUPPORTED_OPS
    ids = torch.randint(0, 300, (1, PREFILL + DECODE), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0].numpy().astype(np.float64)
    got = run_decoder(ex, ids.numpy().astype(np.int32)).astype(np.float64)
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() >= 0.999, cos
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_large_float16_weights_are_widened_in_slices_with_the_same_result(op, monkeypatch) -> None:
    """A float16 weight past WIDEN_SLICE_VALUES is multiplied a slice of rows at a time (a 3B
    lm_head widened whole would hold 1.6 GB); the products are those of the whole weight."""
    from adapterpack.formats.mlpackage.executor import linalg

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)  # float32 activations: the numpy path
    weight = (rng.standard_normal((300, 64)) * 0.1).astype(np.float16)
    args = {"x": x, "weight": weight} if op == "linear" else {"x": x, "y": weight, "transpose_y": True}
    run = linalg._linear if op == "linear" else linalg._matmul
    whole = run(args)
    monkeypatch.setattr(linalg, "WIDEN_SLICE_VALUES", 64 * 7)  # slices of 7 rows, the last one short
    sliced = run(args)
    expected = x.astype(np.float32) @ weight.astype(np.float32).T
    np.testing.assert_allclose(sliced, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sliced, whole, rtol=1e-5, atol=1e-6)  # BLAS blocks differently, no more
