"""What compression costs on the user's own text: per function, the perplexity of the package and
of its PyTorch reference (peft, unmerged, float32) on the same tokens, their ratio, and how often
the two agree on the most likely next token.

Sliding windows: the text's tokens are cut into windows of ``max_context - 1`` tokens (what one
call of the Swift client can hold; ``--window`` for fewer), each starting half a window after the previous one; a
window scores only the tokens the previous one did not, each predicted from everything before
it in the window (so every token after the first window has at least half a window of
context). Each window is one prefill call on a fresh state, with the Swift client's mask; the
reference sees the same windows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.verify.drives import swift_mask


@dataclass
class FunctionEval:
    function: str
    perplexity: float  # the package's
    reference_perplexity: float | None  # None without a manifest to make the reference from
    top1_agreement: float | None  # share of scored tokens whose most likely next token is the same

    @property
    def ratio(self) -> float | None:
        return None if self.reference_perplexity is None else self.perplexity / self.reference_perplexity


@dataclass
class EvalReport:
    package: Path
    text: Path
    tokens: int  # of the text
    scored: int  # tokens scored (all but the first)
    window: int
    stride: int
    backend: str
    functions: list[FunctionEval] = field(default_factory=list)

    def as_json(self) -> dict:
        data = asdict(self)
        data["package"], data["text"] = str(self.package), str(self.text)
        data["functions"] = [asdict(f) | {"ratio": f.ratio} for f in self.functions]
        return data


def windows(count: int, window: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) of each window over ``count`` tokens."""
    stride = max(1, window // 2)
    found, scored_to = [], 1
    start = 0
    while True:
        end = min(start + window, count)
        found.append((start, end, scored_to))
        scored_to = end
        if end == count:
            return found
        start += stride


def _scores(logits: np.ndarray, ids: np.ndarray, start: int, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihood, most likely token) of positions first..end-1, from a window's logits."""
    rows = np.asarray(logits, np.float64)[first - start - 1 : end - start - 1]
    shifted = rows - rows.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    targets = ids[first:end]
    return -log_probs[np.arange(len(targets)), targets], rows.argmax(axis=1)


def evaluate(
    package,
    text_file: Path,
    checked=None,
    *,
    functions: list[str] | None = None,
    window: int | None = None,
    backend: str = "numpy",
    progress: Callable[[int, int], None] | None = None,
) -> EvalReport:
    """Perplexity of every function (or ``functions``) of ``package`` and, given ``checked``
    (the manifest's inputs), of its reference on the text in ``text_file``;
    ``window``: tokens per window (default and most: ``max_context - 1``; a model trained on
    shorter sequences is measured fairly with its training length). ``progress(done, total)``
    counts windows run."""
    from adapterpack.evaluate.text import package_text, read_text_file
    from adapterpack.verify.reference import reference_model
    from adapterpack.verify.runners import backend_for, function_sessions

    text = package_text(package, checked)
    names = functions or text.functions
    for name in names:
        text.check_function(name)
    ids = np.array(text.encode(read_text_file(text_file), where=str(text_file)), np.int64)
    if len(ids) < 2:
        raise BadInput(f"{text_file}: one token is nothing to predict; give more text")
    window = text.max_tokens if window is None else window  # 0 is refused below, not taken as the default
    if not 2 <= window <= text.max_tokens:
        raise BadInput(f"--window {window}: give 2 to {text.max_tokens} tokens (max_context - 1)")
    spans = windows(len(ids), window)
    report = EvalReport(
        Path(package), Path(text_file), len(ids), len(ids) - 1, window, max(1, window // 2), backend_for(Path(package), backend)
    )
    sessions = function_sessions(Path(package), backend)
    total, done = (2 if checked is not None else 1) * len(spans) * len(names), 0
    import torch

    def scored(forward) -> tuple[np.ndarray, np.ndarray]:
        """(negative log-likelihoods, most likely tokens) of every scored token, window by window."""
        nonlocal done
        nll, top = [], []
        for start, end, first in spans:
            window_nll, window_top = _scores(forward(ids[None, start:end]), ids, start, first, end)
            nll.append(window_nll)
            top.append(window_top)
            done += 1
            if progress is not None:
                progress(done, total)
        return np.concatenate(nll), np.concatenate(top)

    for name in names:
        new_session = sessions(name)
        # each window one prefill call on a fresh state, with the Swift client's mask
        ours, ours_top = scored(
            lambda window, new_session=new_session: new_session()(window.astype(np.int32), swift_mask(0, window.shape[1]))[0]
        )
        if checked is None:
            report.functions.append(FunctionEval(name, math.exp(ours.mean()), None, None))
            continue
        with reference_model(checked, name) as model:
            reference, reference_top = scored(lambda window: model(torch.from_numpy(window)).logits[0].float().numpy())
        agreement = float(np.mean(ours_top == reference_top))
        report.functions.append(FunctionEval(name, math.exp(ours.mean()), math.exp(reference.mean()), agreement))
    return report
