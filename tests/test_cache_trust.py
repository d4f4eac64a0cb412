"""A restored build cache is input from outside the build: every reused byte is re-hashed, a
damaged entry is dropped and rebuilt (the package byte-identical to a clean build), a verdict
vouches only for the bytes it was given, concurrent builds share a cache safely, and weights
that do not fit float16 are refused before any conversion."""

from __future__ import annotations

import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from adapterpack.assemble.cache import ENTRY_FILE, MARKER, BuildCache, file_digests
from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.errors import BadInput
from factories import CACHED_MANIFEST, make_adapter, make_cached_project, make_project, run_cli, tree_digest

MANIFEST = CACHED_MANIFEST.format(name="trust")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_cached_project(tmp_path_factory.mktemp("trust"), "trust")


@pytest.fixture(scope="module")
def clean(project, tmp_path_factory):
    """A verified build with a fresh cache: (result, cache folder). It measures its calibration
    whatever this process built before (the statistics of a build are reused in-process
    otherwise, and its cache then holds no calibration entry)."""
    from adapterpack.assemble import calibration

    calibration._LAST_MEASURED.clear()
    out = tmp_path_factory.mktemp("clean")
    result = build(project / "m.yaml", output=out / "p.mlpackage", options=BuildOptions(cache_dir=out / "cache"))
    return result, out / "cache"


def entries(cache: Path, kind: str) -> list[Path]:
    return sorted(p.parent for p in (cache / kind).glob(f"*/{ENTRY_FILE}"))


def flip_payload_byte(entry: Path) -> Path:
    """Change one byte in the middle of the entry's largest file; sizes and headers stay."""
    files = [p for p in entry.rglob("*") if p.is_file() and p.name != ENTRY_FILE]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def part_of(cache: Path, function: str) -> Path:
    return next(e for e in entries(cache, "parts") if json.loads((e / ENTRY_FILE).read_text())["about"]["function"] == function)


# kind of the damaged entry -> the entries to remove as well, so that the build reads it
DAMAGE = {
    "parts": lambda cache: [],
    "bases": lambda cache: [part_of(cache, "chat")],  # chat's patch needs the compressed base
    "palettes": lambda cache: [part_of(cache, "chat")],  # ...and the base's palettes of its weights
    "checks": lambda cache: [part_of(cache, "chat")],  # building anything checks float16 ranges
    "verdicts": lambda cache: [],
}


@pytest.fixture
def warnings(caplog):
    """Messages the library logs at WARNING (the CLI stops its logger propagating; attach here)."""
    logger = logging.getLogger("adapterpack")
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.WARNING)
    yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("kind", [k if k in ("parts", "palettes") else pytest.param(k, marks=pytest.mark.slow) for k in sorted(DAMAGE)])
def test_damaged_entry_of_each_kind_is_dropped_and_rebuilt(project, clean, tmp_path, warnings, kind):
    result, cache = clean
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    for entry in DAMAGE[kind](copy):
        shutil.rmtree(entry)
    damaged = entries(copy, kind)
    assert damaged, f"the clean build cached no {kind}"
    for entry in damaged:
        flip_payload_byte(entry)
    again = build(project / "m.yaml", output=tmp_path / "p.mlpackage", options=BuildOptions(cache_dir=copy))
    assert any(w.startswith(f"build cache: {kind}/") and "damaged" in w for w in warnings()), warnings()
    assert tree_digest(again.output) == tree_digest(result.output)
    assert again.verify_report.passed
    if kind == "parts":
        assert again.reused == []  # every part was damaged: all built again
    if kind == "verdicts":
        assert not any(f.reused for f in again.verify_report.functions)
    # What was dropped was written again, intact (palettes: only those the rebuild read).
    if kind != "palettes":
        assert all(BuildCache(copy)._read(e, kind).problem() is None for e in entries(copy, kind))


def test_missing_file_is_a_damaged_entry(project, clean, tmp_path, warnings):
    result, cache = clean
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    entry = part_of(copy, "code")
    (entry / "part.mlpackage" / "Manifest.json").unlink()
    again = build(project / "m.yaml", output=tmp_path / "p.mlpackage", options=BuildOptions(cache_dir=copy, verify=False))
    assert any("Manifest.json is missing" in w for w in warnings()), warnings()
    assert again.reused == ["chat", "base"]
    assert tree_digest(again.output) == tree_digest(result.output)


