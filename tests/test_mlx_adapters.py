"""Adapters trained with mlx-lm: checked, read as the peft adapter that computes the same, and
packaged; the package matches mlx-lm's own forward of base + adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adapterpack.errors import BadInput
from adapterpack.inputs.checked import check_inputs

REPO = Path(__file__).resolve().parents[1]
DEMO_BASE = REPO / "adapters" / "demo" / "base"


def write_mlx_adapter(folder: Path, tensors: dict[str, np.ndarray], **config) -> Path:
    """An mlx-lm adapter folder as mlx_lm.lora writes it (the config is its training arguments)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    settings = {"fine_tune_type": "lora", "num_layers": 2, "model": str(DEMO_BASE),
                "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}
    settings.update(config)
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(folder / "adapters.safetensors"))
    return folder


def q_proj_lora(layers=(2, 3), rank=4, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for layer in layers:
        out[f"model.layers.{layer}.self_attn.q_proj.lora_a"] = rng.normal(0, 0.05, (128, rank)).astype(np.float32)
        out[f"model.layers.{layer}.self_attn.q_proj.lora_b"] = rng.normal(0, 0.05, (rank, 128)).astype(np.float32)
    return out


def manifest_for(root: Path, adapters: str, extra: str = "") -> Path:
    path = root / "m.yaml"
    path.write_text(f"name: mlx\nbase: {{path: {DEMO_BASE}}}\nadapters:\n{adapters}export: {{max_context: 64}}\n"
                    f"compression: {{method: none}}\n{extra}")
    return path


def test_an_mlx_adapter_is_detected_and_read_as_peft(tmp_path):
    write_mlx_adapter(tmp_path / "skill", q_proj_lora())
    checked = check_inputs(manifest_for(tmp_path, "  - {name: skill, path: skill}\n"))
    info = checked.adapters["skill"]
    assert info.format == "mlx" and info.origin == tmp_path / "skill"
    assert info.target_modules == ("model.layers.2.self_attn.q_proj", "model.layers.3.self_attn.q_proj")
    assert info.config["lora_alpha"] == 40.0 and info.config["r"] == 4  # scaling alpha / r = mlx's scale 10
    import hashlib

    files = (tmp_path / "skill" / "adapter_config.json").read_bytes() + (tmp_path / "skill" / "adapters.safetensors").read_bytes()
    assert info.content_hash == hashlib.sha256(files).hexdigest()
    # peft's lora_A is mlx's lora_a transposed
    from safetensors.numpy import load_file

    peft = load_file(info.folder / "adapter_model.safetensors")
    mlx = load_file(tmp_path / "skill" / "adapters.safetensors")
    np.testing.assert_array_equal(peft["base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"], mlx["model.layers.2.self_attn.q_proj.lora_a"].T)


BAD = {
    "fine_tune_type full": (q_proj_lora(), {"fine_tune_type": "full"}),
    "model.layers.0.self_attn.q_proj.lora_a maps to no LoRA layer": (q_proj_lora(layers=(0, 2, 3)), {}),
    "has shape (128, 8), the base needs (128, 4)": (q_proj_lora(rank=8), {}),
    "adapter_quantization: not format mlx_lm.quantized_lora version 1": (q_proj_lora(), {"adapter_quantization": {"format": "mlx_lm.quantized_lora"}}),
    "lora_parameters.scale": (q_proj_lora(), {"lora_parameters": {"rank": 4}}),
}


@pytest.mark.parametrize("expected", sorted(BAD))
def test_bad_mlx_adapters_are_bad_input_naming_the_problem(tmp_path, expected):
    tensors, config = BAD[expected]
    write_mlx_adapter(tmp_path / "skill", tensors, **config)
    with pytest.raises(BadInput, match=expected.replace("(", r"\(").replace(")", r"\)")):
        check_inputs(manifest_for(tmp_path, "  - {name: skill, path: skill}\n"))


def test_nan_in_an_mlx_adapter_names_the_tensor(tmp_path):
    tensors = q_proj_lora()
    tensors["model.layers.3.self_attn.q_proj.lora_b"][1, 2] = np.nan
    write_mlx_adapter(tmp_path / "skill", tensors)
    with pytest.raises(BadInput, match="model.layers.3.self_attn.q_proj.lora_b"):
        check_inputs(manifest_for(tmp_path, "  - {name: skill, path: skill}\n"))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_dequantization_is_mlx_s(bits):
    mx = pytest.importorskip("mlx.core")
    from adapterpack.inputs.mlx_adapter import dequantize

    rng = np.random.default_rng(bits)
    for group_size in (32, 64, 128):
        packed, scales, biases = mx.quantize(mx.array(rng.normal(0, 1, (6, 256)).astype(np.float32)), group_size=group_size, bits=bits, mode="affine")
        expected = np.array(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits, mode="affine"))
        got = dequantize(np.array(packed), np.array(scales), np.array(biases), group_size, bits)
        np.testing.assert_array_equal(got, expected)


