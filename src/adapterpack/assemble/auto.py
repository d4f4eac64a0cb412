"""``compression.auto``: the fewest bytes that keep each function's behaviour on its own text.

Every function whose compression has ``auto`` starts at its palettization (say 4 bits, groups of
16) and is measured on its calibration text against itself uncompressed: its perplexity ratio,
and for an adapter its retention (the cosine between its change of the logits from the base and
the uncompressed adapter's; a kept adapter counts as its low-rank change, exact, on the compressed
base). While some function misses its targets, the layers holding most of
the remaining error move one step up a ladder of settings, fewest bytes first:

    start (4-bit /16)  ->  smaller groups (4-bit /4)  ->  8-bit  ->  float16

A layer's error is what its compression adds to its output on the calibration text,
``sum_j E[x_j^2] |dW[:, j]|^2`` (the activation statistics data-aware palettes weigh by,
``assemble.calibration``): each round moves the largest errors, together a quarter of the
remaining error of the candidates and at least twice as many layers as the round before, then
measures again; once every function meets its targets, the last round's moves are bisected
down to the fewest (largest errors first) that still do. Candidates are the layers shared by
the functions that start alike (a shared base weight moves for all of them, so it stays stored
once) and the layers a failing adapter changes (its own tensors, which cost only it).

An adapter's retention is measured twice, and the lower one counts: on its calibration text,
and on the seeded token ids ``verify`` checks every function on (``verification.drives``), so that a
choice that keeps a skill on its own text does not fail the package's verification (palettes
compensated on that text fit it, not the rest of the inputs). And every function is also judged
as verify's quality verdict judges it: on the real-text tokens verify scores
(``verification.texts``: the start of its calibration text as an app sends it, at most
``max_context - 1`` tokens), by verify's thresholds, next-token agreement included. A choice that
holds on the whole text can miss there: Gemma 3 270M's ``haiku`` met 1.05 on its 459 tokens and
measured 1.241 on the 47 that ``max_context: 48`` leaves verify.

Everything is computed in float32 from the float16 weights the package stores, with the very
palettes the build then writes (the palette store and its cache are shared), so what is measured
is what is built; the search is deterministic and its result is kept in the build cache.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from adapterpack.assemble.calibration import CALIBRATION_VERSION, calibration_ids, calibration_key, channel_importance
from adapterpack.assemble.records import content_key
from adapterpack.config.compression import SETTING_FIELDS, Compression
from adapterpack.errors import BadInput
from adapterpack.inputs.checked import CheckedInputs

log = logging.getLogger(__name__)

# Bump when the search changes, so choices cached by an older version are made again.
# 5: judged on verify's real text by verify's thresholds, against verify's references, too.
AUTO_VERSION = 5
# Tokens of each function's calibration text it is measured on (a bound on the search's time).
AUTO_TOKENS = 1024
# Share of the candidates' remaining error moved up a step per round.
MOVE_SHARE = 0.25
# Rounds at most: the ladder has four steps, so every layer could climb it in far fewer.
MAX_ROUNDS = 64
RESULT_FILE = "auto.json"


class _Figures(NamedTuple):
    """What one measurement of a function found (retentions None for the base)."""

    perplexity_ratio: float  # on its calibration text
    retention: float | None  # on its calibration text
    seeded_retention: float | None  # on verify's seeded token ids
    # on verify's real text: {"perplexity_ratio", "agreement", "retention"}; None without one
    on_verify_text: dict[str, float | None] | None = None


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose for one function, and what it measured there."""

    function: str
    compression: Compression  # the start with its per-layer exceptions
    perplexity_ratio: float
    retention: float | None  # adapters only: on the calibration text
    met: bool
    tokens: int
    seeded_retention: float | None = None  # adapters only: on verify's seeded token ids
    # on the real text verify scores: perplexity ratio, agreement, retention (None: no such text)
    on_verify_text: dict[str, float | None] | None = None

    def as_metadata(self) -> dict[str, object]:
        targets = self.compression.auto
        return {
            "perplexity_ratio": round(self.perplexity_ratio, 5),
            "retention": None if self.retention is None else round(self.retention, 5),
            "seeded_retention": None if self.seeded_retention is None else round(self.seeded_retention, 5),
            "on_verify_text": None if self.on_verify_text is None else {
                key: None if value is None else round(value, 5) for key, value in self.on_verify_text.items()
            },
            "max_perplexity_ratio": float(targets.max_perplexity_ratio),
            "min_retention": float(targets.min_retention),
            "met": self.met,
            "tokens": self.tokens,
            "exceptions": len(self.compression.layers),
        }


