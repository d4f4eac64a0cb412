"""Reading a Core AI ``.aimodel``: its entry points and their signatures (through coreai-core's
asset summary), adapterpack's metadata (``metadata.json``) and the integrity of its program.

An asset is a folder: ``main.mlirb`` (the program, every entry point and its weights),
``main.hash`` (sha256 of ``main.mlirb``, written by coreai-core) and ``metadata.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.files import sha256_files
from adapterpack.formats.listing import Feature, FunctionInfo, PackageFunctions
from adapterpack.formats.metadata import METADATA_PREFIX

SUFFIX = ".aimodel"
PROGRAM_FILE = "main.mlirb"
HASH_FILE = "main.hash"
METADATA_FILE = "metadata.json"
# Where adapterpack's metadata sits in metadata.json (coreai's set_custom).
METADATA_KEY = "adapterpack"
# The metadata key of the contract an asset's functions follow (config.manifest.CONTRACTS); an
# asset without it was written before there was a choice: swift-transformers'.
CONTRACT_KEY = METADATA_PREFIX + "contract"
EXTRA_MISSING = 'the .aimodel format needs the [coreai] extra: pip install "adapterpack[coreai]"'

_SIGNATURE = re.compile(r"NDArray \((\w+), (.*)\)")


def asset_metadata(path: Path) -> dict[str, str]:
    """adapterpack's metadata in the asset (the same keys as a ``.mlpackage``'s)."""
    try:
        document = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError) as error:
        raise BadInput(f"{path}: not a readable .aimodel ({METADATA_FILE}: {error})") from None
    found = document.get("creatorDefinedMetadata", {}).get(METADATA_KEY, {})
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def asset_contract(path: Path) -> str:
    """How the asset's functions are called: ``swift-transformers`` or ``apple``."""
    return asset_metadata(path).get(CONTRACT_KEY, "swift-transformers")


def program_intact(path: Path) -> bool:
    """Whether ``main.mlirb`` still has the sha256 recorded beside it when it was written."""
    try:
        return sha256_files([path / PROGRAM_FILE]) == (path / HASH_FILE).read_bytes().hex()
    except (BadInput, OSError):  # a missing or unreadable file is not intact
        return False


def program_digest(path: Path) -> str:
    """Hex sha256 of the asset's program (what ``main.hash`` records)."""
    try:
        return (path / HASH_FILE).read_bytes().hex()
    except OSError:
        return ""


def feature_of(name: str, signature: str) -> tuple[str, str, str]:
    """(name, dtype, shape) from the runtime's ``NDArray (Float16, 1 × ? × 264)``."""
    found = _SIGNATURE.fullmatch(signature.strip())
    if found is None:
        return name, signature, ""
    dims = [d.strip() for d in found.group(2).split("×")]
    return name, found.group(1).lower(), "(" + ", ".join(dims) + ")"


def dims_of(shape: str) -> tuple[int, ...]:
    """The static dimensions of a shape as ``feature_of`` writes it: ``(4, 1, 65)``."""
    return tuple(int(d) for d in shape.strip("()").split(", "))


def shape_of(signature: str) -> tuple[int, ...]:
    """The static shape in a runtime signature (a state's): ``NDArray (Float16, 4 × 1 × 65)``."""
    return dims_of(feature_of("", signature)[2])


def asset_summary(path: Path, *, statistics: bool = False):
    """coreai-core's summary of the asset: function names and signatures, and with
    ``statistics`` storage types and op counts (slower: reads the whole program)."""
    if not (path / PROGRAM_FILE).is_file():
        raise BadInput(f"{path}: not a Core AI asset (no {PROGRAM_FILE})")
    try:
        from coreai.authoring.asset import AIModelAsset
    except ImportError:
        raise BadInput(EXTRA_MISSING) from None
    try:
        return AIModelAsset.load(path).summary(include_statistics=statistics)
    except RuntimeError as error:
        raise BadInput(f"{path}: Core AI cannot read this asset: {error}") from None



def asset_functions(path: Path) -> PackageFunctions:
    """A Core AI asset's entry points, read with coreai-core; its default from our metadata."""
    summary = asset_summary(path)
    functions = [
        FunctionInfo(
            name=name,
            inputs=[Feature(*feature_of(*item)) for item in summary.function_inputs(name)],
            outputs=[Feature(*feature_of(*item)) for item in summary.function_outputs(name)],
            states=[Feature(*feature_of(*item)) for item in summary.function_states(name)],
        )
        for name in summary.function_names
    ]
    if not functions:
        raise BadInput(f"{path}: the asset has no entry points")
    metadata = asset_metadata(path)
    default = metadata.get(METADATA_PREFIX + "defaultFunction") or functions[0].name
    return PackageFunctions(path=path, functions=functions, default=default, metadata=metadata)
