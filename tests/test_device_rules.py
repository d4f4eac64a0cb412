"""Device rules checked at build time: Neural Engine state sizes and the Swift client's contract."""

from __future__ import annotations

import copy
import json
import textwrap

import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.config.device_rules import cache_length_findings, package_findings
from adapterpack.formats.mlpackage.spec import load_spec_file, spec_path
from adapterpack.inputs.checked import check_inputs, check_state_sizes
from factories import make_adapter, make_base, run_cli


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("rules")
    make_base(root / "base", "qwen3")  # head_dim 32
    make_adapter(root / "a", root / "base", std=0.1)
    manifest = "name: r\nbase: {path: base}\nadapters: [{name: a, path: a}]\nexport: {max_context: %s}\ncompression: {method: none}\n"
    (root / "good.yaml").write_text(manifest % 64)
    (root / "odd.yaml").write_text(manifest % 40)
    return root


@pytest.fixture(scope="module")
def good_spec(project):
    package = build(project / "good.yaml", output=project / "good.mlpackage", options=BuildOptions(verify=False)).output
    return package, load_spec_file(spec_path(package))


def test_sizes_rule_names_the_fix():
    assert cache_length_findings(512, 128, "m.yaml") == []
    (context,) = cache_length_findings(500, 128, "m.yaml")
    assert "max_context 500 is not a multiple of 32" in context.line() and "max_context: 480" in context.line()
    assert "coremltools#2631" in context.source
    (width,) = cache_length_findings(512, 80, "m.yaml")
    assert "head_dim 80" in width.problem


def test_exported_package_meets_every_rule(good_spec):
    _, spec = good_spec
    assert package_findings(spec) == []
    states = [s.name for s in spec.description.functions[0].state]
    assert states == ["keyCache", "valueCache", "writtenSlots"]


@pytest.mark.parametrize(
    "break_it, expected",
    [
        (lambda f: f.state.pop(0), "no state keyCache"),
        (lambda f: f.output[0].type.multiArrayType.shape.extend([1, 1]), "logits must have rank 3"),
        (lambda f: f.input[0].type.multiArrayType.ClearField("shapeRange"), "not a range"),
        (lambda f: setattr(f.input[1].type.multiArrayType.shapeRange.sizeRanges[2], "lowerBound", 2), "one query row"),
        (lambda f: f.state[2].type.stateType.arrayType.shape.__setitem__(-1, 40), "writtenSlots"),
    ],
    ids=["no-key-cache", "logits-rank", "fixed-query", "mask-rows", "state-width"],
)
def test_broken_contract_is_found(good_spec, break_it, expected):
    _, spec = good_spec
    broken = copy.deepcopy(spec)
    for function in broken.description.functions:
        if function.name == "a":
            break_it(function)
    lines = [f.line() for f in package_findings(broken)]
    # and the program's own declaration is read when the description leaves the output unshaped
    assert package_findings(spec) == []
    assert len(lines) == 1 and lines[0].startswith("function a:") and expected in lines[0], lines


def test_build_warns_and_strict_refuses_an_odd_context(project, caplog):
    with caplog.at_level("WARNING"):
        check_state_sizes(check_inputs(project / "odd.yaml"), strict=False)
    assert any("max_context 40 is not a multiple of 32" in r.getMessage() for r in caplog.records)
    result = run_cli("build", project / "odd.yaml", "--strict", "-o", project / "odd.mlpackage")
    assert result.returncode == 2, result.stderr
    assert "max_context 40" in result.stderr and "--strict" in result.stderr
    assert result.stderr.strip().count("\n") == 0 and not (project / "odd.mlpackage").exists()


def test_inspect_reports_rules_and_strict_fails(project, good_spec, tmp_path):
    package, spec = good_spec
    result = run_cli("inspect", package, "--json", "--strict")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["device_rules"] == []
    # The same package with a logits output of the wrong rank.
    import shutil

    broken = tmp_path / "broken.mlpackage"
    shutil.copytree(package, broken)
    bad = copy.deepcopy(spec)
    for function in bad.description.functions:
        function.output[0].type.multiArrayType.shape.extend([1, 1])
    spec_path(broken).write_bytes(bad.SerializeToString())
    result = run_cli("inspect", broken, "--json")
    assert result.returncode == 0
    assert [r["rule"] for r in json.loads(result.stdout)["device_rules"]] == ["swift-contract"]
    result = run_cli("inspect", broken, "--strict")
    assert result.returncode == 2 and "logits must have rank 3" in result.stderr


def test_auto_context_is_a_multiple_of_32(tmp_path):
    """auto fits the device, is capped at the positions the model has (200 here), then rounded down."""
    make_base(tmp_path / "base", "llama", max_position_embeddings=200)
    (tmp_path / "m.yaml").write_text(
        textwrap.dedent(
            """\
            name: auto
            base: {path: base}
            include_base: base
            export: {max_context: auto, target_device: iphone-15}
            """
        )
    )
    assert check_inputs(tmp_path / "m.yaml").manifest.export.max_context == 192
