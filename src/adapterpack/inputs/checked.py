"""Everything known about a build's inputs before any heavy work: the validated manifest, the
base and every adapter checked (``check_inputs``), ``max_context: auto`` resolved, and the
device rules on the state sizes the export will have.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from adapterpack.config.compression import (
    VOCABULARY_PATTERNS,
    VOCABULARY_SHARE,
    exception_matches,
    matches_any,
    vocabulary_setting,
    vocabulary_share,
)
from adapterpack.config.device_rules import NEURAL_ENGINE_STATE_MULTIPLE, cache_length_findings
from adapterpack.config.devices import estimated_weight_bytes, find_device, largest_context_that_fits
from adapterpack.config.families import check_family
from adapterpack.config.manifest import Manifest, load_manifest, looks_like_hub_id
from adapterpack.errors import BadInput, warn_or_refuse
from adapterpack.inputs.adapter import AdapterInfo, inspect_adapter
from adapterpack.inputs.base import BaseInfo, check_weight_shapes, resolve_base
from adapterpack.inputs.calibration import CalibrationText, read_calibration
from adapterpack.inputs.text_tower import text_tower, tower_adapter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedInputs:
    """Everything known about the inputs before any heavy work."""

    manifest: Manifest
    base: BaseInfo
    adapters: dict[str, AdapterInfo]  # by function name
    # by function name; the base's under include_base (None when the base is not shipped)
    calibration: dict[str | None, CalibrationText] = field(default_factory=dict)
    # by function: what compression auto chose and measured (assemble.auto), once it has run
    auto_figures: dict[str, dict] = field(default_factory=dict)

    def input_paths(self) -> tuple[Path, ...]:
        """Everything a build reads, as the user named it: the manifest, the base folder, each
        adapter's folder (an mlx-lm adapter's own, not its peft form) and the calibration
        texts. No output may be written over, into or around any of them
        (``config.paths.refuse_overlap``)."""
        found = [self.base.tower_of or self.base.folder, *(info.origin for info in self.adapters.values())]
        found += [text.path for text in self.calibration.values()]
        if self.manifest.source is not None:
            found.append(Path(self.manifest.source))
        return tuple(found)

    def with_format(self, package_format: str, contract: str | None = None) -> CheckedInputs:
        """The same inputs, the manifest writing ``package_format`` (mlpackage | aimodel) under
        ``contract`` (None: the manifest's)."""
        return replace(self, manifest=self.manifest.with_format(package_format, contract))


def check_inputs(
    manifest: Manifest | str | Path | CheckedInputs, *, allow_pickle: bool = False, strict: bool = False
) -> CheckedInputs:
    """Validate the manifest, the base and every adapter without importing torch or coremltools.

    ``strict`` turns warnings (an adapter trained on a differently named base) into errors.
    """

    if isinstance(manifest, CheckedInputs):
        return manifest
    if not isinstance(manifest, Manifest):
        manifest = load_manifest(manifest)
    base = text_tower(resolve_base(manifest.base.path, manifest.base.revision, manifest.folder))
    check_family(base.config, (base.tower_of or base.folder) / "config.json")
    check_weight_shapes(base)
    manifest = _vocabulary_default(manifest, base)
    check_layer_exceptions(manifest, base)
    adapters = {}
    for adapter in manifest.adapters:
        # The hub id the tokenizer is named by is also a name of the base.
        aliases = tuple(filter(None, [manifest.base.tokenizer, base.config.get("_name_or_path")]))
        info = read_adapter(manifest.adapter_path(adapter), adapter.format, base, allow_pickle=allow_pickle, base_names=aliases)
        mode = manifest.lora_mode(adapter.name)
        if mode == "keep" and info.uses_dora:
            raise BadInput(
                f"{info.origin}: DoRA adapters cannot be kept unfused (their magnitude vector rescales "
                "the whole weight, so the base cannot be shared): use lora: fuse for this adapter"
            )
        if mode == "keep" and info.modules_to_save:
            raise BadInput(
                f"{info.origin}: modules_to_save ({', '.join(info.modules_to_save)}) replaces whole base "
                "modules, which cannot be shared: use lora: fuse for this adapter"
            )
        for warning in info.warnings:
            warn_or_refuse(warning, strict=strict, log=log)
        adapters[adapter.name] = info
    if manifest.export.max_context == "auto":
        manifest = _resolve_auto_context(manifest, base, adapters)
    calibration = {function: read_calibration(path) for function, path in manifest.calibration_paths().items()}
    return CheckedInputs(manifest=manifest, base=base, adapters=adapters, calibration=calibration)


def _vocabulary_default(manifest: Manifest, base: BaseInfo) -> Manifest:
    """A base whose vocabulary holds most of its weights gets it compressed at 8 bits by default
    rather than kept float16 (``config.compression.VOCABULARY_SHARE``), in every function whose
    compression block (the manifest's, or an adapter's own) does not say what to keep float16."""
    shapes = {name: tuple(info.shape) for name, info in base.tensors.items()}
    if vocabulary_share(shapes) <= VOCABULARY_SHARE:
        return manifest
    present = [p for p in VOCABULARY_PATTERNS if any(matches_any(name.replace(".", "_"), (p,)) for name in shapes)]

    def widened(compression, keeps_its_own: bool):
        setting = vocabulary_setting(compression)
        if keeps_its_own or setting is None:
            return compression
        # after the manifest's own exceptions: a pattern it wrote for these weights decides them
        exceptions = tuple(
            (pattern, compression.model_validate({**setting, "method": compression.method, "keep_float16": ()}))
            for pattern in present
        )
        kept = tuple(p for p in compression.keep_float16 if p not in VOCABULARY_PATTERNS)
        return compression.model_copy(update={"keep_float16": kept, "layers": compression.layers + exceptions})

    block_keeps = "keep_float16" in manifest.compression.model_fields_set
    adapters = []
    for adapter in manifest.adapters:
        if adapter.compression is not None:
            # its own block, merged over the manifest's, widened and put in its place whole
            own = widened(manifest.compression_for(adapter.name), block_keeps or "keep_float16" in adapter.compression)
            adapter = adapter.model_copy(update={"compression": own.model_dump(mode="json")})
        adapters.append(adapter)
    log.debug("the vocabulary holds most of the base's weights: %s at 8 bits by default", ", ".join(present))
    return manifest.model_copy(
        update={"compression": widened(manifest.compression, block_keeps), "adapters": tuple(adapters)}
    )


def check_layer_exceptions(manifest: Manifest, base: BaseInfo) -> dict[str, dict[str, list[str]]]:
    """{function: {pattern: the weights it decides}} of the per-layer compression exceptions
    (``compression.layers``); BadInput naming the first that decides no weight of the base: a
    misspelt name, a weight kept float16 anyway, or one an earlier pattern already takes. Such an
    exception would change nothing, yet be reported."""
    weights = {name: tuple(info.shape) for name, info in base.tensors.items()}
    found: dict[str, dict[str, list[str]]] = {}
    for function in manifest.function_names:
        compression = manifest.compression_for(function)
        if not compression.layers:
            continue
        found[function] = exception_matches(weights, compression)
        for pattern, decided in found[function].items():
            if not decided:
                raise BadInput(
                    f"{_where(manifest, pattern)}: compression.layers: '{pattern}' (function '{function}') decides no "
                    "weight of the base: it matches none that is compressed, or an earlier pattern takes them "
                    "(patterns match weight names as keep_float16's, e.g. model.layers.0.mlp.down_proj)"
                )
    return found


def _where(manifest: Manifest, text: str) -> str:
    """``file:line`` of the manifest's first line mentioning ``text`` (the file alone if none)."""
    if manifest.source is None:
        return "manifest"
    try:
        lines = Path(manifest.source).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return str(manifest.source)
    number = next((i for i, line in enumerate(lines, 1) if text in line), None)
    return f"{manifest.source}:{number}" if number else str(manifest.source)


def read_adapter(folder: Path, format: str | None, base, *, allow_pickle: bool, base_names: tuple[str, ...]):
    """A peft adapter as it is; an mlx-lm one (stated, or detected by its files) checked and
    read as the peft adapter that computes the same (``inputs.mlx_adapter``)."""
    import dataclasses

    from adapterpack.inputs.mlx_adapter import looks_like_mlx, read_mlx_adapter

    folder = Path(folder)
    if format == "mlx" or (format is None and folder.is_dir() and looks_like_mlx(folder)):
        mlx = read_mlx_adapter(folder, base, base_names=(*base_names, str(base.tower_of or base.folder)))
        info = inspect_adapter(mlx.peft_folder, base)
        return dataclasses.replace(
            info, content_hash=mlx.content_hash, warnings=mlx.warnings, format="mlx", source=folder
        )
    renamed = tower_adapter(folder, base)
    if renamed is not None:  # trained on the multimodal model: read as the text tower names it
        peft_folder, content_hash, warnings = renamed
        info = inspect_adapter(peft_folder, base, base_names=base_names)
        return dataclasses.replace(info, content_hash=content_hash, warnings=(*warnings, *info.warnings), source=folder)
    return inspect_adapter(folder, base, allow_pickle=allow_pickle, base_names=base_names)


def check_state_sizes(checked: CheckedInputs, *, strict: bool) -> None:
    """Device rules on the state sizes the export will have (device_rules), before any heavy work:
    a warning, or BadInput with ``strict``."""

    manifest = checked.manifest
    head_dim = _head_dim(_text_config(checked.base))
    for finding in cache_length_findings(int(manifest.export.max_context), head_dim, str(manifest.source)):
        warn_or_refuse(finding.line(), strict=strict, log=log)


def _text_config(base: BaseInfo) -> dict:
    """The decoder's config (multimodal configs nest it under ``text_config``)."""
    return base.config.get("text_config") or base.config


def _head_dim(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _resolve_auto_context(manifest: Manifest, base, adapters: dict) -> Manifest:
    """``max_context: auto``: the largest context whose weights + KV-cache + activations fit the device."""
    config = _text_config(base)
    heads = config["num_attention_heads"]
    head_dim = _head_dim(config)
    largest = 0
    for name in manifest.function_names:
        info = adapters.get(name)
        lora = info.tensors if info is not None and manifest.lora_mode(name) == "keep" else {}
        weights = estimated_weight_bytes(base.tensors, manifest.compression_for(name), lora, manifest.lora_compression)
        largest = max(largest, weights)
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


def hf_name(checked: CheckedInputs) -> str:
    """The name the Swift client uses to look up the tokenizer (``co.huggingface.exporters.name``)."""

    if checked.manifest.base.tokenizer:
        return checked.manifest.base.tokenizer
    source = checked.manifest.base.path
    if looks_like_hub_id(source) and not (checked.manifest.folder / source).exists():
        return source
    configured = str(checked.base.config.get("_name_or_path") or "")
    if looks_like_hub_id(configured):
        return configured
    return (checked.base.tower_of or checked.base.folder).name
