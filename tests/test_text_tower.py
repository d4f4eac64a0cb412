"""A multimodal Gemma 3 checkpoint (``model_type: gemma3``, Gemma 3 4B and up) packaged as its text
tower: the base and its adapters read as the ``gemma3_text`` model they hold, against
transformers' own ``Gemma3ForConditionalGeneration`` with the adapter peft applies to it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adapterpack.errors import BadInput
from adapterpack.inputs.checked import check_inputs
from adapterpack.inputs.safetensors import read_safetensors_header
from factories import make_adapter, tiny_config

# A SigLIP encoder at toy size: 28-pixel images in 14-pixel patches, four image tokens.
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=14)


def make_multimodal_base(folder: Path, seed: int = 0, **text_overrides) -> Path:
    """A random ``Gemma3ForConditionalGeneration`` whose language model is the toy Gemma 3 of
    ``factories.tiny_config`` (sliding and global layers, (1 + w) gains made to matter), saved as
    transformers 5 saves it (``model.language_model.*`` beside ``model.vision_tower.*``)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    text = tiny_config("gemma3_text", **text_overrides).to_dict()
    config = Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                          boi_token_index=90, eoi_token_index=91, image_token_index=92)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def with_hub_names(source: Path, folder: Path) -> Path:
    """``source`` as the hub's Gemma 3 checkpoints name their tensors (``language_model.model.*``,
    ``vision_tower.*``, ``multi_modal_projector.*``), the layout transformers converts on load."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    renamed = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        name = name.replace("model.language_model.", "language_model.model.", 1)
        renamed[name.removeprefix("model.") if name.startswith(("model.vision_tower", "model.multi_modal")) else name] = tensor
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((source / "config.json").read_text())
    return folder


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multimodal")
    base = make_multimodal_base(root / "base")
    # q and v of both towers: the vision tower's LoRA is left out of the text package
    make_adapter(root / "skill", base, targets=("q_proj", "v_proj", "down_proj"), std=0.3)
    return root


def manifest_for(root: Path, base: Path, adapter: Path, name: str = "m.yaml", extra: str = "") -> Path:
    path = root / name
    path.write_text(f"name: tower\nbase: {{path: {base}}}\nadapters:\n  - {{name: skill, path: {adapter}}}\n"
                    f"export: {{max_context: 32}}\ncompression: {{method: none}}\n{extra}")
    return path


def _logits_through_peft(base_model, adapter: Path, ids: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel

    with torch.no_grad():
        return PeftModel.from_pretrained(base_model, str(adapter)).eval()(input_ids=ids).logits[0]


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_the_text_tower_computes_what_the_multimodal_model_computes(multimodal, tmp_path, layout):
    """The text tower read from either layout, with the adapter read as the tower names it,
    gives transformers' multimodal model + peft's adapter logits on text, to float32 rounding;
    the tower's language model is the whole text path (no vision tensor is carried)."""
    from transformers import Gemma3ForConditionalGeneration

    from adapterpack.convert.base_model import load_base

    base = multimodal / "base" if layout == "transformers" else with_hub_names(multimodal / "base", tmp_path / "hub")
    checked = check_inputs(manifest_for(tmp_path, base, multimodal / "skill"))
    tower, skill = checked.base, checked.adapters["skill"]
    assert tower.tower_of == base and tower.config["model_type"] == "gemma3_text"
    assert not any("vision" in name or "multi_modal" in name for name in tower.tensors)
    assert skill.origin == multimodal / "skill" and skill.folder != skill.origin
    assert all(module.startswith("model.layers.") for module in skill.target_modules)
    assert any("vision tower" in warning for warning in skill.warnings)

    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    multimodal_model = Gemma3ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        base_reference = multimodal_model(input_ids=ids).logits[0]
    reference = _logits_through_peft(multimodal_model, multimodal / "skill", ids)
    with torch.no_grad():
        tower_base = load_base(tower.folder)(input_ids=ids).logits[0]
    assert (reference - base_reference).abs().max() > 0.05  # the adapter changes the logits
    torch.testing.assert_close(tower_base, base_reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits_through_peft(load_base(tower.folder), skill.folder, ids), reference, rtol=0, atol=1e-5)


def test_a_multimodal_base_builds_and_verifies_as_its_text_tower(multimodal, tmp_path):
    """The whole pipeline on the multimodal checkpoint: the package's functions pass verify, and
    the tower (written once per content) is read back, not written again, by the next build."""
    import adapterpack as ap

    manifest = manifest_for(tmp_path, multimodal / "base", multimodal / "skill", extra="include_base: base\n")
    result = ap.build(manifest, output=tmp_path / "tower.mlpackage", options=ap.BuildOptions(use_cache=False))
    assert result.verify_report.passed
    assert sorted(f.name for f in result.verify_report.functions) == ["base", "skill"]
    tower = check_inputs(manifest).base.folder
    stamp = (tower / "model.safetensors").stat().st_mtime_ns
    report = ap.verify(tmp_path / "tower.mlpackage", manifest)
    assert report.passed and (tower / "model.safetensors").stat().st_mtime_ns == stamp


