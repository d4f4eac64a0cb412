"""What a build will do, decided once at the edge: the checked inputs, the format, where the
output goes and which build cache serves it. ``build``, fan-out parts, ``merge`` and ``release``
take a ``Plan``; nothing after it chooses a format or reads one back from a file name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adapterpack.assemble.cache import BuildCache, cache_holding
from adapterpack.assemble.disk import check_build_disk
from adapterpack.assemble.records import BuildOptions
from adapterpack.config.manifest import Manifest
from adapterpack.config.paths import refuse_overlap, resolved
from adapterpack.errors import BadInput, OutputExists
from adapterpack.formats.format import Format
from adapterpack.formats.registry import FORMATS, named, of_output, written_by_adapterpack
from adapterpack.inputs.checked import CheckedInputs, check_inputs, check_state_sizes

CACHE_FOLDER = ".adapterpack-cache"


@dataclass(frozen=True)
class Plan:
    checked: CheckedInputs  # its manifest writes ``format``
    format: Format
    destination: Path
    cache: BuildCache | None

    @property
    def manifest(self) -> Manifest:
        return self.checked.manifest


def chosen_format(
    manifest: Manifest, output: str | Path | None, package_format: str | None, contract: str | None = None
) -> Format:
    """The format a build writes: ``--format``, else the output path's suffix, else the manifest's
    (under ``contract``, ``--contract``, or the manifest's)."""
    by_path = of_output(output) if output is not None else None
    if package_format and by_path and by_path.name != package_format:
        raise BadInput(f"--output {output} is a {by_path.suffix} but --format is {package_format}")
    chosen = named(package_format or (by_path.name if by_path else manifest.export.format))
    try:
        manifest.export.model_copy(update={"format": chosen.name, "contract": contract or manifest.export.contract}).check_for_format()
    except ValueError as error:
        raise BadInput(f"{manifest.source or 'manifest'}: export: {error}") from None
    return chosen


def checked_for(manifest: Manifest | str | Path | CheckedInputs, options: BuildOptions, output: str | Path | None = None):
    """(checked inputs writing the chosen format, the format): every check before heavy work."""
    checked = check_inputs(manifest, allow_pickle=options.allow_pickle, strict=options.strict)
    check_state_sizes(checked, strict=options.strict)
    package_format = chosen_format(checked.manifest, output, options.package_format, options.contract)
    return checked.with_format(package_format.name, options.contract), package_format


def plan_build(
    manifest: Manifest | str | Path | CheckedInputs, output: str | Path | None, options: BuildOptions
) -> Plan:
    """The plan of ``adapterpack build``: inputs checked, format chosen, destination checked."""
    checked, package_format = checked_for(manifest, options, output)
    destination = checked.manifest.output_path(output)
    cache_dir = resolved(options.cache_dir, "build cache") if options.cache_dir else destination.parent / CACHE_FOLDER
    check_destination(destination, checked, force=options.force, cache_dir=cache_dir if options.use_cache else None)
    if options.use_cache:
        check_cache_folder(cache_dir, checked)
    check_build_disk(checked, cache_dir if options.use_cache else None, destination)
    return Plan(checked, package_format, destination, BuildCache(cache_dir) if options.use_cache else None)


def check_destination(destination: Path, checked: CheckedInputs | None, *, force: bool, cache_dir: Path | None = None) -> None:
    """Refuse an output that is, holds or lies inside an input (base, adapter, manifest,
    calibration text) or the build cache, or that exists and is not a package adapterpack wrote,
    with or without --force; an existing package of ours needs --force."""
    if "\0" in str(destination):
        raise BadInput(f"{str(destination)!r}: the output path holds a NUL byte")
    if of_output(destination) is None:
        raise BadInput(
            f"{destination}: a package is a folder named *{' or *'.join(f.suffix for f in FORMATS.values())} "
            "(a release's zip is written by `adapterpack release`)"
        )
    refuse_overlap(destination, checked.input_paths() if checked is not None else ())
    refuse_inside_a_cache(destination, "output")
    if cache_dir is not None:
        refuse_overlap(destination, [cache_dir], "output (it would be inside the build cache, or hold it)")
    if not (destination.exists() or destination.is_symlink()):
        return
    if not written_by_adapterpack(destination):
        raise BadInput(
            f"{destination} exists and is not a package adapterpack wrote: it is never replaced, even with --force; "
            "choose another output or remove it yourself"
        )
    if not force:
        raise OutputExists(f"{destination} exists: pass --force to replace it")


def refuse_inside_a_cache(path: Path, role: str) -> None:
    """BadInput when ``path`` lies inside a build cache (``cache verify`` would drop it)."""
    holder = cache_holding(resolved(path, role))
    if holder is not None:
        raise BadInput(f"{path}: the {role} would be inside the build cache {holder}, whose commands drop what they did not write: choose another {role}")


def check_cache_folder(cache_dir: Path, checked: CheckedInputs) -> None:
    """The build cache writes and deletes its own entries: it must not be, hold or lie inside an input."""
    refuse_overlap(cache_dir, checked.input_paths(), "build cache")


def refuse_whole_format(package_format: Format) -> None:
    """Parts and merge exist for formats built one function at a time."""
    if not package_format.fans_out:
        raise BadInput(
            f"parts and merge are for formats built one function at a time: a {package_format.title} is written "
            f"in one session to store the base once (build it whole: adapterpack build MANIFEST --format {package_format.name})"
        )
