"""The functions a package declares: names, inputs, outputs, states and the package metadata,
read from the spec alone.
"""

from __future__ import annotations

from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.files import refuse_special_file
from adapterpack.formats.listing import Feature, FunctionInfo, PackageFunctions
from adapterpack.formats.mlpackage.spec import check_package_manifest, load_spec_file, spec_path

_DTYPES = {65568: "float32", 65552: "float16", 131104: "int32", 65600: "float64"}


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


def package_functions(path: Path) -> PackageFunctions:
    """Functions, default function and metadata of a ``.mlpackage`` (or an ``.mlmodel`` file)."""
    # The spec alone, read without importing coremltools' converters (and with them torch).
    if path.is_dir():
        check_package_manifest(path)
        spec = load_spec_file(spec_path(path))
    elif path.is_file():
        refuse_special_file(path, "a Core ML package or model file")
        spec = load_spec_file(path)
    else:
        raise BadInput(f"{path}: not a Core ML package (a folder) or model file")
    description = spec.description
    if spec.specificationVersion == 0 or not (len(description.functions) or len(description.input) or len(description.output)):
        # An empty file parses as an empty spec: it declares nothing, and is no model.
        raise BadInput(f"{path}: not a Core ML model (its spec declares no function, input or output)")
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


def package_metadata(path: Path) -> dict[str, str]:
    """The package's user-defined metadata (adapterpack's keys among them)."""
    return dict(load_spec_file(spec_path(path)).description.metadata.userDefined)
