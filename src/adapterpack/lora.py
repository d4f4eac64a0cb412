"""Apply a peft LoRA adapter to the one in-memory base model, and take it off again exactly.

The base is loaded once per build. Each function applies its adapter inside ``applied_adapter``:
``fuse`` merges with peft (``merge_and_unload``) and afterwards copies the saved original weights
back bit for bit (peft's unmerge subtracts the delta in floating point, which is not exact and
would stop identical base weights from deduplicating); ``keep`` leaves peft's LoRA layers in place
so the exported function computes ``W x + scale * B (A x)`` with the base weights untouched.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch

from .errors import BadInput

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"


def _lora_layers(model: torch.nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def _fused_weights(
    layers, original_weight: Callable[[str], torch.Tensor] | None, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor] | None:
    """New weights W + delta for every LoRA layer, computed in float32 and stored in ``dtype``
    (default: the in-memory W's dtype).

    The delta comes from peft (``get_delta_weight``: scaling, rsLoRA and rank/alpha patterns as
    peft defines them). With a float16 base, W is re-read in its original precision via
    ``original_weight`` so the sum is rounded once, exactly as merging a float32 base and
    converting to float16 would. Returns None when a layer needs peft's own merge (DoRA, LoRA
    biases, embeddings), which then runs instead.
    """
    fused = {}
    for name, layer in layers:
        base_layer = layer.get_base_layer()
        if (
            not isinstance(base_layer, torch.nn.Linear)
            or any(getattr(layer, "use_dora", {}).values())
            or any(getattr(layer, "lora_bias", {}).values())
        ):
            return None
        module = name.removeprefix("base_model.model.")
        weight = original_weight(module) if original_weight is not None else None
        if weight is None or weight.shape != base_layer.weight.shape:
            weight = base_layer.weight
        delta = layer.get_delta_weight(ADAPTER_NAME).to(torch.float32)
        fused[module] = (weight.to(torch.float32) + delta).to(dtype or base_layer.weight.dtype)
    return fused


def _with_adapter(base: torch.nn.Module, adapter_folder: Path, scale: float):
    """(peft model, its LoRA layers) for ``base`` with the adapter loaded and scaled."""
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(
            base, str(adapter_folder), adapter_name=ADAPTER_NAME, is_trainable=False
        )
    except (ValueError, KeyError, RuntimeError) as error:
        raise BadInput(f"{adapter_folder}: peft cannot apply this adapter to the base: {error}") from None
    peft_model.eval()
    layers = _lora_layers(peft_model)
    if not layers:
        peft_model.unload()
        raise BadInput(f"{adapter_folder}: the adapter targets no layer of the base")
    if scale != 1.0:
        for _, layer in layers:
            layer.scale_layer(scale)
    return peft_model, layers


@contextmanager
def applied_adapter(
    base: torch.nn.Module,
    adapter_folder: Path,
    *,
    mode: Literal["fuse", "keep", "unmerged"],
    scale: float = 1.0,
    original_weight: Callable[[str], torch.Tensor] | None = None,
) -> Iterator[torch.nn.Module]:
    """Yield ``base`` with the adapter applied; restore ``base`` exactly on exit.

    ``fuse``: weights merged (plain ``nn.Linear`` layers). ``keep``/``unmerged``: peft LoRA layers
    left in the model (the peft reference used by tests and verification is ``unmerged``).
    ``original_weight(module_name)`` returns a base weight in its stored precision (used when the
    in-memory base is float16, so fusing rounds once).
    """
    peft_model, layers = _with_adapter(base, adapter_folder, scale)

    originals: dict[str, torch.Tensor] = {}
    try:
        if mode == "fuse":
            for name, layer in layers:
                originals[name.removeprefix("base_model.model.")] = layer.get_base_layer().weight.detach().clone()
            with torch.no_grad():
                fused = _fused_weights(layers, original_weight)
                if fused is None:
                    merged = peft_model.merge_and_unload(safe_merge=True)
                else:
                    merged = peft_model.unload()
                    modules = dict(merged.named_modules())
                    for module, weight in fused.items():
                        modules[module].weight.copy_(weight)
                    del fused
            yield merged
        else:
            yield peft_model.base_model.model
    finally:
        if mode == "fuse":
            # The base layers are back under their own names, holding fused weights.
            modules = dict(base.named_modules())
            with torch.no_grad():
                for module, weight in originals.items():
                    modules[module].weight.copy_(weight)
        else:
            peft_model.unload()
        # peft leaves its bookkeeping on the base; the next adapter must start from a clean model.
        for attribute in ("peft_config", "_hf_peft_config_loaded"):
            if hasattr(base, attribute):
                try:
                    delattr(base, attribute)
                except AttributeError:
                    pass


def adapted_weight_names(base: torch.nn.Module, adapter_folder: Path) -> list[str]:
    """Names of the base weights an adapter changes when fused (for size reports)."""
    with applied_adapter(base, adapter_folder, mode="keep") as model:
        return [f"{name}.weight" for name, _ in _lora_layers(model)]


def fused_weight_changes(
    base_info, adapter_folder: Path, *, scale: float, targets: list[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{module: (base weight, fused weight)} in float16 for every module the adapter targets,
    computed without loading the base model.

    The model is built on the meta device (no memory) and only the targeted modules are
    materialized, from the safetensors at their stored precision; peft is applied to that
    skeleton, so deltas, scaling and DoRA are peft's own, and W + delta is rounded to float16
    once. Returns None when the adapter needs more of the model than the modules it targets
    (``modules_to_save`` replaces whole modules); callers then use the loaded base.
    """
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from .quiet import captured_output

    adapter_config = json.loads((adapter_folder / "adapter_config.json").read_text())
    if adapter_config.get("modules_to_save"):
        return None
    with captured_output():
        config = AutoConfig.from_pretrained(str(base_info.folder), local_files_only=True, trust_remote_code=False)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    skeleton.eval()
    originals: dict[str, torch.Tensor] = {}
    for target in targets:
        module = skeleton.get_submodule(target)
        module.to_empty(device="cpu")
        for name, parameter in module.named_parameters(recurse=False):
            info = base_info.tensors.get(f"{target}.{name}")
            if info is None:
                return None
            with safe_open(str(info.file), framework="pt") as handle:
                parameter.data = handle.get_tensor(f"{target}.{name}")
            parameter.requires_grad_(False)
        originals[target] = module.weight.detach().to(torch.float16)
    peft_model, layers = _with_adapter(skeleton, adapter_folder, scale)
    with torch.no_grad():
        fused = _fused_weights(layers, None, torch.float16)
        if fused is None:  # DoRA, LoRA biases: peft's own merge, at the stored precision
            merged = dict(peft_model.merge_and_unload(safe_merge=True).named_modules())
            fused = {t: merged[t].weight.detach().to(torch.float16) for t in targets}
    if set(fused) != set(targets) or any(value.is_meta for value in fused.values()):
        return None
    return {t: (originals[t], fused[t]) for t in targets}
