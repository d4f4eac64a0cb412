import sys
from pathlib import Path

from adapterpack.threads import use_machine_threads

# As the command line does, before numpy or torch loads: the suite runs two workers and the
# builds' own subprocesses on two cores, where spinning thread pools would wait on each other.
use_machine_threads()

# Test helpers (factories.py) live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402

from factories import FAMILIES, make_family_project  # noqa: E402

# The default run builds Llama and Qwen3 (q/k norms); Mistral (sliding window) and Qwen2 (q/k/v
# biases) run in the slow step, with every test that takes this fixture.
DEFAULT_FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="session", params=[f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def family_build(request, tmp_path_factory):
    """(family, root, BuildResult): a float16 package per family with every FAMILY_ADAPTERS
    function and the base, built and verified once for the whole session."""
    from adapterpack.assemble.pipeline import build

    family = request.param
    root = tmp_path_factory.mktemp(f"build-{family}")
    manifest = make_family_project(root, family)
    return family, root, build(manifest, output=root / "out.mlpackage")


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The shipped demo (manifests/demo.yaml), built and verified once for the session, by the
    public Python API."""
    import adapterpack as ap

    out = tmp_path_factory.mktemp("demo")
    manifest = Path(__file__).resolve().parents[1] / "manifests" / "demo.yaml"
    return ap.build(manifest, output=out / "demo.mlpackage", options=ap.BuildOptions(cache_dir=out / "cache"))


def pytest_configure(config):
    # Under pytest-xdist each worker is one of the machine's cores: one BLAS/OpenMP thread per
    # worker (and the commands it runs) instead of every worker spinning threads on every core.
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
