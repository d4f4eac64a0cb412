"""The build, in order: the only module that knows the sequence of stages.

validate manifest -> check base and adapters (no torch yet) -> for each function not in the build
cache: make its part (the base converted and compressed once; fused adapters patched into it;
keep-mode adapters converted and compressed on their own) -> merge parts with metadata -> verify
what changed -> move into place.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapterpack.assemble.builder import (
    build_parts,
    folder_size,
    merge_parts,
    part_size,
    templates_for,
)
from adapterpack.assemble.cache import BuildCache
from adapterpack.assemble.parts import PartRecord, is_part, read_parts, write_part
from adapterpack.assemble.plan import (
    Plan,
    check_cache_folder,
    check_destination,
    checked_for,
    plan_build,
    refuse_inside_a_cache,
    refuse_whole_format,
)
from adapterpack.assemble.records import BuildOptions, BuildResult, FunctionProvenance, Reporter, content_key
from adapterpack.assemble.staging import Staging
from adapterpack.config.device_rules import package_findings
from adapterpack.config.devices import lora_float16_bytes
from adapterpack.config.manifest import Manifest
from adapterpack.config.paths import refuse_overlap, resolved
from adapterpack.errors import BadInput, VerificationFailed, warn_or_refuse
from adapterpack.formats.aimodel.format import AIMODEL
from adapterpack.formats.aimodel.writer import build_asset
from adapterpack.formats.format import Format
from adapterpack.formats.mlpackage.spec import load_spec_file, spec_path
from adapterpack.formats.registry import named, of_package
from adapterpack.inputs.checked import CheckedInputs, check_inputs
from adapterpack.verification.package import verify_package
from adapterpack.verification.reports import VERIFY_FORMAT

log = logging.getLogger(__name__)


def check_device_rules(package: Path, *, strict: bool, sizes_checked: bool = False) -> list:
    """Warn about (or, with ``strict``, refuse) a package that breaks a device rule (device_rules).

    ``sizes_checked``: the state-size rule was already reported from the manifest.
    """

    findings = package_findings(load_spec_file(spec_path(package)))
    if sizes_checked:
        findings = [f for f in findings if f.rule != "ane-state-multiple"]
    for finding in findings:
        warn_or_refuse(finding.line(), strict=strict, log=log)
    return findings


@dataclass
class Written:
    """What a writer put in staging: each function's provenance, and for a format built in parts,
    each part's record and size, the functions taken from the cache, each function's digest."""

    functions: list[FunctionProvenance]
    parts: list = field(default_factory=list)  # [(PartRecord, part folder)]
    part_sizes: dict[str, int] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)
    digests: dict[str, str] | None = None


def build(
    manifest: Manifest | str | Path | CheckedInputs,
    *,
    output: str | Path | None = None,
    options: BuildOptions = BuildOptions(),
    reporter: Reporter | None = None,
) -> BuildResult:
    """Build the package a manifest describes; returns where it went and what it holds.

    Functions whose inputs, settings and tool versions are unchanged since a previous build are
    taken from the build cache (default ``.adapterpack-cache`` beside the output). Verification
    runs on the written package while it is still in staging: if it fails (VerificationFailed,
    exit 3), nothing is moved into place and a previous output is untouched.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    plan = plan_build(manifest, output, options)
    if plan.cache is not None:
        plan.cache.mark()
    with Staging(plan.destination) as staging:
        plan = dataclasses.replace(plan, checked=_chosen(plan.checked, plan.cache, staging.folder, reporter))
        staged = staging.folder / plan.destination.name
        write = _write_in_parts if plan.format.fans_out else _write_whole
        written = write(plan, staged, options, reporter)
        report = _verified(plan, staged, written, options, reporter) if options.verify else None
        staging.commit(staged)
    if plan.cache is not None and written.parts:
        _prune_cache(plan, written)
    result = _result(plan.format, plan.destination, plan.manifest, written, report, started)
    estimate = keep_mode_estimate(plan.checked, result)
    if estimate is not None and estimate < KEEP_HINT_RATIO * result.package_size:
        reporter.info(
            f"hint: with `lora: keep` this package would be about {estimate / 2**20:.1f} MiB instead of "
            f"{result.package_size / 2**20:.1f} MiB (the base stored once, adapters as float16 LoRA matrices)"
        )
    return result


def _chosen(checked: CheckedInputs, cache: BuildCache | None, scratch: Path, reporter: Reporter) -> CheckedInputs:
    """``checked`` with what ``compression.auto`` chose in place (the palettes it makes go to the
    build cache, else to ``scratch``)."""
    from adapterpack.assemble.auto import resolve_auto
    from adapterpack.assemble.cache import FolderPalettes

    files = cache.palette_files() if cache is not None else FolderPalettes(scratch / ".auto-palettes")
    return resolve_auto(checked, reporter, files, cache)[0]


