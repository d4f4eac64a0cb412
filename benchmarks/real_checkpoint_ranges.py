"""Where a real checkpoint's values could overflow float16: the largest magnitude of each kind of
value its float32 reference computes, per function.

The table in docs/models.md (SmolLM2-135M-Instruct, ``manifests/smollm2.yaml``) comes from this script.
Each function's PyTorch reference (the base computing in float32, the adapter applied by peft and
not merged, as verification computes it) runs on two prompts, and the larger figure is shown: a
chat-template prompt (the tokenizer's own template around one user message) and verify's seeded
random tokens. Measured: the residual stream (every decoder layer's output and the residual adds
inside it), ``down_proj``'s input (gate x up) and output, the attention scores q.k/sqrt(d) (through
an attention function that computes them before calling torch's), the logits, and the largest
mean square a norm takes of its input (what a float16 norm squares and sums).

    .venv/bin/python scripts/smollm2.py                   # the checkpoint, once
    .venv/bin/python benchmarks/real_checkpoint_ranges.py [--manifest manifests/smollm2.yaml] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLOAT16_MAX = 65504.0
MESSAGE = "Tell me about the weather at sea today, and what a sailor should pack for a long voyage."
ROWS = (
    ("residual", "residual stream (the residual adds)"),
    ("down_proj_out", "`down_proj` output (writes the massive channel)"),
    ("down_proj_in", "`down_proj` input (gate x up)"),
    ("scores", "attention scores (q.k / sqrt(d))"),
    ("logits", "logits"),
    ("norm_mean_square", "a norm's mean square (before this export)"),
)


@contextlib.contextmanager
def measured(model, found: dict[str, float]):
    """Record the largest magnitude of each kind of value over the forwards run inside."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def note(kind: str, value: torch.Tensor) -> None:
        found[kind] = max(found.get(kind, 0.0), float(value.detach().float().abs().max()))

    def scored_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        keys = key.repeat_interleave(groups, dim=1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        note("scores", (query.float() @ keys.float().transpose(-1, -2)) * scale)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("measured", scored_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("measured")
    handles = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if name.endswith("down_proj"):

            def projection(m, args, out):  # a forward hook that returns a value replaces the output
                note("down_proj_in", args[0])
                note("down_proj_out", out)

            handles.append(module.register_forward_hook(projection))
        elif kind.endswith("DecoderLayer"):

            def layer_output(m, args, out):
                note("residual", out[0] if isinstance(out, tuple) else out)

            handles.append(module.register_forward_hook(layer_output))
        elif kind.endswith("RMSNorm"):
            # A layer's norms read the residual stream (the post-attention norm reads it right after
            # the attention's residual add); Qwen3's q/k norms read a head's projection instead.
            reads_residual = not name.endswith(("q_norm", "k_norm"))

            def norm_input(m, args, reads_residual=reads_residual):
                x = args[0].float()
                found["norm_mean_square"] = max(found.get("norm_mean_square", 0.0), float(x.pow(2).mean(-1).max()))
                if reads_residual:
                    note("residual", x)

            handles.append(module.register_forward_pre_hook(norm_input))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)


def prompts(checked, vocab_size: int):
    from adapterpack.inputs.text import load_tokenizer
    from adapterpack.verification.drives import verification_tokens

    tokenizer = load_tokenizer(checked.base.folder)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": MESSAGE}], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    random = verification_tokens(vocab_size, checked.manifest.verify)
    return {"chat": [int(t) for t in chat], "random": [int(t) for t in random]}


def run(manifest: Path) -> dict:
    import torch

    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification.reference import computed_in_float32, reference_model

    checked = check_inputs(manifest)
    functions = list(checked.manifest.function_names)
    results: dict = {"manifest": str(manifest), "functions": {}}
    for function in functions:
        print(f"{function} ...", file=sys.stderr, flush=True)
        with reference_model(checked, function) as model:
            if "prompts" not in results:
                results["prompts"] = prompts(checked, int(model.config.vocab_size))
            per_prompt = {}
            for prompt, ids in results["prompts"].items():
                found: dict[str, float] = {}
                with torch.no_grad(), computed_in_float32(model), measured(model, found):
                    logits = model(torch.tensor([ids])).logits
                found["logits"] = float(logits.float().abs().max())
                per_prompt[prompt] = found
            results["functions"][function] = {
                kind: max(per_prompt[p][kind] for p in per_prompt) for kind, _ in ROWS
            }
    results["prompt_tokens"] = {p: len(ids) for p, ids in results.pop("prompts").items()}
    return results


def table(results: dict) -> str:
    functions = list(results["functions"])
    lines = [
        "| value | " + " | ".join(functions) + " | float16 holds |",
        "|---|" + "---|" * len(functions) + "---|",
    ]
    for kind, label in ROWS:
        cells = [f"{results['functions'][f][kind]:,.0f}" for f in functions]
        limit = "overflows" if any(results["functions"][f][kind] > FLOAT16_MAX for f in functions) else ""
        if kind == "residual":
            limit = f"{FLOAT16_MAX:,.0f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {limit} |")
    counts = ", ".join(f"{p}: {n} tokens" for p, n in results["prompt_tokens"].items())
    return "\n".join(lines) + f"\n\nprompts: {counts}; the larger figure of the two is shown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2.yaml")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run(args.manifest)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    if any(math.isnan(v) for f in results["functions"].values() for v in f.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
