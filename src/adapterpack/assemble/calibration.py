"""The build's calibration: the activation statistics of the manifest's calibration texts, which
data-aware palettes weigh by (``compress.importance``), measured once and kept in the build cache.

The statistics are the base's, on every calibration text (the base's and each skill's), not each
fused function's on its own text: identical base weights then get identical palettes in every
function, so the package still stores them once, and a skill's text still decides what its
layers keep.
"""

from __future__ import annotations

import logging

from adapterpack.assemble.parts import content_key
from adapterpack.compress.importance import ChannelImportance
from adapterpack.inputs.calibration import CALIBRATION_TOKENS
from adapterpack.inputs.checked import CheckedInputs

log = logging.getLogger(__name__)

# Bump when what the statistics compute changes, so ones cached by an older version are not used.
CALIBRATION_VERSION = 1
# Tokens per forward while measuring (at most the cache length).
CALIBRATION_WINDOW = 512
ENERGIES_FILE = "energies.npz"
# The statistics last measured in this process, by calibration key: a build without a cache
# (or a build_parts after auto) reads them again instead of running the base once more.
_LAST_MEASURED: dict[str, ChannelImportance] = {}


def calibration_key(checked: CheckedInputs, function: str | None = None) -> str | None:
    """Digest of everything the statistics depend on, or None when none are used (no calibration
    text, or ``function``, when named, is not palettized)."""
    if not checked.calibration:
        return None
    if function is not None and checked.manifest.compression_for(function).method != "palettize":
        return None
    return content_key(
        {
            "calibration": CALIBRATION_VERSION,
            "base": checked.base.content_hash,
            "texts": [text.sha256 for text in checked.calibration.values()],
            "tokens": CALIBRATION_TOKENS,
            "window": calibration_window(checked),
        }
    )


def calibration_window(checked: CheckedInputs) -> int:
    return min(CALIBRATION_WINDOW, int(checked.manifest.export.max_context))


def calibration_ids(checked: CheckedInputs) -> dict[str | None, list[int]]:
    """Each calibration text's first ``CALIBRATION_TOKENS`` token ids, by function (as
    ``CheckedInputs.calibration``), with the base's tokenizer."""
    from adapterpack.inputs.text import load_tokenizer

    tokenizer = load_tokenizer(checked.base.folder)
    return {function: list(tokenizer(text.text)["input_ids"])[:CALIBRATION_TOKENS] for function, text in checked.calibration.items()}


def channel_importance(checked: CheckedInputs, reporter, cache=None) -> ChannelImportance | None:
    """The importance data-aware palettes weigh by, or None when the build palettizes data-free
    (no calibration text, or nothing palettized)."""
    manifest = checked.manifest
    if not any(calibration_key(checked, name) for name in manifest.function_names):
        return None
    key = calibration_key(checked)
    if key in _LAST_MEASURED:
        return _LAST_MEASURED[key]
    stored = cache.read_file("calibration", key, ENERGIES_FILE) if cache is not None else None
    if stored is not None:
        try:
            return ChannelImportance.from_bytes(stored)
        except (OSError, ValueError, KeyError, EOFError):
            log.info("build cache: calibration/%s cannot be read: measured again", key[:16])
    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.calibration import channel_energies
    from adapterpack.verify.reference import computed_in_float32, stored_dtype

    texts = calibration_ids(checked)
    tokens = sum(len(ids) for ids in texts.values())
    with reporter.stage(f"calibration: activations of {len(texts)} text(s), {tokens:,} tokens, on the base"):
        base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
        with computed_in_float32(base):
            importance = ChannelImportance(channel_energies(base, list(texts.values()), calibration_window(checked)))
        del base
    if cache is not None:
        cache.write("calibration", key, {ENERGIES_FILE: importance.to_bytes()}, {"base": checked.base.content_hash})
    _LAST_MEASURED.clear()
    _LAST_MEASURED[key] = importance
    return importance
