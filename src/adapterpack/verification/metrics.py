"""Comparing a function's logits with its reference: cosine, max error, top-1 agreement (float16
ties counted as agreement), KL, and how much of the adapter's effect survived (retention).
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)


# float16 has an 11-bit significand: logits closer than ~1e-3 of their magnitude are a tie.
TOP1_TIE_TOLERANCE = 1e-3


# ... and so are logits within two float16 steps of each other at the top logit's magnitude: a
# float16 program rounds every op, its last rounding alone moves each logit by half a step, and
# the rounding before it by as much again.
TOP1_TIE_FLOAT16_STEPS = 2


def top1_resolution(top: np.ndarray | float) -> np.ndarray | float:
    """How close two logits may be and still be a tie, when the largest is ``top`` in magnitude."""
    top = np.asarray(top, np.float64)
    steps = np.spacing(np.minimum(top, 65504).astype(np.float16)).astype(np.float64)
    return np.maximum(TOP1_TIE_TOLERANCE * top, TOP1_TIE_FLOAT16_STEPS * steps)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


# ... and, where a package is checked against its own weights (the exact verdict), logits closer
# than this many times the position's own RMS error: the two next tokens are a tie the float16
# program's rounding at that position decides (a real mistake moves the cosine, which is held to
# 0.9999 beside it).
TOP1_TIE_ERRORS = 2


def compare_logits(got: np.ndarray, reference: np.ndarray, *, ties_within_error: bool = False) -> dict[str, float]:
    """Cosine (mean over positions), max abs error, top-1 agreement and mean KL(ref || got);
    ``ties_within_error``: a position agrees when the reference's best and the package's choice
    are within ``TOP1_TIE_ERRORS`` times that position's RMS error."""
    got = got.reshape(-1, got.shape[-1]).astype(np.float64)
    ref = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    if not np.all(np.isfinite(got)):
        return {"cosine": 0.0, "max_abs_error": float("inf"), "top1": 0.0, "kl": float("inf")}
    dots = (got * ref).sum(-1)
    norms = np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1)
    cosine = float(np.mean(dots / np.maximum(norms, 1e-30)))
    log_p, log_q = _log_softmax(ref), _log_softmax(got)
    kl = float(np.mean((np.exp(log_p) * (log_p - log_q)).sum(-1)))
    # A position agrees when the package's top token is also the reference's top token to within
    # float16 resolution of the logits: a near-tie (common in small random models) that float16
    # cannot order is not a disagreement.
    rows = np.arange(len(ref))
    tolerance = top1_resolution(np.abs(ref).max(axis=-1))
    if ties_within_error:
        tolerance = np.maximum(tolerance, TOP1_TIE_ERRORS * np.sqrt(((got - ref) ** 2).mean(axis=-1)))
    agrees = ref[rows, got.argmax(-1)] >= ref.max(axis=-1) - tolerance
    return {
        "cosine": cosine,
        "max_abs_error": float(np.abs(got - ref).max()),
        "top1": float(np.mean(agrees)),
        "kl": max(kl, 0.0),
    }


def perplexity_ratio(got: np.ndarray, reference: np.ndarray, ids: np.ndarray) -> float:
    """Perplexity of ``got``'s next-token predictions over ``ids`` (each row predicts the next
    id) divided by ``reference``'s: above 1, the text is less likely under ``got``."""
    targets = np.asarray(ids[1:], np.int64)
    rows = np.arange(len(targets))

    def mean_loss(logits: np.ndarray) -> float:
        return float(-_log_softmax(logits[: len(targets)])[rows, targets].mean())

    if not len(targets) or not np.all(np.isfinite(got)):
        return float("inf") if len(targets) else 1.0
    return math.exp(mean_loss(got) - mean_loss(reference))


def retention(got: np.ndarray, adapter_ref: np.ndarray, base_ref: np.ndarray) -> tuple[float, float]:
    """How much of the adapter's effect the package kept, and how big that effect is.

    Retention is the cosine between the package's change from the base reference and the
    adapter's change (both over all positions and logits): near 1 when the adapter's effect
    survived, near 0 when compression washed it out and only compression noise is left (noise is
    uncorrelated with the adapter's change). The second value is the effect's size relative to
    the base logits.
    """
    delta_ref = (adapter_ref - base_ref).astype(np.float64).ravel()
    delta_got = (got - base_ref).astype(np.float64).ravel()
    ref_norm = float(np.linalg.norm(delta_ref))
    effect = ref_norm / max(float(np.linalg.norm(base_ref.astype(np.float64))), 1e-30)
    return retention_of_sums(float(delta_got @ delta_ref), float(delta_got @ delta_got), ref_norm * ref_norm), effect


def retention_of_sums(change_dot_effect: float, change_squared: float, effect_squared: float) -> float:
    """Retention from its three sums (the package's change dotted with the adapter's, and each
    squared), for callers that add them up piece by piece instead of holding all the logits."""
    if effect_squared == 0.0:  # an adapter with no effect has nothing to lose
        return 1.0
    if change_squared == 0.0:
        return 0.0
    return change_dot_effect / math.sqrt(change_squared * effect_squared)
