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
from adapterpack.formats.registry import of_package, read_functions
from adapterpack.inputs.checked import check_inputs
from adapterpack.verify.executor import DeclaredTypeMismatch
from adapterpack.verify.metrics import compare_logits, retention
from adapterpack.verify.reference import reference_logits
from adapterpack.verify.reports import FunctionReport, VerifyReport
from adapterpack.verify.runners import Backend, backend_for, drive_runner

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
        run = drive_runner(package, backend)
    except BadInput:
        raise
    except Exception as error:  # a damaged package fails verification rather than crashing it
        report.integrity.append(f"package cannot be loaded: {type(error).__name__}: {error}")
        return report
    to_run = [n for n in expected if n not in reuse]
    ran = _run_functions(checked, to_run, run, digests, report, backend, stage)
    report.functions = [reuse[name] if name in reuse else ran[name] for name in expected if name in reuse or name in ran]
    return report


def _run_functions(checked, names: list[str], run, digests: dict[str, str], report: VerifyReport, backend: str, stage) -> dict:
    """{function: its report} for each of ``names`` that runs; a function that cannot run is
    an integrity failure in ``report``."""
    import gc

    manifest = checked.manifest
    # All PyTorch references first, then the torch base goes, and each function runs alone:
    # at no point does a float32 base share memory with a function's weights.
    with stage(f"references: the PyTorch base and {sum(manifest.adapter(n) is not None for n in names)} adapter(s), float32"):
        tokens, base_reference, references = reference_logits(checked, names)
    prefill = min(manifest.verify.prefill, len(tokens))
    gc.collect()
    ran: dict[str, FunctionReport] = {}
    for name in names:
        try:
            with stage(f"{name}: run both drives ({backend})"):
                got, trouble = run(name, tokens, prefill)
        except BadInput:
            raise
        except DeclaredTypeMismatch as error:
            report.integrity.append(f"function {name}: the program's declared types are not what its ops compute: {error}")
            continue
        except Exception as error:  # a damaged function fails verification rather than crashing it
            report.integrity.append(f"function {name} cannot be run: {type(error).__name__}: {error}")
            continue
        reference = references.get(name, base_reference)
        ran[name] = function_report(manifest, name, got, reference, base_reference, trouble, digests.get(name, ""))
        gc.collect()
    return ran


def function_report(
    manifest: Manifest, name: str, got: dict[str, np.ndarray], reference, base_reference, trouble: str | None, digest: str
) -> FunctionReport:
    """Function ``name``'s report from its logits under each drive (``got``), against its reference
    and the base's: the worse drive's figures, and every threshold any drive misses."""
    adapter = manifest.adapter(name)
    compression = manifest.compression_for(name)
    thresholds = manifest.verify.thresholds_for(compression)
    by_drive = {drive: compare_logits(logits, reference) for drive, logits in got.items()}
    worst = min(by_drive, key=lambda drive: (by_drive[drive]["cosine"], by_drive[drive]["top1"]))
    found = FunctionReport(
        name=name,
        compression=compression.describe(),
        retention=None,
        adapter_effect=None,
        thresholds=thresholds,
        drive=worst,
        digest=digest,
        **by_drive[worst],
    )
    if trouble is not None:
        # Named even when the figures pass: the device computes the same declared float16 program.
        found.failures.append(f"{trouble}; {FLOAT16_HINT}")
    # Thresholds hold for every drive, not only the reported one.
    for drive, figures in by_drive.items():
        label = f" ({drive} drive)" if len(by_drive) > 1 else ""
        if figures["top1"] < thresholds["top1"]:
            found.failures.append(f"top-1 {figures['top1']:.1%} < {thresholds['top1']:.1%}{label}")
        if figures["cosine"] < thresholds["cosine"]:
            found.failures.append(f"cosine {figures['cosine']:.4f} < {thresholds['cosine']}{label}")
    if adapter is not None:
        for drive, logits in got.items():
            kept, effect = retention(logits, reference, base_reference)
            by_drive[drive]["retention"] = kept
            if found.retention is None or kept < found.retention:
                found.retention, found.adapter_effect = kept, effect
        if found.retention < thresholds["retention"]:
            remedy = (
                "keep the adapter unfused (lora: keep) or use more bits for its target modules"
                if manifest.lora_mode(name) == "fuse"
                else "use more bits for this function's compression"
            )
            found.failures.append(
                f"adapter not retained: retention {found.retention:.2f} < {thresholds['retention']} (compression "
                f"washed out the adapter's effect); {remedy}"
            )
    found.by_drive = by_drive
    return found
