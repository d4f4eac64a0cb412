"""Keep the heavy libraries' own chatter (import warnings, tqdm bars) out of the user's terminal.

coremltools logs about ten warnings at import on Linux and draws tqdm bars during conversion;
transformers and peft warn about things users of adapterpack cannot act on. adapterpack reports
progress itself, so these are silenced unless debug logging is on.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator

NOISY_LOGGERS = ("coremltools", "transformers", "peft", "torch", "huggingface_hub", "accelerate")


def silence_libraries() -> None:
    """Lower the heavy libraries' loggers and disable tqdm; call before importing them."""
    if logging.getLogger("adapterpack").isEnabledFor(logging.DEBUG) and os.environ.get("ADAPTERPACK_DEBUG"):
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"(coremltools|transformers|peft|torch)(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*(deprecated|TracerWarning).*")


@contextlib.contextmanager
def captured_output() -> Iterator[io.StringIO]:
    """Capture what a library prints to stdout/stderr (kept for the debug log)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield buffer


@contextlib.contextmanager
def native_output_captured() -> Iterator[None]:
    """Capture what native code writes to the process's stdout/stderr (file descriptors 1 and 2,
    which Python's redirection does not reach); kept for the debug log."""
    import sys
    import tempfile

    log = logging.getLogger(__name__)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            printed = sink.read().decode(errors="replace").strip()
            if printed:
                log.debug("native output: %s", printed)


# Libraries coremltools probes at import for converters and modes adapterpack never uses (its
# scikit-learn converters and scikit-learn k-means): importing scikit-learn alone adds about 0.7 s
# to every command where it is installed.
UNUSED_PROBES = ("sklearn",)


def import_coremltools():
    """Import coremltools without its import-time warnings (and without its unused probes)."""
    import sys

    silence_libraries()
    if "coremltools" not in sys.modules:
        blocked = [name for name in UNUSED_PROBES if name not in sys.modules]
        for name in blocked:
            sys.modules[name] = None  # makes ``import sklearn`` fail fast; coremltools treats it as absent
        try:
            with captured_output():
                import coremltools  # noqa: F401
        finally:
            for name in blocked:
                if sys.modules.get(name, 0) is None:
                    del sys.modules[name]
    import coremltools

    # Our own handlers decide what is shown; coremltools' root-level warnings are noise here.
    logging.getLogger("coremltools").setLevel(logging.ERROR)
    return coremltools


def import_coreml_proto():
    """coremltools' generated protobuf modules (``Model_pb2``, ``MIL_pb2``, ...) without running
    coremltools' package ``__init__``, which imports torch and transformers (seconds per command).

    Commands that only read a package's spec (``functions``, ``inspect``) use this. The modules are
    loaded under their real names, so a later ``import coremltools`` in the same process finds and
    reuses them instead of loading the same descriptors twice.
    """
    import importlib
    import importlib.util
    import sys
    import types

    if "coremltools.proto.Model_pb2" in sys.modules or "coremltools" in sys.modules:
        return importlib.import_module("coremltools.proto")
    spec = importlib.util.find_spec("coremltools")
    if spec is None or not spec.submodule_search_locations:
        return importlib.import_module("coremltools.proto")
    # A placeholder parent while the proto modules load; removed right after, so the real
    # package still initialises in full when something imports it.
    placeholder = types.ModuleType("coremltools")
    placeholder.__path__ = list(spec.submodule_search_locations)
    sys.modules["coremltools"] = placeholder
    try:
        proto = importlib.import_module("coremltools.proto")
    finally:
        if sys.modules.get("coremltools") is placeholder:
            del sys.modules["coremltools"]
    return proto