def test_reused_verdict_is_refused_when_the_bytes_differ(project, clean, tmp_path):
    """A poisoned part (its entry's digests rewritten to match) passes the integrity check, but
    its bytes are not the ones verified: the verdict is not reused, the function is verified
    now, and the build fails instead of printing a PASS for bytes no check saw."""
    from adapterpack.errors import VerificationFailed

    result, cache = clean
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    entry = part_of(copy, "chat")
    weights = entry / "part.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    # Negate a run of float16 values inside one record: the weight shifts, headers stay.
    data = bytearray(weights.read_bytes())
    values = np.frombuffer(bytes(data[4096 : 4096 + 2000]), np.uint16) ^ np.uint16(0x8000)
    data[4096 : 4096 + 2000] = values.tobytes()
    weights.write_bytes(bytes(data))
    record = json.loads((entry / ENTRY_FILE).read_text())
    record["files"] = BuildCache(copy)._read(entry, "parts").files | {
        "part.mlpackage/Data/com.apple.CoreML/weights/weight.bin": [len(data), file_digests(weights)]
    }
    (entry / ENTRY_FILE).write_text(json.dumps(record))

    before = {f.name: f.digest for f in result.verify_report.functions}
    try:
        again = build(project / "m.yaml", output=tmp_path / "p.mlpackage", options=BuildOptions(cache_dir=copy))
    except VerificationFailed as failure:
        report = failure.report
    else:
        report = again.verify_report
    chat = next(f for f in report.functions if f.name == "chat")
    assert not chat.reused and chat.digest != before["chat"]
    assert {f.name for f in report.functions if f.reused} == {"code", "base"}


@pytest.mark.slow
def test_two_builds_share_one_cache_at_once(project, tmp_path):
    """Two builds writing one cache at the same time (two terminals, matrix jobs) never read
    each other's half-written entries and produce identical packages."""
    cache = tmp_path / "cache"
    manifest = project / "m.yaml"

    def one(name: str):
        return run_cli("build", manifest, "-o", tmp_path / name / "p.mlpackage", "--cache-dir", cache, "--no-verify", "--quiet")

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(one, ["one", "two"])
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert tree_digest(tmp_path / "one" / "p.mlpackage") == tree_digest(tmp_path / "two" / "p.mlpackage")
    checked = run_cli("cache", "verify", cache)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert not list(cache.glob(".trash-*")) and not list(cache.glob("*/.incoming-*"))


def test_fused_parts_share_the_base_blob_on_disk_and_are_hashed_once(clean, monkeypatch):
    """A fused function's cached part links the compressed base's blob: the cache holds that
    blob once, `cache info` counts it once, and re-checking the parts reads it once."""
    import adapterpack.assemble.cache as cache_module

    _, cache = clean
    blob = Path("part.mlpackage/Data/com.apple.CoreML/weights/weight.bin")
    chat, base = part_of(cache, "chat") / blob, part_of(cache, "base") / blob
    assert chat.stat().st_ino == base.stat().st_ino  # the base function's part is the compressed base
    own = part_of(cache, "chat") / blob.parent / "patched-1.bin"
    assert 0 < own.stat().st_size < chat.stat().st_size / 2  # its q/v records only
    stored = {}
    for f in cache.rglob("*"):
        if f.is_file() and f.name not in (ENTRY_FILE, MARKER):
            stored[f.stat().st_ino] = f.stat().st_size
    recorded = sum(e.size for kind in ("parts", "bases", "palettes", "checks", "verdicts") for e in BuildCache(cache).entries([kind]))
    listing = json.loads(run_cli("cache", "info", cache, "--json").stdout)
    assert listing["bytes"] == sum(stored.values()) < recorded
    hashed = []
    monkeypatch.setattr(cache_module, "file_digests", lambda path: hashed.append(path.name) or file_digests(path))
    keys = [json.loads((e / ENTRY_FILE).read_text())["key"] for e in entries(cache, "parts")]
    assert len(BuildCache(cache).parts(keys)) == len(keys) == 3
    assert hashed.count("weight.bin") == 1 and hashed.count("patched-1.bin") == 2


