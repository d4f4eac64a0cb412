"""Fast, deterministic 1-D k-means for weight palettization.

One-dimensional k-means needs no pass over all values per iteration: with each group's values
sorted once and their prefix sums kept, a Lloyd step finds the cluster boundaries by
``searchsorted`` of the centroid midpoints and the cluster sums by prefix-sum differences, so it
costs O(k log n) per group instead of O(n k). All groups of a tensor run together, vectorized.
Initialization is by quantiles (no randomness), so identical weights always give identical
palettes: a requirement for deduplicating shared base weights across functions.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ITERATIONS = 256  # Lloyd from quantiles converges in ~250 steps on Gaussian-like weights


def batched_searchsorted(rows: torch.Tensor, queries: torch.Tensor, *, right: bool) -> torch.Tensor:
    """``torch.searchsorted`` for few queries per long sorted row, by a vectorized binary search.

    torch's batched searchsorted costs time proportional to the rows' length per call here; this
    takes ceil(log2(n + 1)) gathers of only (rows, queries) elements.
    """
    n_rows, n = rows.shape
    low = torch.zeros(queries.shape, dtype=torch.long)
    high = torch.full(queries.shape, n, dtype=torch.long)
    for _ in range(max(1, n).bit_length()):
        middle = (low + high) // 2
        value = torch.gather(rows, 1, middle.clamp(max=n - 1))
        go_right = (value <= queries) if right else (value < queries)
        go_right &= middle < high
        low = torch.where(go_right, middle + 1, low)
        high = torch.where(go_right, high, middle)
    return low


def _sort_rows(groups: np.ndarray, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row sorted, with the permutation. float16 rows (what Core ML weights are) sort as
    16-bit integer keys, which numpy radix-sorts in linear time: about 2.5x torch.sort here."""
    if groups.dtype != np.float16:
        return torch.sort(data, dim=1)
    bits = np.ascontiguousarray(groups).view(np.uint16)
    # Order-preserving key: flip all bits of negatives, set the sign bit of positives.
    keys = np.where(bits & 0x8000, ~bits, bits | 0x8000).astype(np.uint16)
    permutation = torch.from_numpy(np.argsort(keys, axis=1, kind="stable"))
    return torch.gather(data, 1, permutation), permutation


def kmeans_1d(groups: np.ndarray, nbits: int, iterations: int = MAX_ITERATIONS) -> tuple[np.ndarray, np.ndarray]:
    """Palettize each row of ``groups`` (G, n): returns ``lut`` (G, 2**nbits) and ``indices`` (G, n) uint8.

    Rows with no more distinct values than palette entries get those values exactly.
    """
    data = torch.from_numpy(np.ascontiguousarray(groups, dtype=np.float32))
    n_groups, n = data.shape
    k = 1 << nbits
    ordered, permutation = _sort_rows(groups, data)
    ordered64 = ordered.to(torch.float64)
    prefix = torch.zeros((n_groups, n + 1), dtype=torch.float64)
    prefix[:, 1:] = torch.cumsum(ordered64, dim=1)

    # Quantile initialisation: the centre of each of k equal-count slices of the sorted values.
    positions = ((torch.arange(k, dtype=torch.float64) + 0.5) * n / k).floor().clamp(max=n - 1).long()
    centroids = ordered64[:, positions]

    starts = torch.zeros((n_groups, 1), dtype=torch.long)
    ends = torch.full((n_groups, 1), n, dtype=torch.long)
    for _ in range(iterations):
        midpoints = (centroids[:, 1:] + centroids[:, :-1]) / 2
        cuts = batched_searchsorted(ordered64, midpoints, right=False)
        bounds = torch.cat((starts, cuts, ends), dim=1)
        counts = bounds[:, 1:] - bounds[:, :-1]
        sums = torch.gather(prefix, 1, bounds[:, 1:]) - torch.gather(prefix, 1, bounds[:, :-1])
        updated = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        # Keep centroids sorted (empty clusters keep their old place, which may break the order).
        updated, _ = torch.sort(updated, dim=1)
        if torch.equal(updated, centroids):
            break
        centroids = updated

    lut = centroids.to(torch.float32)
    # Assign in sorted order (the label steps up at each cut), then scatter back to the original
    # positions: O(n), instead of a binary search per value. A value equal to a midpoint goes to
    # the lower cluster, as searchsorted(midpoints, value) would place it.
    midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32).contiguous()
    cuts = batched_searchsorted(ordered, midpoints, right=True)
    steps = torch.zeros((n_groups, n + 1), dtype=torch.int16)
    steps.scatter_add_(1, cuts, torch.ones_like(cuts, dtype=torch.int16))
    labels_sorted = torch.cumsum(steps[:, :n], dim=1, dtype=torch.int16)
    indices = torch.empty((n_groups, n), dtype=torch.int16)
    indices.scatter_(1, permutation, labels_sorted)

    # Exact palettes where the values already fit: k-means would only blur them.
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1) + 1
    small = torch.nonzero(distinct <= k).flatten().tolist()
    for row in small:
        values = torch.unique(ordered[row])
        exact = torch.zeros(k, dtype=torch.float32)
        exact[: len(values)] = values
        exact[len(values):] = values[-1]
        lut[row] = exact
        indices[row] = torch.searchsorted(values.contiguous(), data[row].contiguous())
    return lut.numpy(), indices.to(torch.uint8).numpy()


def palettize_group(values: np.ndarray, nbits: int) -> tuple[np.ndarray, np.ndarray]:
    """coremltools ``custom`` lut_function contract for one group: (lut[2**nbits], indices like values)."""
    lut, indices = kmeans_1d(values.reshape(1, -1), nbits)
    return lut[0].astype(values.dtype), indices[0].reshape(values.shape)
