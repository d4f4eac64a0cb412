"""Load the base model once, in float32, from safetensors only (never remote code)."""

from __future__ import annotations

import logging
from pathlib import Path

from .errors import BadInput
from .quiet import captured_output, silence_libraries

log = logging.getLogger(__name__)


def load_base(folder: Path):
    """Load a Hugging Face causal LM from a local folder for export and as the reference."""
    silence_libraries()
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with captured_output():
            model = AutoModelForCausalLM.from_pretrained(
                str(folder),
                dtype=torch.float32,
                use_safetensors=True,
                trust_remote_code=False,
                local_files_only=True,
            )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise BadInput(f"{folder}: transformers cannot load this base model: {first}") from None
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model
