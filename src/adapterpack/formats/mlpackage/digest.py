"""A function's digest: what one function of a package runs, whatever package holds it.

sha256 of the function's program (every op, type and inline constant) with each weight
reference replaced by the identity of the record it names (``blob.record_identity``: its type
and bytes), and of its declared inputs, outputs and states. Where a record sits in the blob, the
function's name and the other functions of the package do not enter it: a function that a
rebuild left unchanged keeps its digest in the new package, and any changed byte it runs (a
weight, an op, a declared type) changes it. Cached verdicts are keyed by it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.blob import record_identity
from adapterpack.formats.mlpackage.spec import MODEL_FOLDER, load_spec_file, op_values, spec_path, walk_ops


def blob_values(function) -> Iterator[Any]:
    """Every ``BlobFileValue`` (a weight in the blob) a program function reads."""
    for specialization in sorted(function.block_specializations):  # map: see spec.op_values
        for op in walk_ops(function.block_specializations[specialization]):
            for _, value in op_values(op):
                if value.WhichOneof("value") == "blobFileValue":
                    yield value.blobFileValue


def function_digest(function, description, identities: Mapping[tuple[str, int], bytes]) -> str:
    """The digest of ``function`` (a program function), declared by ``description`` (its
    FunctionDescription), whose weight at offset o of blob file f has identity ``identities[f, o]``."""
    copy = type(function)()
    copy.CopyFrom(function)
    for value in blob_values(copy):
        value.fileName, value.offset = identities[value.fileName, value.offset].hex(), 0
    declared = type(description)()
    declared.CopyFrom(description)
    declared.name = ""
    digest = hashlib.sha256(copy.SerializeToString(deterministic=True))
    digest.update(declared.SerializeToString(deterministic=True))
    return digest.hexdigest()


def top_level_description(spec, name: str):
    """The FunctionDescription of a single-function spec's one function, which it declares at
    the top level (a multifunction spec lists one per function)."""
    from coremltools.proto import Model_pb2

    return Model_pb2.FunctionDescription(
        name=name,
        input=spec.description.input,
        output=spec.description.output,
        state=spec.description.state,
        predictedFeatureName=spec.description.predictedFeatureName,
        predictedProbabilitiesName=spec.description.predictedProbabilitiesName,
    )


def function_digests(package: Path) -> dict[str, str]:
    """{function: digest} of every function of a package on disk (multifunction or not)."""
    from coremltools.proto import Model_pb2

    spec = load_spec_file(spec_path(package))
    if spec.WhichOneof("Type") != "mlProgram":
        raise BadInput(f"{package}: not an ML Program")
    descriptions = {d.name: d for d in spec.description.functions}
    if not descriptions:  # a single-function package declares its one function at the top
        descriptions = {name: top_level_description(spec, name) for name in spec.mlProgram.functions}
    digests = {}
    with contextlib.ExitStack() as files:
        handles = {}
        for name, function in spec.mlProgram.functions.items():
            identities: dict[tuple[str, int], bytes] = {}
            for value in blob_values(function):
                if value.fileName not in handles:
                    # as the spec names it: "@model_path/weights/weight.bin"
                    file = package.joinpath(*MODEL_FOLDER, value.fileName.removeprefix("@model_path/"))
                    try:
                        handles[value.fileName] = files.enter_context(file.open("rb"))
                    except OSError as error:
                        raise BadInput(f"{file}: cannot read: {error.strerror or error}") from None
                if (value.fileName, value.offset) not in identities:
                    identities[value.fileName, value.offset] = record_identity(handles[value.fileName], value.offset)[0]
            digests[name] = function_digest(function, descriptions.get(name, Model_pb2.FunctionDescription()), identities)
    return digests


def weights_digest(package: Path) -> str:
    """sha256 of the package's weight blobs, in path order (recorded at build, checked here)."""
    digest = hashlib.sha256()
    weights = sorted((package / "Data").rglob("weights/*")) if (package / "Data").exists() else []
    for file in weights:
        if file.is_file():
            digest.update(file.relative_to(package).as_posix().encode())
            with file.open("rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()
