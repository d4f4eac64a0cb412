"""The package's public face is true: each stage's ``__all__`` names exactly its modules (and, for
a package that re-exports names, names that exist)."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "adapterpack"
PACKAGES = sorted(
    ".".join(("adapterpack", *folder.relative_to(SOURCE).parts)) for folder in SOURCE.rglob("*") if (folder / "__init__.py").is_file()
)


@pytest.mark.parametrize("package", PACKAGES)
def test_all_names_what_exists(package):
    module = importlib.import_module(package)
    listed = set(module.__all__)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    reexported = {name for name in listed if name not in submodules}
    assert all(hasattr(module, name) for name in reexported), sorted(name for name in reexported if not hasattr(module, name))
    if not reexported:  # a stage folder lists its modules, every one of them
        assert listed == submodules, (sorted(listed - submodules), sorted(submodules - listed))
