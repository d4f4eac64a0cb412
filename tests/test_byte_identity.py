"""Reorganising the code that writes packages must not change a byte of them: every variant of
``package_digests`` (the demo and every family with fused and kept functions, both formats, every
compression method) is built and its tree digest compared with the one recorded in
``tests/package_digests.json``. A change meant to change the bytes records them again
(``.venv/bin/python tests/package_digests.py --write``), and says so in its commit."""

from __future__ import annotations

import pytest

from package_digests import built_digest, recorded, variants, versions

# One fused Core ML and one Core AI variant in the default run; the whole matrix in the slow step.
DEFAULT = ("llama-mixed-mlpackage", "llama-keep-aimodel")


@pytest.fixture(scope="module")
def record() -> dict:
    found = recorded()
    if found["versions"] != versions():
        pytest.fail(
            "the recorded digests were written by other library versions "
            f"({found['versions']} against {versions()}): install within constraints.txt (scripts/setup.sh), "
            "or record them again with tests/package_digests.py --write"
        )
    return found


@pytest.mark.parametrize("variant", [v if v in DEFAULT else pytest.param(v, marks=pytest.mark.slow) for v in variants()])
def test_package_bytes_are_unchanged(record, variant):
    assert variant in record["digests"], f"{variant}: no digest recorded: run tests/package_digests.py --write {variant}"
    assert built_digest(variant) == record["digests"][variant], f"{variant}: the package's bytes changed"
