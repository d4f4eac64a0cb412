"""Trace the export decoder and convert it to a stateful Core ML ML Program (one function)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from adapterpack.convert.export_decoder import CAUSAL_MASK, INPUT_IDS, LOGITS, STATE_NAMES, ExportDecoder
from adapterpack.quiet import captured_output, import_coremltools

log = logging.getLogger(__name__)


def deployment_target(name: str):
    ct = import_coremltools()
    try:
        return getattr(ct.target, name)
    except AttributeError:
        raise ValueError(f"coremltools {ct.__version__} does not know deployment target {name}") from None


def norm_islands(block) -> set[str]:
    """Names of the float32 ops connected to an ``rsqrt``: every RMS norm and the residual stream.

    The decoder is traced from a float16 model; ``export_decoder`` carries the residual stream in
    float32 and ``rms_norm`` computes inside in float32, as transformers' RMSNorm does, so the
    norms and the residual adds between them form one float32 region, entered by the casts of
    each sublayer's float16 output and left by the cast of each norm's output, with the norms'
    ``rsqrt`` ops in it (no other op of the decoder uses one). Walking float32 values back and
    forth from those ``rsqrt`` ops finds the region without depending on op names; other float32
    values of the trace (peft's LoRA matrices, the rope tables, the attention bias) are not
    connected to it.
    """
    from coremltools.converters.mil.mil import types

    def float32(var) -> bool:
        return getattr(var, "dtype", None) == types.fp32

    found: set[str] = set()
    for rsqrt in (op for op in block.operations if op.op_type == "rsqrt"):
        stack = [rsqrt]
        while stack:
            op = stack.pop()
            if op.name in found:
                continue
            found.add(op.name)
            for value in op.inputs.values():
                for var in value if isinstance(value, (list, tuple)) else [value]:
                    if float32(var) and var.op is not None and var.op.op_type != "const":
                        stack.append(var.op)
            for output in op.outputs:
                stack.extend(child for child in output.child_ops if any(float32(o) for o in child.outputs))
    return found


def compute_precision(ct):
    """float16 everywhere except the RMS norms and the residual stream, which stay float32.

    coremltools' plain FLOAT16 precision also narrows the norms' float32 upcast and the float32
    residual. On a real checkpoint that costs accuracy at the attention-sink tokens, whose
    residual reaches thousands and whose last layers cancel most of it again: SmolLM2-135M's
    fused ``shout``, position 1, cosine 0.9949 all-float16 against 0.9995 with float32 norms
    (mean over positions 0.99973 -> 0.99997), and a float32 residual brings the largest logit
    error from 0.41 to 0.09. The norm's form (``export_decoder.rms_norm``) is exact in float16
    as well, so a backend that narrows it (the Neural Engine has no float32) still cannot
    overflow. Each norm adds about a dozen small float32 ops, each sublayer a cast and an add,
    all on one row per token.
    """
    islands: dict[int, set[str]] = {}

    def narrowed(op) -> bool:
        block = op.enclosing_block
        if id(block) not in islands:
            islands[id(block)] = norm_islands(block)
        return op.name not in islands[id(block)]

    return ct.transform.FP16ComputePrecision(op_selector=narrowed)


def convert_decoder(model: torch.nn.Module, *, max_context: int, target: str = "iOS18"):
    """Convert an HF causal LM (plain or with peft LoRA layers) to a single-function ML Program.

    Returns an unloaded ``MLModel`` (``skip_model_load``: no Core ML runtime is needed).
    """
    ct = import_coremltools()
    decoder = ExportDecoder(model, max_context=max_context, cache_dtype=torch.float16).eval()
    # Trace with q > 1 and end >= q (max_context is at least 2), so neither the prefill nor the
    # cache offset is specialised away.
    example = (
        torch.zeros((1, 2), dtype=torch.int32),
        torch.zeros((1, 1, 2, min(5, max_context)), dtype=torch.float32),
    )
    with torch.no_grad(), captured_output():
        traced = torch.jit.trace(decoder, example, check_trace=False)
        # The example call wrote its keys and values into the cache buffers; a checkpoint whose
        # float16 forward overflows on the example token (a massive activation on it) writes NaN
        # there, which coremltools' check that a traced buffer equals itself refuses (NaN != NaN).
        # The states start at zero on a device whatever these hold.
        for name in STATE_NAMES:
            getattr(traced, name).zero_()
    # coremltools names the ops it creates from one process-wide counter per op type
    # (coreml_update_state_N, ...), which converting or loading any program advances: start
    # each conversion from zero, as a fresh process does, so a program's bytes do not depend
    # on what this process did before (a build after a verify, a kept adapter after the base).
    from coremltools.converters.mil.mil import Builder

    Builder.name_count.clear()
    length = ct.RangeDim(lower_bound=1, upper_bound=max_context, default=1)
    mask_rows = ct.RangeDim(lower_bound=1, upper_bound=max_context, default=1)
    mask_end = ct.RangeDim(lower_bound=1, upper_bound=max_context, default=1)
    with captured_output():
        mlmodel = ct.convert(
            traced,
            inputs=[
                ct.TensorType(name=INPUT_IDS, shape=(1, length), dtype=np.int32),
                ct.TensorType(name=CAUSAL_MASK, shape=(1, 1, mask_rows, mask_end), dtype=np.float16),
            ],
            outputs=[ct.TensorType(name=LOGITS, dtype=np.float16)],
            states=[
                ct.StateType(wrapped_type=ct.TensorType(shape=getattr(decoder, name).shape, dtype=np.float16), name=name)
                for name in STATE_NAMES
            ],
            minimum_deployment_target=deployment_target(target),
            compute_precision=compute_precision(ct),
            compute_units=ct.ComputeUnit.ALL,
            skip_model_load=True,
        )
    del traced, decoder
    return mlmodel
