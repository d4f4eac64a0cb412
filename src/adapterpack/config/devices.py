"""Will a package run on a given device? App memory limits, and what a decoder needs at run time.

An iOS app that goes over its memory limit is killed by jetsam without a crash log, so "it built"
says nothing about "it runs". Apple publishes neither the RAM of its phones nor the per-app limits
(the docs of the ``com.apple.developer.kernel.increased-memory-limit`` entitlement only say that a
higher limit exists "on supported devices" and point to ``os_proc_available_memory()``). The
table below therefore records, for every number, where it comes from (``source``) and whether it
is an estimate rather than a measurement on that very device (``estimate``). Treat the result as a
first check, then measure with ``os_proc_available_memory()`` on the device.

Conventions: "GB" in the cited reports is read as GiB (2**30 bytes), which is what
``os_proc_available_memory()`` reporters usually print; the difference (7 %) is well inside the
spread of the reports. A limit is the memory the whole app may use, so the app's own code, UI
and the Core ML runtime come out of the headroom, not out of the limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from adapterpack.config.compression import compressed_bytes, weight_setting
from adapterpack.errors import BadInput

GIB = 1 << 30
MIB = 1 << 20

# Candidate context lengths go in multiples of this: it is the granularity people pick contexts in
# (512, 2048, 4096, ... are all multiples) and keeps the search short.
CONTEXT_STEP = 256
# No search beyond a million tokens: every supported family's rope tables end well before.
CONTEXT_CEILING = 1 << 20


@dataclass(frozen=True)
class Device:
    """One device class: its RAM, the memory an app may use on it, and where those figures come from."""

    key: str  # short name for --device, e.g. "iphone-15-pro"
    name: str
    ram_bytes: int
    limit_bytes: int  # default per-app limit (no entitlement)
    increased_limit_bytes: int | None  # with com.apple.developer.kernel.increased-memory-limit; None: n/a
    source: str
    estimate: bool  # True when the limit is not a measurement on this device model

    def limit(self, increased: bool = False) -> int:
        """The app memory limit, with the increased-memory-limit entitlement when ``increased``."""
        if increased and self.increased_limit_bytes is not None:
            return self.increased_limit_bytes
        return self.limit_bytes


_IPHONE_RAM = (
    "RAM as reported by teardowns and the press (Apple does not publish iPhone RAM; it does say "
    "Apple Intelligence needs an iPhone 15 Pro or later, the 8 GB models)"
)

DEVICES: tuple[Device, ...] = (
    Device(
        key="iphone-15",
        name="iPhone 15",
        ram_bytes=6 * GIB,
        limit_bytes=3 * GIB,
        increased_limit_bytes=int(4.2 * GIB),
        source=(
            f"{_IPHONE_RAM}: 6 GB. Limits measured on another 6 GB iPhone (13 Pro): "
            "os_proc_available_memory() 3.12 GB at launch without the entitlement, 4.20 GB with it "
            "(github.com/a-ghorbani/pocketpal-ai/pull/651); the usual rule of thumb is about half "
            "of RAM without the entitlement"
        ),
        estimate=True,
    ),
    Device(
        key="iphone-15-pro",
        name="iPhone 15 Pro",
        ram_bytes=8 * GIB,
        limit_bytes=3 * GIB,
        increased_limit_bytes=6 * GIB,
        source=(
            f"{_IPHONE_RAM}: 8 GB. Developer report on an iPhone 15 Pro: about 3 GB available to the "
            "app without the entitlement, 6 GB with it (github.com/introlab/rtabmap/pull/1446)"
        ),
        estimate=False,
    ),
    Device(
        key="iphone-16",
        name="iPhone 16",
        ram_bytes=8 * GIB,
        limit_bytes=3 * GIB,
        increased_limit_bytes=6 * GIB,
        source=(
            f"{_IPHONE_RAM}: 8 GB. No public measurement found: assumed equal to the iPhone 15 Pro "
            "(same RAM; github.com/introlab/rtabmap/pull/1446)"
        ),
        estimate=True,
    ),
    Device(
        key="iphone-16-pro",
        name="iPhone 16 Pro",
        ram_bytes=8 * GIB,
        limit_bytes=3 * GIB,
        increased_limit_bytes=6 * GIB,
        source=(
            f"{_IPHONE_RAM}: 8 GB. No public measurement found: assumed equal to the iPhone 15 Pro "
            "(same RAM; github.com/introlab/rtabmap/pull/1446)"
        ),
        estimate=True,
    ),
    Device(
        key="ipad-8gb",
        name="iPad (8 GB, e.g. M1/M2 iPad Air or Pro)",
        ram_bytes=8 * GIB,
        limit_bytes=5 * GIB,
        increased_limit_bytes=6 * GIB,
        source=(
            "8 GB as sold. About 5 GB per app on an M1 iPad Pro under iPadOS 14 (9to5mac.com/2021/06/25/"
            "apps-can-request-access-to-more-ram-with-ios-15-entitlement-exceeding-normal-system-memory-limits); "
            "up to 6 GB with the entitlement on 8 GB M1 iPad Pros (Artstudio Pro developers, "
            "macrumors.com/2021/09/17/ipados-15-up-to-12gb-ram-high-end-ipad-pro). Varies by OS: "
            "github.com/utmapp/UTM/issues/3982 could not "
            "allocate more than ~3.5 GB on iPadOS 15.1, and an Apple forum report "
            "(developer.apple.com/forums/thread/826325) measured ~6 GB dropping to ~3 GB on iPadOS 26.4"
        ),
        estimate=True,
    ),
    Device(
        key="ipad-pro-16gb",
        name="iPad Pro (16 GB)",
        ram_bytes=16 * GIB,
        limit_bytes=5 * GIB,
        increased_limit_bytes=12 * GIB,
        source=(
            "16 GB as sold (1 TB and 2 TB models). About 5 GB per app under iPadOS 14 (9to5mac, June "
            "2021, as for the 8 GB iPad); up to 12 GB with the entitlement (Artstudio Pro developers, "
            "macrumors.com/2021/09/17/ipados-15-up-to-12gb-ram-high-end-ipad-pro)"
        ),
        estimate=True,
    ),
    Device(
        key="mac-16gb",
        name="Mac (16 GB, Apple silicon)",
        ram_bytes=16 * GIB,
        limit_bytes=int(10922.67 * MIB),
        increased_limit_bytes=None,
        source=(
            "macOS has no per-app jetsam limit (it swaps); the practical ceiling used here is Metal's "
            "recommendedMaxWorkingSetSize, 10922.67 MB (2/3 of RAM) on a 16 GB M1 "
            "(github.com/abetlen/llama-cpp-python/issues/687) and 11.84 GB on a 16 GB M3 "
            "(github.com/AlexsJones/llmfit/pull/754); the entitlement does not exist on macOS"
        ),
        estimate=True,
    ),
)


def find_device(name: str, devices: Sequence[Device] = DEVICES) -> Device:
    """The device whose key or name is ``name`` (case-insensitive); BadInput listing the keys otherwise."""
    wanted = name.strip().lower()
    for device in devices:
        if wanted in (device.key, device.name.lower()):
            return device
    keys = ", ".join(d.key for d in devices)
    raise BadInput(f"unknown device {name!r}: choose one of {keys}")


def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_context: int, dtype_bytes: int = 2) -> int:
    """Bytes of the key and value caches: 2 x layers x kv_heads x head_dim x max_context x dtype_bytes.

    ``n_kv_heads`` is the number of key/value heads, which grouped-query attention makes smaller
    than the number of query heads (e.g. 8 instead of 32): the cache holds only the kv heads.
    """
    return 2 * n_layers * n_kv_heads * head_dim * max_context * dtype_bytes


def state_bytes(n_layers: int, n_kv_heads: int, head_dim: int, max_context: int, dtype_bytes: int = 2) -> int:
    """Bytes of every state a package's function holds: the key and value caches plus
    ``writtenSlots`` (one value per cache position, see export_decoder)."""
    return kv_cache_bytes(n_layers, n_kv_heads, head_dim, max_context, dtype_bytes) + max_context * dtype_bytes


def activation_bytes(
    *,
    query: int,
    context: int,
    vocab: int,
    hidden: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    intermediate: int | None = None,
    dtype_bytes: int = 2,
) -> int:
    """Estimated peak of the transient buffers of one call with ``query`` new tokens over ``context`` keys.

    An estimate, not a measurement: the sum of the largest buffers that are alive together while one
    decoder layer runs (layers run one after another, so one layer's worth), plus the logits:

    * logits: query x vocab
    * four hidden-size buffers (residual, normed input, attention output, MLP output): 4 x query x hidden
    * q/k/v projections: query x (n_heads + 2 n_kv_heads) x head_dim
    * keys and values read from the cache and repeated to the query heads (GQA): 2 x n_heads x context x head_dim
    * attention scores and their softmax: 2 x n_heads x query x context
    * the attention bias: query x context
    * MLP gate, up and their product: 3 x query x intermediate (4 x hidden when unknown)

    all at ``dtype_bytes`` (float16). It assumes attention scores are materialized, as a plain
    ``scaled_dot_product_attention`` does; a runtime that tiles attention needs less, one that keeps
    extra copies more. Weights and the KV-cache are counted separately.
    """
    intermediate = intermediate if intermediate else 4 * hidden
    elements = (
        query * vocab
        + 4 * query * hidden
        + query * (n_heads + 2 * n_kv_heads) * head_dim
        + 2 * n_heads * context * head_dim
        + 2 * n_heads * query * context
        + query * context
        + 3 * query * intermediate
    )
    return elements * dtype_bytes


class BudgetRow(NamedTuple):
    """One device's verdict: ``headroom`` is limit minus need (negative when it does not fit)."""

    device: Device
    limit: int
    fits: bool
    headroom: int


def memory_budget(
    weights_bytes: int,
    kv_bytes: int,
    activation_bytes: int,
    devices: Sequence[Device] = DEVICES,
    *,
    increased_limit: bool = False,
) -> list[BudgetRow]:
    """For each device: does weights + KV-cache + activations fit in the app memory limit?

    ``increased_limit`` uses the limit with the increased-memory-limit entitlement where one is known.
    """
    need = weights_bytes + kv_bytes + activation_bytes
    rows = []
    for device in devices:
        limit = device.limit(increased_limit)
        rows.append(BudgetRow(device=device, limit=limit, fits=need <= limit, headroom=limit - need))
    return rows


def memory_need(
    context: int,
    *,
    weights_bytes: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    vocab: int,
    hidden: int,
    n_heads: int | None = None,
    intermediate: int | None = None,
    max_query: int | None = None,
    dtype_bytes: int = 2,
) -> int:
    """Weights + states (KV-cache) + activations of the largest call for a package built with ``context``.

    The largest call prefills ``context`` tokens at once (the package accepts inputIds up to
    max_context long), unless ``max_query`` caps it for an app that prefills in chunks.
    ``n_heads`` defaults to hidden // head_dim (true of Llama, Mistral and Qwen2).
    """
    heads = n_heads or max(hidden // head_dim, n_kv_heads)
    query = min(context, max_query) if max_query else context
    return (
        weights_bytes
        + state_bytes(n_layers, n_kv_heads, head_dim, context, dtype_bytes)
        + activation_bytes(
            query=query,
            context=context,
            vocab=vocab,
            hidden=hidden,
            n_heads=heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            dtype_bytes=dtype_bytes,
        )
    )


def largest_context_that_fits(
    device: Device | str,
    weights_bytes: int,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    vocab: int,
    hidden: int,
    *,
    n_heads: int | None = None,
    intermediate: int | None = None,
    max_query: int | None = None,
    increased_limit: bool = False,
) -> int:
    """The largest max_context, in steps of 256 tokens, whose memory need fits the device's app limit.

    0 when not even 256 tokens fit. Steps of 256 (not powers of two) because the need grows
    quadratically with the context through the attention scores, so powers of two would leave up
    to half the usable context on the table. The need only grows with the context, so a binary
    search over the steps finds the largest one; ``CONTEXT_CEILING`` bounds it.
    """
    if isinstance(device, str):
        device = find_device(device)
    limit = device.limit(increased_limit)

    def fits(steps: int) -> bool:
        need = memory_need(
            steps * CONTEXT_STEP,
            weights_bytes=weights_bytes,
            n_layers=n_layers,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab=vocab,
            hidden=hidden,
            n_heads=n_heads,
            intermediate=intermediate,
            max_query=max_query,
        )
        return need <= limit

    if not fits(1):
        return 0
    # Invariant: ``low`` steps fit; nothing above ``high`` steps does (or is past the ceiling).
    low, high = 1, CONTEXT_CEILING // CONTEXT_STEP
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low * CONTEXT_STEP


def estimated_weight_bytes(tensors: dict, compression, lora_tensors: dict | None = None, lora_compression=None) -> int:
    """Bytes one function's weights will take once compressed, from the base's tensor shapes and
    (keep mode) the adapter's LoRA matrices, each stored as ``weight_setting`` decides: the rule
    the compressors follow."""
    lora = {name: info for name, info in (lora_tensors or {}).items() if "lora_" in name}
    return sum(
        compressed_bytes(tuple(info.shape), weight_setting(name, tuple(info.shape), compression, lora_compression))
        for name, info in {**tensors, **lora}.items()
    )


def lora_float16_bytes(tensors: dict) -> int:
    """Bytes of an adapter's LoRA A/B matrices in float16 (what keep mode stores per function)."""
    return sum(2 * math.prod(info.shape) for name, info in tensors.items() if "lora_" in name)
