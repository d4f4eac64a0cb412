"""What each compression does to a real checkpoint's functions, on text: side by side, one run.

Per function of the manifest (the base, and each adapter fused into it as ``lora: fuse`` does)
and per compression, the function's weights are compressed as a build compresses them (the
project's one rule picks the weights, ``keep_float16``, per-layer exceptions and sizes included;
the compressed forms are the Core AI writer's, whose palettes are the ``.mlpackage``'s) and
computed in float32 torch, so that what is measured is the compression alone, not float16
arithmetic (verify measures that). Against the same function in float32: perplexity ratio on
the text, top-1 agreement, and for an adapter its retention (the cosine between the compressed
function's change from the float32 base and the adapter's own change, over every scored position
and logit). Bytes: what the function's weights take in the package (float16 where left
uncompressed).

Compressions ending in ``-data-aware`` are what a build with calibration text makes: palettes
weighted by the activations of the manifest's calibration texts (``compress.importance``), their
entries chosen with error compensation (``compress.compensation``), and linear int4 integers
chosen with it at coremltools' scales (``compress.quantize``); ``-weighted`` ones are the
same palettes with each weight's nearest entry (weighting alone); ``-self`` ones are what a
build without calibration text makes (the same, on text the base writes itself:
``assemble.calibration``); the other labels use no statistics at all; ``auto`` is what ``compression: auto`` chooses per
function (data-aware, its default targets or ``--auto-ratio``/``--auto-retention``).
``palettize-4-channel-scale`` and ``palettize-4-outliers`` are forms a build does not write,
emulated to compare them with what it does (``EMULATED``). With
``--heldout DIR``, each function is measured on ``DIR/<function>.txt`` (text the calibration
never saw), else every function on ``--text``. With ``--embedding LABEL`` (repeatable), each
compression is measured again with the token embedding (and the output head, when tied to it)
compressed by ``LABEL``'s data-free form instead of kept float16: what a large vocabulary's
embedding costs to compress, the rest of the function as the compression leaves it.

    .venv/bin/python scripts/smollm2.py       # the checkpoint, once
    .venv/bin/python benchmarks/quality.py [--manifest manifests/smollm2.yaml] [--heldout adapters/smollm2/heldout]
        [--text adapters/demo/heldout.txt] [--function base ...] [--compression palettize-4 ...] [--window 256] [--json F]
        [--embedding linear-8 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KEEP_FLOAT16 = ["embed_tokens", "lm_head"]  # as the shipped manifests keep them
COMPRESSIONS = {
    "float16": {"method": "none"},
    "palettize-4-data-aware": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "palettize-4-group4-data-aware": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 4},
    "palettize-4-group1-data-aware": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 1},
    "palettize-4-weighted": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "auto": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16, "auto": {}},
    "palettize-8": {"method": "palettize", "nbits": 8, "granularity": "per_grouped_channel", "group_size": 16},
    "palettize-6": {"method": "palettize", "nbits": 6, "granularity": "per_grouped_channel", "group_size": 16},
    "palettize-4": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "palettize-4-group1": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 1},
    "linear-8": {"method": "linear", "nbits": 8, "granularity": "per_channel"},
    "linear-4-block32": {"method": "linear", "nbits": 4, "granularity": "per_block", "block_size": 32},
    "palettize-4-group2": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 2},
    "palettize-4-group4": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 4},
    "palettize-4-channel-scale": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "palettize-4-outliers": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "linear-4-block32-data-aware": {"method": "linear", "nbits": 4, "granularity": "per_block", "block_size": 32},
    "palettize-4-group1-self": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 1},
    "palettize-4-self": {"method": "palettize", "nbits": 4, "granularity": "per_grouped_channel", "group_size": 16},
    "linear-4-block32-self": {"method": "linear", "nbits": 4, "granularity": "per_block", "block_size": 32},
}
# Data-free forms compared for the default that builds do not write, emulated here on the
# palettes of groups of 16: coremltools' per-channel scale before clustering
# (``enable_per_channel_scale``: each output channel divided by its largest magnitude, a float16
# scale per channel stored beside the palettes), and the largest weights kept exact beside them
# (a sparse overlay: iOS 18's sparse constant, a one-bit mask per weight plus the kept float16
# values), OUTLIER_SHARE of each weight's values.
EMULATED = ("palettize-4-channel-scale", "palettize-4-outliers")
OUTLIER_SHARE = 0.001


def fused(base, checked, function: str):
    """The function in float32: ``base`` with the adapter merged into its weights (fuse); the
    base itself for the base function. Restored on exit."""
    import contextlib

    from adapterpack.convert.lora import applied_adapter

    adapter = checked.manifest.adapter(function)
    if adapter is None:
        return contextlib.nullcontext(base)
    return applied_adapter(base, checked.adapters[function].folder, mode="fuse", scale=float(adapter.scale))


def weight_bytes(model, compression) -> int:
    """The bytes all the function's linear and embedding weights take in the package."""
    from torch import nn

    from adapterpack.config.compression import compressed_bytes, weight_setting

    total = 0
    for name, module in model.named_modules():
        # isinstance: Gemma's embedding is a subclass (it scales what it looks up)
        if (type(module) is nn.Linear or isinstance(module, nn.Embedding)) and not (
            name == "lm_head" and model.config.tie_word_embeddings
        ):
            shape = tuple(module.weight.shape)
            total += compressed_bytes(shape, weight_setting(name, shape, compression))
    return total


