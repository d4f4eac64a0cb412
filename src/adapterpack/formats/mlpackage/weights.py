"""Compress one function's weights (before the merge: coremltools refuses multifunction models).

Palettization goes through coremltools' ``custom`` mode with adapterpack's own deterministic 1-D
k-means (``kmeans.py``, served by a ``palettes.PaletteStore``): coremltools' k-means switches to
scikit-learn for small groups (slow, and not guaranteed to give identical tables for identical
weights), and identical base weights must compress identically to stay shared after the merge.
Each method's coremltools configuration comes from one table, ``OP_CONFIGS``.

In ``lora: keep`` functions the LoRA A/B matrices are compressed separately from the base weights
(default: left float16, since they are small and carry the whole adapter).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from adapterpack.compress.palettes import PaletteStore, grouped_rows
from adapterpack.config.compression import WEIGHT_THRESHOLD, Compression, is_lora_weight, weight_setting
from adapterpack.formats.mlpackage.spec import save_model
from adapterpack.quiet import captured_output, import_coremltools

log = logging.getLogger(__name__)

def weight_values(mlmodel) -> dict[str, np.ndarray]:
    """The weight constants large enough to be compressed, by name."""
    import_coremltools()
    from coremltools.optimize.coreml import get_weights_metadata

    with captured_output():
        metadata = get_weights_metadata(mlmodel, weight_threshold=WEIGHT_THRESHOLD)
    return {name: meta.val for name, meta in metadata.items()}


def _palettize(compression: Compression, palettes: PaletteStore):
    from coremltools.optimize import coreml as cto

    nbits = compression.nbits
    config = cto.OpPalettizerConfig(
        mode="custom",
        lut_function=lambda group: palettes.serve(group, nbits),
        granularity=compression.granularity,
        group_size=compression.group_size or 0,
        weight_threshold=WEIGHT_THRESHOLD,
    )
    return config, cto.palettize_weights


def _linear(compression: Compression, palettes: PaletteStore):
    from coremltools.optimize import coreml as cto

    config = cto.OpLinearQuantizerConfig(
        mode="linear_symmetric",
        dtype="int4" if compression.nbits == 4 else "int8",
        granularity=compression.granularity,
        block_size=compression.block_size or 32,
        weight_threshold=WEIGHT_THRESHOLD,
    )
    return config, cto.linear_quantize_weights


def _prune(compression: Compression, palettes: PaletteStore):
    from coremltools.optimize import coreml as cto

    config = cto.OpMagnitudePrunerConfig(target_sparsity=compression.sparsity, weight_threshold=WEIGHT_THRESHOLD)
    return config, cto.prune_weights


# method -> (coremltools op config, the coremltools function that applies it); "none" compresses nothing.
OP_CONFIGS: dict[str, Callable[[Compression, PaletteStore], tuple[object, Callable]]] = {
    "palettize": _palettize,
    "linear": _linear,
    "prune": _prune,
}


def compress_model(
    mlmodel,
    compression: Compression,
    lora_compression: Compression | None = None,
    palettes: PaletteStore | None = None,
):
    """Return ``mlmodel`` compressed as the manifest says.

    ``compression`` applies to the base weights; ``lora_compression`` (keep mode) to the LoRA
    matrices, which are otherwise left float16. ``palettes`` is the build's palette store (a
    fresh in-memory one when not given).
    """
    if compression.method == "none" and (lora_compression is None or lora_compression.method == "none"):
        return mlmodel
    palettes = palettes if palettes is not None else PaletteStore()
    import_coremltools()
    from coremltools.optimize import coreml as cto

    values = weight_values(mlmodel)
    settings = {name: weight_setting(name, value.shape, compression, lora_compression) for name, value in values.items()}
    lora_names = [name for name, setting in settings.items() if setting is not None and is_lora_weight(name)]
    # Two passes: the base weights, then (keep mode) the LoRA matrices with their own setting.
    if compression.method != "none":
        op_config, apply = OP_CONFIGS[compression.method](compression, palettes)
        # per weight: None (left float16), or a per-layer exception's own configuration
        own: dict[str, object | None] = {name: None for name, setting in settings.items() if setting is None or is_lora_weight(name)}
        for name, setting in settings.items():
            if name not in own and setting != compression:
                own[name] = OP_CONFIGS[setting.method](setting, palettes)[0]
        if compression.method == "palettize":
            for setting in {s for n, s in settings.items() if n not in own or own[n] is not None}:
                palettes.prime({n: v for n, v in values.items() if settings[n] == setting and not is_lora_weight(n)}, setting)
        # coremltools loads its own copy of the weights: drop ours first (a 1B model's float16
        # weights are 2.5 GB).
        values.clear()
        config = cto.OptimizationConfig(global_config=op_config, op_name_configs=own)
        log.debug("compressing with %s; kept float16: %s", compression.describe(), sorted(n for n, c in own.items() if c is None))
        with captured_output():
            mlmodel = apply(mlmodel, config=config)
        if palettes.files is not None:
            # Palettes are on disk now; the next function reloads what it shares in a moment.
            palettes.clear()
    del values
    if lora_names:
        op_config, apply = OP_CONFIGS[lora_compression.method](lora_compression, palettes)
        config = cto.OptimizationConfig(global_config=None, op_name_configs={name: op_config for name in lora_names})
        with captured_output():
            mlmodel = apply(mlmodel, config=config)
    return mlmodel


def compress_package(
    source: Path,
    target: Path,
    compression: Compression,
    lora_compression: Compression | None = None,
    palettes: PaletteStore | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Write package ``target``: package ``source`` (one function) compressed as the manifest says.

    Palettization and linear quantization stream record by record (``program.compress_program``)
    whenever they can; pruning, and the rare layouts it leaves to coremltools, load the program
    into coremltools (whose linear integers are never error-compensated). ``progress(done,
    total)`` counts weight values (streaming path only).
    """
    from adapterpack.formats.mlpackage.program import compress_program

    lora_plain = lora_compression is None or lora_compression.method == "none"
    if compression.method == "none" and lora_plain:
        shutil.copytree(source, target)
        return
    palettes = palettes if palettes is not None else PaletteStore()
    if compression.method in ("palettize", "linear") and lora_plain:
        setting_of = lambda name, shape: weight_setting(name, shape, compression)  # noqa: E731
        if compress_program(source, target, compression, palettes, setting_of=setting_of, progress=progress):
            return
    ct = import_coremltools()
    with captured_output():
        mlmodel = ct.models.MLModel(str(source), skip_model_load=True)
    mlmodel = compress_model(mlmodel, compression, lora_compression, palettes=palettes)
    save_model(mlmodel, target)


