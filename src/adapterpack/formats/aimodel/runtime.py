"""Running a Core AI asset: each entry point on Core AI's runtime, called as the clients of the
asset's contract call it (swift-transformers' mask and caches, or Apple's Swift engine emulated
call for call, ``engine``). What verify, generate and eval drive an ``.aimodel`` with
(``verification.runners``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from adapterpack.errors import BadInput
from adapterpack.formats.aimodel import asset as aimodel
from adapterpack.formats.aimodel.engine import PipelinedEngine, SequentialEngine, check_signature
from adapterpack.formats.format import Predict
from adapterpack.formats.metadata import METADATA_PREFIX
from adapterpack.quiet import native_output_captured


class _CoreAIRuntime:
    """One asset loaded on Core AI's runtime, driven synchronously: its API is async, so one event
    loop, in a thread of its own, serves every call, from any thread (two drives' calls overlap:
    the runtime computes in its own worker threads, and one call keeps about one core busy);
    the model is released when nothing refers to this any more."""

    def __init__(self, package: Path):
        import asyncio
        import threading

        from coreai.authoring.asset import AIModelAsset

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="coreai-calls", daemon=True).start()
        opened = AIModelAsset.load(package).executable()
        with native_output_captured():  # the runtime prints a line per model and function it loads
            self.model = self.run(opened.__aenter__())
        weakref.finalize(self, _close_asset, self.loop, opened)

    def load(self, function: str):
        with native_output_captured():
            return self.model.load_function(function)

    def run(self, call):
        import asyncio

        return asyncio.run_coroutine_threadsafe(call, self.loop).result()


def _close_asset(loop, opened) -> None:
    import asyncio

    asyncio.run_coroutine_threadsafe(opened.__aexit__(None, None, None), loop).result()
    loop.call_soon_threadsafe(loop.stop)


def open_asset(package: Path) -> tuple[Callable[[str], Callable[[], Predict]], str]:
    """(``open_function(name)`` -> ``new_session()`` -> ``predict(ids, mask)``, the asset's
    contract): the entry points of a Core AI asset on Core AI's runtime (the CPU off Apple
    devices), each session what ``makeState()`` gives a client of that contract."""
    summary = aimodel.asset_summary(package)  # BadInput without the [coreai] extra or for a broken asset
    runtime = _CoreAIRuntime(package)
    contract = aimodel.asset_contract(package)
    if contract == "apple":
        return _apple_sessions(package, summary, runtime), contract
    return _swift_transformers_sessions(summary, runtime), contract


def _swift_transformers_sessions(summary, runtime: _CoreAIRuntime) -> Callable[[str], Callable[[], Predict]]:
    """Entry points of an asset of swift-transformers' contract: the caller's mask is sent."""
    from coreai.runtime import NDArray

    shapes = {
        name: {state: aimodel.shape_of(signature) for state, signature in summary.function_states(name)}
        for name in summary.function_names
    }

    def open_function(function: str) -> Callable[[], Predict]:
        entry = runtime.load(function)

        def new_session() -> Predict:
            # What makeState() gives a client: every state zero.
            state = {name: NDArray(np.zeros(shape, np.float16)) for name, shape in shapes[function].items()}

            def predict(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
                inputs = {
                    "inputIds": NDArray(np.ascontiguousarray(ids, np.int32)),
                    "causalMask": NDArray(np.ascontiguousarray(mask, np.float16)),
                }
                return runtime.run(entry(inputs, state=state))["logits"].numpy()

            return predict

        return new_session

    return open_function


def _apple_sessions(package: Path, summary, runtime: _CoreAIRuntime) -> Callable[[str], Callable[[], Predict]]:
    """Entry points of an asset of Apple's contract, each session an emulated Swift engine
    (``engine``): it sends the position ids and grows the caches itself, as the
    runtime does, so the ``causalMask`` a caller passes is not sent (Apple's contract has none).
    By default the pipelined engine, warmed up as ``LanguageModelSession``'s loader does: the one
    ``EngineFactory`` picks for an asset of dynamic shapes (``autoDetectVariant``)."""
    from coreai.runtime import NDArray

    max_context = int(aimodel.asset_metadata(package).get(METADATA_PREFIX + "maxContext", "0") or 0)
    if max_context < 1:  # what the bundle's max_context_length tells the runtime
        raise BadInput(f"{package}: the asset's metadata has no maxContext")
    features = {}
    for name in summary.function_names:
        signature = [
            [aimodel.feature_of(*item) for item in listed(name)]
            for listed in (summary.function_inputs, summary.function_outputs, summary.function_states)
        ]
        check_signature(name, *signature)
        features[name] = signature

    def open_function(function: str) -> Callable[[], Predict]:
        entry = runtime.load(function)
        inputs, outputs, states = features[function]
        names = [name for name, _, _ in inputs]
        logits = outputs[0][0]

        def run(given: dict[str, np.ndarray], arrays: dict) -> np.ndarray:
            sent = {names[0]: NDArray(np.ascontiguousarray(given["ids"])), names[1]: NDArray(np.ascontiguousarray(given["positions"]))}
            return runtime.run(entry(sent, state=arrays))[logits].numpy()

        def new_session(engine: str = "pipelined", **options) -> Predict:
            """``engine``: "pipelined" (warmed up) or "sequential"; ``options``: the engine's
            (tests start the caches smaller to make them grow)."""
            shapes = {name: aimodel.dims_of(shape.replace("?", "-1")) for name, _, shape in states}
            kind = PipelinedEngine if engine == "pipelined" else SequentialEngine
            found = kind(run, shapes, max_context=max_context, make=NDArray, read=lambda a: a.numpy(), **options)
            if engine == "pipelined":
                found.warmup()

            def predict(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
                return found.process(ids)[None]

            predict.engine = found
            return predict

        return new_session

    return open_function
