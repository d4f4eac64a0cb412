"""Palette indices chosen with error compensation (GPTQ's, over a palette instead of a grid).

Taking each weight's nearest palette entry minimizes each weight's own error, but what the
layer computes is ``W x``: an error left in ``W[:, j]`` can be paid back by the weights of other
input channels that the calibration text shows move with ``x_j``. GPTQ (Frantar et al., 2022)
does that column by column with the inverse of the inputs' Gram matrix ``H = E[x x^T]``: it
rounds column ``j``, then spreads the error over the columns not yet rounded, so that the
expected output error ``tr(dW H dW^T)`` stays near its least. Rounding to a palette instead of an
integer grid changes nothing in that derivation: the palettes (one per group of output channels,
from the data-aware k-means) stay, only which entry each weight takes changes. Columns go in
decreasing activation energy (GPTQ's "act order"), so the channels that matter most are rounded
while every other column can still compensate them.

On SmolLM2-135M at 4 bits in groups of 16 output channels this takes the held-out perplexity
ratio from 1.27x (weighted k-means, nearest entries) to 1.08x at the same bytes (docs/compression.md).

    indices = compensated_indices(weight, luts, group_rows=16, gram=H)
"""

from __future__ import annotations

import numpy as np
import torch

# Ridge added to the Gram's diagonal, as a share of its mean: keeps the Cholesky defined and the
# compensation from fitting the calibration text instead of the model. GPTQ's default is 0.01;
# on SmolLM2-135M's held-out texts at 4 bits in groups of 16 (perplexity ratio base / shout /
# pirate) 0.01 gave 1.09 / 1.20 / 1.11, 0.1 gave 1.08 / 1.14 / 1.10, 0.3 gave 1.10 / 1.14 / 1.10.
DAMPING = 0.1
# Columns rounded before their error reaches the rest at once (one matrix product per block).
BLOCK = 128
# Within a block, columns rounded before their error reaches the block's other columns at once:
# each column's error is spread one column at a time only over its own few neighbours, and by a
# matrix product over the rest (GPTQ's lazy batch, applied twice). The one-column updates were
# most of a build's compensation on a 1B model (py-spy); BLOCK here spreads every column's error
# one column at a time over the whole block, as before (benchmarks/compensation_blocks.py).
SUB_BLOCK = 16
# Palettes of at least this many entries find each weight's nearest by bisection in their sorted
# entries instead of comparing it with every entry, which was a quarter of compression auto's
# search on Gemma 3 270M (py-spy), most layers of which it moves to 8 bits. At 256 entries a
# layer takes about half the time, at 16 bisection is no faster (benchmarks/compensation_nearest.py).
BISECT_ENTRIES = 64


class GramFactor:
    """What the compensation reads of a Gram matrix: its dead channels (never excited), the column
    order (decreasing activation energy) and the upper Cholesky factor of the damped, reordered
    Gram's inverse. A pure function of the Gram, computed once per layer input for every weight
    and function that reads it (q/k/v, gate/up, and each adapter's fused weights): the factor is
    the costly part at 3072 inputs and up. The factor's upper triangle is kept packed in float64,
    the bytes of the float32 Gram it replaces.

        factor = GramFactor(gram)
        indices = compensated_indices(weight, luts, 16, factor)
    """

    def __init__(self, gram: np.ndarray):
        # float64 throughout: the Gram of a trained checkpoint spans ten orders of magnitude (its
        # massive activations), and identical inputs must give identical indices on any machine.
        hessian = torch.from_numpy(np.asarray(gram, dtype=np.float64).copy())
        self.size = hessian.shape[0]
        self.dead = hessian.diagonal() <= 0
        hessian[self.dead, self.dead] = 1.0
        self.order = torch.argsort(-hessian.diagonal(), stable=True)
        hessian = hessian[self.order][:, self.order]
        hessian.diagonal().add_(DAMPING * float(hessian.diagonal().mean()))
        upper = _upper_cholesky_of_inverse(hessian)
        self._packed = torch.cat([upper[row, row:] for row in range(self.size)])  # row by row, from the diagonal

    def inverse(self) -> torch.Tensor:
        """The upper Cholesky factor of the inverse, (in, in) float64."""
        full = torch.zeros((self.size, self.size), dtype=torch.float64)
        start = 0
        for row in range(self.size):
            full[row, row:] = self._packed[start : start + self.size - row]
            start += self.size - row
        return full


