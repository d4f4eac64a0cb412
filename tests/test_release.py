"""release: reproducible artifacts, sums that check, and output that survives interruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adapterpack.inputs.checked import check_inputs
from factories import make_adapter, make_base, tree_digest

CLI = [sys.executable, "-m", "adapterpack"]
MANIFEST = """name: rel
base: {path: base}
adapters:
  - {name: chat, path: chat}
include_base: base
export: {max_context: 32}
compression: {method: none}
"""


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env, timeout=600, **kwargs)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    from test_generate import write_byte_level_tokenizer

    root = tmp_path_factory.mktemp("release")
    make_base(root / "base", "llama")
    write_byte_level_tokenizer(root / "base")
    make_adapter(root / "chat", root / "base", std=0.1)
    (root / "rel.yaml").write_text(MANIFEST)
    (root / "eval.txt").write_text("def f(x):\n    return x + 1\n\nclass A:\n    pass\n")
    return root


@pytest.fixture(scope="module")
def first_release(project) -> Path:
    result = run("release", project / "rel.yaml", "--out-dir", project / "dist1", "--eval-text", project / "eval.txt", "--quiet")
    assert result.returncode == 0, result.stderr
    return project / "dist1"


def test_release_is_reproducible_and_sums_check(project, first_release):
    time.sleep(1.5)  # a different wall-clock second must not change any byte
    second = run("release", project / "rel.yaml", "--out-dir", project / "dist2", "--eval-text", project / "eval.txt", "--quiet")
    assert second.returncode == 0, second.stderr
    for name in ("rel.mlpackage.zip", "build-info.json", "SHA256SUMS"):
        assert (first_release / name).read_bytes() == (project / "dist2" / name).read_bytes(), name
    assert tree_digest(first_release / "rel") == tree_digest(project / "dist2" / "rel")
    check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=first_release, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "rel.mlpackage.zip: OK" in check.stdout and "rel/README.md: OK" in check.stdout
    assert "rel/rel.mlpackage/Data/com.apple.CoreML/weights/weight.bin: OK" in check.stdout


def test_bundle_holds_what_the_app_needs(project, first_release):
    bundle = first_release / "rel"
    names = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    for expected in ("README.md", "AdapterFunction.swift", "tokenizer.json", "tokenizer_config.json", "config.json",
                     "generation_config.json", "rel.mlpackage/Manifest.json"):
        assert expected in names, names
    for name in ("tokenizer.json", "config.json"):
        assert (bundle / name).read_bytes() == (project / "base" / name).read_bytes()
    swift = (bundle / "AdapterFunction.swift").read_text()
    assert 'case chat = "chat"' in swift and 'case base = "base"' in swift
    card = (bundle / "README.md").read_text()
    info = json.loads((first_release / "build-info.json").read_text())
    assert card.startswith("---\nlibrary_name: coreml\n")
    assert info["adapters"]["chat"]["sha256"][:16] in card  # the adapter's hash
    assert "## Verification" in card and "## Evaluation" in card and "## Memory on device" in card
    assert "AutoTokenizer.from(modelFolder: folder)" in card and "AdapterFunction.chat.rawValue" in card
    chat = next(f for f in info["eval"]["functions"] if f["function"] == "chat")
    assert f"{chat['perplexity']:.3f}" in card
    # build-info lists every bundle file with the digest SHA256SUMS checks
    sums = dict(reversed(line.split("  ", 1)) for line in (first_release / "SHA256SUMS").read_text().splitlines())
    assert info["bundle"] and all(sums[path] == digest for path, digest in info["bundle"].items())


def test_generate_runs_from_the_bundle_alone(first_release):
    """In a bundle the package finds its tokenizer beside it: no manifest needed."""
    result = run("generate", first_release / "rel" / "rel.mlpackage", "--function", "chat", "--prompt", "def f(x):",
                 "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def f(x):") and "chat: 4 tokens" in result.stderr


def test_release_without_tokenizer_files_is_bad_input(tmp_path):
    make_base(tmp_path / "base", "llama")
    (tmp_path / "m.yaml").write_text(MANIFEST.replace("adapters:\n  - {name: chat, path: chat}\n", "adapters: []\n"))
    result = run("release", tmp_path / "m.yaml", "--out-dir", tmp_path / "dist")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "no tokenizer files" in errors[0], result.stderr
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_build_info_records_provenance(project, first_release):
    info = json.loads((first_release / "build-info.json").read_text())
    assert info["functions"] == ["chat", "base"]
    assert len(info["base"]["sha256"]) == 64 and len(info["adapters"]["chat"]["sha256"]) == 64
    assert info["verify"]["passed"] is True
    assert info["sizes"]["zip_bytes"] == (first_release / "rel.mlpackage.zip").stat().st_size
    assert "coremltools" in info["versions"] and info["manifest"]["name"] == "rel"


def test_zip_entries_are_normalized(first_release):
    import zipfile

    with zipfile.ZipFile(first_release / "rel.mlpackage.zip") as archive:
        names = archive.namelist()
        assert names == sorted(names) or names[0] == "rel.mlpackage/"
        assert all(info.date_time == (1980, 1, 1, 0, 0, 0) for info in archive.infolist())
        assert {(info.external_attr >> 16) & 0o777 for info in archive.infolist()} <= {0o644, 0o755}
        assert "rel.mlpackage/Manifest.json" in names


def test_existing_release_needs_force(project, first_release):
    before = tree_digest(first_release)
    refused = run("release", project / "rel.yaml", "--out-dir", first_release)
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert tree_digest(first_release) == before


def _start_build_and_wait_for_staging(project: Path, output: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    process = subprocess.Popen(
        [*CLI, "build", str(project / "rel.yaml"), "-o", str(output), "--force", "--quiet", "--no-cache"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if list(output.parent.glob(f".{output.name}*staging*/parts/*")):
            return process
        if process.poll() is not None:
            raise AssertionError(f"build ended before it could be interrupted: {process.stderr.read()}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError("no staging folder appeared")


@pytest.mark.parametrize("how", [pytest.param("SIGINT", marks=pytest.mark.slow), pytest.param("SIGKILL", marks=pytest.mark.slow)])
def test_interrupted_build_leaves_previous_output_intact(project, tmp_path, how):
    output = tmp_path / "pkg.mlpackage"
    first = run("build", project / "rel.yaml", "-o", output, "--no-verify", "--quiet")
    assert first.returncode == 0, first.stderr
    before = tree_digest(output)

    process = _start_build_and_wait_for_staging(project, output)
    process.send_signal(signal.SIGINT if how == "SIGINT" else signal.SIGKILL)
    code = process.wait(timeout=120)
    stderr = process.stderr.read()
    if how == "SIGINT":
        assert code == 130, stderr
        assert "Traceback" not in stderr
        assert not list(tmp_path.glob(".pkg.mlpackage*staging*")), "staging must be removed on Ctrl-C"
    else:
        assert code == -signal.SIGKILL
    assert tree_digest(output) == before

    # The next run removes what a killed run left behind, and succeeds.
    again = run("build", project / "rel.yaml", "-o", output, "--no-verify", "--quiet", "--force")
    assert again.returncode == 0, again.stderr
    assert not list(tmp_path.glob(".pkg.mlpackage*staging*"))


def test_short_disk_space_is_exit_4(project, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import adapterpack.distribution.artifacts as release_module
    from adapterpack.cli.app import app

    monkeypatch.setattr(release_module.shutil, "disk_usage", lambda path: type("u", (), {"free": 1024})())
    result = CliRunner().invoke(app, ["release", str(project / "rel.yaml"), "--out-dir", str(tmp_path / "d")])
    assert result.exit_code == 4, result.output
    assert "MiB free" in result.output
    assert not (tmp_path / "d" / "SHA256SUMS").exists()


def test_a_build_that_cannot_fit_the_disk_is_refused_before_any_work(project, tmp_path, monkeypatch):
    """The estimate of what a clean build writes (assemble.disk) against the free space of each
    filesystem it writes to: too little is exit 4 naming the folder and the figures, before any
    work, the previous package untouched; validate states the estimate."""
    from typer.testing import CliRunner

    import adapterpack.assemble.disk as disk
    from adapterpack.cli.app import app

    output = tmp_path / "pkg.mlpackage"
    first = run("build", project / "rel.yaml", "-o", output, "--no-verify", "--quiet")
    assert first.returncode == 0, first.stderr
    before = sorted(p.name for p in output.rglob("*"))
    checked = check_inputs(project / "rel.yaml")
    needs = disk.disk_needs(checked)
    assert needs.cache > disk.float16_model_bytes(checked) > 0 and needs.output > 0

    free = {"bytes": needs.output // 2}
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: type("usage", (), {"free": free["bytes"]})())
    refused = CliRunner().invoke(app, ["build", str(project / "rel.yaml"), "-o", str(output), "--force", "--no-cache"])
    assert refused.exit_code == 4, refused.output
    assert "GiB free, this build needs about" in refused.output and str(tmp_path) in refused.output
    assert sorted(p.name for p in output.rglob("*")) == before
    assert not list(tmp_path.glob("*staging*"))
    free["bytes"] = needs.output + needs.cache + 1  # enough: it builds
    assert CliRunner().invoke(app, ["build", str(project / "rel.yaml"), "-o", str(output), "--force", "--no-cache", "--no-verify"]).exit_code == 0
    assert "disk: a clean build writes about" in run("validate", project / "rel.yaml").stdout
    # A rebuild writes less: what its cache holds already is counted once a clean build would not fit.
    cache = tmp_path / "cache"
    free["bytes"] = needs.output + needs.cache + 1
    build_args = ["build", str(project / "rel.yaml"), "-o", str(output), "--force", "--no-verify", "--cache-dir", str(cache)]
    assert CliRunner().invoke(app, build_args).exit_code == 0
    cached = disk._folder_bytes(cache)
    assert 0 < cached <= needs.cache  # the estimate holds what the build left
    free["bytes"] = needs.output + max(0, needs.cache - cached) + 1
    assert free["bytes"] < needs.output + needs.cache
    assert CliRunner().invoke(app, build_args).exit_code == 0
    free["bytes"] -= 2
    assert CliRunner().invoke(app, build_args).exit_code == 4


def test_strict_turns_base_name_mismatch_into_an_error(project, tmp_path):
    import shutil

    root = tmp_path / "p"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("dist*"))
    config_file = root / "chat" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "someone/another-model"
    config_file.write_text(json.dumps(config))
    lenient = run("validate", root / "rel.yaml")
    assert lenient.returncode == 0 and "another-model" in lenient.stderr
    strict = run("build", root / "rel.yaml", "--strict", "-o", tmp_path / "x.mlpackage")
    assert strict.returncode == 2 and "--strict" in strict.stderr
    assert not (tmp_path / "x.mlpackage").exists()
