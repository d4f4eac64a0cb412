"""Error hierarchy: each class carries the process exit code the CLI reports for it.

The CLI is the only place that turns these into a one-line message and an exit code.
"""

from __future__ import annotations


class AdapterpackError(Exception):
    """Base class of every error adapterpack reports without a traceback."""

    exit_code = 1


class BadInput(AdapterpackError):
    """A manifest, model or adapter is invalid (exit 2)."""

    exit_code = 2


class VerificationFailed(AdapterpackError):
    """A built function does not match its PyTorch reference (exit 3)."""

    exit_code = 3
    report = None  # the verify.VerifyReport, for printing the table

    def with_report(self, report) -> VerificationFailed:
        self.report = report
        return self


class OutOfResources(AdapterpackError):
    """Not enough disk space or memory to finish (exit 4)."""

    exit_code = 4


class OutputExists(BadInput):
    """The output exists and ``--force`` was not given (exit 2)."""


def warn_or_refuse(message: str, *, strict: bool, log) -> None:
    """A warning on ``log``, or with ``--strict`` a BadInput (exit 2) saying so."""
    if strict:
        raise BadInput(f"{message} (an error with --strict)")
    log.warning("%s", message)


EXIT_CODES = {
    0: "success",
    1: "internal error (a bug: please report it with ADAPTERPACK_DEBUG=1 output)",
    2: "bad input: manifest, model, adapter or arguments",
    3: "verification failed",
    4: "out of resources (disk space)",
    130: "interrupted (Ctrl-C)",
}
