"""verify: passes a good package, fails an altered one with exit 3, and detects washed-out adapters."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.config.manifest import load_manifest
from adapterpack.verification.metrics import compare_logits, retention
from adapterpack.verification.package import verify_package
from factories import make_adapter, make_base, make_project, run_cli


@pytest.fixture(scope="module")
def float16_package(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    make_base(root / "base", "qwen2")
    make_adapter(root / "chat", root / "base", std=0.1, targets=("q_proj", "v_proj", "down_proj"))
    (root / "m.yaml").write_text(
        textwrap.dedent(
            """\
            name: v
            base: {path: base}
            adapters: [{name: chat, path: chat}]
            include_base: base
            export: {max_context: 32}
            compression: {method: none}
            """
        )
    )
    result = build(root / "m.yaml", output=root / "v.mlpackage", options=BuildOptions(verify=False))
    return root, result.output


def test_verify_cli_passes_good_package(float16_package):
    root, package = float16_package
    result = run_cli("verify", package, "--manifest", root / "m.yaml", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and [f["name"] for f in report["functions"]] == ["chat", "base"]
    chat = report["functions"][0]
    assert chat["top1"] >= 0.99 and chat["cosine"] >= 0.999 and chat["retention"] > 0.99


def _weight_regions(blob: bytes) -> list[tuple[int, int]]:
    """(offset, size) of each tensor's data in a Core ML weight.bin (64-byte aligned records:
    sentinel 0xDEADBEEF, dtype, size, offset), so tests change values and keep the file valid."""
    regions, position = [], 64
    while position + 24 <= len(blob):
        sentinel, _dtype, size, offset = np.frombuffer(blob[position : position + 24], dtype="<u4,<u4,<u8,<u8")[0]
        if sentinel != 0xDEADBEEF:
            break
        regions.append((int(offset), int(size)))
        position = (int(offset) + int(size) + 63) // 64 * 64
    return regions


def _alter_weights(package: Path, destination: Path, how: str) -> Path:
    shutil.copytree(package, destination)
    blob = next(destination.rglob("weight.bin"))
    data = bytearray(blob.read_bytes())
    regions = _weight_regions(bytes(data))
    assert len(regions) > 10
    rng = np.random.default_rng(0)
    for offset, size in regions:
        values = np.frombuffer(bytes(data[offset : offset + size]), dtype=np.float16).copy()
        if how == "scale":  # every weight 1.5x larger
            values = (values.astype(np.float32) * 1.5).astype(np.float16)
        elif how == "noise":  # a few percent of the weights perturbed
            idx = rng.choice(len(values), size=max(1, len(values) // 20), replace=False)
            values[idx] = (values[idx].astype(np.float32) + rng.normal(0, 0.2, len(idx))).astype(np.float16)
        data[offset : offset + size] = values.tobytes()
    blob.write_bytes(bytes(data))
    return destination


@pytest.mark.parametrize("how", ["scale", pytest.param("noise", marks=pytest.mark.slow)])
def test_altered_weight_blob_fails_with_exit_3(float16_package, tmp_path, how):
    root, package = float16_package
    altered = _alter_weights(package, tmp_path / "altered.mlpackage", how)
    result = run_cli("verify", altered, "--manifest", root / "m.yaml")
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0
    assert "FAIL" in result.stderr


def test_altered_weights_fail_numerically_without_the_digest(float16_package, tmp_path):
    """The numeric check alone catches altered values (the digest is a second, independent line)."""
    root, package = float16_package
    altered = _alter_weights(package, tmp_path / "altered.mlpackage", "noise")
    report = verify_package(altered, load_manifest(root / "m.yaml"))
    assert report.integrity, "the recorded digest must notice the change"
    report.integrity.clear()
    assert not report.passed
    assert any(f.failures for f in report.functions)


def _where_mask_bias(self, inputIds, start, end, causal_mask):  # noqa: N803
    """The attention bias as it was once built: ``torch.where`` on 0-d operands, which coremltools
    saves with a rank-0 declared type while it computes a (q, end) matrix."""
    import torch

    self.writtenSlots[:, :, :, start:end] = torch.ones_like(inputIds, dtype=torch.float16).view(1, 1, 1, -1)
    q_pos = torch.arange(inputIds.shape[-1], dtype=torch.int32) + start
    k_pos = torch.arange(end, dtype=torch.int32)
    allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)) & (self.writtenSlots[0, 0, :, :end] > 0)
    causal = torch.where(allowed, torch.zeros(()), torch.full((), -1.0e4))
    return causal.unsqueeze(0).unsqueeze(0) + causal_mask.to(torch.float32)


def test_mistyped_program_fails_verify_naming_function_op_and_types(tmp_path, monkeypatch):
    """A program whose declared types are not what its ops compute fails verify (exit 3), naming
    the function, the op and both types, although its numbers are right."""
    from adapterpack.convert.export_decoder import ExportDecoder

    make_base(tmp_path / "base", "llama")
    make_adapter(tmp_path / "chat", tmp_path / "base", std=0.1)
    (tmp_path / "m.yaml").write_text(
        "name: w\nbase: {path: base}\nadapters: [{name: chat, path: chat}]\n"
        "export: {max_context: 32}\ncompression: {method: none}\n"
    )
    with monkeypatch.context() as patch:
        patch.setattr(ExportDecoder, "_attention_bias", _where_mask_bias)
        package = build(tmp_path / "m.yaml", output=tmp_path / "w.mlpackage", options=BuildOptions(verify=False)).output
    report = verify_package(package, load_manifest(tmp_path / "m.yaml"))
    assert not report.passed
    assert [
        p for p in report.integrity
        if "function 'chat'" in p and "op 'select'" in p and "declares float16 rank 0 ()" in p and "rank 2" in p
    ], report.integrity
    result = run_cli("verify", package, "--manifest", tmp_path / "m.yaml")
    assert result.returncode == 3 and "declared types" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_saved_type_that_coremltools_disagrees_with_fails_verify(float16_package, tmp_path):
    """A saved declaration that differs from coremltools' own type inference (an attention output
    declared rank 2) is reported as such, exit 3, not as a crash."""
    import coremltools as ct

    root, package = float16_package
    mistyped = tmp_path / "mistyped.mlpackage"
    shutil.copytree(package, mistyped)
    spec_file = next(mistyped.rglob("model.mlmodel"))
    spec = ct.proto.Model_pb2.Model.FromString(spec_file.read_bytes())
    function = spec.mlProgram.functions["chat"]
    operation = next(
        op for op in function.block_specializations[function.opset].operations
        if op.type == "scaled_dot_product_attention"
    )
    tensor = operation.outputs[0].type.tensorType
    tensor.rank = 2
    del tensor.dimensions[2:]
    spec_file.write_bytes(spec.SerializeToString())

    report = verify_package(mistyped, load_manifest(root / "m.yaml"))
    assert [p for p in report.integrity if "function chat" in p and "declares types" in p], report.integrity
    assert not [p for p in report.integrity if "function base" in p], report.integrity  # base is intact
    result = run_cli("verify", mistyped, "--manifest", root / "m.yaml")
    assert result.returncode == 3 and "declared types" in result.stderr, result.stderr


def test_coreml_backend_refused_off_macos(float16_package):
    if sys.platform == "darwin":
        pytest.skip("Core ML is available here")
    root, package = float16_package
    result = run_cli("verify", package, "--manifest", root / "m.yaml", "--backend", "coreml")
    assert result.returncode == 2
    assert "needs macOS" in result.stderr


@pytest.mark.slow
def test_washed_out_adapter_is_reported(tmp_path):
    """A fused adapter whose delta is far below the 4-bit palette step does not survive; a strong one does."""
    make_base(tmp_path / "base", "llama", hidden_size=128, intermediate_size=256)
    make_adapter(tmp_path / "faint", tmp_path / "base", std=0.004, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    make_adapter(tmp_path / "strong", tmp_path / "base", std=0.15, seed=3, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    (tmp_path / "m.yaml").write_text(
        textwrap.dedent(
            """\
            name: w
            base: {path: base}
            adapters: [{name: faint, path: faint}, {name: strong, path: strong}]
            export: {max_context: 32}
            compression: {method: palettize, nbits: 4, keep_float16: []}
            """
        )
    )
    result = build(tmp_path / "m.yaml", output=tmp_path / "w.mlpackage", options=BuildOptions(verify=False))
    report = verify_package(result.output, load_manifest(tmp_path / "m.yaml"))
    by_name = {f.name: f for f in report.functions}
    faint, strong = by_name["faint"], by_name["strong"]
    assert faint.retention < 0.5, faint
    assert any("not retained" in failure and "lora: keep" in failure for failure in faint.failures)
    assert strong.retention > 0.5, strong
    assert not any("not retained" in failure for failure in strong.failures)


def test_metrics_against_known_values():
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(5, 20))
    same = compare_logits(reference, reference)
    assert same["cosine"] == pytest.approx(1.0) and same["top1"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-12)
    flipped = compare_logits(-reference, reference)
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["top1"] == 0.0 and flipped["kl"] > 1
    base = rng.normal(size=(5, 20))
    adapter = base + rng.normal(size=(5, 20))
    assert retention(adapter, adapter, base)[0] == pytest.approx(1.0)
    assert retention(base, adapter, base)[0] == 0.0
    assert abs(retention(base + rng.normal(size=(5, 20)), adapter, base)[0]) < 0.5


@pytest.mark.parametrize("widened", ["whole", "in parts"])
def test_reference_computed_layer_by_layer_equals_the_float32_model(family_build, tmp_path, widened, monkeypatch):
    """The reference holds the base at its stored precision and widens one module's weights at a
    time (or, for a large vocabulary's, a part at a time: here every linear layer and embedding,
    7 output rows at a time); its logits must be the float32 model's (peft, unmerged), base and
    adapters alike."""
    import torch

    from adapterpack.verification import reference

    if widened == "in parts":
        monkeypatch.setattr(reference, "WIDEN_WHOLE_BYTES", 0)
        monkeypatch.setattr(reference, "WIDE_ROWS_BYTES", 7 * 4 * 64)  # 7 rows of the families' hidden width
        parts = []
        original = reference._widened_in_parts
        monkeypatch.setattr(reference, "_widened_in_parts", lambda module: parts.append(module) or original(module))

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification.reference import random_references, stored_dtype

    family, root, _ = family_build
    # the family's base, stored in float16 as published models are
    load_base(root / "base").half().save_pretrained(tmp_path / "base16", safe_serialization=True)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (root / "base" / extra).exists():
            shutil.copy(root / "base" / extra, tmp_path / "base16" / extra)
    manifest = (root / "m.yaml").read_text().replace("base: {path: base}", f"base: {{path: {tmp_path / 'base16'}}}")
    manifest = "\n".join(
        line.replace("path: ", f"path: {root}/") if line.strip().startswith("path:") else line for line in manifest.splitlines()
    )
    (tmp_path / "m.yaml").write_text(manifest)
    checked = check_inputs(tmp_path / "m.yaml")
    assert stored_dtype(checked.base) == "float16"  # so the layered path is the one under test
    names = checked.manifest.function_names
    tokens, base_logits, adapter_logits = random_references(checked, names)
    full = load_base(checked.base.folder)  # float32 throughout
    ids = torch.from_numpy(tokens[None, :])
    # in parts, the float32 kernel blocks each product its own way: last-bit differences
    atol = 2e-6 if widened == "whole" else 1e-5
    with torch.no_grad():
        np.testing.assert_allclose(base_logits, full(ids).logits[0].numpy(), rtol=0, atol=atol)
        for name, logits in adapter_logits.items():
            adapter = checked.manifest.adapter(name)
            with applied_adapter(full, checked.adapters[name].folder, mode="unmerged", scale=float(adapter.scale)) as model:
                expected = model(ids).logits[0].numpy()
            np.testing.assert_allclose(logits, expected, rtol=0, atol=atol, err_msg=name)
            if name != "zero":  # FAMILY_ADAPTERS' identity adapter
                assert np.abs(logits - base_logits).max() > 1e-3, f"{name}: the adapter moved nothing"
    for parameter in full.parameters():
        assert parameter.dtype == torch.float32
    if widened == "in parts":
        assert any(isinstance(m, torch.nn.Embedding) for m in parts) and any(isinstance(m, torch.nn.Linear) for m in parts)
        assert all("forward" not in vars(m) for m in parts)  # each module's own forward again


SIDE_BY_SIDE_MANIFEST = """name: rows
base: {path: base}
include_base: base
export: {max_context: 24}
compression: {method: none}
adapters:
  - {name: attn, path: attn}
  - {name: mlp, path: mlp, scale: 0.5}
  - {name: wide, path: wide}
  - {name: dora, path: dora}
  - {name: saved, path: saved}
