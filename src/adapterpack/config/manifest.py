"""The manifest: a strict, frozen, typed description of one package, validated once at the edge.

Everything here is cheap (PyYAML + pydantic, no torch or coremltools), so a broken manifest is
refused in well under a second. Errors carry ``file:line: field: reason``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from adapterpack.config.compression import Compression
from adapterpack.config.devices import find_device
from adapterpack.config.names import check_function_name, check_package_name
from adapterpack.config.paths import resolved
from adapterpack.config.strict import Strict
from adapterpack.errors import BadInput
from adapterpack.formats import registry as format_registry

DEPLOYMENT_TARGETS = ("iOS18", "macOS15", "tvOS18", "watchOS11", "visionOS2", "iOS26", "macOS26")
MAX_CONTEXT_LIMIT = 131072


class Base(Strict):
    path: StrictStr = Field(description="Local Hugging Face folder (relative to the manifest) or a hub id")
    revision: StrictStr | None = Field(default=None, description="Hub revision (hub ids only)")
    tokenizer: StrictStr | None = Field(
        default=None,
        description="Hub id the Swift client loads the tokenizer from (written as co.huggingface.exporters.name); "
        "default: `path` when it is a hub id, else the base's _name_or_path or folder name",
    )

    calibration: StrictStr | None = Field(
        default=None,
        description="Text file (relative to the manifest) of what the base is used for: palettes are weighted by the "
        "activations it causes, and `compression.auto` measures the base function on it. Where the manifest names no "
        "calibration text, the base writes its own to weigh by",
    )

    @field_validator("path")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return _without_nul(value)

    @field_validator("calibration")
    @classmethod
    def _calibration(cls, value: str | None) -> str | None:
        return _without_nul(value)


def _without_nul(value: str | None) -> str | None:
    # no path holds a NUL byte, and pathlib raises a bare ValueError on one
    if value is not None and "\0" in value:
        raise ValueError("a path cannot hold a NUL byte")
    return value


class Adapter(Strict):
    name: StrictStr = Field(description="Function name in the package ([A-Za-z_][A-Za-z0-9_]*)")
    path: StrictStr = Field(
        description="Adapter folder: peft's (adapter_config.json + adapter_model.safetensors) or mlx-lm's (adapters.safetensors)"
    )
    format: Literal["peft", "mlx"] | None = Field(
        default=None, description="peft or mlx (mlx_lm.lora's folder); detected from the files when left out"
    )
    scale: StrictFloat | StrictInt = Field(
        default=1.0, allow_inf_nan=False, description="Multiplier on the adapter's LoRA scaling (finite)"
    )
    lora: Literal["fuse", "keep"] | None = Field(default=None, description="Override of the manifest-wide `lora`")
    compression: dict[str, Any] | None = Field(
        default=None, description="Per-function override of the manifest's `compression` block"
    )
    calibration: StrictStr | None = Field(
        default=None,
        description="Text file (relative to the manifest) of this skill's own text: palettes are weighted by the "
        "activations it causes, and `compression.auto` measures this function on it",
    )

    @field_validator("name")
    @classmethod
    def _swift_name(cls, value: str) -> str:
        return check_function_name(value)

    @field_validator("path", "calibration")
    @classmethod
    def _paths(cls, value: str | None) -> str | None:
        return _without_nul(value)

    @field_validator("compression", mode="before")
    @classmethod
    def _auto_word(cls, value: Any) -> Any:
        return _auto_shorthand(value)


# The formats the manifest accepts are the registry's (formats.registry): a new format is added there.
PACKAGE_FORMATS: tuple[str, ...] = format_registry.NAMES
PackageFormat = Literal[PACKAGE_FORMATS]  # type: ignore[valid-type]


def format_of(path: str | Path) -> str | None:
    """The name of the package format a path's suffix names, or None."""
    found = format_registry.of_output(path)
    return found.name if found is not None else None


# How an app calls a function (export.contract): swift-transformers' LanguageModelWithStatefulKVCache
# (the default; a .mlpackage's only one), or Apple's Core AI Swift runtime (convert.export_decoder);
# every contract some format of the registry takes, the default first.
CONTRACTS = tuple(dict.fromkeys(contract for f in format_registry.FORMATS.values() for contract in f.contracts))


