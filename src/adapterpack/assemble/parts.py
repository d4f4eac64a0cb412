"""Parts: one function's compressed single-function package plus a JSON record of what made it.

The build cache and the fan-out across CI jobs both deal in parts. A part's key hashes every
input that can change its bytes (base and adapter content, settings, tool versions), so a cached
part is reused exactly when rebuilding would give the same bytes, and parts built on different
machines can be checked for coming from the same base, settings and tool versions before merging.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import NamedTuple

from adapterpack.assemble.calibration import calibration_key
from adapterpack.assemble.records import FunctionProvenance, content_key
from adapterpack.errors import BadInput
from adapterpack.formats.metadata import library_versions, package_metadata, strict_json
from adapterpack.formats.mlpackage.format import MLPACKAGE
from adapterpack.formats.mlpackage.weight_patch import link_or_copy

log = logging.getLogger(__name__)


PART_SUFFIX = ".part.json"


# Bump when the program a part holds changes for the same inputs (export_decoder, convert), so
# cached parts and converted bases from before are not reused.
PART_FORMAT = 4


# Fields every part of one package must agree on.
SHARED_FIELDS = ("manifest_name", "base", "max_context", "deployment_target", "versions", "function_order", "default_function")
# Fields that name or order a part without changing its bytes: left out of its key.
UNKEYED_FIELDS = ("function_order", "default_function", "manifest_name", "adapter")


@dataclass(frozen=True)
class BaseSource:
    """The base a part was built from: as the manifest names it, its content and the name the
    Swift client looks its tokenizer up by."""

    source: str
    revision: str | None
    sha256: str
    hf_name: str


@dataclass(frozen=True)
class PartRecord:
    """Everything that determines the bytes of one function's part; stored beside it as JSON."""

    manifest_name: str
    function: str
    function_order: tuple[str, ...]
    default_function: str
    adapter: str | None  # as the manifest names it
    adapter_sha256: str | None
    lora: str | None  # fuse | keep, None for the base
    scale: float | None
    compression: str  # human-readable
    compression_settings: dict
    lora_compression: dict | None  # keep mode only
    base: BaseSource
    max_context: int
    deployment_target: str
    versions: dict[str, str]
    format: int = PART_FORMAT
    # digest of the calibration its palettes are weighted by (assemble.calibration); None: unweighted
    calibration: str | None = None
    # what compression auto measured for the choice (assemble.auto.AutoChoice.as_metadata)
    auto: dict | None = None

    @classmethod
    def for_function(cls, checked, name: str, hf_name: str) -> PartRecord:
        """The record of function ``name`` of a checked manifest (inputs.checked.CheckedInputs)."""

        manifest = checked.manifest
        adapter = manifest.adapter(name)
        info = checked.adapters.get(name)
        mode = manifest.lora_mode(name) if adapter is not None else None

        compression = manifest.compression_for(name)
        calibration = calibration_key(checked, name)
        return cls(
            manifest_name=manifest.name,
            function=name,
            function_order=tuple(manifest.function_names),
            default_function=manifest.default,
            adapter=adapter.path if adapter is not None else None,
            adapter_sha256=info.content_hash if info is not None else None,
            lora=mode,
            scale=float(adapter.scale) if adapter is not None else None,
            compression=compression.describe() + (
                "" if not calibration else ", data-aware" if checked.calibration else ", calibrated on the base's own text"
            ),
            compression_settings=compression.model_dump(mode="json"),
            lora_compression=manifest.lora_compression.model_dump(mode="json") if mode == "keep" else None,
            base=BaseSource(
                source=manifest.base.path, revision=manifest.base.revision, sha256=checked.base.content_hash, hf_name=hf_name
            ),
            max_context=manifest.export.max_context,
            deployment_target=manifest.export.deployment_target,
            versions=library_versions(MLPACKAGE.libraries),
            calibration=calibration,
            auto=checked.auto_figures.get(name),
        )

    def as_json(self) -> dict:
        """The record as stored (``adapterSha256`` as in the package metadata)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["adapterSha256"] = data.pop("adapter_sha256")
        data["function_order"] = list(self.function_order)
        data["base"] = asdict(self.base)
        return data

    @classmethod
    def from_json(cls, data: object, where: Path) -> PartRecord:
        """A stored record; BadInput naming ``where`` when it is not one of this version."""
        if not isinstance(data, dict) or "function" not in data or data.get("format") != PART_FORMAT:
            raise BadInput(
                f"{where}: not an adapterpack part record of this version (format {PART_FORMAT}): "
                "build the parts again with this adapterpack"
            )
        values = dict(data)
        values["adapter_sha256"] = values.pop("adapterSha256", None)
        for added in ("calibration", "auto"):  # records of builds before these existed
            values.setdefault(added, None)
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise BadInput(f"{where}: part record fields {sorted(set(values) ^ names)} missing or unknown")
        values["function_order"] = tuple(values["function_order"])
        try:
            values["base"] = BaseSource(**values["base"])
        except TypeError:
            raise BadInput(f"{where}: part record's base is not {{source, revision, sha256, hf_name}}") from None
        return cls(**values)

    @property
    def key(self) -> str:
        """Content key: identical for identical inputs, settings and tool versions."""
        return content_key({k: v for k, v in self.as_json().items() if k not in UNKEYED_FIELDS})

    def provenance(self) -> FunctionProvenance:
        return FunctionProvenance(self.function, self.adapter, self.adapter_sha256, self.lora, self.scale, self.compression, self.auto)


class Part(NamedTuple):
    """A built part: its record and its single-function package."""

    record: PartRecord
    package: Path


def place(source: Path, destination: Path) -> None:
    """Copy a package folder, hard-linking files where possible (parts are never modified)."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(source, destination, copy_function=link_or_copy)


