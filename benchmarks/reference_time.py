"""Verify's PyTorch references and the build's range check: the base and each adapter one forward
at a time, against all of them side by side in one batch.

Before any function runs, verify computes the logits of the float32 base and of the base with
each adapter applied by peft (unmerged) on its seeded tokens (``verification.reference``). The base
stays at its stored precision and each module's weights are widened to float32 while it runs,
so every forward reads and widens every weight of the model. One at a time (how verify did it),
that is one pass over the weights per function; side by side (what verify does now), the base
and the adapters peft can mix are batch rows of one forward, one pass for all of them. Same
inputs as ``build_time.py`` (4 LoRA adapters, r 16 on q/k/v/o, random float16 weights of the
published shapes, made once under ``--work``); each way runs in a fresh process, alternately,
``--repeat`` times; the report gives seconds, peak RSS, the ratio, and the largest difference
between the two ways' logits. The range check a build runs before converting (``verification.ranges``:
every module's largest value on a 16-token prompt, per function) takes the same passes and is
timed the same way, its findings compared.

    .venv/bin/python benchmarks/reference_time.py --shape 1b 3b      # about 10 minutes here
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_time import PYTHON, SHAPES, machine, make_inputs  # noqa: E402
from results import Table, add_record_option, record  # noqa: E402

# One way, in its own process: seconds and peak RSS of verify's references (``verify``) or the
# build's range check (``range``), what they found saved.
RUN = r"""
import json, pickle, sys, time
from pathlib import Path
import numpy as np
from adapterpack.inputs.checked import check_inputs
import adapterpack.verification.reference as reference
from adapterpack.verification.ranges import out_of_float16_range
manifest, way, stage, saved = sys.argv[1:5]
if way == "one_at_a_time":  # every adapter on its own forward, as before
    reference._mixes = lambda info: False
checked = check_inputs(Path(manifest))
names = checked.manifest.function_names
started = time.perf_counter()
if stage == "verify":
    tokens, base, adapters = reference.random_references(checked, names)
else:
    found = out_of_float16_range(checked, names)
seconds = time.perf_counter() - started
if stage == "verify":
    np.savez(saved, base=base, **adapters)
else:
    Path(saved).write_bytes(pickle.dumps(sorted((f.function, f.tensor, f.largest) for f in found)))
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the forked parent, which made the inputs.
hwm_kib = int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:")).split()[1])
print(json.dumps({"seconds": round(seconds, 1), "peak_rss_gib": round(hwm_kib / 2**20, 2)}))
"""
WAYS = ("one_at_a_time", "side_by_side")
STAGES = ("verify", "range")


def run_shape(args, shape: str) -> dict:
    import pickle

    root = args.work / shape
    root.mkdir(parents=True, exist_ok=True)
    manifest = make_inputs(root, shape)
    figures: dict = {"shape": shape}
    with tempfile.TemporaryDirectory() as scratch:
        for stage in STAGES:
            runs: dict = {way: [] for way in WAYS}
            results = {}
            for _ in range(args.repeat):
                for way in WAYS:
                    saved = Path(scratch) / f"{stage}-{way}"
                    command = [PYTHON, "-c", RUN, str(manifest), way, stage, str(saved)]
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        sys.exit(f"{shape} {stage} {way} failed:\n{done.stderr[-3000:]}")
                    runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(shape, stage, way, runs[way][-1], flush=True)
                    results[way] = dict(np.load(f"{saved}.npz")) if stage == "verify" else pickle.loads(saved.read_bytes())
            best = {way: min(run["seconds"] for run in runs[way]) for way in WAYS}
            first, second = (results[way] for way in WAYS)
            figures[stage] = {
                **runs,
                "best_seconds": best,
                "side_by_side_faster": round(best["one_at_a_time"] / best["side_by_side"], 2),
                # verify: the largest logit difference; range: whether both found the same
                "agreement": float(max(np.abs(first[k] - second[k]).max() for k in first)) if stage == "verify" else first == second,
            }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["1b"], help="one or more, run in this order")
    parser.add_argument("--work", type=Path, default=Path("/tmp/adapterpack-bench"))
    parser.add_argument("--repeat", type=int, default=2, help="runs of each way, alternately")
    parser.add_argument("--json", type=Path)
    add_record_option(parser)
    args = parser.parse_args()
    report = {"machine": machine(), "runs": []}
    for shape in args.shape:
        report["runs"].append(run_shape(args, shape))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    for run in report["runs"]:
        for stage in STAGES:
            figures = run[stage]
            best = figures["best_seconds"]
            peak = {way: max(run["peak_rss_gib"] for run in figures[way]) for way in WAYS}
            agreement = (f"logits differ by at most {figures['agreement']:.2e}" if stage == "verify"
                         else "same findings" if figures["agreement"] else "DIFFERENT FINDINGS")
            print(f"{run['shape']} {stage}: one at a time {best['one_at_a_time']} s, side by side {best['side_by_side']} s: "
                  f"{figures['side_by_side_faster']}x faster; peak RSS {peak['one_at_a_time']} / {peak['side_by_side']} GiB; {agreement}")
    if args.record:
        record(args.record, {"references": references_table(report["runs"])}, report, report["machine"])


SHAPE_TITLES = {"25m": "25M", "1b": "1B", "3b": "3B", "8b": "8B"}
STAGE_TITLES = {"verify": "verify references", "range": "range check"}


def references_table(runs: list[dict]) -> Table:
    """One row per shape and stage: the best seconds of each way, the ratio, the peaks."""
    rows = []
    for run in runs:
        for stage in STAGES:
            figures = run[stage]
            best = figures["best_seconds"]
            peak = {way: max(found["peak_rss_gib"] for found in figures[way]) for way in WAYS}
            rows.append([f"{SHAPE_TITLES[run['shape']]} {STAGE_TITLES[stage]}", f"{best['one_at_a_time']} s",
                         f"{best['side_by_side']} s (**{figures['side_by_side_faster']}x faster**)",
                         f"{peak['one_at_a_time']:.2f} / {peak['side_by_side']:.2f} GiB"])
    return Table(["4 adapters, r 16 on q/k/v/o", "one at a time", "side by side", "peak RSS (one at a time / side by side)"], rows)

if __name__ == "__main__":
    main()
