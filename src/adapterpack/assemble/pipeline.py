"""The build, in order: the only module that knows the sequence of stages.

validate manifest -> check base and adapters (no torch yet) -> for each function not in the build
cache: make its part (the base converted and compressed once; fused adapters patched into it;
keep-mode adapters converted and compressed on their own) -> merge parts with metadata -> verify
what changed -> move into place.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from adapterpack.assemble.builder import (
    build_parts,
    folder_size,
    merge_parts,
    template_key,
)
from adapterpack.assemble.cache import BuildCache
from adapterpack.assemble.parts import PartRecord, content_key, read_parts, write_part
from adapterpack.assemble.records import BuildOptions, BuildResult, Reporter
from adapterpack.assemble.staging import Staging
from adapterpack.config.device_rules import package_findings
from adapterpack.config.devices import lora_float16_bytes
from adapterpack.config.manifest import Manifest, format_of
from adapterpack.errors import BadInput, OutputExists, VerificationFailed, warn_or_refuse
from adapterpack.inputs.checked import CheckedInputs, check_inputs, check_state_sizes
from adapterpack.mlpackage.functions import written_by_adapterpack
from adapterpack.mlpackage.spec import load_spec_file, spec_path
from adapterpack.verify.package import verify_package
from adapterpack.verify.reports import VERIFY_FORMAT

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
    runs on the merged package while it is still in staging: if it fails (VerificationFailed,
    exit 3), nothing is moved into place and a previous output is untouched.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    checked = check_inputs(manifest, allow_pickle=options.allow_pickle, strict=options.strict)
    check_state_sizes(checked, strict=options.strict)
    checked = checked.with_format(chosen_format(checked.manifest, output, options.package_format))
    manifest = checked.manifest
    destination = manifest.output_path(output)
    check_destination(destination, checked, force=options.force)
    cache_dir = Path(options.cache_dir) if options.cache_dir else destination.parent / CACHE_FOLDER
    cache = BuildCache(cache_dir) if options.use_cache else None
    if manifest.export.format == "aimodel":
        return _build_asset(checked, destination, options, reporter, cache, started)
    with Staging(destination) as staging:
        parts, reused = build_parts(checked, staging.folder / "parts", reporter, cache=cache)
        records = [record.function_record() for record, _ in parts]
        part_sizes = {record.function: folder_size(path) for record, path in parts}
        merged = staging.folder / destination.name
        with reporter.stage("merge functions"):
            digests = merge_parts(parts, merged)
        check_device_rules(merged, strict=options.strict, sizes_checked=True)
        report = None
        backend = options.backend
        if options.verify:

            keys = {record.function: verdict_key(record, digests[record.function], manifest, backend) for record, _ in parts}
            reuse = cache.verified(keys) if cache is not None else {}
            label = f"verify {len(records) - len(reuse)} function(s) ({backend})"
            with reporter.stage(label + (f"; {len(reuse)} with bytes equal to bytes verified before" if reuse else "")):
                report = verify_package(
                    merged, manifest, backend=backend, checked=checked, reuse=reuse, digests=digests, stage=reporter.stage
                )
            refuse_unless_passed(report, destination)
            if cache is not None:
                cache.put_verified({keys[f.name]: f for f in report.functions if f.name not in reuse})
        staging.commit(merged)
    if cache is not None:
        templates = {template_key(checked)} | {template_key(checked, manifest.compression_for(n)) for n in manifest.function_names}
        cache.prune_build(manifest.name, {record.key for record, _ in parts}, checked.base.content_hash, templates)

    result = BuildResult(
        output=destination,
        manifest=manifest,
        functions=records,
        default_function=manifest.default,
        part_sizes=part_sizes,
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
        reused=reused,
    )
    estimate = keep_mode_estimate(checked, result)
    if estimate is not None and estimate < KEEP_HINT_RATIO * result.package_size:
        reporter.info(
            f"hint: with `lora: keep` this package would be about {estimate / 2**20:.1f} MiB instead of "
            f"{result.package_size / 2**20:.1f} MiB (the base stored once, adapters as float16 LoRA matrices)"
        )
    return result


def check_destination(destination: Path, checked: CheckedInputs | None, *, force: bool) -> None:
    """Refuse an output that is, holds or lies inside an input (base, adapter, manifest,
    tokenizer), or that exists and is not a package adapterpack wrote, with or without --force;
    an existing package of ours needs --force."""
    if "\0" in str(destination):
        raise BadInput(f"{str(destination)!r}: the output path holds a NUL byte")
    target = Path(destination).resolve()
    inputs: list[Path] = []
    if checked is not None:
        inputs = [checked.base.folder, *(info.folder for info in checked.adapters.values())]
        if checked.manifest.source is not None:
            inputs.append(Path(checked.manifest.source))
    for given in inputs:
        given = Path(given).resolve()
        if target == given or target in given.parents or given in target.parents:
            raise BadInput(f"{destination}: the output would be written over or into an input ({given}): choose another output")
    if not (destination.exists() or destination.is_symlink()):
        return
    if not written_by_adapterpack(destination):
        raise BadInput(
            f"{destination} exists and is not a package adapterpack wrote: it is never replaced, even with --force; "
            "choose another output or remove it yourself"
        )
    if not force:
        raise OutputExists(f"{destination} exists: pass --force to replace it")


def refuse_unless_passed(report, destination: Path) -> None:
    """VerificationFailed (exit 3) unless every function passed; the output was not written."""
    if not report.passed:
        raise VerificationFailed(report.verdict() + f" (nothing written to {destination})").with_report(report)


# Why fan-out stops at the .mlpackage: Core AI shares weights only between entry points converted
# in one session, so separate jobs' assets could not be merged without storing the base again.
ASSET_WHOLE = (
    "parts and merge are for .mlpackage: an .aimodel is converted in one session to store the base once "
    "(build it whole: adapterpack build MANIFEST --format aimodel)"
)


def chosen_format(manifest: Manifest, output: str | Path | None, package_format: str | None) -> str:
    """The format a build writes: ``--format``, else the output path's suffix, else the manifest's."""
    named = format_of(output) if output is not None else None
    if package_format and named and named != package_format:
        raise BadInput(f"--output {output} is a .{named} but --format is {package_format}")
    chosen = package_format or named or manifest.export.format
    try:
        manifest.export.model_copy(update={"format": chosen}).check_precision()
    except ValueError as error:
        raise BadInput(f"{manifest.source or 'manifest'}: export: {error}") from None
    return chosen


def _build_asset(checked: CheckedInputs, destination: Path, options: BuildOptions, reporter: Reporter, cache, started: float) -> BuildResult:
    """The ``.aimodel`` build: one converter session for every function, verified with the Core AI
    runtime in staging. No parts: the asset is written whole (build cache: palettes only)."""
    from adapterpack.assemble.aimodel import build_asset

    manifest = checked.manifest
    report = None
    with Staging(destination) as staging:
        staged = staging.folder / destination.name
        records = build_asset(checked, staged, reporter, cache=cache)
        if options.verify:
            with reporter.stage(f"verify {len(records)} function(s) (Core AI runtime, CPU)"):
                report = verify_package(staged, manifest, checked=checked, stage=reporter.stage)
            refuse_unless_passed(report, destination)
        staging.commit(staged)
    return BuildResult(
        output=destination,
        manifest=manifest,
        functions=records,
        default_function=manifest.default,
        part_sizes={},
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
        reused=[],
    )


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


CACHE_FOLDER = ".adapterpack-cache"


def cache_key(manifest: Manifest | str | Path | CheckedInputs, function: str | None = None) -> tuple[str, str]:
    """(key, restore prefix) for a CI cache of the build cache (actions/cache): the key changes
    with anything that changes what the cache holds (the base's and adapters' content, the
    manifest's settings, tool and library versions; ``function`` for a fan-out job's part); the
    prefix matches every cache of the same base and versions, so a build whose adapters changed
    still restores the converted base and palettes. Costs one read of the inputs (the content
    hashes every build computes), not a hash of the cache."""
    from adapterpack.mlpackage.metadata import library_versions

    checked = check_inputs(manifest)
    m = checked.manifest
    if function is not None and function not in m.function_names:
        raise BadInput(f"--function {function}: not a function of {m.source}: choose one of {', '.join(m.function_names)}")
    versions = library_versions(core_ai=m.export.format == "aimodel")
    shared = content_key({"base": checked.base.content_hash, "versions": versions, "export": m.export.model_dump(mode="json")})[:16]
    everything = content_key({
        "shared": shared,
        "manifest": m.model_dump(mode="json", exclude={"source", "output"}),
        "adapters": {name: info.content_hash for name, info in checked.adapters.items()},
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
    checked = check_inputs(manifest, allow_pickle=options.allow_pickle, strict=options.strict)
    check_state_sizes(checked, strict=options.strict)
    if chosen_format(checked.manifest, None, options.package_format) == "aimodel":
        raise BadInput(ASSET_WHOLE)
    if function not in checked.manifest.function_names:
        raise BadInput(
            f"--function {function}: not a function of {checked.manifest.source}: "
            f"choose one of {', '.join(checked.manifest.function_names)}"
        )
    parts_dir = Path(parts_dir).resolve()
    with Staging(parts_dir / f"{function}.mlpackage") as staging:

        use_cache = options.cache_dir is not None and options.use_cache
        cache = BuildCache(Path(options.cache_dir)) if use_cache else None
        parts, _ = build_parts(checked, staging.folder, reporter, cache=cache, only=[function])
        return write_part(parts_dir, parts[0])


def merge_from_parts(
    parts_dir: str | Path,
    output: str | Path,
    *,
    manifest: Manifest | str | Path | None = None,
    options: BuildOptions = BuildOptions(),
    reporter: Reporter | None = None,
) -> BuildResult:
    """Fan-in: merge the parts in ``parts_dir`` into one package (verified when a manifest is given)."""
    backend = options.backend
    reporter = reporter or Reporter()
    started = time.perf_counter()
    if format_of(output) == "aimodel":
        raise BadInput(ASSET_WHOLE)
    parts = read_parts(Path(parts_dir))
    destination = Path(output).resolve()
    checked = check_inputs(manifest, strict=options.strict) if manifest is not None else None
    check_destination(destination, checked, force=options.force)
    if checked is not None and checked.base.content_hash != parts[0].record.base["sha256"]:
        raise BadInput(f"{parts_dir}: the parts were built from another base than {checked.manifest.source} names")
    report = None
    with Staging(destination) as staging:
        merged = staging.folder / destination.name
        with reporter.stage(f"merge {len(parts)} parts"):
            merge_parts(parts, merged)
        check_device_rules(merged, strict=options.strict)
        if checked is not None and options.verify:

            with reporter.stage(f"verify {len(parts)} function(s) ({backend})"):
                report = verify_package(merged, checked.manifest, backend=backend, checked=checked, stage=reporter.stage)
            refuse_unless_passed(report, destination)
        staging.commit(merged)
    first = parts[0].record
    return BuildResult(
        output=destination,
        manifest=checked.manifest if checked else None,
        functions=[record.function_record() for record, _ in parts],
        default_function=first.default_function,
        part_sizes={record.function: folder_size(path) for record, path in parts},
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
    )
