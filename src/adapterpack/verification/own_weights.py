"""The reference that proves a conversion exact whatever the compression: the PyTorch model
computed in float32, with the package's own weights read back from it.

A compressed function cannot match the float32 model closely (4 bits move a real checkpoint's
logits visibly), so measured against it, a conversion mistake smaller than the compression's own
error passes unseen. Measured against the same model holding the weights the package holds
(palettes, integers and scales decompressed, float16 values as stored), the package must agree
to float16 arithmetic whatever its compression: any op-level mistake (a wrong epsilon, rope base
or scale, a dropped bias) shows. Only the weights come from the package, matched by name to the
model's parameters; every other constant (epsilons, rope tables, scales, masks) the model
computes itself, as transformers does. A ``lora: keep`` function runs peft's adapter unmerged,
its LoRA matrices as the package stores them; a fused one is the base architecture holding the
fused weights.

The model is built on the meta device and given the package's arrays (no copy) and, for any
parameter the package does not name, the base's stored tensor: it never holds the base's
weights beside the package's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np

log = logging.getLogger(__name__)

# What the converter appends to a weight's traced name: compressed forms (constexpr ops), and
# casts it folded into the constant.
SUFFIXES = ("", "_palettized", "_quantized", "_sparsified", "_to_fp16", "_to_fp32", "_promoted")
# The traced decoder holds the Hugging Face model as ``hf`` (convert.export_decoder).
PREFIX = "hf_"


def traced_name(parameter: str) -> str:
    """The name a parameter's constant has in the traced program (``model.layers.0.mlp.up_proj.weight``
    -> ``hf_model_layers_0_mlp_up_proj_weight``)."""
    return PREFIX + parameter.replace(".", "_")


def package_value(values: dict[str, np.ndarray], parameter: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The package's array for ``parameter`` (of ``shape``), or None when it holds none."""
    for suffix in SUFFIXES:
        found = values.get(traced_name(parameter) + suffix)
        if found is not None and tuple(found.shape) == tuple(shape):
            return found
    return None


def _tensor(array: np.ndarray):
    import warnings

    import torch

    with warnings.catch_warnings():  # the executor's arrays are read-only: nothing writes them here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _skeleton(checked, values: dict[str, np.ndarray]):
    """The base architecture holding the package's arrays where it names them, the base's stored
    tensors elsewhere; (model, the parameters taken from the package)."""
    import torch
    from safetensors import safe_open

    from adapterpack.convert.base_model import meta_model
    from adapterpack.verification.reference import stored_dtype

    model = meta_model(checked.base.folder, stored_dtype(checked.base))
    state, taken = {}, []
    for name, parameter in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        # A module a kept adapter wraps keeps its base weight under ``base_layer`` in the program.
        found = package_value(values, name, parameter.shape)
        if found is None:
            found = package_value(values, f"{module}.base_layer.{leaf}", parameter.shape)
        if found is not None:
            state[name] = _tensor(found)
            taken.append(name)
            continue
        info = checked.base.tensors.get(name)
        if info is None:
            raise KeyError(f"{name}: neither the package nor the base holds it")
        with safe_open(str(info.file), framework="pt") as handle:
            state[name] = handle.get_tensor(name)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        # A tied head the package stores apart from the embedding (compressed otherwise): untied.
        found = package_value(values, name, parameter.shape) if name not in state else None
        if found is not None and found.__array_interface__["data"][0] != parameter.data_ptr():
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, torch.nn.Parameter(_tensor(found), requires_grad=False))
            taken.append(name)
    _materialize_buffers(model)
    return model.eval(), taken


def _materialize_buffers(model) -> None:
    """Modules whose buffers are still on the meta device (computed, not stored) made again on
    the CPU: rotary frequencies from the config; Gemma's embedding scale from its own record."""
    import torch

    for name, module in list(model.named_modules()):
        if not any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            continue
        if hasattr(module, "scalar_embed_scale"):  # Gemma3TextScaledWordEmbedding: sqrt(hidden)
            module.embed_scale = torch.tensor(module.scalar_embed_scale)
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, type(module)(config=module.config))


@contextlib.contextmanager
def own_weights_model(checked, function: str, values: dict[str, np.ndarray]) -> Iterator[tuple[object, list[str]]]:
    """(function ``function``'s PyTorch reference holding the package's weights ``values`` (by
    the program's names, ``ProgramExecutor.known_values``), the parameters taken from the
    package); computing in float32 (``reference.computed_in_float32``)."""
    import torch

    from adapterpack.convert.lora import applied_adapter
    from adapterpack.verification.reference import computed_in_float32

    manifest = checked.manifest
    model, taken = _skeleton(checked, values)
    adapter = manifest.adapter(function)
    kept = adapter is not None and manifest.lora_mode(function) == "keep"
    applied = (
        applied_adapter(model, checked.adapters[function].folder, mode="keep", scale=float(adapter.scale))
        if kept
        else contextlib.nullcontext(model)
    )
    with torch.no_grad(), applied as reference:
        if kept:  # the LoRA matrices as the package stores them, widened already: peft casts
            # a branch's input to its matrices' dtype before their module runs
            for name, parameter in reference.named_parameters():
                if ".lora_" in name:
                    found = package_value(values, name, parameter.shape)
                    if found is not None:
                        parameter.data = _tensor(found).to(parameter.dtype)
                        taken.append(name)
        with computed_in_float32(reference):
            yield reference, taken


def own_weights_logits(checked, function: str, values: dict[str, np.ndarray], sequences: list[np.ndarray]) -> list[np.ndarray]:
    """Logits (tokens, vocab) of ``function``'s reference holding the package's weights, for each
    token sequence of ``sequences``."""
    import torch

    found = []
    with own_weights_model(checked, function, values) as (model, taken):
        log.debug("%s: %d parameters from the package", function, len(taken))
        for ids in sequences:
            found.append(model(torch.from_numpy(np.asarray(ids, np.int64)[None, :])).logits[0].float().numpy())
    return found
