"""Verify of one real checkpoint's function on Core AI's runtime, against the .mlpackage executor.

SmolLM2-135M-Instruct (``scripts/smollm2.py``) with its ``shout`` skill fused, float16 compute,
built once as a Core AI asset and once as an ``.mlpackage``; then, in one run, side by side:
the asset's drives one after another (how verify ran them before), the asset's drives at once
(verify now), and the numpy executor on the package. Each figure is ``verify_package``'s own
time for the one function (its PyTorch reference included), with the manifest's verify settings
(prefill 16, then 16 decode steps, each drive).

    .venv/bin/python benchmarks/coreai_verify.py                    # about 11 minutes here

Where the runtime's time goes (``perf record`` on a verify, docs/core-ai.md): off Apple devices
Core AI computes float16 arithmetic in software, a call to a half-precision conversion routine
per element, so one decode call of this 135M model takes about 8 s and a 16-token prefill about
90 s, against a fraction of a second on the executor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def manifest(root: Path, base: Path, fmt: str) -> Path:
    adapters = REPO / "adapters" / "smollm2"
    path = root / f"{fmt}.yaml"
    path.write_text(
        f"name: smollm2-{fmt}\nbase: {{path: {base}, tokenizer: HuggingFaceTB/SmolLM2-135M-Instruct}}\n"
        f"adapters:\n  - {{name: shout, path: {adapters / 'shout'}}}\nlora: fuse\n"
        f"export: {{max_context: 512, format: {fmt}, compute_precision: float16}}\n"
        f"compression: {{method: none}}\noutput: {root / ('smollm2.' + fmt)}\n"
    )
    return path


def timed_verify(path: Path, *, concurrent: bool) -> tuple[float, dict]:
    """Seconds ``verify_package`` takes (``concurrent``: whether the drives may run at once) and
    the function's figures."""
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification import runners
    from adapterpack.verification.package import verify_package

    checked = check_inputs(path)
    original = runners.run_drives

    def drives(*args, **kwargs):
        kwargs["concurrent"] = concurrent and kwargs.get("concurrent", False)
        return original(*args, **kwargs)

    runners.run_drives = drives
    try:
        start = time.perf_counter()
        report = verify_package(checked.manifest.output_path(), checked.manifest, checked=checked)
        seconds = time.perf_counter() - start
    finally:
        runners.run_drives = original
    (function,) = report.functions
    return seconds, {"cosine": function.cosine, "top1": function.top1, "passed": report.passed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/adapterpack-coreai-verify"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from smollm2 import ensure_base

    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions

    base = ensure_base()
    args.work.mkdir(parents=True, exist_ok=True)
    paths = {fmt: manifest(args.work, base, fmt) for fmt in ("aimodel", "mlpackage")}
    for path in paths.values():
        build(path, options=BuildOptions(cache_dir=args.work / "cache", verify=False))

    rows = {
        "core ai, drives one after another": timed_verify(paths["aimodel"], concurrent=False),
        "core ai, drives at once": timed_verify(paths["aimodel"], concurrent=True),
        "mlpackage, numpy executor": timed_verify(paths["mlpackage"], concurrent=False),
    }
    executor = rows["mlpackage, numpy executor"][0]
    before = rows["core ai, drives one after another"][0]
    print(f"{'verify of one function':40} {'seconds':>8} {'x executor':>10} {'x before':>9}  figures")
    for name, (seconds, figures) in rows.items():
        print(f"{name:40} {seconds:8.1f} {seconds / executor:10.1f} {seconds / before:9.2f}  {figures}")
    if args.json:
        payload = {name: {"seconds": seconds, **figures} for name, (seconds, figures) in rows.items()}
        payload["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
