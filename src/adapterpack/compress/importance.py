"""How much each input channel of each linear layer matters, measured on calibration text.

A palette that minimizes a weight's squared error treats every weight alike, but an error in
``W[:, j]`` reaches the layer's output multiplied by the activation ``x_j``: the expected output
error is ``sum_j E[x_j^2] * |dW[:, j]|^2``. A trained checkpoint's activations are anything but
alike (a few channels carry the "massive activations", thousands of times the others), so
weighting each weight's squared error by the mean square of the activation it multiplies (what
coremltools' sensitive k-means does with gradients, and AWQ with activation scales) keeps the
weights that matter. On SmolLM2-135M at 4 bits this takes the perplexity ratio from 7.4x to 1.3x
at the same bytes (docs/compression.md).

Weights are named as the build meets them: module paths (``model.layers.0.mlp.down_proj``), the
checkpoint's tensor names (``...down_proj.weight``) or the traced program's constants
(``hf_model_layers_0_mlp_down_proj_weight``); all resolve to the module path.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # compensation loads torch, which reading the energies does not need
    from adapterpack.compress.compensation import GramFactor

# Every channel keeps this share of the mean energy: a channel the calibration text never
# excites still gets a palette entry's worth of attention (other text may excite it).
ENERGY_FLOOR = 1e-3
# What the input Gram matrices of error-compensated palettes (``compress.compensation``) may take
# in memory, float32, counted per layer: layers are compensated narrowest first while they fit,
# the rest keep nearest-entry palettes. SmolLM2-135M's all take 0.5 GiB; Llama-3.2-1B's but its
# MLP down projections 1.5 GiB (each of those alone would take 0.25), so one of those fits too.
GRAM_BUDGET_BYTES = 2 << 30
# Each Gram factored once for every weight and function that reads it (False: the compensation
# factors it again for each tensor it compensates, as builds did before; benchmarks/build_time.py
# --calibration-previous compares the two).
FACTOR_ONCE = True


def compensated_modules(in_features: dict[str, int], budget: int | None = None) -> frozenset[str]:
    """The linear layers (module path -> input width) whose Gram matrices fit ``budget`` bytes
    (``GRAM_BUDGET_BYTES``), narrowest first: the layers whose palettes are error-compensated."""
    budget = GRAM_BUDGET_BYTES if budget is None else budget
    chosen, used = [], 0
    for name in sorted(in_features, key=lambda name: (in_features[name], name)):
        size = 4 * in_features[name] ** 2
        if used + size > budget:
            break
        chosen.append(name)
        used += size
    return frozenset(chosen)


def _flat(name: str) -> str:
    return name.replace(".", "_").removesuffix("_weight")


class ChannelImportance:
    """Per linear layer (by module path): the mean square of each input channel's activation,
    and, when ``grams`` can measure them, its inputs' Gram matrices for error compensation.

        importance = ChannelImportance(energies)     # convert.calibration.channel_energies
        rows = importance.rows("hf_model_layers_0_mlp_down_proj_weight", grouped)
        importance = ChannelImportance(energies, grams=measure)   # measure(modules) -> {module: Gram}
        if importance.compensates(name, shape): factor = importance.factor(name)

    ``grams`` is called at most once, when the first Gram is needed (a build whose palettes are all
    cached never runs it), for every layer the budget admits; ``measured``: those Grams already
    measured (with the energies), so ``grams`` is never called. Each Gram is factored once
    (``compensation.GramFactor``) for every weight and function that reads it, and released then.
    """

    def __init__(
        self,
        energies: dict[str, np.ndarray],
        grams: Callable[[list[str]], dict[str, np.ndarray]] | None = None,
        gram_budget: int | None = None,
        measured: dict[str, np.ndarray] | None = None,
    ):
        self.energies = {name: np.asarray(value, dtype=np.float64) for name, value in sorted(energies.items())}
        self._by_flat = {_flat(name): name for name in self.energies}
        self._digests: dict[str, str] = {}
        self._measure_grams = grams
        self._grams: dict[str, np.ndarray] | None = None
        self._grams_lock = threading.Lock()
        # by the id of the Gram a factor was computed from (modules fed one input share one)
        self._site_of: dict[str, int] = {}
        self._factors: dict[int, GramFactor] = {}
        self._factor_locks: dict[int, threading.Lock] = {}
        self.compensated: frozenset[str] = frozenset()
        if grams is not None or measured is not None:
            self.compensated = compensated_modules({name: value.size for name, value in self.energies.items()}, gram_budget)
        if measured is not None:
            self._keep({module: gram for module, gram in measured.items() if module in self.compensated})

    def module_of(self, name: str) -> str | None:
        """The module path weight ``name`` belongs to (the longest whose flattened path ends
        ``name``'s at a word boundary), or None."""
        flat = _flat(name)
        best = None
        for candidate, module in self._by_flat.items():
            if (flat == candidate or flat.endswith("_" + candidate)) and (best is None or len(candidate) > len(best[0])):
                best = (candidate, module)
        return best[1] if best else None

    def channels(self, name: str, in_features: int) -> np.ndarray | None:
        """The importance of each of weight ``name``'s ``in_features`` input channels (energy
        plus the floor), or None when the layer was not measured or its width differs."""
        module = self.module_of(name)
        if module is None or self.energies[module].shape != (in_features,):
            return None
        energy = self.energies[module]
        return energy + ENERGY_FLOOR * max(float(energy.mean()), np.finfo(np.float64).tiny)

    def rows(self, name: str, shape: tuple[int, ...], flat: np.ndarray) -> np.ndarray | None:
        """Importance laid out like ``flat`` (the weight of ``shape`` as one row per channel
        group, ``palettes.grouped_rows``), or None (unweighted)."""
        if len(shape) != 2:
            return None
        channels = self.channels(name, shape[1])
        if channels is None:
            return None
        return np.broadcast_to(np.tile(channels, flat.shape[1] // shape[1]), flat.shape)

    def compensates(self, name: str, shape: tuple[int, ...] | None) -> bool:
        """Whether weight ``name`` of ``shape`` gets error-compensated palettes (its layer's Gram is
        within the budget and fits the weight)."""
        module = self.module_of(name)
        return (
            module in self.compensated
            and shape is not None
            and len(shape) == 2
            and self.energies[module].shape == (shape[1],)
        )

    def gram(self, name: str) -> np.ndarray | None:
        """The Gram matrix of weight ``name``'s layer's inputs (measured for every compensated
        layer on first use), or None when it is not compensated or was factored (``factor``)."""
        module = self.module_of(name)
        if module not in self.compensated:
            return None
        with self._grams_lock:
            if self._grams is None:
                self._keep(self._measure_grams(sorted(self.compensated)))
            return self._grams.get(module)

    def factor(self, name: str) -> GramFactor | np.ndarray | None:
        """What the compensation of weight ``name`` reads of its layer's Gram, or None when it is
        not compensated: computed once per measured Gram (q/k/v share one, as gate/up do, and
        every function's fused weights read the base's), whose matrix is released then."""
        module = self.module_of(name)
        if module not in self.compensated:
            return None
        if not FACTOR_ONCE:
            return self.gram(name)
        self.gram(name)  # measured, if not yet
        with self._grams_lock:
            site = self._site_of.get(module)
            if site is None:
                return None
            lock = self._factor_locks.setdefault(site, threading.Lock())
        with lock:
            if site not in self._factors:
                from adapterpack.compress.compensation import GramFactor

                with self._grams_lock:
                    gram = self._grams[module]
                self._factors[site] = GramFactor(gram)
                with self._grams_lock:
                    for shared in [m for m, s in self._site_of.items() if s == site]:
                        self._grams.pop(shared, None)
            return self._factors[site]

    def _keep(self, grams: dict[str, np.ndarray]) -> None:
        self._grams = dict(grams)
        self._site_of = {module: id(gram) for module, gram in grams.items()}

    def digest(self, name: str) -> str | None:
        """A short digest of the importance weight ``name`` is palettized with (palette cache keys)."""
        module = self.module_of(name)
        if module is None:
            return None
        if module not in self._digests:
            self._digests[module] = hashlib.sha256(self.energies[module].tobytes()).hexdigest()[:32]
        return self._digests[module]

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, **{name.replace(".", "/"): value for name, value in self.energies.items()})
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, grams: Callable[[list[str]], dict[str, np.ndarray]] | None = None) -> ChannelImportance:
        with np.load(io.BytesIO(data), allow_pickle=False) as stored:
            return cls({name.replace("/", "."): stored[name] for name in stored.files}, grams)