def test_cache_commands(project, clean, tmp_path):
    _, cache = clean
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    info = run_cli("cache", "info", copy, "--json")
    assert info.returncode == 0, info.stderr
    listing = json.loads(info.stdout)
    assert {kind for kind, row in listing["kinds"].items() if row["entries"]} == {"parts", "bases", "palettes", "checks", "verdicts", "calibration"}
    total = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file() and f.name not in (ENTRY_FILE, MARKER))
    assert listing["bytes"] == total

    flip_payload_byte(part_of(copy, "code"))
    checked = run_cli("cache", "verify", copy)
    assert checked.returncode == 3 and "damaged" in checked.stdout and "parts/" in checked.stdout
    assert run_cli("cache", "verify", copy).returncode == 0  # the damaged entry was dropped

    # Least recently used first: age every entry but one part, then bound the size.
    kept = part_of(copy, "chat")
    for entry in entries(copy, "parts") + entries(copy, "bases") + entries(copy, "palettes") + entries(copy, "calibration"):
        if entry != kept:
            os.utime(entry / ENTRY_FILE, (1, 1))
    recent = [kept, *entries(copy, "checks"), *entries(copy, "verdicts")]
    size = sum(f.stat().st_size for e in recent for f in e.rglob("*") if f.is_file() and f.name != ENTRY_FILE)
    pruned = run_cli("cache", "prune", copy, "--max-size", str(size + 100))
    assert pruned.returncode == 0, pruned.stderr
    assert entries(copy, "parts") == [kept] and not entries(copy, "bases")
    assert json.loads(run_cli("cache", "info", copy, "--json").stdout)["bytes"] == size

    assert run_cli("cache", "prune", copy, "--older-than", "0").returncode == 0
    assert json.loads(run_cli("cache", "info", copy, "--json").stdout)["bytes"] == 0

    bad = run_cli("cache", "prune", copy, "--max-size", "lots")
    assert bad.returncode == 2 and "--max-size 'lots'" in bad.stderr
    missing = run_cli("cache", "info", tmp_path / "nowhere")
    assert missing.returncode == 2 and "no build cache" in missing.stderr


def test_prune_drops_an_older_layout_and_leftovers(tmp_path):
    cache = BuildCache(tmp_path)
    (tmp_path / "templates").mkdir()
    (tmp_path / "abc.part.json").write_text("{}")
    (tmp_path / "palettes").mkdir()
    (tmp_path / "palettes" / "x.npz").write_bytes(b"old")
    leftover = tmp_path / ".trash-0"
    leftover.mkdir()
    os.utime(leftover, (1, 1))
    cache.write("verdicts", "k", {"verdict.json": b"{}"}, {})
    dropped = cache.prune()
    assert len(dropped) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "palettes", "verdicts"]
    assert cache.open("verdicts", "k") is not None


def test_a_second_writer_keeps_the_first_entry(tmp_path):
    cache = BuildCache(tmp_path)
    first = cache.write("checks", "key", {"check.json": b"1"}, {})
    second = cache.write("checks", "key", {"check.json": b"2"}, {})
    assert first == second and (first / "check.json").read_bytes() == b"1"
    assert not list((tmp_path / "checks").glob(".incoming-*"))


# -- weights that do not fit float16 ------------------------------------------------------------


@pytest.fixture(scope="module")
def bfloat16_project(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    root = make_project(tmp_path_factory.mktemp("bf16"), MANIFEST.replace("include_base: base\n", ""), {"chat": dict(std=0.1), "code": dict(std=0.1, seed=4)})
    model = AutoModelForCausalLM.from_pretrained(root / "base", torch_dtype=torch.bfloat16)
    model.save_pretrained(root / "bf16", safe_serialization=True)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = 1e6
    model.save_pretrained(root / "huge", safe_serialization=True)
    return root


def test_bfloat16_value_beyond_float16_exits_2_naming_the_tensor(bfloat16_project, tmp_path):
    root = bfloat16_project
    (root / "huge.yaml").write_text((root / "m.yaml").read_text().replace("base: {path: base}", "base: {path: huge}"))
    run = run_cli("build", root / "huge.yaml", "-o", tmp_path / "p.mlpackage", "--quiet")
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    # 1e6 in bfloat16 is 999424
    assert len(errors) == 1 and "model.layers.1.mlp.down_proj.weight (BF16) largest magnitude 999424 > 65504" in errors[0], run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "p.mlpackage").exists()


