"""A real pretrained checkpoint from a GGUF file that a package on the registries ships, saved as
a Hugging Face folder: transformers reads the GGUF (with the ``gguf`` package) de-quantized into
torch, the state dict is copied into a fresh model of the same config and saved as bfloat16
safetensors, as checkpoints are published, with its tokenizer. Used by ``smollm2.py`` and
``gemma3.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def save_from_gguf(folder: Path, gguf_name: str, hub_name: str, dest: Path) -> Path:
    """``folder / gguf_name`` as a Hugging Face folder at ``dest`` (whole or not at all), its
    config naming ``hub_name`` (the id the Swift app resolves the tokenizer by)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = hub_name
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    staged = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    model.save_pretrained(staged, safe_serialization=True)
    tokenizer.save_pretrained(staged)
    shutil.rmtree(dest, ignore_errors=True)
    staged.rename(dest)
    return dest
