"""`eval`: perplexity of the package and of its reference on the user's text, in sliding windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

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

    from adapterpack.verify.reference import reference_model

    family, root, result = family_build
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