def test_fused_delta_beyond_float16_is_bad_input(bfloat16_project, tmp_path):
    root = bfloat16_project
    project = tmp_path / "p"
    project.mkdir()
    make_adapter(project / "loud", root / "bf16", std=30.0, alpha=4096, targets=("o_proj",))
    (project / "m.yaml").write_text(
        f"name: loud\nbase: {{path: {root / 'bf16'}}}\nadapters:\n  - {{name: loud, path: loud, scale: 1000}}\n"
        "export: {max_context: 32}\n"
    )
    with pytest.raises(BadInput, match=r"o_proj.weight largest magnitude .* > 65504"):
        build(project / "m.yaml", output=project / "p.mlpackage", options=BuildOptions(verify=False))
    assert not (project / "p.mlpackage").exists()


def test_kept_lora_matrix_beyond_float16_is_bad_input(bfloat16_project, tmp_path):
    from safetensors.numpy import load_file, save_file

    root = bfloat16_project
    project = tmp_path / "p"
    shutil.copytree(root / "chat", project / "chat")
    weights = project / "chat" / "adapter_model.safetensors"
    tensors = load_file(weights)
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name] = tensors[name].copy()
    tensors[name][0, 0] = 1e5
    save_file(tensors, weights)
    (project / "m.yaml").write_text(
        f"name: kept\nbase: {{path: {root / 'bf16'}}}\nlora: keep\nadapters:\n  - {{name: chat, path: chat}}\n"
        "export: {max_context: 32}\n"
    )
    with pytest.raises(BadInput, match=rf"{name} \(F32\) largest magnitude 100000 > 65504"):
        build(project / "m.yaml", output=project / "p.mlpackage", options=BuildOptions(verify=False))


def test_magnitudes_are_read_from_the_bits(tmp_path):
    """The raw-bit scan gives the largest |value| exactly, for every float type it reads."""
    import torch
    from safetensors.torch import save_file

    from adapterpack.inputs.float16 import tensor_magnitudes
    from adapterpack.inputs.safetensors import read_safetensors_header

    generator = torch.Generator().manual_seed(0)
    values = torch.randn(64, 33, generator=generator) * 300
    values[7, 9] = -70000.0
    tensors = {
        "f32": values,
        "bf16": values.to(torch.bfloat16),
        "f16": (values / 4).to(torch.float16),
        "f64": values.to(torch.float64),
        "nan": torch.tensor([1.0, float("nan"), -2.0]),
        "inf": torch.tensor([1.0, float("-inf")], dtype=torch.float16),
        "ints": torch.arange(5),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    found = tensor_magnitudes(read_safetensors_header(tmp_path / "t.safetensors"))
    for name in ("f32", "bf16", "f16", "f64"):
        assert found[name] == float(tensors[name].abs().max()), name
    assert np.isnan(found["nan"]) and found["inf"] == float("inf") and "ints" not in found


def test_large_files_are_hashed_in_pieces(tmp_path, monkeypatch):
    """A file larger than a piece is hashed piece by piece (both cores); a change names its piece."""
    import adapterpack.assemble.cache as cache_module

    monkeypatch.setattr(cache_module, "HASH_PIECE", 1000)
    data = bytes(range(256)) * 20  # 5120 bytes: 6 pieces
    cache = BuildCache(tmp_path)
    entry = cache.write("checks", "k", {"check.json": data}, {})
    record = json.loads((entry / ENTRY_FILE).read_text())
    assert len(record["files"]["check.json"][1]) == 6
    changed = bytearray(data)
    changed[3500] ^= 1
    (entry / "check.json").write_bytes(bytes(changed))
    problem = cache._read(entry, "checks").problem()
    assert "bytes 3,000-4,000 differs" in problem, problem
