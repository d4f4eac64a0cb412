"""The build, in order: the only module that knows the sequence of stages.

validate manifest -> check base and adapters (no torch yet) -> load base once -> for each function:
apply adapter, convert, compress, save a part -> merge parts -> write metadata -> move into place.
"""

from __future__ import annotations

import contextlib
import logging
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
        info = inspect_adapter(manifest.adapter_path(adapter), base, allow_pickle=allow_pickle)
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
    return CheckedInputs(manifest=manifest, base=base, adapters=adapters)


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
) -> BuildResult:
    """Build the package a manifest describes; returns where it went and what it holds.

    Verification runs on the merged package while it is still in staging: if it fails
    (VerificationFailed, exit 3), nothing is moved into place and a previous output is untouched.
    """
    reporter = reporter or Reporter()
    started = time.perf_counter()
    checked = check_inputs(manifest, allow_pickle=allow_pickle, strict=strict)
    manifest = checked.manifest
    destination = manifest.output_path(output)
    if destination.exists() and not force:
        raise OutputExists(f"{destination} exists: pass --force to replace it")

    with Staging(destination) as staging:
        records, part_sizes = _build_parts(checked, staging.folder, reporter)
        merged = staging.folder / destination.name
        with reporter.stage("merge functions"):
            _merge(checked, records, {r.name: staging.folder / "parts" / f"{r.name}.mlpackage" for r in records}, merged)
        report = None
        if verify:
            from .errors import VerificationFailed
            from .verify import verify_package

            with reporter.stage(f"verify {len(records)} function(s) ({backend})"):
                report = verify_package(merged, manifest, backend=backend, checked=checked)
            if not report.passed:
                raise VerificationFailed(report.verdict() + f" (nothing written to {destination})").with_report(report)
        staging.commit(merged)

    result = BuildResult(
        output=destination,
        manifest=manifest,
        functions=records,
        default_function=manifest.default,
        part_sizes=part_sizes,
        package_size=folder_size(destination),
        seconds=time.perf_counter() - started,
        verify_report=report,
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
_LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B")


def keep_mode_estimate(checked: CheckedInputs, result: BuildResult) -> int | None:
    """Estimated package bytes in keep mode, or None when no function is fused.

    One function's part is (close to) the whole base as compressed; keep mode adds only each
    adapter's LoRA matrices in float16.
    """
    fused = [r for r in result.functions if r.lora == "fuse"]
    if not fused or not result.part_sizes:
        return None
    base_bytes = min(result.part_sizes.values())
    lora_bytes = 0
    for name, info in checked.adapters.items():
        for key, tensor in info.tensors.items():
            if key.endswith(_LORA_SUFFIXES):
                count = 1
                for dim in tensor.shape:
                    count *= dim
                lora_bytes += 2 * count
    return base_bytes + lora_bytes


def _build_parts(checked: CheckedInputs, folder: Path, reporter: Reporter) -> tuple[list[FunctionRecord], dict[str, int]]:
    from .base_model import load_base
    from .compress import clear_palette_memo, compress_model
    from .convert import convert_decoder
    from .lora import applied_adapter

    manifest = checked.manifest
    with reporter.stage(f"load base {manifest.base.path}"):
        base = load_base(checked.base.folder)
    records: list[FunctionRecord] = []
    sizes: dict[str, int] = {}
    parts = folder / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for name in manifest.function_names:
        adapter = manifest.adapter(name)
        compression = manifest.compression_for(name)
        if adapter is None:
            context = contextlib.nullcontext(base)
            record = FunctionRecord(name, None, None, None, None, compression.describe())
        else:
            info = checked.adapters[name]
            mode = manifest.lora_mode(name)
            context = applied_adapter(base, info.folder, mode=mode, scale=float(adapter.scale))
            record = FunctionRecord(
                name, adapter.path, info.content_hash, mode, float(adapter.scale), compression.describe()
            )
        with reporter.stage(f"{name}: convert"):
            with context as model:
                mlmodel = convert_decoder(
                    model,
                    max_context=manifest.export.max_context,
                    target=manifest.export.deployment_target,
                )
        lora_compression = manifest.lora_compression if adapter is not None and manifest.lora_mode(name) == "keep" else None
        with reporter.stage(f"{name}: compress ({compression.describe()})"):
            mlmodel = compress_model(mlmodel, compression, lora_compression)
        part = parts / f"{name}.mlpackage"
        from .quiet import captured_output

        with captured_output():
            mlmodel.save(str(part))
        del mlmodel
        sizes[name] = folder_size(part)
        records.append(record)
    del base
    clear_palette_memo()
    return records, sizes


def _merge(checked: CheckedInputs, records: list[FunctionRecord], parts: dict[str, Path], destination: Path) -> None:
    from .merge import library_versions, merge_functions, package_metadata

    manifest = checked.manifest
    base = checked.base
    metadata = package_metadata(
        hf_name=hf_name(checked),
        manifest_name=manifest.name,
        functions={r.name: r.as_metadata() for r in records},
        default_function=manifest.default,
        max_context=manifest.export.max_context,
        base={"source": manifest.base.path, "revision": manifest.base.revision, "sha256": base.content_hash},
        versions=library_versions(),
    )
    description = f"{manifest.name}: {len(records)} function(s) ({', '.join(parts)}), built by adapterpack"
    merge_functions(parts, default_function=manifest.default, destination=destination, metadata=metadata, description=description)


def folder_size(path: Path) -> int:
    """Bytes of all files under ``path`` (a package is a folder)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
