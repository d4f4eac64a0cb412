"""Apply a peft LoRA adapter to the one in-memory base model, and take it off again exactly.

The base is loaded once per build. Each function applies its adapter inside ``applied_adapter``:
``fuse`` merges with peft (``merge_and_unload``) and afterwards copies the saved original weights
back bit for bit (peft's unmerge subtracts the delta in floating point, which is not exact and
would stop identical base weights from deduplicating); ``keep`` leaves peft's LoRA layers in place
so the exported function computes ``W x + scale * B (A x)`` with the base weights untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch

from adapterpack.errors import BadInput

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


def _scale(layers, scale: float) -> None:
    """The manifest's per-adapter ``scale``, applied to peft's own scaling of every LoRA layer."""
    if scale != 1.0:
        for _, layer in layers:
            layer.scale_layer(scale)


def peft_config(adapter_folder: Path):
    """peft's own reading of the folder's adapter_config.json. The input checks look at the
    fields the shape checks rely on; peft checks the rest when it builds its config (a nested
    config such as ``arrow_config`` of the wrong type is a TypeError there), and any refusal of
    the file is bad input, named, not an internal error."""
    from peft import PeftConfig

    try:
        return PeftConfig.from_pretrained(str(adapter_folder))
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise BadInput(f"{adapter_folder / 'adapter_config.json'}: peft refuses this adapter config: {error}") from None


def _with_adapter(base: torch.nn.Module, adapter_folder: Path, scale: float):
    """(peft model, its LoRA layers) for ``base`` with the adapter loaded and scaled."""
    from peft import PeftModel

    config = peft_config(adapter_folder)
    try:
        peft_model = PeftModel.from_pretrained(
            base, str(adapter_folder), adapter_name=ADAPTER_NAME, is_trainable=False, config=config
        )
    except (ValueError, KeyError, RuntimeError) as error:
        raise BadInput(f"{adapter_folder}: peft cannot apply this adapter to the base: {error}") from None
    peft_model.eval()
    layers = _lora_layers(peft_model)
    if not layers:
        peft_model.unload()
        raise BadInput(f"{adapter_folder}: the adapter targets no layer of the base")
    _scale(layers, scale)
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
        _forget_peft(base)


def _forget_peft(base: torch.nn.Module) -> None:
    # peft leaves its bookkeeping on the base; the next adapter must start from a clean model.
    for attribute in ("peft_config", "_hf_peft_config_loaded"):
        if hasattr(base, attribute):
            try:
                delattr(base, attribute)
            except AttributeError:
                pass


# The batch row of ``applied_side_by_side`` that runs the base alone (peft's own name for it).
BASE_ROW = "__base__"


@contextmanager
def applied_side_by_side(base: torch.nn.Module, adapters: dict[str, tuple[Path, float]]) -> Iterator[tuple[torch.nn.Module, dict[str, str]]]:
    """Yield (a model: ``base`` with every adapter of ``adapters`` ({function: (folder, scale)})
    loaded unmerged beside the others, {function: its adapter's name in peft}); restore ``base``
    on exit. Call the model with ``adapter_names``: one name per batch row.

    One forward then runs every adapter and the base at once, each batch row under its own
    (peft's mixed-batch ``adapter_names``, with ``BASE_ROW`` for the base): the base's weights
    are read once for all of them. peft computes each row as the adapter alone would (the base
    layer over the whole batch, each adapter's branch over its rows). Not for DoRA, which peft
    refuses to mix, nor ``modules_to_save``, whose whole-module copies would all be held at once.
    """
    from peft import PeftModel

    # peft's names are ours, not the functions': a function may be called "__base__" or "default"
    named = {function: f"adapter_{index}" for index, function in enumerate(adapters)}
    peft_model = None
    try:
        for function, (folder, _) in adapters.items():
            config = peft_config(folder)
            try:
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(
                        base, str(folder), adapter_name=named[function], is_trainable=False, config=config
                    )
                else:
                    peft_model.load_adapter(str(folder), adapter_name=named[function], is_trainable=False)
            except (ValueError, KeyError, RuntimeError) as error:
                raise BadInput(f"{folder}: peft cannot apply this adapter to the base: {error}") from None
        if peft_model is None:
            yield base, {}
            return
        peft_model.eval()
        for _, layer in _lora_layers(peft_model):
            for function, (_, scale) in adapters.items():
                if named[function] in layer.scaling and scale != 1.0:
                    layer.scaling[named[function]] *= scale  # peft's scale_layer, for one adapter of several
        yield peft_model, named
    finally:
        if peft_model is not None:
            peft_model.unload()
        _forget_peft(base)


def fused_weight_changes(
    base_info, adapter_info, *, scale: float, dtype: torch.dtype = torch.float16
) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """{tensor name: (base value, fused value)} in ``dtype`` for every tensor the adapter changes
    (each targeted module's weight, and its bias where a LoRA bias changes it), computed without
    loading the base model.

    peft is injected into a model made of the targeted modules alone, holding the base's weights
    at their stored precision (read from the safetensors), so deltas, scaling and DoRA are
    peft's own and W + delta is rounded to float16 once. Returns None when the adapter changes
    more than the modules its LoRA weights target (``modules_to_save`` replaces whole modules);
    callers then apply it to the loaded base.
    """
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors import safe_open

    if adapter_info.modules_to_save:
        return None
    embeddings = {key.split(".lora_embedding_")[0].removeprefix("base_model.model.") for key in adapter_info.tensors if ".lora_embedding_" in key}
    root = torch.nn.Module()
    originals: dict[str, torch.Tensor] = {}
    for target in adapter_info.target_modules:
        stored = {}
        for name in ("weight", "bias"):
            info = base_info.tensors.get(f"{target}.{name}")
            if info is not None:
                with safe_open(str(info.file), framework="pt") as handle:
                    stored[name] = handle.get_tensor(f"{target}.{name}")
        weight = stored.get("weight")
        if weight is None or weight.ndim != 2:
            return None
        if target in embeddings:
            module = torch.nn.Embedding(*weight.shape, device="meta")
        else:
            module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in stored, device="meta")
        for name, value in stored.items():
            setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
        parent = root
        *path, leaf = target.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, module)
        originals.update({f"{target}.{name}": value.to(dtype) for name, value in stored.items()})

    config = peft_config(adapter_info.folder)
    try:
        inject_adapter_in_model(config, root, adapter_name=ADAPTER_NAME)
        state = {key.removeprefix("base_model.model."): value for key, value in load_peft_weights(str(adapter_info.folder)).items()}
        loaded = set_peft_model_state_dict(root, state, adapter_name=ADAPTER_NAME)
    except (ValueError, KeyError, RuntimeError) as error:
        raise BadInput(f"{adapter_info.folder}: peft cannot apply this adapter to the base: {error}") from None
    layers = _lora_layers(root)
    if getattr(loaded, "unexpected_keys", None) or {name for name, _ in layers} != set(adapter_info.target_modules):
        return None  # the adapter reaches beyond its LoRA targets: let the whole model take it
    _scale(layers, scale)
    with torch.no_grad():
        fused = _fused_weights(layers, None, dtype)
        if fused is not None:
            changes = {f"{target}.weight": (originals[f"{target}.weight"], fused[target]) for target in adapter_info.target_modules}
            return _finite(changes, adapter_info.origin)
        # DoRA, LoRA biases, embeddings: peft's own merge, at the stored precision
        changes = {}
        for name, layer in layers:
            layer.merge(safe_merge=True, adapter_names=[ADAPTER_NAME])
            for tensor, value in layer.get_base_layer().named_parameters(recurse=False):
                new = value.detach().to(dtype)
                old = originals[f"{name}.{tensor}"]
                if tensor == "weight" or not torch.equal(old, new):  # a LoRA bias changes the bias
                    changes[f"{name}.{tensor}"] = (old, new)
    return _finite(changes, adapter_info.origin)


def _finite(changes: dict, folder: Path) -> dict:
    """``changes``, or BadInput when a fused value does not fit its type (float16: > 65504)."""
    for tensor, (_, new) in changes.items():
        if new.is_floating_point() and not bool(torch.isfinite(new).all()):
            raise BadInput(
                f"{folder}: fusing this adapter makes {tensor} overflow {str(new.dtype).removeprefix('torch.')} "
                "(a fused value beyond 65504 or NaN): lower the adapter's scale or use lora: keep"
            )
    return changes


def fused_magnitudes(base_info, adapter_info, *, scale: float) -> dict[str, float] | None:
    """{tensor: largest |fused value|}, computed in float32, for the tensors the adapter
    changes; None when it changes more than its LoRA targets (see ``fused_weight_changes``)."""
    changes = fused_weight_changes(base_info, adapter_info, scale=scale, dtype=torch.float32)
    if changes is None:
        return None
    return {tensor: float(new.abs().max()) if new.numel() else 0.0 for tensor, (_, new) in changes.items()}
