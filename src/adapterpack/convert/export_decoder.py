"""Export-friendly decoder forward over a Hugging Face causal LM.

transformers' own ``forward`` does not convert to Core ML (its mask and cache code emit ops
coremltools cannot lower), so this module re-implements only the attention plumbing and calls the
HF modules themselves for everything with weights: embeddings, q/k/v/o projections (plain
``nn.Linear`` or peft LoRA layers), q/k norms, MLPs, final norm and ``lm_head``. The KV-cache is a
pair of registered buffers that coremltools turns into the ``keyCache``/``valueCache`` states of
the Swift contract.

Swift contract (swift-transformers ``LanguageModelWithStatefulKVCache``):
``inputIds`` (1, q) int32, ``causalMask`` (1, 1, q or 1, end) additive float16, states
``keyCache``/``valueCache``, output ``logits`` (1, q, vocab). This call's tokens are written at
cache positions ``start = end - q`` .. ``end - 1``, and the causal structure is built here: the
client sends ZEROS for ``causalMask``.

Two calling conventions meet here. Python clients in Apple's style send ``end = past + q``.
swift-transformers sends ``end = tokenCount + 1`` (every token so far, plus one), so its prompt
lands at positions 1..n and slot 0 is never written. Only rope's relative positions matter, so
both give the same logits provided a slot no call has written is never attended: a third state,
``writtenSlots``, marks the slots each call writes (``makeState()`` creates every state the model
declares, so the Swift client needs no change).

``AppleDecoder`` is the same decoder under the contract of Apple's own Core AI Swift runtime
(``export.contract: apple``), whose caches are arguments the runtime allocates and grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from adapterpack.config.families import FAMILIES, SUPPORTED_FAMILIES, unsupported_message
from adapterpack.errors import BadInput

# Large enough that exp() underflows to 0 in float16 softmax, small enough not to overflow
# when a caller's own additive mask is added on top.
MASK_NEGATIVE = -1.0e4
# Name of the state that marks written cache slots (1.0) against never-written ones (0.0, the
# value Core ML and the executor give a fresh state).
WRITTEN_SLOTS = "writtenSlots"
# The function's inputs, output and states, as swift-transformers names them (both formats).
INPUT_IDS = "inputIds"
CAUSAL_MASK = "causalMask"
LOGITS = "logits"
STATE_NAMES = ("keyCache", "valueCache", WRITTEN_SLOTS)
# Smallest row maximum an RMS norm divides by (2^-10): keeps eps / m / m finite in float16
# (at most eps * 2^20) while leaving the normalized row exact (see ``rms_norm``).
NORM_FLOOR = 2.0**-10


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (an HF RMSNorm: ``weight``, ``variance_epsilon``) of ``x``, exact in float16.

    Pretrained checkpoints carry "massive activations" (Sun et al., 2024): residual entries in
    the tens of thousands, whose mean square (10^6 on SmolLM2-135M) overflows float16's 65504.
    transformers upcasts to float32 inside the norm, but a float16 Core ML conversion drops that
    cast, so ``pow -> reduce_mean`` gives inf and the token's state becomes zero. RMSNorm is
    invariant to the row's scale, so divide by the row's largest magnitude m first:
    ``x / sqrt(mean(x^2) + eps) == (x/m) / sqrt(mean((x/m)^2) + eps/m^2)``, where every
    intermediate lies in [0, 1] (the mean is at least 1/n) or is bounded by eps / m^2. Chosen over
    the ``layer_norm([x, -x])`` form of Neural-Engine exporters because its safety does not
    depend on how a backend accumulates inside ``layer_norm``: each op here is exact in any
    float16 arithmetic, and all of them (abs, reduce_max, real_div, reduce_mean, rsqrt) are
    plain elementwise or reduction ops that the CPU, GPU and Neural Engine run.
    """
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    # transformers' own structure: float32 inside, the input's dtype out (a float16 torch model
    # traces to a float16 program either way; Core ML's float16 pass narrows the inside too).
    dtype = x.dtype
    x = x.to(torch.float32)
    largest = x.abs().amax(dim=-1, keepdim=True).clamp(min=NORM_FLOOR)
    scaled = x / largest
    # eps / m / m, not eps / m^2: m^2 would overflow for m > 256.
    variance = (scaled * scaled).mean(dim=-1, keepdim=True) + (eps / largest) / largest
    return norm.weight * (scaled * torch.rsqrt(variance)).to(dtype)


