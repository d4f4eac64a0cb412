"""Making parts: the base traced, converted and compressed once per compression setting (the
templates), fused adapters patched into them, kept adapters converted on their own, and the
build cache consulted and filled along the way.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from adapterpack.assemble.calibration import calibration_key, channel_importance
from adapterpack.assemble.parts import PART_FORMAT, Part, PartRecord, metadata_of, place
from adapterpack.assemble.records import Reporter, content_key
from adapterpack.errors import BadInput
from adapterpack.formats.metadata import library_versions
from adapterpack.formats.mlpackage.format import MLPACKAGE
from adapterpack.formats.mlpackage.merge import merge_functions
from adapterpack.formats.mlpackage.weight_patch import TensorChange, patch_weights
from adapterpack.inputs.checked import CheckedInputs, hf_name

log = logging.getLogger(__name__)

# Compressions a fused function is patched into the compressed base with (formats.mlpackage.weights'
# compressed_records); pruning's kept values depend on the whole tensor, so it converts whole.
PATCHED_COMPRESSIONS = ("palettize", "linear")


def build_parts(
    checked: CheckedInputs,
    folder: Path,
    reporter: Reporter,
    *,
    cache=None,
    only: list[str] | None = None,
) -> tuple[list[Part], list[str]]:
    """Build (or take from ``cache``) the part of every function, in the package's order.

    Returns the parts and the names of the functions reused from the cache. The base is loaded
    only if some part has to be built.
    """
    from adapterpack.assemble.cache import FolderPalettes
    from adapterpack.compress.palettes import PaletteStore

    manifest = checked.manifest
    folder.mkdir(parents=True, exist_ok=True)
    # Palettes go to disk even without a build cache: a fused function's patch re-reads the
    # base's, and holding a 1B model's in memory would cost over a gigabyte.
    palette_files = cache.palette_files() if cache is not None else FolderPalettes(folder / ".palettes")
    names = only or manifest.function_names
    name_for_client = hf_name(checked)
    reused: list[str] = []
    built: list[str] = []
    builder = None
    records = {name: PartRecord.for_function(checked, name, name_for_client) for name in names}
    targets = {name: folder / f"{name}.mlpackage" for name in names}
    try:
        # Cached parts first (re-hashed side by side): a kept adapter's function can then be
        # patched from any of them.
        cached = {}
        if cache is not None and (cache.folder / "parts").is_dir():
            with reporter.stage("build cache: re-hash the parts it holds"):
                cached = cache.parts(records[name].key for name in names)
        for name in names:
            if records[name].key in cached:
                with reporter.stage(f"{name}: unchanged, reused from the build cache"):
                    place(cached[records[name].key], targets[name])
                reused.append(name)
        to_build = [name for name in names if name not in reused]
        importance = None
        if to_build:
            check_value_ranges(checked, to_build, reporter, cache)
            importance = channel_importance(checked, reporter, cache)
        palettes = PaletteStore(palette_files, importance)
        for name in names:
            if name not in reused:
                if builder is None:
                    builder = _PartBuilder(checked, reporter, folder, cache, palettes, templates_for(checked, to_build))
                builder.build(name, targets[name], finished={n: targets[n] for n in names if n in reused or n in built})
                built.append(name)
                if cache is not None:
                    cache.put_part(records[name].key, targets[name], records[name])
        parts = [Part(records[name], targets[name]) for name in names]
    finally:
        if builder is not None:
            builder.close()
        shutil.rmtree(folder / ".palettes", ignore_errors=True)
    return parts, reused


# Bump when what the float16 range check computes changes.
FLOAT16_CHECK = 1


def check_value_ranges(checked: CheckedInputs, functions: list[str], reporter: Reporter, cache=None) -> None:
    """Before converting ``functions``: their weights must fit float16, then (for a program
    computing in float16) every value their references compute on random ids and real text
    (``verification.ranges``), so a weight beyond float16 is named as such, not by its activations."""
    from adapterpack.verification.ranges import check_reference_values

    with reporter.stage("check that the weights fit float16"):
        check_float16_range(checked, functions, cache)
    export = checked.manifest.export
    if export.compute_precision == "float32":  # only a format computing as stored allows it (Export.check_for_format)
        return
    with reporter.stage(f"range check: {len(functions)} reference(s) on random ids and real text"):
        check_reference_values(checked, functions)


def check_float16_range(checked: CheckedInputs, functions: list[str], cache=None) -> None:
    """BadInput (exit 2) naming the tensor, before any conversion, when a weight of the base, a
    fused adapter's weight or a kept adapter's LoRA matrix does not fit float16 (see
    ``inputs.float16``). The base's magnitudes are read once per base and kept in the cache."""
    from adapterpack.inputs import float16

    base = checked.base
    check_key = content_key({"check": "float16-range", "version": FLOAT16_CHECK, "base": base.content_hash})
    magnitudes = cache.checks(check_key) if cache is not None else None
    computed = magnitudes is None
    if computed:
        magnitudes = float16.tensor_magnitudes(base.tensors)
    float16.check_base(magnitudes, base.tensors)
    if cache is not None and computed:
        cache.put_checks(check_key, magnitudes, base.content_hash)
    manifest = checked.manifest
    for name in functions:
        adapter = manifest.adapter(name)
        if adapter is None:
            continue
        info = checked.adapters[name]
        safetensors = {key: t for key, t in info.tensors.items() if t.file.suffix == ".safetensors"}
        if manifest.lora_mode(name) == "keep":
            float16.check_adapter_tensors(safetensors, "a kept adapter's LoRA matrices are")
            continue
        replaced = {key: t for key, t in safetensors.items() if any(f".{m}." in f".{key}" for m in info.modules_to_save)}
        float16.check_adapter_tensors(replaced, "the modules it replaces are")
        bounds = float16.fused_bounds(info.config, safetensors, float(adapter.scale), magnitudes)
        if all(float16.fits(bound) for bound in bounds.values()):
            continue
        from adapterpack.convert.lora import fused_magnitudes

        exact = fused_magnitudes(base, info, scale=float(adapter.scale)) or {}
        for tensor in sorted(exact):
            if not float16.fits(exact[tensor]):
                raise BadInput(
                    f"{info.origin}: fused with scale {adapter.scale}, {tensor} {float16.describe(exact[tensor])}: "
                    "it does not fit float16, which Core ML stores weights in; lower the scale or use lora: keep"
                )


