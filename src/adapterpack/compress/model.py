"""Compress one function's weights (before the merge: coremltools refuses multifunction models).

Palettization goes through coremltools' ``custom`` mode with adapterpack's own deterministic 1-D
k-means (``palettize.py``): coremltools' k-means switches to scikit-learn for small groups (slow,
and not guaranteed to give identical tables for identical weights), and identical base weights
must compress identically to stay shared after the merge. Palettes are memoized by content hash,
so a base weight shared by N functions is clustered once per build, not N times.

In ``lora: keep`` functions the LoRA A/B matrices are compressed separately from the base weights
(default: left float16, since they are small and carry the whole adapter).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np

from adapterpack.compress.kmeans import palettize_group
from adapterpack.config.compression import LORA_PATTERNS, WEIGHT_THRESHOLD, matches_any
from adapterpack.config.manifest import Compression
from adapterpack.quiet import captured_output, import_coremltools

log = logging.getLogger(__name__)


# Constants that are never compressed whatever the manifest says: rope tables feed sin/cos
# positions (errors here shift every token), and tiny tensors gain nothing.
ALWAYS_FLOAT16 = ("rope_cos", "rope_sin")


_palette_memo: dict[tuple[bytes, int, str, tuple[int, ...]], tuple[np.ndarray, np.ndarray]] = {}


_palette_cache_dir: Path | None = None


# Bump when the k-means changes, so palettes cached on disk by an older version are not reused.
PALETTE_ALGORITHM = "kmeans1d-quantile-lloyd-v1"


def set_palette_cache(folder: Path | None) -> None:
    """Keep palettes on disk in ``folder`` (keyed by tensor content and settings) across builds."""
    global _palette_cache_dir
    _palette_cache_dir = Path(folder) if folder is not None else None


def _memoized_palette(group: np.ndarray, nbits: int) -> tuple[np.ndarray, np.ndarray]:
    # Served entries leave the memo: coremltools keeps what it is given, and a 1B model's
    # palettes are over a gigabyte, so holding both would raise the peak by that much. A group
    # asked for twice (identical values in two tensors) is clustered again, identically.
    found = _palette_memo.pop(_group_key(group, nbits), None)
    if found is None:
        log.debug("palette memo miss for a group of shape %s", group.shape)
        found = palettize_group(group, nbits)
    return found


def _group_key(group: np.ndarray, nbits: int) -> tuple[bytes, int, str, tuple[int, ...]]:
    return (hashlib.blake2b(group.tobytes(), digest_size=16).digest(), nbits, str(group.dtype), group.shape)


# Rows of k-means solved at once: bounds the temporary sort/prefix-sum buffers.
_PRIME_BATCH_VALUES = 1 << 24


def _grouped_rows(value: np.ndarray, compression: Compression) -> np.ndarray | None:
    """``value`` as one row per channel group, the way coremltools splits a linear/embedding
    weight (contiguous blocks of ``group_size`` output channels, axis 0); None if it splits it
    otherwise (or not at all)."""
    if value.ndim < 2 or value.dtype.kind != "f":
        return None
    rows = value.shape[0] if compression.granularity == "per_tensor" else compression.group_size
    if not rows or value.shape[0] % rows:
        return None
    return np.ascontiguousarray(value).reshape(value.shape[0] // rows, -1)


def prime_palettes(weights: dict[str, np.ndarray], compression: Compression) -> int:
    """Cluster every channel group of ``weights`` in vectorized batches, ahead of coremltools.

    coremltools' custom mode asks for one group at a time; answering each from this memo keeps
    its op construction while the k-means itself runs batched. Groups coremltools splits
    differently are simply clustered on demand. Returns the number of groups primed.
    """
    nbits = compression.nbits
    grouped = {name: _grouped_rows(value, compression) for name, value in weights.items()}
    grouped = {name: flat for name, flat in grouped.items() if flat is not None}
    primed = 0
    for (name, flat), (luts, indices) in zip(grouped.items(), tensor_palettes(list(grouped.values()), nbits)):
        value = weights[name]
        group_shape = (value.shape[0] // flat.shape[0], *value.shape[1:])
        for row in range(flat.shape[0]):
            group = flat[row].reshape(group_shape)
            _palette_memo[_group_key(group, nbits)] = (luts[row].astype(value.dtype), indices[row].reshape(group_shape))
            primed += 1
    return primed


def tensor_palettes(flats: list[np.ndarray], nbits: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(luts, indices) of every row of each tensor in ``flats`` (one row per channel group).

    From the disk cache where a previous build clustered the same values; the rest are clustered
    together, rows of equal length from all tensors in one batch (up to ``_PRIME_BATCH_VALUES``
    values): a Lloyd step costs about as much for one small tensor as for many, so batching
    across tensors is what makes the few changed tensors of an adapter quick. Rows are clustered
    independently, so a row's palette does not depend on what it was batched with.
    """
    from adapterpack.compress.kmeans import kmeans_1d

    results: list[tuple[np.ndarray, np.ndarray] | None] = [_cached_palettes(flat, nbits) for flat in flats]
    pending: dict[tuple[int, str], list[int]] = {}
    for index, found in enumerate(results):
        if found is None:
            pending.setdefault((flats[index].shape[1], str(flats[index].dtype)), []).append(index)
    for (length, _), members in pending.items():
        luts = {i: np.empty((flats[i].shape[0], 1 << nbits), np.float32) for i in members}
        labels = {i: np.empty(flats[i].shape, np.uint8) for i in members}
        step = max(1, _PRIME_BATCH_VALUES // length)
        batch: list[tuple[int, int, int]] = []  # (tensor, first row, end row)

        def cluster(batch=batch, luts=luts, labels=labels) -> None:
            lut, label = kmeans_1d(np.concatenate([flats[i][a:b] for i, a, b in batch]), nbits)
            offset = 0
            for i, a, b in batch:
                luts[i][a:b], labels[i][a:b] = lut[offset : offset + b - a], label[offset : offset + b - a]
                offset += b - a
            batch.clear()

        filled = 0
        for i in members:
            start = 0
            while start < flats[i].shape[0]:
                take = min(flats[i].shape[0] - start, step - filled)
                batch.append((i, start, start + take))
                start, filled = start + take, filled + take
                if filled == step:
                    cluster()
                    filled = 0
        if batch:
            cluster()
        for i in members:
            results[i] = (luts[i], labels[i])
            _store_palettes(flats[i], nbits, results[i])
    return results


def _palette_file(flat: np.ndarray, nbits: int) -> Path | None:
    if _palette_cache_dir is None:
        return None
    digest = hashlib.blake2b(flat.tobytes(), digest_size=20)
    digest.update(f"{flat.shape}|{flat.dtype}|{nbits}|{PALETTE_ALGORITHM}".encode())
    return _palette_cache_dir / f"{digest.hexdigest()}.npz"


def _cached_palettes(flat: np.ndarray, nbits: int) -> tuple[np.ndarray, np.ndarray] | None:
    cached = _palette_file(flat, nbits)
    if cached is None or not cached.is_file():
        return None
    try:
        with np.load(cached, allow_pickle=False) as stored:
            luts, indices = stored["luts"], stored["indices"]
        # a damaged entry is recomputed, never used
        if luts.shape == (flat.shape[0], 1 << nbits) and indices.shape == flat.shape and indices.dtype == np.uint8:
            if not indices.size or int(indices.max()) < (1 << nbits):
                return luts, indices
    except (OSError, ValueError, KeyError, EOFError):
        pass
    cached.unlink(missing_ok=True)
    return None


def _store_palettes(flat: np.ndarray, nbits: int, palettes: tuple[np.ndarray, np.ndarray]) -> None:
    cached = _palette_file(flat, nbits)
    if cached is None:
        return
    _palette_cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = cached.with_suffix(f".{os.getpid()}.tmp.npz")
    np.savez(temporary, luts=palettes[0], indices=palettes[1])
    os.replace(temporary, cached)


def clear_palette_memo() -> None:
    """Forget memoized palettes (end of a build)."""
    _palette_memo.clear()


def weight_values(mlmodel) -> dict[str, np.ndarray]:
    """The weight constants large enough to be compressed, by name."""
    import_coremltools()
    from coremltools.optimize.coreml import get_weights_metadata

    with captured_output():
        metadata = get_weights_metadata(mlmodel, weight_threshold=WEIGHT_THRESHOLD)
    return {name: meta.val for name, meta in metadata.items()}


def _op_config(compression: Compression):
    from coremltools.optimize import coreml as cto

    if compression.method == "palettize":
        nbits = compression.nbits

        def lut_function(group: np.ndarray):
            return _memoized_palette(group, nbits)

        config = cto.OpPalettizerConfig(
            mode="custom",
            lut_function=lut_function,
            granularity=compression.granularity,
            group_size=compression.group_size or 0,
            weight_threshold=WEIGHT_THRESHOLD,
        )
        return config, cto.palettize_weights
    if compression.method == "linear":
        config = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype="int4" if compression.nbits == 4 else "int8",
            granularity=compression.granularity,
            block_size=compression.block_size or 32,
            weight_threshold=WEIGHT_THRESHOLD,
        )
        return config, cto.linear_quantize_weights
    if compression.method == "prune":
        config = cto.OpMagnitudePrunerConfig(target_sparsity=compression.sparsity, weight_threshold=WEIGHT_THRESHOLD)
        return config, cto.prune_weights
    raise ValueError(compression.method)  # pragma: no cover - the schema allows nothing else


