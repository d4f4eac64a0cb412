"""The second writer: every function of a manifest into one Core AI ``.aimodel``.

Shares everything before the writing with the ``.mlpackage`` build (manifest, checked inputs,
fusing with peft, the export wrapper, the palettes and their cache) and everything after it
(verification, metadata). What differs is the converter: all functions go through one Core AI
converter session (``formats.aimodel.conversion.AssetSession``), each compressed in torch
(``formats.aimodel.weights``), the base's compressed weights made once and shared.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import shutil
from pathlib import Path

from adapterpack.assemble.builder import check_value_ranges
from adapterpack.assemble.calibration import channel_importance
from adapterpack.assemble.parts import PartRecord, metadata_of
from adapterpack.assemble.records import FunctionProvenance, Reporter
from adapterpack.formats.aimodel.asset import CONTRACT_KEY
from adapterpack.formats.aimodel.format import AIMODEL
from adapterpack.formats.metadata import METADATA_PREFIX, library_versions, strict_json
from adapterpack.inputs.checked import CheckedInputs, hf_name

log = logging.getLogger(__name__)


def model_sizes(config: dict) -> dict[str, int | None]:
    """vocab, hidden, heads and MLP width of the base (config.json)."""
    return {
        "vocab": config.get("vocab_size"),
        "hidden": config.get("hidden_size"),
        "n_heads": config.get("num_attention_heads"),
        "intermediate": config.get("intermediate_size"),
    }


def _asset_metadata(checked: CheckedInputs, records: list[PartRecord]) -> tuple[dict[str, str], str]:
    """The asset's metadata and description: its functions' provenance, and what a ``.mlpackage``
    would say in its program (the model's shape, for ``inspect``'s activations estimate; the
    contract its functions follow)."""
    metadata, description = metadata_of(records, library_versions(AIMODEL.libraries))
    metadata[METADATA_PREFIX + "shape"] = strict_json(model_sizes(checked.base.config), sort_keys=True)
    contract = checked.manifest.export.contract
    if contract != "swift-transformers":
        # How its functions are called: what verify, generate and eval drive them with (an asset
        # without the key follows swift-transformers', as every asset did before).
        metadata[CONTRACT_KEY] = contract
    return metadata, description


def build_asset(checked: CheckedInputs, target: Path, reporter: Reporter, *, cache=None) -> list[FunctionProvenance]:
    """Write ``target`` (a ``.aimodel``): one entry point per function of ``checked``'s manifest."""
    from adapterpack.assemble.cache import FolderPalettes
    from adapterpack.compress.palettes import PaletteStore
    from adapterpack.convert.base_model import load_base, stored_weight_reader
    from adapterpack.convert.lora import applied_adapter
    from adapterpack.formats.aimodel.conversion import AssetSession, swapped_modules
    from adapterpack.formats.aimodel.weights import CoreAIWeights

    manifest = checked.manifest
    names = manifest.function_names
    session = AssetSession(
        max_context=manifest.export.max_context, compute=manifest.export.compute_precision, contract=manifest.export.contract
    )
    scratch = target.parent / f".{target.stem}.palettes"
    name_for_client = hf_name(checked)
    records = {name: PartRecord.for_function(checked, name, name_for_client) for name in names}
    try:
        check_value_ranges(checked, names, reporter, cache)
        importance = channel_importance(checked, reporter, cache)
        palettes = PaletteStore(cache.palette_files() if cache is not None else FolderPalettes(scratch), importance)
        weights = CoreAIWeights(palettes)
        with reporter.stage(f"load base {manifest.base.path}"):
            base = load_base(checked.base.folder, dtype="float16")
        original_weight = stored_weight_reader(checked.base)
        for name in names:
            adapter = manifest.adapter(name)
            mode = manifest.lora_mode(name) if adapter is not None else None
            compression = manifest.compression_for(name)
            applied = (
                applied_adapter(
                    base, checked.adapters[name].folder, mode=mode, scale=float(adapter.scale), original_weight=original_weight
                )
                if adapter is not None
                else contextlib.nullcontext(base)
            )
            lora_compression = manifest.lora_compression if mode == "keep" else None
            with applied as model:
                with reporter.progress(f"{name}: compress ({compression.describe()})") as update:
                    replacements = weights.replacements(model, compression, lora_compression, progress=update)
                # The model gets its own modules back before the next adapter is applied.
                with reporter.stage(f"{name}: export"), swapped_modules(model, replacements):
                    session.add(name, model)
                del replacements
        # ``model`` is the base itself once its adapter is unapplied: unbind both, or the float16
        # base stays resident while the converter copies every function's weights.
        del base, model
        gc.collect()
        log.debug("compressed weights: %d made, %d shared with an earlier function", weights.compressed_count, weights.reused_count)
        metadata, description = _asset_metadata(checked, [records[name] for name in names])
        with reporter.stage(f"convert {len(names)} function(s) to one Core AI program"):
            session.save(target, metadata=metadata, description=description)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [records[name].provenance() for name in names]