def test_quantized_training_base_is_one_warning(tmp_path, caplog):
    import logging

    write_mlx_adapter(tmp_path / "skill", q_proj_lora(), model="mlx-community/demo-base-4bit")
    logger = logging.getLogger("adapterpack")
    logger.addHandler(caplog.handler)
    try:
        check_inputs(manifest_for(tmp_path, "  - {name: skill, path: skill}\n"))
    finally:
        logger.removeHandler(caplog.handler)
    warnings = {r.getMessage() for r in caplog.records if "quantized" in r.getMessage()}
    assert len(warnings) == 1 and "trained against its quantized weights" in warnings.pop()


# -- against mlx-lm itself -------------------------------------------------------------------

def mlx_lm():
    """mlx-lm, the reference (a test dependency, never a runtime one)."""
    return pytest.importorskip("mlx_lm", reason="mlx-lm (mlx[cpu] on Linux) is not installable here")


def train_with_mlx_lm(folder: Path, data: Path, *, fine_tune_type: str, num_layers: int, keys=None, rank=4) -> Path:
    """`mlx_lm lora --train`, as a Mac user runs it (a few steps at a high learning rate)."""
    config = data / f"{folder.name}.yaml"
    parameters = {"rank": rank, "scale": 10.0, "dropout": 0.0} | ({"keys": keys} if keys else {})
    config.write_text(json.dumps({"lora_parameters": parameters}))
    command = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(DEMO_BASE), "--train", "--data", str(data),
               "--iters", "4", "--batch-size", "2", "--num-layers", str(num_layers), "--adapter-path", str(folder),
               "--fine-tune-type", fine_tune_type, "-c", str(config), "--learning-rate", "2e-2", "--max-seq-length", "96",
               "--steps-per-report", "4", "--steps-per-eval", "100", "--seed", "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    mlx_lm()
    root = tmp_path_factory.mktemp("mlx")
    data = root / "data"
    data.mkdir()
    text = (REPO / "adapters" / "demo" / "heldout.txt").read_text()
    lines = [json.dumps({"text": text[i : i + 90]}) for i in range(0, 2700, 90)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    (data / "valid.jsonl").write_text("\n".join(lines[:4]) + "\n")
    train_with_mlx_lm(root / "lora", data, fine_tune_type="lora", num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"])
    train_with_mlx_lm(root / "dora", data, fine_tune_type="dora", num_layers=3)
    # top-level modules named by full path: the embedding and the output layer
    train_with_mlx_lm(root / "edges", data, fine_tune_type="lora", num_layers=1, keys=["mlp.up_proj", "model.embed_tokens", "lm_head"])
    quantize_adapter(root / "lora", root / "quant", root / "quant-float", bits=4)
    return root


def quantize_adapter(source: Path, target: Path, reference: Path, *, bits: int, group_size=64, rank_group_size=32) -> None:
    """``target``: ``source`` persisted as mlx-lm's quantized LoRA (``QuantizedLoRALinear.from_lora``
    and ``save_quantized_adapter``, mlx_lm/tuner: adapter_quantization, format mlx_lm.quantized_lora,
    affine), quantized by MLX itself; ``reference``: the float adapter MLX dequantizes it to, as
    ``QuantizedLoRALinear.fuse`` does. (The mlx-lm release here predates the quantized format, so
    its writer is followed from its source.)"""
    import mlx.core as mx

    weights = mx.load(str(source / "adapters.safetensors"))
    config = json.loads((source / "adapter_config.json").read_text())
    rank = config["lora_parameters"]["rank"]
    quantized, floats, layers = {}, {}, {}

    def pad(matrix, size):
        return mx.pad(matrix, [(0, 0), (0, size - matrix.shape[-1])])

    for module in sorted({name.rsplit(".", 1)[0] for name in weights}):
        a, b = weights[f"{module}.lora_a"], weights[f"{module}.lora_b"]  # (in, r), (r, out)
        input_dims, output_dims = a.shape[0], b.shape[1]
        padded_input, padded_rank = -(-input_dims // group_size) * group_size, -(-rank // rank_group_size) * rank_group_size
        qa = mx.quantize(pad(a.T, padded_input), group_size=group_size, bits=bits, mode="affine")
        qb = mx.quantize(pad(b.T, padded_rank), group_size=rank_group_size, bits=bits, mode="affine")
        for leaf, (q, s, z) in (("lora_a", qa), ("lora_b", qb)):
            quantized.update({f"{module}.{leaf}": q, f"{module}.{leaf}_scales": s, f"{module}.{leaf}_biases": z})
        da = mx.dequantize(*qa, group_size=group_size, bits=bits, mode="affine")[:rank, :input_dims]
        db = mx.dequantize(*qb, group_size=rank_group_size, bits=bits, mode="affine")[:, :rank]
        floats.update({f"{module}.lora_a": da.T, f"{module}.lora_b": db.T})
        layers[module] = {"bits": bits, "input_dims": input_dims, "output_dims": output_dims, "rank": rank,
                          "padded_input_dims": padded_input, "padded_rank": padded_rank}
    for folder, tensors, extra in (
        (target, quantized, {"adapter_quantization": {"format": "mlx_lm.quantized_lora", "version": 1, "group_size": group_size,
                                                     "rank_group_size": rank_group_size, "mode": "affine", "layers": layers}}),
        (reference, floats, {}),
    ):
        folder.mkdir()
        mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
        (folder / "adapter_config.json").write_text(json.dumps(config | extra, indent=2, sort_keys=True))


def mlx_logits(adapter: Path, ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    model, _ = mlx_lm().load(str(DEMO_BASE), adapter_path=str(adapter))
    return np.array(model(mx.array([ids])).astype(mx.float32))[0]


def package_logits(package: Path, function: str, ids: list[int]) -> np.ndarray:
    from adapterpack.verification.drives import swift_mask
    from adapterpack.verification.runners import function_sessions

    predict = function_sessions(package)(function)()
    return np.asarray(predict(np.array([ids], np.int32), swift_mask(0, len(ids))), np.float32)[0]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))))


