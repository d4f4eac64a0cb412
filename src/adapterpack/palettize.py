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

MAX_ITERATIONS = 60


def kmeans_1d(groups: np.ndarray, nbits: int, iterations: int = MAX_ITERATIONS) -> tuple[np.ndarray, np.ndarray]:
    """Palettize each row of ``groups`` (G, n): returns ``lut`` (G, 2**nbits) and ``indices`` (G, n) uint8.

    Rows with no more distinct values than palette entries get those values exactly.
    """
    data = torch.from_numpy(np.ascontiguousarray(groups, dtype=np.float32))
    n_groups, n = data.shape
    k = 1 << nbits
    ordered, _ = torch.sort(data, dim=1)
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
        cuts = torch.searchsorted(ordered64, midpoints.contiguous(), right=False)
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
    midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32).contiguous()
    indices = torch.searchsorted(midpoints, data.contiguous(), right=False)

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
