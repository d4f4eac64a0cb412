"""The format seam: every format the registry holds is complete (a reader, a runtime that can run
it, an inspection, card text), the schema and the registry agree on the formats that exist, and
no code outside the formats layer tests which format it holds."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from adapterpack.assemble.pipeline import WHOLE_WRITERS
from adapterpack.config.manifest import PACKAGE_FORMATS, Export
from adapterpack.errors import BadInput
from adapterpack.formats.registry import FORMATS, NAMES, named, of_output, of_package
from adapterpack.report.inspectors import INSPECTORS
from adapterpack.verification.runners import SESSIONS

SOURCE = Path(__file__).resolve().parents[1] / "src" / "adapterpack"


def test_the_schema_and_the_registry_know_the_same_formats():
    assert tuple(PACKAGE_FORMATS) == NAMES
    export = Export.model_json_schema()["properties"]
    assert tuple(export["format"]["enum"]) == NAMES and export["format"]["default"] == NAMES[0]
    assert set(export["contract"]["enum"]) == {c for f in FORMATS.values() for c in f.contracts}


def test_what_a_format_takes_is_its_registry_entrys(monkeypatch):
    """The manifest asks the registry which contracts and precisions a format takes: a format
    that took Apple's contract would be let through, one that did not is refused."""
    with pytest.raises(ValueError, match=r"contract apple applies to format aimodel \(a \.mlpackage takes contract swift-transformers\)"):
        Export(contract="apple")
    with pytest.raises(ValueError, match="compute_precision float32 applies to format aimodel"):
        Export(compute_precision="float32")
    widened = dataclasses.replace(FORMATS["mlpackage"], contracts=("swift-transformers", "apple"))
    monkeypatch.setitem(FORMATS, "mlpackage", widened)
    assert Export(contract="apple").contract == "apple"
    monkeypatch.setitem(FORMATS, "aimodel", dataclasses.replace(FORMATS["aimodel"], contracts=("swift-transformers",)))
    with pytest.raises(ValueError, match=r"contract apple applies to format mlpackage \(a \.aimodel takes"):
        Export(format="aimodel", contract="apple")


@pytest.mark.parametrize("name", NAMES)
def test_every_format_is_complete(name):
    package_format = FORMATS[name]
    assert package_format in INSPECTORS
    assert package_format.fans_out or name in WHOLE_WRITERS
    assert (package_format.runtime or "numpy") in SESSIONS
    assert named(name) is package_format and of_output(f"x/y{package_format.suffix}") is package_format
    intro = package_format.card.introduction(f"n{package_format.suffix}", "hub/base", 64, "iOS18")
    lead, code, _ = package_format.card.swift(f"n{package_format.suffix}", "n", "AdapterFunction", "chat", "the tokenizer")
    assert f"n{package_format.suffix}" in intro and "AdapterFunction.chat.rawValue" in "\n".join(code) and lead


def test_paths_and_names_map_to_formats():
    assert of_output("out/x.zip") is None
    assert of_package("out/model.mlmodel") is FORMATS["mlpackage"]  # Core ML's reader takes an .mlmodel too
    with pytest.raises(BadInput, match="choose mlpackage or aimodel"):
        named("onnx")


# A test of the format outside the formats layer: comparing a format name or a path's suffix with a
# package suffix. The schema (config/manifest.py) states which formats exist and checks `output:`.
FORMAT_TEST = re.compile(r"""==\s*["'](mlpackage|aimodel)["']|["'](mlpackage|aimodel)["']\s*==|suffix\s*==\s*["']\.(mlpackage|aimodel)|is_asset\(""")


def test_no_code_outside_the_formats_layer_tests_a_format():
    found = []
    for file in SOURCE.rglob("*.py"):
        relative = file.relative_to(SOURCE).as_posix()
        if relative.startswith("formats/") or relative == "config/manifest.py":
            continue
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if FORMAT_TEST.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, found


def test_a_saved_model_leaves_no_temporary_package(tmp_path):
    """coremltools keeps a converted model in a temporary package until the process exits;
    ``save_model`` moves it into place, with the metadata set after conversion."""
    import numpy as np

    from adapterpack.formats.mlpackage.spec import load_spec_file, save_model, spec_path
    from adapterpack.quiet import captured_output, import_coremltools

    ct = import_coremltools()
    from coremltools.converters.mil import Builder as mb

    weight = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 64), dtype=ct.converters.mil.mil.types.fp16)], opset_version=ct.target.iOS18)
    def program(x):
        return mb.linear(x=x, weight=weight)

    with captured_output():
        model = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18, skip_model_load=True)
    temporary = Path(model.package_path)
    assert temporary.is_dir() and model.is_temp_package
    model.user_defined_metadata["written"] = "after conversion"
    save_model(model, tmp_path / "m.mlpackage")
    assert not temporary.exists()
    spec = load_spec_file(spec_path(tmp_path / "m.mlpackage"))
    assert spec.description.metadata.userDefined["written"] == "after conversion"
    assert (tmp_path / "m.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size > 64 * 64 * 2


def _layered_modules() -> set[str]:
    """Every module the import contracts place: the stages' layers and each room's own layers."""
    import tomllib

    contracts = tomllib.loads((SOURCE.parents[1] / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    placed = set()
    for contract in contracts:
        if contract["type"] != "layers":
            continue
        for container in contract.get("containers", [""]):
            for layer in contract["layers"]:
                for name in re.split(r"[|:]", layer):
                    placed.add(f"{container}.{name.strip()}" if container else name.strip())
    return placed


def test_every_module_of_a_format_sits_in_a_declared_layer():
    """A format's room spans the stages it serves (its writer beside assemble, its conversion
    over convert...), so the import contracts name its modules one by one: a module added to a
    room, or to the formats package, must be given its layer or the import contracts would not
    check it."""
    placed = _layered_modules()
    unplaced = []
    for file in (SOURCE / "formats").rglob("*.py"):
        parts = ["adapterpack", *file.relative_to(SOURCE).with_suffix("").parts]
        if parts[-1] == "__init__":
            continue
        if not any(".".join(parts[:n]) in placed for n in range(3, len(parts) + 1)):
            unplaced.append(".".join(parts))
    assert not unplaced, f"add to pyproject.toml's import-linter layers: {unplaced}"


def test_the_adding_a_format_page_names_every_table_and_room_module():
    """docs/adding-a-format.md: each registration table it lists exists where it says, and its
    table of the Core AI room names exactly the room's modules."""
    import importlib

    page = (SOURCE.parents[1] / "docs" / "adding-a-format.md").read_text()
    tables = re.findall(r"^\| `([A-Z_]+)` \| `([\w/]+)\.py` \|", page, re.M)
    assert {name for name, _ in tables} == {"FORMATS", "WHOLE_WRITERS", "SESSIONS", "INSPECTORS"}
    for name, module in tables:
        assert hasattr(importlib.import_module("adapterpack." + module.replace("/", ".")), name), (name, module)
    listed = set(re.findall(r"^\| `(\w+)\.py` \|", page, re.M))
    room = {f.stem for f in (SOURCE / "formats" / "aimodel").glob("*.py") if f.stem != "__init__"}
    assert listed == room
