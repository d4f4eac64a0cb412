"""The streaming merge against coremltools' save_multifunction, and the fused fast path against
compressing every function whole."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from adapterpack.assemble.pipeline import build, build_function_part
from adapterpack.assemble.records import BuildOptions
from adapterpack.errors import BadInput
from adapterpack.formats.mlpackage.merge import merge_functions, read_spec
from adapterpack.formats.mlpackage.spec import op_values, walk_ops
from factories import make_adapter, make_project, tree_digest

MANIFEST = """name: merging
base: {path: base}
adapters:
  - {name: chat, path: chat}
  - {name: code, path: code, compression: {nbits: 6}}
  - {name: kept, path: chat, lora: keep}
include_base: base
export: {max_context: 32}
compression: {method: palettize}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_project(
        tmp_path_factory.mktemp("merging"),
        MANIFEST,
        {"chat": dict(std=0.1), "code": dict(std=0.1, seed=4, targets=("q_proj", "gate_proj", "up_proj"))},
    )


@pytest.fixture(scope="module")
def parts(project) -> dict[str, Path]:
    folder = project / "parts"
    for name in ("chat", "code", "kept", "base"):
        build_function_part(project / "m.yaml", name, folder)
    return {name: folder / f"{name}.mlpackage" for name in ("chat", "code", "kept", "base")}


def resolved(package: Path) -> tuple[object, dict]:
    """(spec, {function: [(op type, outputs, [(parameter, blob dtype, bytes)])]}): what each
    function reads, wherever the records sit in the blob."""
    spec = read_spec(package)
    blob = (package / "Data/com.apple.CoreML/weights/weight.bin").read_bytes()
    functions = {}
    for name, function in spec.mlProgram.functions.items():
        ops = []
        for block in function.block_specializations.values():
            for op in walk_ops(block):
                values = []
                for parameter, value in op_values(op):
                    if value.WhichOneof("value") == "blobFileValue":
                        _, dtype, size, data = struct.unpack_from("<IIQQ", blob, value.blobFileValue.offset)
                        values.append((parameter, dtype, blob[data : data + size]))
                ops.append((op.type, [o.name for o in op.outputs], sorted(values)))
        functions[name] = ops
    return spec, functions