def gemma_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm`` (transformers' Gemma3RMSNorm: ``weight``, ``eps``) of ``x``, in float32 out.

    Gemma applies its gains as ``1 + w`` and multiplies in float32 before casting ("Llama does
    x.to(float16) * w whilst Gemma3 is (x * w).to(float16)", modeling_gemma3.py); its stored gains
    reach 152, so a post-sublayer norm's output (up to sqrt(hidden) * 153) goes to the float32
    residual as it is, and the caller casts the others. The row is scaled by its largest
    magnitude first, as in ``rms_norm``: Gemma 3 270M's residual reaches 103,821 at ``<bos>``.
    """
    x = x.to(torch.float32)
    largest = x.abs().amax(dim=-1, keepdim=True).clamp(min=NORM_FLOOR)
    scaled = x / largest
    variance = (scaled * scaled).mean(dim=-1, keepdim=True) + (float(norm.eps) / largest) / largest
    return (scaled * torch.rsqrt(variance)) * (1.0 + norm.weight.float())


@dataclass(frozen=True)
class DecoderShape:
    """Static sizes of a decoder, read once from its config as Python ints.

    Python ints (not ``tensor.shape`` arithmetic) keep ``aten::Int`` out of the traced graph.
    """

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    sliding_window: int | None
    # Gemma 3: each layer's attention type (``sliding_attention``: the window applies and the
    # local rope table; ``full_attention``: the whole cache and the global table). None: every
    # layer alike, the window (where set) applying to all.
    layer_types: tuple[str, ...] | None = None
    attention_scale: float | None = None  # query_pre_attn_scalar ** -0.5; None: 1 / sqrt(head_dim)
    sandwich_norms: bool = False  # Gemma 3's four norms per layer, (1 + w) gains

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_FAMILIES:
            raise BadInput(unsupported_message(model_type))
        n_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
        sliding = None
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            sliding = int(config.sliding_window)
        gemma = FAMILIES[model_type].sandwich_norms
        return cls(
            model_type=model_type,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            sliding_window=sliding,
            layer_types=tuple(config.layer_types) if gemma else None,
            attention_scale=_query_scale(config, head_dim) if gemma else None,
            sandwich_norms=gemma,
        )

    def attention_types(self) -> list[str | None]:
        """Each layer's attention type, in order of first use (None: the one type of every layer)."""
        return list(dict.fromkeys(self.layer_types)) if self.layer_types else [None]

    def kv_cache_shape(self, max_context: int) -> tuple[int, ...]:
        # (layers, batch, kv_heads, context, head_dim): the layout of Apple's stateful Llama export.
        return (self.n_layers, 1, self.n_kv_heads, max_context, self.head_dim)

    @staticmethod
    def written_slots_shape(max_context: int) -> tuple[int, ...]:
        # (batch, 1, 1, context): broadcasts against the (batch, heads, q, context) attention bias.
        return (1, 1, 1, max_context)


def _query_scale(config, head_dim: int) -> float | None:
    """Gemma's attention scale, ``query_pre_attn_scalar ** -0.5``; None where it is SDPA's own
    ``1 / sqrt(head_dim)`` (Gemma 3 270M and 1B)."""
    scalar = float(config.query_pre_attn_scalar)
    return None if scalar == head_dim else scalar**-0.5


def rope_tables(hf_model, shape: DecoderShape, max_context: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_context, head_dim) from the model's own rotary embedding (of
    ``layer_type``'s layers, for a model with one per attention type: Gemma 3).

    Reusing ``rotary_emb.inv_freq`` and ``attention_scaling`` keeps every rope variant HF
    implements (Llama 3 scaling, YaRN, linear) without re-deriving it here.
    """
    rotary = hf_model.model.rotary_emb
    prefix = f"{layer_type}_" if layer_type else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq").detach().to(torch.float64)
    scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
    positions = torch.arange(max_context, dtype=torch.float64)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.shape[-1] != shape.head_dim:
        raise BadInput(
            f"rotary embedding covers {emb.shape[-1]} of head_dim {shape.head_dim}: "
            "partial rotary embeddings are not supported"
        )
    return (emb.cos() * scaling).to(torch.float32), (emb.sin() * scaling).to(torch.float32)


def _table_name(table: str, kind: str | None) -> str:
    """A rope table's buffer name (and constant name in the program): ``rope_cos``, or per
    attention type ``rope_cos_sliding`` / ``rope_cos_full``."""
    return table if kind is None else f"{table}_{kind.removesuffix('_attention')}"


class _Decoder(nn.Module):
    """What both contracts share: the rope tables, the attention over a cache and the layers; a
    subclass says where the cache is and how a call's positions and mask are given."""

    def __init__(self, hf_model, max_context: int, logits_dtype: torch.dtype | None, scaled_norms: bool):
        super().__init__()
        self.logits_dtype = logits_dtype  # the contract's output type when computing in another
        # ``rms_norm`` for converters that narrow every op to float16 (coremltools); a converter
        # that keeps transformers' float32 upcast inside the norm (coreai-torch) gets the model's
        # own norm, already exact there.
        self.shape = DecoderShape.from_config(hf_model.config)
        if scaled_norms:
            self.norm = gemma_rms_norm if self.shape.sandwich_norms else rms_norm
        elif self.shape.sandwich_norms:
            # transformers' Gemma3RMSNorm returns its input's dtype: a post-sublayer norm of a
            # float16 output would overflow there (its gains reach 152). Given float32, it
            # returns float32, as ``gemma_rms_norm`` does.
            self.norm = lambda norm, x: norm(x.to(torch.float32))
        else:
            self.norm = lambda norm, x: norm(x)
        self.max_context = int(max_context)
        self.hf = hf_model
        for module in hf_model.model.embed_tokens.modules():
            if isinstance(getattr(module, "embed_scale", None), torch.Tensor):
                # Gemma scales its embeddings by sqrt(hidden), a float32 buffer cast to the
                # weights' dtype on every call; coremltools keeps that cast's constant float32
                # and then refuses the float16 multiply. Stored in the weights' dtype, the value
                # is the one transformers multiplies by.
                module.embed_scale = module.embed_scale.to(module.weight.dtype)
        for kind in self.shape.attention_types():
            cos, sin = rope_tables(hf_model, self.shape, self.max_context, kind)
            self.register_buffer(_table_name("rope_cos", kind), cos, persistent=False)
            self.register_buffer(_table_name("rope_sin", kind), sin, persistent=False)

    def _tables(self, positions) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """{attention type: (cos, sin) rows at ``positions``} (a slice or an index tensor)."""
        return {
            kind: (getattr(self, _table_name("rope_cos", kind))[positions], getattr(self, _table_name("rope_sin", kind))[positions])
            for kind in self.shape.attention_types()
        }

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.shape.head_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _allowed(self, q_len, start, end, kind: str | None = None) -> torch.Tensor:
        """(q, end) 1.0 where token i of this call (cache slot start + i) may attend slot j:
        causal, within the sliding window (of every layer, or of ``kind``'s layers)."""
        # Token i of this call sits at position start + i and sees keys 0..start + i.
        q_pos = torch.arange(q_len, dtype=torch.int32) + start
        k_pos = torch.arange(end, dtype=torch.int32)
        allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).to(torch.float32)
        if self.shape.sliding_window is not None and kind in (None, "sliding_attention"):
            inside = k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.shape.sliding_window
            allowed = allowed * inside.to(torch.float32)
        return allowed

    def _attend(self, layer_idx: int, attn, hidden, cos, sin, bias, start, end, key_cache, value_cache) -> torch.Tensor:
        s = self.shape
        q = attn.q_proj(hidden).view(1, -1, s.n_heads, s.head_dim)
        k = attn.k_proj(hidden).view(1, -1, s.n_kv_heads, s.head_dim)
        v = attn.v_proj(hidden).view(1, -1, s.n_kv_heads, s.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3, Gemma 3: RMS norm per head before rope
            narrow = q.dtype
            q = self.norm(attn.q_norm, q)
            k = self.norm(attn.k_norm, k)
            if self.shape.sandwich_norms:  # Gemma's norms give float32
                q, k = q.to(narrow), k.to(narrow)
        q = self._rotate(q.transpose(1, 2), cos, sin)
        k = self._rotate(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)

        key_cache[layer_idx, :, :, start:end, :] = k.to(key_cache.dtype)
        value_cache[layer_idx, :, :, start:end, :] = v.to(value_cache.dtype)
        keys = key_cache[layer_idx, :, :, :end, :].to(q.dtype)
        values = value_cache[layer_idx, :, :, :end, :].to(q.dtype)

        groups = s.n_heads // s.n_kv_heads
        if groups > 1:  # grouped-query attention: repeat each kv head for its query heads
            keys = keys.unsqueeze(2).repeat(1, 1, groups, 1, 1).flatten(1, 2)
            values = values.unsqueeze(2).repeat(1, 1, groups, 1, 1).flatten(1, 2)

        if s.attention_scale is not None:
            # Gemma's query_pre_attn_scalar ** -0.5 in place of 1 / sqrt(head_dim), applied to q:
            # coremltools lowers SDPA's own ``scale`` as a float32 constant that a float16 q
            # cannot be multiplied by (nor a Python float: the converter widens q to float32).
            q = q * torch.tensor(s.attention_scale * s.head_dim**0.5, dtype=q.dtype)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
        out = out.transpose(1, 2).reshape(1, -1, s.n_heads * s.head_dim)
        return attn.o_proj(out)

    def _logits(self, hidden, cos, sin, bias, start, end, key_cache, value_cache) -> torch.Tensor:
        """Every layer over the embedded tokens ``hidden``, then the final norm and the head."""
        body = self.hf.model
        # The residual stream is carried in float32, the rest computes in the model's dtype. A
        # trained checkpoint's attention-sink tokens reach tens of thousands in a few residual
        # channels, which the last layers cancel again: in float16 (spacing 16 at 25,000) that
        # cancellation leaves errors of several units, which the final norm passes on to the
        # logits (SmolLM2-135M's fused shout: max logit error 0.41 at position 1 with a float16
        # residual, 0.09 with a float32 one). A cast and an add per sublayer, one row per token.
        narrow = hidden.dtype
        hidden = hidden.to(torch.float32)
        for idx, layer in enumerate(body.layers):
            residual = hidden
            hidden = self.norm(layer.input_layernorm, hidden).to(narrow)
            hidden = residual + self._attend(
                idx, layer.self_attn, hidden, cos, sin, bias, start, end, key_cache, value_cache
            ).to(torch.float32)
            residual = hidden
            hidden = self.norm(layer.post_attention_layernorm, hidden).to(narrow)
            hidden = residual + layer.mlp(hidden).to(torch.float32)
        return self._head(hidden, narrow)

    def _head(self, hidden, narrow) -> torch.Tensor:
        hidden = self.norm(self.hf.model.norm, hidden).to(narrow)
        logits = self.hf.lm_head(hidden)
        return logits if self.logits_dtype is None else logits.to(self.logits_dtype)

    def _gemma_logits(self, hidden, tables, biases, start, end, key_cache, value_cache) -> torch.Tensor:
        """Gemma 3's layers (transformers' Gemma3DecoderLayer): each sublayer's output is
        normalized before it joins the residual, and each layer attends by its type, with that
        type's rope table and mask (``tables``, ``biases``: by attention type). The residual is
        carried in float32, as in ``_logits``."""
        narrow = hidden.dtype
        hidden = hidden.to(torch.float32)
        for idx, layer in enumerate(self.hf.model.layers):
            kind = self.shape.layer_types[idx]
            cos, sin = tables[kind]
            normed = self.norm(layer.input_layernorm, hidden).to(narrow)
            attended = self._attend(idx, layer.self_attn, normed, cos, sin, biases[kind], start, end, key_cache, value_cache)
            hidden = hidden + self.norm(layer.post_attention_layernorm, attended)
            normed = self.norm(layer.pre_feedforward_layernorm, hidden).to(narrow)
            hidden = hidden + self.norm(layer.post_feedforward_layernorm, layer.mlp(normed))
        return self._head(hidden, narrow)


class ExportDecoder(_Decoder):
    """Stateful decoder forward: ``(inputIds, causalMask) -> logits``, cache in buffers."""

    def __init__(
        self,
        hf_model,
        max_context: int,
        cache_dtype: torch.dtype = torch.float16,
        logits_dtype: torch.dtype | None = None,
        scaled_norms: bool = True,
    ):
        super().__init__(hf_model, max_context, logits_dtype, scaled_norms)
        cache_shape = self.shape.kv_cache_shape(self.max_context)
        # Buffer names become the Core ML state names.
        self.register_buffer("keyCache", torch.zeros(cache_shape, dtype=cache_dtype))
        self.register_buffer("valueCache", torch.zeros(cache_shape, dtype=cache_dtype))
        self.register_buffer(
            WRITTEN_SLOTS, torch.zeros(self.shape.written_slots_shape(self.max_context), dtype=cache_dtype)
        )

    def reset_cache(self) -> None:
        self.keyCache.zero_()
        self.valueCache.zero_()
        self.writtenSlots.zero_()

    def _attention_bias(self, inputIds, start, end, causal_mask: torch.Tensor) -> torch.Tensor:  # noqa: N803
        """Additive bias (1, 1, q, end): causal, sliding window, written slots, plus the caller's mask.

        Built from arithmetic on full-shaped tensors, not ``torch.where`` on scalars: coremltools
        broadcasts ``select`` only for static shapes and would declare a rank-0 result here.
        """
        q_len = inputIds.shape[-1]
        # Mark this call's slots as written before reading them back.
        written = torch.ones_like(inputIds, dtype=self.writtenSlots.dtype).view(1, 1, 1, -1)
        self.writtenSlots[:, :, :, start:end] = written
        seen = self.writtenSlots[:, :, :, :end].to(torch.float32)
        # Token i of this call sits at position start + i and sees keys 0..start + i. (Written
        # out here, not through ``_allowed``: the traced program names its values after these
        # variables, and the package's bytes must not change.)
        q_pos = torch.arange(q_len, dtype=torch.int32) + start
        k_pos = torch.arange(end, dtype=torch.int32)
        allowed = (k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)).to(torch.float32)
        if self.shape.sliding_window is not None:
            inside = k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.shape.sliding_window
            allowed = allowed * inside.to(torch.float32)
        allowed = allowed.unsqueeze(0).unsqueeze(0) * seen
        # The caller's mask is only added on top; (1, 1, 1, end) broadcasts over the query axis.
        return (1.0 - allowed) * MASK_NEGATIVE + causal_mask.to(torch.float32)

    def forward(self, inputIds: torch.Tensor, causalMask: torch.Tensor) -> torch.Tensor:  # noqa: N803
        q_len = inputIds.shape[-1]
        end = causalMask.shape[-1]
        start = end - q_len
        hidden = self.hf.model.embed_tokens(inputIds)
        if self.shape.layer_types is not None:
            tables = {kind: (cos.to(hidden.dtype), sin.to(hidden.dtype)) for kind, (cos, sin) in self._tables(slice(start, end)).items()}
            biases = self._attention_biases(inputIds, start, end, causalMask, hidden.dtype)
            return self._gemma_logits(hidden, tables, biases, start, end, self.keyCache, self.valueCache)
        cos = self.rope_cos[start:end].to(hidden.dtype)
        sin = self.rope_sin[start:end].to(hidden.dtype)
        bias = self._attention_bias(inputIds, start, end, causalMask).to(hidden.dtype)
        return self._logits(hidden, cos, sin, bias, start, end, self.keyCache, self.valueCache)

    def _attention_biases(self, inputIds, start, end, causal_mask, dtype) -> dict[str, torch.Tensor]:  # noqa: N803
        """{attention type: additive bias (1, 1, q, end)}, as ``_attention_bias`` builds it, the
        sliding window for the sliding layers alone."""
        written = torch.ones_like(inputIds, dtype=self.writtenSlots.dtype).view(1, 1, 1, -1)
        self.writtenSlots[:, :, :, start:end] = written
        seen = self.writtenSlots[:, :, :, :end].to(torch.float32)
        caller = causal_mask.to(torch.float32)
        return {
            kind: ((1.0 - self._allowed(inputIds.shape[-1], start, end, kind).unsqueeze(0).unsqueeze(0) * seen) * MASK_NEGATIVE + caller).to(dtype)
            for kind in self.shape.attention_types()
        }


class AppleDecoder(_Decoder):
    """The decoder as Apple's Core AI Swift runtime calls it (apple/coreai-models 86b363d):
    ``(input_ids, position_ids, key_cache, value_cache) -> logits``.

    From ``CoreAISequentialEngine.swift`` (``processTokenBatch``) and
    ``Handlers/StateHandler+NDArray.swift`` (``GrowingNDArrayState``): ``input_ids`` (1, q) Int32
    are this call's tokens; ``position_ids`` (1, processed + q) Int32 are 0..processed + q - 1,
    every position so far, so the call starts at ``position_ids.shape[1] - q`` (as Apple's own
    exported models read it, ``models/macos/qwen2.py``); the two caches are states the runtime
    allocates (capacity 256, doubled while a call needs more, up to the bundle's
    ``max_context_length``) and grows by copying the filled prefix into a new array whose other
    slots are left uninitialized, so a call reads exactly slots 0..end - 1 and never a mask over
    more; causality is the graph's, rope takes the position ids' values; logits (1, q, vocab)
    float16 are the first output.
    """

    def forward(self, input_ids, position_ids, key_cache, value_cache) -> torch.Tensor:
        q_len = input_ids.shape[-1]
        end = position_ids.shape[-1]
        start = end - q_len
        hidden = self.hf.model.embed_tokens(input_ids)
        positions = position_ids[0, start:end].to(torch.long)
        if self.shape.layer_types is not None:
            tables = {kind: (cos.to(hidden.dtype), sin.to(hidden.dtype)) for kind, (cos, sin) in self._tables(positions).items()}
            biases = {
                kind: ((1.0 - self._allowed(q_len, start, end, kind)) * MASK_NEGATIVE).unsqueeze(0).unsqueeze(0).to(hidden.dtype)
                for kind in self.shape.attention_types()
            }
            return self._gemma_logits(hidden, tables, biases, start, end, key_cache, value_cache)
        cos = self.rope_cos[positions].to(hidden.dtype)
        sin = self.rope_sin[positions].to(hidden.dtype)
        bias = ((1.0 - self._allowed(q_len, start, end)) * MASK_NEGATIVE).unsqueeze(0).unsqueeze(0).to(hidden.dtype)
        return self._logits(hidden, cos, sin, bias, start, end, key_cache, value_cache)
