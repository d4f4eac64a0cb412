"""Patching fused weights into a converted or compressed base: exact where it can be, refused where it cannot."""

from __future__ import annotations

import numpy as np
import pytest

from adapterpack.formats.mlpackage.weight_patch import WEIGHTS, TensorChange, patch_weights


def two_layer_program(path, w1, w2, compression=None, palettes=None):
    """Save a two-linear program with these float16 weights (compressed as ``compression`` says)."""
    from adapterpack.formats.mlpackage.weights import compress_model
    from adapterpack.quiet import captured_output, import_coremltools

    ct = import_coremltools()
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=ct.converters.mil.mil.types.fp16)],
                opset_version=ct.target.iOS18)
    def program(x):
        return mb.linear(x=mb.linear(x=x, weight=w1), weight=w2)

    with captured_output():
        model = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                           skip_model_load=True)
    if compression is not None:
        model = compress_model(model, compression, palettes=palettes)
    with captured_output():
        model.save(str(path))
    return path


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A converted two-layer program whose float16 weights we know."""
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 64)).astype(np.float16)
    w2 = rng.standard_normal((64, 64)).astype(np.float16)
    return two_layer_program(tmp_path_factory.mktemp("tpl") / "t.mlpackage", w1, w2), w1, w2


def run(path, x):
    from adapterpack.formats.mlpackage.executor import ProgramExecutor

    executor = ProgramExecutor.load(path)
    return next(iter(executor.predict({"x": x}).values()))


def run_function(path, function, x):
    from adapterpack.formats.mlpackage.executor import ProgramExecutor

    executor = ProgramExecutor.load(path, functions=[function])
    return next(iter(executor.predict({"x": x}, function=function).values()))


def test_patched_copy_computes_with_the_new_weight(template, tmp_path):
    path, w1, w2 = template
    new = (w2.astype(np.float32) * -0.5).astype(np.float16)
    assert patch_weights(path, tmp_path / "p.mlpackage", [TensorChange.float16(w2, new)])
    x = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float16)
    expected = (x.astype(np.float32) @ w1.T.astype(np.float32)).astype(np.float16).astype(np.float32) @ new.T.astype(np.float32)
    got = run(tmp_path / "p.mlpackage", x).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=5e-2)
    # the template itself is untouched
    original = run(path, x).astype(np.float32)
    assert not np.allclose(original, got)


def test_patched_package_shares_the_base_blob_and_holds_only_the_new_records(template, tmp_path):
    """A fused part costs its changed records on disk, not a copy of the base: the base's blob
    is linked (left as it was), the replacing records are a blob of their own, and the merge
    writes one blob whose function is the patched one."""
    from adapterpack.formats.mlpackage.digest import function_digests
    from adapterpack.formats.mlpackage.merge import merge_functions
    from adapterpack.formats.mlpackage.weight_patch import unread_bytes

    path, w1, w2 = template
    before = (path / WEIGHTS).read_bytes()
    new = (w2.astype(np.float32) + 0.25).astype(np.float16)
    patched = tmp_path / "p.mlpackage"
    assert patch_weights(path, patched, [TensorChange.float16(w2, new)])
    assert (patched / WEIGHTS).stat().st_ino == (path / WEIGHTS).stat().st_ino
    assert (path / WEIGHTS).read_bytes() == before
    own = sorted(p.name for p in (patched / WEIGHTS).parent.iterdir())
    assert own == ["patched-1.bin", "weight.bin"]
    assert (patched / WEIGHTS).parent.joinpath("patched-1.bin").stat().st_size == 64 + 64 + new.nbytes
    # the record it replaced is the one the linked blob holds unread (a part's own size leaves it out)
    assert unread_bytes(path) == 0 and unread_bytes(patched) == 64 + w2.nbytes
    # patching a patched package adds a second blob and still shares the first two
    newer = (w1.astype(np.float32) * 2).astype(np.float16)
    twice = tmp_path / "twice.mlpackage"
    assert patch_weights(patched, twice, [TensorChange.float16(w1, newer)])
    assert sorted(p.name for p in (twice / WEIGHTS).parent.iterdir()) == ["patched-1.bin", "patched-2.bin", "weight.bin"]
    x = np.random.default_rng(2).standard_normal((1, 64)).astype(np.float16)
    hidden = (x.astype(np.float32) @ newer.T.astype(np.float32)).astype(np.float16).astype(np.float32)
    np.testing.assert_allclose(run(twice, x).astype(np.float32), hidden @ new.T.astype(np.float32), rtol=2e-2, atol=5e-2)
    # merged: one blob, the patched function's digest as in the part, the base's unchanged
    merged = tmp_path / "merged.mlpackage"
    digests = merge_functions({"base": path, "fused": twice}, default_function="base", destination=merged, metadata={}, description="")
    assert sorted(p.name for p in (merged / WEIGHTS).parent.iterdir()) == ["weight.bin"]
    assert digests == {"base": function_digests(path)["main"], "fused": function_digests(twice)["main"]}
    assert digests["base"] != digests["fused"]
    np.testing.assert_array_equal(run_function(merged, "fused", x), run(twice, x))


def test_unknown_weight_is_refused_and_leaves_nothing(template, tmp_path):
    path, _, _ = template
    stranger = np.ones((64, 64), np.float16)
    assert not patch_weights(path, tmp_path / "p.mlpackage", [TensorChange.float16(stranger, stranger * 2)])
    assert not (tmp_path / "p.mlpackage").exists()


def test_shape_or_dtype_change_is_refused(template, tmp_path):
    path, w1, _ = template
    with pytest.raises(TypeError):
        TensorChange.float16(w1, w1.astype(np.float32))
    assert not patch_weights(path, tmp_path / "q.mlpackage", [TensorChange.float16(w1, w1[:32])])
    assert not (tmp_path / "q.mlpackage").exists()


@pytest.mark.parametrize(
    "settings",
    [
        dict(method="palettize", nbits=4, granularity="per_grouped_channel", group_size=16),
        dict(method="palettize", nbits=6, granularity="per_tensor"),
        # the changed weight is excluded from compression: found and patched as float16
        dict(method="palettize", nbits=4, granularity="per_grouped_channel", group_size=16, keep_float16=["linear_1"]),
        dict(method="linear", nbits=4, granularity="per_block", block_size=32),
        dict(method="linear", nbits=8, granularity="per_channel"),
    ],
    ids=["4bit-grouped", "6bit-tensor", "kept-float16", "int4-block", "int8-channel"],
)
def test_patching_a_compressed_base_equals_compressing_the_changed_model(template, tmp_path, settings):
    """The fast path of a fused function: patch compressed records into the compressed base.
    It must give byte for byte what compressing the model with the new weight gives."""
    from adapterpack.assemble.cache import FolderPalettes
    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.config.compression import Compression
    from adapterpack.formats.mlpackage.digest import function_digests
    from adapterpack.formats.mlpackage.weights import compressed_records

    _, w1, w2 = template
    compression = Compression(**settings)
    new = (w2.astype(np.float32) * 0.9 + 0.05).astype(np.float16)
    store = PaletteStore(FolderPalettes(tmp_path / "palettes"))
    base = two_layer_program(tmp_path / "base.mlpackage", w1, w2, compression, store)
    expected = two_layer_program(tmp_path / "expected.mlpackage", w1, new, compression, store)
    before, after = compressed_records([w2, new], [compression, compression], store)
    change = TensorChange.float16(w2, new)
    change.encodings.insert(0, [(d, b, a) for (d, b), (_, a) in zip(before, after)])
    assert patch_weights(base, tmp_path / "patched.mlpackage", [change])
    # the same program over records of the same bytes (the digest names records by content)
    patched = function_digests(tmp_path / "patched.mlpackage")
    assert patched == function_digests(expected)
    assert patched != function_digests(base)


def test_compressed_records_decode_to_the_palettized_weight():
    """The records are what constexpr_lut_to_dense reads: packed indices (LSB first) and a palette."""
    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.config.compression import Compression
    from adapterpack.formats.mlpackage.weights import compressed_records

    weight = np.random.default_rng(3).standard_normal((32, 48)).astype(np.float16)
    [[(index_dtype, packed), (lut_dtype, lut)]] = compressed_records(
        [weight], [Compression(method="palettize", nbits=4, granularity="per_grouped_channel", group_size=8)], PaletteStore()
    )
    assert (index_dtype, lut_dtype) == ("uint4", "float16")
    packed = np.frombuffer(packed, np.uint8)
    indices = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(32, 48)
    palettes = np.frombuffer(lut, np.float16).reshape(4, 16)
    dense = np.take_along_axis(palettes.repeat(8, axis=0), indices.astype(np.int64), axis=1)
    from adapterpack.compress.kmeans import kmeans_1d

    luts, labels = kmeans_1d(weight.reshape(4, -1), 4)
    reference = np.take_along_axis(luts.astype(np.float16), labels.astype(np.int64), axis=1).reshape(32, 48)
    np.testing.assert_array_equal(dense, reference)
    assert np.abs(dense.astype(np.float32) - weight).mean() < 0.1
    assert len(np.unique(dense)) > 16  # one palette per group of 8 rows, not one for all
