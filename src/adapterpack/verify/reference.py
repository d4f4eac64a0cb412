"""The references: logits of the float32 base, and of the base with each adapter applied by peft
and not merged, computed before any function runs and freed after.

The base is loaded at the precision it is stored in (a float16 model maps its safetensors and
costs 2 bytes a parameter, not 4), and every module computes in float32 while it runs: its own
weights are widened just for its forward and put back after. The arithmetic is that of the
float32 model (widening float16 or bfloat16 is exact), but only one weight at a time is ever
held in float32: a 3B model's reference needs its 6 GB of float16, not 12.8 GB of float32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import numpy as np

from adapterpack.verify.drives import verification_tokens

log = logging.getLogger(__name__)

# safetensors dtype -> the torch dtype the base is loaded in (anything else: float32)
STORED_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def stored_dtype(base_info) -> str:
    """The one floating dtype every weight of the base is stored in, else float32."""
    found = {STORED_DTYPES.get(info.dtype, "float32") for info in base_info.tensors.values() if info.dtype.startswith(("F", "BF"))}
    return found.pop() if len(found) == 1 else "float32"


@contextlib.contextmanager
def computed_in_float32(model) -> Iterator[None]:
    """Every module that owns parameters runs its forward with them in float32, widened on
    entry and restored on exit (also when the forward fails)."""
    import torch

    stashed: dict[torch.nn.Parameter, torch.Tensor] = {}

    def widen(module, _args) -> None:
        for parameter in module.parameters(recurse=False):
            if parameter.dtype != torch.float32 and parameter not in stashed:
                stashed[parameter] = parameter.data
                parameter.data = parameter.data.float()

    def restore(module, _args, _output) -> None:
        for parameter in module.parameters(recurse=False):
            original = stashed.pop(parameter, None)
            if original is not None:
                parameter.data = original

    handles = []
    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(widen))
            handles.append(module.register_forward_hook(restore))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for parameter, original in stashed.items():
            parameter.data = original
        stashed.clear()


def reference_logits(checked, names: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(tokens, base logits, {adapter function: logits}) from the PyTorch base computed in
    float32, with each adapter applied by peft unmerged. Everything torch holds is gone when
    this returns."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    # The Swift client's mask is one slot wider than the tokens, so it holds max_context - 1 of them.
    tokens = verification_tokens(int(base.config.vocab_size), manifest.verify)[: manifest.export.max_context - 1]
    ids = torch.from_numpy(tokens[None, :])
    with torch.no_grad(), computed_in_float32(base):
        base_reference = base(ids).logits[0].float().numpy()
    references = {}
    for name in names:
        adapter = manifest.adapter(name)
        if adapter is None:
            continue
        folder = checked.adapters[name].folder
        with torch.no_grad(), applied_adapter(base, folder, mode="unmerged", scale=float(adapter.scale)) as model:
            with computed_in_float32(model):
                references[name] = model(ids).logits[0].float().numpy()
    return tokens, base_reference, references


@contextlib.contextmanager
def reference_model(checked, name: str) -> Iterator[object]:
    """The PyTorch reference of function ``name`` (the manifest's adapter, or the base for the
    base function), as verification computes it: the base at its stored precision computing in
    float32, the adapter applied by peft and not merged. Freed on exit."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    adapter = manifest.adapter(name)
    applied = (
        applied_adapter(base, checked.adapters[name].folder, mode="unmerged", scale=float(adapter.scale))
        if adapter is not None
        else contextlib.nullcontext(base)
    )
    with torch.no_grad(), applied as model, computed_in_float32(model):
        yield model
