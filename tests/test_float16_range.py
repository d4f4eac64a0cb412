"""Real checkpoints' massive activations in float16: the norm form that survives them, the planted
fixture that shows today's form would not, and verify naming where float16 overflows."""

from __future__ import annotations

import warnings

import pytest
import torch

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.convert import export_decoder
from adapterpack.errors import VerificationFailed
from adapterpack.formats.mlpackage import conversion as coreml
from factories import make_adapter, make_massive_base


class _Norm(torch.nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, size))
        self.variance_epsilon = 1e-5


def _float16_hf_norm(norm: _Norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm with its float32 upcast dropped, as a float16 conversion computes it."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight.half() * (x * torch.rsqrt(variance + norm.variance_epsilon))


@pytest.mark.parametrize("largest", [0.003, 1.0, 300.0, 22574.0, 65000.0])
def test_the_exported_norm_is_exact_in_float16_for_any_magnitude(largest):
    torch.manual_seed(0)
    norm = _Norm(576).half()
    x = torch.randn(3, 576)
    x[:, 7] = largest  # one massive channel, as pretrained checkpoints have
    x = x * (largest / x.abs().amax(-1, keepdim=True))
    reference = norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    got = export_decoder.rms_norm(norm, x.half()).float()
    assert torch.isfinite(got).all()
    cosine = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert cosine.min() > 0.99999, cosine
    if largest > 300:  # the form it replaces: x^2 overflows, the token's state becomes zero
        assert not torch.isfinite(x.half().pow(2).mean(-1)).all()
        assert _float16_hf_norm(norm, x.half()).abs().max() == 0


def _planted_project(root):
    make_massive_base(root / "base", "llama")
    make_adapter(root / "a", root / "base", std=0.1, targets=("q_proj", "v_proj", "down_proj"))
    (root / "m.yaml").write_text(
        "name: planted\nbase: {path: base}\nadapters: [{name: a, path: a}]\ninclude_base: base\n"
        "export: {max_context: 24}\ncompression: {method: none}\nverify: {prefill: 9, decode_steps: 7, min_top1: 0.9}\n"
    )
    return root / "m.yaml"


def test_planted_activation_passes_and_the_unsafe_norm_fails_naming_the_overflow(tmp_path, monkeypatch):
    """The fixture is strong enough to catch the old export: with transformers' norm module
    exported as it is, verify fails and names the first overflowing op; no numpy warning leaks."""
    manifest = _planted_project(tmp_path)
    result = build(manifest, output=tmp_path / "ok.mlpackage", options=BuildOptions(use_cache=False))
    for function in result.verify_report.functions:
        assert function.cosine >= 0.9999, function

    # The old export: transformers' norm module as it is, every op narrowed to float16.
    monkeypatch.setattr(export_decoder, "rms_norm", lambda norm, x: norm(x))
    monkeypatch.setattr(coreml, "compute_precision", lambda ct: ct.precision.FLOAT16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(VerificationFailed) as failed:
            build(manifest, output=tmp_path / "bad.mlpackage", options=BuildOptions(use_cache=False))
    message = str(failed.value)
    assert "float16 overflow first at op" in message, message
    # The planted channel is written by layer 0's MLP: the overflow is in the norm after it.
    assert "after 1 of 2 attention ops" in message, message
    assert "cosine" in message  # the figures still fail, and say so
    assert not (tmp_path / "bad.mlpackage").exists()


def test_values_float16_cannot_hold_are_refused_before_conversion(tmp_path):
    """A residual past 65504 cannot be made safe by the export: build and validate --range refuse
    it with exit 2 naming the module, before any conversion."""
    from transformers import AutoModelForCausalLM

    from adapterpack.assemble.pipeline import build as build_package
    from factories import make_base, plant_massive_activation, run_cli

    make_base(tmp_path / "base", "llama")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    plant_massive_activation(model, target=90000.0)
    model.save_pretrained(tmp_path / "base")
    (tmp_path / "m.yaml").write_text("name: big\nbase: {path: base}\ninclude_base: base\nadapters: []\nexport: {max_context: 16}\n")
    from adapterpack.errors import BadInput

    with pytest.raises(BadInput, match=r"model\.layers\.0\.mlp\.down_proj \(output\) reaches 8\d{4}"):
        build_package(tmp_path / "m.yaml", output=tmp_path / "big.mlpackage", options=BuildOptions(use_cache=False))
    assert not (tmp_path / "big.mlpackage").exists()
    result = run_cli("validate", tmp_path / "m.yaml", "--range")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "float16" in lines[-1] and "Traceback" not in result.stderr
    assert run_cli("validate", tmp_path / "m.yaml").returncode == 0  # without --range: files only


def test_the_range_check_side_by_side_names_the_function_that_overflows(tmp_path, monkeypatch):
    """The functions' references run as batch rows of one forward; the check must name the one
    adapter whose LoRA branch passes float16's range, not the base or the adapter beside it, and
    find exactly what running each function alone finds."""
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.verification import reference
    from adapterpack.verification.ranges import out_of_float16_range
    from factories import make_base

    make_base(tmp_path / "base", "llama")
    make_adapter(tmp_path / "quiet", tmp_path / "base", std=0.1)
    make_adapter(tmp_path / "loud", tmp_path / "base", std=300.0, seed=3, targets=("down_proj",))
    (tmp_path / "m.yaml").write_text(
        "name: rows\nbase: {path: base}\ninclude_base: base\nexport: {max_context: 24}\n"
        "adapters: [{name: quiet, path: quiet}, {name: loud, path: loud}]\n"
    )
    checked = check_inputs(tmp_path / "m.yaml")
    found = out_of_float16_range(checked, checked.manifest.function_names)
    assert found and {f.function for f in found} == {"loud"}, found
    assert any(f.tensor.endswith("down_proj.lora_B.default (output)") for f in found), found
    monkeypatch.setattr(reference, "_mixes", lambda info: False)  # every function on its own
    alone = out_of_float16_range(checked, checked.manifest.function_names)
    assert sorted((f.function, f.tensor, f.largest) for f in found) == sorted((f.function, f.tensor, f.largest) for f in alone)
