"""The text tower of a multimodal checkpoint, as the text-only base it holds.

Gemma 3 4B, 12B and 27B are ``model_type: gemma3`` (transformers' ``Gemma3ForConditionalGeneration``):
a SigLIP vision encoder and its projector beside a language model that is exactly
``Gemma3ForCausalLM`` under ``text_config``. An app sends text, so adapterpack packages the
language model alone: the checkpoint is written once (per content) as the ``gemma3_text`` base
folder it holds (its language model's tensors, renamed as that model names them, bytes copied
as stored; its ``text_config`` with transformers' defaults filled in; its tokenizer files), and
everything after reads that folder. An adapter trained on the multimodal model is read the same
way: its LoRA tensors renamed, those on the vision tower left out with a warning.

Names, from transformers' ``conversion_mapping.py`` (``llava``, ``LlavaModel``): transformers 5
saves ``model.language_model.*``, ``model.vision_tower.*``, ``model.multi_modal_projector.*``
and ``lm_head.*``; the hub's checkpoints (and mlx-lm's ``gemma3`` model) use
``language_model.model.*`` and ``language_model.lm_head.*`` with ``vision_tower.*`` and
``multi_modal_projector.*`` at the top.

Only a multimodal base imports transformers here (its config class fills the defaults the
checkpoint's sparse ``text_config`` leaves out, as transformers itself reads it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from pathlib import Path

from adapterpack.config.families import check_family
from adapterpack.errors import BadInput
from adapterpack.files import bad_file, sha256_files, written_once
from adapterpack.inputs.base import TOKENIZER_JSON_FILES, BaseInfo, check_weight_shapes, os_errors_as_bad_input
from adapterpack.inputs.safetensors import _load_json_object, read_safetensors_header, write_renamed

log = logging.getLogger(__name__)

# multimodal model_type -> the family of the text tower it holds
TOWERS = {"gemma3": "gemma3_text"}
# Bumped when what is written for a tower changes, so an older copy is never read again.
TOWER_VERSION = 1

# stored prefix -> the text-only model's; checked in order (the longest first)
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
_OTHER_TOWERS = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
# Files the text tower's folder takes along: the tokenizer and what generation and chat read.
_CARRIED_FILES = (*TOKENIZER_JSON_FILES, "tokenizer.model", "added_tokens.json", "generation_config.json",
                  "chat_template.jinja", "chat_template.json")


def is_multimodal(config: dict) -> bool:
    model_type = config.get("model_type")
    return isinstance(model_type, str) and model_type in TOWERS


def text_name(name: str) -> str | None:
    """``name`` as the text-only model names it; None for a tensor of another tower (vision
    encoder, projector); unchanged when it has none of the known prefixes (the completeness
    check then names it)."""
    for stored, text in _TEXT_PREFIXES:
        if name.startswith(stored):
            return text + name[len(stored):]
    if name.startswith(_OTHER_TOWERS):
        return None
    return name


def cache_root() -> Path:
    """Where adapterpack keeps inputs it derives once per content: ``ADAPTERPACK_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/adapterpack``, else ``~/.cache/adapterpack``."""
    chosen = os.environ.get("ADAPTERPACK_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home).expanduser() / "adapterpack"


def _text_config(config: dict, config_file: Path) -> dict:
    """The text tower's config as transformers reads it (defaults filled), as a
    ``Gemma3ForCausalLM`` config.json."""
    text = config.get("text_config")
    family = TOWERS[config["model_type"]]
    if not isinstance(text, dict):
        raise bad_file(config_file, f"a {config['model_type']} config must hold a 'text_config' object (its language model)")
    if text.get("model_type", family) != family:
        raise bad_file(config_file, f"text_config.model_type is {text.get('model_type')!r}; a {config['model_type']} model's is {family!r}")
    from adapterpack.quiet import captured_output, silence_libraries

    silence_libraries()
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        with captured_output():
            full = AutoConfig.for_model(**config)
        filled = full.text_config.to_dict()
    # StrictDataclassError: a field of the wrong type (transformers validates its config classes)
    except (TypeError, ValueError, KeyError, AttributeError, StrictDataclassError) as error:
        raise bad_file(config_file, f"transformers cannot read this config: {str(error).strip().splitlines()[0][:200]}") from None
    filled.pop("transformers_version", None)
    filled.update(
        model_type=family,
        architectures=["Gemma3ForCausalLM"],
        # The multimodal model ties its head by its own (top-level) setting.
        tie_word_embeddings=bool(full.tie_word_embeddings),
        _name_or_path=config.get("_name_or_path") or "",
    )
    if "dtype" in config or "torch_dtype" in config:
        filled["dtype"] = config.get("dtype") or config.get("torch_dtype")
    return filled


@os_errors_as_bad_input  # an unwritable cache folder is named, not a traceback
def text_tower(base: BaseInfo) -> BaseInfo:
    """``base`` when it is a text-only model; for a multimodal one, the text-only base its
    language model is (written under ``cache_root()`` the first time, read back after)."""
    if not is_multimodal(base.config):
        return base
    config_file = base.folder / "config.json"
    folder = cache_root() / "text-towers" / f"{base.content_hash[:32]}-v{TOWER_VERSION}"
    if not (folder / "model.safetensors").is_file():
        config = _text_config(base.config, config_file)
        # What the export refuses is refused before gigabytes are copied, naming the checkpoint's files.
        check_family(config, config_file)
        named = {text: info for name, info in base.tensors.items() if (text := text_name(name)) is not None}
        check_weight_shapes(dataclasses.replace(base, config=config, tensors=named))
        _write_tower(base, config, folder)
    weights = folder / "model.safetensors"
    return dataclasses.replace(
        base,
        folder=folder,
        config=_load_json_object(folder / "config.json"),
        tensors=read_safetensors_header(weights),
        weight_files=(weights,),
        from_hub=False,
        tower_of=base.folder,
    )


def _write_tower(base: BaseInfo, config: dict, folder: Path) -> None:
    """The tower's folder: its language model's tensors renamed, its config, its tokenizer."""
    chosen, others = [], []
    for name, info in sorted(base.tensors.items()):
        text = text_name(name)
        (others if text is None else chosen).append((text, info.file, name))
    needed = sum(file.stat().st_size for file in base.weight_files)
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    if free < needed:
        raise BadInput(
            f"{folder.parent}: the text tower of {base.folder} needs up to {needed / 2**30:.1f} GiB here, "
            f"{free / 2**30:.1f} GiB are free: set ADAPTERPACK_CACHE_DIR to a folder on a larger disk"
        )
    log.info("%s: writing its text tower once (%d tensors; %d of the vision tower left out) to %s",
             base.folder, len(chosen), len(others), folder)
    carried = {name: base.shipped_file(name) for name in _CARRIED_FILES}

    def fill(incoming: Path) -> None:
        write_renamed(chosen, incoming / "model.safetensors")
        (incoming / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for name, data in carried.items():
            if data is not None:
                (incoming / name).write_bytes(data)

    written_once(folder, fill)


# peft's key prefix and the leaves a LoRA tensor name ends with
_PEFT_PREFIX = "base_model.model."
_LORA_LEAF = re.compile(r"\.(lora_[A-Za-z_]+|modules_to_save)(\..*)?$")


@os_errors_as_bad_input
def tower_adapter(folder: Path, base: BaseInfo) -> tuple[Path, str, tuple[str, ...]] | None:
    """For a peft adapter trained on the multimodal model ``base`` was read from: (the peft
    folder that names its tensors as the text tower does, the content hash of the adapter as
    given, warnings); None when there is nothing to rename (a text-only base, or an adapter
    already named for the text tower)."""
    weights = Path(folder) / "adapter_model.safetensors"
    if base.tower_of is None or not weights.is_file():
        return None
    tensors = read_safetensors_header(weights)
    renamed, left_out = {}, []
    for key in tensors:
        inner = key.removeprefix(_PEFT_PREFIX)
        text = text_name(inner)
        if text is None:
            left_out.append(key)
        elif text != inner:
            renamed[key] = _PEFT_PREFIX + text
    if not renamed and not left_out:
        return None
    config_file = Path(folder) / "adapter_config.json"
    config = _load_json_object(config_file)
    kept = sorted((renamed.get(key, key), key) for key in tensors if key not in left_out)
    if not kept:
        raise bad_file(weights, f"all {len(tensors)} LoRA tensors adapt the vision tower, which a package does not hold")
    content_hash = sha256_files((config_file, weights))
    target = cache_root() / "tower-adapters" / f"{content_hash[:32]}-v{TOWER_VERSION}"
    if not (target / "adapter_model.safetensors").is_file():
        renamed_config = _tower_adapter_config(config, kept)

        def fill(incoming: Path) -> None:
            write_renamed([(new, weights, old) for new, old in kept], incoming / "adapter_model.safetensors")
            (incoming / "adapter_config.json").write_text(json.dumps(renamed_config, indent=2, sort_keys=True))

        written_once(target, fill)
    warnings = ()
    if left_out:
        warnings = (f"{weights}: {len(left_out)} LoRA tensor(s) adapt the vision tower (first: {left_out[0]}), "
                    "which a package does not hold: left out",)
    return target, content_hash, warnings


def _tower_adapter_config(config: dict, kept: list[tuple[str, str]]) -> dict:
    """peft's config for the renamed adapter: target_modules the modules it holds LoRA tensors
    for, by their text names (a regex written for the multimodal model's names would match
    nothing); rank and alpha patterns renamed the same way."""
    modules = sorted({_LORA_LEAF.sub("", new.removeprefix(_PEFT_PREFIX)) for new, _ in kept if ".lora_" in new})
    renamed = dict(config, target_modules=modules)
    for field in ("rank_pattern", "alpha_pattern"):
        if isinstance(config.get(field), dict):
            renamed[field] = {(text_name(key) or key): value for key, value in config[field].items()}
    return renamed

