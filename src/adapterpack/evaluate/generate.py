"""Generate a continuation: the package driven exactly as swift-transformers drives it (the prompt
in one prefill call, then one token per call through the same state, the mask ``tokenCount +
1`` zeros wide each time), or its PyTorch reference (peft, unmerged, float32) stepped through
its own KV cache; both sampled the same way.

    text = package_text(package, checked)
    stream = PackageStream(function_sessions(package)(function))
    for token in Generation(stream, text.encode(prompt), limit=text.max_tokens, eos=text.eos_ids).tokens():
        ...
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.verification.drives import Predict, swift_mask


@dataclass(frozen=True)
class Sampling:
    """Greedy at temperature 0 (the default); otherwise softmax(logits / temperature) over the
    ``top_k`` most likely tokens, cut to the smallest set holding ``top_p`` of the probability."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"--temperature {self.temperature}: give 0 (greedy) or a finite positive number")
        if self.top_k is not None and self.top_k < 1:
            raise BadInput(f"--top-k {self.top_k}: give 1 or more")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise BadInput(f"--top-p {self.top_p}: give a probability in (0, 1]")

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        logits = np.asarray(logits, np.float64)
        if self.temperature == 0:
            return int(np.argmax(logits))
        order = np.argsort(-logits, kind="stable")
        if self.top_k is not None:
            order = order[: self.top_k]
        scaled = logits[order] / self.temperature
        probabilities = np.exp(scaled - scaled.max())
        probabilities /= probabilities.sum()
        if self.top_p is not None and self.top_p < 1:
            keep = np.cumsum(probabilities) - probabilities < self.top_p  # always keeps the first
            order, probabilities = order[keep], probabilities[keep] / probabilities[keep].sum()
        return int(rng.choice(order, p=probabilities))


class LogitsStream(Protocol):
    """Next-token logits of a growing sequence."""

    def start(self, ids: list[int]) -> np.ndarray: ...

    def step(self, token: int) -> np.ndarray: ...


class PackageStream:
    """A package function, called as the Swift client calls it; ``new_session()`` gives a
    predict bound to a fresh state (``verification.runners.function_sessions``)."""

    def __init__(self, new_session: Callable[[], Predict]):
        self.new_session = new_session
        self._predict: Predict | None = None
        self._count = 0

    def start(self, ids: list[int]) -> np.ndarray:
        self._predict = self.new_session()
        self._count = len(ids)
        logits = self._predict(np.array([ids], np.int32), swift_mask(0, len(ids)))
        return np.asarray(logits, np.float32)[0, -1]

    def step(self, token: int) -> np.ndarray:
        logits = self._predict(np.array([[token]], np.int32), swift_mask(self._count, 1))
        self._count += 1
        return np.asarray(logits, np.float32)[0, -1]


class ReferenceStream:
    """The PyTorch reference (``verification.reference.reference_model``) through its own KV cache."""

    def __init__(self, model):
        self.model = model
        self._past = None

    def _run(self, ids: list[int], past) -> np.ndarray:
        import torch

        output = self.model(input_ids=torch.tensor([ids], dtype=torch.long), past_key_values=past, use_cache=True)
        self._past = output.past_key_values
        return output.logits[0, -1].float().numpy()

    def start(self, ids: list[int]) -> np.ndarray:
        return self._run(ids, None)

    def step(self, token: int) -> np.ndarray:
        return self._run([token], self._past)


class Generation:
    """One continuation of ``prompt``: ``tokens()`` yields each new token as it is chosen; the
    timings are filled in as it runs. Stops at an ``eos`` token (not yielded), after
    ``max_new_tokens``, or when the sequence reaches ``limit`` tokens."""

    def __init__(self, stream: LogitsStream, prompt: list[int], *, limit: int, eos=frozenset(),
                 max_new_tokens: int = 64, sampling: Sampling = Sampling(),
                 on_logits: Callable[[int, np.ndarray], None] | None = None):
        if len(prompt) > limit:
            raise BadInput(f"--prompt: {len(prompt)} tokens, but the package holds at most {limit} (max_context - 1)")
        self.stream, self.prompt, self.limit, self.eos = stream, prompt, limit, eos
        self.max_new_tokens, self.sampling, self.on_logits = max_new_tokens, sampling, on_logits
        self.generated: list[int] = []
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self.stopped_at_eos = False

    def tokens(self) -> Iterator[int]:
        rng = np.random.default_rng(self.sampling.seed)
        started = time.perf_counter()
        logits = self.stream.start(self.prompt)
        self.prefill_seconds = time.perf_counter() - started
        started = time.perf_counter()
        while len(self.generated) < self.max_new_tokens:
            if self.on_logits is not None:
                self.on_logits(len(self.generated), logits)
            token = self.sampling.pick(logits, rng)
            if token in self.eos:
                self.stopped_at_eos = True
                break
            self.generated.append(token)
            yield token
            if len(self.prompt) + len(self.generated) >= self.limit:
                break
            logits = self.stream.step(token)
            self.decode_seconds = time.perf_counter() - started
        self.decode_seconds = time.perf_counter() - started

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: one call per token after the first, which the prefill's logits chose."""
        steps = max(len(self.generated) - 1, 0)
        return steps / self.decode_seconds if steps and self.decode_seconds > 0 else 0.0


