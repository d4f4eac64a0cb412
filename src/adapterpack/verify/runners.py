"""Runners: one function at a time on the numpy executor (any OS) or on Core ML (macOS), through
every drive, each with a fresh state.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from adapterpack.errors import BadInput
from adapterpack.quiet import captured_output, import_coremltools
from adapterpack.verify.drives import Predict, run_drives
from adapterpack.verify.executor import ProgramExecutor, UnsupportedOp

log = logging.getLogger(__name__)


Backend = Literal["numpy", "coreml"]


def function_sessions(package: Path, backend: Backend = "numpy") -> Callable[[str], Callable[[], Predict]]:
    """``open(function)`` loads one function (dropping the one loaded before, so a runner holds
    one function's weights, not the package's) and returns ``new_session()``: a predict bound to
    a fresh state, what ``makeState()`` gives a client."""
    if backend == "coreml":
        return _coreml_sessions(package)
    loaded: dict[str, ProgramExecutor] = {}

    def open_function(function: str) -> Callable[[], Predict]:
        if function not in loaded:
            loaded.clear()
            try:
                loaded[function] = ProgramExecutor.load(package, functions=[function])
            except UnsupportedOp as error:
                raise BadInput(f"{package}: {error}") from None
        executor = loaded[function]

        def new_session() -> Predict:
            state = executor.make_state(function)
            return lambda ids, mask: executor.predict({"inputIds": ids, "causalMask": mask}, state=state, function=function)["logits"]

        return new_session

    return open_function


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


def drive_runner(package: Path, backend: Backend = "numpy"):
    """``run(function, tokens, prefill)``: every drive's logits, each drive through a fresh state."""
    if backend == "numpy":
        # A program the executor cannot read fails here, as the package, before any function runs.
        ProgramExecutor.function_names_of(package)
    sessions = function_sessions(package, backend)
    return lambda function, tokens, prefill: run_drives(sessions(function), tokens, prefill)
