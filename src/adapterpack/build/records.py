"""What a build reports: progress hooks (the CLI supplies a rich display), one record per
function, and the build's result.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from adapterpack.config.manifest import Manifest

log = logging.getLogger(__name__)


class Reporter:
    """Progress hooks; the library default only logs. The CLI supplies a rich display."""

    def stage(self, label: str) -> contextlib.AbstractContextManager[None]:
        return _logged_stage(label)

    def info(self, message: str) -> None:
        log.info(message)


@contextlib.contextmanager
def _logged_stage(label: str) -> Iterator[None]:
    started = time.perf_counter()
    log.info("%s ...", label)
    yield
    log.info("%s done (%.1f s)", label, time.perf_counter() - started)


@dataclass(frozen=True)
class BuildOptions:
    """How ``build``, ``release``, ``merge`` and fan-out parts run: the flags the commands share."""

    force: bool = False  # replace an existing output (only once the new one succeeded)
    allow_pickle: bool = False  # accept pickle (.bin) adapters, loaded with weights_only
    strict: bool = False  # warnings (other base, device rules) are errors
    verify: bool = True  # verify every function before the output is moved into place
    backend: str = "numpy"  # verification backend: numpy (any OS) or coreml (macOS)
    cache_dir: Path | None = None  # build cache (default: .adapterpack-cache beside the output)
    use_cache: bool = True  # read and write the build cache


@dataclass
class FunctionRecord:
    name: str
    adapter: str | None
    adapter_sha256: str | None
    lora: str | None
    scale: float | None
    compression: str

    def as_metadata(self) -> dict[str, object]:
        return {
            "adapter": self.adapter,
            "adapterSha256": self.adapter_sha256,
            "lora": self.lora,
            "scale": self.scale,
            "compression": self.compression,
        }


@dataclass
class BuildResult:
    output: Path
    manifest: Manifest
    functions: list[FunctionRecord]
    default_function: str
    part_sizes: dict[str, int] = field(default_factory=dict)
    package_size: int = 0
    seconds: float = 0.0
    verify_report: object | None = None  # verify.VerifyReport when verification ran
    reused: list[str] = field(default_factory=list)  # functions taken from the build cache
