"""Commands that only read a manifest or a package's spec stay fast: they never import torch,
transformers, peft or coremltools' package (whose ``__init__`` imports torch and transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "coremltools")

PROBE = f"""
import contextlib, io, json, sys
from adapterpack.cli.app import app
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        app(sys.argv[1:], standalone_mode=False)
    except SystemExit:
        pass
print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))
"""


@pytest.fixture(scope="module")
def package(demo):
    """The session's demo package (conftest.py): these commands only read its spec."""
    return demo.output


@pytest.mark.parametrize("command", ["validate", "functions", "inspect", "schema"])
def test_command_imports_no_heavy_library(command, package):
    args = {
        "validate": [str(REPO / "manifests" / "demo.yaml")],
        "functions": [str(package), "--expect", "code,docs,zen"],
        "inspect": [str(package), "--json"],
        "schema": [],
    }[command]
    result = subprocess.run([sys.executable, "-c", PROBE, command, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [], f"{command} imported heavy libraries"
