"""The base model: a local folder or a hub id resolved to a folder, its config and safetensors
headers read and checked before any heavy work; nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapterpack.config.families import ignored_weight, read_weights
from adapterpack.config.paths import resolved
from adapterpack.errors import BadInput
from adapterpack.files import bad_file, refuse_special_file, sha256_files, short
from adapterpack.inputs.safetensors import (
    _T,
    TensorInfo,
    _load_json_object,
    read_safetensors_header,
)

# A Hugging Face repo id: "name" or "owner/name".
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class BaseInfo:
    """A validated base model folder."""

    folder: Path  # local folder holding the files
    config: dict  # parsed config.json
    tensors: dict[str, TensorInfo]  # every weight name -> info, from safetensors headers only
    weight_files: tuple[Path, ...]
    content_hash: str  # sha256 over config.json + weight files
    source: str  # what the manifest said (path or hub id)
    revision: str | None
    from_hub: bool = False  # a hub snapshot: its files are links into the repository's blob store
    # The multimodal checkpoint this text-only base was read from (``inputs.text_tower``); its
    # ``folder`` is then the text tower's, written by adapterpack.
    tower_of: Path | None = None

    def shipped_file(self, name: str) -> bytes | None:
        """The bytes of file ``name`` of the base folder, for a release to ship (a tokenizer
        file), or None when there is none. Only a regular file from inside the base's own
        folder, at most ``MAX_SHIPPED_FILE_BYTES``: a link leading outside it (to
        ``/etc/passwd``, to another project) or a special file is refused, never copied."""
        return read_shipped_file(self.folder, name, self.folder.parent.parent if self.from_hub else self.folder)


# The largest file a release copies from an input folder (Gemma 3's tokenizer.json is 33 MB).
MAX_SHIPPED_FILE_BYTES = 256 << 20


def read_shipped_file(folder: Path, name: str, root: Path) -> bytes | None:
    """``folder / name``'s bytes when it is a regular file lying inside ``root`` once links are
    followed, of at most ``MAX_SHIPPED_FILE_BYTES``; None when there is no such entry; BadInput
    naming it otherwise."""
    path = folder / name
    if not (path.exists() or path.is_symlink()):
        return None
    target, root = resolved(path, "file"), resolved(root, "folder")
    if not (target == root or root in target.parents):
        raise bad_file(path, f"links outside its folder (to {target}): a release copies only files from inside its inputs")
    if not target.is_file():
        raise bad_file(path, "is not a regular file (a folder, FIFO, socket, device or dangling link): a release copies only regular files")
    size = target.stat().st_size
    if size > MAX_SHIPPED_FILE_BYTES:
        raise bad_file(path, f"is {size / 2**20:.0f} MiB: a release copies files of at most {MAX_SHIPPED_FILE_BYTES >> 20} MiB from its inputs")
    return target.read_bytes()


def _looks_local(source: str) -> bool:
    """True when ``source`` can only be a filesystem path, never a hub repo id."""
    return (
        source.startswith((".", "/", "~", "\\"))
        or "\\" in source
        or (len(source) > 1 and source[1] == ":")  # Windows drive
        or not _HUB_ID.match(source)
    )


def os_errors_as_bad_input(func: Callable[..., _T]) -> Callable[..., _T]:
    """Safety net: an unreadable path found while probing folders is bad input, not a crash."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return func(*args, **kwargs)
        except OSError as exc:
            where = exc.filename or (args[0] if args else "input")
            raise bad_file(where, f"cannot access: {exc.strerror or short(exc)}") from None

    return wrapper


@os_errors_as_bad_input
def resolve_base(source: str, revision: str | None, manifest_dir: Path) -> BaseInfo:
    """Locate the base model (folder relative to ``manifest_dir``, or hub id) and validate it.

    For a hub id the files are fetched with ``huggingface_hub.snapshot_download`` (json,
    safetensors and tokenizer files only). The folder must hold ``config.json`` and either
    ``model.safetensors`` or ``model.safetensors.index.json`` with its shards; pickle-only
    bases are refused. Weights are described from headers only; NaN/Inf is not scanned here.
    """
    if not isinstance(source, str) or not source.strip():
        raise BadInput(
            "base: the manifest gives no base model (expected a local folder or a hub id)"
        )
    path = resolved(source, "base path", Path(manifest_dir))
    if path.exists():
        if not path.is_dir():
            raise bad_file(
                path, "base is a file; expected a folder with config.json and model.safetensors"
            )
        return _inspect_base_folder(path, source, revision, from_hub=False)
    if _looks_local(source):
        raise bad_file(
            path,
            "base folder not found (the manifest's base path is resolved relative to the manifest)",
        )
    return _inspect_base_folder(_download(source, revision, path), source, revision, from_hub=True)


def _download(source: str, revision: str | None, local_path: Path) -> Path:
    """Fetch a hub snapshot; any failure is a BadInput suggesting a local folder."""
    try:
        # Lazy: huggingface_hub is only needed for hub ids and pulls in networking code.
        from huggingface_hub import snapshot_download

        where = snapshot_download(
            repo_id=source,
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*"],
        )
    except Exception as exc:  # network, auth, missing repo, offline mode, missing package
        raise BadInput(
            f"base '{source}': cannot download from the Hugging Face hub "
            f"({type(exc).__name__}: {short(exc)}): use a local folder "
            f"(there is none at {local_path})"
        ) from None
    folder = Path(where)
    if not folder.is_dir():
        raise BadInput(
            f"base '{source}': the hub download gave no folder ({where}): use a local folder"
        )
    return folder


TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json")


def _inspect_base_folder(
    folder: Path, source: str, revision: str | None, from_hub: bool
) -> BaseInfo:
    """Validate config.json and the safetensors weights of a local base folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise bad_file(
            config_file,
            "missing: the base folder must be a Hugging Face model folder with config.json",
        )
    config = _load_json_object(config_file)

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    refuse_special_file(single, "a safetensors file")
    refuse_special_file(index, "a JSON file")
    # Same preference as transformers: the single file wins over an index.
    if single.is_file():
        weight_files: tuple[Path, ...] = (single,)
        tensors = read_safetensors_header(single)
    elif index.is_file():
        weight_files, tensors = _read_sharded(folder, index)
    else:
        raise _no_weights_error(folder, from_hub)
    if not tensors:
        raise bad_file(weight_files[0], "holds no tensors")
    # The tokenizer files generate, eval and release read later, and an app ships: a truncated
    # or mistyped one is refused now rather than after the build.
    for name in TOKENIZER_JSON_FILES:
        if (folder / name).exists() or (folder / name).is_symlink():
            _load_json_object(folder / name)

    return BaseInfo(
        folder=folder,
        config=config,
        tensors=tensors,
        weight_files=weight_files,
        content_hash=sha256_files((config_file, *weight_files)),
        source=source,
        revision=revision,
        from_hub=from_hub,
    )


def _no_weights_error(folder: Path, from_hub: bool) -> BadInput:
    """Explain why no safetensors weights were found (pickle-only, other formats, nothing)."""
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickles:
        return bad_file(
            folder,
            f"base has only pickle weights ({', '.join(pickles[:3])}), which can run code "
            "when loaded; convert them to safetensors "
            "(load and save_pretrained(safe_serialization=True))",
        )
    others = [n for n in names if n.endswith(".safetensors")]
    found = f"; found {', '.join(others[:3])}" if others else ""
    # The hub download skips *.bin, so a pickle-only repo arrives without any weights.
    hub = " (hub repos with only pickle weights are refused)" if from_hub else ""
    return bad_file(folder, f"no model.safetensors or model.safetensors.index.json{found}{hub}")


def _read_sharded(folder: Path, index: Path) -> tuple[tuple[Path, ...], dict[str, TensorInfo]]:
    """Validate a sharded checkpoint: index weight_map against every shard's header."""
    data = _load_json_object(index)
    weight_map = data.get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise bad_file(
            index,
            "'weight_map' must be a non-empty object mapping tensor names to shard file names",
        )

    shard_names = sorted(set(weight_map.values()))
    files: list[Path] = []
    tensors: dict[str, TensorInfo] = {}
    for shard_name in shard_names:
        shard = folder / shard_name
        # Refuse "../" or absolute names: the index must not point outside the model folder.
        # Checked lexically, because hub snapshots are symlinks into a shared blob store.
        normal = Path(os.path.normpath(shard_name))
        if not shard_name or normal.is_absolute() or normal.parts[:1] == ("..",):
            raise bad_file(index, f"shard {shard_name!r} lies outside the model folder")
        if not shard.is_file():
            raise bad_file(index, f"names shard {shard_name!r}, which is missing from {folder}")
        header = read_safetensors_header(shard)
        for name, info in header.items():
            if name in tensors:
                raise bad_file(shard, f"tensor {name!r} also appears in {tensors[name].file.name}")
            if weight_map.get(name) != shard_name:
                raise bad_file(
                    shard,
                    f"tensor {name!r} is not mapped to this shard in {index.name}: "
                    "inconsistent checkpoint",
                )
            tensors[name] = info
        files.append(shard)
    missing = [name for name in weight_map if name not in tensors]
    if missing:
        raise bad_file(
            index,
            f"{len(missing)} tensor(s) listed but absent from their shard, first {missing[0]!r} "
            f"(expected in {weight_map[missing[0]]})",
        )
    return tuple(files), tensors


def check_weight_shapes(base: BaseInfo) -> None:
    """BadInput unless the weight files hold exactly the weights the family reads for this
    config, each of the shape the config implies: the first weight of another shape (a
    ``vocab_size`` that disagrees with the embedding), the first one missing (transformers would
    fill it at random, and the reference would share the random weight, so nothing after would
    notice) or the first one the family does not read (another architecture's weights under
    this ``model_type``)."""
    config_file = base.folder / "config.json"
    expected = read_weights(base.config)
    for name, info in sorted(base.tensors.items()):
        if name in expected and tuple(info.shape) != expected[name]:
            raise bad_file(info.file, f"{name} has shape {tuple(info.shape)}, but {config_file.name} implies {expected[name]}")
    missing = [name for name in expected if name not in base.tensors]
    if missing:
        raise bad_file(
            config_file,
            f"{len(missing)} weight(s) the config's layers need are in no weight file (first: {missing[0]}): "
            "a base must be complete",
        )
    unread = sorted(name for name in base.tensors if name not in expected and not ignored_weight(name, base.config))
    if unread:
        model_type = base.config.get("model_type")
        raise bad_file(
            base.tensors[unread[0]].file,
            f"{len(unread)} tensor(s) a {model_type} model does not read (first: {unread[0]}): "
            f"weights of another architecture, or a config.json that does not describe them",
        )
