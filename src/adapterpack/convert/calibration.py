"""Activation statistics of a torch model on calibration text: what data-aware palettes weigh by.

One forward per window, in float32, with a hook on every linear layer adding up the square of
each input channel. Each text counts equally (its own mean, then the mean over texts), so a long
base text does not drown a skill's short one.

    energies = channel_energies(base, [token_ids_of_text_a, token_ids_of_text_b], window=512)
    grams = input_grams(base, texts, window=512, modules=["model.layers.0.mlp.down_proj", ...])
    texts = generated_texts(base, count=16, tokens=128, seed=0, top_p=0.9)   # where no text is named
"""

from __future__ import annotations

import numpy as np


def linear_widths(model) -> dict[str, int]:
    """{linear module path: its input width}: the layers ``channel_energies`` measures."""
    from torch import nn

    return {name: module.in_features for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def channel_energies(model, texts: list[list[int]], window: int) -> dict[str, np.ndarray]:
    """{linear module path: mean square of each input channel}, over ``texts`` (token ids each),
    read in windows of ``window`` tokens."""
    return channel_statistics(model, texts, window)[0]


def input_grams(model, texts: list[list[int]], window: int, modules: list[str]) -> dict[str, np.ndarray]:
    """{linear module path: mean of ``x x^T`` over its inputs ``x``} (float32, (in, in)) for each
    of ``modules``, over ``texts`` read as ``channel_energies`` reads them (whose result is these
    matrices' diagonals). Modules fed the same tensor (a layer's q/k/v projections, its gate and
    up projections) share one array, measured once."""
    return channel_statistics(model, texts, window, modules, energies=False)[1]


def channel_statistics(
    model, texts: list[list[int]], window: int, gram_modules: list[str] | tuple[str, ...] = (), *, energies: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``channel_energies`` and the ``input_grams`` of ``gram_modules`` in one pass over the texts:
    a build that compensates measures both with one forward per window, where measuring the Grams
    later cost a second forward (at 3B, 243 s on a palette worker's single thread)."""
    totals: dict[tuple[str, str], object] = {}
    means: dict[tuple[str, str], object] = {}
    site_of: dict[str, str] = {}  # module -> the module whose input it shares (itself if none)
    # The input the last hooked module was called with, held so that its memory cannot be reused
    # by another tensor: projections of one input run one after the other (q, k, v; gate, up).
    last: list = [None, None]  # [tensor, module]
    handles = (_energy_hooks(model, totals, means) if energies else []) + _gram_hooks(model, set(gram_modules), totals, means, site_of, last)
    try:
        found = _text_means(model, texts, window, totals, means)
    finally:
        last[0] = None
        for handle in handles:
            handle.remove()
    measured_energies = {name: value for (kind, name), value in found.items() if kind == "energy"}
    grams = {name: found[("gram", site)] for name, site in site_of.items() if ("gram", site) in found}
    return measured_energies, grams


def _energy_hooks(model, totals: dict, means: dict) -> list:
    """Hooks adding each linear layer's squared input channels into ``totals[("energy", name)]``."""
    import torch
    from torch import nn

    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    for name, module in linears.items():
        totals["energy", name] = torch.zeros(module.in_features, dtype=torch.float64)
        means["energy", name] = torch.zeros(module.in_features, dtype=torch.float64)

    def hook(name):
        def add(module, args):
            value = args[0].detach().to(torch.float64)
            totals["energy", name].add_((value * value).reshape(-1, value.shape[-1]).sum(dim=0))

        return add

    return [module.register_forward_pre_hook(hook(name)) for name, module in linears.items()]


def _gram_hooks(model, wanted: set[str], totals: dict, means: dict, site_of: dict, last: list) -> list:
    """Hooks adding ``x^T x`` of each wanted module's input into ``totals[("gram", site)]``, once
    per input tensor (``site``: the first wanted module fed it)."""
    import torch

    linears = {name: module for name, module in model.named_modules() if name in wanted}

    def hook(name):
        def add(module, args):
            value = args[0]
            if name not in site_of:
                site_of[name] = last[1] if value is last[0] and last[1] is not None else name
            last[0], last[1] = value, site_of[name]
            site = site_of[name]
            if site != name:
                return
            flat = value.detach().reshape(-1, value.shape[-1]).to(torch.float32)
            if ("gram", name) not in totals:
                totals["gram", name] = torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float32)
                means["gram", name] = torch.zeros_like(totals["gram", name])
            totals["gram", name].addmm_(flat.T, flat)

        return add

    return [module.register_forward_pre_hook(hook(name)) for name, module in linears.items()]


def _text_means(model, texts: list[list[int]], window: int, totals: dict, means: dict) -> dict:
    """Run ``model`` over each text in windows while hooks add into ``totals`` (zeroed per text);
    each text's totals per token count once in ``means``: the mean over texts, as numpy."""
    import torch

    counted = 0
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
    return {name: (mean / max(counted, 1)).numpy() for name, mean in means.items()}


def generated_texts(model, count: int, tokens: int, seed: int, top_p: float = 1.0) -> list[list[int]]:
    """``count`` texts of ``tokens`` token ids each that ``model`` writes itself, sampled at
    temperature 1 from the smallest set of tokens holding ``top_p`` of the probability (no top-k
    or penalty) after its begin-of-text token (token 0 where it has none), its end-of-text
    tokens held back until the last. Deterministic for a seed; the caller's random state is
    left as it was.

    Text a model writes itself carries its own activation statistics, massive activations and
    all, where random token ids do not: calibrated on it, 4-bit palettes of Gemma 3 270M cost
    1.02x the float perplexity on English prose instead of 2.31x (docs/compression.md).
    """
    import torch
    from transformers import GenerationConfig

    config = model.config.get_text_config()
    start = config.bos_token_id if config.bos_token_id is not None else 0
    ends = config.eos_token_id
    ends = [ends] if isinstance(ends, int) else list(ends or [])
    # Every sampling setting explicit: generate fills the ones left unset from the checkpoint's
    # own generation_config.json (Qwen's sets top_k 20, top_p 0.8, a repetition penalty).
    settings = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=top_p,
        min_p=0.0,
        typical_p=1.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        max_new_tokens=tokens - 1,
        min_new_tokens=tokens - 1,
        eos_token_id=ends or None,
        pad_token_id=ends[0] if ends else start,
    )
    prompt = torch.full((count, 1), start, dtype=torch.long)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        written = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=settings)
    return [row[:tokens] for row in written.tolist()]
