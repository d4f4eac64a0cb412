"""The 1-D k-means behind palettization: deterministic, batch-independent, and a real k-means."""

from __future__ import annotations

import kmeans1d
import numpy as np
import pytest

import adapterpack.compress.palettes as palettes
from adapterpack.compress.kmeans import kmeans_1d
from adapterpack.compress.palettes import PaletteStore


def weights(seed: int, shape=(64, 256)) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float16)


def test_identical_rows_get_identical_palettes_run_to_run():
    rows = weights(0, (8, 512))
    first, second = kmeans_1d(rows, 4), kmeans_1d(rows.copy(), 4)
    np.testing.assert_array_equal(first[0], second[0])
    np.testing.assert_array_equal(first[1], second[1])


def test_lloyd_fixed_point_and_better_than_uniform_levels():
    rows = weights(1, (4, 4096)).astype(np.float32)
    luts, labels = kmeans_1d(rows, 4)
    for row, lut, label in zip(rows, luts, labels):
        # each value sits in its nearest centroid's cluster, and each centroid is its cluster's mean
        nearest = np.abs(row[:, None] - lut[None, :]).argmin(axis=1)
        assert np.mean(nearest == label) > 0.999
        for k in np.unique(label):
            np.testing.assert_allclose(lut[k], row[label == k].mean(), rtol=1e-4, atol=1e-7)
        uniform = np.linspace(row.min(), row.max(), 16)
        uniform_error = np.mean((row - uniform[np.abs(row[:, None] - uniform).argmin(axis=1)]) ** 2)
        assert np.mean((row - lut[label]) ** 2) < 0.6 * uniform_error


def test_few_distinct_values_are_kept_exactly():
    row = np.repeat(np.array([-1.5, 0.25, 3.0], np.float16), 100)[None]
    lut, labels = kmeans_1d(row, 4)
    np.testing.assert_array_equal(lut[0][labels[0]].astype(np.float16), row[0])


def _optimal_error(row: np.ndarray, nbits: int) -> float:
    """Squared error of the exact 1-D k-means optimum (kmeans1d, the package coremltools' own
    k-means palettization uses for large float16 groups)."""
    values = row.astype(np.float64)
    labels, centroids = kmeans1d.cluster(values, 1 << nbits)
    return float(((values - np.asarray(centroids)[labels]) ** 2).sum())


def _real_weights(name: str) -> np.ndarray:
    from factories import load_script

    script = load_script("smollm2")
    import torch
    from safetensors.torch import load_file as load_torch

    return load_torch(script.ensure_base() / "model.safetensors")[name].to(torch.float16).numpy()


def _weight_groups(kind: str) -> np.ndarray:
    """Two groups of 16 output channels, as builds palettize them."""
    rng = np.random.default_rng(7)
    if kind == "gaussian":
        weight = rng.standard_normal((32, 1024)) * 0.02
    elif kind == "student-t":  # heavy tails: a few weights 10-30 standard deviations out
        weight = rng.standard_t(3, size=(32, 1024)) * 0.02
    else:  # a real checkpoint's (bfloat16-trained, heavy-tailed, few distinct values per group)
        weight = _real_weights(kind)[:32]
    return np.ascontiguousarray(weight.astype(np.float16)).reshape(2, -1)


@pytest.mark.parametrize("kind", ["gaussian", "student-t", "model.layers.2.mlp.down_proj.weight", "model.layers.10.self_attn.q_proj.weight"])
def test_palettes_are_near_the_exact_optimum_at_every_bit_width(kind):
    """Quantile-started Lloyd stopped at 16x the optimal squared error on the real down_proj at 8
    bits (2.7x at 6, 161x on Student-t at 8); the grown palette stays near the optimum."""
    groups = _weight_groups(kind)
    for nbits, bound in ((2, 1.01), (4, 1.10), (6, 1.15), (8, 1.35)):
        luts, labels = kmeans_1d(groups, nbits)
        for row, lut, label in zip(groups, luts, labels):
            error = float(((row.astype(np.float64) - lut.astype(np.float64)[label]) ** 2).sum())
            assert error <= bound * _optimal_error(row, nbits), (kind, nbits, error / _optimal_error(row, nbits))


