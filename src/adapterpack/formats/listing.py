"""What every format's reader gives: the functions a package declares (names, inputs, outputs,
states), its default function and adapterpack's metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Feature:
    name: str
    dtype: str
    shape: str


@dataclass
class FunctionInfo:
    name: str
    inputs: list[Feature] = field(default_factory=list)
    outputs: list[Feature] = field(default_factory=list)
    states: list[Feature] = field(default_factory=list)


@dataclass
class PackageFunctions:
    path: Path
    functions: list[FunctionInfo]
    default: str
    metadata: dict[str, str]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]
