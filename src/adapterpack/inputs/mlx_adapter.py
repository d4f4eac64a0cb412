"""Adapters trained with mlx-lm (``mlx_lm.lora``), read as what they are and handed on as the
peft adapter that computes the same thing.

mlx-lm's folder: ``adapter_config.json`` holds the training arguments (``fine_tune_type`` lora |
dora | full, ``num_layers``: the last N transformer blocks, ``lora_parameters``: rank, scale,
dropout, optional ``keys``; ``model``: the base it was trained on) and ``adapters.safetensors``
holds tensors named by the mlx module path: ``<module>.lora_a`` (in, r), ``<module>.lora_b``
(r, out) and, for DoRA, ``<module>.m`` (out). mlx-lm's model classes name modules as
transformers does (``model.layers.3.self_attn.q_proj``) for every family supported here.

What mlx-lm computes (``mlx_lm/tuner/lora.py``, ``dora.py``): ``y = W x + scale * (x @ lora_a)
@ lora_b``, fused as ``W + (scale * lora_b.T) @ lora_a.T``; DoRA rescales each row of that to
``m`` over its norm; an embedding adds ``scale * lora_a[ids] @ lora_b``. peft computes the same
with ``lora_A = lora_a.T``, ``lora_B = lora_b.T``, ``lora_alpha = scale * r`` (scaling ``alpha /
r``) and ``lora_magnitude_vector = m``, so the rest of adapterpack (fuse, keep, the reference,
verification) treats the adapter as that peft adapter, written once per content to a folder of
its own. Which modules get LoRA is what ``linear_to_lora_layers`` (``mlx_lm/tuner/utils.py``)
chooses: the modules named by ``keys`` (default: every linear layer of a block) in the last
``num_layers`` blocks, and top-level modules whose full name is a key.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.inputs.safetensors import check_finite, read_safetensors_header, tensor_data_ranges

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"

# mlx tensor leaf -> what it is
_LEAVES = ("lora_a", "lora_b", "m")


def looks_like_mlx(folder: Path) -> bool:
    """An mlx-lm adapter folder: its weights file, and no peft one."""
    return (folder / WEIGHTS).is_file() and not any((folder / name).exists() for name in ("adapter_model.safetensors", "adapter_model.bin"))


@dataclass
class MlxAdapter:
    """An mlx-lm adapter checked against a base, and the peft folder that computes the same."""

    folder: Path  # as the user gave it
    peft_folder: Path  # the same adapter in peft's format
    content_hash: str  # sha256 over the files mlx-lm wrote
    fine_tune_type: str
    warnings: tuple[str, ...]


def _bad(path: Path, problem: str) -> BadInput:
    return BadInput(f"{path}: {problem}")


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise _bad(folder, f"no {CONFIG} (mlx_lm.lora writes one beside {WEIGHTS})") from None
    except (OSError, ValueError) as error:
        raise _bad(path, f"not readable JSON ({str(error)[:120]})") from None
    if not isinstance(config, dict):
        raise _bad(path, "not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise _bad(path, "fine_tune_type full: a full fine-tune is a new base, not an adapter; fuse it with mlx_lm.fuse and package the result as the base")
    if kind not in ("lora", "dora"):
        raise _bad(path, f"fine_tune_type {kind!r} is not supported: lora or dora")
    parameters = config.get("lora_parameters")
    if not isinstance(parameters, dict) or not isinstance(parameters.get("rank"), int) or parameters["rank"] < 1:
        raise _bad(path, "lora_parameters.rank is missing or not a positive integer")
    if not isinstance(parameters.get("scale"), (int, float)) or not math.isfinite(parameters["scale"]):
        raise _bad(path, "lora_parameters.scale is missing or not a number (mlx-lm's LoRA scale)")
    keys = parameters.get("keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise _bad(path, "lora_parameters.keys must be a list of module names")
    if not isinstance(config.get("num_layers"), int):
        raise _bad(path, "num_layers is missing or not an integer")
    if config.get("adapter_quantization") is not None:
        raise _bad(path, "adapter_quantization: quantized LoRA adapters (mlx_lm.quantized_lora) are not supported; package the float adapter")
    return config


def lora_modules(config: dict, base_tensors: dict) -> dict[str, str]:
    """{module: 'linear' | 'embedding'} that mlx-lm's ``linear_to_lora_layers`` gives LoRA on this base."""
    layers = sorted({int(m.group(1)) for key in base_tensors if (m := re.match(r"model\.layers\.(\d+)\.", key))})
    keys = config["lora_parameters"].get("keys")
    chosen: dict[str, str] = {}
    count = max(config["num_layers"], 0)
    last = layers[-count:] if count else layers  # mlx: model.layers[-max(n, 0):], and [-0:] is all of them
    for index in last:
        prefix = f"model.layers.{index}."
        for key, info in base_tensors.items():
            if key.startswith(prefix) and key.endswith(".weight") and len(info.shape) == 2:
                relative = key[len(prefix) : -len(".weight")]
                if keys is None or relative in keys:
                    chosen[prefix + relative] = "linear"
    for key in keys or ():
        info = base_tensors.get(f"{key}.weight")
        if info is not None and len(info.shape) == 2:
            chosen[key] = "embedding" if key.endswith("embed_tokens") else "linear"
    return chosen


