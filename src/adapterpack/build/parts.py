"""Parts: one function's compressed single-function package plus a JSON record of what made it.

The build cache and the fan-out across CI jobs both deal in parts. A part's key hashes every
input that can change its bytes (base and adapter content, settings, tool versions), so a cached
part is reused exactly when rebuilding would give the same bytes, and parts built on different
machines can be checked for coming from the same base, settings and tool versions before merging.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from adapterpack.errors import BadInput

log = logging.getLogger(__name__)


PART_SUFFIX = ".part.json"


# Bump when the program a part holds changes for the same inputs (export_decoder, convert), so
# cached parts and converted bases from before are not reused.
PART_FORMAT = 2


# Fields every part of one package must agree on.
SHARED_FIELDS = ("manifest_name", "base", "max_context", "deployment_target", "versions", "function_order", "default_function")


def part_record(checked, name: str, hf_name: str) -> dict:
    """Everything that determines the bytes of function ``name``'s part, as plain JSON data."""
    from adapterpack.mlpackage.metadata import library_versions

    manifest = checked.manifest
    adapter = manifest.adapter(name)
    info = checked.adapters.get(name)
    mode = manifest.lora_mode(name) if adapter is not None else None
    compression = manifest.compression_for(name)
    return {
        "format": PART_FORMAT,
        "manifest_name": manifest.name,
        "function": name,
        "function_order": manifest.function_names,
        "default_function": manifest.default,
        "adapter": adapter.path if adapter is not None else None,
        "adapterSha256": info.content_hash if info is not None else None,
        "lora": mode,
        "scale": float(adapter.scale) if adapter is not None else None,
        "compression": compression.describe(),
        "compression_settings": compression.model_dump(mode="json"),
        "lora_compression": manifest.lora_compression.model_dump(mode="json") if mode == "keep" else None,
        "base": {
            "source": manifest.base.path,
            "revision": manifest.base.revision,
            "sha256": checked.base.content_hash,
            "hf_name": hf_name,
        },
        "max_context": manifest.export.max_context,
        "deployment_target": manifest.export.deployment_target,
        "versions": library_versions(),
    }


def part_key(record: dict) -> str:
    """Content key of a part: identical for identical inputs, settings and tool versions."""
    payload = {k: v for k, v in record.items() if k not in ("function_order", "default_function", "manifest_name", "adapter")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def place(source: Path, destination: Path) -> None:
    """Copy a package folder, hard-linking files where possible (parts are never modified)."""
    if destination.exists():
        shutil.rmtree(destination)

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, destination, copy_function=link_or_copy)


def write_part(folder: Path, package: Path, record: dict) -> Path:
    """Store a part for a later ``adapterpack merge`` (fan-out across CI jobs)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = record["function"]
    target = folder / f"{name}.mlpackage"
    place(package, target)
    (folder / f"{name}{PART_SUFFIX}").write_text(json.dumps(record, indent=2, sort_keys=True))
    return target


def read_parts(folder: Path) -> list[tuple[dict, Path]]:
    """Parts in ``folder``, in the package's function order, checked to belong together."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder}: parts folder not found")
    parts: list[tuple[dict, Path]] = []
    for record_file in sorted(folder.glob(f"*{PART_SUFFIX}")):
        try:
            record = json.loads(record_file.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise BadInput(f"{record_file}: not a readable part record ({error})") from None
        if not isinstance(record, dict) or "function" not in record or record.get("format") != PART_FORMAT:
            raise BadInput(
                f"{record_file}: not an adapterpack part record of this version (format {PART_FORMAT}): "
                "build the parts again with this adapterpack"
            )
        package = folder / f"{record['function']}.mlpackage"
        if not package.is_dir():
            raise BadInput(f"{record_file}: its package {package.name} is missing")
        parts.append((record, package))
    if not parts:
        raise BadInput(f"{folder}: no parts (*{PART_SUFFIX}) to merge")
    first = parts[0][0]
    for record, _ in parts[1:]:
        for field in SHARED_FIELDS:
            if record.get(field) != first.get(field):
                raise BadInput(
                    f"{folder}: parts '{first['function']}' and '{record['function']}' differ in {field} "
                    f"({json.dumps(first.get(field), sort_keys=True)[:120]} vs "
                    f"{json.dumps(record.get(field), sort_keys=True)[:120]}): build all parts from one manifest "
                    "with the same adapterpack and library versions"
                )
    order = first["function_order"]
    present = {record["function"] for record, _ in parts}
    missing = [name for name in order if name not in present]
    extra = sorted(present - set(order))
    if missing or extra:
        detail = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}", extra and f"unexpected {', '.join(extra)}"]))
        raise BadInput(f"{folder}: parts do not make up the package: {detail}")
    return sorted(parts, key=lambda part: order.index(part[0]["function"]))
