"""Tiny random models and adapters, made offline, for every supported family.

Like mergekit's ``make_picollama``: small enough to build in seconds, shaped like the real thing
(GQA, biases, q/k norms, Llama 3 rope scaling, tied embeddings).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "llama":
        common.update(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            tie_word_embeddings=True,
        )
    elif family == "mistral":
        common.update(num_key_value_heads=4, sliding_window=None)  # MHA
    elif family == "qwen3":
        common.update(head_dim=32)  # head_dim decoupled from hidden/heads, as in Qwen3
    elif family == "gemma3_text":
        # Gemma 3's shape at toy size: sliding and global layers with their own rope bases, a
        # window shorter than verify's sequences, a query scale that is not 1/sqrt(head_dim).
        common.update(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=4, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


def make_base(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random base model of ``family`` to ``folder`` (safetensors) and return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():  # biases start at zero; make them matter (Qwen2 q/k/v biases)
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.1)
            elif family == "gemma3_text" and name.endswith("norm.weight"):  # Gemma's (1 + w) gains start at w = 0
                parameter.normal_(0, 0.5)
    model.config._name_or_path = f"adapterpack-tests/tiny-{family}"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# Every 8th token id triggers the planted activation (see ``plant_massive_activation``): the
# verification sequence of 32 seeded tokens holds several.
TRIGGER_EVERY = 8


def plant_massive_activation(model, target: float = 20000.0, channel: int = 5, triggers=None) -> None:
    """Give a random model the "massive activations" of real checkpoints (Sun et al., 2024): the
    first layer's MLP writes about ``target`` into one residual channel for trigger tokens (every
    ``TRIGGER_EVERY``-th id, or the ids ``triggers``), and the residual stream carries it on, as
    in pretrained Llama, Mistral and Qwen checkpoints. Random weights alone never pass a few hundred."""
    with torch.no_grad():
        hidden = model.config.hidden_size
        embed = model.model.embed_tokens.weight
        embed[:, channel + 1] = 0.0
        embed[slice(None, None, TRIGGER_EVERY) if triggers is None else list(triggers), channel + 1] = 2.0  # the trigger direction dominates those tokens' norm
        mlp = model.model.layers[0].mlp
        unit = 0
        mlp.gate_proj.weight[unit].zero_()
        mlp.up_proj.weight[unit].zero_()
        mlp.gate_proj.weight[unit, channel + 1] = 4.0
        mlp.up_proj.weight[unit, channel + 1] = 4.0
        # The trigger's normalized value is about sqrt(hidden): gate*up ~ 16 * hidden.
        mlp.down_proj.weight[:, unit].zero_()
        mlp.down_proj.weight[channel, unit] = target / (16.0 * hidden)
        if model.config.model_type == "gemma3_text":
            # Gemma normalizes the MLP's output before the residual add (its norm gains reach
            # 152 in Gemma 3 270M, whose residual reaches 103,821 at <bos>): a gain that turns
            # the trigger's normalized sqrt(hidden) into five times the target, past float16.
            # Only the trigger may reach that channel, or every token's residual would be ruled
            # by it: no other unit writes it, and attention leaves the trigger direction alone.
            post = model.model.layers[0].post_feedforward_layernorm
            post.weight[channel] = 5.0 * target / hidden**0.5 - 1.0
            mlp.down_proj.weight[channel, unit + 1:] = 0.0
            model.model.layers[0].self_attn.o_proj.weight[channel + 1].zero_()


def make_massive_base(folder: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """``make_base`` with a planted massive activation (``plant_massive_activation``)."""
    from transformers import AutoModelForCausalLM

    make_base(folder, family, seed, **overrides)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    plant_massive_activation(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_adapter(
    folder: Path,
    base_folder: Path,
    *,
    seed: int = 1,
    r: int = 4,
    alpha: int = 8,
    targets=("q_proj", "v_proj"),
    zero_b: bool = False,
    std: float = 0.3,
    **lora_kwargs,
) -> Path:
    """Save a peft LoRA adapter with random (non-identity) A and B to ``folder``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora_kwargs)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                if "lora_B" in name and zero_b:
                    parameter.zero_()
                else:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(folder)
    return folder


# One package per family holds a function for each of these (see conftest.family_build).
FAMILY_ADAPTERS = {
    # rsLoRA with per-module rank and alpha patterns, on attention
    "rs": dict(
        r=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), use_rslora=True,
        rank_pattern={"v_proj": 8}, alpha_pattern={"o_proj": 32},
    ),
    # the MLP only, high alpha, a manifest scale
    "mlp": dict(r=8, alpha=32, targets=("gate_proj", "up_proj", "down_proj"), seed=7, scale=0.7),
    # everything, rank 2
    "all": dict(
        r=2, alpha=2, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=9,
    ),
    # the negative control: lora_B = 0 must leave the base unchanged
    "zero": dict(r=4, alpha=8, targets=("q_proj", "v_proj"), zero_b=True, seed=11),
    # kept unfused: the LoRA branch is part of the program
    "kept": dict(r=8, alpha=16, targets=("q_proj", "k_proj", "o_proj"), seed=13, lora="keep"),
}


