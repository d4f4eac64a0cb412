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
from typing import Iterator

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
