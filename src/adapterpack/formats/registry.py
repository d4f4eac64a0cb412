"""Every format adapterpack writes, and the one place a path or a name is mapped to its format."""

from __future__ import annotations

from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.formats.aimodel.format import AIMODEL
from adapterpack.formats.format import Format
from adapterpack.formats.listing import PackageFunctions
from adapterpack.formats.metadata import METADATA_PREFIX
from adapterpack.formats.mlpackage.format import MLPACKAGE

FORMATS: dict[str, Format] = {f.name: f for f in (MLPACKAGE, AIMODEL)}
NAMES = tuple(FORMATS)


def described() -> str:
    """Every format with what runs it, for help texts: ``mlpackage (Core ML, iOS/macOS 18+) or ...``."""
    return " or ".join(f"{f.name} ({f.platforms})" for f in FORMATS.values())


def named(name: str) -> Format:
    """The format called ``name`` (``--format``, ``export.format``)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise BadInput(f"format {name!r}: choose {' or '.join(NAMES)}") from None


def of_output(path: str | Path) -> Format | None:
    """The format a path to write names by its suffix, or None when it names none."""
    suffix = Path(path).suffix
    return next((f for f in FORMATS.values() if f.suffix == suffix), None)


def of_package(path: str | Path) -> Format:
    """The format of an existing package: by its suffix; anything else is read as Core ML's
    (an ``.mlpackage`` of another name, or an ``.mlmodel`` file)."""
    return of_output(path) or MLPACKAGE


def read_functions(package: str | Path) -> PackageFunctions:
    """Functions, default function and metadata of a package of any format."""
    path = Path(package)
    if not path.exists():
        raise BadInput(f"{path}: package not found")
    return of_package(path).read_functions(path)


def written_by_adapterpack(path: str | Path) -> bool:
    """Whether ``path`` is a package adapterpack wrote (its own metadata keys are inside): the
    only kind of existing output a build may replace, whatever its name ends with."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return False
    try:
        metadata = of_package(path).metadata(path)
    except Exception:  # noqa: BLE001 - anything unreadable (no spec, bad protobuf, no access) is not ours
        return False
    return any(key.startswith(METADATA_PREFIX) for key in metadata)
