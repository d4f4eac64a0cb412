"""Thread pools sized for the cores a build gets, and idle OpenMP threads that sleep."""

from __future__ import annotations

import os
import subprocess
import sys

import adapterpack.threads as threads
from adapterpack.threads import available_cores, use_machine_threads


def test_unset_pools_get_the_cores_and_passive_waiting():
    environ: dict[str, str] = {}
    use_machine_threads(environ)
    cores = str(available_cores())
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": cores, "OPENBLAS_NUM_THREADS": cores, "MKL_NUM_THREADS": cores}


def test_what_the_environment_says_wins():
    environ = {"OMP_NUM_THREADS": "7", "OMP_WAIT_POLICY": "ACTIVE"}
    use_machine_threads(environ)
    assert environ["OMP_NUM_THREADS"] == "7" and environ["OMP_WAIT_POLICY"] == "ACTIVE"
    untouched = {"ADAPTERPACK_THREADS": "library-defaults"}
    use_machine_threads(untouched)
    assert untouched == {"ADAPTERPACK_THREADS": "library-defaults"}


def test_a_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "CGROUP_CPU_MAX", quota)
    affinity = len(os.sched_getaffinity(0))
    quota.write_text("50000 100000\n")  # half a core
    assert available_cores() == 1
    quota.write_text("max 100000\n")
    assert available_cores() == affinity
    quota.write_text("garbage\n")
    assert available_cores() == affinity


def test_the_command_line_sets_them_before_numpy_loads():
    """numpy's BLAS reads its thread count when it loads: the command line's package must set
    it before its commands import numpy."""
    code = "import os, sys; import adapterpack.cli.app; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('OPENBLAS_NUM_THREADS'))"
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    check = "import sys; import adapterpack.cli; print('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", check], env=environ, capture_output=True, text=True, check=True).stdout.strip() == "False"
    got = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True).stdout.split()
    assert got == ["PASSIVE", str(available_cores())]
