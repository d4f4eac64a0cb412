"""Error-compensated palette entries: each weight's nearest entry found by comparing it with
every entry, against bisection in the sorted entries, side by side.

Runs ``compress.compensation.compensated_indices`` on Gemma 3 270M's MLP shape (2048 x 640,
random weights, a Gram of random inputs; palettes of 16 rows) at 4 bits (16 entries) and 8 bits
(256, the step ``compression: auto`` moves most layers to on that checkpoint), once each way,
checks that both choose identical entries, and reports seconds and the ratio.

    .venv/bin/python benchmarks/compensation_nearest.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adapterpack.threads import use_machine_threads  # noqa: E402

use_machine_threads()  # the thread pools a build runs with, set before numpy and torch load

import numpy as np  # noqa: E402
from results import Table, add_record_option, record  # noqa: E402

import adapterpack.compress.compensation as compensation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, the fastest reported")
    add_record_option(parser)
    args = parser.parse_args()
    rows, figures = [], {"repeat": args.repeat, "entries": {}}
    rng = np.random.default_rng(0)
    out_features, in_features = 2048, 640
    weight = (rng.standard_normal((out_features, in_features)) * 0.02).astype(np.float32)
    inputs = rng.standard_normal((2048, in_features))
    gram = (inputs.T @ inputs / len(inputs)).astype(np.float32)
    print(f"{'entries':>8} {'every entry':>12} {'bisection':>10} {'ratio':>6}")
    for entries in (16, 256):
        luts = np.sort(rng.standard_normal((out_features // 16, entries)) * 0.02, axis=1).astype(np.float16).astype(np.float32)
        seconds, chosen = {}, {}
        for label, threshold in (("every entry", 1 << 30), ("bisection", 1)):
            compensation.BISECT_ENTRIES = threshold
            runs = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                chosen[label] = compensation.compensated_indices(weight, luts, 16, gram)
                runs.append(time.perf_counter() - started)
            seconds[label] = min(runs)
        if not np.array_equal(chosen["every entry"], chosen["bisection"]):
            sys.exit(f"{entries} entries: bisection chose other entries")
        ratio = seconds["every entry"] / seconds["bisection"]
        print(f"{entries:>8} {seconds['every entry']:>11.2f}s {seconds['bisection']:>9.2f}s {ratio:>5.2f}x")
        figures["entries"][entries] = {**{k: round(v, 3) for k, v in seconds.items()}, "ratio": round(ratio, 2), "identical_entries": True}
        rows.append([str(entries), f"{seconds['every entry']:.2f} s", f"{seconds['bisection']:.2f} s", f"{ratio:.2f}x"])
    if args.record:
        columns = ["palette entries (2048 x 640 weight)", "compared with every entry", "bisection", "ratio"]
        record(args.record, {"nearest": Table(columns, rows)}, figures)


if __name__ == "__main__":
    main()
