"""The packages whose bytes must not change when the code that writes them is reorganised.

Each variant is a manifest (the demo, or a family project of ``factories``) with one format, LoRA
mode and compression; ``tests/package_digests.json`` holds the tree digest each one had when it
was recorded, beside the library versions that wrote it (the bytes depend on them). Recording
again is a deliberate act, for a change that is meant to change the bytes:

    .venv/bin/python tests/package_digests.py --write              # rebuild every variant, record digests
    .venv/bin/python tests/package_digests.py --write VARIANT ...  # only these
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from factories import FAMILIES, make_family_project, tree_digest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RECORD = Path(__file__).resolve().parent / "package_digests.json"
FORMATS = ("mlpackage", "aimodel")
# Every family's project already mixes LoRA modes (its `kept` adapter is kept, the others fused);
# Llama's is also built with every adapter kept, and the demo with its zen skill kept.
KEPT_PROJECTS = ("llama",)
# Compression beyond the float16 default, on the Llama project: each adapter's function its own
# method (per-adapter `compression`), the base and the rest palettized at 4 bits with the kept
# LoRA matrices as int8, fused and kept.
METHODS = {
    "rs": "{method: linear, nbits: 4, granularity: per_block, block_size: 32}",
    "mlp": "{method: linear, nbits: 8, granularity: per_channel}",
    "all": "{method: prune, sparsity: 0.5}",
}
METHODS_DEFAULT = "{method: palettize, nbits: 4}\nlora_compression: {method: linear, nbits: 8}"


def variants() -> list[str]:
    """``project-mode-format``: mode ``mixed`` is the project as written (some adapters fused,
    some kept), ``keep`` every adapter kept."""
    names = [f"demo-mixed-{fmt}" for fmt in FORMATS]
    names += [f"{family}-mixed-{fmt}" for family in FAMILIES for fmt in FORMATS]
    names += [f"{family}-keep-{fmt}" for family in KEPT_PROJECTS for fmt in FORMATS]
    names += [f"llama+methods-{mode}-{fmt}" for mode in ("mixed", "keep") for fmt in FORMATS]
    return names


def manifest_of(variant: str, root: Path) -> Path:
    """Write the manifest of ``variant`` under ``root``; returns it."""
    project, mode, _ = variant.rsplit("-", 2)
    root.mkdir(parents=True, exist_ok=True)
    if project == "demo":
        # The manifest names its inputs relative to itself, as the shipped one does: the package
        # records the base's path as written, so an absolute one would differ between checkouts.
        (root / "adapters").symlink_to(REPO / "adapters")
        (root / "manifests").mkdir()
        text = re.sub(r"(?m)^output:.*\n", "", (REPO / "manifests" / "demo.yaml").read_text())
        text = text.replace("    path: ../adapters/demo/zen\n", "    path: ../adapters/demo/zen\n    lora: keep\n")
        manifest = root / "manifests" / "m.yaml"
        manifest.write_text(text)
        return manifest
    family, _, methods = project.partition("+")
    manifest = make_family_project(root, family)
    # peft writes target_modules from a set, in the order of this process's string hashing: sorted,
    # the adapters (whose hashes the package records) have the same bytes in every process.
    for config in root.glob("*/adapter_config.json"):
        data = json.loads(config.read_text())
        if isinstance(data.get("target_modules"), list):
            data["target_modules"] = sorted(data["target_modules"])
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    text = re.sub(r"(?m)^compression:.*\n", "", manifest.read_text())
    if methods:
        for name, compression in METHODS.items():
            text = text.replace(f"    path: {name}\n", f"    path: {name}\n    compression: {compression}\n")
    if mode == "keep":
        text = re.sub(r"(?m)^    lora: .*\n", "", text) + "lora: keep\n"
    text += f"compression: {METHODS_DEFAULT if methods else '{method: none}'}\n"
    manifest.write_text(text)
    return manifest


# Adapters record their base's absolute path (peft's base_model_name_or_path), and the package
# records the adapters' hashes: every variant is built at the same place on every machine.
WORK = Path("/tmp/adapterpack-package-digests")


def built_digest(variant: str) -> str:
    import shutil

    from adapterpack.assemble.pipeline import build
    from adapterpack.assemble.records import BuildOptions

    fmt = variant.rsplit("-", 1)[1]
    root = WORK / variant
    shutil.rmtree(root, ignore_errors=True)
    manifest = manifest_of(variant, root)
    result = build(manifest, output=root / f"out.{fmt}", options=BuildOptions(use_cache=False, verify=False))
    digest = tree_digest(result.output)
    shutil.rmtree(root)
    return digest


def versions() -> dict[str, str]:
    from adapterpack.formats.metadata import library_versions
    from adapterpack.formats.registry import FORMATS

    return {name: library_versions(f.libraries) for name, f in FORMATS.items()}


def recorded() -> dict:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {"versions": {}, "digests": {}}


def main() -> None:
    if not sys.argv[1:] or sys.argv[1] != "--write":
        sys.exit(__doc__)
    chosen = sys.argv[2:] or variants()
    digests = recorded()["digests"] if sys.argv[2:] else {}
    for variant in chosen:
        digests[variant] = built_digest(variant)
        print(variant, digests[variant], flush=True)
    RECORD.write_text(json.dumps({"versions": versions(), "digests": digests}, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
