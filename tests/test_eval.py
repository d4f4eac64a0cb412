"""`eval`: perplexity of the package and of its reference on the user's text, in sliding windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from adapterpack.evaluate.perplexity import evaluate, windows
from adapterpack.inputs.checked import check_inputs
from factories import invoke_cli, run_cli

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "manifests" / "demo.yaml"


@pytest.mark.parametrize("count,window", [(2, 2), (10, 4), (100, 33), (511, 511), (1000, 511)])
def test_windows_score_every_token_once(count, window):
    spans = windows(count, window)
    scored = [t for start, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, count))
    for start, end, first in spans:
        assert end - start <= window and start < first <= end
        assert first - start >= min(window // 2, first)  # context of at least half a window, once there is one


def test_reference_perplexity_is_the_models_own_loss(family_build, tmp_path):
    """One window: the reference's perplexity is exp of the loss transformers computes itself;
    the float16 package's is within float16 noise of it."""
    import torch

    from adapterpack.verification.reference import reference_model
    from factories import copied_build

    family, root, result = copied_build(family_build, tmp_path / "build")
    _write_tokenizer(root / "base")
    checked = check_inputs(root / "m.yaml")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n")
    report = evaluate(result.output, text, checked, functions=["rs", "base"])
    from transformers import AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(root / "base")(text.read_text()).input_ids])
    for row in report.functions:
        with reference_model(checked, row.function) as model:
            loss = float(model(ids, labels=ids).loss)
        assert row.reference_perplexity == pytest.approx(math.exp(loss), rel=1e-5)
        assert row.ratio == pytest.approx(1.0, abs=0.01) and row.top1_agreement >= 0.9, row
    rows = {row.function: row for row in report.functions}
    assert rows["base"].retention is None  # the base has no adapter whose effect could be lost
    assert rows["rs"].retention > 0.99, rows["rs"]  # a float16 package keeps all of it


def test_retention_on_the_text_is_verify_retention_over_the_scored_positions():
    """Window by window, eval keeps sums instead of logits; the figure must be verify's
    retention of all scored rows at once, and follow what the package computes."""
    from adapterpack.evaluate.perplexity import _Scores
    from adapterpack.verification.metrics import retention

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, 40)
    spans = windows(len(ids), 16)
    base = {span: rng.standard_normal((span[1] - span[0], 50)) for span in spans}
    effect = {span: rng.standard_normal(base[span].shape) for span in spans}
    reference = {span: base[span] + effect[span] for span in spans}

    def measured(package) -> float:
        scores = _Scores()
        for span in spans:
            scores.add(package[span], reference[span], base[span], ids, span)
        return scores.function_eval("f").retention

    def scored(logits) -> np.ndarray:
        return np.concatenate([logits[s][s[2] - s[0] - 1 : s[1] - s[0] - 1] for s in spans])

    noisy = {span: reference[span] + 0.7 * rng.standard_normal(base[span].shape) for span in spans}
    for package, expected in ((reference, 1.0), (base, 0.0), (noisy, None)):
        expected = retention(scored(package), scored(reference), scored(base))[0] if expected is None else expected
        assert measured(package) == pytest.approx(expected, abs=1e-9)
    assert 0.5 < measured(noisy) < 0.95  # noise uncorrelated with the effect lowers it


def _write_tokenizer(folder: Path) -> None:
    from test_generate import write_byte_level_tokenizer

    write_byte_level_tokenizer(folder)


def test_demo_zen_knows_the_zen_and_the_base_does_not(demo, tmp_path):
    from test_generate import zen_lines

    text = tmp_path / "zen.txt"
    text.write_text("\n".join(sorted(zen_lines())) + "\n")
    run = run_cli("eval", demo.output, "--text", text, "--manifest", DEMO, "--function", "zen", "--function", "base",
                  "--window", "128", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    rows = {f["function"]: f for f in report["functions"]}
    assert rows["zen"]["perplexity"] < 0.5 * rows["base"]["perplexity"], rows
    for row in rows.values():
        assert 0.8 < row["ratio"] < 1.25 and row["top1_agreement"] > 0.6, row
    assert rows["base"]["retention"] is None and 0.5 < rows["zen"]["retention"] <= 1.0, rows
    assert report["window"] == 128 and report["stride"] == 64


def test_eval_bad_input_is_one_line_exit_2(demo, tmp_path):
    empty, binary, fine = tmp_path / "empty.txt", tmp_path / "blob.txt", tmp_path / "fine.txt"
    empty.write_text("  \n")
    binary.write_bytes(b"\x00\x01\x02binary\xff")
    fine.write_text("Beautiful is better than ugly.\n")
    cases = {
        "the text file is empty": [empty],
        "not a text file": [binary],
        "--window 1": [fine, "--window", "1"],
        "--window 0": [fine, "--window", "0"],  # once silently the default
        "no function 'nope'": [fine, "--function", "nope"],
        "cannot read": [tmp_path / "missing.txt"],
    }
    for expected, (path, *extra) in cases.items():
        run = invoke_cli("eval", demo.output, "--text", path, "--manifest", DEMO, *extra)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
        assert run.returncode == 2 and len(errors) == 1 and expected in errors[0], (expected, run.stderr)
