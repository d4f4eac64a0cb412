"""LoRA adapters, checked from their config and safetensors headers against the base (shapes,
ranks, targets, trained-on base name) before any heavy work; nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapterpack.files import bad_file, sha256_files, short
from adapterpack.inputs.base import BaseInfo, os_errors_as_bad_input
from adapterpack.inputs.safetensors import (
    TensorInfo,
    _is_uint,
    _load_json_object,
    _Roles,
    check_finite,
    read_safetensors_header,
)

_PEFT_PREFIX = "base_model.model."


SUPPORTED_PEFT_TYPES = ("LORA",)


_PICKLE_HINT = "pickle weights can run code; convert to safetensors or pass --allow-pickle"


@dataclass(frozen=True)
class AdapterInfo:
    """A validated peft LoRA adapter that applies to a given base."""

    folder: Path
    config: dict  # parsed adapter_config.json
    tensors: dict[str, TensorInfo]
    weight_file: Path
    content_hash: str  # sha256 over adapter_config.json + weights
    target_modules: tuple[str, ...]  # base module names the LoRA weights change
    uses_dora: bool
    modules_to_save: tuple[str, ...]  # base module names whose weights the adapter replaces
    warnings: tuple[str, ...]
    format: str = "peft"  # peft | mlx (then ``folder`` is its peft form, ``source`` what mlx-lm wrote)
    source: Path | None = None

    @property
    def origin(self) -> Path:
        """The folder the manifest names."""
        return self.source or self.folder


def _pattern_key(patterns: Iterable[str], module: str, config_file: Path, field: str) -> str | None:
    """First pattern matching ``module`` with peft's semantics (``get_pattern_key``), or None.

    peft matches ``(.*\\.)?(pattern)$`` against the full module name: a dotted suffix or a regex
    over a suffix. Dict order decides between several matches, as in peft.
    """
    for pattern in patterns:
        try:
            if re.match(rf"(.*\.)?({pattern})$", module):
                return pattern
        except re.error as exc:
            raise bad_file(
                config_file, f"{field} key {pattern!r} is not a valid regular expression ({exc})"
            ) from None
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _adapter_config(folder: Path) -> tuple[Path, dict]:
    """Load adapter_config.json and check the fields the shape checks rely on."""
    config_file = folder / "adapter_config.json"
    if not config_file.exists():
        raise bad_file(
            config_file,
            "missing: a peft adapter folder needs adapter_config.json next to its weights",
        )
    config = _load_json_object(config_file)
    peft_type = config.get("peft_type")
    if peft_type not in SUPPORTED_PEFT_TYPES:
        raise bad_file(
            config_file,
            f"peft_type {peft_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_PEFT_TYPES)} (LoRA, including DoRA via use_dora)",
        )
    r = config.get("r", 8)  # peft's default when the field is absent
    if not _is_uint(r) or r == 0:
        raise bad_file(config_file, f"'r' must be a positive integer, found {r!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        _is_uint(v) and v > 0 for v in rank_pattern.values()
    ):
        raise bad_file(config_file, "'rank_pattern' must map module patterns to positive integer ranks")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha) or alpha <= 0:
        raise bad_file(config_file, f"'lora_alpha' must be a positive number, found {alpha!r}")
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not all(_is_number(v) and v > 0 for v in alpha_pattern.values()):
        raise bad_file(config_file, "'alpha_pattern' must map module patterns to positive numbers")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
        isinstance(targets, list) and all(isinstance(t, str) for t in targets)
    ):
        raise bad_file(config_file, f"'target_modules' must be a module name, a list of module names or null, found {targets!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not _is_uint(layers) and not (isinstance(layers, list) and all(_is_uint(n) for n in layers)):
        raise bad_file(config_file, f"'layers_to_transform' must be a layer index, a list of layer indices or null, found {layers!r}")
    for field in ("layers_pattern", "exclude_modules"):
        value = config.get(field)
        if value is not None and not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise bad_file(config_file, f"'{field}' must be a string, a list of strings or null, found {value!r}")
    for flag in ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out"):
        if not isinstance(config.get(flag, False), bool):
            raise bad_file(config_file, f"'{flag}' must be true or false, found {config[flag]!r}")
    modules_to_save = config.get("modules_to_save") or []
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    if not isinstance(modules_to_save, list) or not all(
        isinstance(m, str) for m in modules_to_save
    ):
        raise bad_file(config_file, "'modules_to_save' must be a list of module names or null")
    return config_file, config


def _load_pickle_adapter(file: Path) -> dict[str, TensorInfo]:
    """Read names/shapes of an ``adapter_model.bin`` (opt-in) and check it for NaN/Inf."""
    # Lazy: torch must not be imported by the pre-flight checks unless pickle is allowed.
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary globals; also corrupt archives
        raise bad_file(
            file, f"cannot load pickle weights safely ({type(exc).__name__}: {short(exc)})"
        ) from None
    if not isinstance(state, dict):
        raise bad_file(file, f"expected a state dict of tensors, found {type(state).__name__}")
    names = {
        torch.float64: "F64",
        torch.float32: "F32",
        torch.float16: "F16",
        torch.bfloat16: "BF16",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    tensors: dict[str, TensorInfo] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise bad_file(file, f"entry {name!r} is not a named tensor")
        if value.dtype not in names:
            raise bad_file(file, f"tensor {name!r} has unsupported dtype {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise bad_file(
                file,
                f"tensor {name!r} has NaN/Inf values: the weights are corrupt or training diverged",
            )
        tensors[name] = TensorInfo(names[value.dtype], tuple(value.shape), file)
    return tensors


def _natural_key(name: str) -> list[Any]:
    # "layers.10" after "layers.2": easier-to-read reports and stable ordering.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _same_base(a: str, b: str) -> bool:
    """Loose identity of two base references: same string or same last path component."""
    a, b = a.strip().rstrip("/\\"), b.strip().rstrip("/\\")
    return a == b or Path(a).name == Path(b).name


# peft state-dict suffixes (adapter name already removed) -> role of the tensor.
_LORA_SUFFIXES = (
    (".lora_A.weight", "A"),
    (".lora_B.weight", "B"),
    (".lora_B.bias", "B_bias"),  # lora_bias=True
    (".lora_embedding_A", "EA"),
    (".lora_embedding_B", "EB"),
    (".lora_magnitude_vector", "M"),  # DoRA
)


class _KeyChecker:
    """Checks peft state-dict keys against a base; collects problems instead of stopping at one."""

    def __init__(self, base: BaseInfo, config: dict, config_file: Path) -> None:
        self.base = base
        self.config = config
        self.config_file = config_file
        self.problems: list[tuple[str, str]] = []
        self.lora: dict[str, _Roles] = {}
        self.saved: set[str] = set()
        self.fan_in_fan_out = bool(config.get("fan_in_fan_out"))
        self.modules_to_save = config.get("modules_to_save") or []
        if isinstance(self.modules_to_save, str):
            self.modules_to_save = [self.modules_to_save]
        text_config = config_base = base.config
        if isinstance(config_base.get("text_config"), dict):
            text_config = config_base["text_config"]
        self.vocab_size = config_base.get("vocab_size") or text_config.get("vocab_size")

    def base_tensor(self, name: str) -> TensorInfo | None:
        """A base tensor by name; a tied lm_head is not stored, so follow the tie."""
        info = self.base.tensors.get(name)
        if (
            info is None
            and name.endswith("lm_head.weight")
            and self.base.config.get("tie_word_embeddings")
        ):
            tied = [
                n for n in self.base.tensors if n.endswith(("embed_tokens.weight", "wte.weight"))
            ]
            if len(tied) == 1:
                info = self.base.tensors[tied[0]]
        return info

    def base_weight(self, module: str) -> TensorInfo | None:
        """The base ``<module>.weight``."""
        return self.base_tensor(f"{module}.weight")

    def add(self, key: str, info: TensorInfo) -> None:
        """Classify one adapter key; record it or a problem."""
        if not key.startswith(_PEFT_PREFIX):
            self.problems.append(
                (key, f"does not start with {_PEFT_PREFIX!r} (not a peft state dict)")
            )
            return
        name = key[len(_PEFT_PREFIX) :]
        for suffix, role in _LORA_SUFFIXES:
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                if self.base_weight(module) is None:
                    self.problems.append(
                        (key, f"module {module!r} has no weight in the base model")
                    )
                else:
                    self.lora.setdefault(module, {})[role] = (key, info)
                return
        self.add_full_tensor(key, name, info)

    def add_full_tensor(self, key: str, name: str, info: TensorInfo) -> None:
        """A whole tensor: modules_to_save, saved embedding layers, LoRA base_layer copies."""
        module, _, param = name.rpartition(".")
        base_name = name
        if module.endswith(".base_layer"):  # peft saves targeted embeddings' base layer this way
            module = module[: -len(".base_layer")]
            base_name = f"{module}.{param}"
        base_info = self.base_tensor(base_name)
        if base_info is None:
            self.problems.append((key, f"{base_name!r} does not exist in the base model"))
            return
        is_saved = any(module.endswith(m) for m in self.modules_to_save)
        is_embedding = len(base_info.shape) == 2 and base_info.shape[0] == self.vocab_size
        is_copy = base_name != name
        if not (is_saved or is_embedding or is_copy):
            self.problems.append(
                (
                    key,
                    f"replaces base tensor {base_name!r} but {module!r} is not in modules_to_save",
                )
            )
            return
        if info.shape != base_info.shape:
            hint = ": vocabulary resized during fine-tuning?" if is_embedding else ""
            self.problems.append(
                (key, f"shape {info.shape} differs from the base's {base_info.shape}{hint}")
            )
            return
        # A base_layer copy is the frozen base weight peft saves next to a LoRA'd embedding;
        # it replaces nothing, so only real replacements are reported.
        if not is_copy:
            self.saved.add(module)

    def expected_rank(self, module: str) -> int:
        """Rank peft would give ``module``: its rank_pattern entry, else ``r``."""
        rank_pattern = self.config.get("rank_pattern") or {}
        key = _pattern_key(rank_pattern, module, self.config_file, "rank_pattern")
        return rank_pattern[key] if key is not None else self.config.get("r", 8)

    def check_modules(self, uses_dora: bool) -> None:
        """Pairing, shape and rank checks per LoRA module."""
        for module, roles in self.lora.items():
            weight = self.base_weight(module)
            assert weight is not None  # add() only records modules present in the base
            first_key = next(iter(roles.values()))[0]
            if len(weight.shape) != 2:
                self.problems.append(
                    (
                        first_key,
                        f"base {module}.weight has shape {weight.shape}; LoRA needs a 2-D weight",
                    )
                )
                continue
            embedding = "EA" in roles or "EB" in roles
            if embedding:
                # nn.Embedding weight is (num_embeddings, dim); peft's A is (r, num), B is (dim, r).
                a_role, b_role = "EA", "EB"
                n_in, n_out = weight.shape
                if "A" in roles or "B" in roles:
                    self.problems.append(
                        (first_key, "mixes lora_A/B and lora_embedding_A/B on one module")
                    )
                    continue
            else:
                a_role, b_role = "A", "B"
                n_out, n_in = weight.shape[::-1] if self.fan_in_fan_out else weight.shape
            if a_role not in roles or b_role not in roles:
                have, lack = (a_role, b_role) if a_role in roles else (b_role, a_role)
                self.problems.append(
                    (
                        roles[have][0] if have in roles else first_key,
                        f"has no matching {_role_name(lack)} for module {module!r}",
                    )
                )
                continue
            a_key, a = roles[a_role]
            b_key, b = roles[b_role]
            r = self.expected_rank(module)
            if a.shape != (r, n_in):
                self.problems.append(
                    (
                        a_key,
                        f"shape {a.shape}, expected {(r, n_in)} "
                        f"(rank {r} from adapter_config.json, "
                        f"base {module}.weight {weight.shape})",
                    )
                )
            if b.shape != (n_out, r):
                self.problems.append(
                    (
                        b_key,
                        f"shape {b.shape}, expected {(n_out, r)} "
                        f"(rank {r} from adapter_config.json, "
                        f"base {module}.weight {weight.shape})",
                    )
                )
            for role, what in (("B_bias", "lora_B.bias"), ("M", "DoRA magnitude")):
                if role in roles and roles[role][1].shape != (n_out,):
                    self.problems.append(
                        (
                            roles[role][0],
                            f"{what} shape {roles[role][1].shape}, expected {(n_out,)}",
                        )
                    )
            if "M" in roles and not uses_dora:
                self.problems.append(
                    (
                        roles["M"][0],
                        "DoRA magnitude vector but adapter_config.json has use_dora false",
                    )
                )
            if uses_dora and "M" not in roles:
                self.problems.append(
                    (a_key, f"use_dora is true but module {module!r} has no lora_magnitude_vector")
                )
            if "B_bias" in roles and not self.config.get("lora_bias"):
                self.problems.append(
                    (roles["B_bias"][0], "lora_B.bias but adapter_config.json has lora_bias false")
                )


def _role_name(role: str) -> str:
    return {
        "A": "lora_A.weight",
        "B": "lora_B.weight",
        "EA": "lora_embedding_A",
        "EB": "lora_embedding_B",
    }[role]


def _plain_selection(config: dict):
    """``selects(module)`` for a plain ``target_modules`` list (peft's suffix rule, and
    ``layers_to_transform``), or None: regex strings, ``all-linear``, layer patterns and
    exclusions are left to peft rather than re-implemented here."""
    targets = config.get("target_modules")
    if not isinstance(targets, list) or config.get("exclude_modules") or config.get("layers_pattern"):
        return None
    layers = config.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]

    def selects(module: str) -> bool:
        if not any(module == t or module.endswith("." + t) for t in targets if isinstance(t, str)):
            return False
        if layers is None:
            return True
        match = re.search(r"\.layers\.(\d+)\.", module)
        return match is not None and int(match.group(1)) in layers

    return selects


def _untargeted_weights(config: dict, lora_modules: set[str]) -> list[str]:
    """Modules holding LoRA weights that the config does not select: peft would load them and
    drop them."""
    selects = _plain_selection(config)
    if selects is None:
        return []
    return [module for module in sorted(lora_modules, key=_natural_key) if not selects(module)]


def _untrained_targets(base: BaseInfo, config: dict, present: set[str]) -> list[str]:
    """Base modules the config's ``target_modules`` list selects but the weights do not cover."""
    selects = _plain_selection(config)
    if selects is None:
        return []
    modules = sorted(
        {
            name[: -len(".weight")]
            for name, info in base.tensors.items()
            if name.endswith(".weight") and len(info.shape) == 2
        },
        key=_natural_key,
    )
    return [module for module in modules if selects(module) and module not in present]


