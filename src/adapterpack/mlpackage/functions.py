"""The functions a package declares: names, inputs, outputs, states and the package metadata,
read from the spec alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.mlpackage import aimodel
from adapterpack.mlpackage.metadata import METADATA_PREFIX
from adapterpack.mlpackage.spec import load_spec_file, spec_path

_DTYPES = {65568: "float32", 65552: "float16", 131104: "int32", 65600: "float64"}


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


def _array_feature(description) -> Feature:
    kind = description.type.WhichOneof("Type")
    array = description.type.multiArrayType
    if kind == "stateType":
        array = description.type.stateType.arrayType
    elif kind != "multiArrayType":
        return Feature(description.name, kind or "?", "")
    ranges = list(array.shapeRange.sizeRanges)
    if ranges:
        dims = [
            str(r.lowerBound) if r.lowerBound == r.upperBound else f"{r.lowerBound}...{r.upperBound}"
            for r in ranges
        ]
    else:
        dims = [str(d) for d in array.shape]
    return Feature(description.name, _DTYPES.get(array.dataType, str(array.dataType)), "(" + ", ".join(dims) + ")")


def read_functions(package: str | Path) -> PackageFunctions:
    """Functions, default function and metadata of a ``.mlpackage`` (or ``.mlmodel``, ``.aimodel``)."""
    path = Path(package)
    if not path.exists():
        raise BadInput(f"{path}: package not found")
    if aimodel.is_asset(path):
        return _asset_functions(path)
    # The spec alone, read without importing coremltools' converters (and with them torch).
    spec = load_spec_file(spec_path(path) if path.is_dir() else path)
    description = spec.description
    functions: list[FunctionInfo] = []
    if len(description.functions):
        for function in description.functions:
            functions.append(
                FunctionInfo(
                    name=function.name,
                    inputs=[_array_feature(d) for d in function.input],
                    outputs=[_array_feature(d) for d in function.output],
                    states=[_array_feature(d) for d in function.state],
                )
            )
        default = description.defaultFunctionName or functions[0].name
    else:
        functions.append(
            FunctionInfo(
                name="main",
                inputs=[_array_feature(d) for d in description.input],
                outputs=[_array_feature(d) for d in description.output],
                states=[_array_feature(d) for d in description.state],
            )
        )
        default = "main"
    metadata = dict(description.metadata.userDefined)
    return PackageFunctions(path=path, functions=functions, default=default, metadata=metadata)


def written_by_adapterpack(path: str | Path) -> bool:
    """Whether ``path`` is a package adapterpack wrote (its own metadata keys are inside): the
    only kind of existing output a build may replace, whatever its name ends with."""
    path = Path(path)
    try:
        if aimodel.is_asset(path):
            metadata = aimodel.asset_metadata(path)
        elif path.is_dir() and not path.is_symlink():
            metadata = dict(load_spec_file(spec_path(path)).description.metadata.userDefined)
        else:
            return False
    except Exception:  # noqa: BLE001 - anything unreadable (no spec, bad protobuf, no access) is not ours
        return False
    return any(key.startswith(METADATA_PREFIX) for key in metadata)


def _asset_functions(path: Path) -> PackageFunctions:
    """A Core AI asset's entry points, read with coreai-core; its default from our metadata."""
    summary = aimodel.asset_summary(path)
    functions = [
        FunctionInfo(
            name=name,
            inputs=[Feature(*aimodel.feature_of(*item)) for item in summary.function_inputs(name)],
            outputs=[Feature(*aimodel.feature_of(*item)) for item in summary.function_outputs(name)],
            states=[Feature(*aimodel.feature_of(*item)) for item in summary.function_states(name)],
        )
        for name in summary.function_names
    ]
    if not functions:
        raise BadInput(f"{path}: the asset has no entry points")
    metadata = aimodel.asset_metadata(path)
    default = metadata.get(METADATA_PREFIX + "defaultFunction") or functions[0].name
    return PackageFunctions(path=path, functions=functions, default=default, metadata=metadata)
