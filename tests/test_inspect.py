"""inspect: every byte of a package accounted for, per function and per tensor, and the memory budget.

Three small packages of one tiny Llama (fused float16 with the plain base, kept LoRA, palettized)
are checked against what is on disk and against what the adapters and the base say the numbers
must be, computed independently from their safetensors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.cli.app import app
from adapterpack.config.devices import (
    CONTEXT_STEP,
    DEVICES,
    Device,
    find_device,
    kv_cache_bytes,
    largest_context_that_fits,
    memory_budget,
    memory_need,
)
from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.inspection import inspect_package
from adapterpack.report.memory import human_size, memory_estimate
from factories import make_adapter, make_base

GIB = 1 << 30
WEIGHTS = Path("Data/com.apple.CoreML/weights/weight.bin")
SPEC = Path("Data/com.apple.CoreML/model.mlmodel")
CHAT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
CODE_TARGETS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inspect")
    make_base(root / "base", "llama")
    make_adapter(root / "chat", root / "base", targets=CHAT_TARGETS)
    make_adapter(root / "code", root / "base", seed=5, r=8, alpha=16, targets=CODE_TARGETS)
    return root


def _build(project: Path, name: str, *, lora: str, compression: str, adapters=("chat", "code"), base=None) -> Path:
    entries = "".join(f"  - {{name: {a}, path: {a}}}\n" for a in adapters)
    include = f"include_base: {base}\n" if base else ""
    manifest = project / f"{name}.yaml"
    manifest.write_text(
        f"name: {name}\nbase: {{path: base}}\nadapters:\n{entries}{include}lora: {lora}\n"
        f"export: {{max_context: 64}}\ncompression: {compression}\n"
    )
    return build(manifest, output=project / f"{name}.mlpackage", options=BuildOptions(verify=False)).output


@pytest.fixture(scope="module")
def fused(project) -> Path:
    return _build(project, "fused", lora="fuse", compression="{method: none}", base="plain")


@pytest.fixture(scope="module")
def kept(project) -> Path:
    return _build(project, "kept", lora="keep", compression="{method: none}")


@pytest.fixture(scope="module")
def palettized(project) -> Path:
    return _build(project, "palettized", lora="fuse", compression="{method: palettize, nbits: 4, group_size: 16}", adapters=("chat",), base="plain")


def _disk_bytes(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(here, name)) for here, _, names in os.walk(folder) for name in names)


def _float16_bytes(tensors: dict, keep) -> int:
    return sum(2 * value.size for key, value in tensors.items() if keep(key))


@pytest.mark.parametrize("which", ["fused", pytest.param("kept", marks=pytest.mark.slow), "palettized"])
def test_numbers_add_up_to_the_bytes_on_disk(which, request):
    package = request.getfixturevalue(which)
    report = inspect_package(package)

    assert report.total_bytes == _disk_bytes(package)
    blob = os.path.getsize(package / WEIGHTS)
    assert report.weight_files == [WEIGHTS.as_posix()]
    assert report.weight_bytes == blob
    assert report.weight_data_bytes + report.overhead_bytes == blob
    with open(package / WEIGHTS, "rb") as handle:
        (count,) = struct.unpack("<I", handle.read(4))
    assert report.records == count
    assert report.other_bytes == os.path.getsize(package / SPEC) + os.path.getsize(package / "Manifest.json")

    # Every record's data counted exactly once: unique per function + shared once + unreferenced.
    unique = sum(f.unique_bytes for f in report.functions)
    assert unique + report.shared_bytes + report.unreferenced_bytes == report.weight_data_bytes
    assert report.unreferenced_bytes == 0
    assert sum(t.bytes for t in report.tensors) == report.weight_data_bytes
    assert sum(report.bytes_by_kind.values()) == report.weight_data_bytes
    for f in report.functions:
        assert f.referenced_bytes == f.unique_bytes + f.shared_bytes
        assert sum(f.bytes_by_kind.values()) == f.referenced_bytes
        assert f.alone_bytes == f.referenced_bytes + f.overhead_bytes + f.spec_bytes + report.common_bytes
        assert f.spec_bytes > 0
    assert sum(f.spec_bytes for f in report.functions) + report.common_bytes == report.other_bytes
    assert report.common_bytes >= os.path.getsize(package / "Manifest.json")
    assert report.dedup_ratio == pytest.approx(report.sum_alone_bytes / report.total_bytes)
    assert report.dedup_ratio > 1.0  # every package here has two or more functions sharing weights


def test_record_sizes_match_the_tensor_shapes(fused):
    """Uncompressed: each stored tensor is exactly its element count in float16."""
    report = inspect_package(fused)
    assert report.bytes_by_kind == {"float16": report.weight_data_bytes}
    for tensor in report.tensors:
        assert tensor.kind == "float16" and tensor.storage == ["val: float16"]
        assert tensor.bytes == 2 * math.prod(tensor.shape), tensor


def test_shared_bytes_are_counted_once(fused):
    report = inspect_package(fused)
    names = [f.name for f in report.functions]
    assert names == ["chat", "code", "plain"]
    shared_tensors = [t for t in report.tensors if len(t.functions) > 1]
    assert report.shared_bytes == sum(t.bytes for t in shared_tensors) > 0
    # Per function, shared bytes are counted in each function that reads them, but once in the package.
    assert sum(f.referenced_bytes for f in report.functions) > report.weight_data_bytes
    assert report.weight_data_bytes == sum(f.unique_bytes for f in report.functions) + report.shared_bytes
    # chat changes attention, code the MLP: everything of plain is shared with one of them.
    plain = report.function("plain")
    assert plain.unique_bytes == 0 and plain.shared_bytes == plain.referenced_bytes > 0
    embedding = next(t for t in report.tensors if "embed_tokens" in t.names[0])
    assert embedding.functions == ["chat", "code", "plain"]
    attention = [t for t in report.tensors if "q_proj" in t.names[0]]
    assert sorted(tuple(t.functions) for t in attention) == [("chat",), ("chat",), ("code", "plain"), ("code", "plain")]


def test_fuse_mode_unique_bytes_are_the_targeted_weights(fused, project):
    report = inspect_package(fused)
    base = load_file(project / "base" / "model.safetensors")
    for name in ("chat", "code"):
        targets = json.loads((project / name / "adapter_config.json").read_text())["target_modules"]
        expected = _float16_bytes(base, lambda key, targets=targets: any(key.endswith(f".{t}.weight") for t in targets))
        assert expected > 0
        assert report.function(name).unique_bytes == pytest.approx(expected, rel=0.03), name


@pytest.mark.slow
def test_keep_mode_shares_the_base_and_adds_only_lora_matrices(kept, fused, project):
    report = inspect_package(kept)
    base = load_file(project / "base" / "model.safetensors")
    base_bytes = _float16_bytes(base, lambda key: key.endswith(".weight") and "norm" not in key)
    for name in ("chat", "code"):
        adapter = load_file(project / name / "adapter_model.safetensors")
        lora = _float16_bytes(adapter, lambda key: "lora_A" in key or "lora_B" in key)
        function = report.function(name)
        assert function.unique_bytes == pytest.approx(lora, rel=0.03), name
        # The base (plus rope tables and zero biases) is shared byte for byte by both functions.
        assert base_bytes <= function.shared_bytes <= 1.05 * base_bytes
        assert function.unique_bytes * 5 < function.shared_bytes  # rank 4-8 on a 64-wide model
    for tensor in report.tensors:
        if any("lora_" in n for n in tensor.names):
            assert len(tensor.functions) == 1, tensor
        if any("base_layer" in n for n in tensor.names):
            assert tensor.functions == ["chat", "code"], tensor
    # Keeping LoRA unfused stores each adapter in a few KB instead of a copy of every targeted weight.
    fused_report = inspect_package(fused)
    assert report.function("code").unique_bytes < fused_report.function("code").unique_bytes / 4


def test_palettized_tensors_are_reported_as_such(palettized):
    report = inspect_package(palettized)
    assert set(report.bytes_by_kind) == {"palettized 4-bit", "float16"}
    palettes = [t for t in report.tensors if t.kind == "palettized 4-bit"]
    assert palettes
    for tensor in palettes:
        assert "indices: uint4" in tensor.storage and "lut: float16" in tensor.storage
        elements = math.prod(tensor.shape)
        # 4 bits per element plus a small float16 palette: well under the float16 size.
        assert elements // 2 < tensor.bytes < elements, tensor
    embedding = next(t for t in report.tensors if "embed_tokens" in t.names[0])
    assert embedding.kind == "float16"  # keep_float16 default
    for function in report.functions:
        assert function.bytes_by_kind["palettized 4-bit"] > 0 and function.bytes_by_kind["float16"] > 0


def test_model_shape_and_kv_cache_from_the_states(fused):
    shape = inspect_package(fused).shape
    # tiny llama: 2 layers, 4 query heads, 2 kv heads, hidden 64 (head_dim 16), vocab 96, MLP 128
    assert (shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.max_context) == (2, 2, 16, 64)
    assert (shape.vocab, shape.hidden, shape.n_heads, shape.intermediate) == (96, 64, 4, 128)
    assert shape.kv_cache_bytes() == 2 * (2 * 1 * 2 * 64 * 16) * 2  # keyCache + valueCache, float16


def test_kv_cache_bytes_counts_kv_heads_not_query_heads():
    # A Llama 3.2 1B-like shape: 16 layers, 32 query heads sharing 8 kv heads (GQA), head_dim 64.
    assert kv_cache_bytes(16, 8, 64, 2048) == 2 * 16 * 8 * 64 * 2048 * 2 == 64 * (1 << 20)
    assert kv_cache_bytes(16, 32, 64, 2048) == 4 * kv_cache_bytes(16, 8, 64, 2048)
    assert kv_cache_bytes(16, 8, 64, 2048, dtype_bytes=4) == 2 * kv_cache_bytes(16, 8, 64, 2048)


def test_memory_budget_reports_fit_and_headroom():
    rows = memory_budget(GIB, GIB // 2, GIB // 2)
    assert [row.device for row in rows] == list(DEVICES)
    for device, limit, fits, headroom in rows:
        assert limit == device.limit_bytes
        assert headroom == limit - 2 * GIB
        assert fits == (headroom >= 0)
    iphone = find_device("iPhone 15")
    [row] = memory_budget(4 * GIB, 0, 0, [iphone])
    assert not row.fits and row.headroom == -GIB
    [raised] = memory_budget(4 * GIB, 0, 0, [iphone], increased_limit=True)
    assert raised.fits and raised.limit == iphone.increased_limit_bytes


def test_largest_context_that_fits_is_monotonic_in_memory():
    dims = dict(n_layers=16, n_kv_heads=8, head_dim=64, vocab=128256, hidden=2048)
    weights = 700 * (1 << 20)
    limits = [GIB // 2, GIB, 3 * GIB // 2, 2 * GIB, 3 * GIB, 4 * GIB, 6 * GIB, 8 * GIB]
    contexts = []
    for limit in limits:
        device = Device("test", "test", 16 * GIB, limit, None, "test", True)
        context = largest_context_that_fits(device, weights, **dims)
        contexts.append(context)
        assert context % CONTEXT_STEP == 0
        if context:  # tight: this context fits, the next step does not
            assert memory_need(context, weights_bytes=weights, **dims) <= limit
            assert memory_need(context + CONTEXT_STEP, weights_bytes=weights, **dims) > limit
    assert contexts[0] == 0  # the weights alone are over half a GiB's worth of limit with any cache
    assert contexts == sorted(contexts) and contexts[-1] > contexts[1] > 0
    by_weights = [largest_context_that_fits("iphone-15-pro", w * GIB // 4, **dims) for w in range(1, 12)]
    assert by_weights == sorted(by_weights, reverse=True) and by_weights[0] > by_weights[-1]


def test_device_table_is_sourced():
    keys = {d.key for d in DEVICES}
    assert {"iphone-15", "iphone-15-pro", "iphone-16", "iphone-16-pro", "ipad-8gb", "mac-16gb"} <= keys
    assert find_device("iphone-15").ram_bytes == 6 * GIB
    assert find_device("iPhone 15 Pro").ram_bytes == 8 * GIB
    for device in DEVICES:
        assert len(device.source) > 40, device.key
        assert 0 < device.limit_bytes < device.ram_bytes
        assert device.increased_limit_bytes is None or device.limit_bytes <= device.increased_limit_bytes <= device.ram_bytes
    with pytest.raises(BadInput, match="iphone-15"):
        find_device("nokia 3310")


def test_memory_estimate_uses_the_heaviest_function(kept):
    report = inspect_package(kept)
    estimate = memory_estimate(report)
    heaviest = max(report.functions, key=lambda f: f.referenced_bytes)
    assert estimate.function == heaviest.name == "code"  # rank 8 on the wide MLP: the larger adapter
    assert estimate.weights_bytes == heaviest.referenced_bytes < report.weight_data_bytes
    # every state: keyCache + valueCache + writtenSlots (one float16 per cache position)
    assert estimate.kv_bytes == report.shape.state_bytes() == report.shape.kv_cache_bytes() + 2 * report.shape.max_context
    assert estimate.activations_known and estimate.activation_bytes > 0


def test_cli_json_parses(fused):
    result = CliRunner().invoke(app, ["inspect", str(fused), "--json", "--top", "3"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["total_bytes"] == _disk_bytes(fused)
    assert [f["name"] for f in document["functions"]] == ["chat", "code", "plain"]
    assert len(document["largest_tensors"]) == 3
    assert document["weight_data_bytes"] + document["overhead_bytes"] == document["weight_bytes"]
    devices = document["memory"]["devices"]
    assert {d["device"] for d in devices} == {d.key for d in DEVICES}
    assert all(d["fits"] and d["source"] for d in devices)  # a tiny model fits everywhere
    # one float16 row of the vocabulary per token a call is given
    assert document["memory"]["logits_bytes_per_token"] == 2 * inspect_package(fused).shape.vocab > 0


def test_cli_table_for_one_device(kept):
    result = CliRunner().invoke(app, ["inspect", str(kept), "--device", "iphone-15", "--top", "2"])
    assert result.exit_code == 0, result.output
    text = result.stdout
    for expected in ("chat", "code", "dedup ratio", "largest tensors (top 2)", "iPhone 15", "pocketpal"):
        assert expected in text, expected
    shape = inspect_package(kept).shape
    per_token = 2 * shape.vocab
    assert f"logits per call: (1, q, {shape.vocab}) float16, {human_size(per_token)} a token: " \
        f"{human_size(per_token * shape.max_context)} for a {shape.max_context}-token prefill" in " ".join(text.split()), text
    assert "iPhone 16" not in text


def test_cli_missing_package_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ADAPTERPACK_DEBUG"}
    result = subprocess.run(
        [sys.executable, "-m", "adapterpack", "inspect", str(tmp_path / "gone.mlpackage")],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "not found" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("damage", ["not a package", "bad spec", "truncated blob", "unknown device"])
def test_cli_unreadable_package_exits_2(damage, kept, tmp_path):
    package = tmp_path / "copy.mlpackage"
    args = []
    if damage == "not a package":
        package.mkdir()
        (package / "readme.txt").write_text("hello")
    else:
        shutil.copytree(kept, package)
    if damage == "bad spec":
        (package / SPEC).write_bytes(b"\xff" * 100)
    elif damage == "truncated blob":
        data = (package / WEIGHTS).read_bytes()
        (package / WEIGHTS).write_bytes(data[: len(data) // 2 + 10])
    elif damage == "unknown device":
        args = ["--device", "nokia-3310"]
    result = CliRunner().invoke(app, ["inspect", str(package), *args])
    assert result.exit_code == 2, (damage, result.output)
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "error:" in result.stderr
