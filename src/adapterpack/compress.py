"""Compress one function's weights (before the merge: coremltools refuses multifunction models).

Palettization goes through coremltools' ``custom`` mode with adapterpack's own deterministic 1-D
k-means (``palettize.py``): coremltools' k-means switches to scikit-learn for small groups (slow,
and not guaranteed to give identical tables for identical weights), and identical base weights
must compress identically to stay shared after the merge.
"""

from __future__ import annotations

import fnmatch
import logging

import numpy as np

from .manifest import Compression
from .palettize import palettize_group
from .quiet import captured_output, import_coremltools

log = logging.getLogger(__name__)

# Constants that are never compressed whatever the manifest says: rope tables feed sin/cos
# positions (errors here shift every token), and tiny tensors gain nothing.
ALWAYS_FLOAT16 = ("rope_cos", "rope_sin")
WEIGHT_THRESHOLD = 2048


def _matches(const_name: str, patterns: tuple[str, ...]) -> bool:
    for pattern in patterns:
        normalized = pattern.replace(".", "_")
        if any(ch in normalized for ch in "*?["):
            if fnmatch.fnmatchcase(const_name, f"*{normalized}*"):
                return True
        elif normalized in const_name:
            return True
    return False


def weight_names(mlmodel) -> list[str]:
    """Names of the weight constants large enough to be compressed."""
    ct = import_coremltools()
    from coremltools.optimize.coreml import get_weights_metadata

    with captured_output():
        metadata = get_weights_metadata(mlmodel, weight_threshold=WEIGHT_THRESHOLD)
    del ct
    return list(metadata)


def compress_model(mlmodel, compression: Compression):
    """Return ``mlmodel`` compressed as ``compression`` says (the same object for ``none``)."""
    if compression.method == "none":
        return mlmodel
    ct = import_coremltools()
    from coremltools.optimize import coreml as cto

    if compression.method == "palettize":
        nbits = compression.nbits

        def lut_function(group: np.ndarray):
            return palettize_group(group, nbits)

        op_config = cto.OpPalettizerConfig(
            mode="custom",
            lut_function=lut_function,
            granularity=compression.granularity,
            group_size=compression.group_size or 0,
            weight_threshold=WEIGHT_THRESHOLD,
        )
        apply = cto.palettize_weights
    elif compression.method == "linear":
        op_config = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype="int4" if compression.nbits == 4 else "int8",
            granularity=compression.granularity,
            block_size=compression.block_size or 32,
            weight_threshold=WEIGHT_THRESHOLD,
        )
        apply = cto.linear_quantize_weights
    elif compression.method == "prune":
        op_config = cto.OpMagnitudePrunerConfig(
            target_sparsity=compression.sparsity, weight_threshold=WEIGHT_THRESHOLD
        )
        apply = cto.prune_weights
    else:  # pragma: no cover - the schema allows nothing else
        raise ValueError(compression.method)

    excluded = {
        name: None
        for name in weight_names(mlmodel)
        if _matches(name, ALWAYS_FLOAT16) or _matches(name, tuple(compression.keep_float16))
    }
    config = cto.OptimizationConfig(global_config=op_config, op_name_configs=excluded)
    log.debug("compressing with %s; kept float16: %s", compression.describe(), sorted(excluded))
    with captured_output():
        compressed = apply(mlmodel, config=config)
    del ct
    return compressed