"""
SIDE_BY_SIDE_ADAPTERS = {
    "attn": dict(std=0.1),
    "mlp": dict(std=0.1, seed=3, targets=("gate_proj", "up_proj", "down_proj"), r=8, alpha=32),
    "wide": dict(std=0.1, seed=5, targets=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"), r=2, use_rslora=True),
    "dora": dict(std=0.1, seed=7, use_dora=True),
    "saved": dict(std=0.1, seed=9, modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("rows_per_pass", [16, 2])
def test_references_side_by_side_equal_each_adapter_alone(tmp_path_factory, monkeypatch, rows_per_pass):
    """The base and the adapters peft can mix run in one batch, a row each, so the base's weights
    are read once per pass, not once per function; each row must be that adapter's logits alone
    (peft, unmerged, float32), the manifest's scale included, and DoRA and modules_to_save
    adapters, which peft does not mix, still run (alone)."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification import reference

    root = make_project(tmp_path_factory.mktemp("rows"), SIDE_BY_SIDE_MANIFEST, SIDE_BY_SIDE_ADAPTERS)
    checked = check_inputs(root / "m.yaml")
    monkeypatch.setattr(reference, "ROWS_PER_PASS", rows_per_pass)
    passes = []
    embedding = torch.nn.Embedding.forward
    monkeypatch.setattr(torch.nn.Embedding, "forward", lambda self, ids: passes.append(ids.shape[0]) or embedding(self, ids))
    tokens, base_logits, adapter_logits = reference.random_references(checked, checked.manifest.function_names)
    # one pass for the base and the three mixable adapters (or one per adapter, beside the base
    # row, at two rows a pass), then DoRA and modules_to_save alone
    assert passes == ([4, 1, 1] if rows_per_pass == 16 else [2, 2, 2, 1, 1])
    assert sorted(adapter_logits) == ["attn", "dora", "mlp", "saved", "wide"]
    monkeypatch.setattr(torch.nn.Embedding, "forward", embedding)
    ids = torch.from_numpy(tokens[None, :])
    full = load_base(checked.base.folder)
    with torch.no_grad():
        np.testing.assert_allclose(base_logits, full(ids).logits[0].numpy(), rtol=0, atol=2e-6)
        for name, logits in adapter_logits.items():
            adapter = checked.manifest.adapter(name)
            with applied_adapter(full, checked.adapters[name].folder, mode="unmerged", scale=float(adapter.scale)) as model:
                expected = model(ids).logits[0].numpy()
            np.testing.assert_allclose(logits, expected, rtol=0, atol=2e-6, err_msg=name)
            assert np.abs(logits - base_logits).max() > 1e-3, f"{name}: the adapter moved nothing"
    # the base is left as it was: its own weights and modules, no adapter bookkeeping
    from peft.tuners.lora import LoraLayer

    from adapterpack.convert.lora import applied_side_by_side

    before = {name: value.clone() for name, value in full.state_dict().items()}
    group = {name: (checked.adapters[name].folder, 1.0) for name in ("attn", "wide")}
    with applied_side_by_side(full, group) as (model, named):
        assert sorted(named) == ["attn", "wide"] and any(isinstance(m, LoraLayer) for m in model.modules())
    assert not any(isinstance(m, LoraLayer) for m in full.modules())
    assert not any(name in vars(full) for name in ("peft_config", "_hf_peft_config_loaded"))
    after = full.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(after[name], value) for name, value in before.items())


