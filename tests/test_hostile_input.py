"""Hostile and random input: only ever a clean BadInput (exit 2), never a traceback or output.

Property-based (hypothesis): mutated manifests, adapter configs and safetensors files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapterpack.config.manifest import load_manifest
from adapterpack.errors import BadInput
from adapterpack.inputs.checked import check_inputs
from factories import make_adapter, make_base

VALID = """name: h
base: {path: base}
adapters:
  - name: chat
    path: chat
    scale: 1.0
include_base: plain
default_function: chat
export: {max_context: 32, deployment_target: iOS18}
compression: {method: palettize, nbits: 4, keep_float16: [embed_tokens]}
"""
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    make_base(root / "base", "llama")
    make_adapter(root / "chat", root / "base")
    (root / "h.yaml").write_text(VALID)
    return root


def _only_bad_input(call) -> None:
    try:
        call()
    except BadInput as error:
        message = str(error)
        assert message and "\n" not in message and "Traceback" not in message


fragments = st.sampled_from(
    ["name:", "base:", "path:", "adapters:", "- ", "{", "}", "[", "]", ":", "&a", "*a", "!!python/object:os.system",
     "no", "yes", "0x1F", "1e3", "~", "null", "'", '"', "\t", "\n", "  ", "max_context: -1", "nbits: 5",
     "include_base: Chat", "default_function: x", "lora: keep", "method: prune", "sparsity: 2", "???"]
)


@FAST
@given(
    position=st.integers(min_value=0, max_value=len(VALID)),
    cut=st.integers(min_value=0, max_value=20),
    insert=st.lists(fragments, max_size=4).map("".join),
)
def test_mutated_manifests_are_valid_or_bad_input(project, tmp_path_factory, position, cut, insert):
    text = VALID[:position] + insert + VALID[position + cut :]
    path = project / "mutated.yaml"
    path.write_text(text)
    _only_bad_input(lambda: load_manifest(path))


@FAST
@given(data=st.binary(max_size=400))
def test_random_bytes_as_manifest(project, data):
    path = project / "random.yaml"
    path.write_bytes(data)
    _only_bad_input(lambda: load_manifest(path))


def test_yaml_alias_bomb_is_refused(tmp_path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nname: x\n")
    with pytest.raises(BadInput, match="alias bomb"):
        load_manifest(path)


def test_python_tags_do_not_run_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "tag.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\nbase: {{path: .}}\n")
    with pytest.raises(BadInput):
        load_manifest(path)
    assert not marker.exists()


def test_deep_nesting_is_refused(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(BadInput):
        load_manifest(path)


@FAST
@given(text=st.text(max_size=300))
def test_mutated_adapter_config_is_valid_or_bad_input(project, text):
    config = project / "chat" / "adapter_config.json"
    original = config.read_text()
    try:
        config.write_text(text if not text.startswith("{") else original[:-1] + text)
        _only_bad_input(lambda: check_inputs(project / "h.yaml"))
    finally:
        config.write_text(original)


@FAST
@given(
    offset=st.integers(min_value=0, max_value=600),
    replacement=st.binary(min_size=1, max_size=16),
    truncate=st.booleans(),
)
def test_mutated_adapter_weights_are_valid_or_bad_input(project, offset, replacement, truncate):
    weights = project / "chat" / "adapter_model.safetensors"
    original = weights.read_bytes()
    try:
        data = bytearray(original)
        data[offset : offset + len(replacement)] = replacement
        if truncate:
            data = data[: max(0, len(original) - offset)]
        weights.write_bytes(bytes(data))
        _only_bad_input(lambda: check_inputs(project / "h.yaml"))
    finally:
        weights.write_bytes(original)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(min_value=0, max_value=400), value=st.integers(min_value=0, max_value=255))
def test_cli_build_on_mutated_adapter_exit_0_or_2_and_no_output_on_failure(project, tmp_path_factory, offset, value):
    root = tmp_path_factory.mktemp("cli")
    shutil.copytree(project, root / "p")
    weights = root / "p" / "chat" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[offset] = value
    weights.write_bytes(bytes(data))
    output = root / "out.mlpackage"
    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    result = subprocess.run(
        [sys.executable, "-m", "adapterpack", "build", str(root / "p" / "h.yaml"), "-o", str(output), "--quiet",
         "--no-verify"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    if result.returncode == 2:
        assert not output.exists()
        assert len(result.stderr.strip().splitlines()) == 1


def test_a_full_disk_while_copying_is_one_line_and_exit_4(capsys):
    """shutil.copytree reports every failed file in one list; the user gets the first, as one line."""
    import errno
    import shutil

    import typer

    from adapterpack.cli.boundary import error_boundary

    failures = [(f"/tmp/src/{n}.bin", f"/tmp/dst/{n}.bin", f"[Errno {errno.ENOSPC}] No space left on device: '/tmp/dst/{n}.bin'") for n in "ab"]
    with pytest.raises(typer.Exit) as raised:
        with error_boundary():
            raise shutil.Error(failures)
    assert raised.value.exit_code == 4
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0, message
    assert "out of disk space" in message and "/tmp/src/a.bin" in message and "1 more file" in message


def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("target", ["base", "chat", "h.yaml", "notes", "base/inside.mlpackage"])
def test_an_output_over_an_input_or_a_foreign_folder_is_refused_even_with_force(project, target):
    """Data loss: an output naming the base, an adapter, the manifest, a folder of the user's
    (no package marker inside) or a place inside an input is refused with exit 2; nothing changes."""
    from factories import run_cli

    (project / "notes").mkdir(exist_ok=True)
    (project / "notes" / "todo.txt").write_text("keep me")
    before = {name: _tree(project / name) if (project / name).is_dir() else (project / name).read_bytes() for name in ("base", "chat", "notes", "h.yaml")}
    result = run_cli("build", project / "h.yaml", "-o", project / target, "--force", "--no-verify")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "head_dim" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    after = {name: _tree(project / name) if (project / name).is_dir() else (project / name).read_bytes() for name in ("base", "chat", "notes", "h.yaml")}
    assert after == before


def test_an_internal_error_is_one_line_and_exit_1(project, monkeypatch):
    """A bug anywhere inside a build (here: raised from the conversion) is the documented one-line
    internal error with exit 1, not a second traceback from the error boundary."""
    from typer.testing import CliRunner

    from adapterpack.cli.app import app
    from adapterpack.convert import coreml

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(coreml, "convert_decoder", broken)
    monkeypatch.delenv("ADAPTERPACK_DEBUG", raising=False)
    out = project / "fault.mlpackage"
    result = CliRunner().invoke(app, ["build", str(project / "h.yaml"), "-o", str(out), "--no-verify", "--no-cache"])
    assert result.exit_code == 1, result.output
    assert "internal error: RuntimeError: injected fault" in result.output
    assert "NameError" not in result.output and not out.exists()


def _set_json(file: Path, key: str, value) -> None:
    import json

    data = json.loads(file.read_text())
    data[key] = value
    file.write_text(json.dumps(data))


@pytest.mark.parametrize("case", ["lora_alpha null", "target_modules 5", "hidden_size '128'", "scale nan", "config is a FIFO"])
def test_bad_field_types_and_special_files_are_one_line_exit_2(project, tmp_path, case):
    """Each once a traceback (or, for a FIFO, a hang): now validate names the file and exits 2."""
    root = tmp_path / "p"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("*.mlpackage", ".adapterpack-cache", "notes"))
    if case == "lora_alpha null":
        _set_json(root / "chat" / "adapter_config.json", "lora_alpha", None)
    elif case == "target_modules 5":
        _set_json(root / "chat" / "adapter_config.json", "target_modules", 5)
    elif case == "hidden_size '128'":
        _set_json(root / "base" / "config.json", "hidden_size", "128")
    elif case == "scale nan":
        (root / "h.yaml").write_text(VALID.replace("scale: 1.0", "scale: .nan"))
    else:
        (root / "chat" / "adapter_config.json").unlink()
        os.mkfifo(root / "chat" / "adapter_config.json")
    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    result = subprocess.run(
        [sys.executable, "-m", "adapterpack", "validate", str(root / "h.yaml")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2, (case, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, (case, result.stderr)
    named = "h.yaml" if case == "scale nan" else ("config.json" if "hidden" in case else "adapter_config.json")
    assert named in lines[0], (case, lines[0])


def test_adapter_weights_outside_target_modules_are_refused_not_dropped(project, tmp_path):
    """q_proj tensors with target_modules [v_proj]: peft would load and ignore them, so the
    function would silently lack part of the adapter. It is refused, naming the module."""
    root = tmp_path / "p"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("*.mlpackage", ".adapterpack-cache", "notes"))
    _set_json(root / "chat" / "adapter_config.json", "target_modules", ["v_proj"])
    with pytest.raises(BadInput, match=r"do(es)? not target .*first: model\.layers\.0\.self_attn\.q_proj"):
        check_inputs(root / "h.yaml")


def test_release_refuses_a_broken_tokenizer_and_an_out_dir_that_is_a_file(tmp_path):
    """Tokenizer files are loaded before a release ships them; --out-dir naming a file is bad input."""
    from factories import run_cli

    demo = Path(__file__).resolve().parents[1] / "adapters" / "demo" / "base"
    shutil.copytree(demo, tmp_path / "base")
    text = (tmp_path / "base" / "tokenizer.json").read_text()
    (tmp_path / "base" / "tokenizer.json").write_text(text[: len(text) // 2])
    (tmp_path / "m.yaml").write_text("name: t\nbase: {path: base}\nadapters: []\ninclude_base: base\nexport: {max_context: 16}\n")
    result = run_cli("release", tmp_path / "m.yaml", "--out-dir", tmp_path / "dist")
    assert result.returncode == 2 and "tokenizer" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())
    (tmp_path / "file").write_text("x")
    result = run_cli("release", tmp_path / "m.yaml", "--out-dir", tmp_path / "file", "--no-bundle")
    assert result.returncode == 2 and "names a file" in result.stderr, result.stderr
    assert (tmp_path / "file").read_text() == "x"
