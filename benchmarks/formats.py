"""The two output formats side by side: Core ML ``.mlpackage`` against Core AI ``.aimodel``.

For each model (the shipped demo, and the benchmark shapes of ``build_time.py``) and each LoRA
mode (fused, kept), the same manifest is built as both formats in one run, each build in its own
process without a cache and without verification: seconds, peak RSS and bytes on disk, and the
ratios aimodel / mlpackage. With ``--verify``, each package is then verified on its own
(``adapterpack verify``: the numpy executor for the .mlpackage, Core AI's runtime for the .aimodel).

    .venv/bin/python benchmarks/formats.py                          # the demo, fused and kept
    .venv/bin/python benchmarks/formats.py --model demo 1b --json formats.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from build_time import PYTHON, REPO, machine, make_inputs, peak_rss_of, size

FORMATS = ("mlpackage", "aimodel")


def demo_manifest(work: Path, lora: str) -> Path:
    """manifests/demo.yaml with ``lora`` for every adapter, its paths made absolute."""
    text = (REPO / "manifests" / "demo.yaml").read_text()
    text = text.replace("path: ../adapters", f"path: {REPO}/adapters").replace("lora: fuse", f"lora: {lora}")
    text = "\n".join(line for line in text.splitlines() if not line.startswith("output:")) + "\n"
    manifest = work / f"demo-{lora}.yaml"
    manifest.write_text(text)
    return manifest


def manifest_for(work: Path, model: str, lora: str) -> Path:
    if model == "demo":
        return demo_manifest(work, lora)
    root = work / model
    root.mkdir(parents=True, exist_ok=True)
    return make_inputs(root, model, lora)


def run(work: Path, models: list[str], verify: bool) -> dict:
    cli = str(Path(PYTHON).parent / "adapterpack")
    results: dict = {"machine": machine(), "models": {}}
    for model in models:
        for lora in ("fuse", "keep"):
            manifest = manifest_for(work, model, lora)
            row: dict = {}
            for package_format in FORMATS:
                output = work / "out" / f"{model}-{lora}.{package_format}"
                output.parent.mkdir(parents=True, exist_ok=True)
                command = [cli, "build", str(manifest), "-o", str(output), "--no-verify", "--no-cache", "--force", "--quiet"]
                print(f"{model} {lora} {package_format} ...", file=sys.stderr, flush=True)
                figures = peak_rss_of(command, None)
                figures["bytes"] = size(output)
                if verify and figures["finished"]:
                    figures["verify"] = peak_rss_of([cli, "verify", str(output), "--manifest", str(manifest)], None)
                row[package_format] = figures
            mlpackage, aimodel = row["mlpackage"], row["aimodel"]
            if mlpackage["finished"] and aimodel["finished"]:
                row["aimodel_over_mlpackage"] = {
                    "seconds": round(aimodel["seconds"] / mlpackage["seconds"], 2),
                    "peak_rss": round(aimodel["peak_rss_gib"] / mlpackage["peak_rss_gib"], 2),
                    "bytes": round(aimodel["bytes"] / mlpackage["bytes"], 3),
                }
            results["models"][f"{model} {lora}"] = row
            print(json.dumps({f"{model} {lora}": row}, indent=2), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["demo"], choices=["demo", "25m", "1b", "3b"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/adapterpack-bench"), help="inputs and outputs (large)")
    parser.add_argument("--verify", action="store_true", help="also verify each package on its own")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = run(args.work, args.model, args.verify)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
