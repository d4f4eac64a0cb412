"""What a package records about itself: the Swift client's tokenizer name, our provenance
(adapters, their hashes, compression, library versions) and the digest of its weight blobs."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


HF_NAME_KEY = "co.huggingface.exporters.name"


METADATA_PREFIX = "co.adapterpack."


def package_metadata(
    *,
    hf_name: str,
    manifest_name: str,
    functions: Mapping[str, Mapping[str, object]],
    default_function: str,
    max_context: int,
    base: Mapping[str, object],
    versions: Mapping[str, str],
) -> dict[str, str]:
    """Metadata written into the package: the client's lookup key plus adapterpack's provenance."""
    return {
        HF_NAME_KEY: hf_name,
        "co.huggingface.exporters.task": "text-generation",
        METADATA_PREFIX + "name": manifest_name,
        METADATA_PREFIX + "defaultFunction": default_function,
        METADATA_PREFIX + "maxContext": str(max_context),
        METADATA_PREFIX + "base": json.dumps(dict(base), sort_keys=True),
        METADATA_PREFIX + "functions": json.dumps({k: dict(v) for k, v in functions.items()}, sort_keys=True),
        METADATA_PREFIX + "versions": json.dumps(dict(versions), sort_keys=True),
    }


def library_versions(*, core_ai: bool = False) -> dict[str, str]:
    """Versions of adapterpack and the libraries that shape the package's bytes (``core_ai``: of
    a Core AI ``.aimodel``, whose converter and writer replace coremltools)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    converters = ("coreai-core", "coreai-torch") if core_ai else ("coremltools",)
    for package in ("adapterpack", *converters, "torch", "transformers", "peft", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


def weights_digest(package: Path) -> str:
    """sha256 of the package's weight blobs, in path order (recorded at build, checked here)."""
    digest = hashlib.sha256()
    weights = sorted((package / "Data").rglob("weights/*")) if (package / "Data").exists() else []
    for file in weights:
        if file.is_file():
            digest.update(file.relative_to(package).as_posix().encode())
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()
