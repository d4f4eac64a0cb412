"""Error-compensated palette entries (``compress.compensation``): what the layer computes on its
inputs gets closer to the float layer than with each weight's nearest entry, and nothing else
changes (the palettes, determinism, the entries where inputs carry no correlation)."""

from __future__ import annotations

import numpy as np
import pytest

from adapterpack.compress.compensation import compensated_indices
from adapterpack.compress.importance import ChannelImportance
from adapterpack.compress.kmeans import kmeans_1d
from adapterpack.compress.palettes import PaletteStore
from adapterpack.config.compression import Compression

GROUP = 4


def _layer(seed: int, out_features: int = 32, in_features: int = 96, tokens: int = 2000):
    """A weight, its float16 palettes in groups of ``GROUP`` rows, and inputs whose channels are
    correlated and of very unequal energy (as a trained model's are), split into the tokens the
    Gram is measured on and held-out ones."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_t(4, (out_features, in_features)) * 0.05).astype(np.float16)
    mixing = rng.standard_normal((in_features, in_features)) / np.sqrt(in_features) + np.eye(in_features)
    inputs = rng.standard_normal((2 * tokens, in_features)) @ mixing * np.geomspace(0.1, 30, in_features)
    luts, nearest = kmeans_1d(weight.reshape(out_features // GROUP, -1), 3)
    return weight, luts.astype(np.float16).astype(np.float32), nearest.reshape(weight.shape), inputs[:tokens], inputs[tokens:]


def _output_error(weight, luts, indices, inputs) -> float:
    dense = np.take_along_axis(np.repeat(luts, GROUP, axis=0), indices.astype(np.int64), axis=1)
    return float((((weight.astype(np.float64) - dense) @ inputs.T) ** 2).mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compensation_lowers_the_output_error_on_held_out_inputs(seed):
    weight, luts, nearest, seen, held_out = _layer(seed)
    gram = seen.T @ seen / len(seen)
    chosen = compensated_indices(weight, luts, GROUP, gram)
    assert chosen.dtype == np.uint8 and chosen.shape == weight.shape and int(chosen.max()) < luts.shape[1]
    before, after = _output_error(weight, luts, nearest, held_out), _output_error(weight, luts, chosen, held_out)
    assert after < 0.85 * before, (seed, after / before)


@pytest.mark.parametrize("seed", [0, 1])
def test_int4_levels_per_block_of_columns_are_compensated_too(seed):
    """A linear quantization's levels (a scale per output channel and block of 32 inputs, times
    -7..7) as palettes per block of columns: the output error falls as with palettes, and one
    block spanning every column is the per-row palette itself."""
    weight, _, _, seen, held_out = _layer(seed)
    gram = seen.T @ seen / len(seen)
    blocks = weight.astype(np.float64).reshape(weight.shape[0], -1, 32)
    scale = (np.abs(blocks).max(axis=-1) / 7).astype(np.float16).astype(np.float64)
    levels = scale[..., None] * np.arange(-7, 8)  # (out, in / 32, 15)
    block_of = np.arange(weight.shape[1]) // 32

    def output_error(indices) -> float:
        dense = levels[np.arange(weight.shape[0])[:, None], block_of[None, :], indices.astype(np.int64)]
        return float((((weight.astype(np.float64) - dense) @ held_out.T) ** 2).mean())

    nearest = np.abs(blocks[..., None] - levels[:, :, None, :]).argmin(axis=-1).reshape(weight.shape)
    chosen = compensated_indices(weight, levels, 1, gram, block_columns=32)
    assert chosen.shape == weight.shape and int(chosen.max()) < 15
    assert output_error(chosen) < 0.85 * output_error(nearest), seed
    whole = levels[:, :1, :]  # the first block's levels for every column
    np.testing.assert_array_equal(
        compensated_indices(weight, whole, 1, gram, block_columns=weight.shape[1]),
        compensated_indices(weight, whole[:, 0, :], 1, gram),
    )


def test_uncorrelated_inputs_leave_every_weight_at_its_nearest_entry():
    """With a diagonal Gram no column's error can be paid back by another's: the nearest entries."""
    weight, luts, _, seen, _ = _layer(3)
    gram = np.diag((seen**2).mean(axis=0))
    rows = np.repeat(luts, GROUP, axis=0)
    nearest = np.abs(weight.astype(np.float32)[:, :, None] - rows[:, None, :]).argmin(axis=2)
    np.testing.assert_array_equal(compensated_indices(weight, luts, GROUP, gram), nearest)


def test_nearest_entry_by_bisection_is_argmin_s_ties_and_duplicates_included():
    """Large palettes find each weight's nearest entry in their sorted entries: the very index a
    comparison with every entry takes, where two entries are equally near (the lower index) and
    where a palette repeats a value (its first)."""
    import torch

    from adapterpack.compress.compensation import _SortedEntries

    rng = np.random.default_rng(0)
    for trial in range(60):
        rows, entries = int(rng.integers(1, 40)), int(rng.choice([2, 64, 256]))
        palettes = rng.standard_normal((rows, entries)).astype(np.float16).astype(np.float64)
        if trial % 3 == 0:
            palettes[:, ::3] = palettes[:, :1]  # repeated entries
        if trial % 5 == 0:
            palettes = np.round(palettes * 2) / 2  # many equal entries, values on their midpoints
        palettes = torch.from_numpy(palettes)
        ordered = torch.sort(palettes, dim=1).values
        values = {
            0: palettes[:, int(rng.integers(0, entries))].clone(),  # exactly an entry
            1: (ordered[:, 0] + ordered[:, 1]) / 2,  # exactly between two entries
            2: ordered[:, -1] + 1.0,  # beyond the largest
        }.get(trial % 4, torch.from_numpy(rng.standard_normal(rows) * 2))
        expected = (values[:, None] - palettes).abs().argmin(dim=1)
        assert torch.equal(_SortedEntries(palettes).nearest(values), expected), trial


@pytest.mark.parametrize("seed", [0, 5])
def test_errors_spread_by_sub_blocks_choose_what_column_by_column_spreading_chooses(seed, monkeypatch):
    """Within a block, each column's error reaches its sub-block one column at a time and the
    rest of the block by one matrix product: the same sums in another order, so the same entries
    (a different rounding of a sum could flip an exact tie: allowed, but not a different error)."""
    import adapterpack.compress.compensation as compensation

    weight, luts, _, seen, held_out = _layer(seed, out_features=64, in_features=300)
    gram = seen.T @ seen / len(seen)
    by_sub_blocks = compensated_indices(weight, luts, GROUP, gram)
    monkeypatch.setattr(compensation, "SUB_BLOCK", compensation.BLOCK)
    column_by_column = compensated_indices(weight, luts, GROUP, gram)
    monkeypatch.setattr(compensation, "SUB_BLOCK", 1)
    one_column = compensated_indices(weight, luts, GROUP, gram)
    assert np.mean(by_sub_blocks != column_by_column) <= 1e-3
    np.testing.assert_array_equal(one_column, column_by_column)
    errors = [_output_error(weight, luts, chosen, held_out) for chosen in (by_sub_blocks, column_by_column)]
    assert errors[0] == pytest.approx(errors[1], rel=1e-6)


def test_rows_compensated_together_or_alone_take_the_same_entries():
    """A palette store stacks the tensors fed the same input (q/k/v) into one pass."""
    weight, luts, _, seen, _ = _layer(4)
    gram = seen.T @ seen / len(seen)
    together = compensated_indices(weight, luts, GROUP, gram)
    half = weight.shape[0] // 2
    alone = np.concatenate(
        [compensated_indices(weight[:half], luts[: half // GROUP], GROUP, gram),
         compensated_indices(weight[half:], luts[half // GROUP :], GROUP, gram)]
    )
    np.testing.assert_array_equal(together, alone)


def test_the_entries_do_not_depend_on_the_thread_count():
    """Identical base weights must get identical entries in every function and build."""
    import torch

    weight, luts, _, seen, _ = _layer(5, out_features=64, in_features=300)
    gram = seen.T @ seen / len(seen)
    before = torch.get_num_threads()
    try:
        found = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            found.append(compensated_indices(weight, luts, GROUP, gram))
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(*found)


def test_a_store_compensates_only_the_layers_within_the_gram_budget(tmp_path):
    """Layers are compensated narrowest first while their Grams fit; the others keep the nearest
    entries of the same palettes, and their cache entries say which they are."""
    from adapterpack.assemble.cache import FolderPalettes

    narrow, luts_n, nearest_n, seen_n, _ = _layer(6, in_features=32)
    wide, luts_w, nearest_w, seen_w, _ = _layer(7, in_features=96)
    energies = {"model.narrow": (seen_n**2).mean(axis=0), "model.wide": (seen_w**2).mean(axis=0)}
    grams = {"model.narrow": seen_n.T @ seen_n / len(seen_n), "model.wide": seen_w.T @ seen_w / len(seen_w)}
    asked = []

    def measure(modules):
        asked.append(list(modules))
        return {name: grams[name] for name in modules}

    importance = ChannelImportance(energies, measure, gram_budget=4 * 32 * 32)
    assert importance.compensated == {"model.narrow"}
    store = PaletteStore(FolderPalettes(tmp_path), importance)
    compression = Compression(method="palettize", nbits=3, granularity="per_grouped_channel", group_size=GROUP)
    flats = [narrow.reshape(-1, GROUP * 32), wide.reshape(-1, GROUP * 96)]
    (lut_n, idx_n), (lut_w, idx_w) = store.tensor_palettes(flats, compression.nbits, ["model.narrow", "model.wide"], [narrow.shape, wide.shape])
    assert asked == [["model.narrow"]]
    weighted = {name: kmeans_1d(flat, 3, importance=importance.rows(name, shape, flat)) for name, flat, shape in
                zip(["model.narrow", "model.wide"], flats, [narrow.shape, wide.shape])}
    np.testing.assert_array_equal(lut_n, weighted["model.narrow"][0])  # the palettes are the weighted k-means'
    np.testing.assert_array_equal(idx_w, weighted["model.wide"][1])  # beyond the budget: nearest entries
    expected = compensated_indices(narrow, lut_n.astype(np.float16).astype(np.float32), GROUP, grams["model.narrow"])
    np.testing.assert_array_equal(idx_n.reshape(narrow.shape), expected)
    assert not np.array_equal(idx_n, weighted["model.narrow"][1])
    # read back from the files, without measuring again
    again = PaletteStore(FolderPalettes(tmp_path), ChannelImportance(energies, measure, gram_budget=4 * 32 * 32))
    reread = again.tensor_palettes(flats, 3, ["model.narrow", "model.wide"], [narrow.shape, wide.shape])
    np.testing.assert_array_equal(reread[0][1], idx_n)
    assert asked == [["model.narrow"]]


def _dequantized(data, scale, shape):
    return data.astype(np.float64) * np.repeat(scale.astype(np.float64).reshape(shape[0], -1), shape[1] // (scale.size // shape[0]), axis=1)


@pytest.mark.parametrize("granularity", ["per_block", "per_channel"])
def test_compensated_integers_keep_coremltools_scales_and_lower_the_output_error(granularity):
    """``quantize.quantized`` without a Gram is coremltools' own quantization; with one, the
    scales are the same, the integers stay within +-7, and the output error on held-out inputs
    falls."""
    from coremltools.optimize._utils import compute_qparams

    from adapterpack.compress.quantize import block_sizes, quantized

    weight, _, _, seen, held_out = _layer(4, in_features=128)
    setting = Compression(method="linear", nbits=4, granularity=granularity)
    data, scale = quantized(weight, setting)
    expected = compute_qparams(weight, 4, True, "LINEAR_SYMMETRIC", None, block_sizes(weight.shape, setting))
    np.testing.assert_array_equal(data, expected[0].astype(np.int8))
    np.testing.assert_array_equal(scale, expected[1])
    compensated, same_scale = quantized(weight, setting, gram=seen.T @ seen / len(seen))
    np.testing.assert_array_equal(same_scale, scale)
    assert compensated.dtype == np.int8 and int(np.abs(compensated).max()) <= 7
    assert not np.array_equal(compensated, data)

    def output_error(ints) -> float:
        return float((((weight.astype(np.float64) - _dequantized(ints, scale, weight.shape)) @ held_out.T) ** 2).mean())

    assert output_error(compensated) < 0.85 * output_error(data)


def test_signed_integers_pack_as_coremltools_writes_them():
    """int4 two per byte, low nibble first, two's complement (``mil.Program`` blobs)."""
    from adapterpack.compress.quantize import pack_signed

    values = np.array([-7, 7, -1, 0, 3, -8, 5], dtype=np.int8)
    packed = pack_signed(values, 4)
    assert packed.tolist() == [0x79, 0x0F, 0x83, 0x05]
    np.testing.assert_array_equal(pack_signed(values, 8).view(np.int8), values)


