"""Palettes of weight groups, owned by the build that uses them.

``PaletteStore`` answers coremltools' custom palettization (one channel group at a time) from
groups clustered ahead in vectorized batches, and keeps every tensor's palettes on disk (keyed
by content, settings and algorithm) so a fused function's patch, a later function sharing the
weight, or a later build reuses them instead of clustering again. The caller owns the store and
passes it along; nothing here is module state.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from adapterpack.compress.compensation import compensated_indices
from adapterpack.compress.importance import ChannelImportance
from adapterpack.compress.kmeans import kmeans_1d, palettize_group
from adapterpack.config.compression import Compression
from adapterpack.threads import available_cores

log = logging.getLogger(__name__)

# Bump when the k-means changes, so palettes cached on disk by an older version are not reused.
PALETTE_ALGORITHM = "kmeans1d-grown-lloyd-moves-v3"
# Bump when error compensation's choice of entries changes (keys of compensated palettes only).
COMPENSATION_ALGORITHM = "gptq-act-order-v1"
# Rows of k-means solved at once: bounds the temporary sort/prefix-sum buffers.
PRIME_BATCH_VALUES = 1 << 24

# Batches clustered at once by ``in_order``: one per core the build may use, at most four (each
# holds a batch's sort and prefix sums, about 0.8 GB, and past a few the workers mostly wait
# for each other's Python dispatch, which holds the GIL).
PALETTE_WORKERS = min(4, available_cores())

Palettes = tuple[np.ndarray, np.ndarray]  # (luts, indices)


class PaletteFiles(Protocol):
    """Where a store keeps palettes by key (the build cache, or a build's working folder)."""

    def read(self, key: str) -> bytes | None: ...

    def write(self, key: str, data: bytes) -> None: ...


_threads_lock = threading.Lock()
_threads_users = [0, 0]  # [contexts inside, torch threads before the first]


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Torch's own threads limited while the palette workers run: two workers of two threads
    each on two cores only contend. The setting is process-wide, so overlapping uses restore it
    once, when the last one ends."""
    import torch

    with _threads_lock:
        if _threads_users[0] == 0:
            _threads_users[1] = torch.get_num_threads()
            torch.set_num_threads(count)
        _threads_users[0] += 1
    try:
        yield
    finally:
        with _threads_lock:
            _threads_users[0] -= 1
            if _threads_users[0] == 0:
                torch.set_num_threads(_threads_users[1])


@contextlib.contextmanager
def machine_threads() -> Iterator[None]:
    """Torch's threads as they were before the palette workers limited them, for a step a worker
    runs that should take every core (measuring the Gram matrices a compensated palette needs
    runs the base once, while the other worker waits on it or clusters)."""
    import torch

    with _threads_lock:
        limited, before = _threads_users[0] > 0, torch.get_num_threads()
        if limited:
            torch.set_num_threads(_threads_users[1])
    try:
        yield
    finally:
        with _threads_lock:
            if limited and _threads_users[0] > 0:
                torch.set_num_threads(before)


def grouped_rows(value: np.ndarray, compression: Compression) -> np.ndarray | None:
    """``value`` as one row per channel group, the way coremltools splits a linear/embedding
    weight (contiguous blocks of ``group_size`` output channels, axis 0); None if it splits it
    otherwise (or not at all)."""
    if value.ndim < 2 or value.dtype.kind != "f":
        return None
    rows = value.shape[0] if compression.granularity == "per_tensor" else compression.group_size
    if not rows or value.shape[0] % rows:
        return None
    return np.ascontiguousarray(value).reshape(value.shape[0] // rows, -1)


def pack_bits(values: np.ndarray, nbits: int) -> np.ndarray:
    """uint8 ``values`` (each below 2**nbits) packed ``nbits`` each, least significant bits
    first, flat; for ``nbits`` that divide 8 (the blob's uintN layout, and the palette cache's).
    """
    flat = np.ascontiguousarray(values, dtype=np.uint8).reshape(-1)
    if nbits == 8:
        return flat
    per_byte = 8 // nbits
    padded = np.zeros(-(-flat.size // per_byte) * per_byte, np.uint8)
    padded[: flat.size] = flat
    columns = padded.reshape(-1, per_byte)
    packed = columns[:, 0].copy()
    for i in range(1, per_byte):
        packed |= columns[:, i] << (i * nbits)
    return packed


def unpack_bits(packed: np.ndarray, nbits: int, count: int) -> np.ndarray:
    """``pack_bits`` undone: the first ``count`` values, uint8."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if nbits == 8:
        return packed[:count].copy()
    per_byte, mask = 8 // nbits, (1 << nbits) - 1
    return np.stack([(packed >> (i * nbits)) & mask for i in range(per_byte)], axis=1).reshape(-1)[:count]


def content_digest(values: np.ndarray, label: str) -> str:
    """sha256 of ``values``' bytes, shape and dtype, and ``label`` (what they are compressed with)."""
    digest = hashlib.sha256(memoryview(np.ascontiguousarray(values)).cast("B"))
    digest.update(f"{values.shape}|{values.dtype}|{label}".encode())
    return digest.hexdigest()


def _group_key(group: np.ndarray, nbits: int) -> tuple[bytes, int, str, tuple[int, ...]]:
    return (hashlib.blake2b(group.tobytes(), digest_size=16).digest(), nbits, str(group.dtype), group.shape)


class PaletteStore:
    """Palettes for one build: ``prime`` before coremltools compresses, ``serve`` as its lut
    function, ``tensor_palettes`` for whole tensors (the weight patch); ``files`` (optional)
    keeps them on disk across functions and builds. With ``importance`` (measured on the
    calibration text), each named weight's k-means weighs its values by the activation they
    multiply; unnamed or unmeasured weights are clustered unweighted.

        store = PaletteStore(cache.palette_files(), importance)
        compress_model(mlmodel, compression, palettes=store)
    """

    def __init__(self, files: PaletteFiles | None = None, importance: ChannelImportance | None = None):
        self.files = files
        self.importance = importance
        self._memo: dict[tuple[bytes, int, str, tuple[int, ...]], Palettes] = {}

    def serve(self, group: np.ndarray, nbits: int) -> Palettes:
        """The palette of one channel group (coremltools' custom ``lut_function``)."""
        # Served entries leave the memo: coremltools keeps what it is given, and a 1B model's
        # palettes are over a gigabyte, so holding both would raise the peak by that much. A group
        # asked for twice (identical values in two tensors) is clustered again, identically.
        found = self._memo.pop(_group_key(group, nbits), None)
        if found is None:
            log.debug("palette memo miss for a group of shape %s", group.shape)
            found = palettize_group(group, nbits)
        return found

    def prime(self, weights: dict[str, np.ndarray], compression: Compression) -> int:
        """Cluster every channel group of ``weights`` in vectorized batches, ahead of coremltools.

        coremltools' custom mode asks for one group at a time; answering each from the memo keeps
        its op construction while the k-means itself runs batched. Groups coremltools splits
        differently are simply clustered on demand. Returns the number of groups primed.
        """
        nbits = compression.nbits
        grouped = {name: grouped_rows(value, compression) for name, value in weights.items()}
        grouped = {name: flat for name, flat in grouped.items() if flat is not None}
        primed = 0
        found = self.tensor_palettes(list(grouped.values()), nbits, list(grouped), [weights[name].shape for name in grouped])
        for (name, flat), (luts, indices) in zip(grouped.items(), found):
            value = weights[name]
            group_shape = (value.shape[0] // flat.shape[0], *value.shape[1:])
            for row in range(flat.shape[0]):
                group = flat[row].reshape(group_shape)
                self._memo[_group_key(group, nbits)] = (luts[row].astype(value.dtype), indices[row].reshape(group_shape))
                primed += 1
        return primed

    def tensor_palettes(
        self,
        flats: list[np.ndarray],
        nbits: int | list[int],
        names: list[str] | None = None,
        shapes: list[tuple[int, ...]] | None = None,
    ) -> list[Palettes]:
        """(luts, indices) of every row of each tensor in ``flats`` (one row per channel group),
        at ``nbits`` (one for all, or one per tensor); ``names`` and ``shapes`` (the weights'
        own), when given, pick each one's importance.

        From the disk cache where a previous build clustered the same values; the rest are
        clustered together, rows of equal length from all tensors in one batch (up to
        ``PRIME_BATCH_VALUES`` values): a Lloyd step costs about as much for one small tensor as
        for many, so batching across tensors is what makes the few changed tensors of an adapter
        quick. Rows are clustered independently, so a row's palette does not depend on what it
        was batched with.
        """
        bits = [nbits] * len(flats) if isinstance(nbits, int) else list(nbits)
        importances = self._importance(flats, names, shapes)
        # a weight with importance rows was named and shaped, and the store has its importance
        compensated = [importances[i] is not None and self.importance.compensates(names[i], shapes[i]) for i in range(len(flats))]
        # hashed once, read and written by name
        files = [self._file(*args) for args in zip(flats, bits, importances, compensated)]
        results: list[Palettes | None] = [self._cached(file, flat, n) for file, flat, n in zip(files, flats, bits)]
        pending: dict[tuple[int, str, int], list[int]] = {}
        for index, found in enumerate(results):
            if found is None:
                pending.setdefault((flats[index].shape[1], str(flats[index].dtype), bits[index]), []).append(index)
        for (length, _, nbits_here), members in pending.items():
            luts = {i: np.empty((flats[i].shape[0], 1 << nbits_here), np.float32) for i in members}
            labels = {i: np.empty(flats[i].shape, np.uint8) for i in members}
            step = max(1, PRIME_BATCH_VALUES // length)
            batch: list[tuple[int, int, int]] = []  # (tensor, first row, end row)

            def cluster(batch=batch, luts=luts, labels=labels, nbits=nbits_here, length=length) -> None:
                importance = None
                if any(importances[i] is not None for i, _, _ in batch):
                    # equal importance clusters as unweighted: an unmeasured weight in the batch gets ones
                    importance = np.concatenate(
                        [importances[i][1][a:b] if importances[i] is not None else np.ones((b - a, length)) for i, a, b in batch]
                    )
                lut, label = kmeans_1d(np.concatenate([flats[i][a:b] for i, a, b in batch]), nbits, importance=importance)
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
            self._compensate([i for i in members if compensated[i]], flats, shapes, names, luts, labels)
            for i in members:
                results[i] = (luts[i], labels[i])
                self._store(files[i], results[i])
        return results

    def in_order(
        self,
        sizes: list[int],
        grouped: Callable[[int], np.ndarray],
        nbits: int | Callable[[int], int],
        named: Callable[[int], tuple[str, tuple[int, ...]]] | None = None,
    ) -> Iterator[Palettes]:
        """Palettes of tensors 0, 1, ... (``sizes``: their value counts; ``grouped(i)``: tensor
        i's rows, read only when its batch starts; ``nbits``: for all, or ``nbits(i)`` per
        tensor; ``named(i)``: its name and shape, for its importance), yielded in order.

        Consecutive tensors are clustered together in batches of about ``PRIME_BATCH_VALUES``
        values, ``PALETTE_WORKERS`` batches at a time on their own threads (torch and numpy
        release the GIL in the k-means), while the caller writes what is ready: so both cores
        work, and at most that many batches are held at once.
        """
        batches: list[list[int]] = []
        filled = PRIME_BATCH_VALUES
        for index, size in enumerate(sizes):
            if filled >= PRIME_BATCH_VALUES:
                batches.append([])
                filled = 0
            batches[-1].append(index)
            filled += size

        def cluster(batch: list[int]) -> list[Palettes]:
            bits = nbits if isinstance(nbits, int) else [nbits(i) for i in batch]
            if named is None:
                return self.tensor_palettes([grouped(i) for i in batch], bits)
            names, shapes = zip(*(named(i) for i in batch))
            return self.tensor_palettes([grouped(i) for i in batch], bits, list(names), list(shapes))

        if len(batches) <= 1:
            for batch in batches:
                yield from cluster(batch)
            return
        # The last batch's palettes are yielded after the workers and the thread limit are gone,
        # so a caller that takes every palette never resumes with either still in place.
        with _torch_threads(1), ThreadPoolExecutor(PALETTE_WORKERS) as pool:
            waiting = iter(batches[PALETTE_WORKERS:])
            running = deque(pool.submit(cluster, batch) for batch in batches[:PALETTE_WORKERS])
            while True:
                done = running.popleft().result()
                following = next(waiting, None)
                if following is not None:
                    running.append(pool.submit(cluster, following))
                if not running:
                    break
                yield from done
        yield from done

    def _compensate(self, members, flats, shapes, names, luts, labels) -> None:
        """Replace the nearest-entry ``labels`` of ``members`` by error-compensated ones, tensors
        fed the same input (one Gram: q/k/v, gate/up) stacked into one pass, whose cost is
        mostly per input column. Each row's entries depend only on its own values, its
        palette and the Gram, so stacking changes no result."""
        together: dict[tuple[int, int], list[int]] = {}
        for i in members:
            rows = shapes[i][0] // flats[i].shape[0]
            together.setdefault((id(self.importance.factor(names[i])), rows), []).append(i)
        for (_, rows), stacked in together.items():
            gram = self.importance.factor(names[stacked[0]])
            weight = np.concatenate([flats[i].reshape(shapes[i]) for i in stacked])
            # the palettes as stored (float16), which the chosen entries must be nearest to
            stored = np.concatenate([luts[i] for i in stacked]).astype(np.float16).astype(np.float32)
            chosen = compensated_indices(weight, stored, rows, gram)
            start = 0
            for i in stacked:
                labels[i] = chosen[start : start + shapes[i][0]].reshape(flats[i].shape)
                start += shapes[i][0]

    def clear(self) -> None:
        """Forget primed palettes (those on disk stay)."""
        self._memo.clear()

    def _importance(self, flats, names, shapes) -> list[tuple[str, np.ndarray] | None]:
        """Per tensor: (digest, importance rows), or None where it is clustered unweighted."""
        if self.importance is None or names is None:
            return [None] * len(flats)
        found: list[tuple[str, np.ndarray] | None] = []
        for index, (flat, name) in enumerate(zip(flats, names)):
            shape = shapes[index] if shapes is not None else None
            rows = self.importance.rows(name, shape, flat) if shape is not None else None
            found.append((self.importance.digest(name), rows) if rows is not None else None)
        return found

    def _file(
        self, flat: np.ndarray, nbits: int, importance: tuple[str, np.ndarray] | None = None, compensated: bool = False
    ) -> str | None:
        if self.files is None:
            return None
        label = f"{nbits}|{PALETTE_ALGORITHM}" + (f"|importance {importance[0]}" if importance is not None else "")
        # the Gram is the calibration's, as the energies in the importance digest are
        label += f"|{COMPENSATION_ALGORITHM}" if compensated else ""
        return content_digest(flat, label)

    def _cached(self, key: str | None, flat: np.ndarray, nbits: int) -> Palettes | None:
        data = self.files.read(key) if key is not None else None
        if data is None:
            return None
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as stored:
                luts = stored["luts"]
                if "packed" in stored:  # indices at nbits each (entries written before: a byte each)
                    indices = unpack_bits(stored["packed"], nbits, flat.size).reshape(flat.shape)
                else:
                    indices = stored["indices"]
            # a damaged entry is recomputed, never used
            if luts.shape == (flat.shape[0], 1 << nbits) and indices.shape == flat.shape and indices.dtype == np.uint8:
                if not indices.size or int(indices.max()) < (1 << nbits):
                    return luts, indices
        except (OSError, ValueError, KeyError, EOFError):
            pass
        return None

    def _store(self, key: str | None, palettes: Palettes) -> None:
        if key is None:
            return
        luts, indices = palettes
        nbits = int(luts.shape[1]).bit_length() - 1
        buffer = io.BytesIO()
        if 8 % nbits == 0:
            # packed: at 4 bits the cache then takes half the disk (a 1B base's palettes: 2.0 GiB a byte per index)
            np.savez(buffer, luts=luts, packed=pack_bits(indices, nbits))
        else:
            np.savez(buffer, luts=luts, indices=indices)
        self.files.write(key, buffer.getvalue())
