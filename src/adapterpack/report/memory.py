"""What a package needs in memory on a device: its heaviest function's weights, every state, and
the activations of its largest call, against each device's app memory limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from adapterpack.config.devices import activation_bytes, kv_cache_bytes, largest_context_that_fits, memory_budget


def human_size(size: int) -> str:
    """Bytes as people read them: 512 B, 705.6 KB, 2.5 GB (units of 1024)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


@dataclass
class ModelShape:
    """Decoder sizes read from the package (states, logits and weights)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    kv_dtype_bytes: int
    vocab: int | None = None
    hidden: int | None = None
    n_heads: int | None = None
    intermediate: int | None = None
    other_state_bytes: int = 0  # states besides keyCache/valueCache (writtenSlots)

    def kv_cache_bytes(self) -> int:

        return kv_cache_bytes(self.n_layers, self.n_kv_heads, self.head_dim, self.max_context, self.kv_dtype_bytes)

    def state_bytes(self) -> int:
        """Every state of a function: what ``makeState()`` allocates on the device."""
        return self.kv_cache_bytes() + self.other_state_bytes

    def logits_bytes_per_token(self) -> int:
        """The float16 logits one call returns per token it is given: a ``(1, q, vocab)`` output,
        all of it alive when the call returns (part of the activations' estimate); 0 when the
        vocabulary could not be read."""
        return 2 * (self.vocab or 0)


class InspectedFunction(Protocol):
    name: str
    referenced_bytes: int  # the weight bytes a load of this function reads


class Inspection(Protocol):
    """What a format's inspection reports (``formats.<name>.inspection``) that the estimate reads."""

    shape: ModelShape | None

    @property
    def largest_function(self) -> InspectedFunction: ...


@dataclass
class MemoryEstimate:
    """Run-time memory of the package's heaviest function at its largest call (see config.devices)."""

    function: str
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int  # 0 when the vocabulary or hidden size could not be read
    activations_known: bool

    @property
    def need_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes


def memory_estimate(report: Inspection) -> MemoryEstimate | None:
    """Weights of the heaviest function + its KV-cache + activations of the largest call; None without states.

    Only one function is loaded at a time (``MLModelConfiguration.functionName``), so the weights
    are those the largest single function references, at their stored (compressed) size.
    """

    shape = report.shape
    if shape is None:
        return None
    largest = report.largest_function
    known = shape.vocab is not None and shape.hidden is not None
    activations = 0
    if known:
        heads = shape.n_heads or max(shape.hidden // shape.head_dim, shape.n_kv_heads)
        activations = activation_bytes(
            query=shape.max_context,
            context=shape.max_context,
            vocab=shape.vocab,
            hidden=shape.hidden,
            n_heads=heads,
            n_kv_heads=shape.n_kv_heads,
            head_dim=shape.head_dim,
            intermediate=shape.intermediate,
        )
    return MemoryEstimate(
        function=largest.name,
        weights_bytes=largest.referenced_bytes,
        kv_bytes=shape.state_bytes(),
        activation_bytes=activations,
        activations_known=known,
    )


def budget_rows(report, estimate, devices) -> list[dict]:
    """The memory budget per device, with and without the increased-memory-limit entitlement."""

    if estimate is None:
        return []
    plain = memory_budget(estimate.weights_bytes, estimate.kv_bytes, estimate.activation_bytes, devices)
    raised = memory_budget(
        estimate.weights_bytes, estimate.kv_bytes, estimate.activation_bytes, devices, increased_limit=True
    )
    shape = report.shape
    rows = []
    for default_row, raised_row in zip(plain, raised):
        dev = default_row.device
        context = None
        if estimate.activations_known:
            context = largest_context_that_fits(
                dev, estimate.weights_bytes, shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.vocab,
                shape.hidden, n_heads=shape.n_heads, intermediate=shape.intermediate,
            )
        rows.append({
            "device": dev.key,
            "name": dev.name,
            "ram_bytes": dev.ram_bytes,
            "limit_bytes": default_row.limit,
            "fits": default_row.fits,
            "headroom_bytes": default_row.headroom,
            "increased_limit_bytes": dev.increased_limit_bytes,
            "fits_increased": raised_row.fits if dev.increased_limit_bytes is not None else None,
            "headroom_increased_bytes": raised_row.headroom if dev.increased_limit_bytes is not None else None,
            "largest_context": context,
            "estimate": dev.estimate,
            "source": dev.source,
        })
    return rows


def inspection_json(report, estimate, budget: list[dict], top: int) -> dict:
    """``inspect --json``: the package's report with the memory estimate and each device's budget."""
    document = report.as_json(top=top)
    document["memory"] = None if estimate is None else {
        "function": estimate.function,
        "weights_bytes": estimate.weights_bytes,
        "kv_bytes": estimate.kv_bytes,
        "activation_bytes": estimate.activation_bytes,
        "activations_known": estimate.activations_known,
        "logits_bytes_per_token": report.shape.logits_bytes_per_token(),
        "need_bytes": estimate.need_bytes,
        "devices": budget,
    }
    return document