def ladder(start: Compression) -> list[Compression | None]:
    """The settings a layer moves through, fewest bytes first (None: float16)."""
    plain = start.model_copy(update={"layers": (), "auto": None, "keep_float16": ()})
    steps: list[Compression | None] = [plain]
    if plain.granularity == "per_grouped_channel" and plain.group_size > 4:
        steps.append(plain.model_copy(update={"group_size": 4}))
    if plain.nbits < 8:
        steps.append(plain.model_copy(update={"nbits": 8}))
    steps.append(None)
    return steps


def _exception(setting: Compression | None) -> dict:
    """A ladder step as a manifest's per-layer exception (the settings it changes)."""
    if setting is None:
        return {"method": "none"}
    return {key: getattr(setting, key) for key in SETTING_FIELDS if getattr(setting, key) is not None}


@dataclass
class _Function:
    """One function under ``auto``: its text, its start, its own layers, its references."""

    name: str
    start: Compression
    ids: list[int]
    private: set[str] = field(default_factory=set)  # layers its fused adapter changes (its own tensors)
    # a kept adapter: its exact low-rank change per layer (float32), added to the compressed base
    deltas: dict[str, object] = field(default_factory=dict)
    reference_nll: float = 0.0
    base_logits: np.ndarray | None = None  # float16, adapters only
    effect: np.ndarray | None = None  # uncompressed adapter's logits minus the base's
    seeded_ids: list[int] = field(default_factory=list)  # verify's token ids
    seeded_base_logits: np.ndarray | None = None  # as base_logits and effect, on seeded_ids
    seeded_effect: np.ndarray | None = None
    # the real text verify's quality verdict scores, verify's references there (the function's,
    # and the base's for an adapter), and verify's thresholds for the function
    verify_ids: list[int] = field(default_factory=list)
    verify_reference: np.ndarray | None = None
    verify_base: np.ndarray | None = None
    thresholds: dict[str, float] = field(default_factory=dict)


def auto_functions(checked: CheckedInputs) -> list[str]:
    return [name for name in checked.manifest.function_names if checked.manifest.compression_for(name).auto is not None]


def check_auto_inputs(checked: CheckedInputs) -> None:
    """Every function under ``auto`` needs its own calibration text (BadInput naming the manifest)."""
    for name in auto_functions(checked):
        if name not in checked.calibration:
            field_name = "base.calibration" if checked.manifest.adapter(name) is None else f"adapter '{name}' calibration"
            raise BadInput(
                f"{checked.manifest.source}: compression auto measures function '{name}' on its own text: "
                f"name one with {field_name} (a UTF-8 text file)"
            )


def auto_key(checked: CheckedInputs) -> str:
    manifest = checked.manifest
    return content_key(
        {
            "auto": AUTO_VERSION,
            "calibration": [calibration_key(checked), CALIBRATION_VERSION],
            "functions": {
                name: {
                    "compression": manifest.compression_for(name).model_dump(mode="json"),
                    "adapter": checked.adapters[name].content_hash if name in checked.adapters else None,
                    "scale": float(manifest.adapter(name).scale) if manifest.adapter(name) is not None else None,
                    "lora": manifest.lora_mode(name) if manifest.adapter(name) is not None else None,
                }
                for name in auto_functions(checked)
            },
        }
    )