class Export(Strict):
    """How functions are exported: cache length, OS, package format."""

    # At least 2: swift-transformers sends a mask one slot wider than the tokens it holds.
    max_context: Annotated[StrictInt, Field(ge=2, le=MAX_CONTEXT_LIMIT)] | Literal["auto"] = Field(
        default=512,
        description="KV-cache length (a multiple of 32 for the Neural Engine), or `auto`: the largest that fits `target_device`",
    )
    target_device: StrictStr | None = Field(
        default=None, description="Device whose app memory limit `max_context: auto` fits (adapterpack inspect lists them)"
    )
    deployment_target: Literal[DEPLOYMENT_TARGETS] = "iOS18"  # type: ignore[valid-type]
    format: PackageFormat = Field(
        default=PACKAGE_FORMATS[0],
        description=f"{format_registry.described()} (the first is the default)",
    )
    compute_precision: Literal["float16", "float32"] = Field(
        default="float16",
        description="Activations and matrix products (aimodel only: float32 keeps weights and states as stored, computes in float32)",
    )
    contract: Literal[CONTRACTS] = Field(  # type: ignore[valid-type]
        default="swift-transformers",
        description=(
            "How an app calls each function: swift-transformers (inputIds + causalMask, fixed caches; "
            "LanguageModelWithStatefulKVCache, and the same calls on Core AI) or apple (aimodel only: "
            "input_ids + position_ids, caches the runtime grows; Apple's CoreAILanguageModel)"
        ),
    )

    @model_validator(mode="after")
    def _auto_needs_device(self) -> Export:
        self.check_for_format()
        if self.max_context == "auto" and not self.target_device:
            raise ValueError("max_context: auto needs target_device (e.g. iphone-15)")
        if self.target_device:

            try:
                find_device(self.target_device)
            except BadInput as error:
                raise ValueError(f"target_device: {error}") from None
        return self

    def check_for_format(self) -> None:
        """What the format allows (its registry entry): its contracts and compute precisions."""
        chosen = format_registry.named(self.format)
        for setting, value, allowed in (
            ("compute_precision", self.compute_precision, "compute_precisions"),
            ("contract", self.contract, "contracts"),
        ):
            if value not in getattr(chosen, allowed):
                takers = " or ".join(f.name for f in format_registry.FORMATS.values() if value in getattr(f, allowed))
                mine = " or ".join(getattr(chosen, allowed))
                raise ValueError(f"{setting} {value} applies to format {takers} (a {chosen.suffix} takes {setting} {mine})")


# Verify's two verdicts per function (verification.package):
# * exact: the package against its PyTorch reference holding the package's own weights, read back
#   from it (verification.own_weights), on random ids and on real text, under both calling conventions.
#   The conversion must be exact to float16 arithmetic whatever the compression.
EXACT_THRESHOLDS: dict[str, float] = {"cosine": 0.9999, "top1": 0.99}
# * quality: that reference against the float32 one (the base's own weights, the adapter unmerged)
#   on real text: the perplexity ratio, how often the two agree on the next token, and for an
#   adapter how much of its effect on the logits survived (retention). By compression, chosen
#   from measurements on a real checkpoint (SmolLM2-135M-Instruct and its two skills; docs/verification.md)
#   with a margin; compression.auto's targets replace them where given.
DEFAULT_QUALITY: dict[str, dict[str, float]] = {
    "none": {"perplexity_ratio": 1.01, "agreement": 0.97, "retention": 0.97},  # measured 1.000x, 100%, 1.000
    "palettize-low": {"perplexity_ratio": 2.0, "agreement": 0.5, "retention": 0.75},  # 1-4 bits: 0.92-1.55x, 57-90%, 0.88-0.99
    "palettize-high": {"perplexity_ratio": 1.15, "agreement": 0.7, "retention": 0.9},  # 6-8 bits: 0.99-1.07x, 80-99%, 0.99-1.00
    "linear-int4": {"perplexity_ratio": 2.0, "agreement": 0.45, "retention": 0.5},  # 1.20-1.33x, 52-66%, 0.58-0.69
    "linear-int8": {"perplexity_ratio": 1.05, "agreement": 0.85, "retention": 0.95},  # 0.99-1.01x, 94-98%, 0.999
    "prune": {"perplexity_ratio": 4.0, "agreement": 0.3, "retention": 0.3},
}