def write_part(folder: Path, part: Part) -> Path:
    """Store a part for a later ``adapterpack merge`` (fan-out across CI jobs)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = part.record.function
    target = folder / f"{name}.mlpackage"
    place(part.package, target)
    (folder / f"{name}{PART_SUFFIX}").write_text(strict_json(part.record.as_json(), indent=2, sort_keys=True))
    return target


def is_part(package: Path, function: str) -> bool:
    """Whether ``package`` is the part of ``function`` that ``write_part`` wrote: a package folder
    beside its record, which names that function."""
    record = package.with_name(f"{function}{PART_SUFFIX}")
    if package.is_symlink() or not package.is_dir() or record.is_symlink() or not record.is_file():
        return False
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("function") == function


def read_parts(folder: Path) -> list[Part]:
    """Parts in ``folder``, in the package's function order, checked to belong together."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder}: parts folder not found")
    parts: list[Part] = []
    for record_file in sorted(folder.glob(f"*{PART_SUFFIX}")):
        try:
            data = json.loads(record_file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise BadInput(f"{record_file}: not a readable part record ({error})") from None
        record = PartRecord.from_json(data, record_file)
        package = folder / f"{record.function}.mlpackage"
        if not package.is_dir():
            raise BadInput(f"{record_file}: its package {package.name} is missing")
        parts.append(Part(record, package))
    if not parts:
        raise BadInput(f"{folder}: no parts (*{PART_SUFFIX}) to merge")
    first = parts[0].record
    for record, _ in parts[1:]:
        for field in SHARED_FIELDS:
            if getattr(record, field) != getattr(first, field):
                raise BadInput(
                    f"{folder}: parts '{first.function}' and '{record.function}' differ in {field} "
                    f"({json.dumps(first.as_json()[field], sort_keys=True)[:120]} vs "
                    f"{json.dumps(record.as_json()[field], sort_keys=True)[:120]}): build all parts from one manifest "
                    "with the same adapterpack and library versions"
                )
    order = first.function_order
    present = {record.function for record, _ in parts}
    missing = [name for name in order if name not in present]
    extra = sorted(present - set(order))
    if missing or extra:
        detail = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}", extra and f"unexpected {', '.join(extra)}"]))
        raise BadInput(f"{folder}: parts do not make up the package: {detail}")
    return sorted(parts, key=lambda part: order.index(part.record.function))


def metadata_of(records: list[PartRecord], versions: dict[str, str]) -> tuple[dict[str, str], str]:
    """(package metadata, short description) of a package holding the functions of ``records``
    (one manifest's, in the package's order), written by libraries of ``versions``."""
    first = records[0]
    metadata = package_metadata(
        hf_name=first.base.hf_name,
        manifest_name=first.manifest_name,
        functions={r.function: r.provenance().as_metadata() for r in records},
        default_function=first.default_function,
        max_context=first.max_context,
        base={"source": first.base.source, "revision": first.base.revision, "sha256": first.base.sha256},
        versions=versions,
    )
    names = [r.function for r in records]
    return metadata, f"{first.manifest_name}: {len(names)} function(s) ({', '.join(names)}), built by adapterpack"
