"""How weights are compressed: the manifest's ``compression`` block (``Compression``), and which
setting each weight gets: the one rule both compressors (Core ML's through
coremltools, Core AI's in torch) and the memory estimate follow, and how ``keep_float16``
patterns match a weight's name.

"No compression" has one form: ``weight_setting`` returns None (a manifest's ``method: none``
comes out so too).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from typing import Any, Literal

from pydantic import Field, StrictFloat, StrictInt, StrictStr, model_validator

from adapterpack.config.strict import Strict

log = logging.getLogger(__name__)


PALETTIZE_NBITS = (1, 2, 3, 4, 6, 8)
LINEAR_NBITS = (4, 8)
# An unset palettization group_size: one palette per 16 output channels. At 4 bits or fewer in a
# manifest without calibration text, one per output channel instead: chosen when such palettes
# had no activation statistics to weigh by (SmolLM2-135M at 4 bits: 5.2x perplexity in groups of
# 16, 1.29x per channel for 4% more bytes), and measured on Gemma 3 270M since they are weighted
# by text the base writes (assemble.calibration; docs/compression.md).
DEFAULT_GROUP_SIZE = 16
DATA_FREE_GROUP_SIZE = 1
DATA_FREE_GROUP_SIZE_MAX_NBITS = 4
# With calibration text, linear integers at this many bits or fewer are error-compensated
# (compress.quantize): int8 per channel keeps SmolLM2-135M within 1.008x of float already, int4
# in blocks of 32 loses 1.33x without compensation and 1.12x with it (docs/compression.md).
COMPENSATED_LINEAR_MAX_NBITS = 4


# The fields that say how a weight is compressed (what a per-layer exception may change).
SETTING_FIELDS = ("method", "nbits", "granularity", "group_size", "block_size", "sparsity")


class AutoTargets(Strict):
    """What ``compression.auto`` must keep, measured on each function's calibration text."""

    max_perplexity_ratio: StrictFloat | StrictInt = Field(
        default=1.05, ge=1.0, description="Largest perplexity of the compressed function over its float reference's"
    )
    min_retention: StrictFloat | StrictInt = Field(
        default=0.9, ge=0.0, le=1.0, description="Smallest share of the adapter's effect on the logits that survives"
    )


