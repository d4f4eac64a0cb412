"""Benchmark results as the docs show them: ``benchmarks/results/NAME.json``, written by the
benchmark that measured them (``--record NAME``), with the machine it ran on, the commit, the
date and the command; docs/hooks.py renders a page's ``<!-- benchmark: NAME TABLE -->`` marker
from it, so a table in the docs is what the command beside it printed.

    record("build-time-default", tables={"build": Table(columns, rows)}, figures=report)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Table:
    """One table of a result: its column titles and rows of cells (text, as the docs print them)."""

    columns: list[str]
    rows: list[list[str]]


def machine() -> dict:
    """What the figures were measured on: they mean little without it."""
    import numpy
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    memory = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0)
    info = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(memory / 2**20, 1),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS") if k in os.environ},
    }
    try:
        from threadpoolctl import threadpool_info

        info["numpy_threads"] = {pool["internal_api"]: pool["num_threads"] for pool in threadpool_info()}
    except ImportError:
        pass
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    info["adapterpack_commit"] = commit.stdout.strip() or None
    return info


def add_record_option(parser) -> None:
    """``--record NAME``, as every benchmark the docs render takes it."""
    parser.add_argument("--record", metavar="NAME",
                        help="also write benchmarks/results/NAME.json: the table the docs render, the machine and the command")


def record(name: str, tables: dict[str, Table], figures: dict, measured_on: dict | None = None) -> Path:
    """Write ``benchmarks/results/NAME.json``: the tables the docs render, every figure, the
    machine, the date and the command that ran (this process's)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    script = Path(sys.argv[0]).resolve()
    command = shlex.join([".venv/bin/python", str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script), *sys.argv[1:]])
    result = {
        "benchmark": name,
        "command": command,
        "date": datetime.date.today().isoformat(),
        "machine": measured_on or machine(),
        "tables": {key: asdict(table) for key, table in tables.items()},
        "figures": figures,
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
