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

import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adapterpack.files import bad_file, sha256_files, written_once
from adapterpack.inputs.safetensors import check_finite, read_safetensors_header, tensor_data_ranges
from adapterpack.inputs.text_tower import text_name

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"

# mlx tensor leaves: LoRA matrices, DoRA's magnitude, and a quantized adapter's scales and biases
_LEAVES = ("lora_a", "lora_b", "m", "lora_a_scales", "lora_a_biases", "lora_b_scales", "lora_b_biases")
QUANTIZED_FORMAT = "mlx_lm.quantized_lora"


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


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise bad_file(folder, f"no {CONFIG} (mlx_lm.lora writes one beside {WEIGHTS})") from None
    except (OSError, ValueError) as error:
        raise bad_file(path, f"not readable JSON ({str(error)[:120]})") from None
    if not isinstance(config, dict):
        raise bad_file(path, "not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise bad_file(path, "fine_tune_type full: a full fine-tune is a new base, not an adapter; fuse it with mlx_lm.fuse and package the result as the base")
    if kind not in ("lora", "dora"):
        raise bad_file(path, f"fine_tune_type {kind!r} is not supported: lora or dora")
    parameters = config.get("lora_parameters")
    if not isinstance(parameters, dict) or not isinstance(parameters.get("rank"), int) or parameters["rank"] < 1:
        raise bad_file(path, "lora_parameters.rank is missing or not a positive integer")
    if not isinstance(parameters.get("scale"), (int, float)) or not math.isfinite(parameters["scale"]):
        raise bad_file(path, "lora_parameters.scale is missing or not a number (mlx-lm's LoRA scale)")
    keys = parameters.get("keys")
    if keys is not None and (not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)):
        raise bad_file(path, "lora_parameters.keys must be a list of module names")
    if not isinstance(config.get("num_layers"), int):
        raise bad_file(path, "num_layers is missing or not an integer")
    quantization = config.get("adapter_quantization")
    if quantization is not None:
        _check_quantization(path, quantization, parameters["rank"])
    return config


def _check_quantization(path: Path, quantization, rank: int) -> None:
    """The checks mlx-lm's ``_parse_quantized_lora_layers`` makes, as one-line reasons."""
    if not isinstance(quantization, dict) or quantization.get("format") != QUANTIZED_FORMAT or quantization.get("version") != 1:
        raise bad_file(path, f"adapter_quantization: not format {QUANTIZED_FORMAT} version 1")
    if quantization.get("mode") != "affine":
        raise bad_file(path, f"adapter_quantization.mode {quantization.get('mode')!r}: only affine is supported (as mlx-lm persists it)")
    for field in ("group_size", "rank_group_size"):
        if quantization.get(field) not in (32, 64, 128):
            raise bad_file(path, f"adapter_quantization.{field} {quantization.get(field)!r}: 32, 64 or 128")
    layers = quantization.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise bad_file(path, "adapter_quantization.layers is missing")
    fields = ("bits", "input_dims", "output_dims", "rank", "padded_input_dims", "padded_rank")
    for name, layer in layers.items():
        if not isinstance(layer, dict) or any(not isinstance(layer.get(f), int) or layer[f] <= 0 for f in fields):
            raise bad_file(path, f"adapter_quantization.layers.{name}: needs positive integers {', '.join(fields)}")
        if layer["bits"] not in (2, 3, 4, 5, 6, 8):
            raise bad_file(path, f"adapter_quantization.layers.{name}.bits {layer['bits']}: 2, 3, 4, 5, 6 or 8")
        if layer["rank"] != rank:
            raise bad_file(path, f"adapter_quantization.layers.{name}.rank {layer['rank']} disagrees with lora_parameters.rank {rank}")
        if layer["padded_input_dims"] != _padded(layer["input_dims"], quantization["group_size"]) or layer[
            "padded_rank"
        ] != _padded(layer["rank"], quantization["rank_group_size"]):
            raise bad_file(path, f"adapter_quantization.layers.{name}: padding does not match the group sizes")


