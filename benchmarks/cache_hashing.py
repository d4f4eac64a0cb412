"""What checking the build cache costs: a rebuild after one adapter changed, with the cache's
integrity checks (every reused entry re-hashed, every new one hashed when written) and the same
rebuild with hashing switched off, side by side.

Inputs are ``build_time.py``'s (a model shape with random float16 weights, four LoRA adapters on
q/k/v/o, 4-bit palettization, ``--no-verify``). One clean build fills a cache; each rebuild
then starts from a hard-linked copy of that cache (entries are never modified in place, so the
copies cannot disturb each other), with adapter a2 changed. The two variants alternate,
``--repeat`` times each (the first run also warms the page cache; the fastest of each is
reported). The no-hash variant is the same CLI with the cache's hashing replaced by size checks
(a patch inside its own process; the product has no switch for it).

    .venv/bin/python benchmarks/cache_hashing.py --shape 1b
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_time import PYTHON, machine, make_inputs, peak_rss_of  # noqa: E402

# The CLI with the cache's hashing off: sizes are still compared, digests are not computed.
WITHOUT_HASHING = r"""
import sys
import adapterpack.assemble.cache as cache

cache.file_digests = lambda path: []
original = cache.Entry.problem
cache.Entry.problem = lambda self, sizes_only=False: original(self, sizes_only=True)
from adapterpack.cli.app import main
sys.argv = ["adapterpack", *sys.argv[1:]]
main()
"""

# The CLI with the time spent hashing measured.
MEASURED_HASHING = r"""
import atexit, sys, threading, time
import adapterpack.assemble.cache as cache

spent = [0.0, 0]
lock = threading.Lock()
original = cache.file_digests

def timed(path):
    started = time.perf_counter()
    digest = original(path)
    with lock:
        spent[0] += time.perf_counter() - started
        spent[1] += path.stat().st_size
    return digest

cache.file_digests = timed
atexit.register(lambda: print(f"HASHED {spent[1]} {spent[0]:.3f}", file=sys.stderr, flush=True))
from adapterpack.cli.app import main
sys.argv = ["adapterpack", *sys.argv[1:]]
main()
"""


def linked_copy(source: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=os.link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--work", type=Path, default=Path("/tmp/adapterpack-bench"))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from safetensors.torch import load_file, save_file

    root = args.work / args.shape
    root.mkdir(parents=True, exist_ok=True)
    manifest = make_inputs(root, args.shape)
    out = root / "hashing"
    shutil.rmtree(out, ignore_errors=True)
    clean_cache = out / "cache-clean"
    cli = [str(Path(PYTHON).parent / "adapterpack")]
    build = ["build", str(manifest), "--quiet", "--force", "--no-verify"]
    figures: dict = {"shape": args.shape}
    figures["clean_build"] = peak_rss_of([*cli, *build, "-o", str(out / "clean.mlpackage"), "--cache-dir", str(clean_cache)], None)
    figures["cache_bytes"] = sum(f.stat().st_size for f in clean_cache.rglob("*") if f.is_file())

    weights = root / "a2" / "adapter_model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    save_file({k: v + 0.001 if "lora_B" in k else v for k, v in tensors.items()}, weights)
    runs: dict[str, list[float]] = {"with_hashing": [], "without_hashing": []}
    digests = {}
    try:
        for attempt in range(args.repeat):
            for variant, script in (("with_hashing", MEASURED_HASHING), ("without_hashing", WITHOUT_HASHING)):
                cache = out / f"cache-{variant}"
                linked_copy(clean_cache, cache)
                package = out / f"{variant}.mlpackage"
                started = time.perf_counter()
                done = subprocess.run(
                    [PYTHON, "-c", script, *build, "-o", str(package), "--cache-dir", str(cache)],
                    capture_output=True, text=True,
                )
                runs[variant].append(round(time.perf_counter() - started, 2))
                if done.returncode != 0:
                    raise SystemExit(f"{variant} rebuild failed:\n{done.stderr[-3000:]}")
                hashed = [line.split() for line in done.stderr.splitlines() if line.startswith("HASHED")]
                if hashed:
                    figures["hashed_bytes"], figures["hashing_thread_seconds"] = int(hashed[-1][1]), float(hashed[-1][2])
                digests[variant] = subprocess.run(["sha256sum", str(package / "Data/com.apple.CoreML/weights/weight.bin")],
                                                  capture_output=True, text=True).stdout.split()[0]
                print(f"{variant} rebuild {attempt + 1}: {runs[variant][-1]} s", file=sys.stderr, flush=True)
    finally:
        weights.write_bytes(original)
    figures["rebuild_seconds"] = runs
    best = {variant: min(times) for variant, times in runs.items()}
    figures["hashing_seconds"] = round(best["with_hashing"] - best["without_hashing"], 2)
    figures["hashing_share_of_rebuild"] = round(figures["hashing_seconds"] / best["with_hashing"], 3)
    figures["rebuild_with_over_without"] = round(best["with_hashing"] / best["without_hashing"], 3)
    figures["same_package"] = len(set(digests.values())) == 1
    report = {"machine": machine(), "cache_hashing": figures}
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
