"""Runners: one function at a time on the numpy executor (any OS) or on Core ML (macOS), through
every drive, each with a fresh state.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.formats.aimodel.format import CORE_AI_RUNTIME
from adapterpack.formats.aimodel.runtime import open_asset
from adapterpack.formats.mlpackage.executor import ProgramExecutor, UnsupportedOp
from adapterpack.formats.registry import of_package
from adapterpack.quiet import captured_output, import_coremltools
from adapterpack.verification.drives import APPLE_DRIVES, DRIVES, Predict, run_drives

log = logging.getLogger(__name__)


Backend = Literal["numpy", "coreml"]


def check_backend(backend: str) -> None:
    """Refuse (BadInput, exit 2) a backend that is not one, or Core ML where it does not run."""
    if backend not in ("numpy", "coreml"):
        raise BadInput(f"--backend {backend!r}: choose numpy or coreml")
    if backend == "coreml" and sys.platform != "darwin":
        raise BadInput("--backend coreml needs macOS (the Core ML runtime); use the default numpy backend here")


def backend_for(package: Path, backend: str) -> str:
    """The name of what runs ``package`` when ``backend`` is asked for (reports say which ran):
    the runtime its format is bound to, else ``backend``."""
    return of_package(package).runtime or backend


class Sessions:
    """``sessions(function)`` loads one function (dropping the one loaded before, so a runner
    holds one function's weights, not the package's) and returns ``new_session()``: a predict
    bound to a fresh state, what ``makeState()`` gives a client. ``float16_trouble(function)``
    says where that function's arithmetic first overflowed float16 (or gave NaN) in the calls
    so far, as far as the backend lets it be seen; None when it never did. ``concurrent``: the
    drives may run at once, each session in its own thread (a runtime that computes outside
    Python and leaves a core idle)."""

    def __init__(
        self,
        open_function: Callable[[str], Callable[[], Predict]],
        trouble: Callable[[str], str | None],
        drives: tuple[str, ...] = DRIVES,
        concurrent: bool = False,
        known_values: Callable[[str], dict[str, np.ndarray] | None] = lambda function: None,
    ):
        self._open = open_function
        self._trouble = trouble
        self.drives = drives  # how this package's clients call it (verification.drives)
        self.concurrent = concurrent
        # the function's weights as it computes with them (ProgramExecutor.known_values), by the
        # program's names; None where the runtime cannot show them
        self.known_values = known_values

    def __call__(self, function: str) -> Callable[[], Predict]:
        return self._open(function)

    def float16_trouble(self, function: str) -> str | None:
        return self._trouble(function)


def _watching_logits(
    open_function: Callable[[str], Callable[[], Predict]], backend: str, drives: tuple[str, ...] = DRIVES, concurrent: bool = False
) -> Sessions:
    """Sessions of a runtime whose ops cannot be seen: only non-finite logits are noticed."""
    seen: dict[str, str] = {}

    def watched(function: str) -> Callable[[], Predict]:
        new_session = open_function(function)

        def session(**options) -> Predict:
            predict = new_session(**options)

            def checked(ids, mask):
                logits = predict(ids, mask)
                if function not in seen and not np.isfinite(logits).all():
                    kind = "NaN" if np.isnan(logits).any() else "inf"
                    seen[function] = f"{backend} returned logits holding {kind} (its ops cannot be inspected)"
                return logits

            checked.engine = getattr(predict, "engine", None)  # an emulated Swift engine, if any
            return checked

        return session

    return Sessions(watched, seen.get, drives, concurrent)


def function_sessions(package: Path, backend: Backend = "numpy") -> Sessions:
    """The ``Sessions`` of ``package`` on ``backend``, or on the runtime its format is bound to."""
    return SESSIONS[backend_for(package, backend)](package)


def _executor_sessions(package: Path) -> Sessions:
    """Sessions on the numpy executor, which sees every op: float16 trouble is named by op."""
    loaded: dict[str, ProgramExecutor] = {}
    troubles: dict[str, str] = {}

    def open_function(function: str) -> Callable[[], Predict]:
        if function not in loaded:
            # No name may outlive this (a loop variable would): the previous function's executor
            # must be gone while the next one loads, or two functions' dense weights meet (12 GB at 3B).
            troubles.update((name, found.describe()) for held in loaded.values() for name, found in held.nonfinite.items())
            loaded.clear()
            _release_freed_memory()
            try:
                loaded[function] = ProgramExecutor.load(package, functions=[function])
            except UnsupportedOp as error:
                raise BadInput(f"{package}: {error}") from None
        executor = loaded[function]

        def new_session() -> Predict:
            state = executor.make_state(function)
            return lambda ids, mask: executor.predict({"inputIds": ids, "causalMask": mask}, state=state, function=function)["logits"]

        return new_session

    def trouble(function: str) -> str | None:
        for executor in loaded.values():
            if function in executor.nonfinite:
                return executor.nonfinite[function].describe()
        return troubles.get(function)

    def known_values(function: str) -> dict[str, np.ndarray]:
        open_function(function)  # loaded once, for the drives and the weights alike
        return loaded[function].known_values(function)

    return Sessions(open_function, trouble, known_values=known_values)


def _release_freed_memory() -> None:
    """Collect, then hand the C heap's free pages back to the system (glibc keeps freed arrays
    under its growing mmap threshold, up to 32 MB each: most of a model's weights)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def _coreml_sessions(package: Path) -> Callable[[str], Callable[[], Predict]]:
    if sys.platform != "darwin":
        raise BadInput("--backend coreml needs macOS (the Core ML runtime); use the default numpy backend here")
    ct = import_coremltools()

    def open_function(function: str) -> Callable[[], Predict]:
        with captured_output():
            model = ct.models.MLModel(str(package), function_name=function, compute_units=ct.ComputeUnit.CPU_AND_NE)

        def new_session() -> Predict:
            state = model.make_state()
            return lambda ids, mask: model.predict({"inputIds": ids, "causalMask": mask}, state=state)["logits"]

        return new_session

    return open_function


