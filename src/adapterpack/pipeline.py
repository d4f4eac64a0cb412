"""The build, in order: the only module that knows the sequence of stages.

validate manifest -> check base and adapters (no torch yet) -> for each function not in the build
cache: make its part (the base converted and compressed once; fused adapters patched into it;
keep-mode adapters converted and compressed on their own) -> merge parts with metadata -> verify
what changed -> move into place.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager, Iterator

from .errors import BadInput, OutputExists
from .families import check_family
from .manifest import Manifest, load_manifest
from .staging import Staging

log = logging.getLogger(__name__)


class Reporter:
    """Progress hooks; the library default only logs. The CLI supplies a rich display."""

    def stage(self, label: str) -> ContextManager[None]:
        return _logged_stage(label)

    def info(self, message: str) -> None:
        log.info(message)


@contextlib.contextmanager
def _logged_stage(label: str) -> Iterator[None]:
    started = time.perf_counter()
    log.info("%s ...", label)
    yield
    log.info("%s done (%.1f s)", label, time.perf_counter() - started)


@dataclass
class FunctionRecord:
    name: str
    adapter: str | None
    adapter_sha256: str | None
    lora: str | None
    scale: float | None
    compression: str

    @classmethod
    def from_part(cls, record: dict) -> "FunctionRecord":
        return cls(
            record["function"], record["adapter"], record["adapterSha256"], record["lora"], record["scale"],
            record["compression"],
        )

    def as_metadata(self) -> dict[str, object]:
        return {
            "adapter": self.adapter,
            "adapterSha256": self.adapter_sha256,
            "lora": self.lora,
            "scale": self.scale,
            "compression": self.compression,
        }


@dataclass
class BuildResult:
    output: Path
    manifest: Manifest
    functions: list[FunctionRecord]
    default_function: str
    part_sizes: dict[str, int] = field(default_factory=dict)
    package_size: int = 0
    seconds: float = 0.0
    verify_report: object | None = None  # verify.VerifyReport when verification ran
    reused: list[str] = field(default_factory=list)  # functions taken from the build cache


@dataclass(frozen=True)
class CheckedInputs:
    """Everything known about the inputs before any heavy work."""

    manifest: Manifest
    base: object  # inputs.BaseInfo
    adapters: dict  # function name -> inputs.AdapterInfo


def check_inputs(
    manifest: Manifest | str | Path | CheckedInputs, *, allow_pickle: bool = False, strict: bool = False
) -> CheckedInputs:
    """Validate the manifest, the base and every adapter without importing torch or coremltools.

    ``strict`` turns warnings (an adapter trained on a differently named base) into errors.
    """
    from .inputs import inspect_adapter, resolve_base

    if isinstance(manifest, CheckedInputs):
        return manifest
    if not isinstance(manifest, Manifest):
        manifest = load_manifest(manifest)
    base = resolve_base(manifest.base.path, manifest.base.revision, manifest.folder)
    check_family(base.config, base.folder / "config.json")
    adapters = {}
    for adapter in manifest.adapters:
        # The hub id the tokenizer is named by is also a name of the base.
        aliases = tuple(filter(None, [manifest.base.tokenizer, base.config.get("_name_or_path")]))
        info = inspect_adapter(manifest.adapter_path(adapter), base, allow_pickle=allow_pickle, base_names=aliases)
        mode = manifest.lora_mode(adapter.name)
        if mode == "keep" and info.uses_dora:
            raise BadInput(
                f"{info.folder}: DoRA adapters cannot be kept unfused (their magnitude vector rescales "
                "the whole weight, so the base cannot be shared): use lora: fuse for this adapter"
            )
        if mode == "keep" and info.modules_to_save:
            raise BadInput(
                f"{info.folder}: modules_to_save ({', '.join(info.modules_to_save)}) replaces whole base "
                "modules, which cannot be shared: use lora: fuse for this adapter"
            )
        for warning in info.warnings:
            if strict:
                raise BadInput(f"{warning} (an error with --strict)")
            log.warning("%s", warning)
        adapters[adapter.name] = info
    if manifest.export.max_context == "auto":
        manifest = _resolve_auto_context(manifest, base, adapters)
    return CheckedInputs(manifest=manifest, base=base, adapters=adapters)


def check_state_sizes(checked: CheckedInputs, *, strict: bool) -> None:
    """Device rules on the state sizes the export will have (device_rules), before any heavy work:
    a warning, or BadInput with ``strict``."""
    from .device_rules import cache_length_findings

    manifest = checked.manifest
    config = checked.base.config.get("text_config") or checked.base.config
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for finding in cache_length_findings(int(manifest.export.max_context), int(head_dim), str(manifest.source)):
        if strict:
            raise BadInput(f"{finding.line()} (an error with --strict)")
        log.warning("%s", finding.line())


def _resolve_auto_context(manifest: Manifest, base, adapters: dict) -> Manifest:
    """``max_context: auto``: the largest context whose weights + KV-cache + activations fit the device."""
    from .device_rules import NEURAL_ENGINE_STATE_MULTIPLE
    from .devices import estimated_weight_bytes, find_device, largest_context_that_fits

    config = base.config.get("text_config") or base.config
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    largest = 0
    for name in manifest.function_names:
        info = adapters.get(name)
        lora = info.tensors if info is not None and manifest.lora_mode(name) == "keep" else {}
        largest = max(largest, estimated_weight_bytes(base.tensors, manifest.compression_for(name), lora))
    device = find_device(manifest.export.target_device)
    context = largest_context_that_fits(
        device,
        largest,
        config["num_hidden_layers"],
        config.get("num_key_value_heads") or heads,
        head_dim,
        config["vocab_size"],
        config["hidden_size"],
        n_heads=heads,
        intermediate=config.get("intermediate_size"),
    )
    if context == 0:
        raise BadInput(
            f"{manifest.source}: max_context: auto: the weights alone (~{largest / 2**30:.2f} GiB) leave no room "
            f"for even 256 tokens on {device.name}: compress more or pick a larger device"
        )
    trained = config.get("max_position_embeddings")
    if trained and context > trained:  # more cache than the model has positions for is waste
        context = int(trained)
    if context >= NEURAL_ENGINE_STATE_MULTIPLE:  # states the Neural Engine runs (see device_rules)
        context -= context % NEURAL_ENGINE_STATE_MULTIPLE
    log.info("max_context: auto -> %d tokens (fits %s)", context, device.name)
    export = manifest.export.model_copy(update={"max_context": context})
    return manifest.model_copy(update={"export": export})


def check_device_rules(package: Path, *, strict: bool, sizes_checked: bool = False) -> list:
    """Warn about (or, with ``strict``, refuse) a package that breaks a device rule (device_rules).

    ``sizes_checked``: the state-size rule was already reported from the manifest.
    """
    from .device_rules import package_findings
    from .inspect_package import load_spec_file, spec_path

    findings = package_findings(load_spec_file(spec_path(package)))
    if sizes_checked:
        findings = [f for f in findings if f.rule != "ane-state-multiple"]
    for finding in findings:
        if strict:
            raise BadInput(f"{finding.line()} (an error with --strict)")
        log.warning("%s", finding.line())
    return findings


def hf_name(checked: CheckedInputs) -> str:
    """The name the Swift client uses to look up the tokenizer (``co.huggingface.exporters.name``)."""
    from .manifest import looks_like_hub_id

    if checked.manifest.base.tokenizer:
        return checked.manifest.base.tokenizer
    source = checked.manifest.base.path
    if looks_like_hub_id(source) and not (checked.manifest.folder / source).exists():
        return source
    configured = str(checked.base.config.get("_name_or_path") or "")
    if looks_like_hub_id(configured):
        return configured
    return checked.base.folder.name


def build(
    manifest: Manifest | str | Path | CheckedInputs,
    *,
    output: str | Path | None = None,
    force: bool = False,
    allow_pickle: bool = False,
    reporter: Reporter | None = None,
    verify: bool = True,
    backend: str = "numpy",
    strict: bool = False,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
) -> BuildResult:
    """Build the package a manifest describes; returns where it went and what it holds.

    Functions whose inputs, settings and tool versions are unchanged since a previous build are
    taken from the build cache (default ``.adapterpack-cache`` beside the output). Verification
    runs on the merged package while it is still in staging: if it fails (VerificationFailed,
    exit 3), nothing is moved into place and a previous output is untouched.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    checked = check_inputs(manifest, allow_pickle=allow_pickle, strict=strict)
    check_state_sizes(checked, strict=strict)
    manifest = checked.manifest
    destination = manifest.output_path(output)
    if destination.exists() and not force:
        raise OutputExists(f"{destination} exists: pass --force to replace it")

    from .parts import PartCache

    cache = PartCache(Path(cache_dir) if cache_dir else destination.parent / CACHE_FOLDER) if use_cache else None
    with Staging(destination) as staging:
        parts, reused = build_parts(checked, staging.folder / "parts", reporter, cache=cache)
        records = [FunctionRecord.from_part(record) for record, _ in parts]
        part_sizes = {record["function"]: folder_size(path) for record, path in parts}
        merged = staging.folder / destination.name
        with reporter.stage("merge functions"):
            merge_parts(parts, merged)
        check_device_rules(merged, strict=strict, sizes_checked=True)
        report = None
        if verify:
            from .errors import VerificationFailed
            from .verify import verify_package

            keys = {record["function"]: verification_key(record, manifest, backend) for record, _ in parts}
            reuse = cache.verified(keys) if cache is not None else {}
            label = f"verify {len(records) - len(reuse)} function(s) ({backend})"
            with reporter.stage(label + (f"; {len(reuse)} unchanged since verified" if reuse else "")):
                report = verify_package(merged, manifest, backend=backend, checked=checked, reuse=reuse)
            if not report.passed:
                raise VerificationFailed(report.verdict() + f" (nothing written to {destination})").with_report(report)
            if cache is not None:
                cache.put_verified({keys[f.name]: f for f in report.functions if f.name not in reuse})
        staging.commit(merged)
    if cache is not None:
        from .parts import part_key

        templates = {template_key(checked)} | {template_key(checked, manifest.compression_for(n)) for n in manifest.function_names}
        cache.prune(manifest.name, {part_key(record) for record, _ in parts}, checked.base.content_hash, templates)

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
    from .devices import lora_float16_bytes

    base_bytes = min(result.part_sizes.values())
    return base_bytes + sum(lora_float16_bytes(info.tensors) for info in checked.adapters.values())


