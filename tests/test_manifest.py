"""The manifest schema: defaults, cross-references, and one-line errors with file and line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from adapterpack.config.manifest import load_manifest, manifest_json_schema
from adapterpack.errors import BadInput


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    for name in ("base", "a1", "a2"):
        (tmp_path / name).mkdir()
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "m.yaml"
    path.write_text(textwrap.dedent(text).lstrip())
    return path


GOOD = """
name: demo
base:
  path: base
adapters:
  - name: chat
    path: a1
  - name: code
    path: a2
    scale: 0.5
    compression: {nbits: 6}
include_base: plain
default_function: code
export:
  max_context: 256
compression:
  method: palettize
"""


def test_valid_manifest_resolves_defaults(folder):
    manifest = load_manifest(write(folder, GOOD))
    assert manifest.function_names == ["chat", "code", "plain"]
    assert manifest.default == "code"
    assert manifest.compression.nbits == 4 and manifest.compression.group_size == 16
    assert manifest.compression_for("code").nbits == 6
    assert manifest.compression_for("code").granularity == "per_grouped_channel"
    # no calibration text: one palette per output channel at 4 bits (Compression.data_free)
    assert manifest.compression_for("plain") == manifest.compression.model_copy(update={"group_size": 1})
    assert manifest.compression_for("code").group_size == 16
    assert manifest.adapter_path(manifest.adapters[0]) == (folder / "a1").resolve()
    assert manifest.output_path() == (folder / "build" / "demo.mlpackage").resolve()
    assert manifest.output_path("x.mlpackage").name == "x.mlpackage"


def test_unset_group_size_is_one_channel_at_low_bits_without_calibration_text(folder):
    text = GOOD.replace("compression: {nbits: 6}", "compression: {nbits: 6, layers: {o_proj: {nbits: 2}, q_proj: {nbits: 8}}}")
    data_free = load_manifest(write(folder, text))
    (folder / "base.txt").write_text("what the base is used for\n")
    with_text = load_manifest(write(folder, text.replace("  path: base\n", "  path: base\n  calibration: base.txt\n", 1)))
    assert [data_free.compression_for(name).group_size for name in ("chat", "code", "plain")] == [1, 16, 1]
    assert {p: e.group_size for p, e in data_free.compression_for("code").layers} == {"o_proj": 1, "q_proj": 16}
    # with calibration text the palettes are weighted by activations: groups of 16 keep the checkpoint
    assert [with_text.compression_for(name).group_size for name in ("chat", "code", "plain")] == [16, 16, 16]
    assert {p: e.group_size for p, e in with_text.compression_for("code").layers} == {"o_proj": 16, "q_proj": 16}
    # a group size the manifest names is kept
    named = load_manifest(write(folder, GOOD.replace("  method: palettize\n", "  method: palettize\n  group_size: 8\n")))
    assert named.compression_for("chat").group_size == 8
    assert named.compression_for("chat").describe() == "palettize 4-bit per_grouped_channel/8"


def test_default_function_defaults_to_first(folder):
    manifest = load_manifest(write(folder, "name: d\nbase: {path: base}\nadapters: [{name: a, path: a1}]\n"))
    assert manifest.default == "a"
    assert manifest.lora == "fuse"


def test_linear_defaults(folder):
    text = "name: d\nbase: {path: base}\nadapters: [{name: a, path: a1}]\ncompression: {method: linear}\n"
    compression = load_manifest(write(folder, text)).compression
    assert (compression.nbits, compression.granularity, compression.block_size) == (8, "per_block", 32)


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        (GOOD.replace("  max_context: 256", "  max_context: 256\n  colour: red"), 15, "unknown key 'colour'"),
        # a quoted key holding a line break still gives one line (found by the mutated manifests)
        (GOOD.replace("  max_context: 256", '  max_context: 256\n  "col\\nour": red'), 15, "unknown key 'col\\nour'"),
        (GOOD.replace("name: demo", "name: demo\nname: again"), 2, "duplicate key 'name'"),
        (GOOD.replace("  - name: code", "  - name: Chat"), None, "clash"),
        (GOOD.replace("  - name: code", "  - name: 2code"), 7, "not usable from Swift"),
        (GOOD.replace("default_function: code", "default_function: nope"), None, "default_function 'nope'"),
        (GOOD.replace("path: a2", "path: missing"), 8, "does not exist"),
        (GOOD.replace("method: palettize", "method: zip"), 16, "'palettize', 'linear', 'prune' or 'none'"),
        (GOOD.replace("{nbits: 6}", "{nbits: 5}"), None, "nbits 5 is not valid for palettize"),
        (GOOD.replace("name: demo", "name: no"), 1, "quote"),
        (GOOD.replace("  max_context: 256", "  max_context: many"), 14, "integer"),
        (GOOD.replace("  max_context: 256", "  max_context: 256\n  deployment_target: iOS17"), 15, "iOS18"),
        (GOOD.replace("base:\n  path: base", "base:\n  path: ./nothing/here"), 3, "does not exist"),
        ("name: [unclosed\n", None, "YAML syntax error"),
        ("- just\n- a list\n", 1, "must be a YAML mapping"),
        ("name: d\nbase: {path: base}\n", None, "no functions"),
        (GOOD.replace("method: palettize", "method: prune\n  nbits: 4"), None, "'nbits' does not apply"),
        (GOOD.replace("    path: a1\n", "    path: a1\n    calibration: nowhere.txt\n"), 7, "calibration: "),
        (GOOD.replace("method: palettize", "method: palettize\n  auto: {}"), None, "compression auto measures 'chat' on its own text"),
        (GOOD.replace("method: palettize", "method: linear\n  auto: {}"), None, "auto chooses palettization bits"),
        (GOOD.replace("method: palettize", "method: palettize\n  layers: {mlp: {method: linear}}"), None, "an exception is palettize or none"),
        (GOOD.replace("method: palettize", "method: palettize\n  layers: {mlp: 8}"), None, "needs settings as a mapping"),
        (GOOD.replace("method: palettize", "method: palettize\n  auto: {min_retention: 2}"), 17, "less than or equal to 1"),
        # a NUL byte in a path: pathlib would raise a bare ValueError (found by the hostile cases)
        (GOOD.replace("base:\n  path: base", 'base:\n  path: "ba\\0se"'), 3, "NUL byte"),
        (GOOD.replace("path: a2", 'path: "a\\02"'), 8, "NUL byte"),
        (GOOD + 'output: "out\\0.mlpackage"\n', None, "output: a path cannot hold a NUL byte"),
    ],
)
def test_bad_manifests_name_file_and_line(folder, text, line, fragment):
    path = write(folder, text)
    with pytest.raises(BadInput) as raised:
        load_manifest(path)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert fragment in message
    if line is not None:
        assert message.startswith(f"{path}:{line}:"), message


def test_calibration_auto_and_layer_exceptions(folder):
    (folder / "base.txt").write_text("base text")
    (folder / "chat.txt").write_text("chat text")
    text = (
        "name: d\nbase: {path: base, calibration: base.txt}\ninclude_base: plain\n"
        "adapters:\n  - {name: chat, path: a1, calibration: chat.txt}\n  - {name: code, path: a2, compression: {auto: null, nbits: 6}}\n"
        "compression: auto\n"
    )
    manifest = load_manifest(write(folder, text))
    assert manifest.compression.auto is not None and manifest.compression.nbits == 4
    assert manifest.compression_for("code").auto is None and manifest.compression_for("code").nbits == 6
    assert manifest.calibration_paths() == {"plain": (folder / "base.txt").resolve(), "chat": (folder / "chat.txt").resolve()}
    exceptions = load_manifest(
        write(folder, "name: d\nbase: {path: base}\nadapters: [{name: a, path: a1}]\n"
              "compression: {group_size: 8, layers: {layers.0.mlp: {nbits: 8}, o_proj: {method: none}}}\n")
    ).compression
    (pattern, eight), (_, kept) = exceptions.layers
    assert (pattern, eight.nbits, eight.group_size, kept.method) == ("layers.0.mlp", 8, 8, "none")
    assert exceptions.describe() == "palettize 4-bit per_grouped_channel/8 + 1 layer at 8-bit + 1 layer at float16"


def test_missing_manifest(tmp_path):
    with pytest.raises(BadInput, match="manifest not found"):
        load_manifest(tmp_path / "nope.yaml")


def test_schema_is_json_and_strict():
    schema = manifest_json_schema()
    json.dumps(schema)
    assert schema["additionalProperties"] is False
    assert "source" not in schema["properties"]
    assert {"name", "base"} <= set(schema["required"])
