"""Fast, deterministic 1-D k-means for weight palettization.

One-dimensional k-means needs no pass over all values per iteration: with each group's values
sorted once and their prefix sums kept, a Lloyd step finds the cluster boundaries by
``searchsorted`` of the centroid midpoints and the cluster sums by prefix-sum differences, so it
costs O(k log n) per group instead of O(n k). All groups of a tensor run together, vectorized,
and each step computes only the groups still moving: one palette per output channel (the
data-free default) means thousands of short groups, most of which converge in a few steps.

Lloyd only finds a local optimum, and on trained weights the one it finds from evenly spaced
quantiles is poor: a real checkpoint's weights are heavy-tailed and (stored in bfloat16) take
few distinct values, so quantile starts pile up on repeated values in the bulk while the few
large weights share a handful of centroids, and Lloyd cannot move centroids across the bulk to
them. On SmolLM2-135M's ``layers.2.mlp.down_proj`` that left 16x the optimal squared error at 8
bits (2.7x at 6). So the palette is grown instead (Linde-Buzo-Gray): one centroid, every cluster
split in two (a 2-means of its own values), Lloyd, until 2**nbits; then a few rounds move a
centroid from where it is worth least (the adjacent pair whose merge costs least) to where it is
worth most (the cluster whose split gains most) while that lowers the error. Against the exact
optimum (``kmeans1d``) on real, heavy-tailed and Gaussian weights: within 10% at 4 bits and 15%
at 6, 30% at 8 (tests/test_palettize.py); on the real down_proj 1.6%, 6.6% and 9.0%. No
randomness: identical weights always give identical palettes, a requirement for deduplicating
shared base weights across functions.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_ITERATIONS = 256  # Lloyd steps after the palette is grown; it usually stops far sooner
GROWTH_STEPS = 8  # Lloyd steps after each doubling of the palette
MOVE_ROUNDS = 8  # centroid moves (one per group per round), each followed by MOVE_STEPS of Lloyd
MOVE_STEPS = 4
SPLIT_STEPS = 4  # Lloyd steps of each cluster's own 2-means (where to split it)
# Values per block of a search's first steps (``_SearchedRows``); a power of two.
BLOCK = 64
# Divisor floor: a cluster's count is an integer, or with importance a weight sum, possibly below 1.
_TINY = 1e-300


class _SearchedRows:
    """Sorted rows, searched many times with few queries per row: per query, how many of its
    row's values lie below it (``torch.searchsorted``'s answer).

    A branchless binary search, vectorized over every query: the position grows by each power of
    two, largest first, where the value it would step past is still below the query. The rows
    are padded with +inf to one less than twice the largest power of two in their length, so no
    step needs a bounds check, and kept flat, so a subset of rows (``at``) is searched without
    copying it. torch's batched searchsorted costs time proportional to the rows' length here;
    this costs log2(n) reads of one value per query, which are random reads: the rows are kept
    in ``dtype``, the narrowest that holds them exactly (a comparison with a wider query promotes
    the value exactly).
    """

    def __init__(self, ordered: torch.Tensor, dtype: torch.dtype):
        n_groups, n = ordered.shape
        self.top = 1 << (max(1, n).bit_length() - 1)
        self.width = 2 * self.top - 1
        padded = torch.full((n_groups, self.width), torch.inf, dtype=dtype)
        padded[:, :n] = ordered
        self.flat = padded.reshape(-1)
        self.n_groups = n_groups
        # The steps of BLOCK or more only read the last value of each block of BLOCK, so they
        # read a copy of those alone: small enough to stay in cache, where reads from the whole
        # rows each miss it. The last few steps then read within one block.
        self.coarse = padded[:, BLOCK - 1 :: BLOCK].reshape(-1)
        self.coarse_width = self.width // BLOCK

    def count_below(self, queries: torch.Tensor, *, right: bool, at: torch.Tensor | None = None) -> torch.Tensor:
        """(G, q) counts of values < each query (<= with ``right``), in row ``i`` of the rows or
        row ``at[i]``. Queries must be finite."""
        rows = (torch.arange(self.n_groups) if at is None else at)[:, None]
        coarse_starts = rows * self.coarse_width
        block = coarse_starts.expand(queries.shape).clone()  # in the coarse copy: blocks wholly below
        step = self.top // BLOCK
        while step:
            value = torch.take(self.coarse, block + (step - 1))
            block += ((value <= queries) if right else (value < queries)) * step
            step >>= 1
        starts = rows * self.width
        position = (block - coarse_starts) * BLOCK + starts
        step = min(self.top, BLOCK // 2)
        while step:
            value = torch.take(self.flat, position + (step - 1))
            position += ((value <= queries) if right else (value < queries)) * step
            step >>= 1
        return position - starts


def _gathered(rows: torch.Tensor, columns: torch.Tensor, at: torch.Tensor | None) -> torch.Tensor:
    """``rows[i, columns[i, j]]``, or with ``at`` ``rows[at[i], columns[i, j]]``."""
    if at is None:
        return torch.gather(rows, 1, columns)
    # A flat take: advanced indexing rows[at[:, None], columns] is several times slower.
    return torch.take(rows, columns + (at * rows.shape[1])[:, None])


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


def _prefix_sums(rows: torch.Tensor) -> torch.Tensor:
    """(G, n + 1) float64: 0, then each row's running sum. Summed straight into its place: a
    temporary and a copy of the whole buffer took most of the time the prefix sums took."""
    sums = torch.empty((rows.shape[0], rows.shape[1] + 1), dtype=torch.float64)
    sums[:, 0] = 0
    torch.cumsum(rows, dim=1, out=sums[:, 1:])
    return sums


def _means(counts: torch.Tensor, sums: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Each cluster's mean; ``empty`` (broadcast) where a cluster holds no value."""
    return torch.where(counts > 0, sums / counts.clamp(min=_TINY), empty)


