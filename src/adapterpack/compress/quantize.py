"""Linear symmetric quantization of one weight: coremltools' integers, or error-compensated ones.

Data-free, a weight's integers are exactly coremltools' (``compute_qparams_by_dtype``, called
here so its float16 arithmetic, rounding and clipping are its own): the streamed writer
(``formats.mlpackage.program``) and the fused weights' patch produce the bytes ``linear_quantize_weights``
would. With calibration text, at ``COMPENSATED_LINEAR_MAX_NBITS`` bits or fewer
(``Compression.compensated``), the same scales stay and each integer is chosen with error
compensation (``compress.compensation``, GPTQ): every block's levels (its scale times
-qmax..qmax) are a palette per output channel and block of input columns. On SmolLM2-135M's
held-out texts, int4 in blocks of 32 goes from a perplexity ratio of 1.332 / 1.316 / 0.974
(base / shout / pirate) to 1.120 / 1.126 / 1.012 at the same bytes (docs/compression.md).

    data, scale = quantized(value, setting)                  # as coremltools
    data, scale = quantized(value, setting, gram=H)          # compensated
"""

from __future__ import annotations

import io
import math

import numpy as np

from adapterpack.compress.compensation import GramFactor, compensated_indices
from adapterpack.compress.palettes import PaletteStore, content_digest, pack_bits, unpack_bits
from adapterpack.config.compression import Compression

# Bump when compensated integers change (keys of their cache entries).
COMPENSATED_INT_ALGORITHM = "gptq-act-order-int-v1"


def block_sizes(shape: tuple[int, ...], setting: Compression) -> list[int]:
    """coremltools' block size per axis for a weight read as (output channels, input channels),
    the layout of a ``linear`` or ``gather`` weight (``optimize._utils.infer_block_sizes``)."""
    sizes = [0] * len(shape)
    if setting.granularity == "per_channel":
        sizes[0] = 1
    elif setting.granularity == "per_block":
        sizes[0], sizes[1] = 1, setting.block_size
    return sizes


def quantized(value: np.ndarray, setting: Compression, gram: np.ndarray | GramFactor | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """(integers as int8, float16 scale shaped as coremltools stores it) of float16 ``value``
    (out, in) under ``setting`` (``linear``, symmetric), or None where coremltools would not
    quantize it (blocks that do not tile the input channels). With ``gram`` (in, in), the
    integers are error-compensated by it."""
    from coremltools.converters.mil.mil import types
    from coremltools.optimize._utils import compute_qparams_by_dtype

    dtype = types.get_nbits_int_builtin_type(setting.nbits, True)
    found = compute_qparams_by_dtype(value, dtype, "LINEAR_SYMMETRIC", block_sizes(value.shape, setting))
    if found is None:
        return None
    data, scale, _ = found
    data = data.astype(np.int8)
    if gram is None or value.ndim != 2:
        return data, scale
    return _compensated(value, scale, setting.nbits, gram), scale


def stored_quantized(
    value: np.ndarray, setting: Compression, name: str | None, store: PaletteStore
) -> tuple[np.ndarray, np.ndarray] | None:
    """``quantized(value, setting)``, compensated by the Gram of weight ``name``'s layer when
    ``store``'s importance has one for it (and ``setting`` is compensated at all); compensated
    integers are kept in ``store.files`` (keyed by content, setting, importance and algorithm),
    so a fused function's patch and a later build find them instead of solving again."""
    importance = store.importance
    if name is None or importance is None or not setting.compensated() or not importance.compensates(name, value.shape):
        return quantized(value, setting)
    label = f"linear {setting.nbits} {setting.granularity} {setting.block_size}|{COMPENSATED_INT_ALGORITHM}|importance {importance.digest(name)}"
    key = content_digest(value, label) if store.files is not None else None
    stored = store.files.read(key) if key is not None else None
    found = from_bytes(stored, value.shape) if stored is not None else None
    if found is None:
        found = quantized(value, setting, gram=importance.factor(name))
        if found is not None and key is not None:
            store.files.write(key, to_bytes(*found, setting.nbits))
    return found


def _compensated(value: np.ndarray, scale: np.ndarray, nbits: int, gram: np.ndarray | GramFactor) -> np.ndarray:
    out_features, in_features = value.shape
    qmax = (1 << (nbits - 1)) - 1
    # one scale per (output channel, block of input columns), whatever the granularity
    per_block = np.broadcast_to(scale.astype(np.float64).reshape(scale.shape[0], -1), (out_features, scale.size // scale.shape[0]))
    columns = in_features // per_block.shape[1]
    levels = per_block[..., None] * np.arange(-qmax, qmax + 1)
    chosen = compensated_indices(value.astype(np.float32), levels, 1, gram, block_columns=columns)
    return (chosen.astype(np.int16) - qmax).astype(np.int8)


def pack_signed(data: np.ndarray, nbits: int) -> np.ndarray:
    """Signed integers as the blob stores them: int8 as is, int4 two per byte, low nibble
    first (two's complement)."""
    return pack_bits(np.asarray(data, dtype=np.int8).view(np.uint8) & ((1 << nbits) - 1), nbits)


def unpack_signed(packed: np.ndarray, nbits: int, count: int) -> np.ndarray:
    """``pack_signed`` undone: the first ``count`` integers, int8 (sign-extended)."""
    values = unpack_bits(packed, nbits, count).astype(np.int16)
    return np.where(values >= 1 << (nbits - 1), values - (1 << nbits), values).astype(np.int8)


def to_bytes(data: np.ndarray, scale: np.ndarray, nbits: int) -> bytes:
    """A cache entry: the integers packed as the blob stores them (half a byte each at 4 bits)."""
    buffer = io.BytesIO()
    np.savez(buffer, packed=pack_signed(data, nbits), nbits=np.int64(nbits), scale=scale)
    return buffer.getvalue()


def from_bytes(stored: bytes, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """A cache entry read back, or None when it is damaged or not of ``shape``."""
    try:
        with np.load(io.BytesIO(stored), allow_pickle=False) as entry:
            nbits, scale = int(entry["nbits"]), entry["scale"]
            if nbits not in (4, 8) or entry["packed"].size != -(-math.prod(shape) * nbits // 8):
                return None
            data = unpack_signed(entry["packed"], nbits, math.prod(shape)).reshape(shape)
    except (OSError, ValueError, KeyError, EOFError):
        return None
    if scale.dtype != np.float16:
        return None
    return data, scale