def test_an_mlx_adapter_of_the_multimodal_model_reads_as_the_text_tower_s(multimodal, tmp_path):
    """mlx-lm's ``gemma3`` model names its language model ``language_model.model.*``: the adapter
    is read as the same LoRA on the text tower's modules."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    folder = tmp_path / "mlx"
    folder.mkdir()
    tensors = {}
    for layer in (0, 1):
        tensors[f"language_model.model.layers.{layer}.self_attn.q_proj.lora_a"] = rng.normal(0, 0.1, (64, 4)).astype(np.float32)
        tensors[f"language_model.model.layers.{layer}.self_attn.q_proj.lora_b"] = rng.normal(0, 0.1, (4, 128)).astype(np.float32)
    save_file(tensors, str(folder / "adapters.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "fine_tune_type": "lora", "num_layers": 2, "model": "google/gemma-3-4b-it",
        "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}))
    info = check_inputs(manifest_for(tmp_path, multimodal / "base", folder)).adapters["skill"]
    assert info.format == "mlx"
    assert info.target_modules == ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj")
    stored = read_safetensors_header(info.folder / "adapter_model.safetensors")
    assert tuple(stored["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape) == (128, 4)


def test_a_multimodal_config_without_a_gemma_text_tower_is_refused(multimodal, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").write_bytes((multimodal / "base" / "model.safetensors").read_bytes())
    config = json.loads((multimodal / "base" / "config.json").read_text())
    config["text_config"]["model_type"] = "llama"
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=r"config\.json: text_config\.model_type is 'llama'"):
        check_inputs(manifest_for(tmp_path, base, multimodal / "skill"))


def test_an_adapter_of_the_vision_tower_alone_is_refused(multimodal, tmp_path):
    make_adapter(tmp_path / "vision", multimodal / "base", targets=("out_proj",))
    with pytest.raises(BadInput, match="adapt the vision tower, which a package does not hold"):
        check_inputs(manifest_for(tmp_path, multimodal / "base", tmp_path / "vision"))


def test_what_the_export_refuses_in_the_text_tower_names_the_checkpoint_s_config(multimodal, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").symlink_to(multimodal / "base" / "model.safetensors")
    config = json.loads((multimodal / "base" / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (base / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=rf"^{base}/config\.json: final_logit_softcapping 30\.0 is not supported"):
        check_inputs(manifest_for(tmp_path, base, multimodal / "skill"))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda c: c["text_config"].update(hidden_size="wide"), r"config\.json: transformers cannot read this config: .*hidden_size"),
        (lambda c: c.update(vision_config=5), r"config\.json: transformers cannot read this config: .*vision_config"),
        (lambda c: c["text_config"].update(vocab_size=100), r"model\.safetensors: model\.embed_tokens\.weight has shape \(96, 64\), but config\.json implies \(100, 64\)"),
    ],
    ids=["a size of the wrong type", "a vision config of the wrong type", "a vocabulary the weights do not have"],
)
def test_a_bad_multimodal_base_is_one_line_naming_its_own_file_and_nothing_is_written(multimodal, tmp_path, change, expected):
    import os

    base = tmp_path / "base"
    base.mkdir()
    (base / "model.safetensors").symlink_to(multimodal / "base" / "model.safetensors")
    config = json.loads((multimodal / "base" / "config.json").read_text())
    change(config)
    (base / "config.json").write_text(json.dumps(config))
    towers = Path(os.environ["ADAPTERPACK_CACHE_DIR"]) / "text-towers"
    before = sorted(towers.iterdir()) if towers.is_dir() else []
    with pytest.raises(BadInput, match=rf"^{base}/{expected}"):
        check_inputs(manifest_for(tmp_path, base, multimodal / "skill"))
    assert (sorted(towers.iterdir()) if towers.is_dir() else []) == before


def test_an_unwritable_cache_folder_is_one_line_naming_it(multimodal, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    monkeypatch.setenv("ADAPTERPACK_CACHE_DIR", str(cache))
    with pytest.raises(BadInput, match=rf"^{cache}.*: cannot access"):
        check_inputs(manifest_for(tmp_path, multimodal / "base", multimodal / "skill"))


def test_the_export_of_a_4b_shaped_tower_computes_what_the_multimodal_model_computes(tmp_path):
    """Gemma 3 4B's global layers scale their rope positions (linear, factor 8) and its local
    ones do not: the export's decoder over the tower, as both clients call it, against
    transformers' multimodal model on text."""
    from transformers import Gemma3ForConditionalGeneration

    from adapterpack.convert.base_model import load_base
    from test_gemma3 import _both_conventions

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    base = make_multimodal_base(tmp_path / "base", rope_parameters=rope)
    make_adapter(tmp_path / "skill", base, targets=("q_proj",))
    tower = check_inputs(manifest_for(tmp_path, base, tmp_path / "skill")).base
    assert tower.config["rope_parameters"]["full_attention"]["factor"] == 8.0
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = Gemma3ForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()(input_ids=ids).logits[0]
        unscaled = Gemma3ForConditionalGeneration.from_pretrained(
            make_multimodal_base(tmp_path / "unscaled"), dtype=torch.float32).eval()(input_ids=ids).logits[0]
        swift, apple = _both_conventions(load_base(tower.folder), ids, prefill=7)
    assert (unscaled - reference).abs().max() > 0.01  # the scaling changes the logits here
    torch.testing.assert_close(swift, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(apple, reference, rtol=0, atol=1e-5)


def test_validate_says_it_reads_the_text_tower(multimodal, tmp_path):
    from factories import run_cli

    result = run_cli("validate", str(manifest_for(tmp_path, multimodal / "base", multimodal / "skill")))
    assert result.returncode == 0, result.stderr
    assert "(gemma3_text: the text tower of a multimodal checkpoint, read from " in " ".join(result.stdout.split())
