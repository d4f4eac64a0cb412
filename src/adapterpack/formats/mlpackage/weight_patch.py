"""Fused functions from an already built package by patching weight values, not by rebuilding.

A fused adapter changes the values of the weights it targets and nothing else: same ops, same
shapes, same dtypes, and (compressed the same way) the same record sizes. So instead of tracing,
converting and compressing the whole model once per function, the base is converted and
compressed once and each fused function is made from it by replacing the targeted tensors'
records.

The patched package shares the base's weight blob (a hard link where the filesystem allows one)
and holds only the replacing records, in a blob file of its own that the spec's references to
the replaced records now name: an 8B base compressed to 4 bits is 4.5 GB, an adapter's q/k/v/o
records 0.7 GB of it, and a copy per function would fill the disk. Such a package (a part) is
read by the merge, which writes one blob, and by coremltools' loader; nothing else reads parts.

A tensor is found by its content: the bytes its base value is stored as, in one of the forms it
may take (palettized: packed indices + palette; float16), so nothing depends on coremltools'
naming. Anything that cannot be matched exactly returns False and the caller builds that
function the ordinary way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.blob import BlobWriter, read_blob_records, record_chunks, record_metadata
from adapterpack.formats.mlpackage.digest import blob_values
from adapterpack.formats.mlpackage.spec import MODEL_FOLDER, MODEL_PATH_PREFIX, SPEC_NAME, load_spec_file

log = logging.getLogger(__name__)

WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"

# Blob files of replacing records are named "patched-N.bin" in the package's weights folder.
PATCH_BLOB_PREFIX = "patched-"

# One stored form of a tensor: the records it occupies, as (blob dtype, base bytes, new bytes).
Encoding = list[tuple[str, bytes | memoryview, bytes | memoryview]]


@dataclass
class TensorChange:
    """One weight's new value, in each form it may be stored in (tried in order)."""

    encodings: list[Encoding]

    @classmethod
    def float16(cls, old: np.ndarray, new: np.ndarray) -> TensorChange:
        return cls([[("float16", _bytes(old), _bytes(new))]])


def _bytes(value: np.ndarray) -> memoryview:
    """The value's bytes without a copy (a 3B model's fused q/k/v/o are gigabytes)."""
    if value.dtype != np.float16:
        raise TypeError(f"expected float16, got {value.dtype}")
    return memoryview(np.ascontiguousarray(value)).cast("B")


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


# A record as the spec names it: (BlobFileValue.fileName, offset of its metadata block).
Place = tuple[str, int]


