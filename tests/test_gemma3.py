"""Gemma 3 (``gemma3_text``): the export against transformers' own Gemma3ForCausalLM at toy size
(sliding and global layers, their rope bases, the window, (1 + w) gains, a query scale that is not
1/sqrt(head_dim)), the float16 range rule for a residual past 65504, the configs it refuses; and
the real Gemma 3 270M (scripts/gemma3.py) with the haiku skill trained on it (adapters/gemma3).

The family's package-level tests (every function of every family, both formats and contracts)
run with the other families' in the slow step (``factories.FAMILIES``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from factories import load_script, make_adapter, make_base, make_massive_base, run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("gemma") / "base", "gemma3_text")


def _both_conventions(model, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the export's decoder over ``ids`` as swift-transformers calls it (prefill, then
    one token per call, the mask ``tokenCount + 1`` wide) and as Apple's runtime does (one call)."""
    from adapterpack.convert.export_decoder import AppleDecoder, ExportDecoder

    swift = ExportDecoder(model, max_context=32, cache_dtype=torch.float32).eval()
    n = ids.shape[1]
    rows = [swift(ids[:, :prefill].int(), torch.zeros(1, 1, prefill, prefill + 1))[0]]
    for i in range(prefill, n):
        rows.append(swift(ids[:, i : i + 1].int(), torch.zeros(1, 1, 1, i + 2))[0])
    apple = AppleDecoder(model, 32, None, True).eval()
    caches = [torch.zeros(swift.keyCache.shape) for _ in range(2)]
    return torch.cat(rows), apple(ids.int(), torch.arange(n)[None].int(), *caches)[0]


