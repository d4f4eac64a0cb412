"""Release artifacts for CI: a deterministic zip of the verified package, its provenance and sums.

``release`` builds (and verifies) into a staging folder inside the output folder, zips the package
with sorted entries, fixed timestamps and fixed permissions, writes ``build-info.json`` and
``SHA256SUMS``, and only then moves the three files into place. The same inputs with the same
tool versions give byte-identical files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from adapterpack.assemble.disk import float16_model_bytes
from adapterpack.assemble.pipeline import build
from adapterpack.assemble.plan import chosen_format, refuse_inside_a_cache
from adapterpack.assemble.records import BuildOptions, BuildResult, Reporter
from adapterpack.assemble.staging import Staging
from adapterpack.config.paths import refuse_overlap, resolved
from adapterpack.errors import BadInput, OutOfResources, OutputExists
from adapterpack.files import sha256_files
from adapterpack.formats.metadata import library_versions, strict_json
from adapterpack.formats.registry import written_by_adapterpack
from adapterpack.inputs.checked import check_inputs

log = logging.getLogger(__name__)

# 1980-01-01 00:00:00, the earliest time a zip entry can hold: the same for every build.
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
FILE_MODE = 0o644
DIR_MODE = 0o755
BUILD_INFO = "build-info.json"
SUMS = "SHA256SUMS"


@dataclass
class ReleaseResult:
    zip_path: Path
    build_info: Path
    sums: Path
    build: BuildResult
    bundle: Path | None = None  # the app-ready folder (distribution.bundle)
    eval_report: object | None = None  # evaluate.perplexity.EvalReport, with eval_text


def deterministic_zip(folder: Path, destination: Path) -> None:
    """Zip ``folder`` (an .mlpackage) as ``<folder.name>/...`` reproducibly."""
    entries = sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).as_posix())
    with zipfile.ZipFile(destination, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        root = zipfile.ZipInfo(folder.name + "/", date_time=ZIP_EPOCH)
        root.external_attr = (0o40000 | DIR_MODE) << 16
        archive.writestr(root, b"")
        for path in entries:
            name = f"{folder.name}/{path.relative_to(folder).as_posix()}"
            if path.is_dir():
                info = zipfile.ZipInfo(name + "/", date_time=ZIP_EPOCH)
                info.external_attr = (0o40000 | DIR_MODE) << 16
                archive.writestr(info, b"")
                continue
            info = zipfile.ZipInfo(name, date_time=ZIP_EPOCH)
            info.external_attr = (0o100000 | FILE_MODE) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            info.create_system = 3  # unix, whatever the host: the attributes above are unix modes
            with path.open("rb") as source, archive.open(info, "w", force_zip64=True) as target:
                shutil.copyfileobj(source, target, 1 << 20)


def required_disk_bytes(checked) -> int:
    """A conservative estimate of the disk a release needs: float16 parts for every function,
    the merged package, its staging copy and the zip (each about one float16 model or less)."""
    float16_model = float16_model_bytes(checked)
    functions = len(checked.manifest.function_names)
    return float16_model * (functions + 3)


def check_disk_space(folder: Path, needed: int) -> None:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise OutOfResources(
            f"{probe}: {free / 2**20:.0f} MiB free, a release of this manifest needs about "
            f"{needed / 2**20:.0f} MiB"
        )


def _check_outputs(
    written: list[Path], out_dir: Path, checked, package_name: str, eval_text: Path | None, options: BuildOptions
) -> None:
    """Before any work: the release's files may be written (replacing earlier ones only with
    ``--force``), and the disk holds what the build needs."""
    check_release_targets(written, out_dir / f"{checked.manifest.name}.release", checked, package_name, eval_text, options)
    existing = [t for t in written if t.exists() or t.is_symlink()]
    if existing and not options.force:
        raise OutputExists(f"{existing[0]} exists: pass --force to replace the release in {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    check_disk_space(out_dir, required_disk_bytes(checked))


def release(
    manifest,
    out_dir: str | Path,
    *,
    options: BuildOptions = BuildOptions(),
    reporter: Reporter | None = None,
    bundle: bool = True,
    eval_text: Path | None = None,
    eval_window: int | None = None,
) -> ReleaseResult:
    """Build, verify and write ``<name>.mlpackage.zip``, ``build-info.json``, ``SHA256SUMS`` and
    (``bundle``) the app-ready folder ``<name>/`` (``distribution.bundle``), whose model card has an
    evaluation table when ``eval_text`` is given (``evaluate.perplexity``)."""
    from adapterpack.distribution.bundle import write_bundle

    reporter = reporter or Reporter()
    out_dir = resolved(out_dir, "--out-dir")
    checked, package_name = _checked_release(manifest, out_dir, options, bundle=bundle, eval_text=eval_text)
    name = checked.manifest.name
    targets = [out_dir / f"{package_name}.zip", out_dir / BUILD_INFO, out_dir / SUMS]
    bundle_target = out_dir / name
    _check_outputs([*targets, *([bundle_target] if bundle else [])], out_dir, checked, package_name, eval_text, options)

    with Staging(out_dir / f"{name}.release") as staging:
        package = staging.folder / package_name
        # A release is always verified, and built afresh in staging.
        build_options = dataclasses.replace(options, force=True, verify=True)
        result = build(checked, output=package, options=build_options, reporter=reporter)
        zip_path = staging.folder / targets[0].name
        with reporter.stage("zip package"):
            deterministic_zip(package, zip_path)
        evaluated = None
        if eval_text is not None:
            from adapterpack.evaluate.perplexity import evaluate

            with reporter.progress(f"eval on {Path(eval_text).name}", "windows") as update:
                evaluated = evaluate(package, Path(eval_text), checked, window=eval_window, backend=options.backend, progress=update)
        bundle_files: dict[str, str] = {}
        if bundle:
            with reporter.stage(f"bundle {name}/: package, tokenizer files, Swift enum, model card"):
                bundle_files = write_bundle(staging.folder / name, checked, result, package, eval_report=evaluated)
        info = build_info(checked, result, zip_path)
        info["bundle"] = bundle_files or None
        info["eval"] = evaluated.as_json() | {"package": package_name, "text": Path(eval_text).name} if evaluated else None
        written = _write_provenance(staging.folder, zip_path, info, bundle_files)
        if bundle:
            shutil.rmtree(bundle_target, ignore_errors=True)  # --force: the new one is complete
            os.replace(staging.folder / name, bundle_target)
        # The sums file goes last: a release folder with a SHA256SUMS is complete.
        for built, target in zip(written, targets):
            os.replace(built, target)
    return ReleaseResult(
        zip_path=targets[0], build_info=targets[1], sums=targets[2], build=result,
        bundle=bundle_target if bundle else None, eval_report=evaluated,
    )


def check_release_targets(
    targets: list[Path], staging: Path, checked, package_name: str, eval_text: Path | None, options: BuildOptions
) -> None:
    """Refuse a release that would write over, into or around an input (the manifest, the base,
    an adapter, a calibration or eval text) or the build cache, or replace a file that is not
    part of an earlier release, with or without --force: --force replaces an earlier release,
    never anything else."""
    inputs = [*checked.input_paths(), *([eval_text] if eval_text is not None else [])]
    for target in [*targets, staging]:
        refuse_overlap(target, inputs, "release file")
        refuse_inside_a_cache(target, "release file")
        if options.cache_dir is not None and options.use_cache:
            refuse_overlap(target, [options.cache_dir], "release file (the build cache)")
    if options.cache_dir is not None and options.use_cache:
        refuse_overlap(options.cache_dir, inputs, "build cache")
    for target in targets:
        if (target.exists() or target.is_symlink()) and not _earlier_release_file(target, package_name):
            raise BadInput(
                f"{target} exists and is not a file of an earlier release: it is never replaced, even with --force; "
                "choose another --out-dir or remove it yourself"
            )


def _earlier_release_file(target: Path, package_name: str) -> bool:
    """Whether ``target`` is what a release writes under its name: the zip of the package, a
    build-info.json, a SHA256SUMS of sums, the bundle folder holding the package adapterpack
    wrote."""
    if target.is_symlink():
        return False
    try:
        if target.name == SUMS:
            lines = target.read_text(encoding="utf-8").splitlines()
            return bool(lines) and all(_SUM_LINE.fullmatch(line) for line in lines)
        if target.name == BUILD_INFO:
            info = json.loads(target.read_text(encoding="utf-8"))
            return isinstance(info, dict) and {"name", "versions", "functions"} <= set(info)
        if target.suffix == ".zip":
            with zipfile.ZipFile(target) as archive:
                names = archive.namelist()
            return bool(names) and all(n.split("/", 1)[0] == package_name for n in names)
        return target.is_dir() and written_by_adapterpack(target / package_name)
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


# A line of SHA256SUMS as `sha256sum -c` reads it.
_SUM_LINE = re.compile(r"[0-9a-f]{64}  [^\n]+")


def _checked_release(manifest, out_dir: Path, options: BuildOptions, *, bundle: bool, eval_text: Path | None):
    """(checked inputs writing the chosen format, the package's file name): every check a
    release makes before anything is built."""
    from adapterpack.distribution.bundle import check_tokenizer_files

    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"{out_dir}: --out-dir names a file; give a folder (it is created when missing)")
    checked = check_inputs(manifest, allow_pickle=options.allow_pickle, strict=options.strict)
    package_format = chosen_format(checked.manifest, None, options.package_format, options.contract)
    checked = checked.with_format(package_format.name, options.contract)  # build's own state-size check warns once
    if bundle:
        check_tokenizer_files(checked)
    if eval_text is not None:
        from adapterpack.inputs.text import read_text_file

        read_text_file(eval_text)  # a bad text file is bad input before anything is built
    return checked, f"{checked.manifest.name}{package_format.suffix}"


def _write_provenance(folder: Path, zip_path: Path, info: dict, bundle_files: dict[str, str]) -> tuple[Path, Path, Path]:
    """Write build-info.json and SHA256SUMS (over the zip, build-info and every bundle file)
    into ``folder``; returns (zip, build-info, sums)."""
    info_path = folder / BUILD_INFO
    info_path.write_text(strict_json(info, indent=2, sort_keys=True) + "\n")
    sums_path = folder / SUMS
    sums = {p.name: sha256_files([p]) for p in (zip_path, info_path)} | bundle_files
    sums_path.write_text("".join(f"{digest}  {path}\n" for path, digest in sorted(sums.items())))
    return zip_path, info_path, sums_path


def build_info(checked, result: BuildResult, zip_path: Path) -> dict:
    """Provenance of a release: inputs by content hash, settings, versions, verification, sizes."""

    manifest = checked.manifest
    report = result.verify_report
    return {
        "name": manifest.name,
        "manifest": manifest.model_dump(mode="json", exclude={"source", "output"}),
        "base": {
            "source": manifest.base.path,
            "revision": manifest.base.revision,
            "sha256": checked.base.content_hash,
            "model_type": checked.base.config.get("model_type"),
        },
        "adapters": {
            name: {
                "path": manifest.adapter(name).path,
                "sha256": info.content_hash,
                "lora": manifest.lora_mode(name),
                "scale": float(manifest.adapter(name).scale),
                "base_model_name_or_path": info.config.get("base_model_name_or_path"),
                "revision": info.config.get("revision"),
            }
            for name, info in checked.adapters.items()
        },
        "functions": [r.name for r in result.functions],
        "default_function": result.default_function,
        "compression": {r.name: r.compression for r in result.functions},
        "versions": library_versions(result.format.libraries),
        "verify": report.as_json() | {"package": result.output.name} if report is not None else None,
        "sizes": {
            "package_bytes": result.package_size,
            "zip_bytes": zip_path.stat().st_size,
            "functions_alone_bytes": result.part_sizes,
        },
    }
