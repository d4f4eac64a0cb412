"""safetensors files read as untrusted input: headers validated by hand before any byte of data,
NaN/Inf checked on the raw bits, and content hashes streamed. Only the standard library, numpy
and safetensors: this runs before torch, transformers or peft are imported.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from adapterpack.files import CHUNK as _CHUNK
from adapterpack.files import bad_file, refuse_special_file, short

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


_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorInfo:
    """Name-independent facts about one stored tensor."""

    dtype: str  # safetensors dtype string, e.g. "F16", "F32", "BF16"
    shape: tuple[int, ...]
    file: Path


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of the data region
    end: int


def _load_json_object(file: Path) -> dict:
    """Parse a JSON object file, turning every failure into a BadInput with line/column."""
    refuse_special_file(file, "a JSON file")
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise bad_file(file, "missing") from None
    except IsADirectoryError:
        raise bad_file(file, "is a folder, expected a JSON file") from None
    except OSError as exc:
        raise bad_file(file, f"cannot read: {exc.strerror or short(exc)}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise bad_file(file, f"not UTF-8 text (byte {exc.start}); expected a JSON object") from None
    except json.JSONDecodeError as exc:
        raise bad_file(
            file, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except (ValueError, RecursionError) as exc:  # over-long integers, absurd nesting
        raise bad_file(file, f"invalid JSON: {short(exc)}") from None
    if not isinstance(value, dict):
        raise bad_file(file, f"expected a JSON object at the top level, found {type(value).__name__}")
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
    refuse_special_file(file, "a safetensors file")
    try:
        with file.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise bad_file(
                    file,
                    f"not a safetensors file: {size} bytes, shorter than the 8-byte header length",
                )
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES:
                raise bad_file(
                    file,
                    f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit: "
                    "corrupt or not safetensors",
                )
            if n > size - 8:
                raise bad_file(
                    file,
                    f"header length {n} exceeds the file size ({size} bytes): "
                    "truncated or not safetensors",
                )
            raw = fh.read(n)
    except FileNotFoundError:
        raise bad_file(file, "missing") from None
    except IsADirectoryError:
        raise bad_file(file, "is a folder, expected a safetensors file") from None
    except OSError as exc:
        raise bad_file(file, f"cannot read: {exc.strerror or short(exc)}") from None
    if len(raw) != n:
        raise bad_file(file, "file shrank while reading the header")

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError as exc:
        raise bad_file(file, f"safetensors header is not UTF-8 (byte {exc.start + 8})") from None
    except json.JSONDecodeError as exc:
        raise bad_file(
            file, f"safetensors header is not valid JSON (byte {exc.pos + 8}: {exc.msg})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise bad_file(file, f"safetensors header is not valid JSON ({short(exc)})") from None
    if not isinstance(header, dict):
        raise bad_file(file, f"safetensors header must be a JSON object, found {type(header).__name__}")

    data_len = size - 8 - n
    entries: dict[str, _Entry] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            # safetensors accepts null or a string -> string map here; anything else it rejects.
            if spec is not None and not (
                isinstance(spec, dict) and all(isinstance(v, str) for v in spec.values())
            ):
                raise bad_file(file, "__metadata__ must be an object of string values")
            continue
        entries[name] = _check_entry(file, name, spec, data_len)

    # Tensors must tile the data region exactly: no overlaps (aliasing), no gaps, no trailing
    # bytes. This is the layout safetensors itself enforces when loading.
    expected = 0
    previous = None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin < expected:
            raise bad_file(
                file,
                f"tensor {name!r} (bytes {entry.begin}-{entry.end}) overlaps tensor {previous!r}",
            )
        if entry.begin > expected:
            raise bad_file(
                file,
                f"data bytes {expected}-{entry.begin} belong to no tensor (gap before {name!r})",
            )
        expected = entry.end
        previous = name
    if expected != data_len:
        raise bad_file(
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
        raise bad_file(
            file, f"tensor {name!r}: header entry must be an object with dtype, shape, data_offsets"
        )
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise bad_file(
            file, f"tensor {name!r}: unknown dtype {dtype!r}; valid: {', '.join(DTYPE_BITS)}"
        )
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise bad_file(
            file, f"tensor {name!r}: shape {shape!r} must be a list of non-negative integers"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_uint(o) for o in offsets)):
        raise bad_file(
            file,
            f"tensor {name!r}: data_offsets {offsets!r} must be [begin, end] non-negative integers",
        )
    begin, end = offsets
    if begin > end:
        raise bad_file(file, f"tensor {name!r}: data_offsets [{begin}, {end}] end before they begin")
    if end > data_len:
        raise bad_file(
            file,
            f"tensor {name!r} ends at data byte {end} but the data region has only "
            f"{data_len} bytes: file truncated",
        )
    bits = _bounded_prod(shape, 8 * (end - begin) + 1) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise bad_file(
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


def tensor_data_ranges(file: Path) -> dict[str, tuple[int, int]]:
    """{tensor: (first byte, end byte)} of each tensor's data in the file (header checked)."""
    entries, data_start = _parse_header(Path(file))
    return {name: (data_start + e.begin, data_start + e.end) for name, e in entries.items()}


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
                    raise bad_file(file, f"tensor {name!r} is not in this file")
                rule = _NONFINITE_BITS.get(entry.dtype)
                if rule is None or entry.begin == entry.end:
                    continue
                count, first_byte = _scan_nonfinite(
                    fh, data_start + entry.begin, entry.end - entry.begin, rule
                )
                if count:
                    bits = DTYPE_BITS[entry.dtype]
                    raise bad_file(
                        file,
                        f"tensor {name!r} ({entry.dtype} {entry.shape}) has {count} NaN/Inf "
                        f"value(s), first at flat index {first_byte * 8 // bits}: "
                        "the weights are corrupt or training diverged",
                    )
    except OSError as exc:
        raise bad_file(file, f"cannot read: {exc.strerror or short(exc)}") from None