class Compression(Strict):
    """How one function's weights are compressed; unset fields take the method's defaults."""

    method: Literal["palettize", "linear", "prune", "none"] = "palettize"
    nbits: StrictInt | None = None
    granularity: Literal["per_tensor", "per_channel", "per_grouped_channel", "per_block"] | None = None
    group_size: StrictInt | None = Field(
        default=None,
        ge=1,
        description="Output channels per palette (per_grouped_channel); default 16, or 1 at 4 bits or fewer when "
        "the manifest names no calibration text",
    )
    block_size: StrictInt | None = Field(default=None, ge=1)
    sparsity: StrictFloat | None = Field(default=None, gt=0.0, lt=1.0)
    keep_float16: tuple[StrictStr, ...] = ("embed_tokens", "lm_head")
    layers: tuple[tuple[StrictStr, Compression], ...] = Field(
        default=(),
        description="Per-layer exceptions, {weight name pattern: settings} (first match wins; patterns match as "
        "keep_float16's): e.g. {model.layers.0.mlp.down_proj: {nbits: 8}}. Settings merge over this block's; the "
        "method must be this block's or none",
    )
    auto: AutoTargets | None = Field(
        default=None,
        description="Choose more bits or float16 for the layers that need them, until every function meets these "
        "targets on its calibration text (`compression: auto` for the defaults)",
    )

    @model_validator(mode="before")
    @classmethod
    def _layer_mapping(cls, data: Any) -> Any:
        """``layers`` as written, a mapping of pattern to partial settings, made whole: each
        exception's settings merged over this block's (or, naming another method, that method's
        defaults)."""
        if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
            return data
        own = {key: data[key] for key in SETTING_FIELDS if key in data}
        pairs = []
        for pattern, override in data["layers"].items():
            if not isinstance(override, dict):
                raise ValueError(f"layers: '{pattern}' needs settings as a mapping, e.g. {{nbits: 8}}")
            same_method = override.get("method", own.get("method", "palettize")) == own.get("method", "palettize")
            pairs.append((pattern, {**(own if same_method else {}), **override, "keep_float16": ()}))
        return {**data, "layers": tuple(pairs)}

    @model_validator(mode="after")
    def _fill_defaults(self) -> Compression:
        method = self.method
        given = self.model_fields_set

        def forbid(*names: str) -> None:
            for name in names:
                if name in given and getattr(self, name) is not None:
                    raise ValueError(f"'{name}' does not apply to method '{method}'")

        values: dict[str, Any] = {}
        if method == "palettize":
            forbid("block_size", "sparsity")
            nbits = 4 if self.nbits is None else self.nbits
            if nbits not in PALETTIZE_NBITS:
                raise ValueError(f"nbits {nbits} is not valid for palettize: choose one of {PALETTIZE_NBITS}")
            granularity = self.granularity or "per_grouped_channel"
            if granularity not in ("per_tensor", "per_grouped_channel"):
                raise ValueError(
                    f"granularity '{granularity}' is not valid for palettize: "
                    "choose per_tensor or per_grouped_channel"
                )
            values = {"nbits": nbits, "granularity": granularity}
            if granularity == "per_grouped_channel":
                values["group_size"] = self.group_size or DEFAULT_GROUP_SIZE
            else:
                forbid("group_size")
        elif method == "linear":
            forbid("group_size", "sparsity")
            nbits = 8 if self.nbits is None else self.nbits
            if nbits not in LINEAR_NBITS:
                raise ValueError(f"nbits {nbits} is not valid for linear: choose one of {LINEAR_NBITS}")
            granularity = self.granularity or "per_block"
            if granularity not in ("per_tensor", "per_channel", "per_block"):
                raise ValueError(
                    f"granularity '{granularity}' is not valid for linear: "
                    "choose per_tensor, per_channel or per_block"
                )
            values = {"nbits": nbits, "granularity": granularity}
            if granularity == "per_block":
                values["block_size"] = self.block_size or 32
            else:
                forbid("block_size")
        elif method == "prune":
            forbid("nbits", "granularity", "group_size", "block_size")
            values = {"sparsity": 0.5 if self.sparsity is None else self.sparsity}
        else:
            forbid("nbits", "granularity", "group_size", "block_size", "sparsity")
        for key, value in values.items():
            object.__setattr__(self, key, value)
        for pattern, exception in self.layers:
            if exception.method not in (method, "none"):
                raise ValueError(f"layers: '{pattern}' uses method {exception.method}: an exception is {method} or none")
            if exception.layers or exception.auto is not None:
                raise ValueError(f"layers: '{pattern}' cannot have layers or auto of its own")
        if self.auto is not None and method != "palettize":
            raise ValueError(f"auto chooses palettization bits: it does not apply to method '{method}'")
        return self

    def data_free(self) -> Compression:
        """This compression in a manifest without calibration text: a palettization at
        ``DATA_FREE_GROUP_SIZE_MAX_NBITS`` or fewer whose group_size is unset gets one palette per
        output channel (so do such per-layer exceptions)."""
        update: dict[str, Any] = {}
        if (
            self.method == "palettize"
            and self.granularity == "per_grouped_channel"
            and self.nbits <= DATA_FREE_GROUP_SIZE_MAX_NBITS
            and "group_size" not in self.model_fields_set
        ):
            update["group_size"] = DATA_FREE_GROUP_SIZE
        layers = tuple((pattern, exception.data_free()) for pattern, exception in self.layers)
        if layers != self.layers:
            update["layers"] = layers
        return self.model_copy(update=update) if update else self

    def compensated(self) -> bool:
        """Whether this setting's linear integers are error-compensated when calibration text
        gives their layer's Gram."""
        return self.method == "linear" and self.nbits <= COMPENSATED_LINEAR_MAX_NBITS

    def uses_calibration(self) -> bool:
        """Whether calibration text changes what this compression writes: palettes weighted by
        activation energy, or linear integers compensated (here or in a per-layer exception)."""
        return self.method == "palettize" or any(s.compensated() for s in (self, *(e for _, e in self.layers)))

    def describe(self) -> str:
        """Short human description, e.g. ``palettize 4-bit per_grouped_channel/16``, and how many
        layers are exceptions (``+ 2 layers at 8-bit``)."""
        described = self._describe_setting()
        if self.layers:
            kinds: dict[str, int] = {}
            for _, exception in self.layers:
                if exception.method == "none":
                    kind = "float16"
                elif exception.method == "prune":
                    kind = f"{exception.sparsity:.0%} sparsity"
                else:
                    kind = f"{exception.nbits}-bit"
                    if (exception.granularity, exception.group_size, exception.block_size) != (self.granularity, self.group_size, self.block_size):
                        kind = exception._describe_setting().removeprefix(self.method + " ").replace("linear ", "")
                kinds[kind] = kinds.get(kind, 0) + 1
            described += "".join(f" + {count} layer{'s' * (count > 1)} at {kind}" for kind, count in kinds.items())
        return described

    def _describe_setting(self) -> str:
        if self.method == "palettize":
            extra = f"/{self.group_size}" if self.granularity == "per_grouped_channel" else ""
            return f"palettize {self.nbits}-bit {self.granularity}{extra}"
        if self.method == "linear":
            extra = f"/{self.block_size}" if self.granularity == "per_block" else ""
            return f"linear int{self.nbits} {self.granularity}{extra}"
        if self.method == "prune":
            return f"prune {self.sparsity:.0%}"
        return "float16"