def make_family_project(root: Path, family: str) -> Path:
    """A float16 manifest over a ``family`` base with a planted massive activation (as real
    checkpoints have) and every ``FAMILY_ADAPTERS`` function; returns it."""
    make_massive_base(root / "base", family)
    entries = []
    for name, settings in FAMILY_ADAPTERS.items():
        settings = dict(settings)
        extras = {key: settings.pop(key) for key in ("scale", "lora") if key in settings}
        # Realistic magnitudes: large enough to move the logits, small enough for float16.
        # Gemma normalizes each sublayer's output before the residual takes it, which damps a
        # small adapter's change under float16's rounding of the base: three times the size.
        make_adapter(root / name, root / "base", std=0.3 if family == "gemma3_text" else 0.1, **settings)
        entries.append(f"  - name: {name}\n    path: {name}\n" + "".join(f"    {k}: {v}\n" for k, v in extras.items()))
    (root / "m.yaml").write_text(
        "name: numerics\nbase: {path: base}\ninclude_base: base\nexport: {max_context: 40}\n"
        # Random logits have near-ties (top-2 gaps of 1e-3): float16's rounding of the planted
        # channel (spacing 16 at 20,000) flips a few, as torch's own float16 forward does (top-1
        # 96.9% on qwen2's mlp function), so top-1 is held at 90% here and cosine carries the proof.
        "compression: {method: none}\nverify: {prefill: 9, decode_steps: 7, min_top1: 0.9"
        # Retention is measured from the float32 base, so float16's rounding of the base's weights
        # counts as lost effect; on random ids Gemma's normalized sublayer outputs leave an
        # adapter's change only a few times that rounding (0.91-0.93 with float16 weights alone,
        # 0.84 on Core AI's float16 arithmetic).
        + (", min_retention: 0.75" if family == "gemma3_text" else "")
        + "}\nadapters:\n" + "".join(entries)
    )
    return root / "m.yaml"


def make_demo_project(root: Path, manifest: str) -> Path:
    """The shipped demo's base and zen skill copied into ``root`` beside ``manifest`` (as
    ``root/m.yaml``); returns ``root``."""
    import shutil

    demo = Path(__file__).resolve().parents[1] / "adapters" / "demo"
    for name in ("base", "zen"):
        shutil.copytree(demo / name, root / name)
    (root / "m.yaml").write_text(manifest)
    return root


def make_project(root: Path, manifest: str, adapters: dict[str, dict]) -> Path:
    """A Llama base in ``root/base``, each adapter (name -> ``make_adapter`` settings) in
    ``root/NAME``, and ``manifest`` as ``root/m.yaml``; returns ``root``."""
    make_base(root / "base", "llama")
    for name, settings in adapters.items():
        make_adapter(root / name, root / "base", **settings)
    (root / "m.yaml").write_text(manifest)
    return root


# Two palettized fused adapters on different modules and the base function: the projects the
# build cache and fan-out tests rebuild, change and corrupt.
CACHED_MANIFEST = """name: {name}
base: {{path: base}}
adapters:
  - {{name: chat, path: chat}}
  - {{name: code, path: code}}
include_base: base
export: {{max_context: 32}}
compression: {{method: palettize}}
"""
CACHED_ADAPTERS = {"chat": dict(std=0.1), "code": dict(std=0.1, seed=4, targets=("gate_proj", "up_proj"))}


def make_cached_project(root: Path, name: str) -> Path:
    """``make_project`` with ``CACHED_MANIFEST`` (named ``name``) and ``CACHED_ADAPTERS``."""
    return make_project(root, CACHED_MANIFEST.format(name=name), CACHED_ADAPTERS)


def run_cli(*args, cwd: Path | None = None):
    """``adapterpack ARGS`` in a subprocess (no debug tracebacks), its output captured."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    command = [sys.executable, "-m", "adapterpack", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


def invoke_cli(*args):
    """``adapterpack ARGS`` in this process (typer's runner; no debug tracebacks): what
    ``run_cli`` returns, without a second interpreter importing torch for each call."""
    import os
    import subprocess

    from typer.testing import CliRunner

    from adapterpack.cli.app import app

    env = {"ADAPTERPACK_DEBUG": None} if "ADAPTERPACK_DEBUG" in os.environ else {}
    result = CliRunner().invoke(app, [str(arg) for arg in args], env=env)
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def tree_digest(path: Path) -> str:
    """sha256 over a folder's file names and bytes (a package is a folder)."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def run_with_fault(args: list, at: int, report: Path):
    """``adapterpack ARGS`` in a process of its own with a fault at call ``at`` (0: none), as
    ``tests/fault_runner.py`` runs it: (the completed process, {"calls", "where"})."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"} | {"PYTHONHASHSEED": "0"}
    runner = Path(__file__).with_name("fault_runner.py")
    result = subprocess.run([sys.executable, str(runner), str(at), str(report), *map(str, args)],
                            capture_output=True, text=True, env=env, timeout=900)
    return result, json.loads(report.read_text())


def load_script(name: str):
    """``scripts/NAME.py`` as a module (the real checkpoints' converters: ``smollm2``, ``gemma3``),
    with ``scripts/`` importable as it is when the script runs."""
    import importlib
    import sys

    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


def copied_build(family_build: tuple, destination: Path) -> tuple:
    """A session's shared family build (``conftest.family_build``) copied to ``destination``,
    for a test that adds files to it (a tokenizer changes the text other tests' verify drives)."""
    import dataclasses
    import shutil

    family, shared, result = family_build
    output = destination / result.output.relative_to(shared)

    def project_only(folder: str, names: list[str]) -> list[str]:
        # The project's inputs and this worker's package: not the build cache, nor what another
        # worker may be writing into the shared folder at this moment (its package, its staging).
        if Path(folder) != shared:
            return []
        return [name for name in names if name.startswith(".") or (name.startswith("out-") and name != output.name)]

    shutil.copytree(shared, destination, symlinks=True, dirs_exist_ok=True, ignore=project_only)
    return family, destination, dataclasses.replace(result, output=output)


def demo_cache(demo) -> Path:
    """The build cache of the session's demo build (``conftest.demo``), shared by the workers."""
    return demo.output.parent.parent / "cache"
