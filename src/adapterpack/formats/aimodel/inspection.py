"""What a Core AI ``.aimodel`` holds: its entry points and their signatures, storage by element
type, the compressed constants, and what its heaviest entry point needs in memory.

Core AI stores every entry point and its weights in one program (``main.mlirb``); bit-identical
constants are stored once. How many of the program's bytes one entry point references is not
exposed by coreai-core's summary, so the memory estimate takes the whole program as an upper
bound of one function's weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapterpack.formats.aimodel import asset as aimodel
from adapterpack.formats.metadata import METADATA_PREFIX
from adapterpack.report.memory import ModelShape

# Core AI ops that decompress a stored constant, by the manifest's method they carry out.
COMPRESSED_OPS = {"lut_to_dense": "palettize", "blockwise_shift_scale": "linear", "sparse_with_bitmask_to_dense": "prune"}
_DTYPE_BYTES = {"float16": 2, "float32": 4}


@dataclass
class AssetFunction:
    name: str
    adapter: str | None
    lora: str | None
    compression: str
    signature: dict[str, list[str]]  # inputs/outputs/states -> "name dtype shape"
    default: bool = False
    referenced_bytes: int = 0  # upper bound: the whole program (see the module docstring)


@dataclass
class AssetReport:
    path: Path
    default_function: str
    functions: list[AssetFunction]
    files: dict[str, int]
    program_bytes: int
    storage_elements: dict[str, int]  # element type -> elements stored (each constant once)
    compressed_ops: dict[str, int]  # method -> decompressing ops over all entry points
    shape: ModelShape | None = None
    device_findings: list = field(default_factory=list)  # the .mlpackage's device rules do not apply

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def largest_function(self) -> AssetFunction:
        return max(self.functions, key=lambda f: f.referenced_bytes)

    def as_json(self, top: int | None = None) -> dict[str, Any]:
        return {
            "package": str(self.path),
            "format": "aimodel",
            "default_function": self.default_function,
            "total_bytes": self.total_bytes,
            "program_bytes": self.program_bytes,
            "files": self.files,
            "storage_elements": self.storage_elements,
            "compressed_ops": self.compressed_ops,
            "functions": [asdict(f) for f in self.functions],
            "shape": asdict(self.shape) if self.shape else None,
        }


def _shape(report_states: list, metadata: dict[str, str]) -> ModelShape | None:
    states = {feature.name: feature for feature in report_states}
    key_cache = states.get("keyCache")
    if key_cache is None:
        return None
    dims = aimodel.dims_of(key_cache.shape)
    if len(dims) != 5:
        return None
    kv_bytes = _DTYPE_BYTES.get(key_cache.dtype, 2)
    other = sum(
        math.prod(aimodel.dims_of(f.shape)) * _DTYPE_BYTES.get(f.dtype, 2)
        for name, f in states.items()
        if name not in ("keyCache", "valueCache")
    )
    sizes = json.loads(metadata.get(METADATA_PREFIX + "shape", "{}"))
    # The asset's cache has a slot no call reaches (formats.aimodel.conversion): the context is one less ...
    max_context = int(metadata.get(METADATA_PREFIX + "maxContext", dims[3] - 1))
    spare_slots = dims[3] - max_context
    return ModelShape(
        n_layers=dims[0],
        n_kv_heads=dims[2],
        head_dim=dims[4],
        max_context=max_context,
        kv_dtype_bytes=kv_bytes,
        vocab=sizes.get("vocab"),
        hidden=sizes.get("hidden"),
        n_heads=sizes.get("n_heads"),
        intermediate=sizes.get("intermediate"),
        # ... but makeState() allocates it: counted with the other states (keys and values).
        other_state_bytes=other + 2 * spare_slots * (math.prod(dims) // dims[3]) * kv_bytes,
    )


def inspect_asset(path: Path | str) -> AssetReport:
    """Entry points, storage and memory needs of a ``.aimodel``; BadInput when unreadable."""
    path = Path(path)
    listing = aimodel.asset_functions(path)
    statistics = aimodel.asset_summary(path, statistics=True)
    described = json.loads(listing.metadata.get(METADATA_PREFIX + "functions", "{}"))
    files = {f.relative_to(path).as_posix(): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    program_bytes = files.get(aimodel.PROGRAM_FILE, 0)
    functions = []
    for info in listing.functions:
        recorded = described.get(info.name, {})
        signature = {
            kind: [f"{f.name} {f.dtype} {f.shape}" for f in getattr(info, kind)] for kind in ("inputs", "outputs", "states")
        }
        functions.append(
            AssetFunction(
                name=info.name,
                adapter=recorded.get("adapter"),
                lora=recorded.get("lora"),
                compression=recorded.get("compression", "?"),
                signature=signature,
                default=info.name == listing.default,
                referenced_bytes=program_bytes,
            )
        )
    operations = dict(statistics.operation_distribution)
    return AssetReport(
        path=path,
        default_function=listing.default,
        functions=functions,
        files=files,
        program_bytes=program_bytes,
        storage_elements=dict(statistics.storage_types),
        compressed_ops={method: operations.get(op, 0) for op, method in COMPRESSED_OPS.items()},
        shape=_shape(listing.functions[0].states, listing.metadata),
    )