def resolve_auto(checked: CheckedInputs, reporter, palettes_files, cache=None) -> tuple[CheckedInputs, dict[str, AutoChoice]]:
    """``checked`` with every ``auto`` function's compression chosen (its per-layer exceptions
    written into the manifest), and the choices; unchanged when no function uses ``auto``."""
    names = auto_functions(checked)
    if not names:
        return checked, {}
    check_auto_inputs(checked)
    key = auto_key(checked)
    stored = cache.read_file("calibration", key, RESULT_FILE) if cache is not None else None
    choices = _from_json(stored, checked) if stored is not None else None
    if choices is None:
        from adapterpack.compress.palettes import PaletteStore

        importance = channel_importance(checked, reporter, cache)
        search = _Search(checked, names, PaletteStore(palettes_files, importance), reporter)
        choices = search.run()
        if cache is not None:
            payload = json.dumps({name: _to_json(choice) for name, choice in choices.items()}, sort_keys=True).encode()
            cache.write("calibration", key, {RESULT_FILE: payload}, {"base": checked.base.content_hash})
    for choice in choices.values():
        if not choice.met:
            reporter.info(
                f"auto: {choice.function} misses its targets even with every layer float16 "
                f"(perplexity ratio {choice.perplexity_ratio:.3f}, retention {choice.retention}, "
                f"on verify's token ids {choice.seeded_retention}, on verify's real text {choice.on_verify_text})"
            )
    return _with_choices(checked, choices), choices


def _with_choices(checked: CheckedInputs, choices: dict[str, AutoChoice]) -> CheckedInputs:
    """The manifest with each chosen compression in place: per adapter as its override; the
    base function's (the manifest-wide block) only when the base is under ``auto``."""
    from dataclasses import replace

    manifest = checked.manifest
    adapters = []
    for adapter in manifest.adapters:
        choice = choices.get(adapter.name)
        if choice is not None:
            adapter = adapter.model_copy(update={"compression": choice.compression.model_dump(mode="json")})
        adapters.append(adapter)
    update: dict = {"adapters": tuple(adapters)}
    if manifest.include_base in choices:
        update["compression"] = choices[manifest.include_base].compression
    figures = {name: choice.as_metadata() for name, choice in choices.items()}
    return replace(checked, manifest=manifest.model_copy(update=update), auto_figures=figures)


def _to_json(choice: AutoChoice) -> dict:
    return {
        "compression": choice.compression.model_dump(mode="json"),
        "perplexity_ratio": choice.perplexity_ratio,
        "retention": choice.retention,
        "seeded_retention": choice.seeded_retention,
        "on_verify_text": choice.on_verify_text,
        "met": choice.met,
        "tokens": choice.tokens,
    }


def _from_json(data: bytes, checked: CheckedInputs) -> dict[str, AutoChoice] | None:
    try:
        stored = json.loads(data)
        return {
            name: AutoChoice(
                name, Compression.model_validate(value["compression"]), float(value["perplexity_ratio"]),
                None if value["retention"] is None else float(value["retention"]), bool(value["met"]), int(value["tokens"]),
                None if value["seeded_retention"] is None else float(value["seeded_retention"]),
                value["on_verify_text"],
            )
            for name, value in stored.items()
        }
    except (ValueError, KeyError, TypeError):
        log.info("build cache: a stored auto choice cannot be read: searched again")
        return None


