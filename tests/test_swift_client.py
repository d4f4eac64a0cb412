"""Every function, driven call for call as the real Swift client drives it, gives peft's logits.

swift-transformers' ``LanguageModelWithStatefulKVCache`` (Sources/Models/LanguageModel.swift)
prefills the whole prompt in one call, then sends the last token alone, and for every call sends
``causalMask`` = zeros of shape (1, 1, 1, tokenCount + 1), tokenCount being the length of the
whole sequence so far; it reads the logits of the call's last row. Its mask is one slot wider
than the tokens, so its prompt lands at cache positions 1..n and slot 0 is never written: a
package that attends to that slot drifts from the reference. The emulation below follows that
code, and the reference is the float32 base with the adapter applied by peft, unmerged.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.formats.mlpackage.executor import ProgramExecutor
from adapterpack.verification.metrics import compare_logits
from factories import make_adapter, make_base

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENGTH = 11
NEW_TOKENS = 12


def swift_generate(executor: ProgramExecutor, function: str, prompt: list[int], new_tokens: int):
    """Greedy generation exactly as ``LanguageModelWithStatefulKVCache`` calls the model.

    Returns the whole token list and the logits row the client read at each call.
    """
    tokens = list(prompt)
    state = executor.make_state(function)  # resetState(): a fresh makeState()
    input_ids = np.array([tokens], np.int32)  # prefilling: every token
    rows = []
    for _ in range(new_tokens):
        mask = np.zeros((1, 1, 1, len(tokens) + 1), np.float16)  # MLTensor(zeros: [1, 1, 1, tokenCount + 1])
        logits = executor.predict({"inputIds": input_ids, "causalMask": mask}, state=state, function=function)["logits"]
        assert logits.ndim == 3  # the client asserts scores.rank == 3
        row = logits[0, input_ids.shape[1] - 1]  # tokenIndex = inputIds.shape[1] - 1
        rows.append(row.astype(np.float32))
        tokens.append(int(np.argmax(row)))
        input_ids = np.array([[tokens[-1]]], np.int32)  # extending: the last token only
    return tokens, np.stack(rows)


def peft_logits(base_folder: Path, adapter_folder: Path | None, tokens: list[int]) -> np.ndarray:
    """Logits (tokens, vocab) of the float32 base with the adapter applied by peft, unmerged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    if adapter_folder is not None:
        model = PeftModel.from_pretrained(model, adapter_folder)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def check_like_the_swift_client(package: Path, base: Path, adapters: dict[str, Path | None], vocab: int) -> None:
    executor = ProgramExecutor.load(package)
    prompt = list(np.random.default_rng(3).integers(0, vocab, PROMPT_LENGTH))
    for function, adapter in adapters.items():
        tokens, rows = swift_generate(executor, function, prompt, NEW_TOKENS)
        reference = peft_logits(base, adapter, tokens[:-1])[PROMPT_LENGTH - 1 :]
        metrics = compare_logits(rows, reference)
        assert metrics["cosine"] >= 0.9999 and metrics["top1"] == 1.0, (function, metrics)


def assert_both_drives_pass(report, min_top1: float = 1.0, real_text: bool = False) -> None:
    """Every function passed under both drives, on random ids and (``real_text``: a base with a
    tokenizer) on real text."""
    assert report is not None and report.passed, report.verdict()
    drives = {"swift", "python"} | ({"swift text", "python text"} if real_text else set())
    for function in report.functions:
        assert set(function.by_drive) == drives, function
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999 and figures["top1"] >= min_top1, (function.name, drive, figures)


def test_family_functions_match_peft_under_the_swift_client(family_build):
    """Fused (rank and alpha patterns, MLP, all modules), kept and base functions of every family."""
    _, root, result = family_build
    adapters = {"rs": root / "rs", "all": root / "all", "kept": root / "kept", "base": None}
    check_like_the_swift_client(result.output, root / "base", adapters, vocab=96)


def test_family_functions_pass_verify_under_both_drives(family_build):
    _, _, result = family_build
    # The family bases carry a planted massive activation: float16 flips a few near-ties of
    # random logits (see factories.make_family_project), as torch's own float16 forward does.
    assert_both_drives_pass(result.verify_report, min_top1=0.9)


@pytest.mark.slow
def test_sliding_window_shorter_than_the_sequence(tmp_path):
    """Mistral's sliding window counts positions, which the Swift client shifts by one."""
    make_base(tmp_path / "base", "mistral", sliding_window=8)
    make_adapter(tmp_path / "fused", tmp_path / "base", std=0.1, r=4, targets=("q_proj", "v_proj", "down_proj"), seed=5)
    make_adapter(tmp_path / "kept", tmp_path / "base", std=0.1, r=8, targets=("q_proj", "k_proj", "o_proj"), seed=6)
    (tmp_path / "m.yaml").write_text(
        textwrap.dedent(
            """\
            name: swift
            base: {path: base}
            include_base: base
            export: {max_context: 32}
            compression: {method: none}
            verify: {prefill: 9, decode_steps: 12}
            adapters:
              - {name: fused, path: fused, lora: fuse}
              - {name: kept, path: kept, lora: keep}
            """
        )
    )
    result = build(tmp_path / "m.yaml", output=tmp_path / "out.mlpackage", options=BuildOptions(cache_dir=tmp_path / "cache"))
    assert_both_drives_pass(result.verify_report)
    adapters = {"fused": tmp_path / "fused", "kept": tmp_path / "kept", "base": None}
    check_like_the_swift_client(result.output, tmp_path / "base", adapters, vocab=96)


@pytest.fixture(scope="module")
def demo_float16(tmp_path_factory):
    """The demo's skills at float16: code and docs fused, zen kept."""
    data = yaml.safe_load((REPO / "manifests" / "demo.yaml").read_text())
    data["compression"] = {"method": "none"}
    for adapter in data["adapters"]:
        adapter.pop("compression", None)
        adapter["lora"] = "keep" if adapter["name"] == "zen" else "fuse"
    out = tmp_path_factory.mktemp("demo-swift")
    manifest = REPO / "manifests" / f".demo-swift-{out.name}.yaml"  # beside demo.yaml: its paths are relative
    manifest.write_text(yaml.safe_dump(data))
    try:
        result = build(manifest, output=out / "demo.mlpackage", options=BuildOptions(cache_dir=out / "cache"))
        yield manifest, result
    finally:
        manifest.unlink()


@pytest.mark.slow
def test_demo_functions_match_peft_under_the_swift_client(demo_float16):
    demo = REPO / "adapters" / "demo"
    adapters = {"code": demo / "code", "docs": demo / "docs", "zen": demo / "zen", "base": None}
    check_like_the_swift_client(demo_float16[1].output, demo / "base", adapters, vocab=256)


@pytest.mark.slow
def test_demo_functions_pass_verify_under_both_drives(demo_float16):
    assert_both_drives_pass(demo_float16[1].verify_report, real_text=True)
