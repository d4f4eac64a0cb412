"""`generate`: a function continues a prompt driven like the Swift client, on the demo and on
every family with a Hugging Face tokenizer the test writes itself; --compare against peft."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from adapterpack.errors import BadInput
from adapterpack.evaluate.generate import Generation, Sampling, TextStream, first_difference, generate
from adapterpack.inputs.checked import check_inputs
from factories import invoke_cli, run_cli

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "manifests" / "demo.yaml"


def zen_lines() -> set[str]:
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return {line for line in codecs.decode(this.s, "rot13").splitlines() if line}


def test_zen_continues_beautiful_is_with_the_zen_of_python(demo):
    run = run_cli("generate", demo.output, "--function", "zen", "--prompt", "Beautiful is", "--manifest", DEMO, "--max-new-tokens", "96")
    assert run.returncode == 0, run.stderr
    text = run.stdout.removesuffix("\n")  # the command ends the line after the continuation
    assert text.startswith("Beautiful is better than"), text
    # Every line it completes after the first is a line of the Zen (the first continues the prompt).
    complete = text.split("\n")[1:-1]
    assert complete and all(line in zen_lines() for line in complete), text
    assert "tokens/s" in run.stderr and "zen: " in run.stderr


def test_compare_shows_where_package_and_reference_part(demo):
    checked = check_inputs(DEMO)
    result = generate(demo.output, "zen", "Beautiful is", checked=checked, max_new_tokens=64, compare=True)
    # The float32 reference recites the Zen from its first line.
    reference = ("Beautiful is" + result.reference_text).split("\n")
    assert reference[0] == "Beautiful is better than ugly." and all(line in zen_lines() for line in reference[:-1]), reference
    assert result.parted_at == first_difference(result.tokens, result.reference_tokens)
    agreed = result.parted_at if result.parted_at is not None else len(result.tokens)
    assert agreed >= 3 and result.tokens[:agreed] == result.reference_tokens[:agreed]
    # The base function has no adapter: it does not recite the Zen.
    base = generate(demo.output, "base", "Beautiful is", checked=checked, max_new_tokens=16)
    assert not base.text.startswith(" better than")


def write_byte_level_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer over the factories' 96 tokens (printable ASCII, "Ġ" for the
    space, as GPT-2-style tokenizers map it) written to ``folder``. transformers loads it with
    the family's own tokenizer class where it has one (Qwen2Tokenizer), as it would a real
    model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    characters = [chr(c) for c in range(33, 126)]
    vocab = {"<s>": 0, "</s>": 1, "Ġ": 2, **{c: i + 3 for i, c in enumerate(characters)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )


@pytest.fixture
def family_with_tokenizer(family_build, tmp_path):
    """A copy of a family's float16 package, tokenizer files written into its base folder."""
    from factories import copied_build

    family, root, result = copied_build(family_build, tmp_path / "build")
    write_byte_level_tokenizer(root / "base")
    return family, root, result


def test_every_family_generates_what_its_reference_generates(family_with_tokenizer):
    from transformers import AutoTokenizer

    family, root, result = family_with_tokenizer
    checked = check_inputs(root / "m.yaml")
    for function in ("rs", "kept", "base"):
        got = generate(result.output, function, "def f(x): return", checked=checked, max_new_tokens=8, compare=True)
        assert len(got.tokens) == 8 or got.stopped_at_eos
        # float16 package, float32 reference: the same greedy continuation, unless they part
        # where the reference's two candidates are closer than float16 can order (random tiny
        # models have such near-ties).
        assert got.parted_at is None or got.parting_is_tie, (family, function, got.parting_gap, got.tokens, got.reference_tokens)
        tokenizer = AutoTokenizer.from_pretrained(root / "base")
        assert got.text == tokenizer.decode(got.tokens, skip_special_tokens=True) and len(got.text) >= len(got.tokens) - 1


def test_generate_bad_input_is_one_line_exit_2(demo):
    package = demo.output  # built into a folder without tokenizer files
    cases = {
        "no function 'nope'": ["--function", "nope", "--prompt", "x", "--manifest", DEMO],
        "at most 511": ["--function", "base", "--prompt", "x" * 600, "--manifest", DEMO],
        "no tokenizer files beside it": ["--function", "base", "--prompt", "x"],
        "--compare needs --manifest": ["--function", "base", "--prompt", "x", "--compare"],
        "--top-p 2.0": ["--function", "base", "--prompt", "x", "--manifest", DEMO, "--temperature", "1", "--top-p", "2"],
    }
    for expected, args in cases.items():
        run = invoke_cli("generate", package, *args)
        lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == 2 and len(lines) == 1 and expected in lines[0], (expected, run.stderr)
        assert "Traceback" not in run.stderr


def test_sampling():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, np.log(3.0), -5.0])
    assert Sampling().pick(logits, rng) == 1
    assert Sampling(temperature=1.0, top_k=1).pick(logits, rng) == 1
    assert Sampling(temperature=1.0, top_p=0.01).pick(logits, rng) == 1
    draws = [Sampling(temperature=1.0, top_k=2).pick(logits, rng) for _ in range(4000)]
    assert set(draws) == {0, 1} and abs(np.mean(np.array(draws) == 1) - 0.75) < 0.03
    with pytest.raises(BadInput):
        Sampling(temperature=-1)


def test_generation_stops_at_eos_and_at_the_context_limit():
    class Scripted:
        def __init__(self, picks):
            self.picks = iter(picks)

        def logits(self):
            row = np.zeros(8)
            row[next(self.picks)] = 1
            return row

        def start(self, ids):
            return self.logits()

        def step(self, token):
            return self.logits()

    stopped = Generation(Scripted([3, 4, 7, 5]), [1, 2], limit=30, eos={7})
    assert list(stopped.tokens()) == [3, 4] and stopped.stopped_at_eos
    limited = Generation(Scripted([3] * 20), [1, 2], limit=6)
    assert list(limited.tokens()) == [3, 3, 3, 3]
    with pytest.raises(BadInput, match="at most 6"):
        Generation(Scripted([]), list(range(7)), limit=6)


def test_text_stream_waits_for_whole_characters():
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", "replace")

    stream = TextStream(Bytes())
    pieces = [stream.push(b) for b in "é!".encode()]
    assert pieces == ["", "é", "!"] and stream.finish() == ""


def test_demo_bundle_runs_without_the_manifest(demo, tmp_path):
    """The demo's app-ready bundle: its byte-level tokenizer files travel with the package, and
    generate finds them beside it (no manifest, no hub)."""
    from adapterpack.distribution.bundle import write_bundle

    checked = check_inputs(DEMO)
    files = write_bundle(tmp_path / "demo", checked, demo, demo.output)
    bundle = tmp_path / "demo"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        assert (bundle / name).read_bytes() == (REPO / "adapters" / "demo" / "base" / name).read_bytes()
        assert f"demo/{name}" in files
    assert 'case zen = "zen"' in (bundle / "AdapterFunction.swift").read_text()
    run = run_cli("generate", bundle / "demo.mlpackage", "--function", "zen", "--prompt", "Beautiful is", "--max-new-tokens", "12")
    assert run.returncode == 0 and run.stdout.startswith("Beautiful is better than"), run.stdout + run.stderr
