"""How real clients call a function: the seeded token sequence, and the two calling conventions
(swift-transformers' ``tokenCount + 1`` zeros, Apple's Python past + q) run prefill then decode;
for an asset of Apple's runtime contract, its Swift engine's whole and chunked prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from adapterpack.config.manifest import VerifySettings
from adapterpack.formats.format import Predict

log = logging.getLogger(__name__)


def verification_tokens(vocab_size: int, settings: VerifySettings) -> np.ndarray:
    """The fixed, seeded token sequence every function is checked on."""
    rng = np.random.default_rng(settings.seed)
    return rng.integers(0, vocab_size, size=settings.prefill + settings.decode_steps, dtype=np.int64)


# How real clients call a function (see export_decoder): each drive is a prefill of the first
# tokens, then one call per further token through the same state.
DRIVES = ("swift", "python")
# An asset of Apple's contract (formats.aimodel.engine): the Swift engine sends a prompt in one call
# (up to its chunk threshold) or in chunks (past it), then one token per call. Its sessions send
# the position ids themselves, so the masks these drives pass are not sent.
APPLE_DRIVES = ("apple", "apple-chunked")
# The chunked drive's chunks: the prefill in three (COREAI_CHUNK_THRESHOLD set that low).
APPLE_CHUNKS = 3


def swift_mask(past: int, q: int) -> np.ndarray:
    """What swift-transformers sends with ``q`` new tokens after ``past``: zeros, one wider than
    every token of the sequence so far (see ``drive_mask``)."""
    return drive_mask("swift", past, q)


def drive_mask(drive: str, past: int, q: int) -> np.ndarray:
    """The ``causalMask`` a client of style ``drive`` sends for ``q`` new tokens after ``past``.

    ``swift``: swift-transformers' ``LanguageModelWithStatefulKVCache`` sends zeros of shape
    (1, 1, 1, tokenCount + 1), tokenCount being every token of the sequence so far, this call's
    included, for the prefill and for each decode step alike.
    ``python``: Apple's Python examples send width past + q: a full additive causal mask
    (1, 1, q, past + q) for the prefill and zeros for each single-token step.
    """
    if drive == "swift":
        return np.zeros((1, 1, 1, past + q + 1), dtype=np.float16)
    if q == 1:
        return np.zeros((1, 1, 1, past + 1), dtype=np.float16)
    future = np.triu(np.ones((q, past + q), dtype=bool), k=past + 1)
    return np.where(future, np.float16(-np.inf), np.float16(0))[None, None]


def run_drive(predict, tokens: np.ndarray, prefill: int, drive: str) -> np.ndarray:
    """Prefill then decode one token at a time as a ``drive`` client does; logits (tokens, vocab).

    Every row of the prefill is kept (the Swift client reads only its last), then the one row of
    each decode step.
    """
    outputs = []
    style = "swift" if drive == "swift" else "python"  # an apple session sends no mask at all
    if drive == "apple-chunked":
        size = max(1, -(-prefill // APPLE_CHUNKS))
        for start in range(0, prefill, size):
            chunk = tokens[start : min(prefill, start + size)].astype(np.int32)[None, :]
            outputs.append(predict(chunk, drive_mask(style, start, chunk.shape[1])))
    else:
        first = tokens[:prefill].astype(np.int32)[None, :]
        outputs.append(predict(first, drive_mask(style, 0, prefill)))
    for end in range(prefill + 1, len(tokens) + 1):
        step = tokens[end - 1 : end].astype(np.int32)[None, :]
        outputs.append(predict(step, drive_mask(style, end - 1, 1)))
    return np.concatenate([o.reshape(1, -1, o.shape[-1]) for o in outputs], axis=1)[0].astype(np.float32)


def run_drives(
    session: Callable[[], Predict], tokens: np.ndarray, prefill: int, drives: tuple[str, ...] = DRIVES, *, concurrent: bool = False
) -> dict[str, np.ndarray]:
    """Logits of every drive, each through a fresh state: ``session()`` returns a predict
    function bound to a new state (what ``makeState()`` gives a client); with ``concurrent``,
    the drives run at once, one thread each (the sessions are made here, one after another)."""
    if not concurrent or len(drives) < 2:
        return {drive: run_drive(session(), tokens, prefill, drive) for drive in drives}
    from concurrent.futures import ThreadPoolExecutor

    sessions = [session() for _ in drives]
    with ThreadPoolExecutor(len(drives), thread_name_prefix="drive") as pool:
        running = [pool.submit(run_drive, predict, tokens, prefill, drive) for predict, drive in zip(sessions, drives)]
        return {drive: future.result() for drive, future in zip(drives, running)}
