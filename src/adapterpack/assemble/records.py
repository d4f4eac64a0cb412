"""What a build reports: progress hooks (the CLI supplies a rich display), one record per
function, and the build's result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from adapterpack.config.manifest import CONTRACTS, Manifest
from adapterpack.errors import BadInput
from adapterpack.formats.format import Format

log = logging.getLogger(__name__)


def content_key(payload: dict) -> str:
    """sha256 of JSON data, independent of key order (the build cache's keys)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class Reporter:
    """Progress hooks; the library default only logs. The CLI supplies a rich display."""

    def stage(self, label: str) -> contextlib.AbstractContextManager[None]:
        return _logged_stage(label)

    def progress(self, label: str, unit: str = "weights") -> contextlib.AbstractContextManager[Callable[[int, int], None]]:
        """A stage that reports how far it is: yields ``update(done, total)``."""
        return _logged_progress(label, unit)

    def info(self, message: str) -> None:
        log.info(message)


# Long stages say how far they are at least this often where nobody watches a live display.
PROGRESS_LINE_SECONDS = 30.0


class ProgressLines:
    """``update(done, total)`` that prints a line with the rate and the time left, at most every
    ``every`` seconds (and never more than once per call)."""

    def __init__(self, label: str, unit: str, emit: Callable[[str], None], every: float = PROGRESS_LINE_SECONDS):
        self.label, self.unit, self.emit, self.every = label, unit, emit, every
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < self.every or not total:
            return
        self.last = now
        self.emit(f"{self.label}: {progress_text(done, total, now - self.started, self.unit)}")


def progress_text(done: int, total: int, seconds: float, unit: str) -> str:
    """'1.2G / 3.2G weights (38%), 21.0M/s, about 95 s left'."""
    rate = done / seconds if seconds > 0 else 0.0
    left = f", about {(total - done) / rate:.0f} s left" if rate > 0 and done < total else ""
    return f"{_count(done)} / {_count(total)} {unit} ({100 * done / total:.0f}%), {_count(rate)}/s{left}"


def _count(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f}{suffix}"
    return f"{value:.0f}"


@contextlib.contextmanager
def _logged_progress(label: str, unit: str) -> Iterator[Callable[[int, int], None]]:
    with _logged_stage(label):
        yield ProgressLines(label, unit, log.info)


@contextlib.contextmanager
def _logged_stage(label: str) -> Iterator[None]:
    started = time.perf_counter()
    log.info("%s ...", label)
    yield
    log.info("%s done (%.1f s)", label, time.perf_counter() - started)


def _flag(default, flag: str, help: str, *, negates: bool = False):
    """A field of ``BuildOptions`` and the command-line flag that sets it (``negates``: the flag
    sets the field to False, ``--no-verify`` for ``verify``); the CLI generates its flags from
    these (``cli.flags``), so a field, its flag and its help are declared once."""
    return field(default=default, metadata={"flag": flag, "help": help, "negates": negates})


def _format_help() -> str:
    from adapterpack.formats.registry import described

    return f"Package format: {described()}; default: the output's suffix, else the manifest's export.format"


@dataclass(frozen=True)
class BuildOptions:
    """How ``build``, ``release``, ``merge`` and fan-out parts run: the flags the commands share.

    Checked when made: an unknown backend, format or contract is refused (``BadInput``), naming
    the flag that sets it.
    """

    force: bool = _flag(False, "--force", "Replace an existing output (only once the new one succeeded)")
    allow_pickle: bool = _flag(False, "--allow-pickle", "Accept pickle (.bin) adapters, loaded with weights_only")
    strict: bool = _flag(
        False, "--strict", "Treat warnings (an adapter trained on a differently named base, a device rule the package breaks) as errors"
    )
    verify: bool = _flag(True, "--no-verify", "Skip verifying every function against PyTorch", negates=True)
    backend: str = _flag("numpy", "--backend", "Verification backend: numpy (any OS) or coreml (macOS)")
    cache_dir: Path | None = _flag(
        None, "--cache-dir", "Build cache (default: .adapterpack-cache beside the output; parts: none unless given)"
    )
    use_cache: bool = _flag(True, "--no-cache", "Rebuild every function; do not read or write the cache", negates=True)
    package_format: str | None = _flag(None, "--format", _format_help())
    contract: str | None = _flag(
        None,
        "--contract",
        "How an app calls each function: swift-transformers (default) or apple (aimodel only: Apple's "
        "CoreAILanguageModel runtime); default: the manifest's export.contract",
    )

    def __post_init__(self) -> None:
        from adapterpack.formats.registry import NAMES
        from adapterpack.verification.runners import check_backend  # numpy loads when options are made, not on import

        check_backend(self.backend)
        if self.package_format is not None and self.package_format not in NAMES:
            raise BadInput(f"--format {self.package_format!r}: choose {' or '.join(NAMES)}")
        if self.contract is not None and self.contract not in CONTRACTS:
            raise BadInput(f"--contract {self.contract!r}: choose {' or '.join(CONTRACTS)}")


@dataclass
class FunctionProvenance:
    """Where a function of a package comes from: its adapter (path, content hash, how applied)
    and its compression; written into the package's metadata and release cards."""

    name: str
    adapter: str | None
    adapter_sha256: str | None
    lora: str | None
    scale: float | None
    compression: str
    auto: dict | None = None  # what compression auto measured for its choice

    def as_metadata(self) -> dict[str, object]:
        found: dict[str, object] = {
            "adapter": self.adapter,
            "adapterSha256": self.adapter_sha256,
            "lora": self.lora,
            "scale": self.scale,
            "compression": self.compression,
        }
        if self.auto is not None:
            found["auto"] = self.auto
        return found


@dataclass
class BuildResult:
    output: Path
    manifest: Manifest
    functions: list[FunctionProvenance]
    default_function: str
    part_sizes: dict[str, int] = field(default_factory=dict)
    package_size: int = 0
    seconds: float = 0.0
    verify_report: object | None = None  # verify.VerifyReport when verification ran
    reused: list[str] = field(default_factory=list)  # functions taken from the build cache
    format: Format | None = None  # what was written
