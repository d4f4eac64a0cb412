"""Verify every function of a package against its PyTorch reference.

The reference is the float32 base with the adapter applied by peft and NOT merged: the model the
adapter's author trained. Each function runs a seeded prefill, then single-token decode steps
through its states, on the numpy ML Program executor (any OS) or on Core ML itself (macOS), once
per calling convention real clients use (``DRIVES``); the worse of the two is reported. The
numpy executor also checks every op's result against the type the program declares for it. Per function: logit cosine, max abs error, top-1 agreement, KL divergence,
and for adapter functions how much of the adapter's effect survived compression (retention).
Every failure is collected; the caller gets one report and one verdict.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from .errors import BadInput, VerificationFailed
from .executor import DeclaredTypeMismatch
from .manifest import Manifest, VerifySettings

log = logging.getLogger(__name__)

Backend = Literal["numpy", "coreml"]
# float16 has an 11-bit significand: logits closer than ~1e-3 of their magnitude are a tie.
TOP1_TIE_TOLERANCE = 1e-3
# ... and so are logits within two float16 steps of each other at the top logit's magnitude: a
# float16 program rounds every op, its last rounding alone moves each logit by half a step, and
# the rounding before it by as much again.
TOP1_TIE_FLOAT16_STEPS = 2


@dataclass
class FunctionReport:
    name: str
    compression: str
    cosine: float
    max_abs_error: float
    top1: float
    kl: float
    retention: float | None  # None for the base function
    adapter_effect: float | None  # relative size of the adapter's effect on the logits
    thresholds: dict[str, float]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    drive: str = ""  # the calling convention whose figures are reported (the worse one)
    by_drive: dict[str, dict[str, float]] = field(default_factory=dict)  # every drive's metrics

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class VerifyReport:
    package: Path
    backend: str
    functions: list[FunctionReport]
    integrity: list[str] = field(default_factory=list)  # problems found without running anything

    @property
    def passed(self) -> bool:
        return not self.integrity and all(f.passed for f in self.functions)

    def verdict(self) -> str:
        failed = [f.name for f in self.functions if not f.passed]
        if self.passed:
            return f"verify: PASS: {len(self.functions)} function(s) match their PyTorch reference ({self.backend} backend)"
        reasons = list(self.integrity) + [f"{f.name}: {'; '.join(f.failures)}" for f in self.functions if not f.passed]
        return f"verify: FAIL: {', '.join(failed) or 'package'}: " + " | ".join(reasons)

    def as_json(self) -> dict:
        return {
            "package": str(self.package),
            "backend": self.backend,
            "passed": self.passed,
            "integrity": self.integrity,
            "functions": [
                {k: v for k, v in vars(f).items()} | {"passed": f.passed} for f in self.functions
            ],
        }


# ------------------------------------------------------------------------------------- metrics


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def compare_logits(got: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Cosine (mean over positions), max abs error, top-1 agreement and mean KL(ref || got)."""
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
    top = np.abs(ref).max(axis=-1)
    steps = np.spacing(np.minimum(top, 65504).astype(np.float16)).astype(np.float64)
    resolution = np.maximum(TOP1_TIE_TOLERANCE * top, TOP1_TIE_FLOAT16_STEPS * steps)
    agrees = ref[rows, got.argmax(-1)] >= ref.max(axis=-1) - resolution
    return {
        "cosine": cosine,
        "max_abs_error": float(np.abs(got - ref).max()),
        "top1": float(np.mean(agrees)),
        "kl": max(kl, 0.0),
    }


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
    if ref_norm == 0.0:  # an adapter with no effect has nothing to lose
        return 1.0, 0.0
    got_norm = float(np.linalg.norm(delta_got))
    if got_norm == 0.0:
        return 0.0, effect
    return float(delta_got @ delta_ref / (got_norm * ref_norm)), effect


# ------------------------------------------------------------------------------------ runners


def verification_tokens(vocab_size: int, settings: VerifySettings) -> np.ndarray:
    """The fixed, seeded token sequence every function is checked on."""
    rng = np.random.default_rng(settings.seed)
    return rng.integers(0, vocab_size, size=settings.prefill + settings.decode_steps, dtype=np.int64)


# How real clients call a function (see export_decoder): each drive is a prefill of the first
# tokens, then one call per further token through the same state.
DRIVES = ("swift", "python")


def _drive_masks(drive: str, past: int, q: int) -> np.ndarray:
    """The ``causalMask`` a client of style ``drive`` sends for ``q`` new tokens after ``past``.

    ``swift``: swift-transformers' ``LanguageModelWithStatefulKVCache`` sends zeros of shape
    (1, 1, 1, tokenCount + 1), tokenCount being every token of the sequence so far, this call's
    included, for the prefill and for each decode step alike.
    ``python``: Apple's Python examples send width past + q: a full additive causal mask
    (1, 1, q, past + q) for the prefill and zeros for each single-token step.
    """
    if drive == "swift":
        return np.zeros((1, 1, 1, past + q + 1), dtype=np.float16)
    if q == 1:
        return np.zeros((1, 1, 1, past + 1), dtype=np.float16)
    future = np.triu(np.ones((q, past + q), dtype=bool), k=past + 1)
    return np.where(future, np.float16(-np.inf), np.float16(0))[None, None]


