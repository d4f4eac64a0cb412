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
from typing import Iterator, Literal

import torch

from .errors import BadInput

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"


def _lora_layers(model: torch.nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


@contextmanager
def applied_adapter(
    base: torch.nn.Module,
    adapter_folder: Path,
    *,
    mode: Literal["fuse", "keep", "unmerged"],
    scale: float = 1.0,
) -> Iterator[torch.nn.Module]:
    """Yield ``base`` with the adapter applied; restore ``base`` exactly on exit.

    ``fuse``: weights merged (plain ``nn.Linear`` layers). ``keep``/``unmerged``: peft LoRA layers
    left in the model (the peft reference used by tests and verification is ``unmerged``).
    """
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

    originals: dict[str, torch.Tensor] = {}
    try:
        if mode == "fuse":
            for name, layer in layers:
                originals[name] = layer.get_base_layer().weight.detach().clone()
            merged = peft_model.merge_and_unload(safe_merge=True)
            yield merged
        else:
            yield peft_model.base_model.model
    finally:
        if mode == "fuse":
            modules = dict(base.named_modules())
            for name, weight in originals.items():
                # merge_and_unload put the (merged) base layers back under the same names.
                target = modules[name.removeprefix("base_model.model.")]
                with torch.no_grad():
                    target.weight.copy_(weight)
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