def _values(file: Path, tensors: dict) -> dict[str, np.ndarray]:
    """Every tensor as float32, read from the raw bytes (bfloat16 too, which numpy lacks)."""
    ranges = tensor_data_ranges(file)
    out = {}
    with file.open("rb") as handle:
        for name, info in tensors.items():
            start, end = ranges[name]
            handle.seek(start)
            raw = handle.read(end - start)
            if info.dtype == "BF16":
                value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif info.dtype in ("F16", "F32", "F64"):
                value = np.frombuffer(raw, {"F16": np.float16, "F32": np.float32, "F64": np.float64}[info.dtype]).astype(np.float32)
            else:
                raise _bad(file, f"tensor {name} has dtype {info.dtype}; LoRA tensors are floating point")
            out[name] = value.reshape(info.shape)
    return out


def _content_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def _names_another_base(model: str | None, base, manifest_names: tuple[str, ...]) -> str | None:
    """Why the adapter's ``model`` is not the manifest's base (None when it looks like it)."""
    if not model:
        return None
    quantized = f"{model}, a quantized model: the adapter was trained against its quantized weights, not the base's own that the package uses"
    if re.search(r"-(3|4|6|8)bit$", model.rstrip("/")):
        return quantized
    folder = Path(model).expanduser()
    if folder.is_dir():
        try:
            if "quantization" in json.loads((folder / "config.json").read_text()):
                return quantized
        except (OSError, ValueError):
            pass
        if folder.resolve() == base.folder.resolve():
            return None
    names = {n.rstrip("/") for n in manifest_names if n}
    if model.rstrip("/") in names or Path(model).name in {Path(n).name for n in names}:
        return None
    return f"{model}, not the manifest's base: the adapter was trained against other weights than the package uses"