def compressed_weights(model, compression, importance=None) -> tuple[dict, int]:
    """Module name -> dense float32 weight as the package stores it (compressed ones only), and
    ``weight_bytes``."""
    import torch

    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.formats.aimodel.weights import CoreAIWeights

    total = weight_bytes(model, compression)
    if compression.method == "none":
        return {}, total
    with torch.no_grad():
        weights = CoreAIWeights(PaletteStore(importance=importance))
        dense = {name: module.weight_source().float() for name, module in weights.replacements(model, compression).items()}
    return dense, total


def looked_up(store, value, setting):
    """``value`` (float16, numpy) palettized with ``setting`` by ``store`` and looked up again:
    the dense float32 weight the palettes and indices stand for (Core AI's own lookup repeats
    each group's palette per weight: a 262k-row table at 8 bits would take 80 GB)."""
    import numpy as np
    import torch

    from adapterpack.compress.palettes import grouped_rows

    luts, indices = store.tensor_palettes([grouped_rows(value, setting)], setting.nbits)[0]
    rows = np.take_along_axis(luts.astype(np.float16).astype(np.float32), indices.astype(np.int64), 1)
    return torch.from_numpy(rows.reshape(value.shape))


_EMBEDDINGS: dict[tuple, tuple[dict, int]] = {}  # functions that leave the embedding alone share it


def embedding_weights(model, label: str) -> tuple[dict, int]:
    """``compressed_weights`` of the token embedding alone, compressed data-free as ``label`` says
    (``keep_float16`` emptied): {its module name: dense float32 weight}, and its bytes."""
    import torch
    from torch import nn

    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.config.compression import Compression, compressed_bytes, weight_setting
    from adapterpack.formats.aimodel.weights import CoreAIWeights

    compression = Compression(**COMPRESSIONS[label], keep_float16=())
    name, embedding = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding))
    shape = tuple(embedding.weight.shape)
    key = (label, name, float(embedding.weight.detach().double().sum()))
    if key not in _EMBEDDINGS:
        setting = weight_setting(name, shape, compression)
        with torch.no_grad():
            if setting.method == "palettize":
                dense = looked_up(PaletteStore(), embedding.weight.detach().half().numpy(), setting)
            else:
                # its table as a plain embedding (Gemma's scales at lookup, which the model still
                # does) under its own name, so the one rule decides it as it decides the build's
                holder = nn.Module()
                holder.add_module(name.replace(".", "_"), nn.Embedding.from_pretrained(embedding.weight.detach()))
                (module,) = CoreAIWeights(PaletteStore()).replacements(holder, compression).values()
                dense = module.weight_source().float()
        _EMBEDDINGS[key] = {name: dense}, compressed_bytes(shape, setting)
    return _EMBEDDINGS[key]


def emulated_weights(model, compression, label: str) -> tuple[dict, int]:
    """``compressed_weights`` of an ``EMULATED`` form: data-free palettes in groups of 16 of each
    weight the build compresses, with per-channel scales or outliers kept exact."""
    import torch
    from torch import nn

    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.config.compression import weight_setting

    dense, total = {}, weight_bytes(model, compression)
    store = PaletteStore()
    for name, module in model.named_modules():
        setting = weight_setting(name, tuple(module.weight.shape), compression) if type(module) in (nn.Linear, nn.Embedding) else None
        if setting is None:
            continue
        weight = module.weight.detach().float()
        scale = torch.ones(weight.shape[0], 1)
        if label == "palettize-4-channel-scale":
            scale = weight.abs().amax(1, keepdim=True).clamp(min=1e-8).half().float()
            total += 2 * weight.shape[0]
        rebuilt = looked_up(store, (weight / scale).half().numpy(), setting) * scale
        if label == "palettize-4-outliers":
            kept = max(1, int(OUTLIER_SHARE * weight.numel()))
            where = torch.topk(weight.abs().flatten(), kept).indices
            rebuilt.view(-1)[where] = weight.view(-1)[where].half().float()
            total += weight.numel() // 8 + 2 * kept
        dense[name] = rebuilt
    return dense, total


