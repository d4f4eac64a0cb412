"""Merge single-function packages into one multifunction package and write its metadata back.

``save_multifunction`` shares a weight between functions only when it is identical, and drops
model-level metadata, so metadata is re-added afterwards by load -> edit -> save to a new path
(saving onto the folder a model was loaded from deletes it).
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path
from typing import Mapping

from .quiet import captured_output, import_coremltools

log = logging.getLogger(__name__)

HF_NAME_KEY = "co.huggingface.exporters.name"
METADATA_PREFIX = "co.adapterpack."


def merge_functions(
    parts: Mapping[str, Path],
    *,
    default_function: str,
    destination: Path,
    metadata: Mapping[str, str],
    description: str,
) -> Path:
    """Merge ``parts`` (function name -> single-function package) into ``destination``."""
    ct = import_coremltools()
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    descriptor = MultiFunctionDescriptor()
    for name, path in parts.items():
        descriptor.add_function(str(path), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = default_function
    merged = destination.parent / (destination.name + ".merged.mlpackage")
    with captured_output():
        save_multifunction(descriptor, str(merged))
        model = ct.models.MLModel(str(merged), skip_model_load=True)
        model.user_defined_metadata.update({k: str(v) for k, v in metadata.items()})
        model.short_description = description
        model.author = "adapterpack"
        model.save(str(destination))
    shutil.rmtree(merged, ignore_errors=True)
    record_weights_digest(destination)
    normalize_manifest_json(destination)
    return destination


def normalize_manifest_json(package: Path) -> None:
    """Replace the random item identifiers Core ML writes into ``Manifest.json`` with ones derived
    from each item's path, so the same inputs give a byte-identical package."""
    manifest_file = package / "Manifest.json"
    manifest = json.loads(manifest_file.read_text())
    renamed = {}
    for old_id, item in manifest.get("itemInfoEntries", {}).items():
        renamed[old_id] = str(uuid.uuid5(uuid.NAMESPACE_URL, "adapterpack:" + item.get("path", old_id))).upper()
    manifest["itemInfoEntries"] = {renamed[k]: v for k, v in sorted(manifest["itemInfoEntries"].items(), key=lambda kv: renamed[kv[0]])}
    if manifest.get("rootModelIdentifier") in renamed:
        manifest["rootModelIdentifier"] = renamed[manifest["rootModelIdentifier"]]
    manifest_file.write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")


def record_weights_digest(package: Path) -> None:
    """Write the weight blob's sha256 into the package's metadata, so verify can tell an altered blob.

    Only the model spec file is rewritten (the blob itself is untouched, so the digest stays true).
    """
    from coremltools.proto import Model_pb2

    from .verify import weights_digest

    spec_file = package / "Data" / "com.apple.CoreML" / "model.mlmodel"
    spec = Model_pb2.Model()
    spec.ParseFromString(spec_file.read_bytes())
    spec.description.metadata.userDefined[METADATA_PREFIX + "weightsSha256"] = weights_digest(package)
    # deterministic: protobuf map order is otherwise arbitrary, and builds must be reproducible
    spec_file.write_bytes(spec.SerializeToString(deterministic=True))


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


def library_versions() -> dict[str, str]:
    """Versions of adapterpack and the libraries that shape the package's bytes."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("adapterpack", "coremltools", "torch", "transformers", "peft", "numpy"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found