def _padded(size: int, group: int) -> int:
    return -(-size // group) * group


def dequantize(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, group_size: int, bits: int) -> np.ndarray:
    """MLX's affine dequantization (``mx.dequantize``): each row of ``packed`` (uint32) is a
    little-endian stream of ``bits``-bit integers q, and a value is ``scale * q + bias`` with
    one scale and bias per ``group_size`` values of its row."""
    rows = packed.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(packed, dtype="<u4").view(np.uint8).reshape(rows, -1), axis=1, bitorder="little")
    count = stream.shape[1] // bits
    weights = (1 << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    q = (stream[:, : count * bits].reshape(rows, count, bits).astype(np.uint32) * weights).sum(axis=2)
    groups = q.reshape(rows, -1, group_size).astype(np.float32)
    return (groups * scales[:, :, None] + biases[:, :, None]).reshape(rows, -1)


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


def _check_quantized_layer(weights: Path, module: str, leaves: dict, tensors: dict, layer: dict, quantization: dict, base_shape) -> None:
    """A quantized LoRA layer's six tensors, their shapes and metadata, against the base."""
    out_dim, in_dim = base_shape
    if (layer["output_dims"], layer["input_dims"]) != (out_dim, in_dim):
        raise bad_file(weights, f"{module}: adapter_quantization says {layer['output_dims']}x{layer['input_dims']}, the base's is {out_dim}x{in_dim}")
    bits, rank = layer["bits"], layer["rank"]
    expected = {
        "lora_a": (rank, layer["padded_input_dims"] * bits // 32),
        "lora_a_scales": (rank, layer["padded_input_dims"] // quantization["group_size"]),
        "lora_b": (out_dim, layer["padded_rank"] * bits // 32),
        "lora_b_scales": (out_dim, layer["padded_rank"] // quantization["rank_group_size"]),
    }
    expected["lora_a_biases"], expected["lora_b_biases"] = expected["lora_a_scales"], expected["lora_b_scales"]
    for leaf, shape in expected.items():
        if leaf not in leaves:
            raise bad_file(weights, f"{module}.{leaf} is missing (a quantized LoRA layer has lora_a/lora_b, their scales and biases)")
        name = leaves[leaf]
        if tuple(tensors[name].shape) != shape:
            raise bad_file(weights, f"tensor {name} has shape {tuple(tensors[name].shape)}, its metadata needs {shape}")
        if leaf in ("lora_a", "lora_b") and tensors[name].dtype != "U32":
            raise bad_file(weights, f"tensor {name} is {tensors[name].dtype}; quantized LoRA matrices are packed uint32")


def _values(file: Path, tensors: dict) -> dict[str, np.ndarray]:
    """Every tensor as float32, read from the raw bytes (bfloat16 too, which numpy lacks)."""
    ranges = tensor_data_ranges(file)
    out = {}
    with file.open("rb") as handle:
        for name, info in tensors.items():
            start, end = ranges[name]
            handle.seek(start)
            raw = handle.read(end - start)
            if info.dtype == "U32":
                value = np.frombuffer(raw, "<u4").copy()
            elif info.dtype == "BF16":
                value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif info.dtype in ("F16", "F32", "F64"):
                value = np.frombuffer(raw, {"F16": np.float16, "F32": np.float32, "F64": np.float64}[info.dtype]).astype(np.float32)
            else:
                raise bad_file(file, f"tensor {name} has dtype {info.dtype}; LoRA tensors are floating point")
            out[name] = value.reshape(info.shape)
    return out


def _names_another_base(model: str | None, base, manifest_names: tuple[str, ...]) -> str | None:
    """Why the adapter's ``model`` is not the manifest's base (None when it looks like it)."""
    if not model:
        return None
    quantized = f"{model}, a quantized model: the adapter was trained against its quantized weights, not the base's own that the package uses"
    if re.search(r"-(3|4|6|8)bit$", model.rstrip("/")):
        return quantized
    try:  # a model named in the adapter's own config: a path that cannot be followed is just a name
        folder = Path(model).expanduser().resolve()
    except (RuntimeError, OSError, ValueError):
        folder = None
    if folder is not None and folder.is_dir():
        try:
            if "quantization" in json.loads((folder / "config.json").read_text()):
                return quantized
        except (OSError, ValueError):
            pass
        if folder == base.folder.resolve():
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
        raise bad_file(folder, f"no {WEIGHTS} (the weights mlx_lm.lora writes)")
    tensors = read_safetensors_header(weights)
    check_finite(weights, tensors)
    dora = config.get("fine_tune_type", "lora") == "dora"
    rank = config["lora_parameters"]["rank"]
    quantization = config.get("adapter_quantization") or {}
    quantized = quantization.get("layers", {})
    if dora and quantized:
        raise bad_file(folder / CONFIG, "adapter_quantization on a DoRA adapter: mlx-lm quantizes LoRA adapters only")
    expected = lora_modules(config, base.tensors)
    found: dict[str, dict[str, str]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if base.tower_of is not None:  # trained on the multimodal model: its language model's names
            module = text_name(module) or module
        misplaced = (leaf == "m" and not dora) or (leaf.endswith(("_scales", "_biases")) and module not in quantized)
        if leaf not in _LEAVES or module not in expected or misplaced:
            raise bad_file(weights, f"tensor {name} maps to no LoRA layer mlx-lm makes on this base (fine_tune_type "
                                f"{config.get('fine_tune_type', 'lora')}, num_layers {config['num_layers']}, keys "
                                f"{config['lora_parameters'].get('keys') or 'default'})")
        found.setdefault(module, {})[leaf] = name
    if not found:
        raise bad_file(weights, "holds no LoRA tensors")
    for module in quantized:
        if module not in found:
            raise bad_file(weights, f"adapter_quantization names {module}, which has no tensors here")
    for module, leaves in sorted(found.items()):
        kind = expected[module]
        out_dim, in_dim = base.tensors[f"{module}.weight"].shape
        if module in quantized:
            _check_quantized_layer(weights, module, leaves, tensors, quantized[module], quantization, (out_dim, in_dim))
            continue
        if kind == "embedding":
            if dora:
                raise bad_file(weights, f"{module}: DoRA on an embedding is not supported")
            shapes = {"lora_a": (out_dim, rank), "lora_b": (rank, in_dim)}
        else:
            shapes = {"lora_a": (in_dim, rank), "lora_b": (rank, out_dim), "m": (out_dim,)}
        required = ("lora_a", "lora_b", "m") if dora and kind == "linear" else ("lora_a", "lora_b")
        for leaf in required:
            if leaf not in leaves:
                raise bad_file(weights, f"{module}.{leaf} is missing (its module has {', '.join(sorted(leaves))})")
        for leaf, name in leaves.items():
            shape = tuple(tensors[name].shape)
            if shape != shapes[leaf]:
                hint = ""
                if leaf in ("lora_a", "lora_b") and rank not in shape and len(shape) == 2:
                    hint = f" (lora_parameters.rank is {rank})"
                raise bad_file(weights, f"tensor {name} has shape {shape}, the base needs {shapes[leaf]}{hint}")
    warnings = []
    reason = _names_another_base(config.get("model"), base, base_names)
    if reason:
        warnings.append(f"{folder / CONFIG}: model is {reason}")

    content_hash = sha256_files((folder / CONFIG, weights))  # over the files mlx-lm wrote, as for peft's
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
    quantization = config.get("adapter_quantization") or {}
    state = {}
    for module, leaves in sorted(found.items()):
        prefix = f"base_model.model.{module}"
        layer = quantization.get("layers", {}).get(module)
        if layer is not None:
            # as QuantizedLoRALinear.fuse: dequantized, padding cut, already in peft's layout
            a = dequantize(values[leaves["lora_a"]], values[leaves["lora_a_scales"]], values[leaves["lora_a_biases"]],
                           quantization["group_size"], layer["bits"])[:rank, : layer["input_dims"]]
            b = dequantize(values[leaves["lora_b"]], values[leaves["lora_b_scales"]], values[leaves["lora_b_biases"]],
                           quantization["rank_group_size"], layer["bits"])[:, :rank]
            state[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a)
            state[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b)
            continue
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

    def fill(incoming: Path) -> None:
        save_file(state, str(incoming / "adapter_model.safetensors"))
        (incoming / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True))

    written_once(target, fill)
