"""Fused functions from the converted base by patching weight values, not by converting again.

A fused adapter changes the values of the weights it targets and nothing else: same ops, same
shapes, same dtypes. So instead of tracing and converting the whole model once per function,
the base is converted once (the template) and each fused function is a copy of it whose weight
blob has the targeted tensors' bytes replaced in place (same sizes, same offsets, the model spec
untouched). A tensor is found by its content (the float16 base weight), so nothing depends on
coremltools' naming. Anything that cannot be matched exactly returns False and the caller
converts that function the ordinary way.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

import numpy as np

from .inspect_package import read_blob_records

log = logging.getLogger(__name__)

WEIGHTS = "Data/com.apple.CoreML/weights/weight.bin"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=20).digest()


def patch_weights(template: Path, destination: Path, replacements: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    """Copy ``template`` to ``destination`` with each (old, new) float16 tensor's bytes replaced.

    Returns False (and leaves no ``destination``) when some old tensor is not stored exactly once.
    """
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(template, destination)
    try:
        if _patch_in_place(destination, replacements):
            return True
    except Exception:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    shutil.rmtree(destination, ignore_errors=True)
    return False


def _patch_in_place(package: Path, replacements: list[tuple[np.ndarray, np.ndarray]]) -> bool:
    sizes = {old.nbytes for old, _ in replacements}
    records = [r for r in read_blob_records(package, WEIGHTS) if r.size in sizes and r.dtype == "float16"]
    blob = package / WEIGHTS
    by_content: dict[bytes, list[int]] = {}
    with blob.open("rb") as handle:
        for record in records:
            handle.seek(record.data_offset)
            by_content.setdefault(_digest(handle.read(record.size)), []).append(record.data_offset)
    with blob.open("r+b") as handle:
        for old, new in replacements:
            if old.dtype != np.float16 or new.dtype != np.float16 or old.shape != new.shape:
                return False
            places = by_content.get(_digest(np.ascontiguousarray(old).tobytes()), [])
            if len(places) != 1:
                log.debug("weight of shape %s stored %d times in the template: converting instead", old.shape, len(places))
                return False
            handle.seek(places[0])
            handle.write(np.ascontiguousarray(new).tobytes())
    return True