def scored_logits(model, ids: list[int], window: int):
    """(logits, targets) of every scored position: the windows ``eval`` uses."""
    import torch

    from adapterpack.evaluate.perplexity import windows

    logits, targets = [], []
    with torch.no_grad():
        for start, end, first in windows(len(ids), window):
            out = model(torch.tensor([ids[start:end]])).logits[0].float()
            logits.append(out[first - start - 1 : end - start - 1])
            targets.append(torch.tensor(ids[first:end]))
    return torch.cat(logits), torch.cat(targets)


def figures(got, reference, base, targets) -> dict[str, float]:
    import torch

    def perplexity(logits) -> float:
        return math.exp(float(torch.nn.functional.cross_entropy(logits.double(), targets)))

    found = {
        "perplexity": perplexity(got),
        "reference_perplexity": perplexity(reference),
        "top1": float((got.argmax(-1) == reference.argmax(-1)).double().mean()),
    }
    found["ratio"] = found["perplexity"] / found["reference_perplexity"]
    if base is not None:
        from adapterpack.verification.metrics import retention

        found["retention"] = retention(got.numpy(), reference.numpy(), base.numpy())[0]
    return found


def compressed_form(model, compression, label: str, importance=None) -> tuple[dict, int, float]:
    """(``compressed_weights`` or ``emulated_weights`` of ``label``, seconds it took)."""
    began = time.perf_counter()
    if label in EMULATED:
        dense, size = emulated_weights(model, compression, label)
    else:
        dense, size = compressed_weights(model, compression, importance)
    return dense, size, time.perf_counter() - began


def compared(model, compressed: tuple[dict, int, float], ids: list[int], window: int, reference, base_logits, targets,
             embedding: str | None = None) -> dict:
    """``model`` with its weights as ``compressed`` (``compressed_form``) stores them (and its
    embedding compressed by the ``embedding`` label, when given), against ``reference``; the
    model's weights are restored after."""
    import torch
    from torch import nn

    dense, size, seconds = compressed
    began = time.perf_counter() - seconds
    if embedding is not None:
        own, own_size = embedding_weights(model, embedding)
        kept = next(m for m in model.modules() if isinstance(m, nn.Embedding)).weight
        size += own_size - 2 * kept.numel()  # what the compression stored for it: float16
        dense = dense | own
    originals = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        with torch.no_grad():
            for name, p in model.named_parameters():
                module = name.removesuffix(".weight")
                # what the package leaves uncompressed, it stores in float16
                p.copy_(dense[module] if module in dense and name.endswith(".weight") else p.half().float())
        got, _ = scored_logits(model, ids, window)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(originals[name])
    return figures(got, reference, base_logits, targets) | {"bytes": size, "seconds": round(time.perf_counter() - began, 1)}


def chosen(checked, label: str, auto_targets: dict) -> dict:
    """{function: Compression} of ``label`` for every function of ``checked`` (auto: searched)."""
    import tempfile

    from adapterpack.assemble.auto import resolve_auto
    from adapterpack.assemble.cache import FolderPalettes
    from adapterpack.assemble.records import Reporter
    from adapterpack.config.compression import Compression

    settings = dict(COMPRESSIONS[label], keep_float16=KEEP_FLOAT16)
    if label != "auto":
        return {name: Compression(**settings) for name in checked.manifest.function_names}
    settings["auto"] = auto_targets
    manifest = checked.manifest.model_copy(update={"compression": Compression(**settings)})
    with tempfile.TemporaryDirectory() as scratch:
        resolved, _ = resolve_auto(replace(checked, manifest=manifest), Reporter(), FolderPalettes(Path(scratch)))
    return {name: resolved.manifest.compression_for(name) for name in checked.manifest.function_names}


