"""What a package of either format records about itself: the Swift client's tokenizer name and
adapterpack's provenance (adapters, their hashes, compression, library versions), under the
same keys in a ``.mlpackage``'s spec and an ``.aimodel``'s ``metadata.json``."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping

log = logging.getLogger(__name__)


HF_NAME_KEY = "co.huggingface.exporters.name"


METADATA_PREFIX = "co.adapterpack."


def finite(value: object) -> object:
    """``value`` with every float that is not finite (NaN, infinity) replaced by None: JSON has
    no such numbers, and strict readers (Swift's ``JSONDecoder``, ``jq``) refuse Python's
    ``NaN``/``Infinity``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def strict_json(value: object, **options) -> str:
    """``json.dumps`` of ``value`` as standard JSON (``finite``): what adapterpack writes into a
    package, a release or a report is read by strict parsers."""
    return json.dumps(finite(value), allow_nan=False, **options)


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
        METADATA_PREFIX + "base": strict_json(dict(base), sort_keys=True),
        METADATA_PREFIX + "functions": strict_json({k: dict(v) for k, v in functions.items()}, sort_keys=True),
        METADATA_PREFIX + "versions": strict_json(dict(versions), sort_keys=True),
    }


def library_versions(libraries: tuple[str, ...]) -> dict[str, str]:
    """Versions of adapterpack, the libraries that shape the package's bytes (``libraries``: a
    format's converter and writer, ``Format.libraries``) and torch, transformers, peft, numpy."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("adapterpack", *libraries, "torch", "transformers", "peft", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found