def test_compensated_integers_are_kept_in_the_store_files(tmp_path):
    """The store's files hold compensated integers by content: read back, the Gram is not
    measured again; a weight whose layer has no Gram is quantized as coremltools does."""
    from adapterpack.assemble.cache import FolderPalettes
    from adapterpack.compress.quantize import quantized, stored_quantized

    weight, _, _, seen, _ = _layer(5, in_features=64)
    asked = []

    def measure(modules):
        asked.append(list(modules))
        return {"model.layer": seen.T @ seen / len(seen)}

    energies = {"model.layer": (seen**2).mean(axis=0)}
    setting = Compression(method="linear", nbits=4)
    first = stored_quantized(weight, setting, "model.layer", PaletteStore(FolderPalettes(tmp_path), ChannelImportance(energies, measure)))
    np.testing.assert_array_equal(first[0], quantized(weight, setting, gram=seen.T @ seen / len(seen))[0])
    again = stored_quantized(weight, setting, "model.layer", PaletteStore(FolderPalettes(tmp_path), ChannelImportance(energies, measure)))
    np.testing.assert_array_equal(again[0], first[0])
    assert len(asked) == 1
    plain = stored_quantized(weight, setting, "model.other", PaletteStore(FolderPalettes(tmp_path), ChannelImportance(energies, measure)))
    np.testing.assert_array_equal(plain[0], quantized(weight, setting)[0])
    eight = stored_quantized(weight, Compression(method="linear", nbits=8), "model.layer", PaletteStore(None, ChannelImportance(energies, measure)))
    np.testing.assert_array_equal(eight[0], quantized(weight, Compression(method="linear", nbits=8))[0])


