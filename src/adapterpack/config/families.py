"""Model families the export decoder supports, checked from config.json before torch is imported."""

from __future__ import annotations

from pathlib import Path

from adapterpack.errors import BadInput

# model_type -> human name. All share the Llama layout (pre-norm, rotary, gated MLP); Qwen2 adds
# q/k/v biases (inside the Linear layers), Qwen3 adds per-head q/k RMS norms.
SUPPORTED_FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}


def unsupported_message(model_type: object) -> str:
    names = ", ".join(f"{human} ({key})" for key, human in SUPPORTED_FAMILIES.items())
    return f"unsupported architecture {model_type!r}: supported are {names}"


# Sizes the export reads as Python ints (a string or float here would fail deep in torch).
SIZE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
    "num_key_value_heads", "head_dim",
)
OPTIONAL_SIZES = frozenset({"num_key_value_heads", "head_dim"})


def check_family(config: dict, config_file: Path) -> str:
    """Return the config's model_type, or raise BadInput naming the supported families."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_FAMILIES:
        raise BadInput(f"{config_file}: {unsupported_message(model_type)}")
    if config.get("partial_rotary_factor", 1.0) not in (1, 1.0, None):
        raise BadInput(f"{config_file}: partial rotary embeddings (partial_rotary_factor) are not supported")
    name = config.get("_name_or_path")
    if name is not None and not isinstance(name, str):
        raise BadInput(f"{config_file}: '_name_or_path' must be a string, found {name!r}")
    for key in SIZE_FIELDS:
        value = config.get(key)
        # Required sizes must be there; optional ones (head_dim, num_key_value_heads) may be absent or null.
        if (value is None and key in OPTIONAL_SIZES) or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            continue
        raise BadInput(f"{config_file}: {key!r} must be a positive integer, found {value!r}")
    return model_type