CACHE_FOLDER = ".adapterpack-cache"


def verification_key(record: dict, manifest: Manifest, backend: str) -> str:
    """Cache key of a function's verdict: its part (inputs, settings, versions), the verify
    settings and thresholds, and the backend."""
    import hashlib
    import json

    from .parts import part_key
    from .verify import VERIFY_FORMAT

    payload = {"part": part_key(record), "verify": manifest.verify.model_dump(mode="json"), "backend": backend, "format": VERIFY_FORMAT}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def build_parts(
    checked: CheckedInputs,
    folder: Path,
    reporter: Reporter,
    *,
    cache=None,
    only: list[str] | None = None,
) -> tuple[list[tuple[dict, Path]], list[str]]:
    """Build (or take from ``cache``) the part of every function, in the package's order.

    Returns the parts as (record, package path) and the names of the functions reused from the
    cache. The base is loaded only if some part has to be built.
    """
    from .compress import set_palette_cache
    from .parts import part_key, part_record, place

    manifest = checked.manifest
    folder.mkdir(parents=True, exist_ok=True)
    # Palettes go to disk even without a build cache: a fused function's patch re-reads the
    # base's, and holding a 1B model's in memory would cost over a gigabyte.
    set_palette_cache(cache.folder / "palettes" if cache is not None else folder / ".palettes")
    names = only or manifest.function_names
    name_for_client = hf_name(checked)
    parts: list[tuple[dict, Path]] = []
    reused: list[str] = []
    builder = None
    try:
        for name in names:
            record = part_record(checked, name, name_for_client)
            key = part_key(record)
            target = folder / f"{name}.mlpackage"
            cached = cache.get(key) if cache is not None else None
            if cached is not None:
                with reporter.stage(f"{name}: unchanged, reused from the build cache"):
                    place(cached, target)
                reused.append(name)
            else:
                if builder is None:
                    builder = _PartBuilder(checked, reporter, folder, cache)
                builder.build(name, target)
                if cache is not None:
                    cache.put(key, target, record)
            parts.append((record, target))
    finally:
        if builder is not None:
            builder.close()
        set_palette_cache(None)
        shutil.rmtree(folder / ".palettes", ignore_errors=True)
    return parts, reused


