"""Why a float16 ``.aimodel`` of a real checkpoint misses its float32 reference: the accumulation.

Core AI's CPU runtime sums a float16 matrix product over the input channels in float16, one
channel after another (``tests/test_coreai.py::test_the_cpu_runtime_accumulates_float16_products_in_float16``
shows it bit for bit on one layer). This script emulates that in torch for a whole fused function
and compares its logits with verification's float32 reference (the base computing in float32, the
adapter applied by peft and not merged), side by side in one run:

- ``float32 accumulation``: the fused function in torch float16 (float32 sums inside each product);
- ``float16 accumulation, every linear``: every ``nn.Linear`` replaced by the float16 running sum;
- ``float16 accumulation, every linear but down_proj``: the projection with the largest input spared;
- ``float16 accumulation, <projection> only``: one kind of projection at a time.

docs/core-ai.md quotes the rows for SmolLM2-135M-Instruct's ``shout``:

    .venv/bin/python scripts/smollm2.py                    # the checkpoint, once
    .venv/bin/python benchmarks/coreai_accumulation.py [--manifest manifests/smollm2.yaml] [--function shout]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def float16_running_sum(x, weight):
    """``x @ weight.T`` as the runtime computes it: each channel's float16 product added to a
    float16 running sum, in channel order."""
    import torch

    running = torch.zeros(*x.shape[:-1], weight.shape[0], dtype=torch.float16)
    for k in range(x.shape[-1]):
        running = running + x[..., k : k + 1] * weight[:, k]
    return running


@contextlib.contextmanager
def accumulating_in_float16(model, projections: tuple[str, ...]):
    """The model's linear layers named by ``projections`` compute as the runtime does."""
    import torch

    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in projections:

            def replaced(m, args, _out):
                result = float16_running_sum(args[0], m.weight)
                return result if m.bias is None else result + m.bias

            handles.append(module.register_forward_hook(replaced))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def run(manifest: Path, function: str) -> dict:
    import numpy as np
    import torch

    from adapterpack.convert.base_model import load_base, stored_weight_reader
    from adapterpack.convert.lora import applied_adapter
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification.metrics import compare_logits
    from adapterpack.verification.reference import reference_logits

    checked = check_inputs(manifest)
    adapter = checked.manifest.adapter(function)
    if adapter is None:
        raise SystemExit(f"{manifest}: {function} is not one of its adapters")
    print("float32 reference ...", file=sys.stderr, flush=True)
    tokens, _, references = reference_logits(checked, [function])
    reference = references[function]
    ids = torch.from_numpy(np.asarray(tokens)[None, :])

    base = load_base(checked.base.folder, dtype="float16")
    rows = [("float32 accumulation", ()), ("float16 accumulation, every linear", PROJECTIONS)]
    rows += [("float16 accumulation, every linear but down_proj", tuple(p for p in PROJECTIONS if p != "down_proj"))]
    rows += [(f"float16 accumulation, {p} only", (p,)) for p in PROJECTIONS]
    results: dict = {"manifest": str(manifest), "function": function, "tokens": len(tokens), "rows": {}}
    with torch.no_grad(), applied_adapter(
        base, checked.adapters[function].folder, mode="fuse", scale=float(adapter.scale),
        original_weight=stored_weight_reader(checked.base),
    ) as fused:
        for label, projections in rows:
            print(f"{label} ...", file=sys.stderr, flush=True)
            with accumulating_in_float16(fused, projections):
                logits = fused(ids).logits[0].float().numpy()
            results["rows"][label] = compare_logits(logits, reference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2.yaml")
    parser.add_argument("--function", default="shout")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = run(args.manifest, args.function)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{results['function']}, {results['tokens']} tokens, against the float32 reference")
    print("| computed | cosine | top-1 | max error |")
    print("|---|---|---|---|")
    for label, figures in results["rows"].items():
        print(f"| {label} | {figures['cosine']:.5f} | {figures['top1']:.1%} | {figures['max_abs_error']:.3f} |")


if __name__ == "__main__":
    main()