@pytest.mark.parametrize("kind", ["student-t", "model.layers.2.mlp.down_proj.weight"])
def test_weighted_palettes_are_near_the_exact_weighted_optimum(kind):
    """A value of integer importance w counts as w copies of it: the weighted palette's weighted
    error must be near the exact optimum of the values so repeated."""
    groups = _weight_groups(kind)[:, :4096]
    importance = np.random.default_rng(3).integers(1, 6, size=groups.shape).astype(np.float64)
    importance[:, :64] = 40  # a few heavily weighted inputs, as a massive activation makes them
    for nbits, bound in ((2, 1.01), (4, 1.15), (6, 1.15)):
        luts, labels = kmeans_1d(groups, nbits, importance=importance)
        for row, weight, lut, label in zip(groups, importance, luts, labels):
            error = float((weight * (row.astype(np.float64) - lut.astype(np.float64)[label]) ** 2).sum())
            optimum = _optimal_error(np.repeat(row, weight.astype(int)), nbits)
            assert error <= bound * optimum, (kind, nbits, error / optimum)
        unweighted = kmeans_1d(groups, nbits)
        plain_error = sum(
            float((weight * (row.astype(np.float64) - lut.astype(np.float64)[label]) ** 2).sum())
            for row, weight, lut, label in zip(groups, importance, *unweighted)
        )
        weighted_error = sum(
            float((weight * (row.astype(np.float64) - lut.astype(np.float64)[label]) ** 2).sum())
            for row, weight, lut, label in zip(groups, importance, luts, labels)
        )
        assert weighted_error < plain_error, (kind, nbits)


def test_equal_importance_gives_the_unweighted_palettes():
    groups = _weight_groups("student-t")
    luts, labels = kmeans_1d(groups, 4)
    weighted_luts, weighted_labels = kmeans_1d(groups, 4, importance=np.full(groups.shape, 1.0))
    np.testing.assert_array_equal(luts, weighted_luts)
    np.testing.assert_array_equal(labels, weighted_labels)


def test_palettes_do_not_depend_on_what_they_are_batched_with(monkeypatch):
    """Tensors are clustered together in batches that cut across tensor boundaries; each one's
    palettes must equal clustering it alone."""
    tensors = [weights(seed).reshape(-1, 16 * 256) for seed in range(3)]
    alone = [PaletteStore().tensor_palettes([t], 4)[0] for t in tensors]
    monkeypatch.setattr(palettes, "PRIME_BATCH_VALUES", 16 * 256 * 3)  # three rows: splits every tensor
    together = PaletteStore().tensor_palettes(tensors, 4)
    for (lut_a, idx_a), (lut_b, idx_b) in zip(alone, together):
        np.testing.assert_array_equal(lut_a, lut_b)
        np.testing.assert_array_equal(idx_a, idx_b)


@pytest.mark.parametrize("nbits", [2, 4, 6, 8])
@pytest.mark.parametrize("weighted", [False, True], ids=["data-free", "weighted"])
def test_each_group_is_clustered_as_if_alone(nbits, weighted):
    """Heavy-tailed, Gaussian and few-valued groups: a group whose Lloyd steps stop at their cap
    is no fixed point, so steps taken for other groups of its batch would change its palette."""
    rng = np.random.default_rng(1)
    groups = np.concatenate(
        [rng.standard_t(2.5, (12, 256)), rng.normal(size=(12, 256)), np.round(rng.normal(size=(8, 256)) * 3) / 3]
    ).astype(np.float16)
    importance = rng.random(groups.shape) ** 3 if weighted else None
    luts, labels = kmeans_1d(groups, nbits, importance=importance)
    for row in range(len(groups)):
        alone = kmeans_1d(groups[row : row + 1], nbits, importance=None if importance is None else importance[row : row + 1])
        np.testing.assert_array_equal(alone[0][0], luts[row], err_msg=f"row {row}")
        np.testing.assert_array_equal(alone[1][0], labels[row], err_msg=f"row {row}")


