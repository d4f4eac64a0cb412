"""Fused functions from an already built package by patching weight values, not by rebuilding.

A fused adapter changes the values of the weights it targets and nothing else: same ops, same
shapes, same dtypes, and (compressed the same way) the same record sizes. So instead of tracing,
converting and compressing the whole model once per function, the base is converted and
compressed once and each fused function is a copy of it whose weight blob has the targeted
tensors' records replaced in place (same sizes, same offsets, the model spec untouched).

A tensor is found by its content: the bytes its base value is stored as, in one of the forms it
may take (palettized: packed indices + palette; float16), so nothing depends on coremltools'
naming. Anything that cannot be matched exactly returns False and the caller builds that
function the ordinary way.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapterpack.formats.mlpackage.blob import read_blob_records

log = logging.getLogger(__name__)

WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"

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


def patch_weights(source: Path, destination: Path, changes: list[TensorChange]) -> bool:
    """Copy ``source`` to ``destination`` with every change applied.

    Returns False (and leaves no ``destination``) when some change has no form whose base
    records are each stored exactly once in ``source``.
    """
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination)
    try:
        if _patch_in_place(destination, changes):
            return True
    except Exception:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    shutil.rmtree(destination, ignore_errors=True)
    return False


def _patch_in_place(package: Path, changes: list[TensorChange]) -> bool:
    wanted = {(dtype, len(old)) for change in changes for encoding in change.encodings for dtype, old, _ in encoding}
    records = [r for r in read_blob_records(package, WEIGHTS) if (r.dtype, r.size) in wanted]
    blob = package / WEIGHTS
    by_content: dict[tuple[str, bytes], list[int]] = {}
    with blob.open("rb") as handle:
        for record in records:
            handle.seek(record.data_offset)
            by_content.setdefault((record.dtype, _digest(handle.read(record.size))), []).append(record.data_offset)
    writes: list[tuple[int, bytes]] = []
    for change in changes:
        for encoding in change.encodings:
            places = [by_content.get((dtype, _digest(old)), []) for dtype, old, new in encoding]
            if all(len(found) == 1 and len(old) == len(new) for found, (_, old, new) in zip(places, encoding)):
                writes.extend((found[0], new) for found, (_, _, new) in zip(places, encoding))
                break
        else:
            log.debug("a changed weight is not stored exactly once in any expected form: building instead")
            return False
    with blob.open("r+b") as handle:
        for offset, data in writes:
            handle.seek(offset)
            handle.write(data)
    return True
