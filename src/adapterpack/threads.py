"""Thread pools sized for the machine a build really gets, and idle threads that sleep.

torch's intra-op pool (OpenMP), numpy's BLAS and any other OpenMP runtime each start a thread
per core they see, and OpenMP's idle threads spin for a while before they sleep. Alone on a
machine that costs nothing; beside other work (a shared CI runner, the test suite, a laptop
compiling) a spinning thread holds a core the thread it waits for needs, and every parallel
region waits out a time slice: the demo's build took 13x its time beside two CPU-bound
processes, where a fair share is 2x (benchmarks/busy_runner.py). So, unless the environment
already says otherwise: idle OpenMP threads sleep (``OMP_WAIT_POLICY=PASSIVE``), and every pool
is sized to the cores this process may use (its CPU affinity and its cgroup's CPU quota, which
``os.cpu_count`` ignores on a container runner). ``ADAPTERPACK_THREADS=library-defaults``
leaves the libraries as they come.

These variables are read when the libraries load, so ``use_machine_threads`` runs before numpy
or torch is imported: the command line calls it first thing (``adapterpack.cli``).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity
        cores = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return max(1, cores)


def use_machine_threads(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set the thread pools' variables the environment leaves unset (see the module's text)."""
    if environ.get("ADAPTERPACK_THREADS") == "library-defaults":
        return
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cores = str(available_cores())
    for variable in POOL_VARIABLES:
        environ.setdefault(variable, cores)
