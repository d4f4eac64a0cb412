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

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.blob import read_blob_records
from adapterpack.formats.mlpackage.executor import constexpr, elementwise, linalg, shape_ops  # noqa: F401  (importing them registers their ops)
from adapterpack.formats.mlpackage.executor.registry import (
    _OPS,
    _STATE_OPS,
    Args,
    DeclaredTypeMismatch,
    Handler,
    UnsupportedOp,
)
from adapterpack.formats.mlpackage.spec import check_package_manifest

SUPPORTED_OPS: frozenset[str] = frozenset(_OPS) | {"const"} | _STATE_OPS


# --------------------------------------------------------------------------- interpreter

# Let the KV-cache updates of a call write into the cache instead of copying it (see
# ``_InPlaceUpdates``); False copies on every update (tests compare the two).
STATE_UPDATES_IN_PLACE = True


class _InPlaceUpdates:
    """Which ``slice_update`` steps of one call may write into their input instead of a copy.

    A stateful decoder writes its KV-cache as one state: each layer reads the cache written by
    the layer before, updates its rows (``slice_update``) and writes it back. Core ML does that
    in place; a copy per layer of a 3B model's whole cache is most of a decode step here. The
    result is the same array either way when nothing reads the input after the update: the
    step is the input slot's last reader (``_Compiled.in_place``), the array was made during
    this call (a state's copy, or an earlier update's result: never a constant or an input),
    no value still to be read (``pending``) may share its memory (a slice of the cache the
    attention reads is a view), and a state holding it is written next, not read.
    """

    def __init__(self, compiled: _Compiled, live: dict[str, np.ndarray]):
        self.compiled, self.live = compiled, live
        self.enabled = in_place_updates(compiled)
        # Arrays made during this call, kept referenced so that their ids stay theirs.
        self.owned = {id(value): value for value in live.values()} if self.enabled else {}
        self.pending: dict[int, Any] = {}

    def ran(self, index: int, env: list[Any]) -> None:
        """Bookkeeping after step ``index``: its outputs wait for their readers, the values it
        was the last to read are let go (``_Compiled.waits``, ``_Compiled.done``)."""
        if not self.enabled:
            return
        for slot in self.compiled.done[index]:
            self.pending.pop(slot, None)
        for slot in self.compiled.waits[index]:
            self.pending[slot] = env[slot]

    def may_update(self, index: int, step: _Step, env: list[Any]) -> bool:
        if not self.enabled or index not in self.compiled.in_place:
            return False
        x_slot = dict(step.args)["x"]
        x = env[x_slot]
        if id(x) not in self.owned:
            return False
        if (step.dtypes[0] is not None and step.dtypes[0] != x.dtype) or (
            step.declared and step.declared[0] is not None and step.declared[0].mismatch(x) is not None
        ):
            return False  # the copying path casts or reports it
        written_next = self.compiled.in_place[index]
        if any(value is x and key not in written_next for key, value in self.live.items()):
            return False
        return not any(
            slot != x_slot and isinstance(value, np.ndarray) and np.may_share_memory(value, x)
            for slot, value in self.pending.items()
        )

    def updated(self, step: _Step, env: list[Any]) -> np.ndarray:
        args: Args = {param: env[ref] for param, ref in step.args}
        return shape_ops.update_slice_in_place(args)

    def made(self, step: _Step, env: list[Any]) -> None:
        """A copying update's result is this call's own: a later update may write into it."""
        if self.enabled and step.op_type == "slice_update":
            value = env[step.outs[0]]
            self.owned[id(value)] = value


def in_place_updates(compiled: _Compiled) -> bool:
    """Whether a call of ``compiled`` may update values in place (and so copies the states)."""
    return STATE_UPDATES_IN_PLACE and bool(compiled.in_place)


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
    declared: tuple[_Declared | None, ...] = ()
    attentions_before: int = 0  # attention ops ahead of this one: where in the decoder it sits


@dataclass(frozen=True)
class NonFinite:
    """The first op of a function whose float output held inf or NaN although none of its inputs
    did: where float16 arithmetic overflowed (a caller's -inf mask entries are inputs, not this)."""

    function: str
    op_type: str
    label: str
    attentions_before: int
    attentions: int
    kind: str  # "overflow" (inf) or "NaN"
    largest_input: float  # the largest finite magnitude among its inputs
    largest_output: float  # the largest finite magnitude it computed before the float16 cast

    def describe(self) -> str:
        where = f"after {self.attentions_before} of {self.attentions} attention ops" if self.attentions else "in the program"
        sizes = f"its inputs reach {self.largest_input:.6g}"
        if self.largest_output > 0:
            sizes += f", its output {self.largest_output:.6g}"
        return (
            f"float16 {self.kind} first at op {self.op_type!r} (-> {self.label!r}) {where}: {sizes} "
            f"(float16 holds at most 65504)"
        )


