"""Fused weights from the targeted tensors alone equal peft's merge into the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from adapterpack.assemble.pipeline import build
from adapterpack.convert.lora import fused_weight_changes
from adapterpack.inputs.adapter import inspect_adapter
from adapterpack.inputs.base import resolve_base
from factories import make_adapter, make_base

SETTINGS = {
    "rslora-patterns": dict(targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True,
                            rank_pattern={"v_proj": 8}, alpha_pattern={"o_proj": 32}),
    "dora": dict(targets=("q_proj", "v_proj", "down_proj"), use_dora=True),
    "embedding": dict(targets=("embed_tokens", "q_proj")),
    "lora-bias": dict(targets=("q_proj", "v_proj"), lora_bias=True),  # on a Qwen2 base: q/k/v have biases
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    # Mistral: untied embeddings, so an embedding adapter changes one tensor
    return make_base(tmp_path_factory.mktemp("fuse") / "base", "mistral")


@pytest.fixture(scope="module")
def biased_base(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("fuse-qwen2") / "base", "qwen2")


def peft_merged(base_folder: Path, adapter: Path, scale: float) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if adapter is None:
        return {name: parameter.detach() for name, parameter in model.named_parameters()}
    model = PeftModel.from_pretrained(model, str(adapter))
    if scale != 1.0:
        from peft.tuners.lora import LoraLayer

        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.scale_layer(scale)
    return {name: parameter.detach() for name, parameter in model.merge_and_unload().named_parameters()}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_fused_weights_equal_peft_merge_of_the_whole_model(base, biased_base, tmp_path, setting):
    if setting == "lora-bias":
        base = biased_base
    make_adapter(tmp_path / "a", base, std=0.1, seed=5, **SETTINGS[setting])
    # peft starts LoRA biases and embedding A at zero: make them matter
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "a" / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(3)
    save_file(
        {
            k: v + 0.1 * torch.randn(v.shape, generator=generator) if "lora_embedding" in k or k.endswith("lora_B.bias") else v
            for k, v in load_file(weights).items()
        },
        weights,
    )
    info = inspect_adapter(tmp_path / "a", resolve_base(str(base), None, base.parent))
    changes = fused_weight_changes(resolve_base(str(base), None, base.parent), info, scale=0.8)
    reference = peft_merged(base, tmp_path / "a", 0.8)
    original = {name: value for name, value in peft_merged(base, None, 1.0).items()}
    changed = {name for name, value in reference.items() if not torch.equal(value, original[name])}
    assert changes is not None
    assert set(changes) == changed and {f"{m}.weight" for m in info.target_modules} <= changed
    if setting == "lora-bias":
        assert any(name.endswith(".bias") for name in changes)
    for tensor, (old, new) in changes.items():
        expected = reference[tensor].to(torch.float16)
        assert new.dtype == torch.float16 and new.shape == expected.shape
        # rounded once from float32, as merging in float32 and converting would
        torch.testing.assert_close(new, expected, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(old, original[tensor].to(torch.float16), rtol=0, atol=0)


def test_modules_to_save_is_left_to_the_whole_model(base, tmp_path):
    make_adapter(tmp_path / "a", base, std=0.1, modules_to_save=["lm_head"])
    info = inspect_adapter(tmp_path / "a", resolve_base(str(base), None, base.parent))
    assert fused_weight_changes(resolve_base(str(base), None, base.parent), info, scale=1.0) is None


@pytest.mark.slow
def test_modules_to_save_adapter_builds_and_verifies(base, tmp_path):
    """An adapter that replaces lm_head as well as adding LoRA: the fused function must carry
    the new lm_head (verify compares against peft's model with the adapter loaded)."""
    from safetensors.torch import load_file, save_file

    make_adapter(tmp_path / "saved", base, std=0.1, modules_to_save=["lm_head"])
    weights = tmp_path / "saved" / "adapter_model.safetensors"
    tensors = load_file(weights)
    changed = {k: (v * -1.5 if "lora_" not in k else v) for k, v in tensors.items()}
    assert any("lm_head" in k for k in changed)
    save_file(changed, weights)
    (tmp_path / "m.yaml").write_text(
        f"name: saved\nbase: {{path: {base}}}\nadapters:\n  - {{name: saved, path: saved}}\n"
        "export: {max_context: 16}\ncompression: {method: palettize}\nverify: {prefill: 6, decode_steps: 4}\n"
    )
    result = build(tmp_path / "m.yaml", output=tmp_path / "out.mlpackage")
    assert result.verify_report.passed
