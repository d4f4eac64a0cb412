"""Validate the base model and the LoRA adapters before any heavy work starts.

A build loads multi-gigabyte weights, traces a model and runs coremltools for minutes; a bad
input discovered at the end of that wastes the time and usually surfaces as an unreadable
traceback from deep inside torch or coremltools. Everything here therefore works from file
headers and configs only (plus one streaming pass for hashes and NaN/Inf checks) and reports
every problem as a one-line :class:`~adapterpack.errors.BadInput` naming the file at fault.

The module deliberately imports only the standard library, numpy and safetensors: the checks
must stay fast and must run before torch, transformers or peft are imported. Files are treated
as untrusted: safetensors headers are validated by hand before any byte of tensor data is read,
and pickle weights are refused unless the caller opts in.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .errors import BadInput

__all__ = [
    "AdapterInfo",
    "BaseInfo",
    "TensorInfo",
    "check_finite",
    "inspect_adapter",
    "read_safetensors_header",
    "resolve_base",
    "sha256_files",
]

# safetensors refuses headers above this size (its own N_LEN limit); a larger value is a
# corrupt length field, not a real header.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype the installed safetensors reader accepts. Bits rather than
# bytes because F4 packs two elements per byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}

# Non-finite test per float dtype on the raw bits: (unsigned view, mask, value) such that
# ``bits & mask == value`` marks NaN or Inf. Working on bits covers BF16 and FP8, which numpy
# cannot represent, with the same code as F16/F32.
_NONFINITE_BITS: dict[str, tuple[type[np.unsignedinteger], int, int]] = {
    "F16": (np.uint16, 0x7C00, 0x7C00),
    "BF16": (np.uint16, 0x7F80, 0x7F80),
    "F32": (np.uint32, 0x7F80_0000, 0x7F80_0000),
    "C64": (np.uint32, 0x7F80_0000, 0x7F80_0000),  # two F32 halves
    "F64": (np.uint64, 0x7FF0_0000_0000_0000, 0x7FF0_0000_0000_0000),
    "F8_E5M2": (np.uint8, 0x7C, 0x7C),
    "F8_E4M3": (np.uint8, 0x7F, 0x7F),  # "fn" variant: no Inf, NaN is S.1111.111
    "F8_E5M2FNUZ": (np.uint8, 0xFF, 0x80),  # only NaN is the negative-zero pattern
    "F8_E4M3FNUZ": (np.uint8, 0xFF, 0x80),
    "F8_E8M0": (np.uint8, 0xFF, 0xFF),
}

_CHUNK = 1 << 20  # 1 MiB: a multiple of every element size, small enough to stay cache-friendly

_PEFT_PREFIX = "base_model.model."
SUPPORTED_PEFT_TYPES = ("LORA",)
_PICKLE_HINT = "pickle weights can run code; convert to safetensors or pass --allow-pickle"

_T = TypeVar("_T")

# A Hugging Face repo id: "name" or "owner/name".
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


@dataclass(frozen=True)
class TensorInfo:
    """Name-independent facts about one stored tensor."""

    dtype: str  # safetensors dtype string, e.g. "F16", "F32", "BF16"
    shape: tuple[int, ...]
    file: Path


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


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data region
    end: int


def _bad(where: Path | str, problem: str) -> BadInput:
    """Build a one-line BadInput that starts with the file (or source) at fault."""
    return BadInput(" ".join(f"{where}: {problem}".splitlines()))


def _short(exc: BaseException, limit: int = 200) -> str:
    """One-line, bounded description of a foreign exception for embedding in a message."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# Hashing
# --------------------------------------------------------------------------------------------


def sha256_files(files: Iterable[Path | str]) -> str:
    """SHA-256 hex digest of the concatenated contents of ``files``, streamed in 1 MiB chunks.

    The caller fixes the order (config first, then weights); symlinks (hub cache) are followed.
    """
    digest = hashlib.sha256()
    for file in files:
        path = Path(file)
        try:
            with path.open("rb") as fh:
                while chunk := fh.read(_CHUNK):
                    digest.update(chunk)
        except OSError as exc:
            raise _bad(path, f"cannot read: {exc.strerror or _short(exc)}") from None
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# JSON and safetensors headers
# --------------------------------------------------------------------------------------------


