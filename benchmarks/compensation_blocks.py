"""Error-compensated palette entries: each column's error spread one column at a time over its
whole block of 128 (as before), against over a sub-block of ``SUB_BLOCK`` columns with a matrix
product for the rest of the block, side by side.

Runs ``compress.compensation.compensated_indices`` on the Llama-3.2-1B shapes a build
compensates (q/k/v stacked, o, gate/up stacked, down; random weights, a Gram of correlated
random inputs with a few massive channels; one 4-bit palette per output channel, the data-free
default's), each way, and reports seconds, the ratio, the share of entries chosen differently
(the two ways sum the same products in another order) and the layer's output error
``tr(dW H dW^T)`` each way.

    .venv/bin/python benchmarks/compensation_blocks.py [--repeat 1] [--shapes qkv o gate_up down]
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

# (out, in) of what one compensated pass takes at the Llama-3.2-1B shape
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def _problem(out_features: int, in_features: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    weight = (rng.standard_normal((out_features, in_features)) * 0.02).astype(np.float32)
    mixing = rng.standard_normal((in_features, in_features)) / in_features**0.5
    inputs = rng.standard_normal((1024, in_features)) @ (np.eye(in_features) + 0.3 * mixing)
    inputs[:, :4] *= 100.0  # a trained checkpoint's massive channels
    gram = inputs.T @ inputs / len(inputs)
    # one palette of 16 entries per output channel, spanning the channel's values
    quantiles = np.linspace(0.02, 0.98, 16)
    luts = np.quantile(weight, quantiles, axis=1).T.astype(np.float16).astype(np.float32)
    return weight, luts, gram


def _output_error(weight, luts, indices, gram) -> float:
    delta = np.take_along_axis(luts, indices.astype(np.int64), axis=1) - weight
    return float(np.einsum("ij,jk,ik->", delta, gram, delta, optimize=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, the fastest reported")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    add_record_option(parser)
    args = parser.parse_args()
    titles = {"qkv": "q/k/v stacked", "o": "o", "gate_up": "gate/up stacked", "down": "down"}
    rows, figures = [], {"repeat": args.repeat, "shapes": {}}
    rng = np.random.default_rng(0)
    sub_block = compensation.SUB_BLOCK
    ways = (("whole block", compensation.BLOCK), (f"sub-blocks of {sub_block}", sub_block))
    print(f"{'shape':>8} {'out x in':>12} {ways[0][0]:>12} {ways[1][0]:>17} {'ratio':>6} {'differ':>8} {'error ratio':>12}")
    totals = [0.0, 0.0]
    for name in args.shapes:
        weight, luts, gram = _problem(*SHAPES[name], rng)
        seconds, chosen = [], []
        for _, size in ways:
            compensation.SUB_BLOCK = size
            runs = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                found = compensation.compensated_indices(weight, luts, 1, gram)
                runs.append(time.perf_counter() - started)
            seconds.append(min(runs))
            chosen.append(found)
        compensation.SUB_BLOCK = sub_block
        differ = float(np.mean(chosen[0] != chosen[1]))
        errors = [_output_error(weight, luts, c, gram) for c in chosen]
        totals = [t + s for t, s in zip(totals, seconds)]
        shape = "x".join(map(str, SHAPES[name]))
        print(f"{name:>8} {shape:>12} {seconds[0]:>11.2f}s {seconds[1]:>16.2f}s {seconds[0] / seconds[1]:>5.2f}x "
              f"{differ:>8.2e} {errors[1] / errors[0]:>12.6f}")
        figures["shapes"][name] = {"seconds": [round(s, 3) for s in seconds], "entries_differing": differ, "error_ratio": errors[1] / errors[0]}
        rows.append([f"{titles[name]} ({shape.replace('x', ' x ')})", f"{seconds[0]:.2f} s", f"{seconds[1]:.2f} s", f"{seconds[0] / seconds[1]:.2f}x"])
    print(f"{'all':>8} {'':>12} {totals[0]:>11.2f}s {totals[1]:>16.2f}s {totals[0] / totals[1]:>5.2f}x")
    if args.record:
        rows.append(["one layer", f"{totals[0]:.2f} s", f"{totals[1]:.2f} s", f"**{totals[0] / totals[1]:.2f}x**"])
        record(args.record, {"blocks": Table(["pass (out x in)", ways[0][0], ways[1][0], "ratio"], rows)}, figures)


if __name__ == "__main__":
    main()
