"""Palettization and linear quantization written record by record (formats.mlpackage.program) against
coremltools' own ``palettize_weights`` and ``linear_quantize_weights`` on the same converted
programs: the weight blob must be byte-identical,
and the program the same graph (coremltools renames and reorders a few ops of its own when it
reloads a program, so the graph is compared by content, not by names or order)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.records import ProgressLines, progress_text
from adapterpack.compress.palettes import PaletteStore
from adapterpack.config.compression import Compression, weight_setting
from adapterpack.formats.mlpackage.program import compress_program, pack_indices
from adapterpack.formats.mlpackage.spec import load_spec_file, spec_path, walk_ops
from adapterpack.formats.mlpackage.weight_patch import WEIGHTS
from adapterpack.formats.mlpackage.weights import compress_model, compress_package
from adapterpack.quiet import captured_output, import_coremltools

SETTINGS = {
    "4-bit grouped": dict(nbits=4, granularity="per_grouped_channel", group_size=16, keep_float16=[]),
    "6-bit grouped, embeddings kept": dict(nbits=6, granularity="per_grouped_channel", group_size=16),
    "8-bit grouped by 4": dict(nbits=8, granularity="per_grouped_channel", group_size=4, keep_float16=["mlp"]),
    "4-bit per tensor": dict(nbits=4, granularity="per_tensor", keep_float16=[]),
    "4-bit with per-layer exceptions": dict(
        nbits=4, granularity="per_grouped_channel", group_size=16, keep_float16=[],
        layers={"layers.0.mlp": {"nbits": 8}, "layers.1.self_attn.q_proj": {"group_size": 4}, "o_proj": {"method": "none"}},
    ),
    "linear int4 per block of 32": dict(method="linear", nbits=4, granularity="per_block", block_size=32, keep_float16=[]),
    "linear int8 per channel, embeddings kept": dict(method="linear", nbits=8, granularity="per_channel"),
    "linear int4 with per-layer exceptions": dict(
        method="linear", nbits=4, keep_float16=[],
        layers={"layers.0.mlp": {"nbits": 8}, "layers.1.self_attn.q_proj": {"block_size": 64}, "o_proj": {"method": "none"}},
    ),
}


def graph(package: Path) -> tuple[Counter, list[list[str]], bytes]:
    """The program as content: each op's hash over its type, attributes (its name left out) and
    the hashes of what feeds it; the functions' outputs; and the rest of the spec."""
    spec = load_spec_file(spec_path(package))
    ops: Counter = Counter()
    outputs = []
    for function in spec.mlProgram.functions.values():
        values = {argument.name: f"input {argument.name}" for argument in function.inputs}
        for block in function.block_specializations.values():
            for op in walk_ops(block):
                content = type(op)()
                content.CopyFrom(op)
                content.attributes.pop("name", None)
                for argument in content.inputs.values():
                    for binding in argument.arguments:
                        if binding.WhichOneof("binding") == "name":
                            binding.name = values[binding.name]
                for output in content.outputs:
                    output.name = ""
                digest = hashlib.sha256(content.SerializeToString(deterministic=True)).hexdigest()
                for index, output in enumerate(op.outputs):
                    values[output.name] = f"{digest}:{index}"
                ops[digest] += 1
            outputs.append([values[name] for name in block.outputs])
    spec.mlProgram.ClearField("functions")
    return ops, outputs, spec.SerializeToString(deterministic=True)


def coremltools_palettized(source: Path, target: Path, compression: Compression) -> None:
    ct = import_coremltools()
    with captured_output():
        model = ct.models.MLModel(str(source), skip_model_load=True)
    model = compress_model(model, compression, palettes=PaletteStore())
    with captured_output():
        model.save(str(target))


def setting_of(compression: Compression):
    return lambda name, shape: weight_setting(name, shape, compression)


@pytest.fixture(scope="module")
def programs(family_build) -> dict[str, Path]:
    """The converted (uncompressed) programs of one family's build: the base, from the build
    cache's templates, and the keep-mode function (LoRA matrices in the graph)."""
    family, root, result = family_build
    cache = root / ".adapterpack-cache"
    (template,) = (cache / "bases").glob("*/base.mlpackage")
    kept_part = next(
        entry / "part.mlpackage" for entry in (cache / "parts").iterdir()
        if json.loads((entry / "entry.json").read_text())["about"]["lora"] == "keep"
    )
    return {"base": template, "kept": kept_part}


# Every setting on Llama's programs; the other families run one per method, each with per-layer
# exceptions (their programs differ in which weights exist: grouped-query shapes, biases, q/k and
# Gemma's norms, a tied vocabulary; the writer treats a weight the same whatever its family).
@pytest.mark.other_families("setting", ("4-bit with per-layer exceptions", "linear int4 with per-layer exceptions"))
@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("program", ["base", "kept"])
def test_streamed_compression_equals_coremltools(programs, tmp_path, setting, program):
    compression = Compression(**{"method": "palettize", **SETTINGS[setting]})
    source = programs[program]
    coremltools_palettized(source, tmp_path / "coremltools.mlpackage", compression)
    written = []
    assert compress_program(
        source, tmp_path / "streamed.mlpackage", compression, PaletteStore(), setting_of=setting_of(compression),
        progress=lambda done, total: written.append((done, total)),
    )
    expected = (tmp_path / "coremltools.mlpackage" / WEIGHTS).read_bytes()
    assert (tmp_path / "streamed.mlpackage" / WEIGHTS).read_bytes() == expected
    assert graph(tmp_path / "streamed.mlpackage") == graph(tmp_path / "coremltools.mlpackage")
    # progress counts up to every palettized value
    assert written and written[-1][0] == written[-1][1] and [d for d, _ in written] == sorted(d for d, _ in written)
    # and something was compressed at all (the comparison would otherwise be of two copies)
    op_type = b"constexpr_blockwise_shift_scale" if compression.method == "linear" else b"constexpr_lut_to_dense"
    assert op_type in spec_path(tmp_path / "streamed.mlpackage").read_bytes()


