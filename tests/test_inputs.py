"""Tests for adapterpack.inputs: every pre-flight check passes valid input and rejects its defect.

Fixtures are a tiny Llama (saved by transformers) and LoRA adapters (saved by peft), so the key
formats under test are the real ones, not hand-written imitations.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from adapterpack.errors import BadInput
from adapterpack.files import sha256_files
from adapterpack.inputs.adapter import AdapterInfo, inspect_adapter
from adapterpack.inputs.base import BaseInfo, resolve_base
from adapterpack.inputs.safetensors import (
    TensorInfo,
    check_finite,
    read_safetensors_header,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
Q1 = "base_model.model.model.layers.1.self_attn.q_proj"


# ---------------------------------------------------------------------------------------------
# Fixture builders
# ---------------------------------------------------------------------------------------------


def _tiny_llama(**overrides: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    return transformers.LlamaForCausalLM(config)


def _save_adapter(folder: Path, **lora_kwargs: Any) -> Path:
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(**lora_kwargs))
    # peft starts lora_B at zero; random values make the files look like trained adapters.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder standing in for the manifest's folder; fixtures are saved under it."""
    folder = tmp_path_factory.mktemp("inputs")
    with warnings.catch_warnings():
        # peft and transformers comment on these toy configs; the files are what matter.
        warnings.simplefilter("ignore")
        _save_fixtures(folder)
    return folder


def _save_fixtures(folder: Path) -> None:
    _tiny_llama().save_pretrained(folder / "base", safe_serialization=True)
    _tiny_llama(hidden_size=48).save_pretrained(folder / "base48", safe_serialization=True)
    _tiny_llama().save_pretrained(
        folder / "sharded", safe_serialization=True, max_shard_size="40KB"
    )
    _save_adapter(folder / "lora", r=4, target_modules=["q_proj", "v_proj"])
    _save_adapter(folder / "dora", r=4, target_modules=["q_proj"], use_dora=True)
    _save_adapter(folder / "bias", r=4, target_modules=["q_proj"], lora_bias=True)
    _save_adapter(
        folder / "embed",
        r=4,
        target_modules=["embed_tokens", "q_proj"],
        modules_to_save=["lm_head"],
    )
    _save_adapter(
        folder / "rank_suffix",
        r=4,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"layers.1.self_attn.q_proj": 2, "v_proj": 8},
    )
    _save_adapter(
        folder / "rank_regex",
        r=4,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={r"layers\.[01]\..*v_proj": 6},
    )


@pytest.fixture(scope="module")
def base(work: Path) -> BaseInfo:
    return resolve_base("base", None, work)


@pytest.fixture(scope="module")
def base48(work: Path) -> BaseInfo:
    return resolve_base("base48", None, work)


@pytest.fixture
def lora(work: Path, tmp_path: Path) -> Path:
    """A private copy of the valid adapter that a test may damage."""
    return Path(shutil.copytree(work / "lora", tmp_path / "lora"))


