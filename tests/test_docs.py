"""The front door: the README is short and starts with the two commands, the docs site builds in
strict mode (a broken link, anchor or reference fails it), and every adapterpack command the
README and the docs show is one the command line accepts, options and all."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
TWO_COMMANDS = [
    "scripts/setup.sh && .venv/bin/adapterpack build manifests/demo.yaml --force",
    "scripts/setup.sh && .venv/bin/python -m pytest",
]


def test_the_readme_starts_with_the_two_commands_and_stays_short() -> None:
    lines = README.read_text().splitlines()
    assert lines[:4] == ["```sh", *TWO_COMMANDS, "```"]
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move the detail to docs/"


def test_the_docs_site_builds_in_strict_mode(tmp_path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO / "src")}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text()
    manifest = (tmp_path / "site" / "manifest" / "index.html").read_text()
    # the generated references are there, whole: every command, every manifest section
    for command in ("build", "merge", "verify", "generate", "eval", "release", "validate", "inspect", "functions"):
        assert f"adapterpack {command}" in cli, command
    for section in ("Base", "Adapter", "Export", "Compression", "VerifySettings"):
        assert f'id="{section.lower()}"' in manifest, section


def shell_lines(page: Path) -> list[str]:
    """Every line of ``page``'s shell blocks, continuation lines joined."""
    blocks = re.findall(r"```(?:sh|bash|console|shell)\n(.*?)```", page.read_text(), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def _shown_commands() -> list[tuple[str, str]]:
    """(page, command line) of every ``adapterpack`` invocation in a shell block of the README or
    a docs page (continuation lines joined; cut at a pipe, ``&&``, ``;`` or a redirection)."""
    found = []
    for page in [README, *PAGES]:
        for line in shell_lines(page):
            lexer = shlex.shlex(line.lstrip("$ "), posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            words: list[str] = []
            for token in [*lexer, ";"]:
                if token and set(token) <= set("|&;<>()"):
                    if words and words[0].endswith("bin/adapterpack") or words[:1] == ["adapterpack"]:
                        found.append((page.name, shlex.join(words)))
                    words = []
                else:
                    words.append(token)
    return found


def test_the_docs_show_commands() -> None:
    assert len(_shown_commands()) >= 40


@pytest.mark.parametrize("page, command", _shown_commands())
def test_every_command_the_docs_show_parses(page: str, command: str) -> None:
    """Commands, arguments and options as the command line defines them today: parsed (not run)
    by the same click command the CLI runs, so a renamed option or command fails here."""
    import typer

    from adapterpack.cli.app import app

    args = shlex.split(command)[1:]
    group = typer.main.get_command(app)
    try:
        context = group.make_context("adapterpack", list(args))
        # a group's context keeps the command and its arguments for the command's own parse
        while hasattr(group, "commands") and (context._protected_args or context.args):
            rest = [*context._protected_args, *context.args]
            name, group, rest = group.resolve_command(context, rest)
            context = group.make_context(name, list(rest), parent=context)
    except typer.Exit as done:  # --help, --version: printed, then a clean exit
        assert done.exit_code == 0


def test_every_benchmark_table_the_docs_render_was_written_by_its_benchmark() -> None:
    """A ``<!-- benchmark: NAME TABLE -->`` marker names a result a benchmark recorded
    (``benchmarks/results.py``): the table, the machine it ran on, the commit, the date and a
    command that runs a benchmark script of the repository."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)  # the pattern the docs site renders the markers by
    markers = [found for page in [README, *PAGES] for found in hooks.BENCHMARK_MARKER.findall(page.read_text())]
    assert markers, "no page renders a benchmark result"
    for name, table in markers:
        result = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())
        assert result["benchmark"] == name and table in result["tables"]
        columns, rows = result["tables"][table]["columns"], result["tables"][table]["rows"]
        assert rows and all(len(row) == len(columns) for row in rows)
        assert {"cpu", "cores", "memory_gib", "torch", "adapterpack_commit"} <= set(result["machine"])
        script = shlex.split(result["command"])[1]
        assert script.startswith("benchmarks/") and (REPO / script).is_file(), result["command"]
