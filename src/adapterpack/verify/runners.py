"""Runners: one function at a time on the numpy executor (any OS) or on Core ML (macOS), through
every drive, each with a fresh state.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Literal

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.mlpackage.functions import read_functions
from adapterpack.quiet import captured_output, import_coremltools
from adapterpack.verify.drives import run_drives
from adapterpack.verify.executor import ProgramExecutor, UnsupportedOp

log = logging.getLogger(__name__)


Backend = Literal["numpy", "coreml"]


def numpy_runner(package: Path):
    """Loads one function at a time and drops it after its drives, so the executor holds one
    function's weights, not the package's."""

    names = ProgramExecutor.function_names_of(package)

    def run(function: str, tokens: np.ndarray, prefill: int) -> dict[str, np.ndarray]:
        try:
            executor = ProgramExecutor.load(package, functions=[function])
        except UnsupportedOp as error:
            raise BadInput(f"{package}: {error}") from None
        def session():
            state = executor.make_state(function)
            return lambda ids, mask: executor.predict(
                {"inputIds": ids, "causalMask": mask}, state=state, function=function
            )["logits"]

        return run_drives(session, tokens, prefill)

    return run, names


def coreml_runner(package: Path):
    if sys.platform != "darwin":
        raise BadInput("--backend coreml needs macOS (the Core ML runtime); use the default numpy backend here")

    ct = import_coremltools()

    names = read_functions(package).names

    def run(function: str, tokens: np.ndarray, prefill: int) -> dict[str, np.ndarray]:
        with captured_output():
            model = ct.models.MLModel(str(package), function_name=function, compute_units=ct.ComputeUnit.CPU_AND_NE)
        def session():
            state = model.make_state()
            return lambda ids, mask: model.predict({"inputIds": ids, "causalMask": mask}, state=state)["logits"]

        return run_drives(session, tokens, prefill)

    return run, names
