"""What verify's two verdicts measure on a real checkpoint, for each compression a manifest offers:
the figures the quality thresholds (``config.manifest.DEFAULT_QUALITY``) are chosen from.

For each compression, SmolLM2-135M-Instruct with its two skills (fused) and the base is built as
a user's manifest builds it (no calibration text: the data-free defaults; ``-data-aware`` rows
name the manifest's calibration texts) and verified: the exact verdict (the package against its
reference holding the package's own weights, on random ids and real text) and the quality
verdict (that reference against the float32 one on each function's real text: perplexity
ratio, next-token agreement, retention). Side by side in one run.

    .venv/bin/python scripts/smollm2.py                  # the checkpoint, once
    .venv/bin/python benchmarks/verify_quality.py [--compression palettize-4 ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPRESSIONS = {
    "float16": "{method: none}",
    "palettize-8": "{method: palettize, nbits: 8}",
    "palettize-6": "{method: palettize, nbits: 6}",
    "palettize-4": "{method: palettize, nbits: 4}",
    "palettize-4-data-aware": "{method: palettize, nbits: 4}",
    "linear-8": "{method: linear, nbits: 8, granularity: per_channel}",
    "linear-4-block32": "{method: linear, nbits: 4}",
    "prune-50": "{method: prune, sparsity: 0.5}",
}


def manifest(folder: Path, base: Path, compression: str) -> Path:
    adapters = REPO / "adapters" / "smollm2"
    calibration = compression.endswith("-data-aware")

    def text(name: str) -> str:
        return f", calibration: {adapters / 'calibration' / (name + '.txt')}" if calibration else ""

    path = folder / f"{compression}.yaml"
    path.write_text(
        f"name: q\nbase: {{path: {base}, tokenizer: HuggingFaceTB/SmolLM2-135M-Instruct{text('base')}}}\n"
        f"adapters:\n  - {{name: shout, path: {adapters / 'shout'}{text('shout')}}}\n"
        f"  - {{name: pirate, path: {adapters / 'pirate'}{text('pirate')}}}\n"
        f"include_base: base\nexport: {{max_context: 512}}\ncompression: {COMPRESSIONS[compression]}\n"
        # every figure, whatever the thresholds say
        "verify: {max_perplexity_ratio: 1000, min_agreement: 0, min_retention: -1}\n"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compression", action="append", choices=sorted(COMPRESSIONS), help="default: all")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "scripts"))
    from smollm2 import ensure_base

    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions
    from adapterpack.config.manifest import load_manifest
    from adapterpack.verification.package import verify_package

    base = ensure_base()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for compression in args.compression or list(COMPRESSIONS):
            started = time.perf_counter()
            path = manifest(Path(work), base, compression)
            result = build(path, output=Path(work) / f"{compression}.mlpackage", options=BuildOptions(use_cache=False, verify=False))
            report = verify_package(result.output, load_manifest(path))  # its figures, passed or not
            for f in report.functions:
                quality = f.quality or {}
                rows.append({
                    "compression": compression, "function": f.name, "exact_cosine": f.cosine, "exact_top1": f.top1,
                    "exact_passed": not any(x.startswith("exact") for x in f.failures),
                    "perplexity_ratio": quality.get("perplexity_ratio"), "agreement": quality.get("agreement"),
                    "retention": f.retention, "text": f.text,
                })
                print(
                    f"{compression:24s} {f.name:7s} exact cosine {f.cosine:.5f} top-1 {f.top1:6.1%}  "
                    f"quality perplexity {quality.get('perplexity_ratio', float('nan')):.3f}x agreement "
                    f"{quality.get('agreement', float('nan')):6.1%} retention {'-' if f.retention is None else f'{f.retention:.3f}'}",
                    flush=True,
                )
            print(f"{compression}: build and verify {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