@pytest.mark.slow
@pytest.mark.parametrize("lora", ["fuse", "keep"])
def test_mlx_lm_adapters_match_mlx_lm_forward(trained, tmp_path, lora):
    """LoRA (keys, last 2 of 4 blocks) and DoRA (every linear layer of the last 3 blocks),
    trained by mlx-lm, beside a peft adapter in one package; each function's logits match
    mlx-lm's own forward of base + adapter at float16."""
    from adapterpack.assemble.pipeline import build

    code = REPO / "adapters" / "demo" / "code"
    dora = "" if lora == "keep" else f"  - {{name: dora, path: {trained / 'dora'}, lora: fuse}}\n"  # DoRA cannot be kept
    manifest = manifest_for(
        tmp_path,
        f"  - {{name: lora, path: {trained / 'lora'}, format: mlx}}\n{dora}  - {{name: edges, path: {trained / 'edges'}}}\n"
        f"  - {{name: quant, path: {trained / 'quant'}}}\n  - {{name: code, path: {code}}}\n",
        f"lora: {lora}\ninclude_base: base\n",
    )
    result = build(manifest, output=tmp_path / "p.mlpackage")
    assert result.verify_report.passed, result.verify_report.verdict()
    ids = [256, *b"def parse(self, text):\n    return"]
    base = mlx_logits_base(ids)
    edges = check_inputs(manifest).adapters["edges"]
    assert {"model.embed_tokens", "lm_head", "model.layers.3.mlp.up_proj"} == set(edges.target_modules)
    for function in ["lora", "edges", "quant"] + ([] if lora == "keep" else ["dora"]):
        # the quantized adapter against mlx-lm's forward with MLX's own dequantization of it
        reference = trained / ("quant-float" if function == "quant" else function)
        ours, theirs = package_logits(result.output, function, ids), mlx_logits(reference, ids)
        assert cosine(ours, theirs) >= 0.9999, function
        assert np.abs(theirs - base).max() > 0.05  # the adapter changes mlx-lm's logits: not an identity