def template_key(checked: CheckedInputs, compression=None) -> str:
    """Cache key of the converted base, uncompressed (None) or compressed as ``compression`` says."""
    from .compress import PALETTE_ALGORITHM
    from .merge import library_versions
    from .parts import PART_FORMAT, part_key

    export = checked.manifest.export
    record = {
        "template": 2,
        "format": PART_FORMAT,
        "base": checked.base.content_hash,
        "max_context": export.max_context,
        "deployment_target": export.deployment_target,
        "versions": library_versions(),
    }
    if compression is not None and compression.method != "none":
        record.update(compression=compression.model_dump(mode="json"), palettes=PALETTE_ALGORITHM)
    return part_key(record)


class _PartBuilder:
    """Turns one function at a time into a part, doing each piece of shared work once.

    The base is traced and converted once (the template) and compressed once per compression
    setting (the compressed template). The base function is the compressed template; a fused
    function is a copy of it with the records of the weights its adapter changes replaced
    (``weight_patch.py``): its fused weights are computed from the targeted tensors alone
    (``lora.fused_weight_changes``) and palettized like the rest, so neither the torch base nor
    the whole program is loaded for it. Keep-mode functions (a different graph) and anything the
    patch cannot match exactly are converted and compressed on their own.

    Memory: the float16 torch base is loaded only to trace, and dropped before coremltools
    compresses anything, so a build never holds it and a compressing program at once.
    """

    def __init__(self, checked: CheckedInputs, reporter: Reporter, workdir: Path, cache=None):
        self.checked = checked
        self.reporter = reporter
        self.workdir = workdir
        self.cache = cache
        self._base = None
        self._templates: dict[str, Path] = {}

    @property
    def base(self):
        """The float16 torch base, loaded on first use."""
        if self._base is None:
            from .base_model import load_base

            with self.reporter.stage(f"load base {self.checked.manifest.base.path}"):
                self._base = load_base(self.checked.base.folder, dtype="float16")
        return self._base

    def release_base(self) -> None:
        import gc

        if self._base is not None:
            self._base = None
            gc.collect()

    def _convert(self, model):
        from .convert import convert_decoder

        export = self.checked.manifest.export
        return convert_decoder(model, max_context=export.max_context, target=export.deployment_target)

    def _save(self, mlmodel, path: Path) -> None:
        from .quiet import captured_output

        with captured_output():
            mlmodel.save(str(path))

    def template(self, compression=None) -> Path:
        """The base converted once: uncompressed, or compressed as ``compression`` says.

        Cached beside the parts, keyed by the base's content, export settings and versions.
        """
        from .parts import place

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
            from .compress import compress_model
            from .quiet import captured_output, import_coremltools

            source = self.template(None)
            self.release_base()
            with self.reporter.stage(f"base: compress ({compression.describe()}, once for all functions)"):
                with captured_output():
                    mlmodel = import_coremltools().models.MLModel(str(source), skip_model_load=True)
                mlmodel = compress_model(mlmodel, compression)
                self._save(mlmodel, path)
                del mlmodel
        if cached is None and self.cache is not None:
            self.cache.put_template(key, path, self.checked.base.content_hash)
        self._templates[key] = path
        return path

    def _fused_changes(self, name: str, adapter) -> dict | None:
        """{tensor: (base, fused)} float16 values of a fused adapter, or None if it changes more
        than its LoRA targets (``modules_to_save``)."""
        from .lora import fused_weight_changes

        return fused_weight_changes(self.checked.base, self.checked.adapters[name], scale=float(adapter.scale))

    def _patched(self, changes: dict, compression, source: Path, target: Path) -> bool:
        """``target`` = ``source`` with the fused weights in, in the form ``source`` stores them."""
        from .compress import palettized_records
        from .weight_patch import TensorChange, patch_weights

        pairs = [(old.numpy(), new.numpy()) for old, new in changes.values()]
        tensor_changes = [TensorChange.float16(old, new) for old, new in pairs]
        if compression is not None and compression.method == "palettize":
            # all changed tensors at once: their k-means runs batched
            records = palettized_records([value for pair in pairs for value in pair], compression)
            for change, before, after in zip(tensor_changes, records[0::2], records[1::2]):
                if before is not None and after is not None:
                    change.encodings.insert(0, [(dtype, b, a) for (dtype, b), (_, a) in zip(before, after)])
        return patch_weights(source, target, tensor_changes)

    def build(self, name: str, target: Path) -> None:
        from .parts import place

        manifest = self.checked.manifest
        adapter = manifest.adapter(name)
        compression = manifest.compression_for(name)
        if adapter is None:
            place(self.template(compression), target)
            return
        mode = manifest.lora_mode(name)
        changes = None
        if mode == "fuse":
            patchable = compression.method in ("none", "palettize") and not self.checked.adapters[name].modules_to_save
            # The compressed base first: its build is the memory peak, and should not also hold
            # the fused weights.
            source = self.template(compression) if patchable else None
            with self.reporter.stage(f"{name}: fuse"):
                changes = self._fused_changes(name, adapter)
            if changes is not None and patchable:
                with self.reporter.stage(f"{name}: patch the fused weights into the compressed base"):
                    if self._patched(changes, compression, source, target):
                        return
                log.info("%s: the fused weights could not be matched in the compressed base: compressing it whole", name)
        self._build_whole(name, adapter, mode, compression, changes, target)

    def _build_whole(self, name: str, adapter, mode: str, compression, changes: dict | None, target: Path) -> None:
        """One function converted (or patched uncompressed) and compressed on its own."""

        from .base_model import stored_weight_reader
        from .compress import compress_model
        from .lora import applied_adapter
        from .quiet import captured_output, import_coremltools

        manifest = self.checked.manifest
        lora_compression = manifest.lora_compression if mode == "keep" else None
        patched = self.workdir / f".{name}.patched.mlpackage"
        if changes is not None and self._patched(changes, None, self.template(None), patched):
            with captured_output():
                mlmodel = import_coremltools().models.MLModel(str(patched), skip_model_load=True)
        else:
            with self.reporter.stage(f"{name}: trace and convert"):
                with applied_adapter(
                    self.base,
                    self.checked.adapters[name].folder,
                    mode=mode,
                    scale=float(adapter.scale),
                    original_weight=stored_weight_reader(self.checked.base),
                ) as model:
                    mlmodel = self._convert(model)
        self.release_base()
        with self.reporter.stage(f"{name}: compress ({compression.describe()})"):
            mlmodel = compress_model(mlmodel, compression, lora_compression)
        self._save(mlmodel, target)
        del mlmodel
        shutil.rmtree(patched, ignore_errors=True)

    def close(self) -> None:
        from .compress import clear_palette_memo

        self.release_base()
        for path in self._templates.values():
            shutil.rmtree(path, ignore_errors=True)
        clear_palette_memo()