def test_the_export_computes_what_transformers_computes_for_gemma(tiny_gemma):
    """20 tokens through a window of 4: the sliding layer's window, both rope tables, the query
    scale and the (1 + w) gains must all be right for the logits to agree to float32 rounding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits[0]
        swift, apple = _both_conventions(model, ids, prefill=7)
        wide = AutoModelForCausalLM.from_pretrained(tiny_gemma, dtype=torch.float32, sliding_window=64).eval()
        unwindowed = wide(ids).logits[0]
    assert (unwindowed - reference).abs().max() > 0.05  # the window changes the logits here
    torch.testing.assert_close(swift, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(apple, reference, rtol=0, atol=1e-5)


def test_the_range_check_passes_the_float32_residual_and_names_a_float16_overflow(tmp_path):
    """The planted residual passes 65504 (Gemma 3 270M's reaches 103,821); the export carries it
    in float32, so the range check lets it be. An MLP output past 65504 is computed in float16:
    it is named."""
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification.ranges import out_of_float16_range

    make_massive_base(tmp_path / "base", "gemma3_text")
    make_adapter(tmp_path / "loud", tmp_path / "base", std=300.0, seed=3, targets=("down_proj",))
    (tmp_path / "m.yaml").write_text(
        "name: g\nbase: {path: base}\ninclude_base: base\nexport: {max_context: 32}\nadapters: [{name: loud, path: loud}]\n"
    )
    checked = check_inputs(tmp_path / "m.yaml")
    with pytest.MonkeyPatch.context() as patch:  # what the residual reaches: past float16's range
        from adapterpack.verification import ranges

        patch.setattr(ranges, "held_in_float32", lambda tensor, sandwich: False)
        residual = [f for f in out_of_float16_range(checked, ["base"]) if f.tensor == "model.layers.0 (output)"]
    assert residual and residual[0].largest > 65504, residual
    found = out_of_float16_range(checked, checked.manifest.function_names)
    assert {f.function for f in found} == {"loud"}, found
    # the MLP's output, and the post-feedforward norm's input that it is (a float16 value)
    assert any("down_proj" in f.tensor for f in found), found
    assert all("mlp" in f.tensor or f.tensor.endswith("post_feedforward_layernorm (input)") for f in found), found


@pytest.mark.parametrize("change, reason", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "unknown layer_types chunked_attention"),
    ({"layer_types": ["full_attention"]}, "one attention type per layer (2)"),
])
def test_gemma_configs_the_export_does_not_compute_are_refused(tiny_gemma, tmp_path, change, reason):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_gemma, base)
    config = json.loads((base / "config.json").read_text()) | change
    (base / "config.json").write_text(json.dumps(config))
    (tmp_path / "m.yaml").write_text("name: g\nbase: {path: base}\ninclude_base: base\nadapters: []\n")
    result = run_cli("validate", tmp_path / "m.yaml")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert reason in lines[0] and "config.json" in lines[0], lines[0]


# -- the real checkpoint ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def gemma3_base() -> Path:
    """Gemma 3 270M, converted once into models/ (CI does it before the tests; a test that finds
    it missing converts it, about two minutes, rather than skipping)."""
    return load_script("gemma3").ensure_base()


@pytest.fixture(scope="session")
def gemma3_float16(gemma3_base, tmp_path_factory):
    """haiku fused and kept, and the base: one float16 .mlpackage, built and verified once."""
    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions

    root = tmp_path_factory.mktemp("gemma3")
    haiku = REPO / "adapters" / "gemma3" / "haiku"
    (root / "m.yaml").write_text(
        f"name: gemma3\nbase: {{path: {gemma3_base}, tokenizer: google/gemma-3-270m}}\n"
        f"adapters:\n  - {{name: haiku, path: {haiku}}}\n  - {{name: haiku_kept, path: {haiku}, lora: keep}}\n"
        "include_base: base\nexport: {max_context: 48}\ncompression: {method: none}\nverify: {prefill: 16, decode_steps: 4}\n"
    )
    return root / "m.yaml", build(root / "m.yaml", output=root / "gemma3.mlpackage", options=BuildOptions(use_cache=False))


@pytest.mark.slow
def test_real_gemma3_float16_package_is_exact_fused_and_kept(gemma3_float16):
    """On real text with <bos> the checkpoint's residual passes 100,000: every function matches
    its reference under both drives, on random ids and on real text."""
    _, result = gemma3_float16
    report = result.verify_report
    assert report.passed, report.verdict()
    assert {f.name for f in report.functions} == {"haiku", "haiku_kept", "base"}
    for function in report.functions:
        assert set(function.by_drive) == {"swift", "python", "swift text", "python text"}, function.name
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999 and figures["top1"] >= 0.99, (function.name, drive, figures)
        if function.name != "base":
            assert function.adapter_effect > 0.05 and function.retention > 0.99, function


@pytest.mark.slow
@pytest.mark.parametrize("function", ["haiku", "haiku_kept"])
def test_real_gemma3_skill_continues_a_prompt_as_its_reference_does(gemma3_float16, function):
    manifest, result = gemma3_float16
    _continues_as_its_reference(manifest, result.output, function)


def _real_gemma_build(root: Path, base: Path, settings: str, output: str):
    """``haiku`` fused on the real checkpoint at ``settings`` (manifest lines), built and verified."""
    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions

    (root / "m.yaml").write_text(
        f"name: gemma3\nbase: {{path: {base}, tokenizer: google/gemma-3-270m}}\n"
        f"adapters:\n  - {{name: haiku, path: {REPO / 'adapters' / 'gemma3' / 'haiku'}}}\n"
        f"verify: {{prefill: 16, decode_steps: 4}}\n{settings}"
    )
    return root / "m.yaml", build(root / "m.yaml", output=root / output, options=BuildOptions(use_cache=False))


def _continues_as_its_reference(manifest: Path, package: Path, function: str = "haiku") -> None:
    """The skill's greedy continuation of a prompt it never saw, 32 tokens, equals its float32
    reference's (a float16 tie excepted, as ``generate --compare`` judges: the parting named)."""
    from adapterpack.evaluate.generate import generate
    from adapterpack.inputs.checked import check_inputs

    run = generate(package, function, "Write a haiku about a harbor at dawn.\n", max_new_tokens=32,
                   checked=check_inputs(manifest), compare=True)
    if run.tokens != run.reference_tokens:
        assert run.parting_is_tie, (run.parted_at, run.parting_gap, run.text, run.reference_text)
    assert run.text.count("\n") >= 2, run.text  # lines, as a haiku has


@pytest.mark.slow
def test_real_gemma3_aimodel_is_exact_and_continues_as_its_reference(gemma3_base, tmp_path):
    """The .aimodel of the same float16 weights, run by Core AI's own runtime here, computing in
    float32: at Core AI's float16 compute the exact verdict fails on this checkpoint (cosine
    0.99967, top-1 95% on random ids; docs/models.md, Gemma 3)."""
    manifest, result = _real_gemma_build(
        tmp_path, gemma3_base,
        "export: {format: aimodel, max_context: 48, compute_precision: float32}\ncompression: {method: none}\n", "g.aimodel",
    )
    report = result.verify_report
    assert report.passed, report.verdict()
    for function in report.functions:
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= 0.9999 and figures["top1"] >= 0.99, (function.name, drive, figures)
    _continues_as_its_reference(manifest, result.output)


@pytest.mark.slow
@pytest.mark.parametrize("texts", ["named", "none"], ids=["its-calibration-texts", "no-calibration-text"])
def test_real_gemma3_at_4_bits_keeps_its_skill(gemma3_base, tmp_path, texts):
    """4-bit palettes weighted by the activations of calibration text, the manifest's own (as
    manifests/gemma3-q4-calibrated.yaml) or, where it names none, text the base writes itself
    (manifests/gemma3-q4.yaml, the default): verify's quality verdict passes where unweighted
    palettes are refused (retention 0.65 < 0.75; docs/models.md, Gemma 3), and the skill still
    answers in lines."""
    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions
    from adapterpack.evaluate.generate import generate
    from adapterpack.inputs.checked import check_inputs

    folder = REPO / "adapters" / "gemma3" / "calibration"
    base_text, skill_text = (f", calibration: {folder / 'base.txt'}", f", calibration: {folder / 'haiku.txt'}") if texts == "named" else ("", "")
    manifest = tmp_path / "m.yaml"
    manifest.write_text(
        f"name: gemma3\nbase: {{path: {gemma3_base}, tokenizer: google/gemma-3-270m{base_text}}}\n"
        f"adapters:\n  - {{name: haiku, path: {REPO / 'adapters' / 'gemma3' / 'haiku'}{skill_text}}}\n"
        "export: {max_context: 160}\ncompression: {method: palettize, nbits: 4}\n"
    )
    result = build(manifest, output=tmp_path / "g.mlpackage", options=BuildOptions(use_cache=False))
    report = result.verify_report
    assert report.passed, report.verdict()
    (haiku,) = report.functions
    # at 160 tokens here (docs/models.md): its texts 1.007x and 0.923; none 1.097x and 0.818 on
    # one machine, 1.184x and 0.758 on another of the same kind (the text the base writes in
    # bfloat16 follows the CPU's rounding); unweighted 1.199x and 0.653
    assert haiku.retention >= (0.8 if texts == "named" else 0.75), haiku
    assert haiku.quality["perplexity_ratio"] <= 1.2, haiku
    run = generate(result.output, "haiku", "Write a haiku about a harbor at dawn.\n", max_new_tokens=32, checked=check_inputs(manifest))
    assert run.text.count("\n") >= 2, run.text


def test_gemma_weights_under_another_family_s_name_are_refused(tiny_gemma, tmp_path):
    """A Gemma checkpoint relabelled as Qwen3 (q/k norms too, the same projections) validated
    before the base had to hold exactly what its family reads: its extra norms name it."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_gemma, base)
    config = json.loads((base / "config.json").read_text()) | {"model_type": "qwen3"}
    (base / "config.json").write_text(json.dumps(config))
    (tmp_path / "m.yaml").write_text("name: g\nbase: {path: base}\ninclude_base: base\nadapters: []\n")
    result = run_cli("validate", tmp_path / "m.yaml")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "feedforward_layernorm.weight" in lines[0], lines[0]


# -- a vocabulary that holds most of the weights ---------------------------------------------------


def _wide_vocabulary_project(root: Path, compression: str, package_format: str = "mlpackage", skill_compression: str = "") -> Path:
    """A tied Gemma base whose 2,560-row embedding holds 62.5% of its matrix weights (Gemma 3
    270M's share), a skill (with its own ``skill_compression`` block if given), and a manifest at
    ``compression``."""
    if not (root / "base").exists():
        make_base(root / "base", "gemma3_text", vocab_size=2560, tie_word_embeddings=True)
        make_adapter(root / "skill", root / "base", std=0.3)
    own = f", compression: {skill_compression}" if skill_compression else ""
    (root / "m.yaml").write_text(
        f"name: wide\nbase: {{path: base}}\nadapters:\n  - {{name: skill, path: skill{own}}}\ninclude_base: base\n"
        f"export: {{format: {package_format}, max_context: 32}}\ncompression: {compression}\n"
    )
    return root / "m.yaml"


@pytest.mark.parametrize("compression, embedding", [
    ("{method: palettize, nbits: 4}", ("palettize", 8, 16)),
    ("{method: linear, nbits: 4}", ("linear", 8, None)),
    ("{method: palettize, nbits: 4, keep_float16: [embed_tokens]}", None),  # the manifest's own choice stands
    ("{method: prune}", None),
    ("{method: none}", None),
])
def test_a_vocabulary_holding_most_weights_is_compressed_at_8_bits_by_default(tmp_path, compression, embedding):
    from adapterpack.config.compression import vocabulary_share, weight_setting
    from adapterpack.inputs.checked import check_inputs

    checked = check_inputs(_wide_vocabulary_project(tmp_path, compression))
    shapes = {name: tuple(info.shape) for name, info in checked.base.tensors.items()}
    assert 0.6 < vocabulary_share(shapes) < 0.65
    for function in ("skill", "base"):
        setting = weight_setting("model.embed_tokens.weight", (2560, 64), checked.manifest.compression_for(function))
        found = None if setting is None else (setting.method, setting.nbits, setting.group_size)
        assert found == embedding, (function, setting)
        # the rest as the manifest says
        body = weight_setting("model.layers.0.mlp.down_proj.weight", (64, 128), checked.manifest.compression_for(function))
        assert body is None or body.nbits in (4, None)


@pytest.mark.parametrize("skill_compression, embedding, down_proj", [
    ("{method: linear, nbits: 4}", ("linear", 8, None), ("linear", 4)),  # another method: its own 8-bit form
    ("{nbits: 6, layers: {down_proj: {nbits: 8}}}", ("palettize", 8, 16), ("palettize", 8)),  # its own exceptions kept
    ("{nbits: 6, keep_float16: [embed_tokens]}", None, ("palettize", 6)),
])
def test_an_adapter_s_own_compression_gets_the_vocabulary_default_too(tmp_path, skill_compression, embedding, down_proj):
    from adapterpack.config.compression import weight_setting
    from adapterpack.inputs.checked import check_inputs

    manifest = _wide_vocabulary_project(tmp_path, "{method: palettize, nbits: 4}", skill_compression=skill_compression)
    compression = check_inputs(manifest).manifest.compression_for("skill")
    setting = weight_setting("model.embed_tokens.weight", (2560, 64), compression)
    assert (None if setting is None else (setting.method, setting.nbits, setting.group_size)) == embedding, compression
    body = weight_setting("model.layers.0.mlp.down_proj.weight", (64, 128), compression)
    assert (body.method, body.nbits) == down_proj, compression


def test_a_small_vocabulary_stays_float16_by_default(tiny_gemma, tmp_path):
    from adapterpack.config.compression import weight_setting
    from adapterpack.inputs.checked import check_inputs

    (tmp_path / "m.yaml").write_text(f"name: g\nbase: {{path: {tiny_gemma}}}\ninclude_base: base\nadapters: []\n")
    assert weight_setting("model.embed_tokens.weight", (96, 64), check_inputs(tmp_path / "m.yaml").manifest.compression) is None


@pytest.mark.slow
@pytest.mark.parametrize("package_format", ["mlpackage", "aimodel"])
def test_a_compressed_scaled_embedding_verifies_in_both_formats(tmp_path, package_format):
    """Gemma's scaled, tied embedding stored as 8-bit palettes (the default for its share) is
    looked up, scaled and used as the output head as its reference computes, in both formats."""
    from adapterpack.assemble.pipeline import build
    from adapterpack.report.inspectors import inspect_either

    manifest = _wide_vocabulary_project(tmp_path, "{method: palettize, nbits: 4, group_size: 16}", package_format)
    result = build(manifest, output=tmp_path / f"p.{package_format}")
    assert result.verify_report.passed, result.verify_report.verdict()
    report = inspect_either(result.output)
    if package_format == "mlpackage":
        (embedding,) = [t for t in report.tensors if any("embed_tokens" in n for n in t.names)]
        assert embedding.kind == "palettized 8-bit" and embedding.shape == [2560, 64], embedding
    else:
        # the embedding's 163,840 indices are the asset's only 8-bit ones (the rest is 4-bit),
        # one table for the lookup and the output head
        elements = report.storage_elements
        assert elements.get("UInt8") == 2560 * 64 and elements.get("Float16", 0) < 2560 * 64, elements
