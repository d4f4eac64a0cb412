"""Which compression each weight gets: the one rule both compressors (Core ML's through
coremltools, Core AI's in torch) and the memory estimate follow, and how ``keep_float16``
patterns match a weight's name.

"No compression" has one form: ``weight_setting`` returns None (a manifest's ``method: none``
comes out so too).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapterpack.config.manifest import Compression

log = logging.getLogger(__name__)


# Name fragments of peft's low-rank matrices once traced (``..._lora_A_default_weight``).
LORA_PATTERNS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")

# coremltools compresses a constant only when it has more values than this (and rank >= 2:
# it refuses 1-D tensors, rdar://113860800); the other writer and the estimate follow it.
WEIGHT_THRESHOLD = 2048

# Constants never compressed whatever the manifest says: rope tables feed sin/cos positions
# (errors here shift every token).
ALWAYS_FLOAT16 = ("rope_cos", "rope_sin")


# Where the vocabulary (embedding, and output head when untied) holds more than this share of a
# base's matrix weights, the default compresses it at VOCABULARY_NBITS instead of keeping it
# float16: there, float16 vocabulary rows cost more bytes than compressing everything else
# saves. Gemma 3 270M (a 262,144-row tied embedding, 62.6% of its weights), measured with
# benchmarks/quality.py --embedding on held-out text against float32: the embedding as 8-bit
# palettes in groups of 16 costs its haiku skill a perplexity ratio of 1.004 (top-1 99.1%,
# retention 0.9998), int8 per channel 1.008, 6-bit palettes 1.027; at 4 bits, int4 in blocks of
# 32 1.117 against palettes 1.188 (per channel) and 1.221 (groups of 16). Keeping the
# embedding float16 and palettizing the rest at 4 bits (390 MB) costs 1.188 and retention 0.413;
# 8-bit embedding palettes with the rest float16 (377 MB) cost 1.004 and 0.9998.
VOCABULARY_SHARE = 0.5
VOCABULARY_PATTERNS = ("embed_tokens", "lm_head")
VOCABULARY_NBITS = 8


def vocabulary_share(shapes: dict[str, tuple[int, ...]]) -> float:
    """The share of a base's matrix weights (name -> shape) its embedding and output head hold."""
    matrices = {name: math.prod(shape) for name, shape in shapes.items() if len(shape) >= 2}
    vocabulary = sum(size for name, size in matrices.items() if matches_any(name.replace(".", "_"), VOCABULARY_PATTERNS))
    return vocabulary / max(1, sum(matrices.values()))


def vocabulary_setting(compression: Compression) -> dict | None:
    """The per-layer exception the default gives a large vocabulary under ``compression``'s
    method (None: it stays float16): palettes of VOCABULARY_NBITS in groups of 16 (one palette
    of 256 float16 entries per row would add half a byte per weight), or integers of
    VOCABULARY_NBITS per channel."""
    if compression.method == "palettize":
        return {"nbits": VOCABULARY_NBITS, "granularity": "per_grouped_channel", "group_size": 16}
    if compression.method == "linear":
        return {"nbits": VOCABULARY_NBITS, "granularity": "per_channel"}
    return None


def matches_any(const_name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        normalized = pattern.replace(".", "_")
        if any(ch in normalized for ch in "*?["):
            if fnmatch.fnmatchcase(const_name, f"*{normalized}*"):
                return True
        elif normalized in const_name:
            return True
    return False


def is_lora_weight(name: str) -> bool:
    """A LoRA A/B matrix (keep mode), by its module path or traced constant name."""
    return matches_any(name.replace(".", "_"), LORA_PATTERNS)


def weight_setting(
    name: str, shape: tuple[int, ...], compression: Compression, lora_compression: Compression | None = None
) -> Compression | None:
    """The setting weight ``name`` (a module path or a traced constant name) of ``shape`` is
    compressed with, or None when it stays float16: too small or 1-D, a rope table, a
    ``keep_float16`` match, a method ``none``, or groups or blocks that do not tile it. The first
    of ``compression.layers``' patterns that matches gives the weight its own setting. LoRA
    matrices follow ``lora_compression`` (None: float16), not ``keep_float16``."""
    return _rule(name, shape, compression, lora_compression)[1]


def _rule(
    name: str, shape: tuple[int, ...], compression: Compression, lora_compression: Compression | None = None
) -> tuple[str | None, Compression | None]:
    """(the ``compression.layers`` pattern that decides weight ``name``, or None; its setting as
    ``weight_setting`` returns it)."""
    flat = name.replace(".", "_")
    if len(shape) < 2 or math.prod(shape) <= WEIGHT_THRESHOLD or matches_any(flat, ALWAYS_FLOAT16):
        return None, None
    pattern = None
    if matches_any(flat, LORA_PATTERNS):
        setting = lora_compression
    elif matches_any(flat, tuple(compression.keep_float16)):
        return None, None
    else:
        pattern, setting = next(((p, own) for p, own in compression.layers if matches_any(flat, (p,))), (None, compression))
    if setting is None or setting.method == "none" or not _fits(shape, setting):
        return pattern, None
    return pattern, setting


def exception_matches(weights: dict[str, tuple[int, ...]], compression: Compression) -> dict[str, list[str]]:
    """{pattern of ``compression.layers``: the weights (name -> shape) it decides}, every pattern
    listed: one that decides none (a typo, a weight kept float16 anyway, shadowed by an earlier
    pattern) has an empty list."""
    found: dict[str, list[str]] = {pattern: [] for pattern, _ in compression.layers}
    for name, shape in weights.items():
        pattern = _rule(name, shape, compression)[0]
        if pattern is not None:
            found[pattern].append(name)
    return found


def _fits(shape: tuple[int, ...], setting: Compression) -> bool:
    """Whether ``setting`` splits a weight of ``shape`` as coremltools does: channel groups must
    tile the output channels (axis 0), blocks the input channels (the last axis); coremltools
    leaves a weight they do not tile float16."""
    if setting.method == "palettize" and setting.granularity != "per_tensor":
        return shape[0] % setting.group_size == 0
    if setting.method == "linear" and setting.granularity == "per_block":
        return shape[-1] % setting.block_size == 0
    return True


def compressed_bytes(shape: tuple[int, ...], setting: Compression | None) -> int:
    """Bytes a float16 weight of ``shape`` takes stored with ``setting`` (None: float16):
    palettized, nbits per value plus float16 palettes; linear, nbits per value plus a float16
    scale per block or channel; pruned, the kept float16 values plus a one-bit mask."""
    count = math.prod(shape)
    if setting is None:
        return 2 * count
    if setting.method == "palettize":
        groups = 1 if setting.granularity == "per_tensor" else max(1, shape[0] // setting.group_size)
        return count * setting.nbits // 8 + groups * (1 << setting.nbits) * 2
    if setting.method == "linear":
        per = setting.block_size if setting.granularity == "per_block" else shape[-1]
        return count * setting.nbits // 8 + 2 * count // max(1, per)
    return int(count * (1 - setting.sparsity)) * 2 + count // 8  # prune
