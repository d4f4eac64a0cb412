"""The public Python API (``import adapterpack``): what it exports, and that importing it is light."""

from __future__ import annotations

import inspect
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import adapterpack as ap

REPO = Path(__file__).resolve().parents[1]


def test_every_exported_name_resolves_and_is_documented() -> None:
    assert ap.__version__ == version("adapterpack")
    for name in ap.__all__:
        found = getattr(ap, name)
        if name != "__version__":
            assert inspect.getdoc(found), f"adapterpack.{name} has no docstring"
    assert set(ap.__all__) <= set(dir(ap))
    with pytest.raises(AttributeError):
        ap.no_such_name  # noqa: B018


def test_the_api_takes_the_types_it_exports() -> None:
    for function in (ap.build, ap.release):
        assert "options" in inspect.signature(function).parameters
    assert issubclass(ap.OutputExists, ap.BadInput) and issubclass(ap.BadInput, ap.AdapterpackError)
    assert ap.BuildOptions(force=True).force


def test_importing_adapterpack_loads_no_heavy_library() -> None:
    """Every submodule import runs the package's ``__init__`` first: it must not pull torch,
    coremltools or transformers in (a command's start-up, an app's import)."""
    script = (
        "import sys, adapterpack; "
        "print(sorted(m for m in ('torch', 'coremltools', 'transformers', 'peft', 'numpy') if m in sys.modules))"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]", ran.stdout


def test_load_manifest_reads_the_demo() -> None:
    manifest = ap.load_manifest(REPO / "manifests" / "demo.yaml")
    assert isinstance(manifest, ap.Manifest)
    assert manifest.function_names == ["code", "docs", "zen", "base"]
    with pytest.raises(ap.BadInput, match="manifest not found"):
        ap.load_manifest(REPO / "manifests" / "missing.yaml")


def test_build_options_refuse_what_no_flag_accepts() -> None:
    for given, flag in ((dict(package_format="onnx"), "--format 'onnx'"), (dict(contract="coreml"), "--contract 'coreml'"), (dict(backend="gpu"), "--backend 'gpu'")):
        with pytest.raises(ap.BadInput, match=flag):
            ap.BuildOptions(**given)
    assert ap.BuildOptions(package_format="aimodel", contract="apple").package_format == "aimodel"


def test_the_commands_flags_are_the_options_fields() -> None:
    """Each BuildOptions field is one flag, with the field's help and default, in every command
    that takes it: build all of them, release all but --no-verify, merge three."""
    import dataclasses

    import typer

    from adapterpack.cli.app import app

    commands = typer.main.get_command(app).commands
    fields = {f.name: f for f in dataclasses.fields(ap.BuildOptions)}
    taken = {"build": set(fields), "release": set(fields) - {"verify"}, "merge": {"force", "backend", "strict"}}
    for command, names in taken.items():
        options = {opt: param for param in commands[command].params for opt in param.opts}
        for name, field in fields.items():
            flag = field.metadata["flag"]
            assert (flag in options) == (name in names), (command, flag)
            if name in names:
                assert options[flag].help == field.metadata["help"]
                assert options[flag].default == (False if field.metadata["negates"] else field.default), (command, flag)
    from adapterpack.cli.flags import options_flags

    seen = []

    def probe(*, options: ap.BuildOptions, quiet: bool = False) -> None:
        seen.append(options)

    # --no-verify given, --no-cache not: the negated flags set their fields to False
    options_flags("verify", "use_cache", "force")(probe)(verify=True, use_cache=False, force=True, quiet=False)
    assert seen == [ap.BuildOptions(verify=False, use_cache=True, force=True)]