def _write_in_parts(plan: Plan, staged: Path, options: BuildOptions, reporter: Reporter) -> Written:
    """A part per function (built or taken from the cache), merged into ``staged``."""
    parts, reused = build_parts(plan.checked, staged.parent / "parts", reporter, cache=plan.cache)
    with reporter.stage("merge functions"):
        digests = merge_parts(parts, staged)
    check_device_rules(staged, strict=options.strict, sizes_checked=True)
    return Written(
        functions=[record.provenance() for record, _ in parts],
        parts=parts,
        part_sizes={record.function: part_size(path) for record, path in parts},
        reused=reused,
        digests=digests,
    )


def _write_whole(plan: Plan, staged: Path, options: BuildOptions, reporter: Reporter) -> Written:
    """Every function written into ``staged`` by one converter session (build cache: palettes only)."""
    return Written(functions=WHOLE_WRITERS[plan.format.name](plan.checked, staged, reporter, cache=plan.cache))


# A format written whole (``Format.fans_out`` False) -> its writer: (checked inputs, target,
# reporter, cache=) -> each function's provenance.
WHOLE_WRITERS = {AIMODEL.name: build_asset}


def _verified(plan: Plan, staged: Path, written: Written, options: BuildOptions, reporter: Reporter):
    """Verify ``staged``, reusing verdicts the cache holds for bytes verified before; raise
    VerificationFailed (exit 3, nothing written) unless every function passed."""
    backend = plan.format.runtime or options.backend
    keys = {
        record.function: verdict_key(record, written.digests[record.function], plan.manifest, backend) for record, _ in written.parts
    }
    reuse = plan.cache.verified(keys) if plan.cache is not None and keys else {}
    label = f"verify {len(written.functions) - len(reuse)} function(s) ({backend})"
    with reporter.stage(label + (f"; {len(reuse)} with bytes equal to bytes verified before" if reuse else "")):
        report = verify_package(
            staged, plan.manifest, backend=options.backend, checked=plan.checked, reuse=reuse, digests=written.digests,
            stage=reporter.stage,
        )
    refuse_unless_passed(report, plan.destination)
    if plan.cache is not None and keys:
        plan.cache.put_verified({keys[f.name]: f for f in report.functions if f.name not in reuse})
    return report


def _prune_cache(plan: Plan, written: Written) -> None:
    manifest, checked = plan.manifest, plan.checked
    # the uncompressed base only when a function is made from it (builder._drop_uncompressed_when_done)
    templates = templates_for(checked, list(manifest.function_names))
    plan.cache.prune_build(manifest.name, {record.key for record, _ in written.parts}, checked.base.content_hash, templates)


def _result(package_format: Format, destination: Path, manifest, written: Written, report, started: float) -> BuildResult:
    return BuildResult(
        output=destination,
        manifest=manifest,
        functions=written.functions,
        default_function=manifest.default if manifest is not None else written.parts[0][0].default_function,
        part_sizes=written.part_sizes,
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
        reused=written.reused,
        format=package_format,
    )


def refuse_unless_passed(report, destination: Path) -> None:
    """VerificationFailed (exit 3) unless every function passed; the output was not written."""
    if not report.passed:
        raise VerificationFailed(report.verdict() + f" (nothing written to {destination})").with_report(report)


# Suggest keep mode when it would save more than a quarter of the package.
KEEP_HINT_RATIO = 0.75


def keep_mode_estimate(checked: CheckedInputs, result: BuildResult) -> int | None:
    """Estimated package bytes in keep mode, or None when no function is fused.

    One function's part is (close to) the whole base as compressed; keep mode adds only each
    adapter's LoRA matrices in float16.
    """
    fused = [r for r in result.functions if r.lora == "fuse"]
    if not fused or not result.part_sizes:
        return None

    base_bytes = min(result.part_sizes.values())
    return base_bytes + sum(lora_float16_bytes(info.tensors) for info in checked.adapters.values())


def cache_key(manifest: Manifest | str | Path | CheckedInputs, function: str | None = None) -> tuple[str, str]:
    """(key, restore prefix) for a CI cache of the build cache (actions/cache): the key changes
    with anything that changes what the cache holds (the base's, adapters' and calibration
    texts' content, the manifest's settings, tool and library versions; ``function`` for a fan-out job's part); the
    prefix matches every cache of the same base and versions, so a build whose adapters changed
    still restores the converted base and palettes. Costs one read of the inputs (the content
    hashes every build computes), not a hash of the cache."""
    from adapterpack.formats.metadata import library_versions

    checked = check_inputs(manifest)
    m = checked.manifest
    if function is not None and function not in m.function_names:
        raise BadInput(f"--function {function}: not a function of {m.source}: choose one of {', '.join(m.function_names)}")
    versions = library_versions(named(m.export.format).libraries)
    shared = content_key({"base": checked.base.content_hash, "versions": versions, "export": m.export.model_dump(mode="json")})[:16]
    everything = content_key({
        "shared": shared,
        "manifest": m.model_dump(mode="json", exclude={"source", "output"}),
        "adapters": {name: info.content_hash for name, info in checked.adapters.items()},
        "calibration": {str(name): text.sha256 for name, text in checked.calibration.items()},
        "function": function,
    })[:16]
    prefix = f"adapterpack-{versions['adapterpack']}-{m.name}-{shared}-"
    return prefix + everything, prefix


