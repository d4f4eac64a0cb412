"""The build's calibration: the activation statistics of the manifest's calibration texts, which
data-aware palettes weigh by (``compress.importance``), measured once and kept in the build cache,
and the Gram matrices of each layer's inputs that error-compensated palette entries and int4
integers are chosen with (``compress.compensation``), measured when a palette or integers that
need them are not cached.

The statistics are the base's, on every calibration text (the base's and each skill's), not each
fused function's on its own text: identical base weights then get identical palettes in every
function, so the package still stores them once, and a skill's text still decides what its
layers keep.

A manifest that names no calibration text is calibrated on text the base writes itself
(``convert.calibration.generated_texts``: ``GENERATED_TEXTS`` texts of ``GENERATED_TOKENS``
tokens, sampled with a fixed seed, kept in the build cache beside the statistics). Weights
palettized with no statistics at all treat every weight alike, and a trained checkpoint's are
anything but: on Gemma 3 270M at 4 bits that costs 2.31x the float perplexity on English prose
and keeps 0.42 of a skill's change; calibrated on its own text, 1.02x and 0.83, what the
skill's own calibration text reaches (docs/compression.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time

import numpy as np

from adapterpack.assemble.records import content_key
from adapterpack.compress.importance import ChannelImportance, compensated_modules
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
# Without calibration text: how much text the base writes to calibrate on (at most the window
# per text), and the seed it samples with.
GENERATED_TEXTS = 16
GENERATED_TOKENS = 128
GENERATION_SEED = 0
# Nucleus sampling: the text the base writes most, not its long tail. Sampled from the whole
# distribution, Gemma 3 270M's texts derail into strings no prompt gives, and palettes calibrated
# on them cost 1.38x on English prose where top-p 0.9 costs 1.02x.
GENERATION_TOP_P = 0.9
GENERATED_FILE = "generated.npy"
# The Gram matrices measured in the statistics' forward (False: later, in a forward of their own
# on the first palette worker that needs one, as builds did before; benchmarks/build_time.py
# --calibration-previous compares the two).
GRAMS_WITH_ENERGIES = True
# Texts the base wrote in this process, by calibration key (the Gram matrices read them again).
_GENERATED: dict[str, list[list[int]]] = {}
# The statistics last measured in this process, by calibration key: a build without a cache
# (or a build_parts after auto) reads them again instead of running the base once more.
_LAST_MEASURED: dict[str, ChannelImportance] = {}


def calibration_key(checked: CheckedInputs, function: str | None = None) -> str | None:
    """Digest of everything the statistics depend on (the texts named, or those the base writes
    where none are), or None when ``function``, when named, is compressed without them
    (``Compression.uses_calibration``)."""
    if function is not None and not checked.manifest.compression_for(function).uses_calibration():
        return None
    if checked.calibration:
        texts: dict = {"texts": [text.sha256 for text in checked.calibration.values()], "tokens": CALIBRATION_TOKENS}
    else:
        texts = {"generated": [GENERATED_TEXTS, generated_tokens(checked), GENERATION_SEED, GENERATION_TOP_P]}
    return content_key(
        {"calibration": CALIBRATION_VERSION, "base": checked.base.content_hash, **texts, "window": calibration_window(checked)}
    )


def calibration_window(checked: CheckedInputs) -> int:
    return min(CALIBRATION_WINDOW, int(checked.manifest.export.max_context))


def generated_tokens(checked: CheckedInputs) -> int:
    return min(GENERATED_TOKENS, calibration_window(checked))


def calibration_ids(checked: CheckedInputs, cache=None) -> dict[str | None, list[int]]:
    """Each calibration text's first ``CALIBRATION_TOKENS`` token ids, by function (as
    ``CheckedInputs.calibration``), with the base's tokenizer; where the manifest names none,
    the texts the base writes (``generated_ids``)."""
    from adapterpack.inputs.text import load_tokenizer

    if not checked.calibration:
        return {f"written by the base {index + 1}": ids for index, ids in enumerate(generated_ids(checked, cache))}
    tokenizer = load_tokenizer(checked.base.folder)
    return {function: list(tokenizer(text.text)["input_ids"])[:CALIBRATION_TOKENS] for function, text in checked.calibration.items()}


def channel_importance(checked: CheckedInputs, reporter, cache=None) -> ChannelImportance | None:
    """The importance data-aware palettes weigh by (and whose Grams compensate palette entries
    and int4 integers), or None when nothing the build compresses uses it
    (``Compression.uses_calibration``)."""
    manifest = checked.manifest
    if not any(calibration_key(checked, name) for name in manifest.function_names):
        return None
    key = calibration_key(checked)
    if key in _LAST_MEASURED:
        return _LAST_MEASURED[key]
    grams = _gram_measurer(checked, reporter, cache)
    stored = cache.read_file("calibration", key, ENERGIES_FILE) if cache is not None else None
    if stored is not None:
        try:
            return ChannelImportance.from_bytes(stored, grams)
        except (OSError, ValueError, KeyError, EOFError):
            log.info("build cache: calibration/%s cannot be read: measured again", key[:16])
    from adapterpack.convert.calibration import channel_statistics, linear_widths

    if not checked.calibration and key not in _GENERATED:
        with reporter.stage(
            f"calibration: no calibration text named: the base writes {GENERATED_TEXTS} texts of "
            f"{generated_tokens(checked)} tokens to calibrate on"
        ):
            generated_ids(checked, cache)
    texts = calibration_ids(checked, cache)
    tokens = sum(len(ids) for ids in texts.values())
    # The Gram matrices of the layers compensated (compress.compensation) are measured in the same
    # forward: the palettes about to be made need them, and a second forward later would run on
    # a palette worker's single thread (at 3B that was 243 s, against 95 s for this stage).
    measures = "activations and input Gram matrices" if GRAMS_WITH_ENERGIES else "activations"
    with reporter.stage(f"calibration: {measures} of {len(texts)} text(s), {tokens:,} tokens, on the base"):
        with _base_in_float32(checked) as base:
            wanted = sorted(compensated_modules(linear_widths(base))) if GRAMS_WITH_ENERGIES else []
            energies, measured = channel_statistics(base, list(texts.values()), calibration_window(checked), wanted)
    importance = ChannelImportance(energies, grams, measured=measured if GRAMS_WITH_ENERGIES else None)
    if cache is not None:
        files = {ENERGIES_FILE: importance.to_bytes()}
        if not checked.calibration:
            files[GENERATED_FILE] = _npy(np.asarray(_GENERATED[key], dtype=np.int64))
        cache.write("calibration", key, files, {"base": checked.base.content_hash})
    _LAST_MEASURED.clear()
    _LAST_MEASURED[key] = importance
    return importance


def generated_ids(checked: CheckedInputs, cache=None) -> list[list[int]]:
    """The texts the base writes to calibrate on (``convert.calibration.generated_texts``): made
    once per process, or read from the build cache where an earlier build kept them."""
    key = calibration_key(checked)
    if key in _GENERATED:
        return _GENERATED[key]
    stored = cache.read_file("calibration", key, GENERATED_FILE) if cache is not None else None
    if stored is not None:
        try:
            with io.BytesIO(stored) as buffer:
                written = np.load(buffer, allow_pickle=False).tolist()
        except (OSError, ValueError, EOFError):
            log.info("build cache: calibration/%s texts cannot be read: written again", key[:16])
            written = None
        if written is not None:
            _GENERATED[key] = written
            return written
    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.calibration import generated_texts
    from adapterpack.verification.reference import stored_dtype

    # Written in bfloat16 unless stored in float32: twice as fast as float32 here (Gemma 3 270M:
    # 15 s against 31 s, 66 s widening each weight per step), in half its memory, and with
    # float32's range (a float16 forward of Gemma 3 overflows on its own text).
    dtype = "float32" if stored_dtype(checked.base) == "float32" else "bfloat16"
    base = load_base(checked.base.folder, dtype=dtype)
    written = generated_texts(base, GENERATED_TEXTS, generated_tokens(checked), GENERATION_SEED, top_p=GENERATION_TOP_P)
    _GENERATED[key] = written
    return written


def _npy(array) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@contextlib.contextmanager
def _base_in_float32(checked: CheckedInputs):
    from adapterpack.convert.base_model import load_base
    from adapterpack.verification.reference import computed_in_float32, stored_dtype

    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    with computed_in_float32(base):
        yield base


def _gram_measurer(checked: CheckedInputs, reporter, cache=None):
    """What measures the Gram matrices of error-compensated palettes, when the first is needed:
    the base over the same texts, windows and float32 compute as the energies. They are not kept
    in the cache (a 135M checkpoint's take 0.4 GB; the palettes made with them are kept)."""

    def measure(modules: list[str]) -> dict:
        from adapterpack.compress.palettes import machine_threads  # torch: loaded when a build measures
        from adapterpack.convert.calibration import input_grams

        # a line, not a stage: this runs inside the palettes' progress display, on its workers
        started = time.perf_counter()
        texts = calibration_ids(checked, cache)
        # on a palette worker, which runs with one torch thread: this forward takes every core
        with machine_threads(), _base_in_float32(checked) as base:
            grams = input_grams(base, list(texts.values()), calibration_window(checked), modules)
        reporter.info(f"calibration: input Gram matrices of {len(modules)} layer(s), for error compensation ({time.perf_counter() - started:.1f} s)")
        return grams

    return measure