def threshold_profile(compression: Compression) -> str:
    """Which row of DEFAULT_QUALITY applies to a compression."""
    if compression.method == "palettize":
        return "palettize-low" if compression.nbits <= 4 else "palettize-high"
    if compression.method == "linear":
        return f"linear-int{compression.nbits}"
    return compression.method


class VerifySettings(Strict):
    """How ``verify`` exercises each function, and what it accepts (unset: the defaults above)."""

    prefill: StrictInt = Field(default=16, ge=1, description="Tokens in the first (prefill) call")
    decode_steps: StrictInt = Field(default=16, ge=0, description="Single-token calls after the prefill")
    seed: StrictInt = Field(default=0, description="Seed of the random token sequence")
    min_top1: StrictFloat | StrictInt | None = Field(
        default=None, ge=0, le=1, description="Exact verdict: top-1 agreement with the reference holding the package's weights"
    )
    min_cosine: StrictFloat | StrictInt | None = Field(
        default=None, ge=-1, le=1, description="Exact verdict: mean logit cosine with the reference holding the package's weights"
    )
    max_perplexity_ratio: StrictFloat | StrictInt | None = Field(
        default=None, ge=1, description="Quality verdict: largest perplexity on real text over the float32 reference's"
    )
    min_agreement: StrictFloat | StrictInt | None = Field(
        default=None, ge=0, le=1, description="Quality verdict: share of real-text positions where the next token agrees"
    )
    min_retention: StrictFloat | StrictInt | None = Field(
        default=None, ge=-1, le=1, description="Quality verdict: share of the adapter's effect on the logits that must survive"
    )

    def thresholds_for(self, compression: Compression) -> dict[str, float]:
        """Both verdicts' thresholds for a function of ``compression``: ``cosine`` and ``top1``
        (exact), ``perplexity_ratio``, ``agreement`` and ``retention`` (quality); set here, else
        ``compression.auto``'s targets, else the defaults."""
        values = dict(EXACT_THRESHOLDS) | dict(DEFAULT_QUALITY[threshold_profile(compression)])
        if compression.auto is not None:
            values["perplexity_ratio"] = float(compression.auto.max_perplexity_ratio)
            values["retention"] = float(compression.auto.min_retention)
        given = {
            "top1": self.min_top1, "cosine": self.min_cosine, "perplexity_ratio": self.max_perplexity_ratio,
            "agreement": self.min_agreement, "retention": self.min_retention,
        }
        values.update({key: float(value) for key, value in given.items() if value is not None})
        return values


