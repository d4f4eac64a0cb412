"""Compress a torch model's weights the way a Core AI asset stores them, before it is exported.

coreai-torch lowers three custom ops to Core AI's compressed constants: ``coreai::lut_to_dense``
(palettized), ``coreai::constexpr_blockwise_shift_scale`` (linear int4/int8) and
``coreai::sparse_to_dense`` (pruned). Each compressed ``nn.Linear``/``nn.Embedding`` is swapped for
one whose weight is such an op over constant buffers, so the exported program carries the
compressed form and the converter writes it as is.

Compressing in torch, not on the converted program, keeps the manifest's rules by weight name
(``keep_float16``, LoRA matrices, per-adapter overrides), and the palettes come from the same
k-means and palette store as the ``.mlpackage`` (``palettes.PaletteStore``), and linear integers
from the same quantization (``quantize.stored_quantized``: coremltools' own, or error-compensated
with calibration text). A weight met again in
a later function (the base's, in every fused adapter) is served the very same buffers, so the
base is compressed once and the converter stores it once.

    weights = CoreAIWeights(palettes)
    with swapped_modules(model, weights.replacements(model, compression, lora_compression)):
        export(model)           # (conversion.swapped_modules)
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from adapterpack.compress.palettes import PaletteStore, content_digest, grouped_rows
from adapterpack.compress.quantize import stored_quantized
from adapterpack.config.compression import Compression, weight_setting

log = logging.getLogger(__name__)


def _custom_layers():
    # coreai-torch is the optional [coreai] extra: imported only when this format is built.
    from coreai_torch._compression import custom_layers

    return custom_layers


class _CompressedLinear(nn.Module):
    def __init__(self, weight: nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.weight_source = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_source().to(x.dtype), self.bias)


class _CompressedEmbedding(nn.Module):
    def __init__(self, weight: nn.Module, padding_idx: int | None, scale: torch.Tensor | None = None):
        super().__init__()
        self.weight_source = weight
        self.padding_idx = padding_idx
        # Gemma's embedding multiplies what it looks up by sqrt(hidden), in the weights' dtype
        # (transformers' Gemma3TextScaledWordEmbedding)
        self.lookup_scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        found = F.embedding(ids, self.weight_source(), self.padding_idx)
        return found if self.lookup_scale is None else found * self.lookup_scale


def _symmetric_int(weight: np.ndarray, compression: Compression, name: str, store: PaletteStore) -> nn.Module | None:
    """Linear symmetric quantization, coremltools' ``linear_symmetric`` (q within
    +-(2^(n-1) - 1)), with the integers error-compensated where ``store``'s importance has the
    layer's Gram: exactly what the ``.mlpackage`` stores (``quantize.stored_quantized``)."""
    if weight.ndim != 2:
        return None  # not a matrix: left float16
    found = stored_quantized(weight, compression, name, store)
    if found is None:
        return None  # blocks must tile the input channels; left float16, as coremltools leaves it
    quantized, scale = found
    return _custom_layers().WeightDequantizeModule(
        torch.from_numpy(quantized),
        torch.from_numpy(scale.astype(np.float16)),
        input_dtype=torch.int4 if compression.nbits == 4 else torch.int8,
    )


def _magnitude_pruned(weight: np.ndarray, compression: Compression, name: str, store: PaletteStore) -> nn.Module:
    """The smallest ``sparsity`` of the weights by magnitude set to zero, as coremltools' magnitude pruner."""
    layers = _custom_layers()
    flat = weight.reshape(-1)
    drop = int(round(flat.size * compression.sparsity))
    keep = np.ones(flat.size, dtype=bool)
    if drop:
        keep[np.argpartition(np.abs(flat.astype(np.float32)), drop - 1)[:drop]] = False
    mask = keep.reshape(weight.shape)
    return layers.SparseModule(torch.from_numpy(np.ascontiguousarray(weight[mask])), torch.from_numpy(mask))


# Methods that compress each weight on its own (palettization clusters many together, in batches).
ONE_AT_A_TIME = {"linear": _symmetric_int, "prune": _magnitude_pruned}