# Name fragments of peft's low-rank matrices once traced (``..._lora_A_default_weight``).
LORA_PATTERNS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")

# coremltools compresses a constant only when it has more values than this (and rank >= 2:
# it refuses 1-D tensors, rdar://113860800); the other writer and the estimate follow it.
WEIGHT_THRESHOLD = 2048

# Constants never compressed whatever the manifest says: rope tables feed sin/cos positions
# (errors here shift every token).
ALWAYS_FLOAT16 = ("rope_cos", "rope_sin")


# Where the vocabulary (embedding, and output head when untied) holds more than this share of a
# base's matrix weights, the default compresses it at VOCABULARY_NBITS instead of keeping it
# float16: there, float16 vocabulary rows cost more bytes than compressing everything else
# saves. Gemma 3 270M (a 262,144-row tied embedding, 62.6% of its weights), measured with
# benchmarks/quality.py --embedding on held-out text against float32: the embedding as 8-bit
# palettes in groups of 16 costs its haiku skill a perplexity ratio of 1.004 (top-1 99.1%,
# retention 0.9998), int8 per channel 1.008, 6-bit palettes 1.027; at 4 bits, int4 in blocks of
# 32 1.117 against palettes 1.188 (per channel) and 1.221 (groups of 16). Keeping the
# embedding float16 and palettizing the rest at 4 bits (390 MB) costs 1.188 and retention 0.413;
# 8-bit embedding palettes with the rest float16 (377 MB) cost 1.004 and 0.9998.
VOCABULARY_SHARE = 0.5
VOCABULARY_PATTERNS = ("embed_tokens", "lm_head")
VOCABULARY_NBITS = 8


def vocabulary_share(shapes: dict[str, tuple[int, ...]]) -> float:
    """The share of a base's matrix weights (name -> shape) its embedding and output head hold."""
    matrices = {name: math.prod(shape) for name, shape in shapes.items() if len(shape) >= 2}
    vocabulary = sum(size for name, size in matrices.items() if matches_any(name.replace(".", "_"), VOCABULARY_PATTERNS))
    return vocabulary / max(1, sum(matrices.values()))


def vocabulary_setting(compression: Compression) -> dict | None:
    """The per-layer exception the default gives a large vocabulary under ``compression``'s
    method (None: it stays float16): palettes of VOCABULARY_NBITS in groups of 16 (one palette
    of 256 float16 entries per row would add half a byte per weight), or integers of
    VOCABULARY_NBITS per channel."""
    if compression.method == "palettize":
        return {"nbits": VOCABULARY_NBITS, "granularity": "per_grouped_channel", "group_size": 16}
    if compression.method == "linear":
        return {"nbits": VOCABULARY_NBITS, "granularity": "per_channel"}
    return None