def compressed_records(
    values: list[np.ndarray], settings: list[Compression | None], palettes: PaletteStore, names: list[str] | None = None
) -> Iterator[list[tuple[str, bytes]] | None]:
    """For each weight in turn, the blob records ``program.compress_program`` writes for it
    compressed as its setting says (``config.compression.weight_setting``'s): [(blob dtype,
    bytes)] of the packed indices and the float16 palettes (palettized), or of the packed
    integers and the float16 scales (linear); None for a weight left float16 or compressed
    another way. ``names`` (the weights' tensor names) pick their importance (palettes) and Gram
    (compensated integers), as the compressed base was written with.

    Uses the same palettes and integers the build compresses with (``palettes``, disk cache
    included), so a fused function can be patched at the compressed level; the k-means runs on
    both cores (``PaletteStore.in_order``). Callers check the result by finding the base
    weight's records in a compressed package, so a layout mismatch is a miss, never a wrong
    patch.
    """
    from adapterpack.compress.quantize import stored_quantized
    from adapterpack.formats.mlpackage.program import palettized_records, quantized_records

    def is_float16_with(value: np.ndarray, setting: Compression | None, method: str) -> bool:
        return setting is not None and setting.method == method and value.dtype == np.float16

    present = [
        i
        for i, (value, setting) in enumerate(zip(values, settings))
        if is_float16_with(value, setting, "palettize") and grouped_rows(value, setting) is not None
    ]
    found = palettes.in_order(
        [values[i].size for i in present],
        lambda k: grouped_rows(values[present[k]], settings[present[k]]),
        lambda k: settings[present[k]].nbits,
        named=(lambda k: (names[present[k]], values[present[k]].shape)) if names is not None else None,
    )
    palettized = set(present)
    for i, (value, setting) in enumerate(zip(values, settings)):
        if i in palettized:
            yield [(dtype, values.tobytes()) for dtype, values in palettized_records(*next(found), setting.nbits)]
        elif is_float16_with(value, setting, "linear") and value.ndim == 2:
            quantized = stored_quantized(value, setting, names[i] if names is not None else None, palettes)
            if quantized is None:
                yield None
                continue
            yield [(dtype, values.tobytes()) for dtype, values in quantized_records(*quantized, setting.nbits)]
        else:
            yield None
