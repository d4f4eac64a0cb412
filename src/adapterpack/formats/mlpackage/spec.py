"""The model spec of a package: where it is, parsing it (without importing coremltools'
converters), and walking its ML Program's operations and values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adapterpack.errors import BadInput
from adapterpack.files import refuse_special_file
from adapterpack.quiet import captured_output, import_coreml_proto

MODEL_FOLDER = ("Data", "com.apple.CoreML")


SPEC_NAME = "model.mlmodel"


MODEL_PATH_PREFIX = "@model_path/"


def save_model(mlmodel, path: Path) -> None:
    """Write coremltools' ``mlmodel`` as the package ``path``, and delete the temporary package
    coremltools made for it at once: coremltools copies that package on ``save`` and deletes it
    only when the process exits, so every model converted or compressed in a build would hold
    its whole size on disk until the build ends (16 GB for an 8B base). Where the temporary
    package is on the same filesystem it is moved, not copied."""
    import os
    import shutil

    path = Path(path)
    temporary = getattr(mlmodel, "package_path", None) if getattr(mlmodel, "is_temp_package", False) else None
    if temporary is None or not Path(temporary).is_dir():
        with captured_output():
            mlmodel.save(str(path))
        return
    if path.exists():
        shutil.rmtree(path)
    try:
        os.rename(temporary, path)
    except OSError:  # another filesystem
        with captured_output():
            mlmodel.save(str(path))
        shutil.rmtree(temporary, ignore_errors=True)
    else:
        # what save writes besides the copy: the spec as the model holds it (metadata set since)
        from coremltools.models.utils import _get_model_spec_path, save_spec

        save_spec(mlmodel.get_spec(), _get_model_spec_path(str(path)))
    mlmodel.package_path = str(path)  # the model's package is there now
    mlmodel.is_temp_package = False


def refuse_special_files(package: Path) -> None:
    """BadInput naming the first file of ``package`` that is a FIFO, socket or device (reading
    one blocks, or never ends) or a symlink that leads nowhere (or to itself)."""
    if not package.is_dir():
        return
    for path in sorted(package.rglob("*")):
        if path.is_symlink() and not path.exists():
            raise BadInput(f"{path}: a symlink that leads nowhere (or to itself), inside the package")
        refuse_special_file(path, "a file of the package")


def spec_path(package: Path) -> Path:
    """The root model spec, as Manifest.json names it (the usual Data/com.apple.CoreML/model.mlmodel);
    BadInput when the package's Manifest.json is not one Core ML would read."""
    check_package_manifest(package)
    default = package.joinpath(*MODEL_FOLDER, SPEC_NAME)
    info = json.loads((package / "Manifest.json").read_bytes())
    named = package / "Data" / info["itemInfoEntries"][info["rootModelIdentifier"]]["path"]
    if named.is_file():
        return named
    if not default.is_file():
        raise BadInput(f"{package}: not a Core ML package (no {'/'.join(MODEL_FOLDER)}/{SPEC_NAME})")
    return default


def check_package_manifest(package: Path) -> None:
    """BadInput unless ``package``/Manifest.json is what Core ML writes: a JSON object whose
    ``rootModelIdentifier`` names one of its ``itemInfoEntries``, each with a string ``path``.
    coremltools' own package reader answers other content with bare errors, and may write the
    file back while it reads it: it is not handed a manifest that fails this."""
    refuse_special_files(package)
    manifest = package / "Manifest.json"
    try:
        info = json.loads(manifest.read_bytes())
    except (OSError, ValueError) as error:
        raise BadInput(f"{manifest}: not a readable package manifest ({type(error).__name__}: {str(error)[:120]})") from None
    entries = info.get("itemInfoEntries") if isinstance(info, dict) else None
    root = info.get("rootModelIdentifier") if isinstance(info, dict) else None
    if (
        not isinstance(entries, dict)
        or not isinstance(root, str)
        or root not in entries
        or not all(isinstance(e, dict) and isinstance(e.get("path"), str) for e in entries.values())
    ):
        raise BadInput(f"{manifest}: not a Core ML package manifest (rootModelIdentifier must name one of itemInfoEntries, each with a path)")


def load_spec_file(spec_path: Path):
    """A Core ML model spec file, parsed; BadInput naming the file when it is not one."""

    with captured_output():
        spec = import_coreml_proto().Model_pb2.Model()
    try:
        spec.ParseFromString(spec_path.read_bytes())
    except Exception as error:  # protobuf raises DecodeError, and others for some corruptions
        raise BadInput(f"{spec_path}: not a readable Core ML model spec ({type(error).__name__}: {error})") from None
    return spec


def function_names_of_spec(spec) -> list[str]:
    """Functions in the order the package lists them (the description keeps the build order)."""
    described = [f.name for f in spec.description.functions]
    program = list(spec.mlProgram.functions.keys())
    names = [name for name in described if name in spec.mlProgram.functions]
    names += sorted(name for name in program if name not in names)
    if not names:
        raise BadInput("the ML Program has no functions")
    return names


def value_dtype_name(value_type) -> str:

    return import_coreml_proto().MIL_pb2.DataType.Name(value_type.tensorType.dataType).lower()


def value_dims(value_type) -> list[int | None]:
    return [
        d.constant.size if d.WhichOneof("dimension") == "constant" else None
        for d in value_type.tensorType.dimensions
    ]


def walk_ops(block) -> Iterator[Any]:
    for op in block.operations:
        yield op
        for inner in op.blocks:
            yield from walk_ops(inner)


def op_values(op) -> Iterator[tuple[str, Any]]:
    """(parameter, Value) of every value an op holds: attributes, and inputs bound to values.

    In name order: protobuf's map iteration order differs from process to process, and what
    is written in this order (the merged blob's records) must not."""
    for name in sorted(op.attributes):
        yield name, op.attributes[name]
    for name in sorted(op.inputs):
        for binding in op.inputs[name].arguments:
            if binding.WhichOneof("binding") == "value":
                yield name, binding.value
