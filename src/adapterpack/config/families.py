"""Model families the export decoder supports, checked from config.json before torch is imported:
which ``model_type`` values, and which weights each reads (a base must hold exactly those).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapterpack.errors import BadInput


@dataclass(frozen=True)
class Family:
    """A decoder family of the Llama layout (pre-norm, rotary, gated MLP) as transformers builds
    it: which optional weights its layers carry. A bias field is True (always), False (never)
    or the config key that switches it (as transformers' ``modeling_*.py`` reads it)."""

    title: str
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool = False  # per-head RMS norms of q and k (Qwen3, Gemma 3)
    tie_default: bool = False  # tie_word_embeddings when config.json does not say
    # Gemma 3: four norms per layer (each sublayer's output normalized before the residual add),
    # gains applied as (1 + w), attention types per layer (``layer_types``).
    sandwich_norms: bool = False

    def has(self, switch: bool | str, config: dict) -> bool:
        return switch if isinstance(switch, bool) else bool(config.get(switch, False))


# model_type -> family; from transformers 5.x modeling_{llama,mistral,qwen2,qwen3,gemma3}.py.
FAMILIES = {
    "llama": Family("Llama", qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "mistral": Family("Mistral"),
    "qwen2": Family("Qwen2", qkv_bias=True),
    "qwen3": Family("Qwen3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
    # Gemma3ForCausalLM (Gemma 3 270M and 1B; the text tower of the larger ones)
    "gemma3_text": Family(
        "Gemma 3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True, tie_default=True, sandwich_norms=True
    ),
}
# Gemma 3's attention types (transformers' Gemma3Attention: a sliding window or the whole cache).
LAYER_TYPES = ("sliding_attention", "full_attention")
SUPPORTED_FAMILIES = {key: family.title for key, family in FAMILIES.items()}


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
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if config.get(key) is not None and not isinstance(config[key], bool):
            raise BadInput(f"{config_file}: {key!r} must be true or false, found {config[key]!r}")
    if FAMILIES[model_type].sandwich_norms:
        _check_gemma(config, config_file)
    return model_type


def _check_gemma(config: dict, config_file: Path) -> None:
    """What Gemma 3's config may ask that the export does not compute."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise BadInput(f"{config_file}: {key} {config[key]!r} is not supported (softcapping is not exported); set it to null")
    if config.get("use_bidirectional_attention"):
        raise BadInput(f"{config_file}: use_bidirectional_attention is not supported: a decoder with a KV-cache attends causally")
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != config["num_hidden_layers"]:
            raise BadInput(f"{config_file}: 'layer_types' must list one attention type per layer ({config['num_hidden_layers']})")
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise BadInput(f"{config_file}: unknown layer_types {', '.join(unknown)}: supported are {', '.join(LAYER_TYPES)}")
    window = config.get("sliding_window")
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise BadInput(f"{config_file}: 'sliding_window' must be a positive integer, found {window!r}")
    scalar = config.get("query_pre_attn_scalar")
    if scalar is not None and not (isinstance(scalar, (int, float)) and not isinstance(scalar, bool) and scalar > 0):
        raise BadInput(f"{config_file}: 'query_pre_attn_scalar' must be a positive number, found {scalar!r}")


def tied_embeddings(config: dict) -> bool:
    """Whether the output head is the embedding (``tie_word_embeddings``, else the family's default)."""
    family = FAMILIES[config["model_type"]]
    tied = config.get("tie_word_embeddings")
    return family.tie_default if tied is None else bool(tied)


def read_weights(config: dict) -> dict[str, tuple[int, ...]]:
    """Every weight the family's transformers model reads for ``config``, with the shape the
    config implies (``check_family`` has checked the sizes are positive integers); the output
    head only when it is not tied to the embedding."""
    family = FAMILIES[config["model_type"]]
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    intermediate = config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    weights = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied_embeddings(config):
        weights["lm_head.weight"] = (vocab, hidden)
    per_layer = {
        "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (intermediate, hidden), "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate), "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if family.has(family.qkv_bias, config):
        per_layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if family.has(family.o_bias, config):
        per_layer["self_attn.o_proj.bias"] = (hidden,)
    if family.has(family.mlp_bias, config):
        per_layer |= {"mlp.gate_proj.bias": (intermediate,), "mlp.up_proj.bias": (intermediate,), "mlp.down_proj.bias": (hidden,)}
    if family.qk_norm:
        per_layer |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    if family.sandwich_norms:
        per_layer |= {"pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,)}
    for layer in range(layers):
        weights.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    return weights


def ignored_weight(name: str, config: dict) -> bool:
    """A stored tensor transformers drops on purpose: rotary frequencies older exports saved
    (recomputed from the config), and a copy of the embedding as the head of a tied model."""
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and tied_embeddings(config))
