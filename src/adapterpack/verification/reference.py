"""The references: logits of the float32 base, and of the base with each adapter applied by peft
and not merged, computed before any function runs and freed after.

The base is loaded at the precision it is stored in (a float16 model maps its safetensors and
costs 2 bytes a parameter, not 4), and every module computes in float32 while it runs: its own
weights are widened just for its forward and put back after. The arithmetic is that of the
float32 model (widening float16 or bfloat16 is exact), but only one weight at a time is ever
held in float32: a 3B model's reference needs its 6 GB of float16, not 12.8 GB of float32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

# safetensors dtype -> the torch dtype the base is loaded in (anything else: float32)
STORED_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# A weight larger than this in float32 is never widened whole (a large vocabulary's embedding
# and output head: 1.5 GB each at Llama 3.2 3B's shape, which would take verify past 8 GB): an
# embedding looks up its float16 rows and widens those, a linear layer widens WIDE_ROWS_BYTES of
# output rows at a time.
WIDEN_WHOLE_BYTES = 256 << 20
WIDE_ROWS_BYTES = 64 << 20
# Batch rows of one reference forward (the base and the adapters beside it): bounds the logits
# and activations held at once (a row of 32 tokens' logits over a 152k vocabulary is 19 MB).
ROWS_PER_PASS = 16


def stored_dtype(base_info) -> str:
    """The one floating dtype every weight of the base is stored in, else float32."""
    found = {STORED_DTYPES.get(info.dtype, "float32") for info in base_info.tensors.values() if info.dtype.startswith(("F", "BF"))}
    return found.pop() if len(found) == 1 else "float32"


@contextlib.contextmanager
def computed_in_float32(model) -> Iterator[None]:
    """Every module that owns parameters runs its forward with them in float32, widened on
    entry and restored on exit (also when the forward fails); a weight above
    ``WIDEN_WHOLE_BYTES`` a part at a time (``_in_parts``)."""
    import torch

    stashed: dict[torch.nn.Parameter, torch.Tensor] = {}

    def widen(module, _args) -> None:
        for parameter in module.parameters(recurse=False):
            if parameter.dtype != torch.float32 and parameter not in stashed:
                stashed[parameter] = parameter.data
                parameter.data = parameter.data.float()

    def restore(module, _args, _output) -> None:
        for parameter in module.parameters(recurse=False):
            original = stashed.pop(parameter, None)
            if original is not None:
                parameter.data = original

    handles, in_parts = [], []
    for module in model.modules():
        if _in_parts(module):
            in_parts.append(module)
        elif any(True for _ in module.parameters(recurse=False)):
            handles.append(module.register_forward_pre_hook(widen))
            handles.append(module.register_forward_hook(restore))
    for module in in_parts:
        module.forward = _widened_in_parts(module)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in in_parts:
            del module.forward  # the class's own again
        for parameter, original in stashed.items():
            parameter.data = original
        stashed.clear()


def _in_parts(module) -> bool:
    """A plain linear layer or embedding (or Gemma's scaled one) whose float16 or bfloat16 weight
    is too large to widen whole."""
    import torch

    weight = getattr(module, "weight", None)
    return (
        (type(module) in (torch.nn.Linear, torch.nn.Embedding) or hasattr(module, "scalar_embed_scale"))
        and weight is not None
        and weight.dtype != torch.float32
        and 4 * weight.numel() > WIDEN_WHOLE_BYTES
    )


def _widened_in_parts(module):
    """``module``'s forward in float32 without its whole weight widened: an embedding's looked-up
    rows are widened (a lookup then a widening is the lookup of the widened table); a linear
    layer's output is computed ``WIDE_ROWS_BYTES`` of weight rows at a time, each element a
    float32 dot product (the kernel may block it otherwise than one product of the whole
    weight: differences in the last bits)."""
    import torch
    import torch.nn.functional as F

    if isinstance(module, torch.nn.Embedding):
        # Gemma's scaled embedding multiplies by sqrt(hidden) after the lookup: in float32 here,
        # as its float32 model does (its own forward would multiply in the stored dtype).
        scale = getattr(module, "embed_scale", None)

        def lookup(ids):
            rows = torch.nn.Embedding.forward(module, ids).float()
            return rows if scale is None else rows * scale.float()

        return lookup

    def forward(x):
        weight, bias = module.weight, module.bias
        rows = max(1, WIDE_ROWS_BYTES // (4 * weight.shape[1]))
        parts = [
            F.linear(x, weight[first : first + rows].float(), None if bias is None else bias[first : first + rows].float())
            for first in range(0, weight.shape[0], rows)
        ]
        return torch.cat(parts, dim=-1)

    return forward


def reference_passes(checked, base, names: list[str]) -> Iterator[tuple[object, list[str | None], dict]]:
    """The forwards that compute the references of ``names`` (the manifest's functions) over the
    loaded ``base``: yields (model, the function of each batch row, keyword arguments of the call);
    a row of None is the base alone. Call the model (under ``computed_in_float32``) before taking
    the next; each is taken off ``base`` after.

    The base and the adapters peft can mix in one batch run side by side, a batch row each
    (``lora.applied_side_by_side``): every base weight is widened and multiplied once for all
    of them instead of once per function, which is most of a reference's cost (docs/benchmarks.md,
    ``benchmarks/reference_time.py``). DoRA and ``modules_to_save`` adapters run one at a time.
    The first pass always holds the base's row."""
    import torch

    from adapterpack.convert.lora import BASE_ROW, applied_adapter, applied_side_by_side

    manifest = checked.manifest
    adapted = {name: manifest.adapter(name) for name in names if manifest.adapter(name) is not None}
    mixed = [name for name in adapted if _mixes(checked.adapters[name])]
    beside_base = max(ROWS_PER_PASS - 1, 1)  # adapter rows per pass, the base's row beside them
    for first in range(0, max(len(mixed), 1), beside_base):
        group = {name: (checked.adapters[name].folder, float(adapted[name].scale)) for name in mixed[first : first + beside_base]}
        with torch.no_grad(), applied_side_by_side(base, group) as (model, named):
            yield model, [None, *named], ({"adapter_names": [BASE_ROW, *named.values()]} if named else {})
    for name, adapter in adapted.items():
        if name not in mixed:
            with torch.no_grad(), applied_adapter(base, checked.adapters[name].folder, mode="unmerged", scale=float(adapter.scale)) as model:
                yield model, [name], {}


def _mixes(adapter_info) -> bool:
    """Whether peft can run the adapter in a batch beside others (see ``applied_side_by_side``)."""
    return not adapter_info.uses_dora and not adapter_info.modules_to_save


def sequence_passes(checked, base, names: list[str], tokens) -> Iterator[tuple[object, list[str | None], object, dict, str]]:
    """``reference_passes`` over every token sequence verify runs (``tokens``: texts.VerifyTokens):
    yields (model, the function of each batch row (None: the base alone), the ids (rows, length),
    the call's keyword arguments, "random" or "text"). The random ids run on every row; each real
    text on the rows of the functions that run on it, beside the base's row on that text (in
    the first pass only: every pass computes the base alike)."""
    import torch

    from adapterpack.convert.lora import BASE_ROW

    manifest = checked.manifest
    based: set[bytes] = set()
    for model, rows, batch in reference_passes(checked, base, names):
        names_of = dict(zip(rows, batch.get("adapter_names", [None] * len(rows))))
        ids = torch.from_numpy(np.asarray(tokens.random, np.int64)[None, :]).repeat(len(rows), 1)
        yield model, rows, ids, batch, "random"
        for text, functions in tokens.groups():
            wanted = [None] if None in rows and text.tobytes() not in based else []
            wanted += [row for row in rows if row is not None and row in functions and manifest.adapter(row) is not None]
            if not wanted:
                continue
            if None in wanted:
                based.add(text.tobytes())
            call = {"adapter_names": [names_of[row] or BASE_ROW for row in wanted]} if "adapter_names" in batch else {}
            yield model, wanted, torch.from_numpy(text[None, :]).repeat(len(wanted), 1), call, "text"


@dataclass
class References:
    """The float32 references: on the random ids, the base's (``random[None]``) and each adapter
    function's; on each function's real text, its own (``text``, the base's for the base
    function) and the base's on that same text (``base_text``)."""

    random: dict[str | None, np.ndarray] = field(default_factory=dict)
    text: dict[str, np.ndarray] = field(default_factory=dict)
    base_text: dict[str, np.ndarray] = field(default_factory=dict)

    def of(self, function: str) -> np.ndarray:
        return self.random.get(function, self.random[None])


def reference_logits(checked, names: list[str], tokens) -> References:
    """The float32 references of ``names`` on ``tokens`` (texts.VerifyTokens): the PyTorch base
    computed in float32, each adapter applied by peft unmerged (``reference_passes``). Everything
    torch holds is gone when this returns."""
    from adapterpack.convert.base_model import load_base

    manifest = checked.manifest
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    found = References()
    on_text: dict[tuple[bytes, str | None], np.ndarray] = {}
    for model, rows, ids, batch, kind in sequence_passes(checked, base, names, tokens):
        with computed_in_float32(model):
            logits = model(ids, **batch).logits.float().numpy()
        for row, row_logits, row_ids in zip(rows, logits, ids.numpy()):
            if kind == "random":
                found.random[row] = row_logits
            else:
                on_text[row_ids.tobytes(), row] = row_logits
        del logits
    for function, text in tokens.text.items():
        key = text.tobytes()
        found.base_text[function] = on_text[key, None]
        found.text[function] = on_text.get((key, function), on_text[key, None]) if manifest.adapter(function) else on_text[key, None]
    return found


def random_references(checked, names: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(verify's random ids, the base's logits, {adapter function: logits}) on those ids alone."""
    from adapterpack.verification.texts import VerifyTokens, verification_tokens

    manifest = checked.manifest
    vocab = int((checked.base.config.get("text_config") or checked.base.config)["vocab_size"])
    tokens = verification_tokens(vocab, manifest.verify)[: int(manifest.export.max_context) - 1]
    found = reference_logits(checked, names, VerifyTokens(tokens))
    return tokens, found.random[None], {name: found.random[name] for name in names if name in found.random and name is not None}


@contextlib.contextmanager
def reference_model(checked, name: str) -> Iterator[object]:
    """The PyTorch reference of function ``name`` (the manifest's adapter, or the base for the
    base function), as verification computes it: the base at its stored precision computing in
    float32, the adapter applied by peft and not merged. Freed on exit."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    adapter = manifest.adapter(name)
    applied = (
        applied_adapter(base, checked.adapters[name].folder, mode="unmerged", scale=float(adapter.scale))
        if adapter is not None
        else contextlib.nullcontext(base)
    )
    with torch.no_grad(), applied as model, computed_in_float32(model):
        yield model