def test_a_palettized_weight_s_indices_are_gone_once_folded(demo):
    """A one-function executor folds each palettized weight into its dense values and lets the
    indices and palette go (at 3B the indices alone are 3 GB); nothing of coremltools' loaded
    program may still hold them."""
    import gc
    import weakref

    from adapterpack.formats.mlpackage.executor import ProgramExecutor

    executor = ProgramExecutor.load(demo.output, functions=["code"])
    indices = [
        weakref.ref(op.outputs[0].val)
        for op in executor._program.functions["code"].operations
        if op.op_type == "const" and isinstance(op.outputs[0].val, np.ndarray) and op.outputs[0].val.dtype == np.uint8
    ]
    assert len(indices) > 10, "the demo package's code function has no palettized weights"
    executor.make_state("code")  # compiles: folds every constexpr
    gc.collect()
    assert [ref() is None for ref in indices] == [True] * len(indices)


def test_a_function_s_executor_is_gone_before_the_next_one_loads(demo, monkeypatch):
    """Verify holds one function's weights at a time: when the next function's program loads,
    nothing refers to the previous function's executor any more (at 3B each holds 6 GB)."""
    import gc
    import weakref

    from adapterpack.formats.mlpackage.executor import ProgramExecutor
    from adapterpack.verification import runners

    made: list[weakref.ref] = []
    alive_at_load: list[int] = []
    original = ProgramExecutor.load.__func__

    def load(cls, *args, **kwargs):
        gc.collect()
        alive_at_load.append(sum(ref() is not None for ref in made))
        executor = original(cls, *args, **kwargs)
        made.append(weakref.ref(executor))
        return executor

    monkeypatch.setattr(ProgramExecutor, "load", classmethod(load))
    sessions = runners.function_sessions(demo.output)
    for function in ("code", "docs", "zen"):
        sessions(function)()(np.array([[256, 100]], np.int32), np.zeros((1, 1, 1, 3), np.float16))
    assert alive_at_load == [0, 0, 0]
