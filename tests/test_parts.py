"""Build cache and fan-out: unchanged functions are reused, parts merge to the same package."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from adapterpack.assemble.pipeline import build, build_function_part, merge_from_parts
from adapterpack.assemble.records import BuildOptions
from adapterpack.errors import BadInput
from adapterpack.formats.registry import read_functions
from factories import CACHED_MANIFEST, make_adapter, make_cached_project, tree_digest

MANIFEST = CACHED_MANIFEST.format(name="parts")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_cached_project(tmp_path_factory.mktemp("parts"), "parts")


@pytest.fixture(scope="module")
def full_build(project):
    return build(project / "m.yaml", output=project / "out" / "p.mlpackage", options=BuildOptions(verify=False))


def test_rebuild_after_one_adapter_changed_redoes_only_that_function(project, full_build, tmp_path):
    assert full_build.reused == []
    unchanged = build(project / "m.yaml", output=project / "out" / "p.mlpackage", options=BuildOptions(verify=False, force=True))
    assert unchanged.reused == ["chat", "code", "base"]
    assert tree_digest(unchanged.output) == tree_digest(full_build.output)

    changed = tmp_path / "p"
    shutil.copytree(project, changed)
    make_adapter(changed / "code", changed / "base", std=0.1, seed=99, targets=("gate_proj", "up_proj"))
    rebuilt = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False, force=True))
    assert rebuilt.reused == ["chat", "base"]
    def adapter_hashes(package: Path) -> dict:
        functions = json.loads(read_functions(package).metadata["co.adapterpack.functions"])
        return {name: entry["adapterSha256"] for name, entry in functions.items()}

    before, after = adapter_hashes(full_build.output), adapter_hashes(rebuilt.output)
    assert after["code"] != before["code"] and after["chat"] == before["chat"]


def test_cache_is_keyed_by_settings(project, full_build, tmp_path):
    changed = tmp_path / "p"
    shutil.copytree(project, changed)
    (changed / "m.yaml").write_text(MANIFEST.replace("method: palettize", "method: linear"))
    rebuilt = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False, force=True))
    assert rebuilt.reused == []


@pytest.mark.slow
def test_fan_out_parts_merge_to_the_same_package(project, full_build, tmp_path):
    parts = tmp_path / "parts"
    for name in ("base", "code", "chat"):  # any order, as separate CI jobs would finish
        build_function_part(project / "m.yaml", name, parts)
    merged = merge_from_parts(parts, tmp_path / "merged.mlpackage", manifest=project / "m.yaml")
    assert merged.verify_report is not None
    assert tree_digest(merged.output) == tree_digest(full_build.output)


@pytest.mark.slow
def test_merge_refuses_parts_that_do_not_belong_together(project, tmp_path):
    parts = tmp_path / "parts"
    build_function_part(project / "m.yaml", "chat", parts)
    with pytest.raises(BadInput, match="missing code, base"):
        merge_from_parts(parts, tmp_path / "x.mlpackage")
    build_function_part(project / "m.yaml", "code", parts)
    build_function_part(project / "m.yaml", "base", parts)
    record_file = parts / "code.part.json"
    record = json.loads(record_file.read_text())
    record["versions"]["coremltools"] = "0.0"
    record_file.write_text(json.dumps(record))
    with pytest.raises(BadInput, match="differ in versions"):
        merge_from_parts(parts, tmp_path / "x.mlpackage")
    assert not (tmp_path / "x.mlpackage").exists()


def test_unknown_function_part_is_bad_input(project, tmp_path):
    with pytest.raises(BadInput, match="choose one of chat, code, base"):
        build_function_part(project / "m.yaml", "zen", tmp_path / "parts")


@pytest.mark.slow
def test_rebuild_verifies_only_what_changed(project, tmp_path):
    changed = tmp_path / "p"
    shutil.copytree(project, changed, ignore=shutil.ignore_patterns("out"))
    first = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage")
    assert first.verify_report.passed
    assert not any(f.reused for f in first.verify_report.functions)

    make_adapter(changed / "code", changed / "base", std=0.1, seed=98, targets=("gate_proj", "up_proj"))
    rebuilt = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(force=True))
    reused = {f.name for f in rebuilt.verify_report.functions if f.reused}
    assert reused == {"chat", "base"} and rebuilt.verify_report.passed
    code = next(f for f in rebuilt.verify_report.functions if f.name == "code")
    before = next(f for f in first.verify_report.functions if f.name == "code")
    assert code.cosine != before.cosine  # really run again on the new adapter

    # Other verification settings: nothing is reused.
    text = (changed / "m.yaml").read_text() + "verify: {prefill: 5, decode_steps: 3}\n"
    (changed / "m.yaml").write_text(text)
    again = build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(force=True))
    assert not any(f.reused for f in again.verify_report.functions)


def test_fan_out_job_reuses_a_restored_cache(project, tmp_path, monkeypatch):
    """A CI job that restores its cache folder builds nothing for an unchanged function."""
    import adapterpack.assemble.builder

    cache = tmp_path / "cache"
    first = build_function_part(project / "m.yaml", "chat", tmp_path / "parts1", options=BuildOptions(cache_dir=cache))

    def refuse(*args, **kwargs):
        raise AssertionError("built again despite the cache")

    monkeypatch.setattr(adapterpack.assemble.builder, "_PartBuilder", refuse)
    second = build_function_part(project / "m.yaml", "chat", tmp_path / "parts2", options=BuildOptions(cache_dir=cache))
    assert tree_digest(first) == tree_digest(second)


def test_converted_base_is_cached_and_pruned_with_its_settings(project, tmp_path):
    """The cache keeps the compressed base the functions are made from, and the uncompressed one
    only while a function is made from it (otherwise it is the float16 model's whole size on disk
    for nothing but a later change of compression)."""
    changed = tmp_path / "p"
    shutil.copytree(project, changed, ignore=shutil.ignore_patterns("out", "parts*"))
    build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False))
    templates = changed / "out" / ".adapterpack-cache" / "bases"

    def cached() -> list[str]:
        assert len(list(templates.iterdir())) == len(list(templates.glob("*/base.mlpackage")))  # nothing half-deleted
        return sorted(p.parent.name for p in templates.glob("*/base.mlpackage"))

    first = cached()
    assert len(first) == 1  # compressed; the converted base was deleted once it was
    assert not list((changed / "out").glob("**/.template-*"))
    six_bits = MANIFEST.replace("method: palettize", "method: palettize, nbits: 6")
    (changed / "m.yaml").write_text(six_bits)
    build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False, force=True))
    second = cached()
    assert len(second) == 1 and not set(first) & set(second)  # converted again, the 4-bit base gone
    (changed / "m.yaml").write_text(six_bits.replace("{name: code, path: code}", "{name: code, path: code, compression: {method: none}}"))
    build(changed / "m.yaml", output=changed / "out" / "p.mlpackage", options=BuildOptions(verify=False, force=True))
    third = cached()
    assert len(third) == 2 and set(second) < set(third)  # code is made from the converted base: kept