class Manifest(Strict):
    """A validated manifest. Paths are absolute; per-function compression is resolved."""

    name: StrictStr = Field(
        description="Package name: the package's and the release's file names, and the package metadata "
        "(letters, digits, '.', '_', '-', starting with a letter or digit)"
    )
    base: Base
    adapters: tuple[Adapter, ...] = ()
    include_base: StrictStr | None = Field(
        default=None, description="Also ship the plain base as a function with this name"
    )
    default_function: StrictStr | None = Field(default=None, description="Function loaded when none is named")
    lora: Literal["fuse", "keep"] = "fuse"
    export: Export = Export()
    compression: Compression = Compression()
    lora_compression: Compression = Field(
        default_factory=lambda: Compression(method="none"),
        description="Compression of the LoRA A/B matrices in `lora: keep` functions (default: float16)",
    )
    verify: VerifySettings = VerifySettings()
    output: StrictStr | None = Field(
        default=None, description="Output .mlpackage or .aimodel (default build/<name>.<export.format>)"
    )

    # Set by load_manifest; not part of the YAML format.
    source: Annotated[Path | None, Field(exclude=True)] = None

    @field_validator("output")
    @classmethod
    def _output(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return _without_nul(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_package_name(value)

    @field_validator("include_base")
    @classmethod
    def _base_name(cls, value: str | None) -> str | None:
        return None if value is None else check_function_name(value)

    @field_validator("compression", mode="before")
    @classmethod
    def _auto_word(cls, value: Any) -> Any:
        return _auto_shorthand(value)

    @model_validator(mode="after")
    def _cross_references(self) -> Manifest:
        names = self.function_names
        if not names:
            raise ValueError("no functions: list at least one adapter or set include_base")
        seen: dict[str, str] = {}
        for name in names:
            if name.lower() in seen:
                raise ValueError(
                    f"function names '{seen[name.lower()]}' and '{name}' clash "
                    "(names must be unique ignoring case)"
                )
            seen[name.lower()] = name
        if self.default_function is not None and self.default_function not in names:
            raise ValueError(
                f"default_function '{self.default_function}' is not a function: choose one of {', '.join(names)}"
            )
        for adapter in self.adapters:
            if adapter.compression is not None:
                self.compression_for(adapter.name)  # raises ValueError with the reason
        for name in names:
            if self.compression_for(name).auto is None:
                continue
            adapter = self.adapter(name)
            if adapter is not None and self.lora_mode(name) == "keep" and self.lora_compression.method != "none":
                raise ValueError(
                    f"compression auto measures kept adapters with float16 LoRA matrices: '{name}' is lora: keep "
                    "with a lora_compression"
                )
            if (adapter.calibration if adapter is not None else self.base.calibration) is None:
                where = f"adapter '{name}' calibration" if adapter is not None else "base.calibration"
                raise ValueError(f"compression auto measures '{name}' on its own text: name a text file as {where}")
        named = format_of(self.output) if self.output else None
        if self.output is not None and named is None:
            raise ValueError(
                f"output '{self.output}': a package is a folder named *{' or *'.join(f.suffix for f in format_registry.FORMATS.values())} "
                "(a release's zip is written by `adapterpack release`)"
            )
        if named is not None and named != self.export.format:
            raise ValueError(f"output '{self.output}' is a .{named} but export.format is {self.export.format}")
        return self

    @property
    def function_names(self) -> list[str]:
        names = [a.name for a in self.adapters]
        if self.include_base:
            names.append(self.include_base)
        return names

    @property
    def default(self) -> str:
        return self.default_function or self.function_names[0]

    @property
    def folder(self) -> Path:
        return self.source.parent if self.source else Path.cwd()

    def adapter(self, name: str) -> Adapter | None:
        return next((a for a in self.adapters if a.name == name), None)

    def adapter_path(self, adapter: Adapter) -> Path:
        return resolved(adapter.path, "adapter path", self.folder)

    def calibration_paths(self) -> dict[str | None, Path]:
        """The calibration text files the manifest names, by function: the base's under
        ``include_base`` (None when the base is not shipped), each adapter's under its name."""
        found: dict[str | None, Path] = {}
        if self.base.calibration is not None:
            found[self.include_base] = resolved(self.base.calibration, "calibration path", self.folder)
        for adapter in self.adapters:
            if adapter.calibration is not None:
                found[adapter.name] = resolved(adapter.calibration, "calibration path", self.folder)
        return found

    def lora_mode(self, name: str) -> Literal["fuse", "keep"]:
        adapter = self.adapter(name)
        return (adapter.lora if adapter and adapter.lora else self.lora)

    def compression_for(self, name: str) -> Compression:
        """The compression of one function: the adapter's override merged over the manifest's
        (without calibration text, ``Compression.data_free``'s defaults)."""
        found = self._merged_compression(name)
        return found if self.calibration_paths() else found.data_free()

    def _merged_compression(self, name: str) -> Compression:
        adapter = self.adapter(name)
        if adapter is None or adapter.compression is None:
            return self.compression
        override = dict(adapter.compression)
        method = override.get("method", self.compression.method)
        if method == self.compression.method:
            merged = {k: v for k, v in self.compression.model_dump().items() if k in self.compression.model_fields_set}
            merged.update(override)
        else:  # a different method starts from that method's defaults
            merged = {"keep_float16": self.compression.keep_float16, **override}
        try:
            return Compression.model_validate(merged)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"adapter '{name}' compression{'.' + where if where else ''}: {first['msg']}") from None

    def output_path(self, override: str | Path | None = None) -> Path:
        """Where the build writes: ``override``, else the manifest's ``output``, else
        ``build/<name>.<export.format>`` (``with_format`` applies ``--format``)."""
        if override is not None:
            return resolved(override, "output")
        if self.output is not None:
            return resolved(self.output, "output", self.folder)
        return resolved(self.folder / "build" / f"{self.name}.{self.export.format}", "output")

    def with_format(self, package_format: str, contract: str | None = None) -> Manifest:
        """This manifest writing ``package_format`` (the command line's ``--format``) under
        ``contract`` (``--contract``; None: the manifest's)."""
        contract = contract or self.export.contract
        if package_format == self.export.format and contract == self.export.contract:
            return self
        output = self.output
        if output is not None and format_of(output):
            output = str(Path(output).with_suffix(format_registry.named(package_format).suffix))
        export = self.export.model_copy(update={"format": package_format, "contract": contract})
        return self.model_copy(update={"export": export, "output": output})


def _auto_shorthand(value: Any) -> Any:
    """``compression: auto`` is palettization with ``auto``'s default targets."""
    return {"auto": {}} if value == "auto" else value


# ---------------------------------------------------------------- YAML with line numbers


class StrictLoader(yaml.SafeLoader):
    """SafeLoader (YAML 1.1 rules kept on purpose: ``name: no`` reads as ``False``, and the schema's
    strict string fields then refuse it with a hint to quote, instead of accepting a surprise)."""


_YAML_11_WORDS = {"yes", "no", "on", "off", "y", "n", "true", "false"}


MAX_MANIFEST_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes the document expands to once aliases are followed (a YAML "billion laughs" is tiny
    on disk and astronomically large expanded)."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # a cycle counts once instead of recursing forever
    size = 1
    if isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(item, memo) for item in node.value)
    memo[key] = min(size, MAX_EXPANDED_NODES + 1)
    return memo[key]