class _Search:
    """The search itself: layers' steps, their errors, and the functions measured."""

    def __init__(self, checked: CheckedInputs, names: list[str], palettes, reporter):
        self.checked, self.names, self.palettes, self.reporter = checked, names, palettes, reporter
        self.manifest = checked.manifest
        self.importance = palettes.importance
        self.steps: dict[tuple[str, str], int] = {}  # (owner, layer) -> ladder step
        self.errors: dict[tuple[str, str], float] = {}
        self.dense: dict[tuple[str, str, int], object] = {}  # (owner, layer, step) -> float16 weight
        self.ladders: dict[str, list[Compression | None]] = {}  # by function
        self.eligible: dict[str, set[str]] = {}  # by function: the layers its start compresses
        # (function, layer) -> the setting one of the function's own per-layer exceptions gives
        # it (a manifest's, or a large vocabulary's 8 bits): measured so, never moved
        self.fixed: dict[tuple[str, str], Compression] = {}
        # layer -> the name the package stores its weight under: a tied output head is stored
        # once, as the embedding, and compressed (and excepted) by that name
        self.stored_as: dict[str, str] = {}
        self.base_weights: dict[str, object] = {}  # layer -> the base's float16 weight
        self.fused: dict[str, dict[str, object]] = {}  # function -> layer -> its fused float16 weight
        self.before: dict[tuple[str, str], int] = {}  # steps of the last round's moves before it

    # -- owners: a group of functions that start alike shares its base layers -------------------

    def _group(self, function: _Function) -> str:
        return "shared " + function.start.model_dump_json()

    def _owner(self, function: _Function, layer: str) -> str:
        return f"function {function.name}" if layer in function.private else self._group(function)

    def run(self) -> dict[str, AutoChoice]:

        from adapterpack.convert.base_model import load_base

        ids = calibration_ids(self.checked)
        with self.reporter.stage(f"auto: load the base and measure {len(self.names)} function(s) uncompressed"):
            base = load_base(self.checked.base.folder, dtype="float16")
            self.base_weights = {name: module.weight.detach().clone() for name, module in self._layers(base).items()}
            self.stored_as = _stored_names(base)
            seeded = self._seeded_ids(base)
            verify_text = self._verify_text()
            functions = [self._prepare(base, name, ids[name][:AUTO_TOKENS], seeded, verify_text) for name in self.names]
        figures: dict[str, _Figures] = {}
        moved: list[tuple[str, str]] = []
        for round_number in range(1, MAX_ROUNDS + 1):
            # only the functions a move reaches are measured again (all of them at first)
            touched = self._touched(functions, moved) if figures else functions
            with self.reporter.stage(f"auto: round {round_number}, measure {len(touched)} function(s)"):
                figures = {**figures, **self._measured(base, touched)}
            failing = [f for f in functions if not self._meets(f, figures[f.name])]
            log.debug("auto round %d: %s", round_number, figures)
            if not failing:
                if len(moved) > 1:
                    with self.reporter.stage(f"auto: keep the fewest of the last round's {len(moved)} moves"):
                        figures = self._trimmed(base, functions, moved, figures)
                break
            moved = self._move(failing)
            if not moved:
                break
        return {f.name: self._choice(f, figures[f.name]) for f in functions}

    def _measured(self, base, functions: list[_Function]) -> dict[str, _Figures]:
        import torch

        self._compress_pending(functions)
        with torch.no_grad():
            return {f.name: self._measure(base, f) for f in functions}

    def _touched(self, functions: list[_Function], moved: list[tuple[str, str]]) -> list[_Function]:
        """The functions whose stored weights ``moved`` changes: a function's own layers reach
        only it; a shared layer reaches every function of its group that does not hold its own
        fused weight there."""
        return [f for f in functions if any(owner == self._owner(f, layer) for owner, layer in moved)]

    def _trimmed(self, base, functions: list[_Function], moved: list[tuple[str, str]], figures):
        """Undo the last round's smallest moves while every function still meets its targets:
        the fewest of them (largest errors first) that do, found by bisection; their figures."""

        def keep(count: int) -> None:
            for index, key in enumerate(moved):
                self.steps[key] = self.before[key] + (1 if index < count else 0)
                self.errors.pop(key, None)

        best = len(moved)  # the whole round meets the targets, with ``figures``
        touched = self._touched(functions, moved)
        low, high = 1, len(moved) - 1
        while low <= high:
            middle = (low + high) // 2
            keep(middle)
            trial = {**figures, **self._measured(base, touched)}
            if all(self._meets(f, trial[f.name]) for f in functions):
                best, figures, high = middle, trial, middle - 1
            else:
                low = middle + 1
        keep(best)
        return figures

    def _meets(self, function: _Function, figures: _Figures) -> bool:
        targets = function.start.auto
        retentions = [kept for kept in (figures.retention, figures.seeded_retention) if kept is not None]
        if figures.perplexity_ratio > float(targets.max_perplexity_ratio) or any(
            kept < float(targets.min_retention) for kept in retentions
        ):
            return False
        found, limits = figures.on_verify_text, function.thresholds
        return found is None or (
            found["perplexity_ratio"] <= limits["perplexity_ratio"]
            and found["agreement"] >= limits["agreement"]
            and (found["retention"] is None or found["retention"] >= limits["retention"])
        )

    def _choice(self, function: _Function, figures: _Figures) -> AutoChoice:
        steps = self.ladders[function.name]
        start = function.start.model_dump(mode="json")
        exceptions = {pattern: setting for pattern, setting in start["layers"]}  # the function's own first
        for layer in sorted(self.eligible[function.name]):
            step = self._step(function, layer)
            if step:
                exceptions[self.stored_as.get(layer, layer)] = _exception(steps[step])
        compression = Compression.model_validate({**start, "layers": exceptions})
        return AutoChoice(
            function.name, compression, figures.perplexity_ratio, figures.retention, self._meets(function, figures),
            len(function.ids), figures.seeded_retention, figures.on_verify_text,
        )

    # -- the functions ------------------------------------------------------------------------

    def _layers(self, model) -> dict[str, object]:
        from torch import nn

        return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}

    def _applied(self, base, name: str):
        import contextlib

        from adapterpack.convert.base_model import stored_weight_reader
        from adapterpack.convert.lora import applied_adapter

        adapter = self.manifest.adapter(name)
        if adapter is None:
            return contextlib.nullcontext(base)
        # A kept adapter is fused here too: its change is taken from the difference (see _prepare).
        folder = self.checked.adapters[name].folder
        return applied_adapter(base, folder, mode="fuse", scale=float(adapter.scale), original_weight=stored_weight_reader(self.checked.base))

    def _seeded_ids(self, base) -> list[int]:
        """The token ids verify checks every function on, as its reference reads them."""
        from adapterpack.verification.drives import verification_tokens

        tokens = verification_tokens(int(base.config.vocab_size), self.manifest.verify)
        return [int(token) for token in tokens[: self.manifest.export.max_context - 1]]

    def _verify_text(self) -> dict[str, tuple[list[int], np.ndarray, np.ndarray | None]]:
        """By function: the real-text token ids verify's quality verdict scores it on, and verify's
        own references there (``verification.reference``: the base at its stored precision,
        which its float16 copy is not exactly), the function's and the base's (None
        for the base function); none when the base has no tokenizer."""
        from adapterpack.verification.reference import reference_logits
        from adapterpack.verification.texts import verify_tokens

        tokens = verify_tokens(self.checked, list(self.manifest.function_names))
        if not tokens.text:
            return {}
        references = reference_logits(self.checked, self.names, tokens)
        return {
            name: (
                [int(token) for token in tokens.text[name]],
                references.text[name],
                references.base_text[name] if self.manifest.adapter(name) is not None else None,
            )
            for name in self.names
        }

    def _prepare(self, base, name: str, ids: list[int], seeded_ids: list[int], verify_text: dict) -> _Function:
        import torch

        from adapterpack.config.compression import exception_pattern, weight_setting
        from adapterpack.verification.reference import computed_in_float32

        if len(ids) < 2:
            raise BadInput(f"{self.checked.calibration[name].path}: a calibration text needs at least 2 tokens")
        start = self.manifest.compression_for(name)
        function = _Function(name, start, ids, seeded_ids=seeded_ids)
        if name in verify_text:
            function.verify_ids, function.verify_reference, function.verify_base = verify_text[name]
        function.thresholds = self.manifest.verify.thresholds_for(start)
        self.ladders[name] = ladder(start)
        with torch.no_grad(), computed_in_float32(base):
            is_adapter = self.manifest.adapter(name) is not None
            base_logits = self._logits(base, ids) if is_adapter else None
            seeded_base_logits = self._seeded_logits(base, seeded_ids) if is_adapter else None
            with self._applied(base, name) as model:
                layers = self._layers(model)
                self.eligible[name] = set()
                for layer, module in layers.items():
                    stored, shape = self.stored_as.get(layer, layer), tuple(module.weight.shape)
                    setting = weight_setting(stored, shape, start)
                    if setting is None:
                        continue
                    self.eligible[name].add(layer)
                    if exception_pattern(stored, shape, start) is not None:
                        self.fixed[(name, layer)] = setting
                changed = {
                    layer for layer in self.eligible[name] if not torch.equal(layers[layer].weight, self.base_weights[layer])
                }
                if self.manifest.adapter(name) is not None and self.manifest.lora_mode(name) == "keep":
                    # the package keeps the base's weights (shared) and the LoRA matrices in float16
                    function.deltas = {layer: layers[layer].weight.float() - self.base_weights[layer].float() for layer in changed}
                else:
                    function.private = changed
                    self.fused[name] = {layer: layers[layer].weight.detach().clone() for layer in changed}
                logits = self._logits(model, ids)
                seeded_logits = self._seeded_logits(model, seeded_ids) if is_adapter else None
        function.reference_nll = _nll(logits, ids)
        if is_adapter:
            function.base_logits = base_logits.astype(np.float16)
            function.effect = (logits - base_logits).astype(np.float16)
            function.seeded_base_logits = seeded_base_logits.astype(np.float16)
            function.seeded_effect = (seeded_logits - seeded_base_logits).astype(np.float16)
        return function

    def _seeded_logits(self, model, ids: list[int]) -> np.ndarray:
        """Logits of every position of verify's token ids (seeded or real text), in one call as
        verify's reference."""
        import torch

        return model(torch.tensor([ids])).logits[0].float().numpy()

    def _logits(self, model, ids: list[int]) -> np.ndarray:
        """Logits of every position but the last, window by window (float32)."""
        import torch

        from adapterpack.assemble.calibration import calibration_window

        window = calibration_window(self.checked)
        rows = []
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : min(start + window + 1, len(ids))]
            rows.append(model(torch.tensor([chunk[:-1]])).logits[0].float().numpy())
        return np.concatenate(rows)

    def _measure(self, base, function: _Function) -> _Figures:
        """(perplexity ratio, retention on the text and on verify's token ids) of ``function``
        with every layer at its current step."""
        from adapterpack.verification.reference import computed_in_float32

        with self._applied(base, function.name) as model, computed_in_float32(model):
            layers = self._layers(model)
            kept = {}
            try:
                for layer in self.eligible[function.name]:
                    weight = layers[layer].weight
                    kept[layer] = weight.data
                    stored = self._weight(function, layer)
                    weight.data = stored.float() + function.deltas[layer] if layer in function.deltas else stored
                logits = self._logits(model, function.ids)
                seeded = self._seeded_logits(model, function.seeded_ids) if function.effect is not None else None
                on_text = self._seeded_logits(model, function.verify_ids) if function.verify_reference is not None else None
            finally:
                for layer, data in kept.items():
                    layers[layer].weight.data = data
        ratio = math.exp(_nll(logits, function.ids) - function.reference_nll)
        on_verify_text = None if on_text is None else _verify_figures(function, on_text)
        if function.effect is None:
            return _Figures(ratio, None, None, on_verify_text)
        return _Figures(
            ratio,
            _retention(logits, function.base_logits, function.effect),
            _retention(seeded, function.seeded_base_logits, function.seeded_effect),
            on_verify_text,
        )

    # -- layers: their steps, weights and errors ----------------------------------------------

    def _step(self, function: _Function, layer: str) -> int:
        return self.steps.get((self._owner(function, layer), layer), 0)

    def _source(self, function: _Function, layer: str):
        return self.fused[function.name][layer] if layer in function.private else self.base_weights[layer]

    def _weight(self, function: _Function, layer: str):
        """The layer's float16 weight as the package stores it at its current step."""
        self._fill([(function, layer)])
        return self.dense[(self._owner(function, layer), layer, self._step(function, layer))]

    def _compressed_together(self, wanted: list[tuple[str, object, Compression | None]]) -> list[object]:
        """Each (layer, weight, setting) as the package stores it, float16; the palettized ones
        clustered in one batch (a Lloyd step costs about as much for one small tensor as for many)."""
        import torch

        from adapterpack.compress.palettes import grouped_rows

        values = [weight.detach().to(torch.float16).numpy() for _, weight, _ in wanted]
        made: list[object] = [torch.from_numpy(value) for value in values]
        clustered = [i for i, (_, _, setting) in enumerate(wanted) if setting is not None]
        found = (
            self.palettes.tensor_palettes(
                [grouped_rows(values[i], wanted[i][2]) for i in clustered],
                [wanted[i][2].nbits for i in clustered],
                [self.stored_as.get(wanted[i][0], wanted[i][0]) for i in clustered],
                [values[i].shape for i in clustered],
            )
            if clustered
            else []
        )
        for i, (luts, indices) in zip(clustered, found):
            dense = np.take_along_axis(luts.astype(np.float16), indices.astype(np.int64), axis=1)
            made[i] = torch.from_numpy(np.ascontiguousarray(dense.reshape(values[i].shape)))
        return made

    def _compress_pending(self, functions: list[_Function]) -> None:
        """Every weight ``functions`` read at their current steps, compressed now, together."""
        self._fill([(function, layer) for function in functions for layer in sorted(self.eligible[function.name])])

    def _fill(self, needed: list[tuple[_Function, str]]) -> None:
        """The stored weight of each (function, layer) at its current step, compressed in one
        batch where not yet known; a layer's previous step is dropped (memory: one step each)."""
        wanted: dict[tuple[str, str, int], tuple[str, object, Compression | None]] = {}
        for function, layer in needed:
            owner, step = self._owner(function, layer), self._step(function, layer)
            if (owner, layer, step) not in self.dense:
                wanted[(owner, layer, step)] = (layer, self._source(function, layer), self._setting(function, layer, step))
        for (owner, layer, step), dense in zip(wanted, self._compressed_together(list(wanted.values()))):
            self.dense[(owner, layer, step)] = dense
            self.dense.pop((owner, layer, step - 1), None)

    def _setting(self, function: _Function, layer: str, step: int) -> Compression | None:
        fixed = self.fixed.get((function.name, layer))
        return fixed if fixed is not None else self.ladders[function.name][step]

    def _can_move(self, function: _Function, layer: str) -> bool:
        return (function.name, layer) not in self.fixed and self._step(function, layer) + 1 < len(self.ladders[function.name])

    def _error(self, function: _Function, layer: str) -> float:
        """What the layer's compression adds to its output: sum_j E[x_j^2] |dW[:, j]|^2."""
        import torch

        key = (self._owner(function, layer), layer)
        if key not in self.errors:
            source = self._source(function, layer).detach().to(torch.float16).to(torch.float64)
            difference = self._weight(function, layer).to(torch.float64) - source
            energy = self.importance.energies.get(layer) if self.importance is not None else None
            column = (difference * difference).sum(dim=0).numpy()
            self.errors[key] = float(column @ energy) if energy is not None and energy.shape == column.shape else float(column.sum())
        return self.errors[key]

    def _move(self, failing: list[_Function]) -> list[tuple[str, str]]:
        """Move the candidates holding the largest errors up a step; the (owner, layer) moved,
        largest error first (none when every candidate is float16 already)."""
        candidates: dict[tuple[str, str], tuple[float, _Function]] = {}
        groups = {self._group(f) for f in failing}
        for function in failing:
            for layer in self.eligible[function.name]:
                owner = self._owner(function, layer)
                if owner.startswith("shared") and owner not in groups:
                    continue
                if self._can_move(function, layer):
                    candidates[(owner, layer)] = (self._error(function, layer), function)
        ranked = sorted(candidates.items(), key=lambda item: (-item[1][0], item[0]))
        total = sum(error for error, _ in candidates.values())
        moved: list[tuple[str, str]] = []
        share = 0.0
        # at least twice as many as last round: a long tail of similar errors is crossed in a
        # few rounds, and the last round's excess is bisected away (_trimmed)
        at_least = 2 * len(self.before)
        for key, (error, _function) in ranked:
            if len(moved) >= at_least and share >= MOVE_SHARE * total:
                break
            moved.append(key)
            share += error
        self.before = {key: self.steps.get(key, 0) for key in moved}
        for key in moved:
            self.steps[key] = self.before[key] + 1
            self.errors.pop(key, None)
        log.debug("auto: moved %d layer(s) up a step", len(moved))
        return moved


