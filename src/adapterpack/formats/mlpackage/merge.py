"""Merge single-function packages into one multifunction package, weights stored once.

The result is what coremltools' ``MultiFunctionDescriptor`` + ``save_multifunction`` write (one
``FunctionDescription`` and one program function per part, a default function, identical
weights shared), but written by streaming: each part's model spec is small and is copied with
its function renamed, and its weight records are copied one at a time into a new blob, a record
whose dtype and bytes were already written being pointed at instead of written again.
``save_multifunction`` instead loads every part's program with all its weights (5 functions of a
1B model at 4 bits hold over 6 GB as numpy arrays) and re-serializes them; it stays the reference
that tests compare this merge against.

Weight blob format: see ``mlpackage.blob``. The spec's ``BlobFileValue.offset`` is a record's
metadata offset; a copied record keeps its metadata except the absolute data offset.
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from adapterpack.errors import BadInput
from adapterpack.formats.metadata import METADATA_PREFIX
from adapterpack.formats.mlpackage.blob import ALIGNMENT, HEADER_BYTES, METADATA_BYTES, record_chunks, record_identity
from adapterpack.formats.mlpackage.digest import blob_values, function_digest, top_level_description, weights_digest
from adapterpack.formats.mlpackage.spec import MODEL_FOLDER, MODEL_PATH_PREFIX, SPEC_NAME, load_spec_file
from adapterpack.formats.mlpackage.weight_patch import blob_file
from adapterpack.quiet import import_coremltools

log = logging.getLogger(__name__)


WEIGHTS_FILE = MODEL_PATH_PREFIX + "weights/weight.bin"


# A part is a one-function package; coremltools names that function "main".
PART_FUNCTION = "main"


# Multifunction models need the iOS 18 specification (version 9).
MULTIFUNCTION_SPEC_VERSION = 9


class _BlobWriter:
    """Appends weight records to a new blob file, each distinct (metadata, bytes) once."""

    def __init__(self, path: Path):
        self.path = path
        self.handle: BinaryIO = path.open("wb")
        self.handle.write(b"\0" * HEADER_BYTES)
        self.count = 0
        self.written: dict[bytes, int] = {}  # record identity -> metadata offset in the new blob
        self.shared = 0

    def copy(self, source: BinaryIO, offset: int, source_name: str) -> tuple[int, bytes]:
        """Copy the record whose metadata is at ``offset`` in ``source``; returns its new offset
        and its identity (``blob.record_identity``)."""
        key, metadata, data_offset, size = record_identity(source, offset, source_name)
        found = self.written.get(key)
        if found is not None:
            self.shared += 1
            return found, key
        position = self.handle.tell()
        data_position = position + METADATA_BYTES
        self.handle.write(metadata[:16] + struct.pack("<Q", data_position) + metadata[24:])
        for chunk in record_chunks(source, data_offset, size):
            self.handle.write(chunk)
        self.handle.write(b"\0" * (-self.handle.tell() % ALIGNMENT))
        self.count += 1
        self.written[key] = position
        return position, key

    def close(self) -> None:
        self.handle.seek(0)
        self.handle.write(struct.pack("<II", self.count, 2))
        self.handle.close()


def read_spec(package: Path):
    """The model spec (protobuf) of a package."""
    return load_spec_file(package.joinpath(*MODEL_FOLDER, SPEC_NAME))


def merge_functions(
    parts: Mapping[str, Path],
    *,
    default_function: str,
    destination: Path,
    metadata: Mapping[str, str],
    description: str,
) -> dict[str, str]:
    """Merge ``parts`` (function name -> single-function package) into ``destination``; returns
    each function's digest (``digest.function_digest``) as it landed there."""
    import_coremltools()
    from coremltools.proto import Model_pb2

    if default_function not in parts:
        raise ValueError(f"default function {default_function} is not among {', '.join(parts)}")
    model_folder = destination.joinpath(*MODEL_FOLDER)
    (model_folder / "weights").mkdir(parents=True)
    merged = Model_pb2.Model()
    merged.specificationVersion = MULTIFUNCTION_SPEC_VERSION
    blob = _BlobWriter(model_folder / "weights" / "weight.bin")
    digests: dict[str, str] = {}
    try:
        for name, package in parts.items():
            spec = read_spec(package)
            function = _only_function(spec, package)
            placed = {}  # (blob file, offset) in the part -> (offset in the merged blob, identity)
            with contextlib.ExitStack() as files:
                sources: dict[str, BinaryIO] = {}
                for value in blob_values(function):
                    place = (value.fileName, value.offset)
                    if value.fileName not in sources:
                        sources[value.fileName] = files.enter_context(blob_file(package, value.fileName).open("rb"))
                    if place not in placed:
                        placed[place] = blob.copy(sources[value.fileName], value.offset, str(blob_file(package, value.fileName)))
            declared = top_level_description(spec, name)
            digests[name] = function_digest(function, declared, {place: key for place, (_, key) in placed.items()})
            for value in blob_values(function):
                value.fileName, value.offset = WEIGHTS_FILE, placed[(value.fileName, value.offset)][0]
            merged.specificationVersion = max(merged.specificationVersion, spec.specificationVersion)
            if not merged.mlProgram.version:
                merged.mlProgram.version = spec.mlProgram.version
            merged.mlProgram.functions[name].CopyFrom(function)
            merged.description.functions.append(declared)
            del spec, function
    finally:
        blob.close()
    log.debug("merged %d functions: %d weight records written, %d shared", len(parts), blob.count, blob.shared)

    merged.description.defaultFunctionName = default_function
    merged.description.metadata.userDefined.update({k: str(v) for k, v in metadata.items()})
    merged.description.metadata.userDefined[METADATA_PREFIX + "weightsSha256"] = weights_digest(destination)
    merged.description.metadata.shortDescription = description
    merged.description.metadata.author = "adapterpack"
    # deterministic: protobuf map order is otherwise arbitrary, and builds must be reproducible
    (model_folder / SPEC_NAME).write_bytes(merged.SerializeToString(deterministic=True))
    write_package_manifest(destination)
    return digests


def _only_function(spec, package: Path):
    if spec.WhichOneof("Type") != "mlProgram":
        raise BadInput(f"{package}: not an ML Program")
    functions = spec.mlProgram.functions
    if list(functions) != [PART_FUNCTION]:
        raise BadInput(f"{package}: a part holds one function named {PART_FUNCTION}, this one {', '.join(functions)}")
    return functions[PART_FUNCTION]


def write_package_manifest(package: Path) -> None:
    """``Manifest.json`` of an ``.mlpackage`` holding a model spec and its weights.

    Core ML's package writer would give each item a random identifier; these are derived from the
    item's path, so the same inputs give a byte-identical package.
    """
    items = {
        "model.mlmodel": ("com.apple.CoreML/model.mlmodel", "CoreML Model Specification"),
        "weights": ("com.apple.CoreML/weights", "CoreML Model Weights"),
    }
    entries = {}
    root = None
    for name, (path, what) in items.items():
        identifier = str(uuid.uuid5(uuid.NAMESPACE_URL, "adapterpack:" + path)).upper()
        entries[identifier] = {"author": "com.apple.CoreML", "description": what, "name": name, "path": path}
        if name == SPEC_NAME:
            root = identifier
    manifest = {"fileFormatVersion": "1.0.0", "itemInfoEntries": dict(sorted(entries.items())), "rootModelIdentifier": root}
    (package / "Manifest.json").write_text(json.dumps(manifest, indent=4, sort_keys=True) + "\n")