def _walk(node: yaml.Node, path: tuple, lines: dict[tuple, int], file: Path, raw: dict[tuple, str]) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.ScalarNode):
        raw[path] = node.value
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise BadInput(f"{file}:{key_node.start_mark.line + 1}: mapping keys must be plain words")
            key = key_node.value
            if key in seen:
                raise BadInput(
                    f"{file}:{key_node.start_mark.line + 1}: duplicate key '{key}' "
                    f"(first at line {seen[key]})"
                )
            seen[key] = key_node.start_mark.line + 1
            lines[path + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, path + (key,), lines, file, raw)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, path + (index,), lines, file, raw)


def _line_for(loc: tuple, lines: dict[tuple, int]) -> int | None:
    for cut in range(len(loc), -1, -1):
        if loc[:cut] in lines:
            return lines[loc[:cut]]
    return None


def load_manifest(path: str | Path) -> Manifest:
    """Read, parse and validate a manifest file; raise BadInput with ``file:line: reason``."""
    file = Path(path)
    if not file.exists():
        raise BadInput(f"{file}: manifest not found")
    if not file.is_file():
        raise BadInput(f"{file}: manifest is not a file")
    try:
        if file.stat().st_size > MAX_MANIFEST_BYTES:
            raise BadInput(f"{file}: manifest is larger than {MAX_MANIFEST_BYTES // 1024} KiB")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise BadInput(f"{file}: cannot read manifest ({error})") from None
    try:
        root = yaml.compose(text, Loader=StrictLoader)
    except RecursionError:
        raise BadInput(f"{file}: YAML nesting is too deep") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise BadInput(f"{file}{line}: YAML syntax error: {problem}") from None
    if root is None or not isinstance(root, yaml.MappingNode):
        raise BadInput(f"{file}:1: the manifest must be a YAML mapping (name:, base:, adapters:, ...)")
    if _expanded_size(root, {}) > MAX_EXPANDED_NODES:
        raise BadInput(f"{file}: the manifest expands to more than {MAX_EXPANDED_NODES} YAML nodes (alias bomb?)")
    lines: dict[tuple, int] = {}
    raw: dict[tuple, str] = {}
    try:
        _walk(root, (), lines, file, raw)
    except RecursionError:
        raise BadInput(f"{file}: YAML nesting is too deep") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as error:  # e.g. unhashable keys, which compose accepts
        raise BadInput(f"{file}: YAML error: {str(error).splitlines()[0]}") from None
    except (TypeError, ValueError, RecursionError) as error:  # e.g. a mapping used as a key
        raise BadInput(f"{file}: YAML error: {error}") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as error:
        raise BadInput(_describe_validation_error(error, file, lines, raw)) from None
    except ValueError as error:
        raise BadInput(f"{file}: {error}") from None
    manifest = manifest.model_copy(update={"source": resolved(file, "manifest path")})
    _check_paths(manifest, file, lines)
    return manifest


