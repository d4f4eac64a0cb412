"""Calibration texts: the user's own text per function, read and checked before any heavy work.

Data-aware palettes weigh each weight by the activations these texts cause in the base, and
``compression.auto`` measures each function on its own text. A text is UTF-8 and not empty; only
its first ``CALIBRATION_TOKENS`` tokens are used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.inputs.text import read_text_file

MAX_CALIBRATION_BYTES = 16 << 20
# Tokens of each text the statistics and auto's measurements read (from its start): a bound on
# the build time they add, whatever the file's length.
CALIBRATION_TOKENS = 2048


@dataclass(frozen=True)
class CalibrationText:
    path: Path
    text: str
    sha256: str


def read_calibration(path: Path) -> CalibrationText:
    """The text at ``path``; BadInput naming the file when it is not usable text."""
    try:
        too_large = path.stat().st_size > MAX_CALIBRATION_BYTES
    except OSError as error:
        raise BadInput(f"{path}: cannot read: {error.strerror or error}") from None
    if too_large:
        raise BadInput(f"{path}: a calibration text must be at most {MAX_CALIBRATION_BYTES >> 20} MiB")
    text = read_text_file(path)
    return CalibrationText(path, text, hashlib.sha256(text.encode("utf-8")).hexdigest())