# Ops that only move or select values: finite inputs give a finite output, so their (often
# cache-sized) outputs are not scanned; they carry their inputs' inf or NaN along.
_MOVES_VALUES = frozenset({
    "slice_update", "slice_by_index", "slice_by_size", "reshape", "transpose", "expand_dims", "squeeze",
    "concat", "stack", "split", "tile", "gather", "gather_along_axis", "gather_nd", "identity", "flatten2d",
    "reverse", "pad", "scatter", "scatter_along_axis", "scatter_nd",
})


def _finite(value: Any) -> bool:
    return not isinstance(value, np.ndarray) or value.dtype.kind != "f" or bool(np.isfinite(value).all())


def _largest_finite(values: Sequence[Any]) -> float:
    largest = 0.0
    for value in values:
        if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size:
            magnitudes = np.abs(value[np.isfinite(value)])
            if magnitudes.size:
                largest = max(largest, float(magnitudes.max()))
    return largest


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
        if not _shape_fits(value.shape, self.dims):
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
    return _Declared(_declared_dtype(var), _concrete_shape(var.shape))


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
    attentions: int = 0  # attention ops in the function (to say where an op sits)
    named: dict[str, int] = field(default_factory=dict)  # known values (constants, folded) by name
    # Steps that may update their input in place (``_in_place_updates``), with the states whose
    # next state op after the step is a write.
    in_place: dict[int, frozenset[str]] = field(default_factory=dict)
    # Per step, the slots it writes that a later step reads (``waits``) and the slots it is the
    # last to read (``done``): which values are still to be read between steps.
    waits: list[tuple[int, ...]] = field(default_factory=list)
    done: list[tuple[int, ...]] = field(default_factory=list)


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


def _shape_fits(shape: Sequence[int], dims: Sequence[int | None]) -> bool:
    """Same rank, and every static dim (not None) equal."""
    return len(shape) == len(dims) and all(want is None or want == got for want, got in zip(dims, shape))


def _const_value(var: Any) -> Any:
    val = var.val
    if isinstance(val, str):
        return val
    arr = np.asarray(val)
    dtype = _declared_dtype(var)
    return arr.astype(dtype) if dtype is not None and arr.dtype != dtype else arr