def compress_model(mlmodel, compression: Compression, lora_compression: Compression | None = None):
    """Return ``mlmodel`` compressed as the manifest says.

    ``compression`` applies to the base weights; ``lora_compression`` (keep mode) to the LoRA
    matrices, which are otherwise left float16.
    """
    lora_compression = lora_compression or Compression(method="none")
    if compression.method == "none" and lora_compression.method == "none":
        return mlmodel
    import_coremltools()
    from coremltools.optimize import coreml as cto

    values = weight_values(mlmodel)
    names = list(values)
    lora_names = [n for n in names if matches_any(n, LORA_PATTERNS)]
    if compression.method != "none":
        op_config, apply = _op_config(compression)
        excluded = {
            name: None
            for name in names
            if matches_any(name, ALWAYS_FLOAT16) or matches_any(name, tuple(compression.keep_float16)) or name in lora_names
        }
        if compression.method == "palettize":
            prime_palettes({n: v for n, v in values.items() if n not in excluded}, compression)
        # coremltools loads its own copy of the weights: drop ours first (a 1B model's float16
        # weights are 2.5 GB).
        values.clear()
        config = cto.OptimizationConfig(global_config=op_config, op_name_configs=excluded)
        log.debug("compressing with %s; kept float16: %s", compression.describe(), sorted(excluded))
        with captured_output():
            mlmodel = apply(mlmodel, config=config)
        if _palette_cache_dir is not None:
            # Palettes are on disk now; the next function reloads what it shares in a moment.
            clear_palette_memo()
    del values
    if lora_compression.method != "none" and lora_names:
        op_config, apply = _op_config(lora_compression)
        config = cto.OptimizationConfig(global_config=None, op_name_configs={name: op_config for name in lora_names})
        with captured_output():
            mlmodel = apply(mlmodel, config=config)
    return mlmodel


