"""The shipped demo: builds from the repository, verifies, deduplicates, and its skills differ."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.formats.mlpackage.executor import ProgramExecutor
from factories import demo_cache

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "manifests" / "demo.yaml"


def test_demo_builds_verifies_and_deduplicates(demo):
    assert [f.name for f in demo.functions] == ["code", "docs", "zen", "base"]
    assert demo.default_function == "code"
    assert demo.verify_report is not None and demo.verify_report.passed, demo.verify_report.verdict()
    # every skill keeps 0.9 of its change on verify's seeded token ids too (auto measures there)
    for function in demo.verify_report.functions:
        assert function.retention is None or function.retention >= 0.9, function
    alone = sum(demo.part_sizes.values())
    assert demo.package_size < alone, (demo.package_size, alone)


def greedy(executor: ProgramExecutor, function: str, prompt: str, steps: int = 24) -> str:
    """Greedy decoding through the package's KV-cache state; byte tokens after <bos> (id 256),
    as scripts/demo_tokenizer.py encodes them."""
    ids = [256, *prompt.encode()]
    state = executor.make_state(function)
    logits = executor.predict(
        {"inputIds": np.array([ids], np.int32), "causalMask": np.zeros((1, 1, 1, len(ids)), np.float16)},
        state=state, function=function,
    )["logits"]
    out = []
    for _ in range(steps):
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        ids.append(token)
        logits = executor.predict(
            {"inputIds": np.array([[token]], np.int32), "causalMask": np.zeros((1, 1, 1, len(ids)), np.float16)},
            state=state, function=function,
        )["logits"]
    return bytes(t for t in out if t < 256).decode("utf-8", "replace")


def test_the_python_api_builds_the_demo_from_its_manifest(demo, tmp_path):
    """What the README and docs/api.md show, run as a user would: ``ap.build("manifests/demo.yaml")``
    in a checkout writes the manifest's output, verified (its build cache beside it: primed with
    the session's build, so every function and verdict is reused); ``ap.verify`` of a missing
    package and a second build without ``force`` raise the command line's errors."""
    import os
    import subprocess
    import sys

    import adapterpack as ap

    (tmp_path / "manifests").mkdir()
    shutil.copy(DEMO, tmp_path / "manifests" / "demo.yaml")
    (tmp_path / "adapters").symlink_to(REPO / "adapters")
    shutil.copytree(demo_cache(demo), tmp_path / "build" / ".adapterpack-cache")
    script = (
        "import adapterpack as ap; r = ap.build('manifests/demo.yaml'); "
        "print(r.output.name, len(r.reused), r.verify_report.passed, [f.name for f in r.verify_report.functions])"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split(" ", 3) == ["demo.mlpackage", "4", "True", "['code', 'docs', 'zen', 'base']\n"], ran.stdout
    assert (tmp_path / "build" / "demo.mlpackage" / "Manifest.json").is_file()
    with pytest.raises(ap.BadInput, match="package not found"):
        ap.verify(tmp_path / "missing.mlpackage", DEMO)
    with pytest.raises(ap.OutputExists):  # a second build without force keeps the first
        ap.build(tmp_path / "manifests" / "demo.yaml")


def test_demo_functions_write_differently(demo):
    executor = ProgramExecutor.load(demo.output)
    # The Zen's pattern (6-bit weights may pick another line of it than float16 does).
    zen = greedy(executor, "zen", "Beautiful is")
    assert zen.startswith(" better than"), zen
    assert not greedy(executor, "base", "Beautiful is").startswith(" better than")
    samples = {name: greedy(executor, name, "def ", steps=40) for name in ("code", "docs", "zen", "base")}
    assert len(set(samples.values())) >= 3, samples


def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_call(demo):
    """An app that sends a long prompt in chunks through one state (to hold fewer logits at a
    time: ``(1, q, vocab)`` per call) gets the logits one whole call would, as the Swift client
    sends them (zeros one wider than the tokens so far)."""
    from adapterpack.verification.drives import swift_mask

    executor = ProgramExecutor.load(demo.output)
    ids = [256, *b"def parse(self, text):"]

    def call(state, past: int, chunk: list[int]) -> np.ndarray:
        inputs = {"inputIds": np.array([chunk], np.int32), "causalMask": swift_mask(past, len(chunk)).astype(np.float16)}
        return executor.predict(inputs, state=state, function="code")["logits"][0]

    whole = call(executor.make_state("code"), 0, ids)
    state, chunks, past = executor.make_state("code"), [], 0
    for size in (9, 8, len(ids) - 17):
        chunks.append(call(state, past, ids[past : past + size]))
        past += size
    chunked = np.concatenate(chunks)
    assert chunked.shape == whole.shape and np.abs(whole).max() > 1
    np.testing.assert_allclose(chunked, whole, atol=2e-2 * np.abs(whole).max())
    assert (chunked.argmax(-1) == whole.argmax(-1)).all()


def test_demo_op_types_all_have_executor_tests(demo):
    from test_executor import TESTED_OPS

    executor = ProgramExecutor.load(demo.output)
    for function in executor.function_names:
        untested = executor.op_types(function) - TESTED_OPS
        assert not untested, (function, untested)
    assert "constexpr_lut_to_dense" in executor.op_types("code")


def test_demo_metadata_names_the_tokenizer(demo):
    from adapterpack.formats.registry import read_functions

    metadata = read_functions(demo.output).metadata
    assert metadata["co.huggingface.exporters.name"] == "adapterpack/demo-base"
    zen = json.loads(metadata["co.adapterpack.functions"])["zen"]
    # compression: auto, from 4 bits, with the exceptions it chose and what it measured
    assert zen["compression"].startswith("palettize 4-bit") and zen["auto"]["met"]


@pytest.mark.slow
def test_demo_float16_matches_torch(tmp_path):
    """Uncompressed, every demo function matches its PyTorch reference to float16 precision."""
    import yaml

    data = yaml.safe_load(DEMO.read_text())
    data["compression"] = {"method": "none"}
    for adapter in data["adapters"]:
        adapter.pop("compression", None)
    manifest = REPO / "manifests" / ".demo-float16.yaml"  # beside demo.yaml: its paths are relative
    manifest.write_text(yaml.safe_dump(data))
    try:
        result = build(manifest, output=tmp_path / "f16.mlpackage", options=BuildOptions(cache_dir=tmp_path / "cache"))
    finally:
        manifest.unlink()
    for function in result.verify_report.functions:
        assert function.cosine > 0.9999 and function.top1 == 1.0, function
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


@pytest.mark.slow
def test_demo_keep_mode_stores_the_base_once(tmp_path):
    """Three unfused skills weigh little more than the base alone: the base weights are shared."""
    import yaml

    from adapterpack.formats.mlpackage.inspection import inspect_package

    keep = build(REPO / "manifests" / "demo-keep.yaml", output=tmp_path / "keep.mlpackage", options=BuildOptions(cache_dir=tmp_path / "c"))
    data = yaml.safe_load((REPO / "manifests" / "demo-keep.yaml").read_text())
    data.update(adapters=[], include_base="base", default_function="base", name="demo-base-only")
    base_manifest = REPO / "manifests" / ".demo-base-only.yaml"
    base_manifest.write_text(yaml.safe_dump(data))
    try:
        alone = build(base_manifest, output=tmp_path / "base.mlpackage", options=BuildOptions(cache_dir=tmp_path / "c", verify=False))
    finally:
        base_manifest.unlink()
    assert keep.verify_report.passed, keep.verify_report.verdict()
    weights = "Data/com.apple.CoreML/weights/weight.bin"
    keep_blob = (keep.output / weights).stat().st_size
    base_blob = (alone.output / weights).stat().st_size
    assert keep_blob <= 1.10 * base_blob, (keep_blob, base_blob)
    report = inspect_package(keep.output)
    for name in ("code", "docs", "zen"):
        function = report.function(name)
        assert function.unique_bytes < 0.1 * function.shared_bytes, (name, function.unique_bytes, function.shared_bytes)
