"""The command line end to end: builds, function checks for Swift, and bad input refused with
exit 2, one line, no traceback and no output written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.records import BuildOptions
from factories import make_adapter, make_base, run_cli

MANIFEST = """name: tiny
base:
  path: base
  tokenizer: adapterpack-tests/tiny-llama
adapters:
  - name: chat
    path: chat
  - name: code
    path: code
    scale: 0.5
include_base: plain
default_function: code
export:
  max_context: 64
compression:
  method: {method}
output: out/tiny.mlpackage
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    make_base(root / "base", "llama")
    make_adapter(root / "chat", root / "base", targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    make_adapter(root / "code", root / "base", seed=5, r=8, alpha=16, targets=("gate_proj", "up_proj", "down_proj"))
    (root / "tiny.yaml").write_text(MANIFEST.format(method="palettize"))
    return root


@pytest.fixture(scope="module")
def built(project) -> Path:
    # Random tiny weights do not survive 4-bit palettization well enough for the verify
    # thresholds (those are checked on real weights); this package is about structure.
    result = run_cli("build", project / "tiny.yaml", "--quiet", "--no-verify")
    assert result.returncode == 0, result.stderr
    return project / "out" / "tiny.mlpackage"


def test_build_writes_one_multifunction_package(built, project):
    assert built.is_dir()
    assert not list(built.parent.glob(".*staging*")), "staging folders must not be left behind"
    result = run_cli("functions", built, "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert [f["name"] for f in listing["functions"]] == ["chat", "code", "plain"]
    assert listing["default"] == "code"
    for function in listing["functions"]:
        assert [x["name"] for x in function["inputs"]] == ["inputIds", "causalMask"]
        assert [x["name"] for x in function["states"]] == ["keyCache", "valueCache", "writtenSlots"]
        assert [x["name"] for x in function["outputs"]] == ["logits"]
        inputs = {x["name"]: x for x in function["inputs"]}
        assert inputs["inputIds"]["dtype"] == "int32" and inputs["inputIds"]["shape"] == "(1, 1...64)"
        assert inputs["causalMask"]["dtype"] == "float16"


def test_package_metadata_records_provenance(built, project):
    from adapterpack.formats.registry import read_functions

    metadata = read_functions(built).metadata
    assert metadata["co.huggingface.exporters.name"] == "adapterpack-tests/tiny-llama"
    functions = json.loads(metadata["co.adapterpack.functions"])
    assert set(functions) == {"chat", "code", "plain"}
    assert functions["code"]["scale"] == 0.5 and len(functions["code"]["adapterSha256"]) == 64
    assert metadata["co.adapterpack.maxContext"] == "64"
    assert "coremltools" in json.loads(metadata["co.adapterpack.versions"])


def test_package_is_deduplicated(project, tmp_path):
    """Shared weights are stored once: the package is smaller than its functions built alone."""
    from adapterpack.assemble.pipeline import build

    result = build(project / "tiny.yaml", output=tmp_path / "dedup.mlpackage", options=BuildOptions(verify=False))
    alone = sum(result.part_sizes.values())
    assert len(result.part_sizes) == 3
    # chat and code each change only part of the weights; the embeddings, the untouched layers
    # and the whole plain base are shared, so well under the sum must remain.
    assert result.package_size < 0.8 * alone, (result.package_size, alone)


def test_expect_guards_swift_function_names(built):
    ok = run_cli("functions", built, "--expect", "plain,chat,code")
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("functions", built, "--expect", "chat,coder")
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0
    assert "missing coder" in bad.stderr and "unexpected code, plain" in bad.stderr


def test_swift_enum(built):
    result = run_cli("functions", built, "--swift")
    assert result.returncode == 0
    assert 'case chat = "chat"' in result.stdout
    assert 'case plain = "plain"' in result.stdout
    assert "static let defaultFunction: AdapterFunction = .code" in result.stdout


def test_existing_output_needs_force(built, project):
    before = built.stat().st_mtime_ns
    refused = run_cli("build", project / "tiny.yaml", "--quiet", "--no-verify")
    assert refused.returncode == 2
    assert "--force" in refused.stderr
    assert built.stat().st_mtime_ns == before


def test_validate_and_schema(project):
    result = run_cli("validate", project / "tiny.yaml")
    assert result.returncode == 0, result.stderr
    assert "3 function(s)" in result.stdout
    schema = run_cli("schema")
    assert schema.returncode == 0 and json.loads(schema.stdout)["title"] == "adapterpack manifest"


def _corrupt(project: Path, tmp_path: Path, case: str) -> Path:
    """A copy of the project with one defect; returns its manifest."""
    root = tmp_path / "p"
    shutil.copytree(project, root, ignore=shutil.ignore_patterns("out"))
    manifest = root / "tiny.yaml"
    text = manifest.read_text()
    weights = root / "chat" / "adapter_model.safetensors"
    if case == "unknown key":
        manifest.write_text(text + "colour: red\n")
    elif case == "yaml syntax":
        manifest.write_text(text + "adapters: [\n")
    elif case == "missing path":
        manifest.write_text(text.replace("path: chat", "path: gone"))
    elif case == "duplicate name":
        manifest.write_text(text.replace("name: code", "name: chat"))
    elif case == "non-swift name":
        manifest.write_text(text.replace("name: code", "name: my-code"))
    elif case == "unknown default":
        manifest.write_text(text.replace("default_function: code", "default_function: zen"))
    elif case == "pickle only":
        weights.rename(weights.with_name("adapter_model.bin"))
    elif case == "shape mismatch":
        make_base(root / "other", "llama", hidden_size=48)
        make_adapter(root / "chat", root / "other")
    elif case == "missing target":
        config_file = root / "chat" / "adapter_config.json"
        config = json.loads(config_file.read_text())
        config["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj", "nonexistent_proj"]
        config_file.write_text(json.dumps(config))
        from safetensors.numpy import load_file, save_file

        tensors = load_file(weights)
        tensors["base_model.model.model.layers.0.self_attn.nonexistent_proj.lora_A.weight"] = np.ones((4, 64), np.float32)
        save_file(tensors, weights)
    elif case == "missing keys":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(weights)
        for key in [k for k in tensors if ".layers.1.self_attn.v_proj." in k]:
            del tensors[key]
        save_file(tensors, weights)
    elif case == "nan":
        from safetensors.numpy import load_file, save_file

        tensors = load_file(weights)
        key = sorted(tensors)[0]
        tensors[key] = tensors[key].copy()
        tensors[key].flat[0] = np.nan
        save_file(tensors, weights)
    elif case == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) - 100])
    elif case == "missing base":
        shutil.rmtree(root / "base")
        manifest.write_text(text.replace("path: base", "path: ./base"))
    else:
        raise AssertionError(case)
    return manifest


