"""What reading any file a user names must check, below every stage (the formats' readers use it
as the inputs' do): special files refused unopened, one-line messages that start with the file,
content digests streamed; and folders derived from inputs written whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from adapterpack.errors import BadInput

CHUNK = 1 << 20  # 1 MiB: a multiple of every element size, small enough to stay cache-friendly


def bad_file(where: Path | str, problem: str) -> BadInput:
    """A one-line BadInput that starts with the file (or source) at fault."""
    return BadInput(" ".join(f"{where}: {problem}".splitlines()))


def short(exc: BaseException, limit: int = 200) -> str:
    """One-line, bounded description of a foreign exception for embedding in a message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sha256_files(files: Iterable[Path | str]) -> str:
    """SHA-256 hex digest of the concatenated contents of ``files``, streamed in 1 MiB chunks.

    The caller fixes the order (config first, then weights); symlinks (hub cache) are followed.
    """
    digest = hashlib.sha256()
    for file in files:
        path = Path(file)
        refuse_special_file(path, "a file to hash")
        try:
            with path.open("rb") as fh:
                while chunk := fh.read(CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise bad_file(path, f"cannot read: {exc.strerror or short(exc)}") from None
    return digest.hexdigest()


def refuse_special_file(file: Path, expected: str) -> None:
    """BadInput when ``file`` is a FIFO, socket or device: opening one blocks (or never ends),
    so it is refused unopened."""
    if file.exists() and not file.is_dir() and not file.is_file():
        raise bad_file(file, f"is not a regular file (a FIFO, socket or device); expected {expected}")


def written_once(folder: Path, fill: Callable[[Path], None]) -> None:
    """``folder``, filled by ``fill(incoming)`` in a hidden sibling and renamed into place: written
    whole or not at all (a failed fill leaves nothing behind), and another process writing the
    same content at the same time is fine (the first to finish wins)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    incoming = folder.parent / f".{folder.name}.{uuid.uuid4().hex}"
    incoming.mkdir()
    try:
        fill(incoming)
        try:
            os.rename(incoming, folder)
        except OSError:  # written by another process first
            pass
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