def link_or_copy(source: str | Path, destination: str | Path) -> None:
    """A hard link where the filesystem allows one (blobs and parts are never modified in
    place), else a copy."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def patch_weights(source: Path, destination: Path, changes: list[TensorChange]) -> bool:
    """Write ``destination``: ``source`` with every change applied, sharing ``source``'s blobs.

    Returns False (and leaves no ``destination``) when some change has no form whose base
    records the program reads each from exactly one place.
    """
    spec = load_spec_file(source.joinpath(*MODEL_FOLDER, SPEC_NAME))
    replacements = _replacements(source, spec, changes)
    if destination.exists():
        shutil.rmtree(destination)
    if replacements is None:
        log.debug("a changed weight is not stored exactly once in any expected form: building instead")
        return False
    try:
        _write_patched(source, destination, spec, replacements)
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    return True


def blob_file(package: Path, file_name: str) -> Path:
    """The file a BlobFileValue's ``fileName`` names in ``package``: the base's ``weight.bin`` or
    a blob of replacing records, in its weights folder. A part may come from another job (CI
    fan-out): BadInput for a name outside that folder or a file the package lacks."""
    prefix = MODEL_PATH_PREFIX + "weights/"
    name = file_name.removeprefix(prefix)
    if not file_name.startswith(prefix) or not name or "/" in name or name.startswith("."):
        raise BadInput(f"{package}: a weight lives in {file_name}, not in {prefix}")
    path = package.joinpath(*MODEL_FOLDER, "weights", name)
    if not path.is_file():
        raise BadInput(f"{package}: its weights name {file_name}, which it does not hold")
    return path


def _places(spec) -> set[Place]:
    return {(value.fileName, value.offset) for function in spec.mlProgram.functions.values() for value in blob_values(function)}


def _replacements(package: Path, spec, changes: list[TensorChange]) -> dict[Place, bytes | memoryview] | None:
    """{place of a base record: its new bytes} for every change, or None when one is not found."""
    wanted = {(dtype, len(old)) for change in changes for encoding in change.encodings for dtype, old, _ in encoding}
    by_content: dict[tuple[str, bytes], list[Place]] = {}
    handles = {}
    try:
        for place in sorted(_places(spec)):
            file_name, offset = place
            if file_name not in handles:
                handles[file_name] = blob_file(package, file_name).open("rb")
            _, dtype, data_offset, size = record_metadata(handles[file_name], offset)
            if (dtype, size) not in wanted:
                continue
            digest = hashlib.sha256()
            for chunk in record_chunks(handles[file_name], data_offset, size):
                digest.update(chunk)
            by_content.setdefault((dtype, digest.digest()), []).append(place)
    finally:
        for handle in handles.values():
            handle.close()
    replacements: dict[Place, bytes | memoryview] = {}
    for change in changes:
        for encoding in change.encodings:
            found = [by_content.get((dtype, _digest(old)), []) for dtype, old, _ in encoding]
            if all(len(places) == 1 and len(old) == len(new) for places, (_, old, new) in zip(found, encoding)):
                for (place,), (_, _, new) in zip(found, encoding):
                    if place in replacements and bytes(replacements[place]) != bytes(new):
                        return None  # two changes claim one record with different values
                    replacements[place] = new
                break
        else:
            return None
    return replacements


def _write_patched(source: Path, destination: Path, spec, replacements: dict[Place, bytes | memoryview]) -> None:
    """``destination``: ``source``'s files (its blobs linked), a new blob of the replacing
    records, and the spec naming them where it named the records they replace."""
    spec_file = source.joinpath(*MODEL_FOLDER, SPEC_NAME)
    weights = source.joinpath(*MODEL_FOLDER, "weights")
    for path in sorted(source.rglob("*")):
        target = destination / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path != spec_file:
            target.parent.mkdir(parents=True, exist_ok=True)
            (link_or_copy if path.parent == weights else shutil.copy2)(path, target)
    index = 1
    while (weights / f"{PATCH_BLOB_PREFIX}{index}.bin").exists():
        index += 1
    name = f"{PATCH_BLOB_PREFIX}{index}.bin"
    file_name = f"{MODEL_PATH_PREFIX}weights/{name}"
    moved: dict[Place, int] = {}
    blob_folder = destination.joinpath(*MODEL_FOLDER, "weights")
    blob_folder.mkdir(parents=True, exist_ok=True)
    with BlobWriter(blob_folder / name) as blob:
        for place in sorted(replacements):
            with blob_file(source, place[0]).open("rb") as handle:
                metadata = record_metadata(handle, place[1])[0]
            moved[place] = blob.write_like(metadata, replacements[place])
    for function in spec.mlProgram.functions.values():
        for value in blob_values(function):
            offset = moved.get((value.fileName, value.offset))
            if offset is not None:
                value.fileName, value.offset = file_name, offset
    destination.joinpath(*MODEL_FOLDER, SPEC_NAME).write_bytes(spec.SerializeToString(deterministic=True))


def unread_bytes(package: Path) -> int:
    """Bytes of the weight records in ``package``'s blobs that its program does not read: in a
    patched part, the base's records it replaced (its linked blob holds them still)."""
    places = _places(load_spec_file(package.joinpath(*MODEL_FOLDER, SPEC_NAME)))
    weights = package.joinpath(*MODEL_FOLDER, "weights")
    unread = 0
    for blob in sorted(weights.glob("*.bin")) if weights.is_dir() else []:
        file_name = f"{MODEL_PATH_PREFIX}weights/{blob.name}"
        for record in read_blob_records(package, blob.relative_to(package).as_posix()):
            if (file_name, record.offset) not in places:
                unread += record.size + record.overhead
    return unread