def mlx_logits_base(ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    model, _ = mlx_lm().load(str(DEMO_BASE))
    return np.array(model(mx.array([ids])).astype(mx.float32))[0]


@pytest.mark.parametrize("family", ["llama", *(pytest.param(f, marks=pytest.mark.slow) for f in ("mistral", "qwen2", "qwen3", "gemma3_text"))])
def test_mlx_module_paths_map_for_every_family(family, tmp_path):
    """mlx-lm's own model classes for each family name the modules it gives LoRA; the package
    built from that adapter matches mlx-lm's forward (float16, cosine >= 0.9999)."""
    mlx_lm()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions
    from factories import make_base

    make_base(tmp_path / "base", family)
    if family == "gemma3_text":
        # mlx-lm places Gemma 3's global layers by sliding_window_pattern (every n-th), not by
        # layer_types: the toy's [sliding, full] is a pattern of 2
        config = json.loads((tmp_path / "base" / "config.json").read_text())
        assert config["layer_types"] == ["sliding_attention", "full_attention"], config["layer_types"]
        (tmp_path / "base" / "config.json").write_text(json.dumps(config | {"sliding_window_pattern": 2}))
    model, _ = load_model(tmp_path / "base")
    model.freeze()
    parameters = {"rank": 4, "scale": 8.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]}
    linear_to_lora_layers(model, 1, parameters)
    mx.random.seed(7)
    trained = {name: mx.random.normal(value.shape) * 0.05 for name, value in tree_flatten(model.trainable_parameters())}
    model.load_weights(list(trained.items()), strict=False)
    (tmp_path / "skill").mkdir()
    mx.save_safetensors(str(tmp_path / "skill" / "adapters.safetensors"), trained)
    (tmp_path / "skill" / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": parameters, "model": str(tmp_path / "base")}))
    (tmp_path / "m.yaml").write_text(
        "name: fam\nbase: {path: base}\nadapters:\n  - {name: skill, path: skill}\nexport: {max_context: 32}\n"
        "compression: {method: none}\n")
    result = build(tmp_path / "m.yaml", output=tmp_path / "p.mlpackage", options=BuildOptions(verify=False))
    assert set(check_inputs(tmp_path / "m.yaml").adapters["skill"].target_modules) == {
        f"model.layers.1.{key}" for key in parameters["keys"]
    }
    ids = [1, 5, 9, 17, 33, 40, 2]
    theirs = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    assert cosine(package_logits(result.output, "skill", ids), theirs) >= 0.9999
