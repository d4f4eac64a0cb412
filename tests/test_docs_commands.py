"""Every adapterpack command the README and the docs show, run as a reader would run it: each
page's commands in the page's order, through the shell, in a checkout of their own (the
repository's manifests and adapters, the session's demo build and its cache in ``build/``, the
Swift enum an app holds), each exiting 0. ``tests/test_docs.py`` parses every command in the
default run; this runs them (minutes: a Core AI build, releases), in the slow step.

A few commands are not run, each for the reason ``NOT_RUN`` gives; a test keeps that list true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from factories import demo_cache
from test_docs import PAGES, README, shell_lines

REPO = Path(__file__).resolve().parents[1]
SETUP = "scripts/setup.sh && "  # the repository's set-up, done: CI runs it, then these tests

# (page, the command's start) -> why it is not run here
NOT_RUN = {
    ("README.md", ".venv/bin/adapterpack validate skills.yaml"): "the reader's own model: the page shows its manifest, its paths are the reader's",
    ("README.md", ".venv/bin/adapterpack build skills.yaml"): "the reader's own model (as above)",
    ("adapters.md", ".venv/bin/adapterpack build manifest.yaml"): "the reader's own mlx-lm adapter (path/to/base)",
    ("models.md", ".venv/bin/adapterpack "): "the real checkpoints' builds, minutes each (up to a quarter hour); "
    "tests/test_real_checkpoint.py and tests/test_gemma3.py build the same checkpoints and skills",
    ("core-ai.md", ".venv/bin/adapterpack "): "the demo as an asset: verify refuses its zen (perplexity 1.06-1.08 against "
    "its 1.05 target, as the page says), so the build and releases exit 3 and write nothing for the next commands; "
    "tests/test_coreai.py::test_demo_builds_as_an_asset builds it with the target relaxed",
}


def shown_lines(page: Path) -> list[str]:
    """The shell lines of ``page`` that run adapterpack, as written (continuations joined)."""
    found = []
    for line in shell_lines(page):
        line = line.strip().removeprefix("$ ").removeprefix(SETUP)
        if line.startswith(".venv/bin/adapterpack") or line.startswith("adapterpack "):
            found.append(line)
    return found


def _not_run(page: str, line: str) -> str | None:
    return next((why for (where, start), why in NOT_RUN.items() if where == page and line.startswith(start)), None)


BY_NAME = {page.name: page for page in [README, *PAGES]}
RUN = {name: [line for line in shown_lines(page) if _not_run(name, line) is None] for name, page in BY_NAME.items()}


def test_what_is_not_run_is_shown_and_says_why():
    for (page, start), why in NOT_RUN.items():
        assert any(line.startswith(start) for line in shown_lines(BY_NAME[page])), (page, start)
        assert why
    assert sum(len(lines) for lines in RUN.values()) >= 30


@pytest.mark.slow
@pytest.mark.parametrize("page", [name for name, lines in RUN.items() if lines])
def test_every_command_a_page_shows_runs(page, demo, tmp_path):
    project = tmp_path / "checkout"
    project.mkdir()
    for shared in (".venv", "adapters", "models"):  # read only
        (project / shared).symlink_to(REPO / shared)
    # copied, not linked: a manifest's outputs resolve against its folder (../build/demo.mlpackage)
    shutil.copytree(REPO / "manifests", project / "manifests")
    shutil.copytree(demo.output, project / "build" / "demo.mlpackage")
    shutil.copytree(demo_cache(demo), project / "build" / ".adapterpack-cache")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    swift = subprocess.run(
        [str(REPO / ".venv" / "bin" / "adapterpack"), "functions", "build/demo.mlpackage", "--swift"],
        cwd=project, env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    (project / "AdapterFunction.swift").write_text(swift.stdout)  # the enum an app holds (devices.md)
    for line in RUN[page]:
        ran = subprocess.run(["bash", "-c", line], cwd=project, env=env, capture_output=True, text=True, timeout=900)
        assert ran.returncode == 0, f"{page}: {line}\nexit {ran.returncode}\n{ran.stderr[-3000:]}"