def run_drive(predict, tokens: np.ndarray, prefill: int, drive: str) -> np.ndarray:
    """Prefill then decode one token at a time as a ``drive`` client does; logits (tokens, vocab).

    Every row of the prefill is kept (the Swift client reads only its last), then the one row of
    each decode step.
    """
    outputs = []
    first = tokens[:prefill].astype(np.int32)[None, :]
    outputs.append(predict(first, _drive_masks(drive, 0, prefill)))
    for end in range(prefill + 1, len(tokens) + 1):
        step = tokens[end - 1 : end].astype(np.int32)[None, :]
        outputs.append(predict(step, _drive_masks(drive, end - 1, 1)))
    return np.concatenate([o.reshape(1, -1, o.shape[-1]) for o in outputs], axis=1)[0].astype(np.float32)


def _numpy_runner(package: Path):
    """Loads one function at a time and drops it after its drives, so the executor holds one
    function's weights, not the package's."""
    from .executor import ProgramExecutor, UnsupportedOp

    names = ProgramExecutor.function_names_of(package)

    def run(function: str, tokens: np.ndarray, prefill: int) -> dict[str, np.ndarray]:
        try:
            executor = ProgramExecutor.load(package, functions=[function])
        except UnsupportedOp as error:
            raise BadInput(f"{package}: {error}") from None
        logits = {}
        for drive in DRIVES:
            state = executor.make_state(function)

            def predict(ids, mask):
                return executor.predict({"inputIds": ids, "causalMask": mask}, state=state, function=function)["logits"]

            logits[drive] = run_drive(predict, tokens, prefill, drive)
        return logits

    return run, names


def _coreml_runner(package: Path):
    if sys.platform != "darwin":
        raise BadInput("--backend coreml needs macOS (the Core ML runtime); use the default numpy backend here")
    from .quiet import captured_output, import_coremltools

    ct = import_coremltools()
    from .functions import read_functions

    names = read_functions(package).names

    def run(function: str, tokens: np.ndarray, prefill: int) -> dict[str, np.ndarray]:
        with captured_output():
            model = ct.models.MLModel(str(package), function_name=function, compute_units=ct.ComputeUnit.CPU_AND_NE)
        logits = {}
        for drive in DRIVES:
            state = model.make_state()

            def predict(ids, mask):
                return model.predict({"inputIds": ids, "causalMask": mask}, state=state)["logits"]

            logits[drive] = run_drive(predict, tokens, prefill, drive)
        return logits

    return run, names


# ------------------------------------------------------------------------------------- verify


def weights_digest(package: Path) -> str:
    """sha256 of the package's weight blobs, in path order (recorded at build, checked here)."""
    digest = hashlib.sha256()
    weights = sorted((package / "Data").rglob("weights/*")) if (package / "Data").exists() else []
    for file in weights:
        if file.is_file():
            digest.update(file.relative_to(package).as_posix().encode())
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


# Bump when what verification computes changes, so verdicts cached by an older version are not reused.
VERIFY_FORMAT = 2
REUSED_NOTE = "unchanged since a build verified it (build cache)"


def function_report_from_json(data: dict) -> FunctionReport:
    known = set(FunctionReport.__dataclass_fields__)
    report = FunctionReport(**{k: v for k, v in data.items() if k in known})
    if REUSED_NOTE not in report.notes:
        report.notes.append(REUSED_NOTE)
    return report