def test_streaming_merge_matches_save_multifunction(parts, tmp_path):
    from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction

    from adapterpack.quiet import captured_output

    ours = tmp_path / "ours.mlpackage"
    merge_functions(parts, default_function="code", destination=ours, metadata={"k": "v"}, description="d")
    descriptor = MultiFunctionDescriptor()
    for name, path in parts.items():
        descriptor.add_function(str(path), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = "code"
    with captured_output():
        save_multifunction(descriptor, str(tmp_path / "ct.mlpackage"))

    our_spec, our_functions = resolved(ours)
    ct_spec, ct_functions = resolved(tmp_path / "ct.mlpackage")
    assert set(our_functions) == set(ct_functions) == set(parts)  # a protobuf map: no order
    for name in parts:
        assert our_functions[name] == ct_functions[name], name
    assert list(our_spec.description.functions) == list(ct_spec.description.functions)
    assert [f.name for f in our_spec.description.functions] == list(parts)
    assert our_spec.description.defaultFunctionName == "code"
    assert our_spec.specificationVersion == ct_spec.specificationVersion
    assert our_spec.mlProgram.version == ct_spec.mlProgram.version
    assert our_spec.description.metadata.userDefined["k"] == "v"
    # Shared weights are stored once, as save_multifunction stores them.
    weights = "Data/com.apple.CoreML/weights/weight.bin"
    assert (ours / weights).stat().st_size == (tmp_path / "ct.mlpackage" / weights).stat().st_size
    assert (ours / weights).stat().st_size < sum((p / weights).stat().st_size for p in parts.values()) * 0.6


def test_function_digest_is_the_function_not_the_package(parts, tmp_path):
    """A function's digest is the same in its part and in any merged package (where its records
    sit elsewhere), and changes when one byte of a weight it reads changes."""
    import shutil

    from adapterpack.formats.mlpackage.digest import function_digests

    merged = tmp_path / "m.mlpackage"
    returned = merge_functions(parts, default_function="code", destination=merged, metadata={}, description="d")
    assert function_digests(merged) == returned
    for name, part in parts.items():
        assert function_digests(part) == {"main": returned[name]}
    alone = tmp_path / "alone.mlpackage"
    assert merge_functions({"chat": parts["chat"]}, default_function="chat", destination=alone, metadata={}, description="d") == {
        "chat": returned["chat"]
    }
    changed = tmp_path / "chat.mlpackage"
    shutil.copytree(parts["chat"], changed)
    blob = changed / "Data/com.apple.CoreML/weights/weight.bin"
    data = bytearray(blob.read_bytes())
    data[-10] ^= 1  # inside the last record's data
    blob.write_bytes(bytes(data))
    assert function_digests(changed)["main"] != returned["chat"]
    assert len(set(returned.values())) == len(returned)


def test_op_values_come_in_name_order():
    """Records are copied in the order op_values gives: it must not follow protobuf's map order,
    which differs from process to process (merged packages would differ byte for byte)."""
    from coremltools.proto import MIL_pb2

    op = MIL_pb2.Operation(type="x")
    for name in ("zeta", "alpha", "mid"):
        op.attributes[name].immediateValue.tensor.ints.values.append(1)
    for name in ("y", "b"):
        op.inputs[name].arguments.add().value.immediateValue.tensor.ints.values.append(2)
    assert [name for name, _ in op_values(op)] == ["alpha", "mid", "zeta", "b", "y"]


def test_merge_names_a_truncated_part(parts, tmp_path):
    import shutil

    broken = tmp_path / "chat.mlpackage"
    shutil.copytree(parts["chat"], broken)
    blob = broken / "Data/com.apple.CoreML/weights/weight.bin"
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])
    with pytest.raises(BadInput, match="weight.bin"):
        merge_functions({**parts, "chat": broken}, default_function="code",
                        destination=tmp_path / "out.mlpackage", metadata={}, description="d")


@pytest.mark.parametrize(
    "named, says",
    [("@model_path/weights/../../../escape.bin", "not in @model_path/weights/"), ("@model_path/weights/patched-9.bin", "does not hold")],
)
def test_merge_refuses_a_part_naming_a_blob_it_does_not_hold(parts, tmp_path, named, says):
    """A fused part's spec names its own blob besides the base's: a name outside its weights
    folder, or a blob it lacks (an artifact upload that lost a file), is bad input naming it."""
    import shutil

    from adapterpack.formats.mlpackage.digest import blob_values
    from adapterpack.formats.mlpackage.spec import spec_path

    broken = tmp_path / "chat.mlpackage"
    shutil.copytree(parts["chat"], broken)
    spec = read_spec(broken)
    next(blob_values(spec.mlProgram.functions["main"])).fileName = named
    spec_path(broken).write_bytes(spec.SerializeToString())
    with pytest.raises(BadInput, match=f"{re.escape(str(broken))}.*{re.escape(named)}.*{re.escape(says)}"):
        merge_functions({**parts, "chat": broken}, default_function="code",
                        destination=tmp_path / "out.mlpackage", metadata={}, description="d")


def test_merge_refuses_a_multifunction_input(parts, tmp_path):
    merged = tmp_path / "m.mlpackage"
    merge_functions(parts, default_function="code", destination=merged, metadata={}, description="d")
    with pytest.raises(BadInput, match="one function"):
        merge_functions({"x": merged}, default_function="x", destination=tmp_path / "again.mlpackage",
                        metadata={}, description="d")