def _load_json_object(file: Path) -> dict:
    """Parse a JSON object file, turning every failure into a BadInput with line/column."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise _bad(file, "missing") from None
    except IsADirectoryError:
        raise _bad(file, "is a folder, expected a JSON file") from None
    except OSError as exc:
        raise _bad(file, f"cannot read: {exc.strerror or _short(exc)}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise _bad(file, f"not UTF-8 text (byte {exc.start}); expected a JSON object") from None
    except json.JSONDecodeError as exc:
        raise _bad(
            file, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except (ValueError, RecursionError) as exc:  # over-long integers, absurd nesting
        raise _bad(file, f"invalid JSON: {_short(exc)}") from None
    if not isinstance(value, dict):
        raise _bad(file, f"expected a JSON object at the top level, found {type(value).__name__}")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; two entries for one tensor name is corruption.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_uint(value: Any) -> bool:
    # bool is an int subclass in Python; JSON true must not pass as a dimension.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_header(file: Path) -> tuple[dict[str, _Entry], int]:
    """Validate a safetensors file's header and layout; return entries and data-region start."""
    try:
        with file.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise _bad(
                    file,
                    f"not a safetensors file: {size} bytes, shorter than the 8-byte header length",
                )
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES:
                raise _bad(
                    file,
                    f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit: "
                    "corrupt or not safetensors",
                )
            if n > size - 8:
                raise _bad(
                    file,
                    f"header length {n} exceeds the file size ({size} bytes): "
                    "truncated or not safetensors",
                )
            raw = fh.read(n)
    except FileNotFoundError:
        raise _bad(file, "missing") from None
    except IsADirectoryError:
        raise _bad(file, "is a folder, expected a safetensors file") from None
    except OSError as exc:
        raise _bad(file, f"cannot read: {exc.strerror or _short(exc)}") from None
    if len(raw) != n:
        raise _bad(file, "file shrank while reading the header")

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise _bad(file, f"safetensors header is not UTF-8 (byte {exc.start + 8})") from None
    except json.JSONDecodeError as exc:
        raise _bad(
            file, f"safetensors header is not valid JSON (byte {exc.pos + 8}: {exc.msg})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise _bad(file, f"safetensors header is not valid JSON ({_short(exc)})") from None
    if not isinstance(header, dict):
        raise _bad(file, f"safetensors header must be a JSON object, found {type(header).__name__}")

    data_len = size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            # safetensors accepts null or a string -> string map here; anything else it rejects.
            if spec is not None and not (
                isinstance(spec, dict) and all(isinstance(v, str) for v in spec.values())
            ):
                raise _bad(file, "__metadata__ must be an object of string values")
            continue
        entries[name] = _check_entry(file, name, spec, data_len)

    # Tensors must tile the data region exactly: no overlaps (aliasing), no gaps, no trailing
    # bytes. This is the layout safetensors itself enforces when loading.
    expected = 0
    previous = None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < expected:
            raise _bad(
                file,
                f"tensor {name!r} (bytes {entry.begin}-{entry.end}) overlaps tensor {previous!r}",
            )
        if entry.begin > expected:
            raise _bad(
                file,
                f"data bytes {expected}-{entry.begin} belong to no tensor (gap before {name!r})",
            )
        expected = entry.end
        previous = name
    if expected != data_len:
        raise _bad(
            file, f"{data_len - expected} trailing data bytes after the last tensor: corrupt file"
        )
    return entries, 8 + n


def _bounded_prod(dims: list[int], limit: int) -> int:
    """Product of ``dims``, capped just above ``limit``.

    A hostile header can list thousands of huge dimensions; multiplying them out in full would
    build a million-digit integer.
    """
    if 0 in dims:
        return 0
    product = 1
    for dim in dims:
        product *= dim
        if product > limit:
            return limit + 1
    return product


def _check_entry(file: Path, name: str, spec: Any, data_len: int) -> _Entry:
    """Validate one header entry against the size of the data region."""
    if not isinstance(spec, dict):
        raise _bad(
            file, f"tensor {name!r}: header entry must be an object with dtype, shape, data_offsets"
        )
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _bad(
            file, f"tensor {name!r}: unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BITS)}"
        )
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise _bad(
            file, f"tensor {name!r}: shape {shape!r} must be a list of non-negative integers"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise _bad(
            file,
            f"tensor {name!r}: data_offsets {offsets!r} must be [begin, end] non-negative integers",
        )
    begin, end = offsets
    if begin > end:
        raise _bad(file, f"tensor {name!r}: data_offsets [{begin}, {end}] end before they begin")
    if end > data_len:
        raise _bad(
            file,
            f"tensor {name!r} ends at data byte {end} but the data region has only "
            f"{data_len} bytes: file truncated",
        )
    bits = _bounded_prod(shape, 8 * (end - begin) + 1) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise _bad(
            file,
            f"tensor {name!r}: {dtype} {tuple(shape)} does not fit the {end - begin} bytes "
            "its data_offsets span",
        )
    return _Entry(dtype, tuple(shape), begin, end)


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Read and validate a safetensors header without trusting the file; map names to info.

    Checks the 8-byte little-endian length (within the file and below 100 MB), that the header
    is a UTF-8 JSON object, known dtypes, integer shapes, offsets inside the data region that
    match ``prod(shape) * itemsize``, and that tensors tile the data region exactly (no
    overlaps, gaps, trailing bytes or truncation). ``__metadata__`` is allowed.
    """
    file = Path(file)
    entries, _ = _parse_header(file)
    return {name: TensorInfo(e.dtype, e.shape, file) for name, e in entries.items()}


def check_finite(file: Path, tensors: dict[str, TensorInfo]) -> None:
    """Raise BadInput naming the file and tensor if any float tensor holds NaN or Inf.

    Reads raw bytes at the header's offsets and tests exponent bits, so BF16 and FP8 (which
    numpy cannot represent) get the same treatment as F16/F32. Integer tensors are skipped.
    """
    file = Path(file)
    entries, data_start = _parse_header(file)
    try:
        with file.open("rb") as fh:
            for name in tensors:
                entry = entries.get(name)
                if entry is None:
                    raise _bad(file, f"tensor {name!r} is not in this file")
                rule = _NONFINITE_BITS.get(entry.dtype)
                if rule is None or entry.begin == entry.end:
                    continue
                count, first_byte = _scan_nonfinite(
                    fh, data_start + entry.begin, entry.end - entry.begin, rule
                )
                if count:
                    bits = DTYPE_BITS[entry.dtype]
                    raise _bad(
                        file,
                        f"tensor {name!r} ({entry.dtype} {entry.shape}) has {count} NaN/Inf "
                        f"value(s), first at flat index {first_byte * 8 // bits}: "
                        "the weights are corrupt or training diverged",
                    )
    except OSError as exc:
        raise _bad(file, f"cannot read: {exc.strerror or _short(exc)}") from None


def _scan_nonfinite(
    fh: Any, start: int, length: int, rule: tuple[type, int, int]
) -> tuple[int, int]:
    """Count non-finite values in ``length`` bytes at ``start``; return (count, first offset)."""
    view, mask, value = rule
    itemsize = np.dtype(view).itemsize
    fh.seek(start)
    count, first, done = 0, -1, 0
    while done < length:
        buf = fh.read(min(_CHUNK, length - done))
        if not buf:
            raise OSError("file truncated while reading tensor data")
        # Chunks are multiples of 8 bytes and tensors whole elements, so a chunk never splits one.
        bits = np.frombuffer(buf, dtype=view)
        hits = np.flatnonzero((bits & view(mask)) == view(value))
        if hits.size:
            if first < 0:
                first = int(hits[0]) * itemsize + done
            count += int(hits.size)
        done += len(buf)
    return count, first


# --------------------------------------------------------------------------------------------
# Base model
# --------------------------------------------------------------------------------------------


def _looks_local(source: str) -> bool:
    """True when ``source`` can only be a filesystem path, never a hub repo id."""
    return (
        source.startswith((".", "/", "~", "\\"))
        or "\\" in source
        or (len(source) > 1 and source[1] == ":")  # Windows drive
        or not _HUB_ID.match(source)
    )


def _os_errors_as_bad_input(func: Callable[..., _T]) -> Callable[..., _T]:
    """Safety net: an unreadable path found while probing folders is bad input, not a crash."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return func(*args, **kwargs)
        except OSError as exc:
            where = exc.filename or (args[0] if args else "input")
            raise _bad(where, f"cannot access: {exc.strerror or _short(exc)}") from None

    return wrapper


@_os_errors_as_bad_input
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
    path = Path(source).expanduser()
    if not path.is_absolute():
        path = Path(manifest_dir) / path
    if path.exists():
        if not path.is_dir():
            raise _bad(
                path, "base is a file; expected a folder with config.json and model.safetensors"
            )
        return _inspect_base_folder(path.resolve(), source, revision, from_hub=False)
    if _looks_local(source):
        raise _bad(
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
            f"({type(exc).__name__}: {_short(exc)}): use a local folder "
            f"(there is none at {local_path})"
        ) from None
    folder = Path(where)
    if not folder.is_dir():
        raise BadInput(
            f"base '{source}': the hub download gave no folder ({where}): use a local folder"
        )
    return folder


def _inspect_base_folder(
    folder: Path, source: str, revision: str | None, from_hub: bool
) -> BaseInfo:
    """Validate config.json and the safetensors weights of a local base folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise _bad(
            config_file,
            "missing: the base folder must be a Hugging Face model folder with config.json",
        )
    config = _load_json_object(config_file)

    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    # Same preference as transformers: the single file wins over an index.
    if single.is_file():
        weight_files: tuple[Path, ...] = (single,)
        tensors = read_safetensors_header(single)
    elif index.is_file():
        weight_files, tensors = _read_sharded(folder, index)
    else:
        raise _no_weights_error(folder, from_hub)
    if not tensors:
        raise _bad(weight_files[0], "holds no tensors")

    return BaseInfo(
        folder=folder,
        config=config,
        tensors=tensors,
        weight_files=weight_files,
        content_hash=sha256_files((config_file, *weight_files)),
        source=source,
        revision=revision,
    )


def _no_weights_error(folder: Path, from_hub: bool) -> BadInput:
    """Explain why no safetensors weights were found (pickle-only, other formats, nothing)."""
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    pickles = [n for n in names if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    if pickles:
        return _bad(
            folder,
            f"base has only pickle weights ({', '.join(pickles[:3])}), which can run code "
            "when loaded; convert them to safetensors "
            "(load and save_pretrained(safe_serialization=True))",
        )
    others = [n for n in names if n.endswith(".safetensors")]
    found = f"; found {', '.join(others[:3])}" if others else ""
    # The hub download skips *.bin, so a pickle-only repo arrives without any weights.
    hub = " (hub repos with only pickle weights are refused)" if from_hub else ""
    return _bad(folder, f"no model.safetensors or model.safetensors.index.json{found}{hub}")


def _read_sharded(folder: Path, index: Path) -> tuple[tuple[Path, ...], dict[str, TensorInfo]]:
    """Validate a sharded checkpoint: index weight_map against every shard's header."""
    data = _load_json_object(index)
    weight_map = data.get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise _bad(
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
            raise _bad(index, f"shard {shard_name!r} lies outside the model folder")
        if not shard.is_file():
            raise _bad(index, f"names shard {shard_name!r}, which is missing from {folder}")
        header = read_safetensors_header(shard)
        for name, info in header.items():
            if name in tensors:
                raise _bad(shard, f"tensor {name!r} also appears in {tensors[name].file.name}")
            if weight_map.get(name) != shard_name:
                raise _bad(
                    shard,
                    f"tensor {name!r} is not mapped to this shard in {index.name}: "
                    "inconsistent checkpoint",
                )
            tensors[name] = info
        files.append(shard)
    missing = [name for name in weight_map if name not in tensors]
    if missing:
        raise _bad(
            index,
            f"{len(missing)} tensor(s) listed but absent from their shard, first {missing[0]!r} "
            f"(expected in {weight_map[missing[0]]})",
        )
    return tuple(files), tensors


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------


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
            raise _bad(
                config_file, f"{field} key {pattern!r} is not a valid regular expression ({exc})"
            ) from None
    return None


def _adapter_config(folder: Path) -> tuple[Path, dict]:
    """Load adapter_config.json and check the fields the shape checks rely on."""
    config_file = folder / "adapter_config.json"
    if not config_file.exists():
        raise _bad(
            config_file,
            "missing: a peft adapter folder needs adapter_config.json next to its weights",
        )
    config = _load_json_object(config_file)
    peft_type = config.get("peft_type")
    if peft_type not in SUPPORTED_PEFT_TYPES:
        raise _bad(
            config_file,
            f"peft_type {peft_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_PEFT_TYPES)} (LoRA, including DoRA via use_dora)",
        )
    r = config.get("r", 8)  # peft's default when the field is absent
    if not _is_uint(r) or r == 0:
        raise _bad(config_file, f"'r' must be a positive integer, found {r!r}")
    rank_pattern = config.get("rank_pattern") or {}
    if not isinstance(rank_pattern, dict) or not all(
        _is_uint(v) and v > 0 for v in rank_pattern.values()
    ):
        raise _bad(config_file, "'rank_pattern' must map module patterns to positive integer ranks")
    modules_to_save = config.get("modules_to_save") or []
    if isinstance(modules_to_save, str):
        modules_to_save = [modules_to_save]
    if not isinstance(modules_to_save, list) or not all(
        isinstance(m, str) for m in modules_to_save
    ):
        raise _bad(config_file, "'modules_to_save' must be a list of module names or null")
    return config_file, config


def _load_pickle_adapter(file: Path) -> dict[str, TensorInfo]:
    """Read names/shapes of an ``adapter_model.bin`` (opt-in) and check it for NaN/Inf."""
    # Lazy: torch must not be imported by the pre-flight checks unless pickle is allowed.
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses arbitrary globals; also corrupt archives
        raise _bad(
            file, f"cannot load pickle weights safely ({type(exc).__name__}: {_short(exc)})"
        ) from None
    if not isinstance(state, dict):
        raise _bad(file, f"expected a state dict of tensors, found {type(state).__name__}")
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
            raise _bad(file, f"entry {name!r} is not a named tensor")
        if value.dtype not in names:
            raise _bad(file, f"tensor {name!r} has unsupported dtype {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise _bad(
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


_Roles = dict[str, tuple[str, TensorInfo]]  # role ("A", "B", ...) -> (adapter key, info)


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


def _untrained_targets(base: BaseInfo, config: dict, present: set[str]) -> list[str]:
    """Base modules the config's ``target_modules`` list selects but the weights do not cover.

    Only plain lists are checked (peft's suffix rule); regex strings, ``all-linear``, layer
    patterns and exclusions are left to peft rather than re-implemented here.
    """
    targets = config.get("target_modules")
    if not isinstance(targets, list) or config.get("exclude_modules") or config.get("layers_pattern"):
        return []
    layers = config.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    modules = sorted(
        {
            name[: -len(".weight")]
            for name, info in base.tensors.items()
            if name.endswith(".weight") and len(info.shape) == 2
        },
        key=_natural_key,
    )
    missing = []
    for module in modules:
        if not any(module == t or module.endswith("." + t) for t in targets if isinstance(t, str)):
            continue
        if layers is not None:
            match = re.search(r"\.layers\.(\d+)\.", module)
            if match is None or int(match.group(1)) not in layers:
                continue
        if module not in present:
            missing.append(module)
    return missing


@_os_errors_as_bad_input
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
        raise _bad(folder, "adapter folder not found")
    if not folder.is_dir():
        raise _bad(
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
            raise _bad(bin_file, f"refusing adapter_model.bin: {_PICKLE_HINT}")
        weight_file = bin_file
        tensors = _load_pickle_adapter(bin_file)
    else:
        raise _bad(
            folder, "no adapter_model.safetensors (the weights file peft's save_pretrained writes)"
        )
    if not tensors:
        raise _bad(weight_file, "holds no tensors")

    uses_dora = bool(config.get("use_dora"))
    checker = _KeyChecker(base, config, config_file)
    for key, info in tensors.items():
        checker.add(key, info)
    checker.check_modules(uses_dora)
    if checker.problems:
        key, reason = checker.problems[0]
        bad_keys = len({k for k, _ in checker.problems})
        raise _bad(
            weight_file,
            f"{bad_keys} of {len(tensors)} adapter tensor(s) do not apply to base "
            f"'{base.source}'; first: {key}: {reason}",
        )

    missing = _untrained_targets(base, config, set(checker.lora) | set(checker.saved))
    if missing:
        raise _bad(
            weight_file,
            f"missing LoRA weights for {len(missing)} module(s) that adapter_config.json targets, "
            f"first: {missing[0]} (the weights file does not match its config)",
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