def run(manifest: Path, texts, functions: list[str] | None, compressions: list[str], window: int, auto_targets: dict,
        embeddings: list[str] | None = None) -> dict:
    """``texts``: one text file for every function, or a folder of ``<function>.txt``."""
    from adapterpack.assemble.calibration import channel_importance
    from adapterpack.assemble.records import Reporter
    from adapterpack.compress.importance import ChannelImportance
    from adapterpack.config.compression import Compression
    from adapterpack.convert.base_model import load_base
    from adapterpack.inputs.checked import check_inputs
    from adapterpack.inputs.text import load_tokenizer

    checked = check_inputs(manifest)
    tokenizer = load_tokenizer(checked.base.folder)
    names = functions or list(checked.manifest.function_names)

    def text_of(function: str) -> Path:
        return texts / f"{function}.txt" if texts.is_dir() else texts

    results: dict = {"manifest": str(manifest), "text": str(texts), "window": window, "functions": {}, "tokens": {}}
    importance = own_text = None
    # the statistics a palettizing build of this manifest weighs by, whatever it compresses with
    palettized = replace(checked, manifest=checked.manifest.model_copy(update={"compression": Compression(method="palettize")}))
    if any(label.endswith(("data-aware", "weighted", "auto")) for label in compressions):
        importance = channel_importance(palettized, Reporter())
    if any(label.endswith("self") for label in compressions):
        # what a build of it without calibration text weighs by: text the base writes
        own_text = channel_importance(replace(palettized, calibration={}), Reporter())
    settings = {label: chosen(checked, label, auto_targets) for label in compressions}
    base = load_base(checked.base.folder, dtype="float32").eval()
    for function in names:
        ids = tokenizer(text_of(function).read_text(encoding="utf-8"))["input_ids"]
        results["tokens"][function] = len(ids)
        base_logits, targets = scored_logits(base, ids, window)
        adapter = checked.manifest.adapter(function) is not None
        with fused(base, checked, function) as model:
            reference = scored_logits(model, ids, window)[0] if adapter else base_logits
            rows = {}
            for label in compressions:
                compression = settings[label][function]
                weighted = importance if label.endswith(("data-aware", "auto")) else own_text if label.endswith("self") else None
                if label.endswith("weighted"):
                    # the same statistics, no Gram matrices: nearest entries
                    weighted = ChannelImportance(importance.energies)
                # the rest of the function compressed once for every embedding it is measured with
                compressed = compressed_form(model, compression, label, weighted)
                for embedding in [None, *(embeddings or [])]:
                    row = f"{label} + embedding {embedding}" if embedding else label
                    rows[row] = compared(model, compressed, ids, window, reference, base_logits if adapter else None,
                                         targets, embedding)
                    rows[row]["compression"] = compression.describe()
                    print(f"{function} {row}: {rows[row]}", file=sys.stderr, flush=True)
        results["functions"][function] = rows
    return results


def table(results: dict) -> str:
    lines = [
        "| function | compression | weight bytes | perplexity ratio | top-1 | retention |",
        "|---|---|---|---|---|---|",
    ]
    for function, rows in results["functions"].items():
        for label, f in rows.items():
            retention = f"{f['retention']:.3f}" if "retention" in f else ""
            lines.append(
                f"| {function} | {label} | {f['bytes']:,} | {f['ratio']:.3f} | {100 * f['top1']:.1f}% | {retention} |"
            )
    tokens = ", ".join(f"{name} {count}" for name, count in results["tokens"].items())
    return "\n".join(lines) + f"\n\ntokens of {results['text']}: {tokens}; windows of {results['window']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--manifest", type=Path, default=REPO / "manifests" / "smollm2.yaml")
    parser.add_argument("--text", type=Path, default=REPO / "adapters" / "demo" / "heldout.txt")
    parser.add_argument("--heldout", type=Path, help="a folder of <function>.txt, one text per function")
    parser.add_argument("--auto-ratio", type=float, default=1.05, help="auto's max_perplexity_ratio")
    parser.add_argument("--auto-retention", type=float, default=0.9, help="auto's min_retention")
    parser.add_argument("--function", action="append", dest="functions")
    parser.add_argument("--compression", action="append", dest="compressions", choices=list(COMPRESSIONS))
    parser.add_argument("--embedding", action="append", dest="embeddings", choices=[
        label for label in COMPRESSIONS if label not in EMULATED and not label.endswith(("data-aware", "weighted", "auto"))
    ], help="also with the token embedding compressed so (data-free), not kept float16")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    targets = {"max_perplexity_ratio": args.auto_ratio, "min_retention": args.auto_retention}
    results = run(args.manifest, args.heldout or args.text, args.functions, args.compressions or list(COMPRESSIONS), args.window,
                  targets, args.embeddings)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