def test_per_layer_exceptions_take_effect(programs, tmp_path):
    """Exceptions change exactly the weights they name: more bits cost more bytes, float16 leaves
    the weight a plain constant, and the rest are as without exceptions."""
    plain = Compression(method="palettize", **SETTINGS["4-bit grouped"])
    excepted = Compression(method="palettize", **SETTINGS["4-bit with per-layer exceptions"])
    sizes = {}
    for label, compression in (("plain", plain), ("excepted", excepted)):
        target = tmp_path / f"{label}.mlpackage"
        assert compress_program(programs["base"], target, compression, PaletteStore(), setting_of=setting_of(compression))
        sizes[label] = (target / WEIGHTS).stat().st_size
        spec = load_spec_file(spec_path(target))
        ops = {op.outputs[0].name: op for f in spec.mlProgram.functions.values() for b in f.block_specializations.values() for op in walk_ops(b) if op.outputs}
        palettized = {name for name, op in ops.items() if op.type == "constexpr_lut_to_dense"}
        o_proj = {name for name in palettized if "o_proj" in name}
        mlp0 = {name for name in palettized if "layers_0_mlp" in name}
        assert mlp0, "the first layer's MLP is palettized in both"
        if label == "excepted":
            assert not o_proj
            for name in mlp0:
                assert ops[name].inputs["lut"].arguments[0].value.type.tensorType.dimensions[-2].constant.size == 256
        else:
            assert o_proj
    assert sizes["excepted"] > sizes["plain"]


def test_graph_comparison_notices_a_changed_op(programs, tmp_path):
    """The graph comparison the test above relies on can fail."""
    compression = Compression(method="palettize", **SETTINGS["4-bit grouped"])
    compress_program(programs["base"], tmp_path / "a.mlpackage", compression, PaletteStore(), setting_of=setting_of(compression))
    spec = load_spec_file(spec_path(tmp_path / "a.mlpackage"))
    function = next(iter(spec.mlProgram.functions.values()))
    block = next(iter(function.block_specializations.values()))
    multiply = next(op for op in block.operations if op.type == "mul")
    multiply.type = "add"
    spec_path(tmp_path / "a.mlpackage").write_bytes(spec.SerializeToString())
    compress_program(programs["base"], tmp_path / "b.mlpackage", compression, PaletteStore(), setting_of=setting_of(compression))
    assert graph(tmp_path / "a.mlpackage") != graph(tmp_path / "b.mlpackage")


def test_layouts_it_does_not_write_go_to_coremltools(programs, tmp_path):
    """A 2-bit per-tensor palette (4 values) is stored inline by coremltools, not in the blob:
    the streamed writer declines and compress_package takes coremltools' way."""
    compression = Compression(method="palettize", nbits=2, granularity="per_tensor", keep_float16=[])
    assert not compress_program(programs["base"], tmp_path / "s.mlpackage", compression, PaletteStore(), setting_of=setting_of(compression))
    assert not (tmp_path / "s.mlpackage").exists()
    compress_package(programs["base"], tmp_path / "p.mlpackage", compression)
    coremltools_palettized(programs["base"], tmp_path / "c.mlpackage", compression)
    assert (tmp_path / "p.mlpackage" / WEIGHTS).read_bytes() == (tmp_path / "c.mlpackage" / WEIGHTS).read_bytes()


@pytest.mark.parametrize("nbits", [1, 2, 3, 4, 6, 8])
def test_index_packing_matches_coremltools(nbits):
    from coremltools.optimize._utils import pack_elements_into_bits

    indices = np.random.default_rng(nbits).integers(0, 1 << nbits, size=1001, dtype=np.uint8)
    np.testing.assert_array_equal(pack_indices(indices, nbits), pack_elements_into_bits(indices, nbits))


@pytest.mark.parametrize("nbits", [1, 2, 4, 8])
def test_packed_values_unpack_to_themselves(nbits):
    """The palette and integer caches keep indices and integers packed, as the blob does."""
    from adapterpack.compress.palettes import pack_bits, unpack_bits
    from adapterpack.compress.quantize import pack_signed, unpack_signed

    values = np.random.default_rng(nbits).integers(0, 1 << nbits, size=1001, dtype=np.uint8)
    packed = pack_bits(values, nbits)
    assert packed.size == -(-1001 * nbits // 8)
    np.testing.assert_array_equal(unpack_bits(packed, nbits, 1001), values)
    if nbits in (4, 8):
        signed = np.random.default_rng(nbits).integers(-(1 << (nbits - 1)) + 1, 1 << (nbits - 1), size=1001).astype(np.int8)
        np.testing.assert_array_equal(unpack_signed(pack_signed(signed, nbits), nbits, 1001), signed)


def test_progress_lines_report_rate_and_time_left():
    lines = []
    update = ProgressLines("base: compress", "weights", lines.append, every=0.0)
    update(0, 100)
    update(50, 100)
    assert len(lines) == 2 and lines[-1].startswith("base: compress: 50 / 100 weights (50%)")
    assert "s left" in lines[-1]
    assert progress_text(3_200_000_000, 3_200_000_000, 100.0, "weights") == "3.2G / 3.2G weights (100%), 32.0M/s"
    quiet = []
    slow = ProgressLines("x", "weights", quiet.append, every=3600.0)
    slow(1, 2)
    assert quiet == []