BAD_CASES = [
    "unknown key", "yaml syntax", "missing path", "duplicate name", "non-swift name", "unknown default",
    "pickle only", "shape mismatch", "missing target", "missing keys", "nan", "truncated", "missing base",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_exit_2_one_line_no_output(project, tmp_path, case):
    manifest = _corrupt(project, tmp_path, case)
    result = run_cli("build", manifest, "-o", tmp_path / "out.mlpackage")
    assert result.returncode == 2, (case, result.stdout, result.stderr)
    message = result.stderr.strip()
    assert message.count("\n") == 0, message
    assert "Traceback" not in result.stderr
    assert str(tmp_path / "p") in message, message  # names the offending file
    assert not (tmp_path / "out.mlpackage").exists()
    assert not list(tmp_path.glob(".out.mlpackage*"))


def test_version_is_printed():
    from importlib.metadata import version

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"adapterpack {version('adapterpack')}"


def test_a_command_run_in_process_leaves_ctrl_c_as_it_found_it(project):
    """The commands catch Ctrl-C to exit 130; run in a longer-lived process (a test runner, a
    script calling the app), they hand the previous handler back when they return."""
    import signal

    from factories import invoke_cli

    def own_handler(signum, frame):
        raise AssertionError("not reached")

    previous = signal.signal(signal.SIGINT, own_handler)
    try:
        result = invoke_cli("validate", project / "tiny.yaml")
        assert result.returncode == 0, result.stderr
        assert signal.getsignal(signal.SIGINT) is own_handler
    finally:
        signal.signal(signal.SIGINT, previous)