def read_mlx_adapter(folder: Path, base, *, base_names: tuple[str, ...] = (), work: Path | None = None) -> MlxAdapter:
    """Check an mlx-lm adapter against ``base`` and write its peft form (once per content).

    BadInput naming the file and tensor for anything mlx-lm would not load into this base, or
    that adapterpack does not package (full fine-tunes, quantized adapters)."""
    folder = Path(folder)
    config = _read_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise _bad(folder, f"no {WEIGHTS} (the weights mlx_lm.lora writes)")
    tensors = read_safetensors_header(weights)
    check_finite(weights, tensors)
    dora = config.get("fine_tune_type", "lora") == "dora"
    rank = config["lora_parameters"]["rank"]
    expected = lora_modules(config, base.tensors)
    found: dict[str, dict[str, str]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in _LEAVES or module not in expected or (leaf == "m" and not dora):
            raise _bad(weights, f"tensor {name} maps to no LoRA layer mlx-lm makes on this base (fine_tune_type "
                                f"{config.get('fine_tune_type', 'lora')}, num_layers {config['num_layers']}, keys "
                                f"{config['lora_parameters'].get('keys') or 'default'})")
        found.setdefault(module, {})[leaf] = name
    if not found:
        raise _bad(weights, "holds no LoRA tensors")
    for module, leaves in sorted(found.items()):
        kind = expected[module]
        out_dim, in_dim = base.tensors[f"{module}.weight"].shape
        if kind == "embedding":
            if dora:
                raise _bad(weights, f"{module}: DoRA on an embedding is not supported")
            shapes = {"lora_a": (out_dim, rank), "lora_b": (rank, in_dim)}
        else:
            shapes = {"lora_a": (in_dim, rank), "lora_b": (rank, out_dim), "m": (out_dim,)}
        required = ("lora_a", "lora_b", "m") if dora and kind == "linear" else ("lora_a", "lora_b")
        for leaf in required:
            if leaf not in leaves:
                raise _bad(weights, f"{module}.{leaf} is missing (its module has {', '.join(sorted(leaves))})")
        for leaf, name in leaves.items():
            shape = tuple(tensors[name].shape)
            if shape != shapes[leaf]:
                hint = ""
                if leaf in ("lora_a", "lora_b") and rank not in shape and len(shape) == 2:
                    hint = f" (lora_parameters.rank is {rank})"
                raise _bad(weights, f"tensor {name} has shape {shape}, the base needs {shapes[leaf]}{hint}")
    warnings = []
    reason = _names_another_base(config.get("model"), base, base_names)
    if reason:
        warnings.append(f"{folder / CONFIG}: model is {reason}")

    content_hash = _content_hash(folder)
    root = Path(work) if work is not None else Path(tempfile.gettempdir()) / f"adapterpack-mlx-{os.getuid()}"
    target = root / content_hash
    if not (target / "adapter_model.safetensors").is_file():
        _write_peft(target, config, weights, tensors, found, expected, dora)
    return MlxAdapter(folder, target, content_hash, config.get("fine_tune_type", "lora"), tuple(warnings))


def _write_peft(target: Path, config: dict, weights: Path, tensors: dict, found: dict, expected: dict, dora: bool) -> None:
    """The peft adapter that computes what the mlx-lm one does, written whole or not at all."""
    from safetensors.numpy import save_file

    values = _values(weights, tensors)
    parameters = config["lora_parameters"]
    rank = parameters["rank"]
    state = {}
    for module, leaves in sorted(found.items()):
        prefix = f"base_model.model.{module}"
        a, b = values[leaves["lora_a"]], values[leaves["lora_b"]]
        if expected[module] == "embedding":
            state[f"{prefix}.lora_embedding_A"] = np.ascontiguousarray(a.T)
            state[f"{prefix}.lora_embedding_B"] = np.ascontiguousarray(b.T)
        else:
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a.T)
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b.T)
        if "m" in leaves:
            state[f"{prefix}.lora_magnitude_vector"] = np.ascontiguousarray(values[leaves["m"]])
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": float(parameters["scale"]) * rank,  # peft scales by alpha / r: mlx's scale
        "lora_dropout": 0.0,
        "target_modules": sorted(found),
        "bias": "none",
        "use_dora": dora,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    incoming = target.parent / f".{target.name}.{uuid.uuid4().hex}"
    incoming.mkdir()
    save_file(state, str(incoming / "adapter_model.safetensors"))
    (incoming / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True))
    try:
        os.rename(incoming, target)
    except OSError:  # another build wrote the same content first
        import shutil

        shutil.rmtree(incoming, ignore_errors=True)
