"""One rule decides which weights are compressed (``config.compression.weight_setting``): the
Core ML writer (through coremltools), the Core AI writer and the memory estimate agree on it,
down to the size threshold where they once disagreed (a weight of exactly 2048 values)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from adapterpack.config.compression import WEIGHT_THRESHOLD, Compression, compressed_bytes, weight_setting
from adapterpack.config.devices import estimated_weight_bytes

# name -> shape: at the threshold, past it, past it but not tiled by channel groups, 1-D past it, kept by name, a rope table,
# LoRA matrices (keep mode).
SHAPES = {
    "at_threshold": (32, 64),
    "past_threshold": (48, 64),
    "untiled": (40, 64),  # 16-row channel groups do not tile 40 rows
    "one_d": (4096,),
    "embed_tokens": (64, 64),
    "rope_cos": (64, 64),
    "q_proj_lora_A": (8, 512),
    "q_proj_lora_B": (512, 8),
}
assert math.prod(SHAPES["at_threshold"]) == WEIGHT_THRESHOLD


@pytest.mark.parametrize("lora", [None, Compression(method="linear", nbits=8, granularity="per_channel")], ids=["lora float16", "lora int8"])
def test_the_rule(lora):
    palettize = Compression(method="palettize", nbits=4)
    chosen = {name: weight_setting(name, shape, palettize, lora) for name, shape in SHAPES.items()}
    assert chosen["past_threshold"] == palettize
    assert {chosen[n] for n in ("at_threshold", "untiled", "one_d", "embed_tokens", "rope_cos")} == {None}
    assert chosen["q_proj_lora_A"] == chosen["q_proj_lora_B"] == lora
    # "none" has one form: no setting.
    assert all(weight_setting(n, s, Compression(method="none"), None) is None for n, s in SHAPES.items())


def test_the_estimate_counts_what_the_rule_compresses():
    palettize = Compression(method="palettize", nbits=4)
    tensors = {f"model.{name}.weight": SimpleNamespace(shape=shape) for name, shape in SHAPES.items() if "lora" not in name}
    lora = {f"model.{name}.weight": SimpleNamespace(shape=shape) for name, shape in SHAPES.items() if "lora" in name}
    int8 = Compression(method="linear", nbits=8, granularity="per_channel")
    got = estimated_weight_bytes(tensors, palettize, lora, int8)
    # at the threshold: float16 (once counted palettized); past it: 4 bits and a palette per 16 rows.
    expected = 2 * 2048 + (48 * 64 // 2 + 3 * 16 * 2) + 2 * 40 * 64 + 2 * 4096 + 2 * 64 * 64 * 2
    expected += sum(compressed_bytes(s, int8) for n, s in SHAPES.items() if "lora" in n)
    assert got == expected
    assert estimated_weight_bytes(tensors, palettize, lora) == expected - sum(
        compressed_bytes(s, int8) - 2 * math.prod(s) for n, s in SHAPES.items() if "lora" in n
    )


def test_the_core_ai_writer_replaces_what_the_rule_compresses():
    import torch

    from adapterpack.formats.aimodel.weights import CoreAIWeights

    model = torch.nn.Module()
    for name, shape in SHAPES.items():
        if len(shape) == 2:
            layer = torch.nn.Embedding(*shape) if name == "embed_tokens" else torch.nn.Linear(shape[1], shape[0], bias=False)
            model.add_module(name, layer.half())
    palettize = Compression(method="palettize", nbits=4)
    int8 = Compression(method="linear", nbits=8, granularity="per_channel")
    replaced = CoreAIWeights().replacements(model, palettize, int8)
    expected = {n for n, m in model.named_modules() if n and weight_setting(n, tuple(m.weight.shape), palettize, int8)}
    assert set(replaced) == expected == {"past_threshold", "q_proj_lora_A", "q_proj_lora_B"}


def test_the_core_ml_writer_compresses_what_the_rule_compresses():
    """A program whose constants have the shapes above, palettized by ``compress_model``: the
    constants coremltools turned into lookup tables are the ones the rule names."""
    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.formats.mlpackage.weights import compress_model
    from adapterpack.quiet import captured_output, import_coremltools

    ct = import_coremltools()
    from coremltools.converters.mil import Builder as mb

    two_d = {n: s for n, s in SHAPES.items() if len(s) == 2 and "lora" not in n}
    rng = np.random.default_rng(0)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=ct.converters.mil.mil.types.fp16)],
                opset_version=ct.target.iOS18)
    def program(x):
        outputs = []
        for name, shape in two_d.items():
            weight = mb.const(val=rng.standard_normal(shape).astype(np.float16), name=f"{name}_weight")
            outputs.append(mb.reduce_sum(x=mb.matmul(x=weight, y=mb.transpose(x=x, perm=[1, 0])), name=f"{name}_sum"))
        return mb.concat(values=outputs, axis=0, name="out")

    with captured_output():
        mlmodel = ct.convert(program, minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
    palettize = Compression(method="palettize", nbits=4)

    def palettized_names(model) -> set[str]:
        ops = model._mil_program.functions["main"].operations
        return {op.outputs[0].name.removesuffix("_palettized") for op in ops if op.op_type.startswith("constexpr_lut")}

    expected = {f"{n}_weight" for n, s in two_d.items() if weight_setting(f"{n}_weight", s, palettize) is not None}
    assert expected == {"past_threshold_weight"}
    assert palettized_names(compress_model(mlmodel, palettize, palettes=PaletteStore())) == expected
    # coremltools' own choice, without the exclusions the rule hands it: the same weights, but the
    # ones kept by name.
    from coremltools.optimize import coreml as cto

    own = cto.OpPalettizerConfig(mode="uniform", nbits=4, granularity="per_grouped_channel", group_size=16, weight_threshold=WEIGHT_THRESHOLD)
    with captured_output():
        raw = cto.palettize_weights(mlmodel, config=cto.OptimizationConfig(global_config=own))
    assert palettized_names(raw) - {"embed_tokens_weight", "rope_cos_weight"} == expected
