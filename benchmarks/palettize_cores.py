"""Palettization on one core and on two, per palette granularity: the k-means stage of a build,
side by side.

Clusters the weights of some decoder layers of a model shape (random float16, 4-bit,
per_grouped_channel) through ``PaletteStore.in_order``, the path the build streams every weight
through, once with one worker and once with ``PALETTE_WORKERS``, and checks that both give
identical palettes; for each ``--group-size`` (16: the default with calibration text; 1, one
palette per output channel: the data-free default at 4 bits). Reports weights per second, the
speed-up, and each group size's speed per weight against the first's, from one run.

    .venv/bin/python benchmarks/palettize_cores.py [--shape 3b] [--layers 2] [--group-size 16 --group-size 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results import Table, add_record_option, record  # noqa: E402

import adapterpack.compress.palettes as palettes  # noqa: E402
from adapterpack.compress.palettes import PaletteStore, grouped_rows  # noqa: E402
from adapterpack.config.compression import Compression  # noqa: E402

# (hidden, intermediate, kv width) of the shapes in build_time.py
SHAPES = {"1b": (2048, 8192, 512), "3b": (3072, 8192, 1024), "8b": (4096, 14336, 1024)}


def layer_weights(shape: str, layers: int) -> list[np.ndarray]:
    hidden, intermediate, kv = SHAPES[shape]
    sizes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
             (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(size, dtype=np.float32) * 0.02).astype(np.float16) for _ in range(layers) for size in sizes]


def timed(weights: list[np.ndarray], compression: Compression, workers: int | None) -> tuple[float, list]:
    """Seconds and palettes: ``workers`` threads of one torch thread each (``in_order``), or
    None: every batch in turn on the calling thread, torch using its own threads (how builds
    clustered before)."""
    store = PaletteStore()  # in memory: nothing cached between the runs
    started = time.perf_counter()
    if workers is None:
        found = store.tensor_palettes([grouped_rows(w, compression) for w in weights], compression.nbits)
    else:
        palettes.PALETTE_WORKERS = workers
        found = list(store.in_order([w.size for w in weights], lambda i: grouped_rows(weights[i], compression), compression.nbits))
    return time.perf_counter() - started, found


def measured(weights: list[np.ndarray], group_size: int) -> dict:
    compression = Compression(method="palettize", nbits=4, granularity="per_grouped_channel", group_size=group_size)
    total = sum(w.size for w in weights)
    parallel = palettes.PALETTE_WORKERS
    serial, reference = timed(weights, compression, None)
    one, first = timed(weights, compression, 1)
    two, second = timed(weights, compression, parallel)
    palettes.PALETTE_WORKERS = parallel
    identical = all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1])
        for a, b, c in zip(reference, first, second)
    )
    import torch

    return {
        f"serial_torch_{torch.get_num_threads()}_threads_seconds": round(serial, 2),
        "one_worker_seconds": round(one, 2),
        f"{parallel}_workers_seconds": round(two, 2),
        "serial_weights_per_second": round(total / serial),
        f"{parallel}_workers_weights_per_second": round(total / two),
        "speedup_over_serial": round(serial / two, 2),
        "speedup_over_one_worker": round(one / two, 2),
        "identical_palettes": identical,
    }


def cores_table(weights: int, by_size: dict[int, dict]) -> Table:
    """Seconds and weights per second of each way, a column pair per group size."""
    workers = palettes.PALETTE_WORKERS
    titles = {16: "groups of 16", 1: "one per channel"}
    columns = [""]
    for size in by_size:
        columns += [f"{titles.get(size, f'groups of {size}')}: seconds", "weights/s"]
    serial = next(key for key in next(iter(by_size.values())) if key.startswith("serial_torch_"))
    ways = [
        (f"one batch after another, torch's {serial.split('_')[2]} threads inside each step (how builds clustered before)", serial),
        ("one worker, one torch thread", "one_worker_seconds"),
        (f"{workers} workers, one torch thread each (what builds do now)", f"{workers}_workers_seconds"),
    ]
    rows = [
        [title, *(cell for found in by_size.values() for cell in (f"{found[seconds]:.2f}", f"{weights / found[seconds] / 1e6:.1f}M"))]
        for title, seconds in ways
    ]
    rows.append([f"{workers} workers against the previous way (its seconds over theirs)", *(cell for found in by_size.values()
                 for cell in (f"**{found['speedup_over_serial']}x**", ""))])
    return Table(columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--group-size", type=int, action="append", help="repeatable; default 16 and 1")
    parser.add_argument("--json", type=Path)
    add_record_option(parser)
    args = parser.parse_args()

    weights = layer_weights(args.shape, args.layers)
    sizes = args.group_size or [16, 1]
    figures = {
        "shape": args.shape,
        "layers": args.layers,
        "weights": sum(w.size for w in weights),
        "cores": len(__import__("os").sched_getaffinity(0)),
        "group_size": {size: measured(weights, size) for size in sizes},
    }
    rate = f"{palettes.PALETTE_WORKERS}_workers_weights_per_second"
    first = figures["group_size"][sizes[0]][rate]
    for size in sizes[1:]:
        figures[f"group_size_{size}_speed_over_{sizes[0]}"] = round(figures["group_size"][size][rate] / first, 2)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.record:
        record(args.record, {"cores": cores_table(figures["weights"], figures["group_size"])}, figures)
    if not all(f["identical_palettes"] for f in figures["group_size"].values()):
        sys.exit("the palettes differ between one and two workers")


if __name__ == "__main__":
    main()
