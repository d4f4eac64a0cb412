import contextlib
import os
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


@contextlib.contextmanager
def shared_folder(tmp_path_factory, name: str):
    """(folder, whether an earlier holder made it): a folder every worker of this run shares, held
    by one worker at a time (one process without pytest-xdist: its own). The first holder builds
    into it; the others build again with its build cache, which reuses every function."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    with FileLock(f"{folder}.lock"):
        made = (folder / ".made").exists()
        folder.mkdir(exist_ok=True)
        yield folder, made
        (folder / ".made").touch()


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


@pytest.fixture(scope="session")
def family_builds(tmp_path_factory):
    """family -> (family, root, BuildResult), each built on first use and kept for the session,
    its project and build cache shared by the run's workers. pytest holds one value of a
    parametrized fixture at a time, and a worker running whole files switches family in every
    file that uses them: built in ``family_build`` itself, each family was built again in each
    such file."""
    from adapterpack.assemble.pipeline import build

    built: dict[str, tuple] = {}

    def of(family: str) -> tuple:
        if family not in built:
            with shared_folder(tmp_path_factory, f"build-{family}") as (root, made):
                manifest = root / "m.yaml" if made else make_family_project(root, family)
                built[family] = (family, root, build(manifest, output=root / f"out-{_worker()}.mlpackage"))
        return built[family]

    return of


@pytest.fixture(scope="session", params=[f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def family_build(request, family_builds):
    """(family, root, BuildResult): a float16 package per family with every FAMILY_ADAPTERS
    function and the base, built and verified once for the whole session. Shared: a test that
    changes its files works on a copy."""
    return family_builds(request.param)


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The shipped demo (manifests/demo.yaml), built and verified once for the session, by the
    public Python API (its build cache shared by the run's workers)."""
    import adapterpack as ap

    manifest = Path(__file__).resolve().parents[1] / "manifests" / "demo.yaml"
    with shared_folder(tmp_path_factory, "demo") as (shared, _):
        # SHARED/WORKER/demo.mlpackage, its cache SHARED/cache
        output = shared / _worker() / "demo.mlpackage"
        return ap.build(manifest, output=output, options=ap.BuildOptions(cache_dir=shared / "cache"))


@pytest.fixture(scope="session", autouse=True)
def derived_inputs(tmp_path_factory):
    """What adapterpack derives once per input (a multimodal base's text tower) goes to the
    run's own folder, not the user's cache."""
    os.environ["ADAPTERPACK_CACHE_DIR"] = str(tmp_path_factory.mktemp("derived-inputs"))


def pytest_configure(config):
    # Under pytest-xdist each worker is one of the machine's cores: one BLAS/OpenMP thread per
    # worker (and the commands it runs) instead of every worker spinning threads on every core.
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.other_families(param, values)``: a test parametrized over ``family_build``
    and ``param`` runs every value on Llama, and only ``values`` on the other families (whose
    programs hold other weights, not other ways to treat one). The rest are deselected, not
    skipped: they are not tests of this suite."""
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("other_families")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if marker is not None and "family_build" in params:
            param, values = marker.args
            if params["family_build"] != "llama" and params[param] not in values:
                dropped.append(item)
                continue
        kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
