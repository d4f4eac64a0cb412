"""Verify's two verdicts and its real-text drive.

*Exact*: the package against its PyTorch reference holding the package's own weights, read back
from it: whatever the compression, a correct conversion agrees to float16 arithmetic, and any
op-level mistake shows, however much the compression itself costs. *Quality*: that reference
against the float32 one on real text. Real text as an app sends it (with BOS, through the chat
template where there is one) reaches what random ids never do: a checkpoint's massive
activations sit on the first token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.config.manifest import load_manifest
from adapterpack.verification.package import verify_package
from factories import invoke_cli, make_demo_project

FOUR_BIT = (
    "name: q\nbase: {path: base}\n"
    "adapters: [{name: zen, path: zen}, {name: kept, path: zen, lora: keep}]\ninclude_base: base\n"
    "export: {max_context: 48}\ncompression: {method: palettize, nbits: 4}\nverify: {prefill: 12, decode_steps: 8}\n"
)


@pytest.fixture(scope="module")
def four_bit(tmp_path_factory) -> Path:
    """The demo's base and zen skill, fused and kept, data-free 4-bit: built once, unverified."""
    root = make_demo_project(tmp_path_factory.mktemp("four-bit"), FOUR_BIT)
    build(root / "m.yaml", output=root / "q.mlpackage", options=BuildOptions(use_cache=False, verify=False))
    return root


@pytest.fixture(scope="module")
def four_bit_report(four_bit):
    return verify_package(four_bit / "q.mlpackage", load_manifest(four_bit / "m.yaml"))


def test_a_4_bit_package_is_exact_against_its_own_weights_though_far_from_float32(four_bit, four_bit_report):
    """Every function, fused, kept and the base, under both drives on random ids and real text:
    cosine >= 0.9999 against the reference holding its palettized weights, while against the
    float32 model the same logits are visibly off (what the compression costs)."""
    from adapterpack.verification.metrics import compare_logits
    from adapterpack.verification.reference import random_references

    report = four_bit_report
    assert report.passed, report.verdict()
    for function in report.functions:
        assert function.reference == "own weights"
        assert set(function.by_drive) == {"swift", "python", "swift text", "python text"}, function.by_drive
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999 and figures["top1"] >= 0.99, (function.name, drive, figures)
    # the same package against float32 (what verify compared with before): far from exact
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification.drives import run_drives
    from adapterpack.verification.runners import function_sessions

    checked = check_inputs(four_bit / "m.yaml")
    tokens, base, adapters = random_references(checked, ["zen", "base"])
    got = run_drives(function_sessions(four_bit / "q.mlpackage")("zen"), tokens, 12)
    assert compare_logits(got["swift"], adapters["zen"])["cosine"] < 0.999