@pytest.mark.slow
def test_fused_fast_path_equals_compressing_each_function(project, tmp_path, monkeypatch):
    """Fused functions patched into the compressed base are byte-identical to compressing each
    fused model whole (the path taken when the patch cannot match)."""
    import adapterpack.formats.mlpackage.weights

    compressed = []
    compress_package = adapterpack.formats.mlpackage.weights.compress_package

    def counted(source, target, *args, **kwargs):
        compressed.append(1)
        return compress_package(source, target, *args, **kwargs)

    monkeypatch.setattr(adapterpack.formats.mlpackage.weights, "compress_package", counted)
    fast = build(project / "m.yaml", output=tmp_path / "fast" / "p.mlpackage", options=BuildOptions(verify=False))
    # whole programs compressed: the base at 4 and at 6 bits, and the keep-mode function
    assert len(compressed) == 3

    compressed.clear()
    monkeypatch.setattr(
        adapterpack.formats.mlpackage.weights, "compressed_records", lambda values, *settings_and_palettes: iter([None] * len(values))
    )
    slow = build(project / "m.yaml", output=tmp_path / "slow" / "p.mlpackage", options=BuildOptions(verify=False))
    assert len(compressed) == 5  # ... and each fused function on its own
    assert tree_digest(fast.output) == tree_digest(slow.output)


@pytest.mark.slow
def test_rebuild_of_a_fused_adapter_does_not_load_the_base(project, tmp_path, monkeypatch):
    import shutil

    import adapterpack.convert.base_model

    changed = tmp_path / "p"
    shutil.copytree(project, changed, ignore=shutil.ignore_patterns("parts"))
    build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False))
    make_adapter(changed / "code", changed / "base", std=0.1, seed=7, targets=("q_proj", "gate_proj", "up_proj"))

    load_base = adapterpack.convert.base_model.load_base

    def reference_only(folder, dtype="float32"):
        assert dtype == "float32", "the float16 build base was loaded"  # verify's reference is float32
        return load_base(folder, dtype)

    monkeypatch.setattr(adapterpack.convert.base_model, "load_base", reference_only)
    rebuilt = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=True, force=True))
    assert rebuilt.reused == ["chat", "kept", "base"]
    assert rebuilt.verify_report.passed


KEPT_MANIFEST = """name: kept
base: {path: base}
lora: keep
adapters:
  - {name: one, path: one}
  - {name: two, path: two}
  - {name: other, path: other}
export: {max_context: 32}
compression: {method: palettize}
"""


@pytest.mark.slow
def test_kept_adapters_of_the_same_settings_are_patched_not_converted(tmp_path, monkeypatch):
    """A kept adapter with the same settings as one already built is patched into its part (its
    LoRA matrices replaced), byte-identical to converting it; one of other settings (rank) is
    converted; a rebuild after one adapter changed patches it from a cached part."""
    import adapterpack.assemble.builder as builder

    project = make_project(tmp_path / "p", KEPT_MANIFEST, {
        "one": dict(std=0.1, seed=1), "two": dict(std=0.1, seed=2), "other": dict(std=0.1, seed=3, r=8),
    })
    patched = []
    keep_patched = builder._PartBuilder._keep_patched

    def counted(self, name, donor, part, target):
        done = keep_patched(self, name, donor, part, target)
        patched.extend([name] if done else [])
        return done

    monkeypatch.setattr(builder._PartBuilder, "_keep_patched", counted)
    fast = build(project / "m.yaml", output=tmp_path / "fast.mlpackage", options=BuildOptions(verify=False))
    assert patched == ["two"]

    monkeypatch.setattr(builder._PartBuilder, "_keep_patched", lambda *args: False)
    slow = build(project / "m.yaml", output=tmp_path / "slow.mlpackage", options=BuildOptions(verify=False, use_cache=False))
    assert tree_digest(fast.output) == tree_digest(slow.output)

    # one changed: patched from two's cached part, and still what converting it gives
    make_adapter(project / "one", project / "base", std=0.1, seed=9)
    monkeypatch.setattr(builder._PartBuilder, "_keep_patched", counted)
    patched.clear()
    rebuilt = build(project / "m.yaml", output=tmp_path / "rebuilt.mlpackage", options=BuildOptions(verify=False))
    assert rebuilt.reused == ["two", "other"] and patched == ["one"]
    monkeypatch.setattr(builder._PartBuilder, "_keep_patched", lambda *args: False)
    converted = build(project / "m.yaml", output=tmp_path / "converted.mlpackage", options=BuildOptions(verify=False, use_cache=False))
    assert tree_digest(rebuilt.output) == tree_digest(converted.output)
