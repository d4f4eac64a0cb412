"""Paths the user gives, resolved safely, and the one rule every writer follows: an output is never
written over, into, or around an input.

``Path.resolve`` raises a bare RuntimeError on a symlink loop and ``expanduser`` on an unknown
``~user``; here both are bad input naming the path. ``refuse_overlap`` is called by every command
that writes or deletes (build, its parts, merge, release, the build cache and its commands) with
everything the command reads: a package, a release file, a bundle folder or a cache operation
that is, holds or lies inside an input is refused, with or without ``--force``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from adapterpack.errors import BadInput


def resolved(path: str | Path, what: str = "path", folder: Path | None = None) -> Path:
    """``path`` with ``~`` expanded, relative to ``folder`` (default: the working folder),
    absolute, symlinks followed; BadInput naming it when that cannot be done (a symlink loop, an
    unknown home folder, a NUL byte)."""
    text = str(path)
    if "\0" in text:
        raise BadInput(f"{text!r}: the {what} holds a NUL byte")
    try:
        expanded = Path(text).expanduser()
        return (expanded if folder is None else Path(folder) / expanded).resolve()
    except RuntimeError as error:  # Python 3.11: "Symlink loop from ...", "Could not determine home directory."
        raise BadInput(f"{text}: the {what} cannot be resolved ({error})") from None
    except OSError as error:
        raise BadInput(f"{text}: the {what} cannot be resolved ({error.strerror or error})") from None


def overlaps(first: Path, second: Path) -> bool:
    """Whether two resolved paths are the same, or one lies inside the other."""
    return first == second or first in second.parents or second in first.parents


def refuse_overlap(target: str | Path, inputs: Iterable[str | Path], role: str = "output") -> None:
    """BadInput when ``target`` (something a command writes or deletes) is, holds or lies inside
    one of ``inputs`` (everything the command reads)."""
    where = resolved(target, role)
    for given in inputs:
        found = resolved(given, "input")
        if overlaps(where, found):
            relation = "is" if where == found else ("lies inside" if found in where.parents else "holds")
            raise BadInput(
                f"{target}: the {role} {relation} an input ({found}): it would be written over; choose another {role}"
            )

