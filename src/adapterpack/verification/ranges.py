"""Range check before conversion: does every value the reference computes fit float16?

A float16 program (every ``.mlpackage``, and an ``.aimodel`` computing in float16) turns any value
past 65504 into inf. Pretrained checkpoints carry massive activations (tens of thousands in the
residual stream); the export keeps the norms safe for any float16 input (``convert.export_decoder
.rms_norm``), but a value that float16 cannot hold at all (a residual, an MLP product, logits)
cannot be saved by the export. So before any conversion the PyTorch reference of each function
(base, and base + each adapter, unmerged) runs on the first tokens of verify's seeded random ids
and on its real text (``verification.texts``: what a checkpoint's massive activations need, a real
first token) and every module input and output is measured.

Attention scores inside ``scaled_dot_product_attention`` are not observable from module hooks;
verify's executor reports them should they overflow.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

from adapterpack.config.families import FAMILIES
from adapterpack.errors import BadInput
from adapterpack.inputs.float16 import FLOAT16_MAX
from adapterpack.verification.reference import computed_in_float32, sequence_passes, stored_dtype
from adapterpack.verification.texts import verify_tokens

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 16
# Names shown in the error before "and N more".
SHOWN = 5


@dataclass(frozen=True)
class OutOfRange:
    """One tensor of a function's reference that float16 cannot hold."""

    function: str
    tensor: str  # "model.layers.3.mlp.down_proj (input)"
    largest: float

    def describe(self) -> str:
        size = "NaN" if math.isnan(self.largest) else f"{self.largest:.6g}"
        return f"{self.function}: {self.tensor} reaches {size}"


def _largest(value, rows: int) -> list[float] | None:
    """Largest |value| of each of ``rows`` batch rows (NaN where a row holds one), or None for
    what is not a float tensor. A tensor without that batch axis (rotary tables computed once
    for every row) counts for each row."""
    import torch

    if isinstance(value, (tuple, list)):
        found = [m for m in (_largest(v, rows) for v in value) if m is not None]
        return [max(column, key=_order) for column in zip(*found)] if found else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
        return None
    value = value.detach()
    flat = value.reshape(rows, -1) if rows > 1 and value.ndim and value.shape[0] == rows else value.reshape(1, -1)
    nan = torch.isnan(flat).any(dim=1).tolist()
    largest = flat.abs().amax(dim=1).tolist()
    per_row = [math.nan if is_nan else big for is_nan, big in zip(nan, largest)]
    return per_row * rows if len(per_row) == 1 else per_row


def _order(largest: float) -> float:
    # NaN outranks any size: a row that computed one is named for it
    return math.inf if math.isnan(largest) else largest


def _measured(model, ids, rows: int, batch: dict) -> list[dict[str, float]]:
    """For each of ``rows`` batch rows, {module name (input)/(output): largest |value|} over one
    forward of ``model`` on ``ids`` (rows, tokens) (``batch``: the call's keyword arguments),
    each row measuring what that function's reference alone would: an adapter's own modules (its
    LoRA branches, named by its name in peft) see its rows alone and count for its row, and the
    base projection inside a module peft wrapped (``base_layer``) counts for the rows of the
    adapters that wrap it."""
    import torch

    from adapterpack.convert.lora import ADAPTER_NAME, BASE_ROW

    row_adapters = batch.get("adapter_names", ())
    owners = {peft: row for row, peft in enumerate(row_adapters) if peft != BASE_ROW}
    modules = dict(model.named_modules())
    found: list[dict[str, float]] = [{} for _ in range(rows)]

    def note(key: str, value, own_row: int | None, counted: set[int] | None) -> None:
        largest = _largest(value, rows if own_row is None else 1)
        for at, size in zip(range(rows) if own_row is None else [own_row], largest or ()):
            if counted is None or at in counted:
                found[at][key] = max(size, found[at].get(key, 0.0), key=_order)

    handles = []
    for name, module in modules.items():
        if not name:
            continue
        parts = name.split(".")
        own_row = next((owners[part] for part in parts if part in owners), None)
        counted = None
        if row_adapters and parts[-1] == "base_layer":
            # a row whose adapter leaves this module alone computes it without the wrapper
            # (base_layer's output is the module's): that function alone has no base_layer
            wrapping = getattr(modules[".".join(parts[:-1])], "lora_A", {})
            counted = {row for row, peft in enumerate(row_adapters) if peft in wrapping}
        # named as one adapter alone names it (peft's default name), whichever row it is
        shown = ".".join(ADAPTER_NAME if part in owners else part for part in parts)

        def hook(module, args, output, shown=shown, own_row=own_row, counted=counted):
            note(f"{shown} (input)", args, own_row, counted)
            note(f"{shown} (output)", output, own_row, counted)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad(), computed_in_float32(model):
            model(ids, **batch)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _reference_name(name: str) -> str:
    # peft wraps the base: show the base's own module path.
    return name.removeprefix("base_model.model.")