def _release_const(op: Any) -> None:
    """Drop the value a loaded ``const`` op holds: its output's, and its ``val`` parameter's. The
    parameter is an internal var, which ``op.inputs`` leaves out (coremltools lists it only in
    the op's ``_input_vars``); missed, it kept a 3B model's 3 GB of indices beside the dense
    weights they were folded into."""
    internal = getattr(op, "_input_vars", None) or {}
    for var in (op.outputs[0], internal.get("val")):
        if var is not None and hasattr(var, "_sym_val"):
            var._sym_val = None


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

    check_package_manifest(Path(path))
    try:
        spec = ct.utils.load_spec(path)
    except (RuntimeError, ValueError) as error:
        raise BadInput(f"{path}: not a readable Core ML package ({str(error).strip()[:160]})") from None
    if spec.WhichOneof("Type") != "mlProgram":
        raise ValueError(f"{path} is not an ML Program (found {spec.WhichOneof('Type')!r})")
    return spec


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
        # {function: the first op whose float16 arithmetic overflowed}, from every predict so far.
        self.nonfinite: dict[str, NonFinite] = {}
        # Fail at load time, before any work: callers decide up front whether this package can
        # be checked here at all.
        for name, func in program.functions.items():
            for op in func.operations:
                _check_supported(op, name)

    @classmethod
    def load(cls, package_path: str | Path, functions: Sequence[str] | None = None) -> ProgramExecutor:
        """Load the MIL program of an ``.mlpackage``: all functions, or only ``functions``
        (only their weights are read: one function of a 1B model instead of all of them)."""
        from coremltools.converters.mil.frontend.milproto.load import (
            load as load_milproto,
        )
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
        # coremltools' blob reader answers a truncated or altered blob with "index out of
        # bounds": check each blob's records first, so the package is named as bad input.
        for blob in sorted(Path(weights_dir).glob("*")) if Path(weights_dir).is_dir() else []:
            read_blob_records(Path(path), blob.relative_to(path).as_posix())
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

    def known_values(self, function: str | None = None) -> dict[str, np.ndarray]:
        """{name: value} of every array the function computes from constants alone and reads at
        run time: its weights as it uses them (a palettized or quantized one decompressed, under
        its constexpr op's output name), biases, norm gains, tables."""
        compiled = self._compile(function)
        return {name: compiled.env[slot] for name, slot in compiled.named.items() if isinstance(compiled.env[slot], np.ndarray)}

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
            # A copy of its own when updates may run in place: the caller's arrays change only
            # when the call completes.
            live[key] = np.array(state[key], dtype=dtype) if in_place_updates(compiled) else np.asarray(state[key]).astype(dtype, copy=False)
            if live[key].shape != shape:
                raise ValueError(f"state {key!r} of function {name!r} has shape {live[key].shape}, expected {shape}")
        written: set[str] = set()
        # Slots holding inf or NaN: an op is where float16 trouble starts only when its output
        # has some and none of its inputs do.
        tainted = {spec.slot for spec in compiled.inputs if not _finite(env[spec.slot])}
        with np.errstate(all="ignore"):  # overflow is reported as a finding (see ``nonfinite``), not a warning
            self._run_steps(name, compiled, env, live, written, tainted)

        for key in written:
            if state[key].shape == live[key].shape and state[key].dtype == live[key].dtype:
                np.copyto(state[key], live[key])  # keep the caller's arrays
            else:
                state[key] = np.array(live[key])
        return {out_name: np.asarray(env[slot]) for out_name, slot in compiled.outputs}

    def _run_steps(self, name: str, compiled: _Compiled, env: list[Any], live: dict, written: set[str], tainted: set[int]) -> None:
        """Run every run-time op of ``name``, noting where inf or NaN first arises."""
        state_finite: dict[str, bool] = {}  # each state scanned once per call, when first read
        updates = _InPlaceUpdates(compiled, live)
        for index, step in enumerate(compiled.steps):
            if index:
                updates.ran(index - 1, env)
            if step.kind == _READ:
                env[step.outs[0]] = live[step.state]
                if step.state not in state_finite:
                    state_finite[step.state] = _finite(live[step.state])
                if not state_finite[step.state]:
                    tainted.add(step.outs[0])
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
                state_finite[step.state] = step.args[0][1] not in tainted
                if not state_finite[step.state]:
                    tainted.add(step.outs[0])
                continue
            if updates.may_update(index, step, env):
                env[step.outs[0]] = updates.updated(step, env)
                largest_output = 0.0
            else:
                largest_output = self._run_step(step, env, name)
                updates.made(step, env)
            refs = _Compiler._refs(step)
            if step.op_type in _MOVES_VALUES:
                if tainted.intersection(refs):
                    tainted.update(step.outs)
                continue
            if all(_finite(env[slot]) for slot in step.outs):
                continue
            tainted.update(step.outs)
            if name not in self.nonfinite and not tainted.intersection(refs):
                results = [env[slot] for slot in step.outs]
                self.nonfinite[name] = NonFinite(
                    function=name,
                    op_type=step.op_type,
                    label=step.label,
                    attentions_before=step.attentions_before,
                    attentions=compiled.attentions,
                    kind="NaN" if any(np.isnan(r).any() for r in results if isinstance(r, np.ndarray)) else "overflow",
                    largest_input=_largest_finite([env[r] for r in refs]),
                    largest_output=largest_output,
                )

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_input(function: str, spec: _InputSpec, value: Any) -> np.ndarray:
        arr = np.asarray(value)
        if not _shape_fits(arr.shape, spec.shape):
            shown = tuple("?" if d is None else d for d in spec.shape)
            raise ValueError(
                f"input {spec.name!r} of function {function!r} has shape {arr.shape}, expected {shown}"
            )
        return arr.astype(spec.dtype, copy=False) if spec.dtype is not None else arr

    @staticmethod
    def _run_step(step: _Step, env: list[Any], function: str) -> float:
        """Run one op into ``env``; returns the largest finite magnitude of a result that the cast
        to its declared dtype made non-finite (0.0 otherwise)."""
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
        overflowed = 0.0
        for index, (slot, value, dtype) in enumerate(zip(step.outs, results, step.dtypes)):
            value = np.asarray(value)
            declared = step.declared[index] if index < len(step.declared) else None
            if declared is not None and declared.mismatch(value) is not None:
                raise DeclaredTypeMismatch(
                    f"function {function!r}: op {step.op_type!r} -> {step.label!r} declares "
                    f"{declared.describe()} but computes {value.dtype} rank {value.ndim} {tuple(value.shape)}"
                )
            if dtype is not None and value.dtype != dtype:
                wide = value
                value = value.astype(dtype)
                if value.dtype.kind == "f" and not _finite(value) and _finite(wide):
                    overflowed = max(overflowed, _largest_finite([wide]))
            env[slot] = value
        return overflowed

    def _compile(self, function: str | None) -> _Compiled:
        """Resolve slots, fold every constant-only op (constexpr included) once, and cache."""
        name, func = self._function(function)
        if name in self._compiled:
            return self._compiled[name]
        # Constants read by constant-only ops alone (a palettized weight's indices and palette)
        # are let go as soon as their last reader is folded: a 3B model's indices are 3 GB,
        # and holding them beside the dense weights they fold into would add that to the peak.
        # Only in a program of this one function: other functions may share the arrays.
        compiler = _Compiler(name, func, self._declared.get(name), release=len(self._program.functions) == 1)
        for op in func.operations:
            _check_supported(op, name)
            if op.op_type == "const":
                compiler.constant(op)
            elif op.op_type in _STATE_OPS:
                compiler.steps.append(compiler.state_step(op))
            else:
                step = compiler.call_step(op)
                if compiler.reads_constants_only(step):
                    # Depends on constants only (constexpr decompression, casts of weights, shape
                    # arithmetic on constants): evaluate once here instead of on every call.
                    self._run_step(step, compiler.env, name)
                    compiler.folded(step)
                else:
                    compiler.kept(step)
        compiled = compiler.compiled()
        self._compiled[name] = compiled
        return compiled