def verify_package(
    package: str | Path,
    manifest: Manifest,
    *,
    backend: Backend = "numpy",
    checked=None,
    reuse: dict[str, FunctionReport] | None = None,
) -> VerifyReport:
    """Run every function of ``package`` against its PyTorch reference; never raises on a mismatch.

    ``checked`` (pipeline.CheckedInputs) avoids re-validating inputs when called from a build.
    ``reuse`` holds passing reports of functions whose parts (inputs, settings, versions) are
    unchanged since a build verified them; those are not run again. The integrity checks
    always run.
    """
    from .functions import read_functions
    from .pipeline import check_inputs

    package = Path(package)
    listing = read_functions(package)
    checked = checked or check_inputs(manifest)
    manifest = checked.manifest
    settings = manifest.verify
    report = VerifyReport(package=package, backend=backend, functions=[])

    expected = manifest.function_names
    if sorted(listing.names) != sorted(expected):
        report.integrity.append(
            f"package functions {listing.names} differ from the manifest's {expected}"
        )
        return report
    recorded = listing.metadata.get("co.adapterpack.weightsSha256")
    if recorded and recorded != weights_digest(package):
        report.integrity.append("weight blob differs from the one written at build time (file altered?)")

    reuse = reuse or {}
    if all(name in reuse for name in expected):
        report.functions = [reuse[name] for name in expected]
        return report
    try:
        run, _ = _coreml_runner(package) if backend == "coreml" else _numpy_runner(package)
    except BadInput:
        raise
    except Exception as error:  # a damaged package fails verification rather than crashing it
        report.integrity.append(f"package cannot be loaded: {type(error).__name__}: {error}")
        return report
    # All PyTorch references first, then the torch base goes, and each function runs alone:
    # at no point does a float32 base share memory with a function's weights.
    import gc

    tokens, base_reference, references = _references(checked, [n for n in expected if n not in reuse])
    prefill = min(settings.prefill, len(tokens))
    gc.collect()

    for name in expected:
        if name in reuse:
            report.functions.append(reuse[name])
            continue
        adapter = manifest.adapter(name)
        compression = manifest.compression_for(name)
        thresholds = settings.thresholds_for(compression)
        reference = references.get(name, base_reference)
        try:
            got = run(name, tokens, prefill)
        except BadInput:
            raise
        except DeclaredTypeMismatch as error:
            report.integrity.append(f"function {name}: the program's declared types are not what its ops compute: {error}")
            continue
        except Exception as error:  # a damaged function fails verification rather than crashing it
            report.integrity.append(f"function {name} cannot be run: {type(error).__name__}: {error}")
            continue
        by_drive = {drive: compare_logits(logits, reference) for drive, logits in got.items()}
        worst = min(by_drive, key=lambda drive: (by_drive[drive]["cosine"], by_drive[drive]["top1"]))
        metrics = by_drive[worst]
        function_report = FunctionReport(
            name=name,
            compression=compression.describe(),
            retention=None,
            adapter_effect=None,
            thresholds=thresholds,
            drive=worst,
            **metrics,
        )
        # Thresholds hold for every drive, not only the reported one.
        for drive, figures in by_drive.items():
            label = f" ({drive} drive)" if len(by_drive) > 1 else ""
            if figures["top1"] < thresholds["top1"]:
                function_report.failures.append(f"top-1 {figures['top1']:.1%} < {thresholds['top1']:.1%}{label}")
            if figures["cosine"] < thresholds["cosine"]:
                function_report.failures.append(f"cosine {figures['cosine']:.4f} < {thresholds['cosine']}{label}")
        if adapter is not None:
            for drive, logits in got.items():
                kept, effect = retention(logits, reference, base_reference)
                by_drive[drive]["retention"] = kept
                if function_report.retention is None or kept < function_report.retention:
                    function_report.retention, function_report.adapter_effect = kept, effect
            kept = function_report.retention
            if kept < thresholds["retention"]:
                remedy = (
                    "keep the adapter unfused (lora: keep) or use more bits for its target modules"
                    if manifest.lora_mode(name) == "fuse"
                    else "use more bits for this function's compression"
                )
                function_report.failures.append(
                    f"adapter not retained: retention {kept:.2f} < {thresholds['retention']} (compression "
                    f"washed out the adapter's effect); {remedy}"
                )
        function_report.by_drive = by_drive
        report.functions.append(function_report)
        gc.collect()
    return report


def _references(checked, names: list[str]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(tokens, base logits, {adapter function: logits}) from the float32 PyTorch base, with each
    adapter applied by peft unmerged. Everything torch holds is gone when this returns."""
    import torch

    from .base_model import load_base
    from .lora import applied_adapter

    manifest = checked.manifest
    base = load_base(checked.base.folder)
    # The Swift client's mask is one slot wider than the tokens, so it holds max_context - 1 of them.
    tokens = verification_tokens(int(base.config.vocab_size), manifest.verify)[: manifest.export.max_context - 1]
    ids = torch.from_numpy(tokens[None, :])
    with torch.no_grad():
        base_reference = base(ids).logits[0].float().numpy()
    references = {}
    for name in names:
        adapter = manifest.adapter(name)
        if adapter is None:
            continue
        folder = checked.adapters[name].folder
        with torch.no_grad(), applied_adapter(base, folder, mode="unmerged", scale=float(adapter.scale)) as model:
            references[name] = model(ids).logits[0].float().numpy()
    return tokens, base_reference, references


def verify(package: str | Path, manifest: Manifest, *, backend: Backend = "numpy", checked=None) -> VerifyReport:
    """``verify_package`` that raises VerificationFailed (exit 3) with the verdict on failure."""
    report = verify_package(package, manifest, backend=backend, checked=checked)
    if not report.passed:
        raise VerificationFailed(report.verdict()).with_report(report)
    return report