def palettized_records(values: list[np.ndarray], compression: Compression) -> list[list[tuple[str, bytes]] | None]:
    """For each weight, the blob records coremltools writes for it palettized as ``compression``
    says: [(blob dtype, bytes)] of the indices (packed n-bit, weight order) and the float16
    palette; None for a weight coremltools would not palettize this way.

    Uses the same palettes ``compress_model`` gives coremltools (``tensor_palettes``, disk cache
    included), so a fused function can be patched at the compressed level. Callers check the
    result by finding the base weight's records in a compressed package, so a layout mismatch is
    a miss, never a wrong patch.
    """
    if compression.method != "palettize":
        return [None] * len(values)
    import_coremltools()
    from coremltools.optimize._utils import pack_elements_into_bits

    flats = [_grouped_rows(value, compression) if value.dtype == np.float16 else None for value in values]
    present = [i for i, flat in enumerate(flats) if flat is not None]
    palettes = dict(zip(present, tensor_palettes([flats[i] for i in present], compression.nbits)))
    index_dtype = "uint8" if compression.nbits == 8 else f"uint{compression.nbits}"
    records: list[list[tuple[str, bytes]] | None] = []
    for i in range(len(values)):
        if i not in palettes:
            records.append(None)
            continue
        luts, indices = palettes[i]
        packed = pack_elements_into_bits(indices.reshape(-1), compression.nbits)
        records.append([(index_dtype, packed.tobytes()), ("float16", luts.astype(np.float16).tobytes())])
    return records