def _contract_sessions(open_function: Callable[[str], Callable[[], Predict]], contract: str, runtime: str) -> Sessions:
    """Sessions of a runtime that computes outside Python (its drives run at once, each in its
    own thread), driven as the clients of the package's ``contract`` drive it."""
    return _watching_logits(open_function, runtime, APPLE_DRIVES if contract == "apple" else DRIVES, concurrent=True)


def _with_program_values(sessions: Sessions, package: Path) -> Sessions:
    """``sessions`` whose weights (``Sessions.known_values``) are read by the numpy executor:
    Core ML runs the function, and its program holds the same weights."""

    def known_values(function: str) -> dict[str, np.ndarray]:
        return ProgramExecutor.load(package, functions=[function]).known_values(function)

    sessions.known_values = known_values
    return sessions


# Backend name -> the sessions that run a package there.
SESSIONS: dict[str, Callable[[Path], Sessions]] = {
    "numpy": _executor_sessions,
    "coreml": lambda package: _with_program_values(_watching_logits(_coreml_sessions(package), "Core ML"), package),
    CORE_AI_RUNTIME: lambda package: _contract_sessions(*open_asset(package), CORE_AI_RUNTIME),
}


def drive_runner(package: Path, backend: Backend = "numpy") -> tuple[Callable, Sessions]:
    """(``run(function, sequences, prefill)``: ({drive, with " text" for the real-text sequence:
    logits}, every drive of every sequence through a fresh state; where float16 first
    overflowed in them, or None), the sessions it runs on). ``sequences``: {"random" or "text":
    token ids}."""
    if backend_for(package, backend) == "numpy":
        # A program the executor cannot read fails here, as the package, before any function runs.
        ProgramExecutor.function_names_of(package)
    sessions = function_sessions(package, backend)

    def run(function: str, sequences: dict[str, np.ndarray], prefill: int):
        found = {}
        for kind, tokens in sequences.items():
            logits = run_drives(sessions(function), tokens, min(prefill, len(tokens)), sessions.drives, concurrent=sessions.concurrent)
            found.update({drive if kind == "random" else f"{drive} text": value for drive, value in logits.items()})
        return found, sessions.float16_trouble(function)

    return run, sessions
