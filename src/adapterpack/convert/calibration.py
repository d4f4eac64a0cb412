"""Activation statistics of a torch model on calibration text: what data-aware palettes weigh by.

One forward per window, in float32, with a hook on every linear layer adding up the square of
each input channel. Each text counts equally (its own mean, then the mean over texts), so a long
base text does not drown a skill's short one.

    energies = channel_energies(base, [token_ids_of_text_a, token_ids_of_text_b], window=512)
"""

from __future__ import annotations

import numpy as np


def channel_energies(model, texts: list[list[int]], window: int) -> dict[str, np.ndarray]:
    """{linear module path: mean square of each input channel}, over ``texts`` (token ids each),
    read in windows of ``window`` tokens."""
    import torch
    from torch import nn

    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    totals = {name: torch.zeros(module.in_features, dtype=torch.float64) for name, module in linears.items()}
    means = {name: torch.zeros(module.in_features, dtype=torch.float64) for name, module in linears.items()}

    def hook(name):
        def add(module, args):
            value = args[0].detach().to(torch.float64)
            totals[name].add_((value * value).reshape(-1, value.shape[-1]).sum(dim=0))

        return add

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in linears.items()]
    counted = 0
    try:
        with torch.no_grad():
            for ids in texts:
                if not ids:
                    continue
                for total in totals.values():
                    total.zero_()
                for start in range(0, len(ids), window):
                    model(torch.tensor([ids[start : start + window]]))
                for name, total in totals.items():
                    means[name] += total / len(ids)
                counted += 1
    finally:
        for handle in handles:
            handle.remove()
    return {name: (mean / max(counted, 1)).numpy() for name, mean in means.items()}