def compensated_indices(
    weight: np.ndarray, luts: np.ndarray, group_rows: int, gram: np.ndarray | GramFactor, *, block_columns: int | None = None
) -> np.ndarray:
    """For ``weight`` (out, in), the palette entry of every weight (uint8, (out, in)), rounding
    column by column and spreading each column's error over the columns left, by ``gram``
    (in, in), or its ``GramFactor``. ``luts`` (out / group_rows, entries): the palettes, one per block of
    ``group_rows`` output channels, as stored (float16 values in float32 are exact). With
    ``block_columns``, ``luts`` is (out, in / block_columns, entries) instead: a palette per
    output channel and block of input columns (a linear quantization's levels, its scale
    times the integers)."""
    out_features, in_features = weight.shape
    if block_columns is None:
        fits = luts.ndim == 2 and luts.shape[0] * group_rows == out_features
    else:
        fits = luts.ndim == 3 and luts.shape[:2] == (out_features, in_features // block_columns) and in_features % block_columns == 0
    factor = gram if isinstance(gram, GramFactor) else None
    gram_shape = (factor.size, factor.size) if factor is not None else np.shape(gram)
    if gram_shape != (in_features, in_features) or not fits:
        raise ValueError(f"weight {weight.shape}, palettes {luts.shape} ({group_rows} rows, {block_columns} columns) and a Gram of {gram_shape} do not fit")
    factor = factor if factor is not None else GramFactor(gram)
    work = torch.from_numpy(np.asarray(weight, dtype=np.float64).copy())
    dead, order = factor.dead, factor.order
    work[:, dead] = 0.0  # what a channel never excited holds does not matter; nearest is kept below
    work = work[:, order]
    inverse = factor.inverse()
    stored = torch.from_numpy(np.asarray(luts, dtype=np.float64))
    sorted_entries = None  # one palette for every column, when large enough to bisect
    if block_columns is None:
        every = stored.repeat_interleave(group_rows, dim=0)
        if every.shape[1] >= BISECT_ENTRIES:
            sorted_entries = _SortedEntries(every)

        def palette_of(column: int) -> torch.Tensor:
            return every
    else:

        def palette_of(column: int) -> torch.Tensor:
            return stored[:, column // block_columns]
    chosen = torch.empty((out_features, in_features), dtype=torch.uint8)
    for first in range(0, in_features, BLOCK):
        last = min(first + BLOCK, in_features)
        block = work[:, first:last].clone()
        errors = torch.empty_like(block)
        corner = inverse[first:last, first:last]
        for start in range(0, last - first, SUB_BLOCK):
            stop = min(start + SUB_BLOCK, last - first)
            for column in range(start, stop):
                values = block[:, column]
                palette = palette_of(int(order[first + column]))
                entry = sorted_entries.nearest(values) if sorted_entries is not None else (values[:, None] - palette).abs().argmin(dim=1)
                chosen[:, first + column] = entry.to(torch.uint8)
                error = (values - palette.gather(1, entry[:, None])[:, 0]) / corner[column, column]
                block[:, column:stop] -= error[:, None] * corner[column, column:stop][None, :]
                errors[:, column] = error
            if stop < last - first:
                block[:, stop:] -= errors[:, start:stop] @ corner[start:stop, stop:]
        work[:, last:] -= errors @ inverse[first:last, last:]
    indices = torch.empty_like(chosen)
    indices[:, order] = chosen
    result = indices.numpy()
    if dead.any():
        # a channel no text excites keeps its nearest entries (compensating it is meaningless)
        for column in np.flatnonzero(dead.numpy()):
            nearest = np.abs(np.asarray(weight, dtype=np.float64)[:, column, None] - palette_of(int(column)).numpy()).argmin(axis=1)
            result[:, column] = nearest.astype(np.uint8)
    return result


class _SortedEntries:
    """Each row's palette sorted once, to find the entry nearest a value by bisection: the same
    entry ``(values[:, None] - palette).abs().argmin(dim=1)`` finds (at equal distances the
    lowest index, as argmin takes the first), in log(entries) steps instead of entries."""

    def __init__(self, palettes: torch.Tensor):
        self.values, self.order = torch.sort(palettes, dim=1, stable=True)  # equal entries keep their index order
        entries = palettes.shape[1]
        positions = torch.arange(entries).expand_as(self.values)
        # each sorted position's first position holding the same value (its lowest index)
        starts = torch.where(self.values[:, 1:] != self.values[:, :-1], positions[:, 1:], 0)
        self.first = torch.cat([positions[:, :1], starts], dim=1).cummax(dim=1).values
        self.last = entries - 1

    def nearest(self, values: torch.Tensor) -> torch.Tensor:
        column = values[:, None].contiguous()  # a column of the weight: strided
        above = torch.searchsorted(self.values, column)  # the first entry >= each value
        below = (above - 1).clamp(min=0)
        above = above.clamp(max=self.last)
        picks = []
        for side in (below, above):
            start = self.first.gather(1, side)  # the lowest index among that value's equal entries
            picks.append(((column - self.values.gather(1, start)).abs(), self.order.gather(1, start)))
        (low_distance, low_index), (high_distance, high_index) = picks
        take_low = (low_distance < high_distance) | ((low_distance == high_distance) & (low_index < high_index))
        return torch.where(take_low, low_index, high_index)[:, 0]


def _upper_cholesky_of_inverse(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor of ``hessian``'s inverse (what GPTQ's column updates read),
    damped further if the Gram is too ill-conditioned to factor."""
    damping = DAMPING * float(hessian.diagonal().mean())
    for _ in range(8):
        lower, info = torch.linalg.cholesky_ex(hessian)
        if int(info) == 0:
            factor, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0:
                return factor
        hessian = hessian.clone()
        hessian.diagonal().add_(damping)
        damping *= 10
    raise ValueError("the calibration Gram matrix cannot be factored even damped")
