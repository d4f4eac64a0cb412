"""Do the weights fit float16? Core ML stores them (and a kept adapter's LoRA matrices) in
float16, whose largest finite value is 65504: a bfloat16 or float32 base, or a fused adapter's
delta, can hold more, and conversion then fails deep inside the tracer or silently stores inf.

Checked before any conversion, from the files alone (no torch): each tensor's largest magnitude
is read from its raw bits (an IEEE float's magnitude orders like its bits without the sign, so
the largest masked bit pattern is the largest magnitude, and NaN/inf sort above every finite
value). A fused weight W + s * B @ A is bounded by max|W| + s * r * max|B| * max|A|; only when
that bound does not fit is the fused weight computed (``convert.lora.fused_magnitudes``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.inputs.safetensors import TensorInfo, tensor_chunks, tensor_data_ranges

FLOAT16_MAX = 65504.0


# dtype -> (bits as unsigned integers, sign mask removed, the float type to read the bits back)
_MAGNITUDE_BITS = {
    "F16": (np.uint16, 0x7FFF, np.float16, 0),
    "BF16": (np.uint16, 0x7FFF, np.float32, 16),  # the high half of a float32
    "F32": (np.uint32, 0x7FFF_FFFF, np.float32, 0),
    "F64": (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, np.float64, 0),
}


_CHUNK = 1 << 24


def tensor_magnitudes(tensors: Mapping[str, TensorInfo]) -> dict[str, float]:
    """{name: largest |value|} of every float16/bfloat16/float32/float64 tensor (nan when it
    holds a NaN, inf for an infinity); other dtypes are left out."""
    found: dict[str, float] = {}
    by_file: dict[Path, list[str]] = {}
    for name, info in tensors.items():
        if info.dtype in _MAGNITUDE_BITS:
            by_file.setdefault(info.file, []).append(name)
    for file, names in by_file.items():
        ranges = tensor_data_ranges(file)
        try:
            with open(file, "rb") as handle:
                for name in names:
                    start, end = ranges[name]
                    found[name] = _largest(handle, start, end - start, tensors[name].dtype)
        except OSError as error:
            raise BadInput(f"{file}: cannot read: {error.strerror or error}") from None
    return found


def _largest(handle, start: int, length: int, dtype: str) -> float:
    bits, mask, floats, shift = _MAGNITUDE_BITS[dtype]
    largest = 0
    for _, chunk in tensor_chunks(handle, start, length, _CHUNK):
        values = np.frombuffer(chunk, dtype=bits)
        if values.size:
            largest = max(largest, int(np.bitwise_and(values, bits(mask)).max()))
    if shift:
        return float(np.array([largest << shift], np.uint32).view(floats)[0])
    return float(np.array([largest], bits).view(floats)[0])


def fits(magnitude: float) -> bool:
    return magnitude <= FLOAT16_MAX  # False for nan


def describe(magnitude: float) -> str:
    if math.isnan(magnitude):
        return "holds NaN"
    if math.isinf(magnitude):
        return "holds inf"
    return f"largest magnitude {magnitude:.6g} > {FLOAT16_MAX:.0f}"


def check_base(magnitudes: Mapping[str, float], tensors: Mapping[str, TensorInfo]) -> None:
    """BadInput naming the first base tensor that does not fit float16."""
    for name in sorted(magnitudes):
        if not fits(magnitudes[name]):
            info = tensors[name]
            raise BadInput(
                f"{info.file}: tensor {name} ({info.dtype}) {describe(magnitudes[name])}: it does not fit float16, "
                "which Core ML stores weights in; rescale the weight (or fix the checkpoint) before packaging"
            )


def check_adapter_tensors(tensors: Mapping[str, TensorInfo], why: str) -> None:
    """BadInput naming the first adapter tensor that does not fit float16 (``why``: where it is stored so)."""
    magnitudes = tensor_magnitudes(tensors)
    for name in sorted(magnitudes):
        if not fits(magnitudes[name]):
            raise BadInput(
                f"{tensors[name].file}: tensor {name} ({tensors[name].dtype}) {describe(magnitudes[name])}: "
                f"it does not fit float16, which {why} is stored in"
            )


def lora_roles(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, str]]:
    """{base module: {role: adapter tensor name}} of a peft adapter, role one of lora_A.weight,
    lora_B.weight, lora_B.bias, lora_embedding_A, lora_embedding_B, lora_magnitude_vector."""
    modules: dict[str, dict[str, str]] = {}
    for key in tensors:
        module, found, role = key.removeprefix("base_model.model.").partition(".lora_")
        if found:
            role = "lora_" + (role.removesuffix(".weight") if "magnitude" in role else role)
            modules.setdefault(module, {})[role] = key
    return modules


def fused_bounds(
    config: Mapping, tensors: Mapping[str, TensorInfo], scale: float, base_magnitudes: Mapping[str, float]
) -> dict[str, float]:
    """{base tensor: an upper bound of |fused value|} for each weight (and LoRA-changed bias) a
    peft adapter changes when fused with the manifest's ``scale``.

    Conservative: the largest alpha of the config and its alpha pattern, and the rank read from
    the tensor's shape, give the largest scaling peft can use; |(B @ A)_ij| <= r max|B| max|A|;
    DoRA rescales each row to its magnitude entry, so |W'_ij| <= max|m|."""
    roles = lora_roles(tensors)
    magnitudes = tensor_magnitudes({key: tensors[key] for parts in roles.values() for key in parts.values()})
    alphas = [float(config.get("lora_alpha") or 8), *(float(v) for v in (config.get("alpha_pattern") or {}).values())]
    alpha = max(alphas)
    bounds: dict[str, float] = {}
    for module, parts in roles.items():
        largest = {role: magnitudes.get(key, 0.0) for role, key in parts.items()}
        a, b = ("lora_A.weight", "lora_B.weight") if "lora_A.weight" in parts else ("lora_embedding_A", "lora_embedding_B")
        if a not in parts or b not in parts:
            continue
        rank = tensors[parts[a]].shape[0]
        scaling = abs(scale) * alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        if "lora_magnitude_vector" in parts:
            bounds[f"{module}.weight"] = largest["lora_magnitude_vector"]
        else:
            bounds[f"{module}.weight"] = base_magnitudes.get(f"{module}.weight", 0.0) + scaling * rank * largest[a] * largest[b]
        if "lora_B.bias" in parts:
            bounds[f"{module}.bias"] = base_magnitudes.get(f"{module}.bias", 0.0) + scaling * largest["lora_B.bias"]
    return bounds

