"""The references: logits of the float32 base, and of the base with each adapter applied by peft
and not merged, computed before any function runs and freed after.
"""

from __future__ import annotations

import logging

import numpy as np

from adapterpack.verify.drives import verification_tokens

log = logging.getLogger(__name__)


def reference_logits(checked, names: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(tokens, base logits, {adapter function: logits}) from the float32 PyTorch base, with each
    adapter applied by peft unmerged. Everything torch holds is gone when this returns."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder)
    # The Swift client's mask is one slot wider than the tokens, so it holds max_context - 1 of them.
    tokens = verification_tokens(int(base.config.vocab_size), manifest.verify)[: manifest.export.max_context - 1]
    ids = torch.from_numpy(tokens[None, :])
    with torch.no_grad():
        base_reference = base(ids).logits[0].float().numpy()
    references = {}
    for name in names:
        adapter = manifest.adapter(name)
        if adapter is None:
            continue
        folder = checked.adapters[name].folder
        with torch.no_grad(), applied_adapter(base, folder, mode="unmerged", scale=float(adapter.scale)) as model:
            references[name] = model(ids).logits[0].float().numpy()
    return tokens, base_reference, references