def _stored_names(model) -> dict[str, str]:
    """{linear layer: the module the package stores its weight under} for layers whose weight
    is another module's (a tied output head: the embedding's)."""
    from torch import nn

    owners: dict[int, str] = {}
    found = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter):
            continue
        if id(weight) in owners and isinstance(module, nn.Linear):
            found[name] = owners[id(weight)]
        owners.setdefault(id(weight), name)
    return found


def _verify_figures(function: _Function, logits: np.ndarray) -> dict[str, float | None]:
    """Verify's quality figures of ``logits`` on the function's real text, as verify computes
    them (``verification.package``): against its uncompressed logits there."""
    from adapterpack.verification.metrics import compare_logits, perplexity_ratio, retention

    reference = function.verify_reference
    return {
        "perplexity_ratio": perplexity_ratio(logits, reference, np.asarray(function.verify_ids)),
        "agreement": compare_logits(logits, reference)["top1"],
        "retention": None if function.verify_base is None else retention(logits, reference, function.verify_base)[0],
    }


def _retention(logits: np.ndarray, base_logits: np.ndarray, effect: np.ndarray) -> float:
    """The cosine between the change of ``logits`` from the base's and the adapter's own change."""
    from adapterpack.verification.metrics import retention_of_sums

    sums = np.zeros(3)
    for rows in _row_chunks(len(logits)):
        change = logits[rows].astype(np.float32) - base_logits[rows].astype(np.float32)
        own = effect[rows].astype(np.float32)
        sums += [(change * own).sum(dtype=np.float64), (change * change).sum(dtype=np.float64), (own * own).sum(dtype=np.float64)]
    return retention_of_sums(*(float(value) for value in sums))


def _nll(logits: np.ndarray, ids: list[int]) -> float:
    """Mean negative log-likelihood of ``ids[1:]`` under ``logits`` (one row per position)."""
    targets = np.asarray(ids[1 : len(logits) + 1])
    total = 0.0
    for rows in _row_chunks(len(targets)):
        # float32 exponentials, float64 sums: a 262k vocabulary's rows widened whole to float64
        # were most of a measurement's time, for an error far below the ratios' last digit
        chunk = logits[rows].astype(np.float32, copy=False)
        top = chunk.max(axis=1)
        log_norm = np.log(np.exp(chunk - top[:, None]).sum(axis=1, dtype=np.float64)) + top
        total += float((log_norm - chunk[np.arange(len(chunk)), targets[rows]]).sum())
    return total / len(targets)


def _row_chunks(count: int, rows: int = 64) -> list[slice]:
    """Slices of ``rows`` rows over ``count``: a chunk of a large vocabulary's logits at a time."""
    return [slice(start, min(start + rows, count)) for start in range(0, count, rows)]