class _SortedRows:
    """Each group's values sorted, with prefix sums of the values and their squares: every
    cluster statistic a step needs is a difference of two prefix entries.

    With ``importance`` (one non-negative weight per value, in the same order), every statistic
    is weighted: a cluster's "count" is its total weight, its mean the weighted mean, its error
    the weighted squared error. Equal weights give the unweighted palettes."""

    def __init__(self, ordered: torch.Tensor, importance: torch.Tensor | None = None, exact_in: torch.dtype = torch.float32):
        values = ordered.to(torch.float64)
        n_groups, n = values.shape
        # Searched in the narrowest dtype that holds them exactly (``exact_in``: float16 for
        # float16 weights, a quarter of float64's bytes): the searches' random reads dominate.
        self.searched = _SearchedRows(ordered, exact_in)
        self.n = n
        # values is this method's own float64 copy: squared in place once its sums are taken
        self.weights = None
        if importance is None:
            self.sums = _prefix_sums(values)
            self.squares = _prefix_sums(values.mul_(values))
        else:
            weighted = values * importance
            self.sums = _prefix_sums(weighted)
            self.squares = _prefix_sums(weighted.mul_(values))
            self.weights = _prefix_sums(importance)
        self.starts = torch.zeros((n_groups, 1), dtype=torch.long)
        self.ends = torch.full((n_groups, 1), n, dtype=torch.long)

    def bounds(self, centroids: torch.Tensor, at: torch.Tensor | None = None) -> torch.Tensor:
        """(G, k + 1) sorted positions where each centroid's cluster starts, and the end (of
        the groups ``at``, when given: every method takes it, so that work shrinks to the
        groups still moving without copying their values)."""
        midpoints = (centroids[:, 1:] + centroids[:, :-1]) / 2
        starts, ends = (self.starts, self.ends) if at is None else (self.starts[at], self.ends[at])
        return torch.cat((starts, self.searched.count_below(midpoints, right=False, at=at), ends), dim=1)

    def clusters(self, bounds: torch.Tensor, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count, sum and squared error of the values between consecutive ``bounds``."""
        return self.between(bounds[:, :-1], bounds[:, 1:], at)

    def between(self, low: torch.Tensor, high: torch.Tensor, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count, sum and squared error of the sorted values from ``low`` to ``high`` (exclusive)."""
        if self.weights is None:
            counts = (high - low).to(torch.float64)
        else:
            counts = _gathered(self.weights, high, at) - _gathered(self.weights, low, at)
        sums = _gathered(self.sums, high, at) - _gathered(self.sums, low, at)
        squares = _gathered(self.squares, high, at) - _gathered(self.squares, low, at)
        return counts, sums, (squares - sums * sums / counts.clamp(min=_TINY)).clamp(min=0)

    def halves(self, bounds: torch.Tensor, means: torch.Tensor, at: torch.Tensor | None = None):
        """Each cluster cut in two by a few Lloyd steps of its own, starting at its mean: the
        halves' (counts, sums, errors), shaped (G, k, 2)."""
        low, high = bounds[:, :-1], bounds[:, 1:]
        n_groups, k = means.shape
        split_at = means
        for _ in range(SPLIT_STEPS + 1):
            cut = torch.minimum(torch.maximum(self.searched.count_below(split_at, right=False, at=at), low), high)
            counts, sums, errors = self.between(
                torch.stack((low, cut), dim=2).reshape(n_groups, -1), torch.stack((cut, high), dim=2).reshape(n_groups, -1), at
            )
            halves = _means(counts, sums, means.repeat_interleave(2, dim=1)).reshape(n_groups, k, 2)
            split_at = halves.mean(dim=2)
        return counts.reshape(n_groups, k, 2), sums.reshape(n_groups, k, 2), errors.reshape(n_groups, k, 2)

    def lloyd(self, centroids: torch.Tensor, steps: int, at: torch.Tensor | None = None) -> torch.Tensor:
        """Up to ``steps`` Lloyd steps of each group (of the groups ``at``), each group stopping
        when its centroids stop moving: a group that has converged is a fixed point, so only
        the groups still moving are computed (on real weights most stop within a few dozen
        steps, a few run to the cap), and a group's result does not depend on its batch."""
        centroids = centroids.clone()
        moving = torch.arange(len(centroids))
        for _ in range(steps):
            rows = moving if at is None else at[moving]
            current = centroids[moving]
            counts, sums, _ = self.clusters(self.bounds(current, rows), rows)
            # Keep centroids sorted (empty clusters keep their old place, which may break the order).
            updated, _ = torch.sort(_means(counts, sums, current), dim=1)
            changed = (updated != current).any(dim=1)
            centroids[moving] = updated
            moving = moving[changed]
            if not len(moving):
                break
        return centroids

    def grown(self, k: int) -> torch.Tensor:
        """k centroids by doubling from the mean: every cluster replaced by its halves' means."""
        total = self.n if self.weights is None else self.weights[:, -1:].clamp(min=1e-300)
        centroids = self.sums[:, -1:] / total
        while centroids.shape[1] < k:
            bounds = self.bounds(centroids)
            counts, sums, _ = self.clusters(bounds)
            means = _means(counts, sums, centroids)
            half_counts, half_sums, _ = self.halves(bounds, means)
            split = _means(half_counts, half_sums, means[:, :, None])
            centroids = self.lloyd(torch.sort(split.reshape(len(means), -1), dim=1)[0], GROWTH_STEPS)
        return centroids

    def moved(self, centroids: torch.Tensor) -> torch.Tensor:
        """Move centroids, one per group per round, from the cheapest merge to the best split;
        a group stops at the first round whose move would not lower its error."""
        centroids = centroids.clone()
        k = centroids.shape[1]
        pairs = torch.arange(k - 1)[None]
        moving = torch.arange(len(centroids))
        for _ in range(MOVE_ROUNDS):
            current = centroids[moving]
            bounds = self.bounds(current, moving)
            counts, sums, errors = self.clusters(bounds, moving)
            means = _means(counts, sums, current)
            half_counts, half_sums, half_errors = self.halves(bounds, means, moving)
            gain = errors - half_errors.sum(dim=2)
            split = gain.argmax(dim=1)
            # Merging adjacent clusters a, b costs n_a n_b / (n_a + n_b) (mean_a - mean_b)^2 (an
            # empty one: nothing); the pair must not include the cluster being split.
            n_a, n_b = counts[:, :-1], counts[:, 1:]
            cost = n_a * n_b / (n_a + n_b).clamp(min=_TINY) * (means[:, 1:] - means[:, :-1]) ** 2
            cost = torch.where((pairs == split[:, None]) | (pairs + 1 == split[:, None]), torch.inf, cost)
            merge = cost.argmin(dim=1)
            rows = torch.arange(len(moving))
            better = gain[rows, split] > cost[rows, merge] * (1 + 1e-9)
            # only the groups that move take Lloyd steps: a group's palette must not depend on
            # the groups it is batched with (one that stopped at the step cap is no fixed point)
            moving, rows, split, merge = moving[better], rows[better], split[better], merge[better]
            if not len(moving):
                break
            together = counts[rows, merge] + counts[rows, merge + 1]
            moved = current[rows].clone()
            picked = torch.arange(len(rows))
            moved[picked, merge] = _means(together, sums[rows, merge] + sums[rows, merge + 1], current[rows, merge])
            halves = _means(half_counts, half_sums, means[:, :, None])[rows, split]
            moved[picked, merge + 1], moved[picked, split] = halves[:, 0], halves[:, 1]
            centroids[moving] = self.lloyd(torch.sort(moved, dim=1)[0], MOVE_STEPS, moving)
        return centroids


def kmeans_1d(
    groups: np.ndarray, nbits: int, iterations: int = MAX_ITERATIONS, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Palettize each row of ``groups`` (G, n): returns ``lut`` (G, 2**nbits) and ``indices`` (G, n) uint8.

    ``importance`` (G, n), optional, weighs each value's squared error (data-aware palettes: the
    energy of the activation it multiplies); weights should be positive. Rows with no more
    distinct values than palette entries get those values exactly.
    """
    data = torch.from_numpy(np.ascontiguousarray(groups, dtype=np.float32))
    n_groups, n = data.shape
    k = 1 << nbits
    ordered, permutation = _sort_rows(groups, data)
    weights = None
    if importance is not None:
        weights = torch.gather(torch.from_numpy(np.ascontiguousarray(importance, dtype=np.float64)), 1, permutation)
    rows = _SortedRows(ordered, weights, torch.float16 if groups.dtype == np.float16 else torch.float32)
    centroids = rows.moved(rows.lloyd(rows.grown(k), iterations))

    lut = centroids.to(torch.float32)
    # Assign in sorted order (the label steps up at each cut), then scatter back to the original
    # positions: O(n), instead of a binary search per value. A value equal to a midpoint goes to
    # the lower cluster, as searchsorted(midpoints, value) would place it.
    midpoints = ((centroids[:, 1:] + centroids[:, :-1]) / 2).to(torch.float32).contiguous()
    cuts = rows.searched.count_below(midpoints, right=True)
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
