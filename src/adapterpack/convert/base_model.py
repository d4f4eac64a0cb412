"""Load the base model once, in float32, from safetensors only (never remote code)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.quiet import captured_output, silence_libraries

log = logging.getLogger(__name__)


def load_base(folder: Path, dtype: str = "float32"):
    """Load a Hugging Face causal LM from a local folder.

    ``float32`` for the PyTorch reference; ``float16`` for export, which halves the memory of the
    build (Core ML stores float16 anyway, and conversion then copies no float32 weights).
    """
    silence_libraries()
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM

    try:
        with captured_output():
            model = AutoModelForCausalLM.from_pretrained(
                str(folder),
                dtype=getattr(torch, dtype),
                use_safetensors=True,
                trust_remote_code=False,
                local_files_only=True,
            )
    # StrictDataclassError: a config.json field of the wrong type (transformers validates its
    # config classes with huggingface_hub's strict dataclasses, which raise neither of the others)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, StrictDataclassError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise BadInput(f"{folder}: transformers cannot load this base model: {first}") from None
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def meta_model(folder: Path, dtype: str = "float32"):
    """The base's architecture with every parameter and buffer on the meta device (no memory,
    no weights read): for a caller that gives it tensors of its own (``load_state_dict(...,
    assign=True)``)."""
    silence_libraries()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with captured_output():
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def stored_weight_reader(base_info) -> Callable[[str], object]:
    """``reader(module_name)`` -> that module's weight as stored in the base's safetensors, or None.

    Fusing an adapter into a float16 in-memory base re-reads the few weights it targets at their
    stored precision, so W + delta is rounded to float16 once.
    """

    def read(module: str):
        from safetensors import safe_open

        info = base_info.tensors.get(f"{module}.weight")
        if info is None:
            return None
        with safe_open(str(info.file), framework="pt") as handle:
            return handle.get_tensor(f"{module}.weight")

    return read
