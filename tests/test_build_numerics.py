"""Built packages match the unmerged peft model, for every family and many LoRA settings.

Each package (the session's ``family_build``, see conftest.py) is executed (prefill + decode
through the states) on the numpy ML Program executor and compared with PyTorch; uncompressed
functions must reach cosine >= 0.9999 under both drives. Each base carries a planted massive
activation (about 20,000 in one residual channel, as pretrained checkpoints do), which overflows
float16 unless every norm is exported in a float16-safe form.
"""

from __future__ import annotations

import numpy as np
import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.formats.mlpackage.executor import ProgramExecutor
from factories import FAMILY_ADAPTERS, make_adapter, make_base


def test_every_function_matches_unmerged_peft(family_build):
    family, _, result = family_build
    report = result.verify_report
    assert report is not None and report.passed, report.verdict()
    assert {f.name for f in report.functions} == set(FAMILY_ADAPTERS) | {"base"}
    for function in report.functions:
        assert function.top1 >= 0.9, (family, function)  # near-ties of random logits, see make_family_project
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999, (family, function.name, drive, figures)
        if function.name not in ("base", "zero"):
            # the adapters are non-identity, so the comparison is meaningful
            assert function.adapter_effect > 0.01, (family, function)
            assert function.retention > 0.95, (family, function)


def test_zero_adapter_follows_base_and_random_adapter_does_not(family_build):
    _, _, result = family_build
    executor = ProgramExecutor.load(result.output)
    ids = np.array([[5, 17, 3, 44, 8, 2]], dtype=np.int32)
    mask = np.zeros((1, 1, 1, ids.shape[1]), dtype=np.float16)

    def logits(function: str) -> np.ndarray:
        state = executor.make_state(function)
        return executor.predict({"inputIds": ids, "causalMask": mask}, state=state, function=function)["logits"]

    base = logits("base").astype(np.float32)
    np.testing.assert_allclose(logits("zero").astype(np.float32), base, atol=2e-3)
    assert np.abs(logits("rs").astype(np.float32) - base).max() > 0.05


def test_family_op_types_all_have_executor_tests(family_build):
    from test_executor import TESTED_OPS

    _, _, result = family_build
    executor = ProgramExecutor.load(result.output)
    for function in executor.function_names:
        assert not executor.op_types(function) - TESTED_OPS, (function, executor.op_types(function) - TESTED_OPS)


@pytest.mark.parametrize(
    "compression, lora",
    [
        ("{method: linear, nbits: 4}", "fuse"),
        pytest.param("{method: linear, nbits: 8, granularity: per_channel}", "keep", marks=pytest.mark.slow),
        pytest.param("{method: prune, sparsity: 0.4}", "fuse", marks=pytest.mark.slow),
        pytest.param("{method: palettize, nbits: 4}", "keep", marks=pytest.mark.slow),
    ],
)
def test_compressed_packages_run_and_their_ops_are_tested(tmp_path, compression, lora):
    """Every compression (and keep mode's LoRA branch) emits only ops the executor has tests for."""
    from test_executor import TESTED_OPS

    make_base(tmp_path / "base", "qwen2", hidden_size=128, intermediate_size=256)
    make_adapter(tmp_path / "a", tmp_path / "base", std=0.1, r=16, targets=("q_proj", "v_proj", "down_proj"))
    (tmp_path / "m.yaml").write_text(
        f"name: c\nbase: {{path: base}}\nadapters: [{{name: a, path: a}}]\ninclude_base: b\nlora: {lora}\n"
        f"export: {{max_context: 16}}\ncompression: {compression}\n"
        "lora_compression: {method: linear, nbits: 8, granularity: per_channel}\n"
    )
    result = build(tmp_path / "m.yaml", output=tmp_path / "c.mlpackage", options=BuildOptions(verify=False))
    executor = ProgramExecutor.load(result.output)
    constexprs = set()
    for function in executor.function_names:
        ops = executor.op_types(function)
        assert not ops - TESTED_OPS, (function, ops - TESTED_OPS)
        constexprs |= {op for op in ops if op.startswith("constexpr_")}
        state = executor.make_state(function)
        logits = executor.predict(
            {"inputIds": np.array([[1, 2, 3]], np.int32), "causalMask": np.zeros((1, 1, 1, 3), np.float16)},
            state=state, function=function,
        )["logits"]
        assert np.all(np.isfinite(logits))
    assert constexprs, "the package must contain compressed weights"