def _scan_nonfinite(
    fh: Any, start: int, length: int, rule: tuple[type, int, int]
) -> tuple[int, int]:
    """Count non-finite values in ``length`` bytes at ``start``; return (count, first offset)."""
    view, mask, value = rule
    itemsize = np.dtype(view).itemsize
    count, first = 0, -1
    for done, buf in tensor_chunks(fh, start, length):
        bits = np.frombuffer(buf, dtype=view)
        hits = np.flatnonzero((bits & view(mask)) == view(value))
        if hits.size:
            if first < 0:
                first = int(hits[0]) * itemsize + done
            count += int(hits.size)
    return count, first


def tensor_chunks(fh: Any, start: int, length: int, chunk: int = _CHUNK) -> Iterator[tuple[int, bytes]]:
    """(offset within the tensor, bytes) of the ``length`` bytes at ``start``, ``chunk`` at a time;
    OSError when the file ends first. Chunks are multiples of 8 bytes and tensors whole
    elements, so a chunk never splits an element."""
    fh.seek(start)
    done = 0
    while done < length:
        buf = fh.read(min(chunk, length - done))
        if not buf:
            raise OSError(f"file truncated while reading tensor data (byte {start + done})")
        yield done, buf
        done += len(buf)


_Roles = dict[str, tuple[str, TensorInfo]]  # role ("A", "B", ...) -> (adapter key, info)


def write_renamed(tensors: Iterable[tuple[str, Path, str]], destination: Path) -> None:
    """Write ``destination``: a safetensors file holding, for each ``(name, file, stored
    name)`` in order, that tensor's bytes as ``file`` stores them under ``name``. Bytes are
    copied, never decoded, so every dtype (bfloat16 and FP8 included) is kept exactly; each
    source header is validated first (``_parse_header``)."""
    headers: dict[Path, tuple[dict[str, _Entry], int]] = {}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers loads "pt" files only
    spans, offset = [], 0
    for name, file, stored in tensors:
        if file not in headers:
            headers[file] = _parse_header(file)
        entries, data_start = headers[file]
        entry = entries[stored]
        length = entry.end - entry.begin
        header[name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + length]}
        spans.append((file, data_start + entry.begin, length))
        offset += length
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data region starts 8-byte aligned, as safetensors writes it
    with destination.open("wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for file, start, length in spans:
            with file.open("rb") as fh:
                for _, buf in tensor_chunks(fh, start, length):
                    out.write(buf)