def verdict_key(record: PartRecord, digest: str, manifest: Manifest, backend: str) -> str:
    """Cache key of a function's verdict: the digest of its bytes as they are in the package
    (``mlpackage.digest``), what its reference is made from (the part's inputs, settings and
    versions), the verify settings and thresholds, and the backend. A verdict so keyed vouches
    for exactly the bytes it was given."""
    payload = {
        "bytes": digest,
        "part": record.key,
        "verify": manifest.verify.model_dump(mode="json"),
        "backend": backend,
        "format": VERIFY_FORMAT,
    }
    return content_key(payload)


def build_function_part(
    manifest: Manifest | str | Path | CheckedInputs,
    function: str,
    parts_dir: str | Path,
    *,
    options: BuildOptions = BuildOptions(),
    reporter: Reporter | None = None,
) -> Path:
    """Fan-out: build one function's part into ``parts_dir`` for a later ``merge`` (one CI job each).

    With ``options.cache_dir`` (e.g. restored by the CI's cache action) the part, the converted
    base and palettes of earlier runs are reused; parts use no cache otherwise.
    """
    reporter = reporter or Reporter()
    checked, package_format = checked_for(manifest, options)
    refuse_whole_format(package_format)
    if function not in checked.manifest.function_names:
        raise BadInput(
            f"--function {function}: not a function of {checked.manifest.source}: "
            f"choose one of {', '.join(checked.manifest.function_names)}"
        )
    parts_dir = resolved(parts_dir, "parts folder")
    use_cache = options.cache_dir is not None and options.use_cache
    cache_dir = resolved(options.cache_dir, "build cache") if use_cache else None
    check_parts_folder(parts_dir, function, package_format, checked, cache_dir)
    with Staging(parts_dir / f"{function}{package_format.suffix}") as staging:
        cache = BuildCache(cache_dir) if cache_dir is not None else None
        checked = _chosen(checked, cache, staging.folder, reporter)
        parts, _ = build_parts(checked, staging.folder, reporter, cache=cache, only=[function])
        return write_part(parts_dir, parts[0])


def check_parts_folder(parts_dir: Path, function: str, package_format: Format, checked: CheckedInputs, cache_dir: Path | None) -> None:
    """A fan-out part goes to a folder of parts: not an input, not the build cache; a part it
    replaces (a job run again) must be one adapterpack wrote."""
    refuse_overlap(parts_dir, checked.input_paths(), "parts folder")
    refuse_inside_a_cache(parts_dir, "parts folder")
    if cache_dir is not None:
        check_cache_folder(cache_dir, checked)
        refuse_overlap(parts_dir, [cache_dir], "parts folder (the build cache's own entries would mix with it)")
    existing = parts_dir / f"{function}{package_format.suffix}"
    if (existing.exists() or existing.is_symlink()) and not is_part(existing, function):
        raise BadInput(f"{existing} exists and is not a part adapterpack wrote: it is never replaced; remove it or choose another --parts")


def merge_from_parts(
    parts_dir: str | Path,
    output: str | Path,
    *,
    manifest: Manifest | str | Path | None = None,
    options: BuildOptions = BuildOptions(),
    reporter: Reporter | None = None,
) -> BuildResult:
    """Fan-in: merge the parts in ``parts_dir`` into one package (verified when a manifest is given)."""
    reporter = reporter or Reporter()
    started = time.perf_counter()
    package_format = of_package(output)
    refuse_whole_format(package_format)
    destination = resolved(output, "output")
    refuse_overlap(destination, [parts_dir], "output (the parts are its input)")
    parts = read_parts(Path(parts_dir))
    checked = check_inputs(manifest, strict=options.strict) if manifest is not None else None
    check_destination(destination, checked, force=options.force)
    if checked is not None and checked.base.content_hash != parts[0].record.base.sha256:
        raise BadInput(f"{parts_dir}: the parts were built from another base than {checked.manifest.source} names")
    report = None
    with Staging(destination) as staging:
        merged = staging.folder / destination.name
        with reporter.stage(f"merge {len(parts)} parts"):
            merge_parts(parts, merged)
        check_device_rules(merged, strict=options.strict)
        if checked is not None and options.verify:
            with reporter.stage(f"verify {len(parts)} function(s) ({options.backend})"):
                report = verify_package(merged, checked.manifest, backend=options.backend, checked=checked, stage=reporter.stage)
            refuse_unless_passed(report, destination)
        staging.commit(merged)
    written = Written(
        functions=[record.provenance() for record, _ in parts],
        parts=parts,
        part_sizes={record.function: part_size(path) for record, path in parts},
    )
    return _result(package_format, destination, checked.manifest if checked else None, written, report, started)
