"""Apple's Core AI Swift runtime for language models, call for call, in Python: what drives an
asset of Apple's contract (``export.contract: apple``) on Core AI's runtime.

Written from apple/coreai-models at 86b363d (``swift/Sources/CoreAILanguageModels``):

- ``InferenceEngines/CoreAISequentialEngine.swift``: the function must have exactly 2 inputs
  (token ids, then position ids), at least one output (the first is the logits, float16 only)
  and 2 to 4 states. ``processTokenBatch`` makes sure the caches hold ``processed + q`` tokens,
  sends the batch's ids (1, q) Int32 and position ids (1, processed + q) Int32 holding
  0..processed + q - 1, reads (1, q, vocab) logits, then counts the tokens processed. A prompt
  longer than ``chunkThreshold`` is sent in chunks of ``prefillChunkSize``; generation then sends
  one token per call.
- ``InferenceEngines/ModelConfig.swift``: ``chunkThreshold`` 1024 (or ``COREAI_CHUNK_THRESHOLD``),
  ``prefillChunkSize`` ``min(512, chunkThreshold)``.
- ``Handlers/StateHandlerFactory.swift``: two states are both KV caches, handled by
  ``GrowingNDArrayState(initialCapacity: min(256, maxContextLength), maxCapacity:
  maxContextLength)``.
- ``Handlers/StateHandler+NDArray.swift``: the sequence dimension is the first dynamic one (else
  the second last); ``ensureCapacity`` doubles the capacity until the context fits (at most the
  maximum, beyond which it throws), makes new arrays it does not zero and copies into each the
  first ``old capacity x last dimension`` values of every block of the dimensions before the
  sequence one. Neither the first arrays nor grown ones are zeroed (only ``reset`` zeroes): a
  slot no call has written holds whatever memory held, which is NaN here, so a function that
  reads one shows it.

And the GPU's (``PipelinedEngine``), where it differs, from the same commit:

- ``InferenceEngines/KVCache+CoreAI.swift``: a dynamic sequence axis gets a ``GrowingKVCache``
  (``KVCacheFactory.make``, strategy ``.auto``) of 256 slots whatever ``maxContextLength``
  (``KVCacheStrategy.growing.defaultSize``), its sequence axis 3 for a 5-D cache
  (``detectSequenceDim``); it doubles by copying the old slots into a new buffer, bounded by the
  model's declared size only (none when dynamic).
- ``InferenceEngines/CoreAIPipelinedEngine.swift``: ``generate`` refuses a prompt that leaves no
  context, grows the caches once for ``processed + prompt + maxTokens`` (at most
  ``maxContextLength``), prefills (chunked as the sequential engine) and decodes one token per
  call; ``performWarmup(queryLength:)`` runs one call of token ids 1 at positions from 0 and then
  ``reset()``, which only sets the count back to 0: the caches keep what warmup wrote.
  ``reset(to:)`` with a smaller count rewinds the count alone (a prefix kept for the next turn).
- ``LanguageModel/ModelResources.swift``: ``loadEngine`` warms up with ``queryLength: 1``.

    engine = SequentialEngine(run, states, max_context=512)   # run(inputs, states) -> logits
    logits = engine.process(prompt_ids)          # one call, every row of the prompt
    logits = engine.process([next_id])           # a decode step
    engine = PipelinedEngine(run, states, max_context=512)
    engine.warmup()                              # as LanguageModelSession's loader does
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from adapterpack.errors import BadInput

# GrowingNDArrayState's first capacity (StateHandlerFactory.createSyncHandlers).
INITIAL_CAPACITY = 256
# ModelConfig.chunkThreshold's default and prefillChunkSize's bound.
CHUNK_THRESHOLD = 1024
PREFILL_CHUNK_LIMIT = 512
# GrowingKVCache's first capacity on the GPU engine (KVCacheStrategy.growing.defaultSize).
PIPELINED_INITIAL_CAPACITY = 256
# The token id performWarmup writes for every position of its call.
WARMUP_TOKEN = 1

Run = Callable[[dict[str, np.ndarray], dict[str, object]], np.ndarray]  # (inputs, states) -> logits


def check_signature(function: str, inputs, outputs, states) -> None:
    """The checks ``CoreAISequentialEngine.init`` makes of a function's signature (lists of
    (name, dtype, shape) as ``formats.aimodel.asset.feature_of`` gives them), as bad input."""
    if len(inputs) != 2:
        raise BadInput(f"function {function}: Apple's runtime expects 2 inputs (token ids, position ids), got {len(inputs)}")
    for name, dtype, shape in inputs:
        if dtype != "int32" or shape != "(1, ?)":
            raise BadInput(f"function {function}: input {name} is {dtype} {shape}; Apple's runtime sends Int32 (1, ?)")
    if not outputs or outputs[0][1] != "float16":
        found = outputs[0][1] if outputs else "no output"
        raise BadInput(f"function {function}: Apple's runtime reads float16 logits as the first output, got {found}")
    if not 2 <= len(states) <= 4:
        raise BadInput(f"function {function}: Apple's runtime expects 2 to 4 states (the KV caches first), got {len(states)}")


class SequentialEngine:
    """``CoreAISequentialEngine`` over one function: its KV caches (``GrowingNDArrayState``), the
    count of tokens processed, and ``process`` (``processTokenBatch``).

    ``states``: each state's name and declared shape (-1 where it is dynamic); ``make(array)``
    wraps a numpy array as the runtime's state array and ``read(state)`` reads one back."""

    def __init__(
        self,
        run: Run,
        states: dict[str, tuple[int, ...]],
        *,
        max_context: int,
        make: Callable[[np.ndarray], object] = lambda array: array,
        read: Callable[[object], np.ndarray] = np.asarray,
        initial_capacity: int = INITIAL_CAPACITY,
    ):
        self._run = run
        self._shapes = dict(states)
        self._make, self._read = make, read
        self.max_context = int(max_context)
        self.sequence_axis = self._sequence_axis(next(iter(self._shapes.values())))
        self.capacity = self._first_capacity(initial_capacity)
        self.processed = 0
        self.calls = 0
        self.grown = 0
        self._arrays = {name: self._make(self._fresh(shape, self.capacity)) for name, shape in self._shapes.items()}

    @staticmethod
    def _sequence_axis(shape: tuple[int, ...]) -> int:
        # StateHandler+NDArray: the first dynamic axis, else the second last
        dynamic = [axis for axis, size in enumerate(shape) if size < 0]
        return dynamic[0] if dynamic else max(0, len(shape) - 2)

    def _first_capacity(self, initial: int) -> int:
        return min(initial, self.max_context)  # StateHandlerFactory: min(256, maxContextLength)

    @staticmethod
    def _fresh(shape: tuple[int, ...], capacity: int) -> np.ndarray:
        # NDArray(descriptor:) leaves its memory as it was: NaN stands for that here.
        return np.full(tuple(capacity if size < 0 else size for size in shape), np.nan, np.float16)

    def ensure_capacity(self, context: int) -> None:
        """``GrowingNDArrayState.ensureCapacity(forContextLength:)``."""
        if context <= self.capacity:
            return
        if context > self.max_context:
            raise BadInput(f"context length {context} exceeds the maximum {self.max_context}")
        capacity = max(self.capacity, 1)
        while capacity < context:
            capacity = min(capacity * 2, self.max_context)
        axis = self.sequence_axis
        for name, shape in self._shapes.items():
            old = self._read(self._arrays[name])
            new = self._fresh(shape, capacity)
            # copyCache: per block of the dimensions before the sequence axis, the first
            # old-capacity x last-dimension values, flat (the sequence axis is second last).
            blocks = int(np.prod(old.shape[:axis], dtype=np.int64))
            count = old.shape[axis] * old.shape[-1]
            new.reshape(blocks, -1)[:, :count] = old.reshape(blocks, -1)[:, :count]
            self._arrays[name] = self._make(new)
        self.capacity = capacity
        self.grown += 1

    def process(self, tokens) -> np.ndarray:
        """One call with ``tokens`` (``processTokenBatch``): logits (q, vocab), float32."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.size == 0:
            raise ValueError("Cannot process empty token batch")
        self.ensure_capacity(self.processed + tokens.size)
        total = self.processed + tokens.size
        inputs = {"ids": tokens[None, :], "positions": np.arange(total, dtype=np.int32)[None, :]}
        logits = np.asarray(self._run(inputs, self._arrays))
        self.processed = total
        self.calls += 1
        return logits.reshape(tokens.size, -1).astype(np.float32)

    def prefill(self, tokens, chunk_threshold: int = CHUNK_THRESHOLD) -> np.ndarray:
        """A prompt as the engine sends it (``selectPrefillStrategy``): in one call, or in chunks
        of ``min(512, chunk_threshold)`` when longer than ``chunk_threshold``; every row's logits."""
        tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if tokens.size <= chunk_threshold:
            return self.process(tokens)
        size = min(PREFILL_CHUNK_LIMIT, chunk_threshold)
        return np.concatenate([self.process(tokens[start : start + size]) for start in range(0, tokens.size, size)])


