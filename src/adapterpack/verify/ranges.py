"""Range check before conversion: does every value the reference computes fit float16?

A float16 program (every ``.mlpackage``, and an ``.aimodel`` computing in float16) turns any value
past 65504 into inf. Pretrained checkpoints carry massive activations (tens of thousands in the
residual stream); the export keeps the norms safe for any float16 input (``convert.export_decoder
.rms_norm``), but a value that float16 cannot hold at all (a residual, an MLP product, logits)
cannot be saved by the export. So before any conversion the PyTorch reference of each function
(base, and base + each adapter, unmerged) runs on a short calibration prompt (the first tokens of
verify's seeded sequence) and every module input and output is measured.

Attention scores inside ``scaled_dot_product_attention`` are not observable from module hooks;
verify's executor reports them should they overflow.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from adapterpack.errors import BadInput
from adapterpack.inputs.float16 import FLOAT16_MAX
from adapterpack.verify.drives import verification_tokens
from adapterpack.verify.reference import computed_in_float32, stored_dtype

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


def _largest(value) -> float | None:
    import torch

    if isinstance(value, (tuple, list)):
        found = [m for m in map(_largest, value) if m is not None]
        return max(found) if found else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
        return None
    if torch.isnan(value).any():
        return math.nan
    return float(value.detach().abs().max())


def _measured(model, ids) -> dict[str, float]:
    """{module name (input)/(output): largest |value|} over one forward of ``model``."""
    import torch

    found: dict[str, float] = {}

    def note(key: str, value) -> None:
        largest = _largest(value)
        if largest is not None:
            before = found.get(key, 0.0)
            found[key] = largest if math.isnan(largest) or largest > before else before

    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(module, args, output, name=name):
            note(f"{name} (input)", args)
            note(f"{name} (output)", output)

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad(), computed_in_float32(model):
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return found


def _reference_name(name: str) -> str:
    # peft wraps the base: show the base's own module path.
    return name.removeprefix("base_model.model.")


def out_of_float16_range(checked, names: list[str]) -> list[OutOfRange]:
    """Every module input or output of each function's reference (``names``: the manifest's
    functions) whose magnitude float16 cannot hold, on the calibration prompt."""
    import torch

    from adapterpack.convert.base_model import load_base
    from adapterpack.convert.lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder, dtype=stored_dtype(checked.base))
    tokens = verification_tokens(int(base.config.vocab_size), manifest.verify)[:CALIBRATION_TOKENS]
    ids = torch.from_numpy(tokens[None, :])
    found: list[OutOfRange] = []
    for name in names:
        adapter = manifest.adapter(name)
        if adapter is None:
            measured = _measured(base, ids)
        else:
            folder = checked.adapters[name].folder
            with torch.no_grad(), applied_adapter(base, folder, mode="unmerged", scale=float(adapter.scale)) as model:
                measured = _measured(model, ids)
        for tensor, largest in measured.items():
            if math.isnan(largest) or largest > FLOAT16_MAX:
                found.append(OutOfRange(name, _reference_name(tensor), largest))
    del base
    return found


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
        f"cannot hold (at most {FLOAT16_MAX:.0f}) on a {CALIBRATION_TOKENS}-token calibration prompt: {shown}{more}; "
        "a float16 package would compute inf there: write an .aimodel with export.compute_precision: float32, "
        "or rescale the checkpoint"
    )