@pytest.mark.parametrize("length", [1, 2, 3, 7, 8, 9, 63, 64, 65, 127, 128, 1000, 4096])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_searched_rows_count_as_torch_searchsorted(length, dtype):
    """The k-means' branchless search (rows padded with +inf, float16 rows against float64
    queries, a subset of rows by number) answers what torch.searchsorted does, on both sides of
    repeated values and of queries equal to a value."""
    import torch

    from adapterpack.compress.kmeans import _SearchedRows

    rng = np.random.default_rng(length)
    rows = np.sort(np.round(rng.normal(size=(6, length)) * 4) / 4, axis=1).astype(dtype)
    queries = np.sort(np.concatenate([rng.normal(size=(6, 5)), rows[:, :3] if length >= 3 else rows, rows[:, -1:] + 1e-3], axis=1), axis=1)
    ordered = torch.from_numpy(rows.astype(np.float32))
    wide = torch.from_numpy(queries)
    searched = _SearchedRows(ordered, torch.float16 if dtype == np.float16 else torch.float32)
    exact = torch.from_numpy(rows.astype(np.float64))
    for right in (False, True):
        expected = torch.searchsorted(exact, wide, right=right)
        assert torch.equal(searched.count_below(wide, right=right), expected)
        at = torch.tensor([4, 1, 1])
        assert torch.equal(searched.count_below(wide[at], right=right, at=at), expected[at])


def test_disk_cache_returns_what_was_computed(tmp_path):
    from adapterpack.assemble.cache import BuildCache

    tensor = weights(5).reshape(-1, 16 * 256)
    store = PaletteStore(BuildCache(tmp_path).palette_files())
    computed = store.tensor_palettes([tensor], 4)[0]
    assert len(list(tmp_path.glob("palettes/*/palettes.npz"))) == 1
    reread = PaletteStore(BuildCache(tmp_path).palette_files()).tensor_palettes([tensor], 4)[0]
    np.testing.assert_array_equal(computed[0], reread[0])
    np.testing.assert_array_equal(computed[1], reread[1])


def test_damaged_working_files_are_recomputed(tmp_path):
    """A build's own palette files are not hashed (nobody else writes them), but what cannot be
    the palettes of the tensor is still recomputed, never used."""
    from adapterpack.assemble.cache import FolderPalettes

    tensor = weights(6).reshape(-1, 16 * 256)
    store = PaletteStore(FolderPalettes(tmp_path))
    computed = store.tensor_palettes([tensor], 4)[0]
    [entry] = tmp_path.glob("*.npz")
    np.savez(entry, luts=computed[0][:1], indices=computed[1])  # wrong shape
    assert np.array_equal(store.tensor_palettes([tensor], 4)[0][0], computed[0])
    entry.write_bytes(b"not a zip")
    assert np.array_equal(store.tensor_palettes([tensor], 4)[0][1], computed[1])


def test_cached_4_bit_indices_take_half_a_byte_each(tmp_path):
    """Palette cache entries keep indices packed (a 1B base's would otherwise take 2 GB)."""
    from adapterpack.assemble.cache import FolderPalettes

    flat = np.random.default_rng(5).standard_normal((64, 4096)).astype(np.float16)
    store = PaletteStore(FolderPalettes(tmp_path))
    (luts, indices), = store.tensor_palettes([flat], 4)
    (entry,) = tmp_path.glob("*.npz")
    assert entry.stat().st_size < 0.55 * flat.size
    (again_luts, again), = PaletteStore(FolderPalettes(tmp_path)).tensor_palettes([flat], 4)
    np.testing.assert_array_equal(again, indices)
    np.testing.assert_array_equal(again_luts, luts)
