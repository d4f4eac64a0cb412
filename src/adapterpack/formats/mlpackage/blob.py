"""The weight blob of a package (coremltools ``mlmodel/src/MILBlob/Blob/StorageFormat.hpp``): a
64-byte header, then per record a 64-byte metadata block (sentinel 0xDEADBEEF, data type, size,
absolute data offset) and its data, each aligned to 64 bytes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

from adapterpack.errors import BadInput

HEADER_BYTES = 64


METADATA_BYTES = 64


ALIGNMENT = 64


SENTINEL = 0xDEADBEEF


# MILBlob BlobDataType (mlmodel/src/MILBlob/Blob/BlobDataType.hpp); values are only ever appended.
BLOB_DTYPES = {
    1: "float16", 2: "float32", 3: "uint8", 4: "int8", 5: "bfloat16", 6: "int16", 7: "uint16",
    8: "int4", 9: "uint1", 10: "uint2", 11: "uint4", 12: "uint3", 13: "uint6", 14: "int32",
    15: "uint32", 16: "float8e4m3fn", 17: "float8e5m2",
}


@dataclass
class BlobRecord:
    """One record of a weight blob file and who reads it."""

    file: str  # path inside the package
    offset: int  # of the metadata block: what BlobFileValue.offset names
    data_offset: int
    size: int  # sizeInBytes: the data only
    dtype: str
    overhead: int  # metadata block + alignment padding after the data
    functions: set[str] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    kind_by_function: dict[str, str] = field(default_factory=dict)


def read_blob_records(package: Path, name: str) -> list[BlobRecord]:
    """Every record of one blob file, checked against the storage format; BadInput when malformed."""
    path = package / name
    size = path.stat().st_size
    records: list[BlobRecord] = []
    with path.open("rb") as handle:
        header = handle.read(HEADER_BYTES)
        if len(header) < HEADER_BYTES:
            raise BadInput(f"{path}: weight blob shorter than its {HEADER_BYTES}-byte header")
        count, version = struct.unpack_from("<II", header)
        if version != 2:
            raise BadInput(f"{path}: weight blob version {version}, expected 2")
        position = HEADER_BYTES
        while position < size:
            handle.seek(position)
            metadata = handle.read(METADATA_BYTES)
            if len(metadata) < METADATA_BYTES:
                if not metadata.strip(b"\0"):  # zero padding at the end of the file
                    records[-1].overhead += size - position if records else 0
                    break
                raise BadInput(f"{path}: truncated weight record at byte {position}")
            sentinel, dtype, length, data_offset = struct.unpack_from("<IIQQ", metadata)
            if sentinel != SENTINEL:
                raise BadInput(f"{path}: no weight record at byte {position} (sentinel {sentinel:#x})")
            if data_offset < position + METADATA_BYTES or data_offset + length > size:
                raise BadInput(
                    f"{path}: weight record at byte {position} claims data at {data_offset} "
                    f"(+{length} bytes) outside the file ({size} bytes)"
                )
            following = min(-(-(data_offset + length) // ALIGNMENT) * ALIGNMENT, size)
            records.append(
                BlobRecord(
                    file=name,
                    offset=position,
                    data_offset=data_offset,
                    size=length,
                    dtype=BLOB_DTYPES.get(dtype, f"dtype {dtype}"),
                    overhead=following - position - length,
                )
            )
            position = following
    if len(records) != count:
        raise BadInput(f"{path}: header says {count} weight records, found {len(records)}")
    return records


BLOB_DTYPE_CODES = {name: code for code, name in BLOB_DTYPES.items()}


def record_metadata(handle, offset: int, name: str | None = None) -> tuple[bytes, str, int, int]:
    """(metadata block, blob dtype, data offset, size in bytes) of the record whose metadata is at
    ``offset`` (what a BlobFileValue names) in an open blob file; BadInput naming ``name`` (the
    file by default) when there is none."""
    name = name or handle.name
    handle.seek(offset)
    metadata = handle.read(METADATA_BYTES)
    if len(metadata) < METADATA_BYTES:
        raise BadInput(f"{name}: no weight record at byte {offset} (the file ends)")
    sentinel, dtype, length, data_offset = struct.unpack_from("<IIQQ", metadata)
    if sentinel != SENTINEL:
        raise BadInput(f"{name}: no weight record at byte {offset} (sentinel {sentinel:#x})")
    return metadata, BLOB_DTYPES.get(dtype, f"dtype {dtype}"), data_offset, length


_CHUNK = 1 << 24


def record_chunks(handle, offset: int, size: int):
    """The ``size`` bytes at ``offset`` of an open file, in chunks; BadInput when it ends first."""
    handle.seek(offset)
    remaining = size
    while remaining:
        chunk = handle.read(min(remaining, _CHUNK))
        if not chunk:
            raise BadInput(f"{handle.name}: weight record data at byte {offset} runs past the end of the file")
        remaining -= len(chunk)
        yield chunk
        handle.seek(offset + size - remaining)


def record_identity(handle, offset: int, name: str | None = None) -> tuple[bytes, bytes, int, int]:
    """(identity, metadata block, data offset, size) of the record at ``offset``: the identity is
    the sha256 of its metadata without the absolute data offset, and of its data, so equal
    records anywhere in any blob have equal identities (sha256: the hardware-accelerated hash
    here, twice blake2b's speed on gigabytes)."""
    metadata, _, data_offset, size = record_metadata(handle, offset, name)
    identity = hashlib.sha256(metadata[:16] + metadata[24:])
    for chunk in record_chunks(handle, data_offset, size):
        identity.update(chunk)
    return identity.digest(), metadata, data_offset, size


class BlobWriter:
    """Writes a weight blob record by record, in the layout coremltools' own writer produces
    (so a program written this way is byte-identical to one coremltools saves).

        with BlobWriter(path) as blob:
            offset = blob.write("float16", data)   # what the BlobFileValue names
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._handle = self.path.open("wb")
        self._handle.write(bytes(HEADER_BYTES))  # the record count is known at the end
        self._position = HEADER_BYTES
        self.count = 0

    def write(self, dtype: str, data) -> int:
        """Append one record (``data``: bytes or any buffer, e.g. a memory-mapped array); returns
        the offset of its metadata block."""
        view = memoryview(data).cast("B")
        return self._append(lambda offset: self._metadata(dtype, len(view), offset), view)

    def write_like(self, metadata: bytes, data) -> int:
        """Append a record that replaces another whose metadata block is ``metadata``: its
        fields (type, size, padding of sub-byte data) are kept, the data offset is its own."""
        view = memoryview(data).cast("B")
        if struct.unpack_from("<Q", metadata, 8)[0] != len(view):
            raise ValueError(f"a record of {struct.unpack_from('<Q', metadata, 8)[0]} bytes cannot be replaced by {len(view)}")
        return self._append(lambda offset: metadata[:16] + struct.pack("<Q", offset + METADATA_BYTES) + metadata[24:METADATA_BYTES], view)

    def _append(self, metadata_at, view: memoryview) -> int:
        # Records start 64-byte aligned; the file ends right after the last one's data.
        offset = -(-self._position // ALIGNMENT) * ALIGNMENT
        self._handle.write(bytes(offset - self._position))
        self._handle.write(metadata_at(offset))
        self._handle.write(view)
        self._position = offset + METADATA_BYTES + len(view)
        self.count += 1
        return offset

    @staticmethod
    def _metadata(dtype: str, length: int, offset: int) -> bytes:
        block = struct.pack("<IIQQ", SENTINEL, BLOB_DTYPE_CODES[dtype], length, offset + METADATA_BYTES)
        return block.ljust(METADATA_BYTES, b"\0")

    def close(self) -> None:
        if self._handle.closed:
            return
        self._handle.seek(0)
        self._handle.write(struct.pack("<II", self.count, 2).ljust(HEADER_BYTES, b"\0"))
        self._handle.close()

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