def test_a_gram_is_factored_once_for_every_weight_and_function_that_reads_it(monkeypatch):
    """q/k/v (fed one input) and every function's fused q share one measured Gram: its factor is
    computed once, gives the indices the Gram itself gives, bit for bit, and the Gram's matrix is
    released once it is factored."""
    import adapterpack.compress.compensation as compensation

    weight, luts, _, seen, _ = _layer(8)
    gram = seen.T @ seen / len(seen)
    energies = {f"model.layers.0.self_attn.{p}_proj": (seen**2).mean(axis=0) for p in "qkv"}
    importance = ChannelImportance(energies, lambda modules: dict.fromkeys(modules, gram))
    made = []
    original = compensation.GramFactor.__init__

    def counted(self, matrix):
        made.append(matrix)
        original(self, matrix)

    monkeypatch.setattr(compensation.GramFactor, "__init__", counted)
    factors = {importance.factor(f"model.layers.0.self_attn.{p}_proj") for p in "qkvqkv"}
    assert len(factors) == 1 and len(made) == 1 and made[0] is gram
    assert importance.gram("model.layers.0.self_attn.k_proj") is None  # released
    (factor,) = factors
    np.testing.assert_array_equal(compensated_indices(weight, luts, GROUP, factor), compensated_indices(weight, luts, GROUP, gram))
    columns = weight.shape[1] // 32
    levels = np.broadcast_to(np.linspace(-0.2, 0.2, 15), (weight.shape[0], columns, 15)).astype(np.float32)
    np.testing.assert_array_equal(
        compensated_indices(weight, levels, 1, factor, block_columns=32), compensated_indices(weight, levels, 1, gram, block_columns=32)
    )
