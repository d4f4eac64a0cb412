"""A build on a busy machine: the demo's build alone, then beside CPU-bound processes, side by side.

A shared CI runner or a developer's laptop rarely gives a build its cores to itself. Each
configuration builds ``manifests/demo.yaml`` (no cache, verification included, as users run it)
alone and then beside ``--load`` plain CPU-bound processes (one busy Python loop each), and
reports the slowdown against the fair share: with ``cores`` cores and ``load`` other runnable
processes, a build that used every core alone should take (cores + load) / cores times as
long. The configurations are environments the build runs under; the first is what
``adapterpack`` does by itself, the others what it did before (the thread pools of torch, its
OpenMP runtime and numpy's BLAS each sized to the cores and spinning while they wait).

    .venv/bin/python benchmarks/busy_runner.py [--load 2] [--repeat 1] [--alternatives] [--json F]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from adapterpack.threads import available_cores  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import Table, add_record_option, record  # noqa: E402

ADAPTERPACK = REPO / ".venv" / "bin" / "adapterpack"

# name -> environment added to the build's; "adapterpack" runs it as shipped.
CONFIGURATIONS = {
    "adapterpack": {},
    "spinning pools (before)": {"ADAPTERPACK_THREADS": "library-defaults"},
}
# With --alternatives: the other settings tried (each on top of the libraries' defaults).
ALTERNATIVES = {
    "one OpenMP thread": {"ADAPTERPACK_THREADS": "library-defaults", "OMP_NUM_THREADS": "1"},
    "passive waiting only": {"ADAPTERPACK_THREADS": "library-defaults", "OMP_WAIT_POLICY": "PASSIVE"},
    "one BLAS thread": {"ADAPTERPACK_THREADS": "library-defaults", "OPENBLAS_NUM_THREADS": "1"},
    "short spin": {"ADAPTERPACK_THREADS": "library-defaults", "GOMP_SPINCOUNT": "10000"},
}


def busy(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def timed_build(environment: dict[str, str], folder: Path) -> float:
    env = {**os.environ, **environment}
    output = folder / "demo.mlpackage"
    command = [str(ADAPTERPACK), "build", str(REPO / "manifests" / "demo.yaml"), "-o", str(output), "--force", "--no-cache", "-q"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"the build failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return seconds


def beside_load(environment: dict[str, str], folder: Path, load: int) -> float:
    stop = multiprocessing.Event()
    workers = [multiprocessing.Process(target=busy, args=(stop,)) for _ in range(load)]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1)  # the load is running before the build starts
        return timed_build(environment, folder)
    finally:
        stop.set()
        for worker in workers:
            worker.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, help="CPU-bound processes beside the build (default 2)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each measurement; the median is reported")
    parser.add_argument("--alternatives", action="store_true", help="also the other thread settings tried (ALTERNATIVES)")
    parser.add_argument("--json", type=Path)
    add_record_option(parser)
    args = parser.parse_args()

    cores = available_cores()  # what the build's own thread pools are sized to
    fair = (cores + args.load) / cores
    figures: dict = {"cores": cores, "load": args.load, "fair_share_slowdown": round(fair, 2), "configurations": {}}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        timed_build({}, folder)  # warm the file cache: the first build reads every library from disk
        configurations = {**CONFIGURATIONS, **(ALTERNATIVES if args.alternatives else {})}
        for name, environment in configurations.items():
            alone = statistics.median(timed_build(environment, folder) for _ in range(args.repeat))
            loaded = statistics.median(beside_load(environment, folder, args.load) for _ in range(args.repeat))
            figures["configurations"][name] = {
                "alone_seconds": round(alone, 1),
                "beside_load_seconds": round(loaded, 1),
                "slowdown": round(loaded / alone, 2),
                "slowdown_over_fair_share": round(loaded / alone / fair, 2),
            }
            print(name, figures["configurations"][name], flush=True)
    names = list(CONFIGURATIONS)
    ours, before = (figures["configurations"][name] for name in names[:2])
    figures["beside_load_speedup_over_before"] = round(before["beside_load_seconds"] / ours["beside_load_seconds"], 2)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.record:
        titles = {"adapterpack": "adapterpack's thread settings", "spinning pools (before)": "the libraries' own (before)"}
        rows = [
            [titles.get(name, name), f"{found['alone_seconds']} s", f"{found['beside_load_seconds']} s", f"{found['slowdown']}x",
             f"{found['slowdown_over_fair_share']}"]
            for name, found in figures["configurations"].items()
        ]
        rows.append(["beside the load, adapterpack's against before", "", f"**{figures['beside_load_speedup_over_before']}x faster**", "", ""])
        columns = ["", "alone", f"beside {args.load} CPU-bound processes", "slowdown", f"against the fair share ({fair:.2g}x)"]
        record(args.record, {"busy": Table(columns, rows)}, figures)


if __name__ == "__main__":
    main()
