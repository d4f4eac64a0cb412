"""The disk a build will write, estimated before any work, and the refusal when it cannot fit.

A clean build of the parts-built format leaves in its build cache the base compressed, one part
per function, and for palettization the palettes (indices packed, half a byte each at 4 bits,
for the base and each fused function's own weights), as for error-compensated linear integers;
it stages the merged package beside the output. The base function's part is the compressed base
itself and a fused function's part shares its blob (``mlpackage.weight_patch``): on disk it is
the records of the weights its adapter changes; other parts are whole. The base converted
uncompressed (one float16 model) is on disk only while it is compressed, unless a function is
made from it. Files hard-linked into several places are counted once (``_folder_bytes``).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from adapterpack.config.compression import Compression
from adapterpack.errors import OutOfResources

# Palettes on disk per float16 model byte (1B shape, 4 adapters on q/k/v/o, 4 bits: 1.0 GB for
# 2.47 GB); compensated int4 integers take about as much (packed as the blob stores them).
PALETTE_SHARE = 0.45
# A function's program (its ops, not its weights) per decoder layer: 25 KB at the 1B shape.
SPEC_BYTES_PER_LAYER = 32 << 10
# A function not patched into the base (kept LoRA, pruning, modules it replaces) adds at most
# this share of the compressed base to the merged package: its own weights.
PACKAGE_GROWTH_PER_FUNCTION = 0.1


@dataclass(frozen=True)
class DiskNeeds:
    """Bytes a clean build writes: into the build cache and beside the output."""

    cache: int
    output: int


def float16_model_bytes(checked) -> int:
    """The base's weights at two bytes each."""
    weights = sum(path.stat().st_size for path in checked.base.weight_files)
    bytes_per_param = 4 if any(t.dtype == "F32" for t in checked.base.tensors.values()) else 2
    return weights * 2 // bytes_per_param


def stored_share(compression: Compression) -> float:
    """Bytes a compressed weight takes per float16 byte (palettes, scales and masks included);
    ``auto`` may move layers up to float16, so it counts as 8 bits."""
    if compression.method == "none":
        return 1.0
    if compression.auto is not None:
        return 0.5
    if compression.method == "prune":
        return min(1.0, 1.0 - float(compression.sparsity or 0.5) + 1 / 16)
    return min(1.0, (compression.nbits or 8) / 16 + 1 / 32)


def changed_bytes(checked, name: str) -> int | None:
    """Float16 bytes of the base weights a fused adapter changes (its target modules'), or None
    when its part is not patched into the base (``assemble.builder.PATCHED_COMPRESSIONS``)."""
    from adapterpack.assemble.builder import PATCHED_COMPRESSIONS

    manifest = checked.manifest
    info = checked.adapters.get(name)
    compression = manifest.compression_for(name)
    if info is None or manifest.lora_mode(name) != "fuse" or info.modules_to_save:
        return None
    if compression.method not in ("none", *PATCHED_COMPRESSIONS):
        return None
    tensors = checked.base.tensors
    return sum(2 * math.prod(tensors[f"{t}.weight"].shape) for t in info.target_modules if f"{t}.weight" in tensors)


def disk_needs(checked) -> DiskNeeds:
    manifest = checked.manifest
    model = float16_model_bytes(checked)
    compressions = [manifest.compression_for(name) for name in manifest.function_names]
    share = max(stored_share(c) for c in compressions)
    compressed = share * model
    # The uncompressed base is deleted once the compressed one is made, unless a function is
    # made from it (assemble.builder): then it is there only while the base is compressed.
    uncompressed = model if any(c.method == "none" for c in compressions) else 0.0
    kept_values = any(c.method == "palettize" or c.uses_calibration() for c in compressions)
    palettes = PALETTE_SHARE * model if kept_values else 0.0
    parts = package = 0.0
    for name in manifest.function_names:
        if manifest.adapter(name) is None:
            continue  # the compressed base itself
        changed = changed_bytes(checked, name)
        parts += compressed if changed is None else share * changed
        package += PACKAGE_GROWTH_PER_FUNCTION * compressed if changed is None else share * changed
    cache = compressed + palettes + max(model, uncompressed + parts)
    output = compressed + package
    # each part, and the converted and compressed bases, carry their own program
    functions = len(manifest.function_names)
    spec = SPEC_BYTES_PER_LAYER * int(checked.base.config.get("num_hidden_layers") or 1)
    cache += spec * (functions + 2)
    output += spec * functions
    return DiskNeeds(cache=int(cache), output=int(output))


def check_build_disk(checked, cache_dir: Path | None, destination: Path) -> None:
    """Refuse (OutOfResources, exit 4) a build whose estimate does not fit the free space of a
    filesystem it writes to. What the build cache already holds is written no more (a rebuild);
    it is counted, a walk of the cache, only when the clean build's estimate does not fit."""
    needs = disk_needs(checked)
    cached = 0
    short = _short_of_space(needs, cache_dir, destination, cached)
    if short is not None and cache_dir is not None:
        cached = _folder_bytes(cache_dir)
        short = _short_of_space(needs, cache_dir, destination, cached)
    if short is not None:
        probe, free, amount = short
        raise OutOfResources(
            f"{probe}: {free / 2**30:.1f} GiB free, this build needs about {amount / 2**30:.1f} GiB there "
            f"(build cache {needs.cache / 2**30:.1f} GiB, {cached / 2**30:.1f} GiB of it already cached; "
            f"package {needs.output / 2**30:.1f} GiB): free some space, or point --cache-dir at another disk"
        )


def _short_of_space(needs: DiskNeeds, cache_dir: Path | None, destination: Path, cached: int) -> tuple[Path, int, int] | None:
    """(a folder, its filesystem's free bytes, the bytes the build writes there) for the first
    filesystem that cannot hold them; None when every one can."""
    if cache_dir is None:  # without a cache, the build's intermediates live in its staging folder
        writes = [(destination.parent, needs.output + needs.cache)]
    else:
        writes = [(destination.parent, needs.output), (cache_dir, max(0, needs.cache - cached))]
    by_filesystem: dict[int, list] = {}
    for folder, amount in writes:
        probe = _existing(folder)
        by_filesystem.setdefault(os.stat(probe).st_dev, [probe, 0])[1] += amount
    for probe, amount in by_filesystem.values():
        free = shutil.disk_usage(probe).free
        if free < amount:
            return probe, free, amount
    return None


def _existing(folder: Path) -> Path:
    probe = Path(folder).resolve()
    while not probe.exists():
        probe = probe.parent
    return probe


def _folder_bytes(folder: Path) -> int:
    """Bytes the files under ``folder`` take, a file hard-linked in several places once (parts
    share the compressed base's blob)."""
    if not folder.is_dir():
        return 0
    sizes = {}
    for entry in folder.rglob("*"):
        if entry.is_file() and not entry.is_symlink():
            stat = entry.stat()
            sizes[stat.st_dev, stat.st_ino] = stat.st_size
    return sum(sizes.values())
