"""The export forward equals the HF forward for every family, and fused adapters equal peft's
unmerged model, in float32, on prefill and on token-by-token decode through the KV-cache."""

from __future__ import annotations

import copy

import pytest
import torch

from adapterpack.convert.export_decoder import DecoderShape, ExportDecoder
from adapterpack.convert.lora import applied_adapter
from adapterpack.errors import BadInput
from factories import FAMILIES, make_adapter, make_base, tiny_config

MAX_CONTEXT = 48


def run_cached(decoder: ExportDecoder, ids: torch.Tensor, prefill: int, full_mask: bool = False) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then decode the rest one at a time; return all logits."""
    decoder.reset_cache()
    outputs = []
    q = prefill
    mask = torch.zeros(1, 1, q, q) if full_mask else torch.zeros(1, 1, 1, q)
    if full_mask:  # Apple-style callers send the full additive causal mask
        mask = torch.triu(torch.full((q, q), -1e4), diagonal=1)[None, None]
    outputs.append(decoder(ids[:, :q], mask))
    for end in range(q + 1, ids.shape[1] + 1):
        outputs.append(decoder(ids[:, end - 1 : end], torch.zeros(1, 1, 1, end)))
    return torch.cat(outputs, dim=1)


@pytest.fixture(scope="module", params=FAMILIES)
def family_setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    root = tmp_path_factory.mktemp(family)
    base_folder = make_base(root / "base", family)
    adapter = make_adapter(
        root / "adapter", base_folder, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    )
    model = AutoModelForCausalLM.from_pretrained(base_folder).eval()
    return family, model, adapter


def test_export_forward_matches_hf(family_setup):
    family, model, _ = family_setup
    torch.manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 20))
    decoder = ExportDecoder(model, MAX_CONTEXT, cache_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(ids).logits
        got = run_cached(decoder, ids, prefill=7)
        got_full_mask = run_cached(decoder, ids, prefill=7, full_mask=True)
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_full_mask, got, atol=1e-6, rtol=1e-6)


def test_fused_adapter_matches_peft_unmerged(family_setup):
    from peft import PeftModel

    family, model, adapter = family_setup
    torch.manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with torch.no_grad():
        base_logits = model(ids).logits
        reference = PeftModel.from_pretrained(copy.deepcopy(model), adapter).eval()(ids).logits
        with applied_adapter(model, adapter, mode="fuse") as fused:
            got = run_cached(ExportDecoder(fused, MAX_CONTEXT, cache_dtype=torch.float32).eval(), ids, prefill=5)
        with applied_adapter(model, adapter, mode="keep") as kept:
            kept_logits = run_cached(ExportDecoder(kept, MAX_CONTEXT, cache_dtype=torch.float32).eval(), ids, prefill=5)
        after = model(ids).logits
    # The adapter must matter, or the comparison proves nothing.
    assert (reference - base_logits).abs().max() > 0.05
    torch.testing.assert_close(got, reference, atol=5e-5, rtol=1e-4)
    torch.testing.assert_close(kept_logits, reference, atol=5e-5, rtol=1e-4)
    # Taking the adapter off restores the base exactly.
    assert torch.equal(after, base_logits)


def test_zero_b_adapter_leaves_base_unchanged(tmp_path):
    from transformers import AutoModelForCausalLM

    base_folder = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(tmp_path / "zero", base_folder, zero_b=True)
    model = AutoModelForCausalLM.from_pretrained(base_folder).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        base_logits = model(ids).logits
        with applied_adapter(model, adapter, mode="fuse") as fused:
            fused_logits = fused(ids).logits
    torch.testing.assert_close(fused_logits, base_logits, atol=0, rtol=0)


def test_scale_multiplies_the_delta(tmp_path):
    from transformers import AutoModelForCausalLM

    base_folder = make_base(tmp_path / "base", "llama")
    adapter = make_adapter(tmp_path / "a", base_folder, targets=("q_proj", "v_proj", "o_proj"))
    model = AutoModelForCausalLM.from_pretrained(base_folder).eval()
    with torch.no_grad():
        w0 = model.model.layers[0].self_attn.v_proj.weight.clone()
        with applied_adapter(model, adapter, mode="fuse", scale=1.0) as m:
            delta_full = m.model.layers[0].self_attn.v_proj.weight - w0
        with applied_adapter(model, adapter, mode="fuse", scale=0.5) as m:
            delta_half = m.model.layers[0].self_attn.v_proj.weight - w0
    assert delta_full.abs().max() > 0
    torch.testing.assert_close(delta_half, delta_full * 0.5, atol=1e-6, rtol=1e-5)


def test_sliding_window_masks_old_keys():
    from transformers import AutoModelForCausalLM

    config = tiny_config("mistral", sliding_window=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 12))
    decoder = ExportDecoder(model, MAX_CONTEXT, cache_dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(ids).logits
        got = run_cached(decoder, ids, prefill=6)
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)


def test_unsupported_architecture_names_supported_ones():
    config = tiny_config("llama")
    config.model_type = "gpt2"
    with pytest.raises(BadInput, match="supported are Llama .*Mistral.*Qwen2.*Qwen3"):
        DecoderShape.from_config(config)


@pytest.mark.slow
def test_a_conversion_does_not_depend_on_earlier_ones_in_the_process(tmp_path):
    """coremltools numbers the ops it creates from process-wide counters, which loading a
    program (as verify does) advances too: a program converted after that must still be
    byte-identical to the same program converted first."""
    from adapterpack.convert.base_model import load_base
    from adapterpack.formats.mlpackage.conversion import convert_decoder
    from adapterpack.formats.mlpackage.executor import ProgramExecutor
    from adapterpack.formats.mlpackage.spec import spec_path
    from adapterpack.quiet import captured_output

    make_base(tmp_path / "base", "llama")
    model = load_base(tmp_path / "base", dtype="float16")
    specs = []
    for attempt in range(2):
        mlmodel = convert_decoder(model, max_context=32)
        with captured_output():
            mlmodel.save(str(tmp_path / f"{attempt}.mlpackage"))
        specs.append(spec_path(tmp_path / f"{attempt}.mlpackage").read_bytes())
        ProgramExecutor.load(tmp_path / f"{attempt}.mlpackage")  # creates ops with numbered names
    assert b"coreml_update_state" in specs[0]
    assert specs[0] == specs[1]
