"""The build's calibration: the activation statistics of the manifest's calibration texts, which
data-aware palettes weigh by (``compress.importance``), measured once and kept in the build cache,
and the Gram matrices of each layer's inputs that error-compensated palette entries and int4
integers are chosen with (``compress.compensation``), measured when a palette or integers that
need them are not cached.

The statistics are the base's, on every calibration text (the base's and each skill's), not each
fused function's on its own text: identical base weights then get identical palettes in every
function, so the package still stores them once, and a skill's text still decides what its
layers keep.
"""

from __future__ import annotations

import contextlib
import logging
import time

from adapterpack.assemble.records import content_key
from adapterpack.compress.importance import ChannelImportance
from adapterpack.inputs.calibration import CALIBRATION_TOKENS
from adapterpack.inputs.checked import CheckedInputs

log = logging.getLogger(__name__)

# Bump when what the statistics compute, or what palettes or linear integers make of them (the
# algorithm labels of their cache entries change too), changes: the key is part
# of every data-aware part's and auto choice's key, so ones cached by an older version are not
# used. 2: error-compensated palette entries (compress.compensation).
CALIBRATION_VERSION = 2
# Tokens per forward while measuring (at most the cache length).
CALIBRATION_WINDOW = 512
ENERGIES_FILE = "energies.npz"
# The statistics last measured in this process, by calibration key: a build without a cache
# (or a build_parts after auto) reads them again instead of running the base once more.
_LAST_MEASURED: dict[str, ChannelImportance] = {}


def calibration_key(checked: CheckedInputs, function: str | None = None) -> str | None:
    """Digest of everything the statistics depend on, or None when none are used (no calibration
    text, or ``function``, when named, is compressed without it: ``Compression.uses_calibration``)."""
    if not checked.calibration:
        return None
    if function is not None and not checked.manifest.compression_for(function).uses_calibration():
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
    """The importance data-aware palettes weigh by (and whose Grams compensate palette entries
    and int4 integers), or None when the build compresses data-free (no calibration text, or
    nothing it compresses uses it: ``Compression.uses_calibration``)."""
    manifest = checked.manifest
    if not any(calibration_key(checked, name) for name in manifest.function_names):
        return None
    key = calibration_key(checked)
    if key in _LAST_MEASURED:
        return _LAST_MEASURED[key]
    grams = _gram_measurer(checked, reporter)
    stored = cache.read_file("calibration", key, ENERGIES_FILE) if cache is not None else None
    if stored is not None:
        try:
            return ChannelImportance.from_bytes(stored, grams)
        except (OSError, ValueError, KeyError, EOFError):
            log.info("build cache: calibration/%s cannot be read: measured again", key[:16])
    from adapterpack.convert.calibration import channel_energies

    texts = calibration_ids(checked)
    tokens = sum(len(ids) for ids in texts.values())
    with reporter.stage(f"calibration: activations of {len(texts)} text(s), {tokens:,} tokens, on the base"):
        with _base_in_float32(checked) as base:
            importance = ChannelImportance(channel_energies(base, list(texts.values()), calibration_window(checked)), grams)
    if cache is not None:
        cache.write("calibration", key, {ENERGIES_FILE: importance.to_bytes()}, {"base": checked.base.content_hash})
    _LAST_MEASURED.clear()
    _LAST_MEASURED[key] = importance
    return importance


@contextlib.contextmanager
def _base_in_float32(checked: CheckedInputs):
    from adapterpack.convert.base_model import load_base
    from adapterpack.verification.reference import computed_in_float32, stored_dtype

    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    with computed_in_float32(base):
        yield base


def _gram_measurer(checked: CheckedInputs, reporter):
    """What measures the Gram matrices of error-compensated palettes, when the first is needed:
    the base over the same texts, windows and float32 compute as the energies. They are not kept
    in the cache (a 135M checkpoint's take 0.4 GB; the palettes made with them are kept)."""

    def measure(modules: list[str]) -> dict:
        from adapterpack.convert.calibration import input_grams

        # a line, not a stage: this runs inside the palettes' progress display, on its workers
        started = time.perf_counter()
        texts = calibration_ids(checked)
        with _base_in_float32(checked) as base:
            grams = input_grams(base, list(texts.values()), calibration_window(checked), modules)
        reporter.info(f"calibration: input Gram matrices of {len(modules)} layer(s), for error compensation ({time.perf_counter() - started:.1f} s)")
        return grams

    return measure