def _describe_validation_error(error: ValidationError, file: Path, lines: dict[tuple, int], raw: dict[tuple, str]) -> str:
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    line = _line_for(loc, lines)
    where = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if first["type"] == "extra_forbidden":
        message = f"unknown key '{loc[-1]}'"
        where = where.rsplit(".", 1)[0] if "." in where else ""
    written = raw.get(loc)
    if first["type"] == "string_type" and written is not None:
        # YAML turned an unquoted word or number into another type: show what was written.
        reading = "a boolean" if written.lower() in _YAML_11_WORDS else "a number"
        message = f"YAML reads {written} as {reading}, not text: quote it (\"{written}\")"
    if len(error.errors()) > 1:
        message += f" (and {len(error.errors()) - 1} more)"
    prefix = f"{file}:{line}" if line else str(file)
    # one line whatever the YAML held: a quoted key or value may carry line breaks
    described = f"{where + ': ' if where else ''}{message}".replace("\r", "\\r").replace("\n", "\\n")
    return f"{prefix}: {described}"


def _check_paths(manifest: Manifest, file: Path, lines: dict[tuple, int]) -> None:
    """Adapter folders must exist, calibration texts be files; the base must be a folder or look
    like a hub id."""
    for index, adapter in enumerate(manifest.adapters):
        folder = manifest.adapter_path(adapter)
        line = lines.get(("adapters", index, "path"))
        where = f"{file}:{line}" if line else str(file)
        if not folder.exists():
            raise BadInput(f"{where}: adapters[{index}].path: {folder} does not exist")
        if not folder.is_dir():
            raise BadInput(f"{where}: adapters[{index}].path: {folder} is not a folder")
    paths = manifest.calibration_paths()
    for function, path in paths.items():
        index = next((i for i, a in enumerate(manifest.adapters) if a.name == function), None)
        key = ("base", "calibration") if index is None else ("adapters", index, "calibration")
        line = lines.get(key)
        where = f"{file}:{line}" if line else str(file)
        field = "base.calibration" if index is None else f"adapters[{index}].calibration"
        if not path.is_file():
            raise BadInput(f"{where}: {field}: {path} {'is not a file' if path.exists() else 'does not exist'}")
    base = manifest.base.path
    local = resolved(base, "base path", manifest.folder)
    line = lines.get(("base", "path"))
    where = f"{file}:{line}" if line else str(file)
    if local.exists() and not local.is_dir():
        raise BadInput(f"{where}: base.path: {local} is not a folder")
    if not local.exists() and not looks_like_hub_id(base):
        raise BadInput(f"{where}: base.path: {local} does not exist (and '{base}' is not a hub id)")


def looks_like_hub_id(value: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value)) and not value.startswith(".")


def manifest_json_schema() -> dict:
    """JSON Schema of the manifest format (``adapterpack schema``)."""
    schema = Manifest.model_json_schema()
    schema.get("properties", {}).pop("source", None)
    schema["title"] = "adapterpack manifest"
    return schema