class CoreAIWeights:
    """Compressed weight modules for every function of one asset, shared by content."""

    def __init__(self, palettes: PaletteStore | None = None):
        self.palettes = palettes if palettes is not None else PaletteStore()
        self._made: dict[str, nn.Module | None] = {}
        self.compressed_count = 0
        self.reused_count = 0

    def _palettized(self, weights: dict[str, np.ndarray], compression: Compression, progress) -> dict[str, nn.Module | None]:
        layers = _custom_layers()
        grouped = {name: grouped_rows(value, compression) for name, value in weights.items()}
        made: dict[str, nn.Module | None] = {name: None for name, flat in grouped.items() if flat is None}
        names = [name for name, flat in grouped.items() if flat is not None]
        found = self.palettes.in_order(
            [weights[n].size for n in names],
            lambda i: grouped[names[i]],
            compression.nbits,
            named=lambda i: (names[i], weights[names[i]].shape),
        )
        total, done = sum(weights[n].size for n in names), 0
        for name in names:
            luts, indices = next(found)
            value = weights[name]
            # lut_to_dense: lut (groups, 1, ..., entries, 1) over indices shaped as the weight.
            lut = luts.astype(value.dtype).reshape(luts.shape[0], *([1] * (value.ndim - 1)), luts.shape[1], 1)
            made[name] = layers.PalettizeModule(torch.from_numpy(indices.reshape(value.shape)), torch.from_numpy(lut))
            done += value.size
            progress(done, total)
        return made

    def modules(
        self, weights: dict[str, np.ndarray], compression: Compression, progress=lambda done, total: None
    ) -> dict[str, nn.Module | None]:
        """Name -> module whose forward gives the weight as Core AI stores it (None: left float16).

        ``progress(done, total)`` counts the weight values palettized so far."""
        keys = {name: content_digest(value, self._label(name, value.shape, compression)) for name, value in weights.items()}
        pending = {name: weights[name] for name, key in keys.items() if key not in self._made}
        self.reused_count += len(weights) - len(pending)
        if pending:
            if compression.method == "palettize":
                fresh = self._palettized(pending, compression, progress)
            else:
                compress = ONE_AT_A_TIME[compression.method]
                fresh = {name: compress(value, compression, name, self.palettes) for name, value in pending.items()}
            for name, module in fresh.items():
                self._made[keys[name]] = module
                self.compressed_count += module is not None
        return {name: self._made[key] for name, key in keys.items()}

    def _label(self, name: str, shape: tuple[int, ...], compression: Compression) -> str:
        """What a weight's module depends on besides its values: the setting, and for compensated
        integers the importance of its layer (palettes are keyed by the store itself)."""
        label = compression.model_dump_json()
        importance = self.palettes.importance
        if compression.compensated() and importance is not None and importance.compensates(name, shape):
            label += f"|importance {importance.digest(name)}"
        return label

    def replacements(
        self,
        model: nn.Module,
        compression: Compression,
        lora_compression: Compression | None = None,
        progress=lambda done, total: None,
    ) -> dict[str, nn.Module]:
        """Module name -> the module to put in its place: each linear layer or embedding whose
        weight the manifest compresses, computing from the compressed form.
        ``progress(done, total)``: see ``modules``."""
        chosen: dict[Compression, dict[str, nn.Module]] = {}
        # isinstance: Gemma's embedding is a subclass. An output head tied to the embedding is
        # decided by the embedding's name, as the .mlpackage decides their one constant.
        embeddings = {id(m.weight): name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
        for name, module in model.named_modules():
            if not (type(module) is nn.Linear or isinstance(module, nn.Embedding)):
                continue
            decided_by = embeddings.get(id(module.weight), name)
            setting = weight_setting(decided_by, tuple(module.weight.shape), compression, lora_compression)
            if setting is not None:
                chosen.setdefault(setting, {})[name] = module
        replaced: dict[str, nn.Module] = {}
        for setting, members in chosen.items():
            values = {name: m.weight.detach().to(torch.float16).numpy() for name, m in members.items()}
            for name, source in self.modules(values, setting, progress).items():
                if source is None:
                    log.debug("%s left float16: %s does not split it into groups or blocks", name, setting.describe())
                    continue
                module = members[name]
                if isinstance(module, nn.Linear):
                    replaced[name] = _CompressedLinear(source, module.bias)
                else:
                    scale = getattr(module, "embed_scale", None)
                    scale = scale.to(module.weight.dtype) if isinstance(scale, torch.Tensor) else None
                    replaced[name] = _CompressedEmbedding(source, module.padding_idx, scale)
        return replaced
