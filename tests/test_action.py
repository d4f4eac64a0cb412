"""The composite action's shell steps, executed here as GitHub runs them (read from action.yml,
`bash --noprofile --norc -eo pipefail`, the step's env with the inputs substituted, outputs
through $GITHUB_OUTPUT), against the demo manifest: build, a fan-out of parts + merge, release.
The steps that use GitHub's own actions (setup-python, cache restore/save) and the install step
(pip into the runner's Python) are GitHub's side and not run here."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ACTION = yaml.safe_load((REPO / "action.yml").read_text())
SKIPPED = {"install"}


def _expression(text: str, context: dict) -> str:
    """``${{ inputs.x }}``, ``${{ github.action_path }}`` and ``${{ steps.id.outputs.x }}``."""

    def value(match: re.Match) -> str:
        found = context
        for part in match.group(1).strip().split("."):
            found = found.get(part, "") if isinstance(found, dict) else ""
        return str(found)

    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def _condition(condition: str | None, context: dict) -> bool:
    """The few conditions action.yml uses: ``inputs.x == 'v'``, ``!=``, joined with ``&&``."""
    if condition is None:
        return True
    for clause in condition.split("&&"):
        left, operator, right = re.match(r"\s*([\w.-]+)\s*(==|!=)\s*'([^']*)'\s*$", clause).groups()
        actual = _expression("${{ " + left + " }}", context)
        if (actual == right) != (operator == "=="):
            return False
    return True


def run_action(workspace: Path, **inputs) -> dict:
    """Run the action's shell steps in ``workspace``; returns every step's outputs by id."""
    values = {name: str(spec.get("default", "")) for name, spec in ACTION["inputs"].items()} | {
        k.replace("_", "-"): v for k, v in inputs.items()
    }
    context: dict = {"inputs": values, "github": {"action_path": str(REPO)}, "steps": {}}
    for step in ACTION["runs"]["steps"]:
        if "run" not in step or step.get("id") in SKIPPED or not _condition(step.get("if"), context):
            continue
        outputs = workspace / f".output-{step['id']}"
        outputs.write_text("")
        script = workspace / f".step-{step['id']}.sh"
        script.write_text(_expression(step["run"], context))
        env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
        env.update({k: _expression(str(v), context) for k, v in step.get("env", {}).items()})
        env.update(GITHUB_OUTPUT=str(outputs), RUNNER_OS="Linux", PATH=f"{Path(sys.executable).parent}:{env['PATH']}")
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)], cwd=workspace, env=env,
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"step {step['id']}: {done.stdout[-1000:]} {done.stderr[-3000:]}"
        context["steps"][step["id"]] = {"outputs": dict(line.split("=", 1) for line in outputs.read_text().splitlines() if "=" in line)}
    return context["steps"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A repository as a user's would be: the demo manifests, and the adapters they name."""
    root = tmp_path_factory.mktemp("workspace")
    shutil.copytree(REPO / "manifests", root / "manifests")
    (root / "adapters").symlink_to(REPO / "adapters")
    return root


def tree_sha256(package: Path) -> str:
    """What the action's sha256 output is for a package folder: sha256sum of each file, in path order."""
    lines = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(package).as_posix()}\n"
                    for p in sorted(package.rglob("*"), key=lambda p: p.relative_to(package).as_posix().encode()) if p.is_file())
    return hashlib.sha256(lines.encode()).hexdigest()


@pytest.mark.slow
def test_build_step_builds_and_reports(workspace):
    steps = run_action(workspace, manifest="manifests/demo.yaml")
    key = steps["key"]["outputs"]
    assert key["key"].startswith(key["restore-key"]) and key["restore-key"].startswith("adapterpack-")
    out = steps["run"]["outputs"]
    package = workspace / out["package"]
    assert package.is_dir() and package.name == "demo.mlpackage"
    assert out["functions"] == "code,docs,zen,base"
    assert out["sha256"] == tree_sha256(package)
    assert (workspace / ".adapterpack-cache" / "parts").is_dir()  # what the save step stores


@pytest.mark.slow
def test_fan_out_parts_and_merge(workspace):
    keys = set()
    for function in ("code", "docs", "zen", "base"):  # one job each
        steps = run_action(workspace, manifest="manifests/demo.yaml", function=function)
        assert steps["run"]["outputs"]["package"] == f"parts/{function}.mlpackage"
        keys.add(steps["key"]["outputs"]["key"])
    assert len(keys) == 4  # each job caches under its own key
    merged = run_action(workspace, manifest="manifests/demo.yaml", command="merge", output="merged.mlpackage", cache="false")
    out = merged["run"]["outputs"]
    assert out["functions"] == "code,docs,zen,base"
    single = workspace / "build" / "demo.mlpackage"  # the single-job test's build: the same bytes
    assert out["sha256"] == tree_sha256(single)


@pytest.mark.slow
def test_release_step(workspace):
    steps = run_action(workspace, manifest="manifests/demo.yaml", command="release", out_dir="dist", cache="false")
    out = steps["run"]["outputs"]
    assert out["package"] == "dist/demo.mlpackage.zip" and "key" not in steps  # no cache for releases
    archive = workspace / out["package"]
    assert out["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert out["functions"] == "code,docs,zen,base"
    with zipfile.ZipFile(archive) as names:
        assert "demo.mlpackage/Manifest.json" in names.namelist()
    assert (workspace / "dist" / "demo" / "README.md").is_file()


def test_unknown_command_fails_the_step(workspace):
    with pytest.raises(AssertionError, match="command must be build, merge or release"):
        run_action(workspace, manifest="manifests/demo.yaml", command="deploy", cache="false")


def test_version():
    done = subprocess.run([sys.executable, "-m", "adapterpack", "--version"], capture_output=True, text=True)
    from importlib.metadata import version

    assert done.returncode == 0 and done.stdout.strip() == f"adapterpack {version('adapterpack')}"
