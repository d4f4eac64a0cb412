"""Atomic output: build in a staging folder beside the target, rename into place only on success.

A failure, Ctrl-C or a kill at any point leaves the previous output untouched. Staging folders of
runs that were killed (their process is gone) are removed by the next run for the same target.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

STAGING_MARK = ".adapterpack-staging-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Staging:
    """``with Staging(target) as s: ...; s.commit(built)`` puts ``built`` at ``target`` atomically."""

    def __init__(self, target: Path):
        self.target = Path(target)
        self.folder = self.target.parent / f".{self.target.name}{STAGING_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Staging:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(self.target)
        self.folder.mkdir()
        return self

    def commit(self, built: Path) -> None:
        """Replace the target with ``built`` (which lives inside the staging folder)."""
        previous = None
        if self.target.exists() or self.target.is_symlink():
            previous = self.folder / "previous"
            os.replace(self.target, previous)
        try:
            os.replace(built, self.target)
        except BaseException:
            if previous is not None:
                os.replace(previous, self.target)
            raise

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def clean_stale(target: Path) -> None:
    """Remove staging folders left beside ``target`` by runs that no longer exist."""
    prefix = f".{target.name}{STAGING_MARK}"
    for candidate in target.parent.glob(prefix + "*"):
        pid_text = candidate.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        log.info("removing stale staging folder %s", candidate)
        shutil.rmtree(candidate, ignore_errors=True)