def merge_parts(parts: list[tuple[dict, Path]], destination: Path) -> None:
    """Merge parts (all from one manifest, see ``parts.read_parts``) into one package with metadata."""
    from .merge import merge_functions, package_metadata

    first = parts[0][0]
    records = [FunctionRecord.from_part(record) for record, _ in parts]
    metadata = package_metadata(
        hf_name=first["base"]["hf_name"],
        manifest_name=first["manifest_name"],
        functions={r.name: r.as_metadata() for r in records},
        default_function=first["default_function"],
        max_context=first["max_context"],
        base={k: first["base"][k] for k in ("source", "revision", "sha256")},
        versions=first["versions"],
    )
    names = [r.name for r in records]
    description = f"{first['manifest_name']}: {len(names)} function(s) ({', '.join(names)}), built by adapterpack"
    merge_functions(
        {record["function"]: path for record, path in parts},
        default_function=first["default_function"],
        destination=destination,
        metadata=metadata,
        description=description,
    )


def folder_size(path: Path) -> int:
    """Bytes of all files under ``path`` (a package is a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_function_part(
    manifest: Manifest | str | Path | CheckedInputs,
    function: str,
    parts_dir: str | Path,
    *,
    allow_pickle: bool = False,
    strict: bool = False,
    reporter: Reporter | None = None,
    cache_dir: str | Path | None = None,
) -> Path:
    """Fan-out: build one function's part into ``parts_dir`` for a later ``merge`` (one CI job each).

    With ``cache_dir`` (e.g. restored by the CI's cache action) the part, the converted base and
    palettes of earlier runs are reused.
    """
    from .parts import write_part

    reporter = reporter or Reporter()
    checked = check_inputs(manifest, allow_pickle=allow_pickle, strict=strict)
    check_state_sizes(checked, strict=strict)
    if function not in checked.manifest.function_names:
        raise BadInput(
            f"--function {function}: not a function of {checked.manifest.source}: "
            f"choose one of {', '.join(checked.manifest.function_names)}"
        )
    parts_dir = Path(parts_dir).resolve()
    with Staging(parts_dir / f"{function}.mlpackage") as staging:
        from .parts import PartCache

        cache = PartCache(Path(cache_dir)) if cache_dir is not None else None
        parts, _ = build_parts(checked, staging.folder, reporter, cache=cache, only=[function])
        record, package = parts[0]
        return write_part(parts_dir, package, record)


def merge_from_parts(
    parts_dir: str | Path,
    output: str | Path,
    *,
    force: bool = False,
    manifest: Manifest | str | Path | None = None,
    backend: str = "numpy",
    reporter: Reporter | None = None,
) -> BuildResult:
    """Fan-in: merge the parts in ``parts_dir`` into one package (verified when a manifest is given)."""
    from .parts import read_parts

    reporter = reporter or Reporter()
    started = time.perf_counter()
    parts = read_parts(Path(parts_dir))
    destination = Path(output).resolve()
    if destination.exists() and not force:
        raise OutputExists(f"{destination} exists: pass --force to replace it")
    checked = check_inputs(manifest) if manifest is not None else None
    if checked is not None and checked.base.content_hash != parts[0][0]["base"]["sha256"]:
        raise BadInput(f"{parts_dir}: the parts were built from another base than {checked.manifest.source} names")
    report = None
    with Staging(destination) as staging:
        merged = staging.folder / destination.name
        with reporter.stage(f"merge {len(parts)} parts"):
            merge_parts(parts, merged)
        check_device_rules(merged, strict=False)
        if checked is not None:
            from .errors import VerificationFailed
            from .verify import verify_package

            with reporter.stage(f"verify {len(parts)} function(s) ({backend})"):
                report = verify_package(merged, checked.manifest, backend=backend, checked=checked)
            if not report.passed:
                raise VerificationFailed(report.verdict() + f" (nothing written to {destination})").with_report(report)
        staging.commit(merged)
    first = parts[0][0]
    return BuildResult(
        output=destination,
        manifest=checked.manifest if checked else None,
        functions=[FunctionRecord.from_part(record) for record, _ in parts],
        default_function=first["default_function"],
        part_sizes={record["function"]: folder_size(path) for record, path in parts},
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
    )
