"""``inspect`` of a package of any format: each format's inspector, by the format's registry."""

from __future__ import annotations

from pathlib import Path

from adapterpack.formats.aimodel.format import AIMODEL
from adapterpack.formats.aimodel.inspection import AssetReport, inspect_asset
from adapterpack.formats.mlpackage.format import MLPACKAGE
from adapterpack.formats.mlpackage.inspection import PackageReport, inspect_package
from adapterpack.formats.registry import of_package

# Format -> what accounts for a package of it.
INSPECTORS = {MLPACKAGE: inspect_package, AIMODEL: inspect_asset}


def inspect_either(path: Path | str) -> AssetReport | PackageReport:
    """The inspection of a package of any format (``INSPECTORS``)."""
    return INSPECTORS[of_package(path)](path)