def matches_any(const_name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        normalized = pattern.replace(".", "_")
        if any(ch in normalized for ch in "*?["):
            if fnmatch.fnmatchcase(const_name, f"*{normalized}*"):
                return True
        elif normalized in const_name:
            return True
    return False


def is_lora_weight(name: str) -> bool:
    """A LoRA A/B matrix (keep mode), by its module path or traced constant name."""
    return matches_any(name.replace(".", "_"), LORA_PATTERNS)


def weight_setting(
    name: str, shape: tuple[int, ...], compression: Compression, lora_compression: Compression | None = None
) -> Compression | None:
    """The setting weight ``name`` (a module path or a traced constant name) of ``shape`` is
    compressed with, or None when it stays float16: too small or 1-D, a rope table, a
    ``keep_float16`` match, a method ``none``, or groups or blocks that do not tile it. The first
    of ``compression.layers``' patterns that matches gives the weight its own setting. LoRA
    matrices follow ``lora_compression`` (None: float16), not ``keep_float16``."""
    return _rule(name, shape, compression, lora_compression)[1]


def _rule(
    name: str, shape: tuple[int, ...], compression: Compression, lora_compression: Compression | None = None
) -> tuple[str | None, Compression | None]:
    """(the ``compression.layers`` pattern that decides weight ``name``, or None; its setting as
    ``weight_setting`` returns it)."""
    flat = name.replace(".", "_")
    if len(shape) < 2 or math.prod(shape) <= WEIGHT_THRESHOLD or matches_any(flat, ALWAYS_FLOAT16):
        return None, None
    pattern = None
    if matches_any(flat, LORA_PATTERNS):
        setting = lora_compression
    elif matches_any(flat, tuple(compression.keep_float16)):
        return None, None
    else:
        pattern, setting = next(((p, own) for p, own in compression.layers if matches_any(flat, (p,))), (None, compression))
    if setting is None or setting.method == "none" or not _fits(shape, setting):
        return pattern, None
    return pattern, setting


def exception_pattern(
    name: str, shape: tuple[int, ...], compression: Compression, lora_compression: Compression | None = None
) -> str | None:
    """The pattern of ``compression.layers`` that decides weight ``name`` of ``shape``, or None."""
    return _rule(name, shape, compression, lora_compression)[0]


def exception_matches(weights: dict[str, tuple[int, ...]], compression: Compression) -> dict[str, list[str]]:
    """{pattern of ``compression.layers``: the weights (name -> shape) it decides}, every pattern
    listed: one that decides none (a typo, a weight kept float16 anyway, shadowed by an earlier
    pattern) has an empty list."""
    found: dict[str, list[str]] = {pattern: [] for pattern, _ in compression.layers}
    for name, shape in weights.items():
        pattern = _rule(name, shape, compression)[0]
        if pattern is not None:
            found[pattern].append(name)
    return found


def _fits(shape: tuple[int, ...], setting: Compression) -> bool:
    """Whether ``setting`` splits a weight of ``shape`` as coremltools does: channel groups must
    tile the output channels (axis 0), blocks the input channels (the last axis); coremltools
    leaves a weight they do not tile float16."""
    if setting.method == "palettize" and setting.granularity != "per_tensor":
        return shape[0] % setting.group_size == 0
    if setting.method == "linear" and setting.granularity == "per_block":
        return shape[-1] % setting.block_size == 0
    return True


def compressed_bytes(shape: tuple[int, ...], setting: Compression | None) -> int:
    """Bytes a float16 weight of ``shape`` takes stored with ``setting`` (None: float16):
    palettized, nbits per value plus float16 palettes; linear, nbits per value plus a float16
    scale per block or channel; pruned, the kept float16 values plus a one-bit mask."""
    count = math.prod(shape)
    if setting is None:
        return 2 * count
    if setting.method == "palettize":
        groups = 1 if setting.granularity == "per_tensor" else max(1, shape[0] // setting.group_size)
        return count * setting.nbits // 8 + groups * (1 << setting.nbits) * 2
    if setting.method == "linear":
        per = setting.block_size if setting.granularity == "per_block" else shape[-1]
        return count * setting.nbits // 8 + 2 * count // max(1, per)
    return int(count * (1 - setting.sparsity)) * 2 + count // 8  # prune
