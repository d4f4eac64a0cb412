"""What compression costs on the user's own text: per function, the perplexity of the package and
of its PyTorch reference (peft, unmerged, float32) on the same tokens, their ratio, how often
the two agree on the most likely next token, and for an adapter how much of what it changes on
that text survived (retention: as verify's, over every scored position and logit).

Sliding windows: the text's tokens are cut into windows of ``max_context - 1`` tokens (what one
call of the Swift client can hold; ``--window`` for fewer), each starting half a window after the previous one; a
window scores only the tokens the previous one did not, each predicted from everything before
it in the window (so every token after the first window has at least half a window of
context). Each window is one prefill call on a fresh state, with the Swift client's mask; the
reference sees the same windows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.verification.drives import swift_mask
from adapterpack.verification.metrics import retention_of_sums


@dataclass
class FunctionEval:
    function: str
    perplexity: float  # the package's
    reference_perplexity: float | None  # None without a manifest to make the reference from
    top1_agreement: float | None  # share of scored tokens whose most likely next token is the same
    # Adapters, with a manifest: cosine between the package's change from the float32 base and the
    # adapter's own change (its reference minus the base), over every scored position and logit.
    retention: float | None = None

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


def _lora_layers(model) -> list:
    """peft's LoRA layers in a reference model (none for the base function)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _reference_logits(model, lora_layers: list, window: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The reference's logits of ``window``, and the base's (None without ``lora_layers``): the
    same peft model with its LoRA layers switched off, so the base is not loaded twice."""
    import torch

    def logits() -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(window)).logits[0].float().numpy()

    reference = logits()
    if not lora_layers:
        return reference, None
    for layer in lora_layers:
        layer.enable_adapters(False)
    try:
        return reference, logits()
    finally:
        for layer in lora_layers:
            layer.enable_adapters(True)


class _Scores:
    """Per-token scores of the package (and of its reference), added window by window; the
    retention sums are kept instead of the windows' logits, which for a long text and a large
    vocabulary would not fit."""

    def __init__(self):
        self.nlls, self.reference_nlls, self.agreements = [], [], []
        self.change_dot_effect = self.change_squared = self.effect_squared = 0.0
        self.adapter = False  # a base was given: the function is an adapter's

    @property
    def nll(self) -> np.ndarray:
        return np.concatenate(self.nlls)

    def add(self, got, reference, base, ids: np.ndarray, span: tuple[int, int, int]) -> None:
        start, end, first = span
        nll, top = _scores(got, ids, start, first, end)
        self.nlls.append(nll)
        if reference is None:
            return
        reference_nll, reference_top = _scores(reference, ids, start, first, end)
        self.reference_nlls.append(reference_nll)
        self.agreements.append(top == reference_top)
        if base is not None:
            self.adapter = True
            rows = slice(first - start - 1, end - start - 1)
            change = (np.asarray(got, np.float64) - base)[rows]
            effect = (np.asarray(reference, np.float64) - base)[rows]
            self.change_dot_effect += float((change * effect).sum())
            self.change_squared += float((change * change).sum())
            self.effect_squared += float((effect * effect).sum())

    def function_eval(self, name: str) -> FunctionEval:
        if not self.reference_nlls:
            return FunctionEval(name, math.exp(self.nll.mean()), None, None)
        retention = None
        if self.adapter:
            retention = retention_of_sums(self.change_dot_effect, self.change_squared, self.effect_squared)
        return FunctionEval(
            name, math.exp(self.nll.mean()), math.exp(np.concatenate(self.reference_nlls).mean()),
            float(np.mean(np.concatenate(self.agreements))), retention,
        )


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
    from adapterpack.evaluate.text import package_text
    from adapterpack.inputs.text import read_text_file
    from adapterpack.verification.reference import reference_model
    from adapterpack.verification.runners import backend_for, function_sessions

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

    for name in names:
        new_session = sessions(name)
        with reference_model(checked, name) if checked is not None else contextlib.nullcontext() as model:
            scores = _Scores()
            lora_layers = _lora_layers(model) if model is not None else []
            for span in spans:
                tokens = ids[None, span[0] : span[1]]
                # each window one prefill call on a fresh state, with the Swift client's mask
                got = new_session()(tokens.astype(np.int32), swift_mask(0, tokens.shape[1]))[0]
                scores.add(got, *(_reference_logits(model, lora_layers, tokens) if model is not None else (None, None)), ids, span)
                done += 1 if model is None else 2
                if progress is not None:
                    progress(done, total)
        report.functions.append(scores.function_eval(name))
    return report