class TextStream:
    """Decoded text of a growing token list, emitted piece by piece; a piece that ends inside a
    multi-byte character waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self._emitted):
            return ""
        piece, self._emitted = text[len(self._emitted):], text
        return piece

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = text[len(self._emitted):] if text.startswith(self._emitted) else ""
        self._emitted = text
        return piece


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two continuations part (None when neither does)."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class GenerateResult:
    function: str
    prompt_tokens: int
    tokens: list[int]
    text: str
    prefill_seconds: float
    tokens_per_second: float
    stopped_at_eos: bool
    backend: str
    reference_tokens: list[int] | None = None  # --compare: the peft reference's continuation
    reference_text: str | None = None
    parted_at: int | None = None  # first generated token where package and reference differ
    parting_gap: float | None = None  # how far apart the reference puts the two tokens there
    parting_is_tie: bool = False  # ... closer than float16 can order (verify's top-1 tie rule)


def generate(
    package,
    function: str,
    prompt: str,
    *,
    checked=None,
    backend: str = "numpy",
    sampling: Sampling = Sampling(),
    max_new_tokens: int = 64,
    compare: bool = False,
    chat: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> GenerateResult:
    """Continue ``prompt`` with ``function`` of ``package``, calling ``on_text`` with each
    decoded piece as it comes; with ``chat``, answer it as a user message put through the
    tokenizer's chat template as a Swift app does; with ``compare``, also with its PyTorch
    reference (needs ``checked``: the manifest's inputs) and where the two part."""
    from adapterpack.evaluate.text import package_text
    from adapterpack.verification.runners import backend_for, function_sessions

    if compare and checked is None:
        raise BadInput("--compare needs --manifest: the reference is made from its base and adapters")
    if max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens {max_new_tokens}: give 1 or more")
    text = package_text(package, checked)
    text.check_function(function)
    prompt_ids = text.encode_chat(prompt) if chat else text.encode(prompt)
    settings = dict(limit=text.max_tokens, eos=text.eos_ids, max_new_tokens=max_new_tokens, sampling=sampling)
    run = Generation(PackageStream(function_sessions(package, backend)(function)), prompt_ids, **settings)
    pieces = TextStream(text.tokenizer)
    for token in run.tokens():
        piece = pieces.push(token)
        if piece and on_text is not None:
            on_text(piece)
    tail = pieces.finish()
    if tail and on_text is not None:
        on_text(tail)
    result = GenerateResult(
        function, len(prompt_ids), run.generated, text.tokenizer.decode(run.generated, skip_special_tokens=True),
        run.prefill_seconds, run.tokens_per_second, run.stopped_at_eos, backend_for(Path(package), backend),
    )
    if compare:
        from adapterpack.verification.metrics import top1_resolution
        from adapterpack.verification.reference import reference_model

        gaps: dict[int, tuple[float, float]] = {}  # step -> (gap to the package's token, tie resolution)

        def observe(step: int, logits: np.ndarray) -> None:
            if step < len(result.tokens):
                top = float(logits.max())
                gaps[step] = (top - float(logits[result.tokens[step]]), float(top1_resolution(abs(logits).max())))

        with reference_model(checked, function) as model:
            reference = Generation(ReferenceStream(model), prompt_ids, **settings, on_logits=observe)
            result.reference_tokens = list(reference.tokens())
        result.reference_text = text.tokenizer.decode(result.reference_tokens, skip_special_tokens=True)
        result.parted_at = first_difference(result.tokens, result.reference_tokens)
        if result.parted_at is not None and result.parted_at in gaps:
            gap, resolution = gaps[result.parted_at]
            result.parting_gap, result.parting_is_tie = gap, gap <= resolution
    return result