def test_both_verdicts_are_in_the_table_and_the_json(four_bit):
    result = invoke_cli("verify", four_bit / "q.mlpackage", "-m", four_bit / "m.yaml", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for function in report["functions"]:
        quality = function["quality"]
        assert quality["tokens"] >= 20 and 0.5 < quality["perplexity_ratio"] < 2 and 0 < quality["agreement"] <= 1
        assert function["reference"] == "own weights" and "English sample" in function["text"]
        assert {"swift text", "python text"} <= set(function["by_drive"])
    shown = invoke_cli("verify", four_bit / "q.mlpackage", "-m", four_bit / "m.yaml")
    assert "exact: worse drive" in shown.stdout and "quality: perplexity" in shown.stdout


def _plant_wrong_epsilon(package: Path, function: str) -> str:
    """Raise the first RMS norm's epsilon of ``function``'s program from 1e-5 to 5e-4, as a
    conversion mistake would (the weights untouched); returns the constant's name."""
    from adapterpack.formats.mlpackage.spec import load_spec_file, spec_path, walk_ops

    path = spec_path(package)
    spec = load_spec_file(path)
    block = spec.mlProgram.functions[function].block_specializations[spec.mlProgram.functions[function].opset]
    for op in walk_ops(block):
        values = op.attributes["val"].immediateValue.tensor.floats.values if op.type == "const" else []
        if op.type == "const" and op.attributes["val"].type.tensorType.rank == 0 and len(values) == 1 and abs(values[0] - 1e-5) < 1e-9:
            values[0] = 5e-4
            path.write_bytes(spec.SerializeToString())
            return op.outputs[0].name
    raise AssertionError("no epsilon constant found")


def test_a_planted_conversion_mistake_fails_the_exact_verdict_while_quality_looks_fine(four_bit, four_bit_report, tmp_path):
    """One norm's epsilon raised 50-fold in the 4-bit package's zen function: inside what 4 bits
    cost the float32 comparison (it passed verify before), but the exact verdict fails it on every
    drive; the quality figures, which measure only the weights, are what they were."""
    broken = tmp_path / "q.mlpackage"
    shutil.copytree(four_bit / "q.mlpackage", broken)
    _plant_wrong_epsilon(broken, "zen")
    report = verify_package(broken, load_manifest(four_bit / "m.yaml"))
    by_name = {f.name: f for f in report.functions}
    before = {f.name: f for f in four_bit_report.functions}
    zen = by_name["zen"]
    assert not zen.passed and all(failure.startswith("exact:") for failure in zen.failures), zen.failures
    assert zen.cosine < 0.9999
    assert zen.quality == before["zen"].quality and zen.retention == before["zen"].retention
    assert by_name["kept"].passed and by_name["base"].passed  # the other functions are untouched


def test_quality_follows_the_manifest_s_thresholds(four_bit, four_bit_report, tmp_path):
    """The quality verdict is judged against the manifest's thresholds: a bound the 4-bit
    package does not meet fails it (naming the figure), the exact verdict unchanged."""
    manifest = tmp_path / "m.yaml"
    shutil.copytree(four_bit / "base", tmp_path / "base")
    shutil.copytree(four_bit / "zen", tmp_path / "zen")
    ratio = max(f.quality["perplexity_ratio"] for f in four_bit_report.functions)
    manifest.write_text(FOUR_BIT.replace("decode_steps: 8}", f"decode_steps: 8, max_perplexity_ratio: {1 + (ratio - 1) / 2:.4f}}}"))
    report = verify_package(four_bit / "q.mlpackage", load_manifest(manifest))
    failed = [f for f in report.functions if not f.passed]
    assert failed and all(all(x.startswith("quality: perplexity ratio") for x in f.failures) for f in failed)


def test_thresholds_take_the_manifest_then_auto_then_the_defaults():
    from adapterpack.config.compression import Compression
    from adapterpack.config.manifest import DEFAULT_QUALITY, EXACT_THRESHOLDS, VerifySettings

    four = Compression(method="palettize", nbits=4)
    assert VerifySettings().thresholds_for(four) == EXACT_THRESHOLDS | DEFAULT_QUALITY["palettize-low"]
    auto = Compression(method="palettize", nbits=4, auto={"max_perplexity_ratio": 1.07, "min_retention": 0.8})
    found = VerifySettings().thresholds_for(auto)
    assert found["perplexity_ratio"] == 1.07 and found["retention"] == 0.8
    found = VerifySettings(max_perplexity_ratio=1.2, min_top1=0.9).thresholds_for(auto)
    assert found["perplexity_ratio"] == 1.2 and found["top1"] == 0.9 and found["cosine"] == EXACT_THRESHOLDS["cosine"]


# -- real text reaches what random ids do not ----------------------------------------------------


def _bos_project(root: Path) -> tuple[Path, int]:
    """A tiny Llama whose first layer writes 100,000 into one residual channel for its BOS
    token alone (as Gemma 3's residual reaches 103,821 at <bos>), a tokenizer that adds that BOS,
    and a verify seed whose random ids never draw it; (manifest, BOS id)."""
    from tokenizers import processors
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from adapterpack.config.manifest import VerifySettings
    from adapterpack.verification.drives import verification_tokens
    from factories import make_base, plant_massive_activation
    from test_generate import write_byte_level_tokenizer

    make_base(root / "base", "llama")
    write_byte_level_tokenizer(root / "base")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(root / "base" / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.save_pretrained(root / "base")
    bos = 0
    assert tokenizer("Hi").input_ids[0] == bos
    model = AutoModelForCausalLM.from_pretrained(root / "base")
    plant_massive_activation(model, target=100_000.0, triggers=[bos])
    model.save_pretrained(root / "base")
    seed = next(s for s in range(100) if bos not in verification_tokens(96, VerifySettings(seed=s, prefill=9, decode_steps=7)))
    (root / "m.yaml").write_text(
        "name: b\nbase: {path: base}\ninclude_base: base\nexport: {max_context: 40}\ncompression: {method: none}\n"
        f"verify: {{prefill: 9, decode_steps: 7, seed: {seed}}}\n"
    )
    return root / "m.yaml", bos


def test_an_activation_that_fires_only_on_bos_is_missed_by_random_ids_and_caught_on_real_text(tmp_path, monkeypatch):
    """The range check before conversion runs on random ids and real text: random ids alone
    find nothing, real text names the module, and the build is refused (exit 2). A package
    built without that check fails verify on its real-text drives, where float16 overflows."""
    from adapterpack.errors import BadInput
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification import ranges, texts

    manifest, bos = _bos_project(tmp_path)
    checked = check_inputs(manifest)
    tokens = texts.verify_tokens(checked, ["base"])
    assert tokens.text["base"][0] == bos and bos not in tokens.random
    found = ranges.out_of_float16_range(checked, ["base"])
    assert any(f.tensor == "model.layers.0.mlp.down_proj (output)" and f.largest > 90_000 for f in found), found
    with pytest.raises(BadInput, match=r"down_proj \(output\) reaches"):
        build(manifest, output=tmp_path / "b.mlpackage", options=BuildOptions(use_cache=False))
    random_only = texts.verify_tokens  # what verify ran on before: random ids alone

    def without_text(checked, names):
        return texts.VerifyTokens(random_only(checked, names).random)

    monkeypatch.setattr(ranges, "verify_tokens", without_text)
    assert ranges.out_of_float16_range(checked, ["base"]) == []
    result = build(manifest, output=tmp_path / "b.mlpackage", options=BuildOptions(use_cache=False, verify=False))
    monkeypatch.undo()
    report = verify_package(result.output, load_manifest(manifest))
    (base,) = report.functions
    assert not report.passed
    assert base.by_drive["swift"]["cosine"] > 0.9999 and base.by_drive["python"]["cosine"] > 0.9999  # random ids: fine
    assert base.by_drive["swift text"]["cosine"] < 0.9999 or any("float16" in x for x in base.failures), base.failures


def test_real_text_goes_through_the_chat_template_as_an_app_sends_it(tmp_path):
    """With a chat template, verify's real text is the template rendered around the text as
    swift-transformers' applyChatTemplate renders it, encoded without added special tokens."""
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.inputs.text import load_tokenizer
    from adapterpack.verification import texts

    manifest, bos = _bos_project(tmp_path)
    (tmp_path / "base" / "chat_template.jinja").write_text("<s>user:{{ messages[0]['content'] }}\nassistant:")
    checked = check_inputs(manifest)
    tokens = texts.verify_tokens(checked, ["base"])
    tokenizer = load_tokenizer(tmp_path / "base")
    expected = tokenizer("<s>user:" + texts.SAMPLE.read_text()[:2000], add_special_tokens=False).input_ids
    assert list(tokens.text["base"]) == expected[: len(tokens.text["base"])]
    assert "through the chat template" in tokens.sources["base"]
    assert np.array_equal(tokens.text["base"][:1], [bos])