def templates_for(checked: CheckedInputs, names: list[str]) -> set[str]:
    """Keys of the converted bases the functions ``names`` may be made from: each one's
    compression's (the uncompressed one's where that is none)."""
    return {template_key(checked, checked.manifest.compression_for(name)) for name in names}


def template_key(checked: CheckedInputs, compression=None) -> str:
    """Cache key of the converted base, uncompressed (None) or compressed as ``compression`` says."""
    from adapterpack.compress.palettes import PALETTE_ALGORITHM

    export = checked.manifest.export
    record = {
        "template": 2,
        "format": PART_FORMAT,
        "base": checked.base.content_hash,
        "max_context": export.max_context,
        "deployment_target": export.deployment_target,
        "versions": library_versions(MLPACKAGE.libraries),
    }
    if compression is not None and compression.method != "none":
        record.update(compression=compression.model_dump(mode="json"), palettes=PALETTE_ALGORITHM)
        if compression.uses_calibration() and calibration_key(checked) is not None:
            record.update(calibration=calibration_key(checked))
    return content_key(record)


class _PartBuilder:
    """Turns one function at a time into a part, doing each piece of shared work once.

    The base is traced and converted once (the template) and compressed once per compression
    setting (the compressed template). The base function is the compressed template; a fused
    function is the template with the records of the weights its adapter changes replaced
    (``mlpackage.weight_patch``: the template's blob linked, the new records in a blob of their
    own): its fused weights are computed from the targeted tensors alone
    (``lora.fused_weight_changes``) and palettized like the rest, so neither the torch base nor
    the whole program is loaded for it, nor the template's weights copied. Keep-mode functions (a different graph) and anything the
    patch cannot match exactly are converted and compressed on their own.

    Memory: the float16 torch base is loaded only to trace, and dropped before coremltools
    compresses anything, so a build never holds it and a compressing program at once.
    """

    def __init__(self, checked: CheckedInputs, reporter: Reporter, workdir: Path, cache, palettes, wanted: set[str] = frozenset()):
        self.checked = checked
        self._wanted = set(wanted)  # keys of the templates this build's functions are made from
        self.palettes = palettes  # compress.palettes.PaletteStore of this build
        self.reporter = reporter
        self.workdir = workdir
        self.cache = cache
        self._base = None
        self._templates: dict[str, Path] = {}

    @property
    def base(self):
        """The float16 torch base, loaded on first use."""
        if self._base is None:
            from adapterpack.convert.base_model import load_base

            with self.reporter.stage(f"load base {self.checked.manifest.base.path}"):
                self._base = load_base(self.checked.base.folder, dtype="float16")
        return self._base

    def release_base(self) -> None:
        import gc

        if self._base is not None:
            self._base = None
            gc.collect()

    def _convert(self, model):
        from adapterpack.formats.mlpackage.conversion import convert_decoder

        export = self.checked.manifest.export
        return convert_decoder(model, max_context=export.max_context, target=export.deployment_target)

    def _save(self, mlmodel, path: Path) -> None:
        from adapterpack.formats.mlpackage.spec import save_model

        save_model(mlmodel, path)

    def template(self, compression=None) -> Path:
        """The base converted once: uncompressed, or compressed as ``compression`` says.

        Cached beside the parts, keyed by the base's content, export settings and versions.
        """

        if compression is not None and compression.method == "none":
            compression = None
        key = template_key(self.checked, compression)
        if key in self._templates:
            return self._templates[key]
        path = self.workdir / f".template-{key[:16]}.mlpackage"
        cached = self.cache.template(key) if self.cache is not None else None
        if cached is not None:
            place(cached, path)
        elif compression is None:
            with self.reporter.stage("base: trace and convert (once for all functions)"):
                mlmodel = self._convert(self.base)
                self._save(mlmodel, path)
                del mlmodel
        else:
            from adapterpack.formats.mlpackage.weights import compress_package

            source = self.template(None)
            self.release_base()
            with self.reporter.progress(f"base: compress ({compression.describe()}, once for all functions)") as update:
                compress_package(source, path, compression, palettes=self.palettes, progress=update)
        if cached is None and self.cache is not None:
            self.cache.put_template(key, path, self.checked.base.content_hash)
        self._templates[key] = path
        if compression is not None:
            self._drop_uncompressed_when_done()
        return path

    def _drop_uncompressed_when_done(self) -> None:
        """Delete the uncompressed base (here and in the cache) once every compressed one this
        build needs is made, unless a function is made from it: it is the float16 model's whole
        size on disk (16 GB at 8B, beside 4.5 GB compressed), and only a change of compression
        would use it again, at the cost of converting the base again."""
        plain = template_key(self.checked)
        if plain in self._wanted or plain not in self._templates or any(k not in self._templates for k in self._wanted):
            return
        shutil.rmtree(self._templates.pop(plain), ignore_errors=True)
        entry = self.cache.open("bases", plain) if self.cache is not None else None
        if entry is not None:
            self.cache.drop(entry)
        log.debug("dropped the uncompressed base: every function is made from a compressed one")

    def _fused_changes(self, name: str, adapter) -> dict | None:
        """{tensor: (base, fused)} float16 values of a fused adapter, or None if it changes more
        than its LoRA targets (``modules_to_save``)."""
        from adapterpack.convert.lora import fused_weight_changes

        return fused_weight_changes(self.checked.base, self.checked.adapters[name], scale=float(adapter.scale))

    def _patched(self, changes: dict, compression, source: Path, target: Path, progress=None) -> bool:
        """``target`` = ``source`` with the fused weights in, in the form ``source`` stores them.

        ``progress(done, total)``: values compressed so far (the old values' palettes and
        compensated integers usually come from the cache, the new ones are computed)."""
        from adapterpack.config.compression import weight_setting
        from adapterpack.formats.mlpackage.weights import compressed_records

        pairs = [(old.numpy(), new.numpy()) for old, new in changes.values()]
        compressed = compression is not None and compression.method in PATCHED_COMPRESSIONS
        # old and new values of every changed tensor, compressed in order (palettes on both cores)
        names = [name for name in changes for _ in range(2)]
        values = [value for pair in pairs for value in pair]
        settings = [weight_setting(name, value.shape, compression) for name, value in zip(names, values)] if compressed else []
        records = compressed_records(values, settings, self.palettes, names) if compressed else None
        tensor_changes = []
        done, total = 0, 2 * sum(old.size for old, _ in pairs)
        for old, new in pairs:
            change = TensorChange.float16(old, new)  # as stored when kept float16
            before, after = (next(records), next(records)) if records is not None else (None, None)
            if before is not None and after is not None:
                change.encodings.insert(0, [(dtype, b, a) for (dtype, b), (_, a) in zip(before, after)])
            tensor_changes.append(change)
            done += 2 * old.size
            if progress is not None and records is not None:
                progress(done, total)
        return patch_weights(source, target, tensor_changes)

    def build(self, name: str, target: Path, finished: dict[str, Path] | None = None) -> None:
        """Make ``name``'s part at ``target``; ``finished``: parts already made or reused (by
        function), which a kept adapter's part may be patched from."""
        manifest = self.checked.manifest
        adapter = manifest.adapter(name)
        compression = manifest.compression_for(name)
        if adapter is None:
            place(self.template(compression), target)
            return
        mode = manifest.lora_mode(name)
        changes = None
        if mode == "fuse":
            patchable = compression.method in ("none", *PATCHED_COMPRESSIONS) and not self.checked.adapters[name].modules_to_save
            # The compressed base first: its build is the memory peak, and should not also hold
            # the fused weights.
            source = self.template(compression) if patchable else None
            with self.reporter.stage(f"{name}: fuse"):
                changes = self._fused_changes(name, adapter)
            if changes is not None and patchable:
                with self.reporter.progress(f"{name}: patch the fused weights into the compressed base") as update:
                    if self._patched(changes, compression, source, target, update):
                        return
                log.info("%s: the fused weights could not be matched in the compressed base: compressing it whole", name)
        signature = self._keep_signature(name) if mode == "keep" else None
        if signature is not None:
            for donor, part in (finished or {}).items():
                if donor != name and self._keep_signature(donor) == signature and self._keep_patched(name, donor, part, target):
                    return
        self._build_whole(name, adapter, mode, compression, changes, target)

    def _keep_signature(self, name: str) -> str | None:
        """What a ``lora: keep`` function's program depends on besides its LoRA values: the
        adapter's settings (rank, alpha, targets...), the names and shapes of its tensors, the
        manifest's scale and compression. None when the function is not kept or its LoRA
        matrices are compressed (then their stored bytes are not simply float16)."""
        import json

        manifest = self.checked.manifest
        adapter = manifest.adapter(name)
        if adapter is None or manifest.lora_mode(name) != "keep" or manifest.lora_compression.method != "none":
            return None
        info = self.checked.adapters[name]
        if info.weight_file.suffix != ".safetensors" or any(t.dtype not in ("F32", "F16") for t in info.tensors.values()):
            return None
        settings = {k: v for k, v in info.config.items() if k not in ("base_model_name_or_path", "revision", "inference_mode")}
        return json.dumps(
            {
                "settings": settings,
                "tensors": {key: [t.dtype, list(t.shape)] for key, t in sorted(info.tensors.items())},
                "scale": float(adapter.scale),
                "compression": manifest.compression_for(name).model_dump(mode="json"),
            },
            sort_keys=True,
            default=str,
        )

    def _keep_patched(self, name: str, donor: str, part: Path, target: Path) -> bool:
        """``target`` = ``donor``'s kept part with ``name``'s LoRA matrices in place of its own
        (the caller checked both have the same ``_keep_signature``).

        Two kept adapters of the same settings and shapes give the same program but for those
        values, stored float16 each in one record: patching them (found by content, as for fused
        weights) replaces a trace, a conversion and a compression of the whole model. Anything
        not found exactly once returns False, and the function is converted instead."""
        import numpy as np
        from safetensors import safe_open

        def lora_values(function: str) -> dict[str, np.ndarray]:
            info = self.checked.adapters[function]
            with safe_open(str(info.weight_file), framework="np") as handle:
                # as the converted program stores them: float16, in peft's layout
                return {key: handle.get_tensor(key).astype(np.float16) for key in info.tensors}

        old, new = lora_values(donor), lora_values(name)
        changes = [TensorChange.float16(old[key], new[key]) for key in sorted(old) if not np.array_equal(old[key], new[key])]
        with self.reporter.stage(f"{name}: patch its LoRA matrices into {donor}'s part (same settings)"):
            if patch_weights(part, target, changes):
                return True
        log.info("%s: %s's LoRA matrices were not each found once in its part: converting instead", name, donor)
        return False

    def _build_whole(self, name: str, adapter, mode: str, compression, changes: dict | None, target: Path) -> None:
        """One function converted (or patched uncompressed) and compressed on its own."""

        from adapterpack.convert.base_model import stored_weight_reader
        from adapterpack.convert.lora import applied_adapter
        from adapterpack.formats.mlpackage.weights import compress_package

        manifest = self.checked.manifest
        lora_compression = manifest.lora_compression if mode == "keep" else None
        converted = self.workdir / f".{name}.converted.mlpackage"
        if changes is None or not self._patched(changes, None, self.template(None), converted):
            with self.reporter.stage(f"{name}: trace and convert"):
                with applied_adapter(
                    self.base,
                    self.checked.adapters[name].folder,
                    mode=mode,
                    scale=float(adapter.scale),
                    original_weight=stored_weight_reader(self.checked.base),
                ) as model:
                    mlmodel = self._convert(model)
                # ``model`` is the base itself: unbound here, or release_base below frees nothing
                # and the whole base stays resident through the compression.
                del model
                self._save(mlmodel, converted)
                del mlmodel
        self.release_base()
        with self.reporter.progress(f"{name}: compress ({compression.describe()})") as update:
            compress_package(converted, target, compression, lora_compression, palettes=self.palettes, progress=update)
        shutil.rmtree(converted, ignore_errors=True)

    def close(self) -> None:
        self.release_base()
        for path in self._templates.values():
            shutil.rmtree(path, ignore_errors=True)
        self.palettes.clear()


def merge_parts(parts: list[Part], destination: Path) -> dict[str, str]:
    """Merge parts (all from one manifest, see ``parts.read_parts``) into one package with
    metadata; returns each function's digest (``mlpackage.digest``)."""

    first = parts[0].record
    metadata, description = metadata_of([record for record, _ in parts], first.versions)
    return merge_functions(
        {record.function: path for record, path in parts},
        default_function=first.default_function,
        destination=destination,
        metadata=metadata,
        description=description,
    )


def part_size(path: Path) -> int:
    """Bytes of a part's function alone: its package without the records it does not read (a
    fused part links the compressed base's blob, whose records it replaced are there still)."""
    from adapterpack.formats.mlpackage.weight_patch import unread_bytes

    return folder_size(path) - unread_bytes(path)


def folder_size(path: Path) -> int:
    """Bytes of all files under ``path`` (a package is a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