class _Compiler:
    """The state of compiling one function: a slot per value (``env``), which slots hold values
    known before any call (``static``), and the steps left to run at call time."""

    def __init__(self, name: str, func: Any, in_spec: dict | None, *, release: bool):
        from coremltools.converters.mil.mil import types

        self.name, self.func, self.in_spec, self.release = name, func, in_spec, release
        self.slots: dict[int, int] = {}
        self.env: list[Any] = []
        self.static: set[int] = set()
        self.steps: list[_Step] = []
        self.attentions = 0
        self.readers_left: dict[int, int] = {}
        self.const_ops: dict[int, Any] = {}
        self.returned = {id(var) for var in func.outputs}
        self.inputs: list[_InputSpec] = []
        self.states: dict[str, tuple[tuple[int, ...], Any]] = {}
        self.state_slots: dict[int, str] = {}
        self.names: dict[str, int] = {}  # each constant's and op output's slot, by its var name
        for in_name, var in func.inputs.items():
            slot = self.slot_of(var)
            if types.is_state(var.sym_type):
                wrapped = var.sym_type.wrapped_type()
                dtype = np.dtype(types.nptype_from_builtin(wrapped.get_primitive()))
                self.states[in_name] = (tuple(int(d) for d in wrapped.get_shape()), dtype)
                self.state_slots[slot] = in_name
            else:
                self.inputs.append(_InputSpec(in_name, slot, _declared_dtype(var), _concrete_shape(var.shape)))

    def slot_of(self, var: Any) -> int:
        key = id(var)
        if key not in self.slots:
            self.slots[key] = len(self.env)
            self.env.append(None)
        return self.slots[key]

    def declared_of(self, var: Any) -> _Declared | None:
        if self.in_spec is not None:
            return self.in_spec.get(var.name)
        return _declared_of_var(var)

    def constant(self, op: Any) -> None:
        slot = self.slot_of(op.outputs[0])
        self.names[op.outputs[0].name] = slot
        self.env[slot] = _const_value(op.outputs[0])
        self.static.add(slot)
        if id(op.outputs[0]) not in self.returned:
            self.readers_left[slot] = len(op.outputs[0].child_ops)
            self.const_ops[slot] = op

    def state_step(self, op: Any) -> _Step:
        """A read or write of a state input, its declared type checked against the state's."""
        label = _label(op)
        state_var = op.inputs["input"] if op.op_type == "read_state" else op.inputs["state"]
        state_name = self.state_slots.get(self.slots.get(id(state_var), -1))
        if state_name is None:
            raise UnsupportedOp(f"{op.op_type} ({label!r}) in function {self.name!r} does not act on a state input")
        args: tuple[tuple[str, Any], ...] = ()
        if op.op_type == "coreml_update_state":
            args = (("value", self.slot_of(op.inputs["value"])),)
        kind = _READ if op.op_type == "read_state" else _WRITE
        declared = self.declared_of(op.outputs[0])
        state_shape, state_dtype = self.states[state_name]
        if declared is not None and declared.mismatch(np.empty(state_shape, state_dtype)) is not None:
            raise DeclaredTypeMismatch(
                f"function {self.name!r}: op {op.op_type!r} -> {label!r} declares {declared.describe()} "
                f"for state {state_name!r} of {state_dtype} {state_shape}"
            )
        return _Step(kind, op.op_type, label, None, args, (self.slot_of(op.outputs[0]),), (None,), state_name)

    def call_step(self, op: Any) -> _Step:
        for var in op.outputs:
            self.names[var.name] = self.slot_of(var)
        arg_list: list[tuple[str, Any]] = []
        for param, value in op.inputs.items():
            if isinstance(value, (list, tuple)):
                arg_list.append((param, tuple(self.slot_of(v) for v in value)))
            else:
                arg_list.append((param, self.slot_of(value)))
        step = _Step(
            _CALL,
            op.op_type,
            _label(op),
            _OPS[op.op_type].fn,
            tuple(arg_list),
            tuple(self.slot_of(o) for o in op.outputs),
            tuple(_declared_dtype(o) for o in op.outputs),
            declared=tuple(self.declared_of(o) for o in op.outputs),
            attentions_before=self.attentions,
        )
        if op.op_type == "scaled_dot_product_attention":
            self.attentions += 1
        return step

    @staticmethod
    def _refs(step: _Step) -> list[int]:
        return [r for _, ref in step.args for r in (ref if isinstance(ref, tuple) else (ref,))]

    def reads_constants_only(self, step: _Step) -> bool:
        return all(r in self.static for r in self._refs(step))

    def folded(self, step: _Step) -> None:
        """``step`` ran at compile time: its outputs are known, and constants it was the last to read go."""
        self.static.update(step.outs)
        for ref in set(self._refs(step)) & self.readers_left.keys():
            self.readers_left[ref] -= 1
            if self.readers_left[ref] == 0 and self.release:
                self.env[ref] = None
                _release_const(self.const_ops.pop(ref))

    def kept(self, step: _Step) -> None:
        """``step`` runs at call time: the constants it reads are kept."""
        self.steps.append(step)
        for ref in set(self._refs(step)) & self.readers_left.keys():
            self.readers_left.pop(ref)

    def compiled(self) -> _Compiled:
        outputs = [(var.name, self.slot_of(var)) for var in self.func.outputs]
        # Drop folded intermediates nobody reads at run time (e.g. the compressed blobs).
        needed = {r for s in self.steps for r in self._refs(s)}
        needed |= {slot for _, slot in outputs}
        env = [v if (i in needed or i not in self.static) else None for i, v in enumerate(self.env)]
        named = {name: slot for name, slot in self.names.items() if slot in self.static and env[slot] is not None}
        # The last step that reads each slot (len(steps) for the function's outputs).
        last_read: dict[int, int] = {}
        for index, step in enumerate(self.steps):
            last_read.update(dict.fromkeys(self._refs(step), index))
        last_read.update({slot: len(self.steps) for _, slot in outputs})
        waits = [tuple(slot for slot in step.outs if last_read.get(slot, -1) > index) for index, step in enumerate(self.steps)]
        done = [tuple(slot for slot in set(self._refs(step)) if last_read[slot] == index) for index, step in enumerate(self.steps)]
        return _Compiled(
            self.steps, env, self.inputs, self.states, self.state_slots, outputs, self.attentions, named,
            self._in_place_updates(last_read), waits, done,
        )

    def _in_place_updates(self, last_read: dict[int, int]) -> dict[int, frozenset[str]]:
        """{index of a ``slice_update`` step that is its input's last reader: the states whose
        next state op after it is a write (a state holding the input may change early only then)}."""
        found: dict[int, frozenset[str]] = {}
        for index, step in enumerate(self.steps):
            if step.op_type != "slice_update" or last_read.get(dict(step.args)["x"]) != index:
                continue
            next_op: dict[str, int] = {}
            for later in self.steps[index + 1 :]:
                if later.kind in (_READ, _WRITE) and later.state not in next_op:
                    next_op[later.state] = later.kind
                if len(next_op) == len(self.states):
                    break
            found[index] = frozenset(state for state, kind in next_op.items() if kind == _WRITE)
        return found
