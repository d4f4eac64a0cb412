"""Verify every function of a package against its PyTorch reference: the float32 base with the
adapter applied by peft and NOT merged, each function driven the way real clients call it, every
failure collected into one report.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from adapterpack.config.manifest import Manifest
from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.executor import DeclaredTypeMismatch
from adapterpack.formats.registry import of_package, read_functions
from adapterpack.inputs.checked import check_inputs
from adapterpack.verification.metrics import compare_logits, perplexity_ratio, retention
from adapterpack.verification.own_weights import own_weights_logits
from adapterpack.verification.reference import reference_logits
from adapterpack.verification.reports import FunctionReport, VerifyReport
from adapterpack.verification.runners import Backend, backend_for, drive_runner
from adapterpack.verification.texts import verify_tokens

log = logging.getLogger(__name__)

FLOAT16_HINT = (
    "hint: the program computes in float16; `adapterpack validate --range` names the reference's values "
    "float16 cannot hold, and an .aimodel can compute in float32 (export.compute_precision)"
)


def verify_package(
    package: str | Path,
    manifest: Manifest,
    *,
    backend: Backend = "numpy",
    checked=None,
    reuse: dict[str, FunctionReport] | None = None,
    digests: dict[str, str] | None = None,
    stage: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> VerifyReport:
    """Run every function of ``package`` against its PyTorch reference; never raises on a mismatch.

    ``checked`` (inputs.checked.CheckedInputs) avoids re-validating inputs when called from a build.
    ``reuse`` holds passing reports of functions whose bytes (``digests``: each function's digest
    as its format computes it, computed here when not given) equal bytes a build verified against
    the same reference; those are not run again. The integrity checks always run.
    ``stage(label)``: a context manager around each long step (progress display).
    """
    stage = stage or (lambda label: contextlib.nullcontext())

    package = Path(package)
    package_format = of_package(package)
    listing = read_functions(package)
    checked = checked or check_inputs(manifest)
    manifest = checked.manifest
    # A format bound to one runtime (an .aimodel: Core AI's) runs there whatever was asked for.
    backend = backend_for(package, backend)
    report = VerifyReport(package=package, backend=backend, functions=[])

    expected = manifest.function_names
    if sorted(listing.names) != sorted(expected):
        report.integrity.append(f"package functions {listing.names} differ from the manifest's {expected}")
        return report
    report.integrity += package_format.integrity(package, listing)
    digests = digests or package_format.function_digests(package, expected)
    reuse = {name: found for name, found in (reuse or {}).items() if found.digest == digests.get(name)}
    if all(name in reuse for name in expected):
        report.functions = [reuse[name] for name in expected]
        return report
    try:
        run, sessions = drive_runner(package, backend)
    except BadInput:
        raise
    except Exception as error:  # a damaged package fails verification rather than crashing it
        report.integrity.append(f"package cannot be loaded: {type(error).__name__}: {error}")
        return report
    to_run = [n for n in expected if n not in reuse]
    ran = _run_functions(checked, to_run, run, sessions, digests, report, backend, stage)
    report.functions = [reuse[name] if name in reuse else ran[name] for name in expected if name in reuse or name in ran]
    return report


def _run_functions(checked, names: list[str], run, sessions, digests: dict[str, str], report: VerifyReport, backend: str, stage) -> dict:
    """{function: its report} for each of ``names`` that runs; a function that cannot run is
    an integrity failure in ``report``."""
    import gc

    manifest = checked.manifest
    tokens = verify_tokens(checked, names)
    if tokens.reason:
        log.info("verify: %s", tokens.reason)
    # All float32 references first, then the torch base goes, and each function runs alone: at
    # no point does the base's float32 model share memory with a function's weights.
    adapters = sum(manifest.adapter(n) is not None for n in names)
    with stage(f"references: the PyTorch base and {adapters} adapter(s), float32, on random ids and real text"):
        references = reference_logits(checked, names, tokens)
    prefill = min(manifest.verify.prefill, len(tokens.random))
    gc.collect()
    ran: dict[str, FunctionReport] = {}
    for name in names:
        sequences = {"random": tokens.random}
        if name in tokens.text:
            sequences["text"] = tokens.drive_text(name, manifest.verify)
        try:
            with stage(f"{name}: run both drives on random ids and real text ({backend})"):
                got, trouble = run(name, sequences, prefill)
            with stage(f"{name}: its reference holding the package's weights, float32"):
                own = _own_weights_references(checked, name, sessions, tokens)
        except BadInput:
            raise
        except DeclaredTypeMismatch as error:
            report.integrity.append(f"function {name}: the program's declared types are not what its ops compute: {error}")
            continue
        except Exception as error:  # a damaged function fails verification rather than crashing it
            report.integrity.append(f"function {name} cannot be run: {type(error).__name__}: {error}")
            continue
        ran[name] = function_report(manifest, name, got, references, own, tokens, trouble, digests.get(name, ""))
        gc.collect()
    return ran


def _own_weights_references(checked, name: str, sessions, tokens) -> dict[str, np.ndarray] | None:
    """{"random", "text": logits} of ``name``'s reference holding the package's own weights, or
    None when the runtime cannot show them (a Core AI asset's)."""
    values = sessions.known_values(name)
    if values is None:
        return None
    sequences = [tokens.random] + ([tokens.text[name]] if name in tokens.text else [])
    found = own_weights_logits(checked, name, values, sequences)
    return dict(zip(("random", "text"), found))


def function_report(
    manifest: Manifest, name: str, got: dict[str, np.ndarray], references, own, tokens, trouble: str | None, digest: str
) -> FunctionReport:
    """Function ``name``'s report from its logits under each drive and sequence (``got``): the
    exact verdict against its reference holding the package's weights (``own``; the float32
    reference where there is none), on every drive, the worse one's figures reported; the
    quality verdict, that reference against the float32 one on real text."""
    compression = manifest.compression_for(name)
    thresholds = manifest.verify.thresholds_for(compression)
    exact_against = {
        "random": own["random"] if own is not None else references.of(name),
        "text": (own or {}).get("text", references.text.get(name)),
    }
    by_drive = {
        drive: compare_logits(logits, _reference_rows(exact_against, drive, logits), ties_within_error=own is not None)
        for drive, logits in got.items()
    }
    worst = min(by_drive, key=lambda drive: (by_drive[drive]["cosine"], by_drive[drive]["top1"]))
    found = FunctionReport(
        name=name,
        compression=compression.describe(),
        retention=None,
        adapter_effect=None,
        thresholds=thresholds,
        drive=worst,
        digest=digest,
        reference="own weights" if own is not None else "float32",
        text=tokens.sources.get(name, tokens.reason or ""),
        **by_drive[worst],
    )
    if trouble is not None:
        # Named even when the figures pass: the device computes the same declared float16 program.
        found.failures.append(f"{trouble}; {FLOAT16_HINT}")
    if own is None and compression.method != "none":
        # Compressed weights this runtime cannot show: nothing to prove exactness against; the
        # quality verdict judges the package's own logits instead.
        found.notes.append("exact: not proven: this format's compressed weights cannot be read back (figures against float32)")
    else:
        # The conversion is exact, on every drive and sequence, whatever the compression.
        for drive, figures in by_drive.items():
            if figures["top1"] < thresholds["top1"]:
                found.failures.append(f"exact: top-1 {figures['top1']:.1%} < {thresholds['top1']:.1%} ({drive})")
            if figures["cosine"] < thresholds["cosine"]:
                found.failures.append(f"exact: cosine {figures['cosine']:.5f} < {thresholds['cosine']} ({drive})")
    found.by_drive = by_drive
    _quality(found, manifest, name, got, references, own, thresholds, tokens.text.get(name), tokens.random)
    return found


def _reference_rows(against: dict[str, np.ndarray | None], drive: str, logits: np.ndarray) -> np.ndarray:
    """The reference rows a drive's logits are compared with (a real-text drive ran on a prefix)."""
    rows = against["text" if drive.endswith(" text") else "random"]
    return rows[: len(logits)]


def _quality(
    found: FunctionReport, manifest: Manifest, name: str, got, references, own, thresholds: dict[str, float], ids, random_ids
) -> None:
    """The quality verdict into ``found``: on real text, the reference holding the package's
    weights against the float32 reference. Where the format's weights cannot be read back, the
    package's own logits stand in for that reference (on real text, else on the random ids)."""
    if ids is not None:
        where = "real text"
        compressed = own["text"] if own is not None and "text" in own else _worse_drive(got, found.by_drive, " text")
        reference, base = references.text[name], references.base_text[name]
    else:  # a base without a tokenizer: what the random ids show (no app can run it as it is)
        where, ids = "random ids", random_ids
        compressed = own["random"] if own is not None else _worse_drive(got, found.by_drive, "")
        reference, base = references.of(name), references.random[None]
        found.notes.append(f"quality: on random ids ({found.text})")
    reference, base = reference[: len(compressed)], base[: len(compressed)]
    # Random ids give flat next-token distributions whose top-1 flips on any change of weight (a
    # float16 rounding moves 6% of a small random model's): there, as in the exact verdict, a
    # near-tie within the two references' own difference is not a disagreement.
    figures = compare_logits(compressed, reference, ties_within_error=where == "random ids")
    ratio = perplexity_ratio(compressed, reference, ids[: len(compressed)])
    found.quality = {"perplexity_ratio": ratio, "agreement": figures["top1"], "kl": figures["kl"], "tokens": float(len(compressed))}
    if ratio > thresholds["perplexity_ratio"]:
        found.failures.append(f"quality: perplexity ratio {ratio:.3f} > {thresholds['perplexity_ratio']} on {where}")
    if figures["top1"] < thresholds["agreement"]:
        found.failures.append(f"quality: next-token agreement {figures['top1']:.1%} < {thresholds['agreement']:.1%} on {where}")
    if manifest.adapter(name) is None:
        return
    kept, effect = retention(compressed, reference, base)
    found.retention, found.adapter_effect = kept, effect
    if kept < thresholds["retention"]:
        remedy = (
            "keep the adapter unfused (lora: keep) or use more bits for its target modules"
            if manifest.lora_mode(name) == "fuse"
            else "use more bits for this function's compression"
        )
        found.failures.append(
            f"quality: adapter not retained: retention {kept:.2f} < {thresholds['retention']} on {where} (compression "
            f"washed out the adapter's effect); {remedy}"
        )


def _worse_drive(got: dict[str, np.ndarray], figures: dict[str, dict[str, float]], suffix: str) -> np.ndarray:
    """The logits of the drive (of the random ids, ``suffix`` "", or the real text, " text")
    farthest from its reference."""
    drives = [drive for drive in got if drive.endswith(suffix) and (suffix or not drive.endswith(" text"))]
    return got[min(drives, key=lambda drive: figures[drive]["cosine"])]