@os_errors_as_bad_input
def inspect_adapter(
    folder: Path, base: BaseInfo, *, allow_pickle: bool = False, base_names: tuple[str, ...] = ()
) -> AdapterInfo:
    """Validate a peft LoRA adapter folder and check that every tensor applies to ``base``.

    Every key must name a module of the base with matching shapes and the rank peft would
    assign (``rank_pattern`` entry or ``r``); lora_A and lora_B must come in pairs. A
    ``base_model_name_or_path`` that differs from the manifest's base becomes a warning.
    """
    folder = Path(folder)
    if not folder.exists():
        raise bad_file(folder, "adapter folder not found")
    if not folder.is_dir():
        raise bad_file(
            folder,
            "adapter is a file; expected a peft folder with adapter_config.json and "
            "adapter_model.safetensors",
        )
    config_file, config = _adapter_config(folder)

    st_file = folder / "adapter_model.safetensors"
    bin_file = folder / "adapter_model.bin"
    if st_file.exists():
        weight_file = st_file
        tensors = read_safetensors_header(st_file)
        check_finite(st_file, tensors)
    elif bin_file.exists():
        if not allow_pickle:
            raise bad_file(bin_file, f"refusing adapter_model.bin: {_PICKLE_HINT}")
        weight_file = bin_file
        tensors = _load_pickle_adapter(bin_file)
    else:
        raise bad_file(
            folder, "no adapter_model.safetensors (the weights file peft's save_pretrained writes)"
        )
    if not tensors:
        raise bad_file(weight_file, "holds no tensors")

    uses_dora = bool(config.get("use_dora"))
    checker = _KeyChecker(base, config, config_file)
    for key, info in tensors.items():
        checker.add(key, info)
    checker.check_modules(uses_dora)
    if checker.problems:
        key, reason = checker.problems[0]
        bad_keys = len({k for k, _ in checker.problems})
        raise bad_file(
            weight_file,
            f"{bad_keys} of {len(tensors)} adapter tensor(s) do not apply to base "
            f"'{base.source}'; first: {key}: {reason}",
        )

    missing = _untrained_targets(base, config, set(checker.lora) | set(checker.saved))
    if missing:
        raise bad_file(
            weight_file,
            f"missing LoRA weights for {len(missing)} module(s) that adapter_config.json targets, "
            f"first: {missing[0]} (the weights file does not match its config)",
        )

    ignored = _untargeted_weights(config, set(checker.lora))
    if ignored:
        raise bad_file(
            weight_file,
            f"LoRA weights for {len(ignored)} module(s) that adapter_config.json does not target (peft would "
            f"silently ignore them), first: {ignored[0]}; add them to target_modules or remove their tensors",
        )

    warnings: list[str] = []
    named = config.get("base_model_name_or_path")
    known = (base.source, *base_names)
    if isinstance(named, str) and named and not any(_same_base(named, name) for name in known):
        warnings.append(
            f"{config_file}: base_model_name_or_path is '{named}' but the manifest's base is "
            f"'{base.source}'; the shapes match, check it is the intended base"
        )
    named_rev = config.get("revision")
    if isinstance(named_rev, str) and named_rev and base.revision and named_rev != base.revision:
        warnings.append(
            f"{config_file}: adapter was trained on revision '{named_rev}' but the manifest's base "
            f"revision is '{base.revision}'"
        )

    return AdapterInfo(
        folder=folder,
        config=config,
        tensors=tensors,
        weight_file=weight_file,
        content_hash=sha256_files((config_file, weight_file)),
        target_modules=tuple(sorted(checker.lora, key=_natural_key)),
        uses_dora=uses_dora,
        modules_to_save=tuple(sorted(checker.saved, key=_natural_key)),
        warnings=tuple(warnings),
    )