def _bad(
    call: Callable[..., Any], *args: Any, names: Path | str, match: str = "", **kwargs: Any
) -> str:
    """Call and expect a one-line BadInput that names ``names`` (and matches ``match``)."""
    with pytest.raises(BadInput) as info:
        call(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(names) in message, message
    if match:
        assert re.search(match, message), message
    return message


def _edit_tensors(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    file = folder / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


def _edit_config(folder: Path, edit: Callable[[dict], None]) -> Path:
    file = folder / "adapter_config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))
    return file


def _raw_safetensors(
    file: Path, header: Any, data: bytes = b"", *, length: int | None = None
) -> Path:
    """Write a safetensors file byte by byte, so headers can be deliberately wrong."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return file


def _u8(begin: int, n: int = 1, dtype: str = "U8") -> dict:
    return {"dtype": dtype, "shape": [n], "data_offsets": [begin, begin + n]}


# ---------------------------------------------------------------------------------------------
# Module hygiene and hashing
# ---------------------------------------------------------------------------------------------


def test_module_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys, adapterpack.inputs.checked, adapterpack.inputs.adapter, adapterpack.inputs.base; "
        "heavy = ('torch', 'transformers', 'peft', 'huggingface_hub'); "
        "print(','.join(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_sha256_files_streams_concatenation(tmp_path: Path) -> None:
    import hashlib

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 3_000_000)
    b.write_bytes(b"tail")
    assert sha256_files([a, b]) == hashlib.sha256(b"x" * 3_000_000 + b"tail").hexdigest()
    _bad(sha256_files, [tmp_path / "missing"], names=tmp_path / "missing")


# ---------------------------------------------------------------------------------------------
# safetensors header validation
# ---------------------------------------------------------------------------------------------


def test_header_of_real_file(base: BaseInfo) -> None:
    file = base.weight_files[0]
    tensors = read_safetensors_header(file)
    with safe_open(file, "np") as f:
        assert set(tensors) == set(f.keys())
        for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            assert tensors[name] == TensorInfo("F32", tuple(f.get_slice(name).get_shape()), file)


def test_header_allows_metadata_and_empty_tensors(tmp_path: Path) -> None:
    file = _raw_safetensors(
        tmp_path / "ok.safetensors",
        {
            "__metadata__": {"format": "pt"},
            "empty": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
            "a": _u8(0, 2),
            "b": {"dtype": "F4", "shape": [2], "data_offsets": [2, 3]},
        },
        b"\x01\x02\x03",
    )
    assert read_safetensors_header(file) == {
        "empty": TensorInfo("F32", (0, 4), file),
        "a": TensorInfo("U8", (2,), file),
        "b": TensorInfo("F4", (2,), file),
    }
    assert read_safetensors_header(_raw_safetensors(tmp_path / "none.safetensors", {})) == {}


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        (b"", b"", 0, "not valid JSON"),
        ({"a": _u8(0)}, b"\x01", 1 << 40, "exceeds the 100000000-byte limit"),
        ({"a": _u8(0)}, b"\x01", 5000, "exceeds the file size"),
        (b"\xff\xfe{}", b"", None, "not UTF-8"),
        (b"{not json", b"", None, "not valid JSON"),
        (b"[1, 2]", b"", None, "must be a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, b"", None, "not valid JSON"),
        (
            b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": {}}',
            b"\x01",
            None,
            "duplicate",
        ),
        (
            {"a": {"dtype": "F17", "shape": [1], "data_offsets": [0, 1]}},
            b"\x01",
            None,
            "unknown dtype 'F17'; valid: BOOL",
        ),
        ({"a": {"shape": [1], "data_offsets": [0, 1]}}, b"\x01", None, "unknown dtype None"),
        ({"a": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}, b"\x01", None, "shape"),
        ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\x01", None, "shape"),
        ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"\x01", None, "shape"),
        ({"a": {"dtype": "U8", "shape": "1", "data_offsets": [0, 1]}}, b"\x01", None, "shape"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0]}}, b"\x01", None, "data_offsets"),
        ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, b"\x01", None, "end before"),
        ({"a": [1]}, b"\x01", None, "header entry must be an object"),
        ({"a": _u8(0, 2, "F32")}, b"\x01\x02", None, "does not fit"),
        (
            {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}},
            b"\x01",
            None,
            "does not fit",
        ),
        (
            {"a": {"dtype": "U8", "shape": [10**30] * 50, "data_offsets": [0, 1]}},
            b"\x01",
            None,
            "does not fit",
        ),
        ({"a": _u8(0, 2), "b": _u8(1, 1)}, b"\x01\x02", None, "overlaps"),
        ({"a": _u8(0), "b": _u8(2)}, b"\x01\x02\x03", None, "belong to no tensor"),
        ({"a": _u8(0)}, b"\x01\x02", None, "1 trailing data bytes"),
        ({"a": _u8(0, 4)}, b"\x01\x02", None, "truncated"),
        ({"__metadata__": {"x": 1}, "a": _u8(0)}, b"\x01", None, "__metadata__"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_header_defects(
    tmp_path: Path, header: Any, data: bytes, length: int | None, match: str
) -> None:
    file = _raw_safetensors(tmp_path / "bad.safetensors", header, data, length=length)
    _bad(read_safetensors_header, file, names=file, match=match)


def test_header_file_problems(tmp_path: Path, base: BaseInfo) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    _bad(read_safetensors_header, short, names=short, match="shorter than")
    _bad(
        read_safetensors_header,
        tmp_path / "nope.safetensors",
        names=tmp_path / "nope.safetensors",
        match="missing",
    )
    _bad(read_safetensors_header, tmp_path, names=tmp_path, match="is a folder")
    # Cutting a real file anywhere after the header must be reported as truncation.
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(base.weight_files[0].read_bytes()[:-100])
    _bad(read_safetensors_header, cut, names=cut, match="truncated")


# ---------------------------------------------------------------------------------------------
# NaN / Inf
# ---------------------------------------------------------------------------------------------

FLOAT_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e5m2,
    torch.float8_e4m3fn,
    torch.complex64,
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_check_finite_accepts_extreme_finite_values(tmp_path: Path, dtype: torch.dtype) -> None:
    info = torch.finfo(torch.float32 if dtype.is_complex else dtype)
    values = torch.tensor(
        [0.0, -0.0, info.max, -info.max, info.tiny, info.tiny / 4, 1.0, -1.0], dtype=torch.float64
    )
    file = tmp_path / "ok.safetensors"
    save_file({"t": values.to(dtype), "i": torch.arange(5)}, file)
    check_finite(file, read_safetensors_header(file))


@pytest.mark.parametrize(
    ("dtype", "bad"),
    [
        (dtype, bad)
        for dtype in FLOAT_DTYPES
        for bad in (float("nan"), float("inf"), float("-inf"))
        # float8_e4m3fn has no Inf encoding (torch saturates it), so only NaN applies there.
        if not (dtype == torch.float8_e4m3fn and abs(bad) == float("inf"))
    ],
    ids=str,
)
def test_check_finite_finds_nonfinite(tmp_path: Path, dtype: torch.dtype, bad: float) -> None:
    values = torch.ones(40)
    values[17] = bad
    stored = values.to(dtype)
    file = tmp_path / "bad.safetensors"
    save_file({"fine": torch.zeros(3, dtype=dtype), "w": stored}, file)
    _bad(
        check_finite,
        file,
        read_safetensors_header(file),
        names=file,
        match=r"'w'.*1 NaN/Inf.*flat index 17",
    )


def test_check_finite_large_tensor_spans_chunks(tmp_path: Path) -> None:
    values = torch.zeros(600_000, dtype=torch.bfloat16)  # 1.2 MB: more than one read chunk
    values[-1] = float("inf")
    file = tmp_path / "big.safetensors"
    save_file({"w": values}, file)
    _bad(check_finite, file, read_safetensors_header(file), names=file, match="flat index 599999")


# ---------------------------------------------------------------------------------------------
# Base model
# ---------------------------------------------------------------------------------------------


def test_resolve_local_base(work: Path, base: BaseInfo) -> None:
    folder = (work / "base").resolve()
    assert base.folder == folder
    assert base.source == "base" and base.revision is None
    assert base.config["hidden_size"] == 32
    assert base.weight_files == (folder / "model.safetensors",)
    assert base.tensors["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)
    assert base.tensors["lm_head.weight"].dtype == "F32"
    assert base.content_hash == sha256_files([folder / "config.json", folder / "model.safetensors"])
    # An absolute path is used as is.
    assert resolve_base(str(folder), "main", Path("/nonexistent")).revision == "main"


def test_resolve_sharded_base(work: Path, base: BaseInfo) -> None:
    sharded = resolve_base("sharded", None, work)
    assert len(sharded.weight_files) > 1
    assert {n: (t.dtype, t.shape) for n, t in sharded.tensors.items()} == {
        n: (t.dtype, t.shape) for n, t in base.tensors.items()
    }


def _edit_index(folder: Path, edit: Callable[[dict], None]) -> Path:
    file = folder / "model.safetensors.index.json"
    index = json.loads(file.read_text())
    edit(index["weight_map"])
    file.write_text(json.dumps(index))
    return file


def test_sharded_base_defects(work: Path, tmp_path: Path) -> None:
    def fresh() -> Path:
        target = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        return Path(shutil.copytree(work / "sharded", target))

    folder = fresh()
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()
    index = folder / "model.safetensors.index.json"
    _bad(
        resolve_base,
        str(folder),
        None,
        tmp_path,
        names=index,
        match="names shard .* which is missing",
    )

    folder = fresh()
    index = _edit_index(folder, lambda m: m.update({"ghost.weight": next(iter(m.values()))}))
    _bad(
        resolve_base,
        str(folder),
        None,
        tmp_path,
        names=index,
        match="absent from their shard.*'ghost.weight'",
    )

    folder = fresh()
    index = _edit_index(folder, lambda m: m.pop("model.norm.weight"))
    _bad(
        resolve_base,
        str(folder),
        None,
        tmp_path,
        names="model-",
        match="'model.norm.weight' is not mapped",
    )

    folder = fresh()
    index = _edit_index(folder, lambda m: m.update({"model.norm.weight": "../evil.safetensors"}))
    _bad(resolve_base, str(folder), None, tmp_path, names=index, match="outside the model folder")

    folder = fresh()
    index = folder / "model.safetensors.index.json"
    index.write_text('{"weight_map": []}')
    _bad(resolve_base, str(folder), None, tmp_path, names=index, match="weight_map")

    folder = fresh()
    shard = sorted(folder.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    _bad(resolve_base, str(folder), None, tmp_path, names=shard, match="truncated")


def test_base_folder_defects(work: Path, tmp_path: Path) -> None:
    _bad(resolve_base, "./missing", None, tmp_path, names=tmp_path / "missing", match="not found")
    _bad(resolve_base, "", None, tmp_path, names="base", match="no base model")

    (tmp_path / "file").write_text("x")
    _bad(resolve_base, "file", None, tmp_path, names=tmp_path / "file", match="is a file")

    no_config = Path(shutil.copytree(work / "base", tmp_path / "no_config"))
    (no_config / "config.json").unlink()
    _bad(
        resolve_base, "no_config", None, tmp_path, names=no_config / "config.json", match="missing"
    )

    bad_json = Path(shutil.copytree(work / "base", tmp_path / "bad_json"))
    (bad_json / "config.json").write_text('{\n  "hidden_size": 32,\n  oops\n}')
    _bad(
        resolve_base,
        "bad_json",
        None,
        tmp_path,
        names=bad_json / "config.json",
        match="line 3 column 3",
    )

    not_object = Path(shutil.copytree(work / "base", tmp_path / "not_object"))
    (not_object / "config.json").write_text("[1]")
    _bad(resolve_base, "not_object", None, tmp_path, names="config.json", match="JSON object")

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(work / "base" / "config.json", pickled)
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    _bad(
        resolve_base,
        "pickled",
        None,
        tmp_path,
        names=pickled,
        match="only pickle weights.*pytorch_model.bin",
    )

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(work / "base" / "config.json", empty)
    (empty / "consolidated.safetensors").write_bytes(b"")
    _bad(
        resolve_base,
        "empty",
        None,
        tmp_path,
        names=empty,
        match="no model.safetensors.*consolidated",
    )

    corrupt = Path(shutil.copytree(work / "base", tmp_path / "corrupt"))
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _bad(resolve_base, "corrupt", None, tmp_path, names=weights)


def test_hub_id_unreachable_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time, and transformers imported it already.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    message = _bad(
        resolve_base,
        "adapterpack-tests/no-such-model",
        None,
        tmp_path,
        names="base 'adapterpack-tests/no-such-model'",
        match="cannot download from the Hugging Face hub .*: use a local folder",
    )
    assert str(tmp_path / "adapterpack-tests" / "no-such-model") in message


def test_hub_id_downloads(work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict] = []

    def fake_snapshot_download(**kwargs: Any) -> str:
        calls.append(kwargs)
        return str(work / "base")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    info = resolve_base("someone/tiny-llama", "abc123", tmp_path)
    assert calls == [
        dict(
            repo_id="someone/tiny-llama",
            revision="abc123",
            allow_patterns=["*.json", "*.safetensors", "tokenizer*"],
        )
    ]
    assert info.source == "someone/tiny-llama" and info.revision == "abc123"
    assert info.tensors.keys() == resolve_base("base", None, work).tensors.keys()

    # A pickle-only hub repo arrives with no weights at all (*.bin is not downloaded).
    only_config = tmp_path / "snapshot"
    only_config.mkdir()
    shutil.copy(work / "base" / "config.json", only_config)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **_: str(only_config))
    _bad(resolve_base, "someone/pickled", None, tmp_path, names=only_config, match="pickle")


# ---------------------------------------------------------------------------------------------
# Adapters: valid ones
# ---------------------------------------------------------------------------------------------


def test_valid_lora(work: Path, base: BaseInfo) -> None:
    info = inspect_adapter(work / "lora", base)
    assert isinstance(info, AdapterInfo)
    assert info.target_modules == tuple(
        f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")
    )
    assert not info.uses_dora and info.modules_to_save == () and info.warnings == ()
    assert info.weight_file == work / "lora" / "adapter_model.safetensors"
    assert info.tensors[f"{Q0}.lora_A.weight"].shape == (4, 32)
    assert info.config["peft_type"] == "LORA"
    assert info.content_hash == sha256_files(
        [work / "lora" / "adapter_config.json", info.weight_file]
    )


def test_valid_dora_bias_embedding(work: Path, base: BaseInfo) -> None:
    dora = inspect_adapter(work / "dora", base)
    assert dora.uses_dora and len(dora.target_modules) == 2

    assert inspect_adapter(work / "bias", base).target_modules == (Q0[17:], Q1[17:])

    embed = inspect_adapter(work / "embed", base)
    assert "model.embed_tokens" in embed.target_modules
    # peft also saves the frozen embedding as "embed_tokens.base_layer.weight": no replacement.
    assert embed.modules_to_save == ("lm_head",)


@pytest.mark.parametrize("name", ["rank_suffix", "rank_regex"])
def test_rank_pattern_respected(work: Path, base: BaseInfo, tmp_path: Path, name: str) -> None:
    inspect_adapter(work / name, base)
    # Without the rank_pattern the same weights contradict the config's r.
    folder = Path(shutil.copytree(work / name, tmp_path / name))
    _edit_config(folder, lambda c: c.update(rank_pattern={}))
    _bad(
        inspect_adapter,
        folder,
        base,
        names=folder / "adapter_model.safetensors",
        match=r"rank 4 from adapter_config.json",
    )


def test_rank_pattern_invalid_regex(lora: Path, base: BaseInfo) -> None:
    config = _edit_config(lora, lambda c: c.update(rank_pattern={"q_proj(": 2}))
    _bad(inspect_adapter, lora, base, names=config, match="not a valid regular expression")


def test_base_name_warning(lora: Path, base: BaseInfo) -> None:
    _edit_config(lora, lambda c: c.update(base_model_name_or_path="meta-llama/Llama-3.2-1B"))
    (warning,) = inspect_adapter(lora, base).warnings
    assert "meta-llama/Llama-3.2-1B" in warning and "adapter_config.json" in warning

    _edit_config(lora, lambda c: c.update(base_model_name_or_path="/elsewhere/models/base/"))
    assert inspect_adapter(lora, base).warnings == ()


def test_tied_lm_head(tmp_path: Path) -> None:
    # transformers does not store a tied lm_head; LoRA on it must be checked against the embedding.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
        model = peft.get_peft_model(
            _tiny_llama(tie_word_embeddings=True),
            peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"]),
        )
        model.save_pretrained(tmp_path / "lora")
    tied = resolve_base("tied", None, tmp_path)
    assert "lm_head.weight" not in tied.tensors
    assert "lm_head" in inspect_adapter(tmp_path / "lora", tied).target_modules


def test_fan_in_fan_out_conv1d(tmp_path: Path) -> None:
    # GPT-2's Conv1D stores weights as (in, out); peft marks such adapters with fan_in_fan_out.
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
        model = peft.get_peft_model(
            transformers.GPT2LMHeadModel(config),
            peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True),
        )
        model.save_pretrained(tmp_path / "lora")
    gpt2 = resolve_base("gpt2", None, tmp_path)
    assert gpt2.tensors["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert inspect_adapter(tmp_path / "lora", gpt2).target_modules == (
        "transformer.h.0.attn.c_attn",
    )


def test_unreadable_path_is_bad_input(
    tmp_path: Path, base: BaseInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests run as root here, so a permission error is simulated rather than made with chmod.
    locked = tmp_path / "locked"

    def denied(self: Path, *args: Any, **kwargs: Any) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "exists", denied)
    _bad(resolve_base, "locked", None, tmp_path, names=locked, match="Permission denied")
    _bad(inspect_adapter, locked, base, names=locked, match="Permission denied")


# ---------------------------------------------------------------------------------------------
# Adapters: defects
# ---------------------------------------------------------------------------------------------


def test_adapter_folder_and_config_defects(lora: Path, base: BaseInfo, tmp_path: Path) -> None:
    _bad(inspect_adapter, tmp_path / "nope", base, names=tmp_path / "nope", match="not found")
    (tmp_path / "f").write_text("x")
    _bad(inspect_adapter, tmp_path / "f", base, names=tmp_path / "f", match="is a file")

    config = lora / "adapter_config.json"
    text = config.read_text()
    config.write_text('{\n"r": 4,,\n}')
    _bad(inspect_adapter, lora, base, names=config, match="invalid JSON at line 2 column 8")
    config.write_text(text)

    _edit_config(lora, lambda c: c.update(peft_type="IA3"))
    _bad(inspect_adapter, lora, base, names=config, match="'IA3' is not supported; supported: LORA")
    _edit_config(lora, lambda c: c.pop("peft_type"))
    _bad(inspect_adapter, lora, base, names=config, match="None is not supported")
    config.write_text(text)

    _edit_config(lora, lambda c: c.update(r=0))
    _bad(inspect_adapter, lora, base, names=config, match="'r' must be a positive integer")
    config.write_text(text)

    config.unlink()
    _bad(inspect_adapter, lora, base, names=config, match="missing")


def test_adapter_without_weights(lora: Path, base: BaseInfo) -> None:
    (lora / "adapter_model.safetensors").unlink()
    _bad(inspect_adapter, lora, base, names=lora, match="no adapter_model.safetensors")


def test_pickle_adapter(lora: Path, base: BaseInfo) -> None:
    st_file = lora / "adapter_model.safetensors"
    state = load_file(st_file)
    st_file.unlink()
    bin_file = lora / "adapter_model.bin"
    torch.save(state, bin_file)
    _bad(
        inspect_adapter,
        lora,
        base,
        names=bin_file,
        match="pickle weights can run code; convert to safetensors or pass --allow-pickle",
    )

    info = inspect_adapter(lora, base, allow_pickle=True)
    assert info.weight_file == bin_file
    assert len(info.target_modules) == 4
    assert info.tensors[f"{Q0}.lora_A.weight"] == TensorInfo("F32", (4, 32), bin_file)

    state[f"{Q1}.lora_B.weight"][0, 0] = float("nan")
    torch.save(state, bin_file)
    _bad(inspect_adapter, lora, base, allow_pickle=True, names=bin_file, match="NaN/Inf")

    bin_file.write_bytes(b"garbage")
    _bad(inspect_adapter, lora, base, allow_pickle=True, names=bin_file, match="cannot load pickle")


def test_truncated_adapter(lora: Path, base: BaseInfo) -> None:
    file = lora / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-7])
    _bad(inspect_adapter, lora, base, names=file, match="truncated")


def test_nan_in_adapter(lora: Path, base: BaseInfo) -> None:
    file = _edit_tensors(
        lora, lambda t: t[f"{Q1}.lora_B.weight"].view(-1).__setitem__(5, float("nan"))
    )
    _bad(inspect_adapter, lora, base, names=file, match=rf"'{Q1}.lora_B.weight'.*NaN/Inf")


def test_bf16_adapter(lora: Path, base: BaseInfo) -> None:
    def to_bf16(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].to(torch.bfloat16)

    file = _edit_tensors(lora, to_bf16)
    info = inspect_adapter(lora, base)
    assert {t.dtype for t in info.tensors.values()} == {"BF16"}

    _edit_tensors(lora, lambda t: t[f"{Q0}.lora_A.weight"].view(-1).__setitem__(3, float("-inf")))
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=rf"'{Q0}.lora_A.weight' \(BF16 \(4, 32\)\).*flat index 3",
    )


def test_adapter_for_other_base_shape(work: Path, base48: BaseInfo) -> None:
    file = work / "lora" / "adapter_model.safetensors"
    _bad(
        inspect_adapter,
        work / "lora",
        base48,
        names=file,
        match=r"8 of 8 adapter tensor\(s\) do not apply to base 'base48'; .*expected \(4, 48\)",
    )


def test_target_module_absent_from_base(lora: Path, base: BaseInfo) -> None:
    def move(tensors: dict[str, torch.Tensor]) -> None:
        for part in ("lora_A", "lora_B"):
            tensors[f"{Q1.replace('layers.1', 'layers.7')}.{part}.weight"] = tensors.pop(
                f"{Q1}.{part}.weight"
            )

    file = _edit_tensors(lora, move)
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=r"2 of 8 .*first: .*layers\.7\.self_attn\.q_proj\.lora_A\.weight: "
        r"module .* has no weight in the base",
    )


def test_lora_a_without_b(lora: Path, base: BaseInfo) -> None:
    file = _edit_tensors(lora, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=rf"1 of 7 .*{Q0}.lora_A.weight: has no matching lora_B.weight",
    )
    # Both kinds of orphan are counted; the first reported follows the file's key order.
    file = _edit_tensors(lora, lambda t: t.pop(f"{Q1}.lora_A.weight"))
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=rf"2 of 6 .*{Q0}.lora_A.weight: has no matching lora_B",
    )


def test_lora_b_without_a(lora: Path, base: BaseInfo) -> None:
    file = _edit_tensors(lora, lambda t: t.pop(f"{Q1}.lora_A.weight"))
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=rf"1 of 7 .*{Q1}.lora_B.weight: has no matching lora_A.weight",
    )


def test_inconsistent_rank_between_a_and_b(lora: Path, base: BaseInfo) -> None:
    file = _edit_tensors(lora, lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(32, 3)}))
    _bad(
        inspect_adapter,
        lora,
        base,
        names=file,
        match=r"lora_B.weight: shape \(32, 3\), expected \(32, 4\)",
    )


def test_foreign_keys(lora: Path, base: BaseInfo) -> None:
    file = _edit_tensors(
        lora,
        lambda t: t.update({"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}),
    )
    _bad(inspect_adapter, lora, base, names=file, match="does not start with 'base_model.model.'")

    file = _edit_tensors(
        lora,
        lambda t: (
            t.pop("model.layers.0.self_attn.q_proj.lora_A.weight"),
            t.update({"base_model.model.model.norm.weight": torch.ones(32)}),
        ),
    )
    _bad(inspect_adapter, lora, base, names=file, match="'model.norm' is not in modules_to_save")


def test_modules_to_save_shape_mismatch(work: Path, tmp_path: Path, base: BaseInfo) -> None:
    folder = Path(shutil.copytree(work / "embed", tmp_path / "embed"))
    file = _edit_tensors(
        folder, lambda t: t.update({"base_model.model.lm_head.weight": torch.zeros(65, 32)})
    )
    _bad(inspect_adapter, folder, base, names=file, match="vocabulary resized")


def test_dora_flags_must_match_weights(work: Path, tmp_path: Path, base: BaseInfo) -> None:
    folder = Path(shutil.copytree(work / "dora", tmp_path / "dora"))
    _edit_config(folder, lambda c: c.update(use_dora=False))
    _bad(
        inspect_adapter,
        folder,
        base,
        names=folder / "adapter_model.safetensors",
        match="use_dora false",
    )

    _edit_config(folder, lambda c: c.update(use_dora=True))
    file = _edit_tensors(folder, lambda t: t.pop(f"{Q0}.lora_magnitude_vector"))
    _bad(inspect_adapter, folder, base, names=file, match="no lora_magnitude_vector")


def test_lora_bias_flag_must_match_weights(work: Path, tmp_path: Path, base: BaseInfo) -> None:
    folder = Path(shutil.copytree(work / "bias", tmp_path / "bias"))
    _edit_config(folder, lambda c: c.update(lora_bias=False))
    _bad(
        inspect_adapter,
        folder,
        base,
        names=folder / "adapter_model.safetensors",
        match="lora_bias false",
    )


# ---------------------------------------------------------------------------------------------
# Fuzzing: a damaged file is either still valid or a BadInput, never another exception
# ---------------------------------------------------------------------------------------------


def _fuzz_seed() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "seed.safetensors"
        save_file(
            {
                "a": torch.tensor([1.0, -2.0], dtype=torch.float32),
                "b": torch.tensor([[0.5, 3.0]], dtype=torch.bfloat16),
                "c": torch.tensor([7.0], dtype=torch.float16),
                "d": torch.tensor([1, 2, 3], dtype=torch.int8),
            },
            file,
            metadata={"format": "pt"},
        )
        return file.read_bytes()


SEED = _fuzz_seed()
HEADER_END = 8 + struct.unpack("<Q", SEED[:8])[0]

mutations = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, len(SEED) - 1)),
    st.tuples(
        st.just("header"),
        st.lists(
            st.tuples(st.integers(0, HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=4
        ),
    ),
    st.tuples(
        st.just("anywhere"),
        st.lists(
            st.tuples(st.integers(0, len(SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8
        ),
    ),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=16)),
)


def _mutate(data: bytes, mutation: tuple[str, Any]) -> bytes:
    kind, arg = mutation
    if kind == "truncate":
        return data[:arg]
    if kind == "append":
        return data + arg
    out = bytearray(data)
    for index, value in arg:
        out[index] = value
    return bytes(out)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=100, deadline=None)
@given(mutation=mutations)
def test_mutated_safetensors_never_crash(fuzz_dir: Path, mutation: tuple[str, Any]) -> None:
    file = fuzz_dir / "mutated.safetensors"
    file.write_bytes(_mutate(SEED, mutation))
    try:
        tensors = read_safetensors_header(file)
    except BadInput as exc:
        assert "\n" not in str(exc) and str(file) in str(exc)
        return
    # Whatever we accept, the real reader must accept with the same layout.
    with safe_open(file, "np") as f:
        assert set(f.keys()) == set(tensors)
        for name, info in tensors.items():
            assert tuple(f.get_slice(name).get_shape()) == info.shape
            assert f.get_slice(name).get_dtype() == info.dtype
    try:
        check_finite(file, tensors)
    except BadInput as exc:
        assert "NaN/Inf" in str(exc) and str(file) in str(exc)


def test_fuzz_seed_is_valid(tmp_path: Path) -> None:
    file = tmp_path / "seed.safetensors"
    file.write_bytes(SEED)
    tensors = read_safetensors_header(file)
    check_finite(file, tensors)
    assert np.prod(tensors["b"].shape) == 2