# What the export carries in float32 whatever the program's precision (convert.export_decoder:
# the residual stream, and the norms' insides; coremltools keeps that region float32,
# formats.mlpackage.conversion.compute_precision): a decoder layer's input and output, the input of a norm
# reading the residual, and Gemma's post-sublayer norms' outputs, which join it.
_RESIDUAL_FLOAT32 = re.compile(r"model\.layers\.\d+ \((input|output)\)|model\.norm \(input\)")
_NORM_OF_RESIDUAL = ("input_layernorm", "post_attention_layernorm")
_GEMMA_NORM_OF_RESIDUAL = ("input_layernorm", "pre_feedforward_layernorm")
_GEMMA_NORM_INTO_RESIDUAL = ("post_attention_layernorm", "post_feedforward_layernorm")


def held_in_float32(tensor: str, sandwich_norms: bool) -> bool:
    """Whether the program computes ``tensor`` (a module's "(input)" or "(output)", by the base's
    module path) in float32: such a value may pass float16's range (Gemma 3 270M's residual
    reaches 103,821 at ``<bos>``)."""
    if _RESIDUAL_FLOAT32.fullmatch(tensor):
        return True
    module, _, side = tensor.rpartition(" ")
    leaf = module.rpartition(".")[2]
    if side == "(input)":
        return leaf in (_GEMMA_NORM_OF_RESIDUAL if sandwich_norms else _NORM_OF_RESIDUAL) and ".layers." in module
    return sandwich_norms and leaf in _GEMMA_NORM_INTO_RESIDUAL


def out_of_float16_range(checked, names: list[str]) -> list[OutOfRange]:
    """Every module input or output of each function's reference (``names``: the manifest's
    functions) whose magnitude float16 cannot hold, on the first ``CALIBRATION_TOKENS`` of
    verify's random ids and on its real text (a checkpoint's massive activations sit on real
    text's first token); the functions' references run side by side as verify's do
    (``reference.sequence_passes``)."""
    import dataclasses

    from adapterpack.convert.base_model import load_base

    manifest = checked.manifest
    tokens = verify_tokens(checked, names)
    tokens = dataclasses.replace(tokens, random=tokens.random[:CALIBRATION_TOKENS])
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    base_function = next((name for name in names if manifest.adapter(name) is None), None)
    measured: dict[str, dict[str, float]] = {}
    for model, rows, ids, batch, _ in sequence_passes(checked, base, names, tokens):
        for function, found in zip(rows, _measured(model, ids, len(rows), batch)):
            # the base's row stands for the base function, when the manifest has one
            function = base_function if function is None else function
            if function is None:
                continue
            held = measured.setdefault(function, {})
            for tensor, largest in found.items():
                held[tensor] = max(largest, held.get(tensor, 0.0), key=_order)
    del base
    sandwich = FAMILIES[checked.base.config["model_type"]].sandwich_norms
    return [
        OutOfRange(name, _reference_name(tensor), largest)
        for name in names
        for tensor, largest in measured.get(name, {}).items()
        if math.isnan(largest) or (largest > FLOAT16_MAX and not held_in_float32(_reference_name(tensor), sandwich))
    ]


def check_reference_values(checked, names: list[str]) -> None:
    """BadInput naming the reference tensors of ``names`` that float16 cannot hold (before any
    conversion: a float16 program would compute inf there)."""
    found = out_of_float16_range(checked, names)
    if not found:
        return
    shown = "; ".join(f.describe() for f in found[:SHOWN])
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    raise BadInput(
        f"{checked.manifest.source or checked.manifest.name}: the PyTorch reference computes values float16 "
        f"cannot hold (at most {FLOAT16_MAX:.0f}) on random ids and real text: {shown}{more}; "
        "a float16 package would compute inf there: write an .aimodel with export.compute_precision: float32, "
        "or rescale the checkpoint"
    )