class PipelinedEngine(SequentialEngine):
    """``CoreAIPipelinedEngine`` (the GPU's) over one function, where it differs from the
    sequential engine: 256-slot caches whatever the maximum context, grown once per ``generate``,
    a warmup call whose cache contents stay, and ``reset_to`` keeping a prefix. The GPU sampler's
    token is the caller's to pass (greedy: the argmax of the logits returned)."""

    def __init__(self, run: Run, states: dict[str, tuple[int, ...]], *, max_context: int, **options):
        options.setdefault("initial_capacity", PIPELINED_INITIAL_CAPACITY)
        super().__init__(run, states, max_context=max_context, **options)
        declared = next(iter(self._shapes.values()))[self.sequence_axis]
        self._bound = declared if declared > 0 else None

    @staticmethod
    def _sequence_axis(shape: tuple[int, ...]) -> int:
        return 3 if len(shape) == 5 else 2  # KVCacheFactory.detectSequenceDim

    def _first_capacity(self, initial: int) -> int:
        return initial  # GrowingKVCache(initialCapacity:): not bounded by maxContextLength

    def ensure_capacity(self, context: int) -> None:
        """``GrowingKVCache.encodePipelinedExpansion(forContextLength:)``: double until it fits,
        bounded by the declared size only; the old slots copied to the same places."""
        if context <= self.capacity:
            return
        capacity = self.capacity
        while capacity < context:
            capacity *= 2
        if self._bound is not None:
            capacity = min(capacity, self._bound)
        if capacity < context:
            raise BadInput(f"context length {context} exceeds the KV cache's {self._bound} slots")
        axis = self.sequence_axis
        for name, shape in self._shapes.items():
            old = self._read(self._arrays[name])
            new = self._fresh(shape, capacity)
            index = [slice(None)] * old.ndim
            index[axis] = slice(0, old.shape[axis])
            new[tuple(index)] = old
            self._arrays[name] = self._make(new)
        self.capacity = capacity
        self.grown += 1

    def warmup(self, query_length: int = 1) -> None:
        """``performWarmup(queryLength:)`` as ``ModelResources.loadEngine`` calls it: one call
        of ``WARMUP_TOKEN`` ids, then ``reset()`` (the count only)."""
        self.ensure_capacity(query_length)
        self.process(np.full(query_length, WARMUP_TOKEN, np.int32))
        self.processed = 0

    def reset_to(self, index: int) -> None:
        """``reset(to:)``: keep the first ``index`` tokens (0: a new conversation); the caches
        are left as they are either way."""
        if not 0 <= index <= self.processed:
            raise ValueError(f"reset(to: {index}) out of range [0, {self.processed}]")
        self.processed = index

    def generate(self, prompt, max_tokens: int) -> tuple[np.ndarray, list[int]]:
        """``generate`` with a greedy sampler: the prompt's logits (chunked as the sequential
        engine sends it) and then one call per new token, each sending the previous call's
        argmax. Returns (the logits of every call's rows, the tokens generated)."""
        prompt = np.asarray(prompt, dtype=np.int32).reshape(-1)
        left = self.max_context - self.processed - prompt.size
        if left < 1:
            raise BadInput(f"context length {self.processed + prompt.size} leaves no room in {self.max_context}")
        total = min(max_tokens, left)
        self.ensure_capacity(min(self.processed + prompt.size + total, self.max_context))
        if not prompt.size:
            raise ValueError("an empty prompt continues from the GPU sampler's last token, which this does not keep")
        rows = [self.prefill(prompt)]
        generated: list[int] = []
        while len(generated) < total:
            token = int(np.argmax(rows[-1][-1]))
            generated.append(token)
            if len(generated) == total:
                break
            rows.append(self.process([token]))
        return np.concatenate(rows), generated
