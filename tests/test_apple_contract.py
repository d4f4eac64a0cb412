"""Apple's Core AI runtime contract (``export.contract: apple``): the asset's signature is the one
Apple's Swift engines take, and a Python engine written from their source, call for call, runs
every function on Core AI's runtime as the unmerged peft reference computes it."""

from __future__ import annotations

import numpy as np
import pytest

from adapterpack.assemble.pipeline import build
from adapterpack.assemble.records import BuildOptions
from adapterpack.errors import BadInput
from adapterpack.formats.aimodel.engine import PipelinedEngine, SequentialEngine, check_signature
from adapterpack.verification.drives import APPLE_DRIVES, run_drive, verification_tokens
from adapterpack.verification.reference import random_references
from adapterpack.verification.runners import function_sessions
from factories import FAMILIES, make_family_project, make_project, run_cli
from test_coreai import assert_exact


def _apple_asset(root, family: str, compute: str):
    manifest = make_family_project(root, family)
    text = manifest.read_text().replace(
        "export: {max_context: 40}",
        f"export: {{max_context: 40, format: aimodel, compute_precision: {compute}, contract: apple}}",
    )
    manifest.write_text(text)
    return build(manifest, options=BuildOptions(use_cache=False))


@pytest.fixture(scope="session")
def apple_asset(tmp_path_factory):
    """The llama family project (fused, kept, rsLoRA, MLP, zero-B control, base) as one .aimodel
    of Apple's contract computing in float32, built and verified once."""
    return _apple_asset(tmp_path_factory.mktemp("apple-llama"), "llama", "float32")


def _assert_exact(result):
    report = result.verify_report
    assert report.passed, report.verdict()
    assert_exact(result, drives=APPLE_DRIVES)


def test_every_function_runs_on_the_emulated_engine_as_peft_computes_it(apple_asset):
    _assert_exact(apple_asset)
    by_name = {f.name: f for f in apple_asset.verify_report.functions}
    # The negative control: lora_B = 0 leaves the base; a random adapter moves the logits.
    assert by_name["zero"].adapter_effect == 0.0
    assert by_name["rs"].adapter_effect > 0.01 and by_name["rs"].retention > 0.999
    assert by_name["kept"].retention > 0.999


def test_the_signature_is_the_one_apple_s_engine_takes(apple_asset):
    """Read from the asset as the runtime reads it: two Int32 inputs (1, ?), the logits float16
    first, two float16 caches whose sequence axis (3) is the only dynamic one."""
    from adapterpack.formats.aimodel.asset import CONTRACT_KEY, asset_functions

    listed = asset_functions(apple_asset.output)
    assert listed.metadata[CONTRACT_KEY] == "apple"
    for function in listed.functions:
        assert [(f.name, f.dtype, f.shape) for f in function.inputs] == [
            ("input_ids", "int32", "(1, ?)"), ("position_ids", "int32", "(1, ?)")
        ]
        assert [(f.name, f.dtype) for f in function.outputs] == [("logits", "float16")]
        assert function.outputs[0].shape.startswith("(1, ?, ")
        assert [f.name for f in function.states] == ["key_cache", "value_cache"]
        for state in function.states:
            dims = state.shape.strip("()").split(", ")
            assert state.dtype == "float16" and len(dims) == 5 and dims[3] == "?" and "?" not in dims[:3] + dims[4:]
        check_signature(function.name, *[[(f.name, f.dtype, f.shape) for f in kind] for kind in (function.inputs, function.outputs, function.states)])


@pytest.mark.parametrize("engine", ["pipelined", "sequential"])
def test_caches_grown_from_two_slots_give_the_same_logits(apple_asset, engine):
    """The runtime grows the caches by copying their filled prefix into arrays it does not zero
    (NaN here): a function must read only the slots its calls wrote, whatever the capacity (the
    pipelined engine's also hold its warmup call's)."""
    checked_manifest = apple_asset.manifest
    from adapterpack.inputs.checked import check_inputs

    checked = check_inputs(checked_manifest)
    tokens = verification_tokens(int(checked.base.config["vocab_size"]), checked_manifest.verify)
    sessions = function_sessions(apple_asset.output)
    small = sessions("rs")(engine=engine, initial_capacity=2)
    grown = run_drive(small, tokens, 9, "apple-chunked")
    capacity, doublings = 2, 0
    while capacity < len(tokens):
        capacity, doublings = capacity * 2, doublings + 1
    assert doublings >= 3 and (small.engine.grown, small.engine.capacity) == (doublings, capacity)
    whole = run_drive(sessions("rs")(), tokens, 9, "apple")
    assert np.isfinite(grown).all()
    np.testing.assert_allclose(grown, whole, atol=2e-3)
    _, _, references = random_references(checked, ["rs"])
    reference = references["rs"][: len(tokens)]
    cosine = float((grown * reference).sum() / np.linalg.norm(grown) / np.linalg.norm(reference))
    assert cosine >= 0.9999


class _Recorder:
    """A function that records what the engine sends it and answers one-hot logits of the last
    position id, writing each call's position into the first cache slot it covers."""

    def __init__(self, vocab: int = 8):
        self.calls: list[tuple[np.ndarray, np.ndarray, int]] = []
        self.vocab = vocab

    def __call__(self, inputs, states):
        ids, positions = inputs["ids"], inputs["positions"]
        cache = states["key_cache"]
        self.calls.append((ids.copy(), positions.copy(), cache.shape[3]))
        start = positions.shape[1] - ids.shape[1]
        cache[:, :, :, start : positions.shape[1], :] = np.arange(start, positions.shape[1])[None, None, None, :, None]
        written = cache[0, 0, 0, : positions.shape[1], 0]
        assert np.isfinite(written).all(), "a slot no call wrote was read"
        return np.eye(self.vocab, dtype=np.float16)[positions[0, start:] % self.vocab][None]


def _engine(recorder, max_context=1500, **options):
    shapes = {"key_cache": (2, 1, 1, -1, 4), "value_cache": (2, 1, 1, -1, 4)}
    return SequentialEngine(recorder, shapes, max_context=max_context, **options)


def test_the_engine_sends_what_the_swift_engine_sends():
    recorder = _Recorder()
    engine = _engine(recorder)
    engine.prefill(np.arange(5))
    engine.process([7])
    (ids, positions, capacity), (step, step_positions, _) = recorder.calls
    assert ids.dtype == np.int32 and ids.shape == (1, 5) and capacity == 256
    np.testing.assert_array_equal(positions, np.arange(5)[None])
    np.testing.assert_array_equal(step, [[7]])
    np.testing.assert_array_equal(step_positions, np.arange(6)[None])
    assert engine.processed == 6


def test_a_long_prompt_is_chunked_and_the_caches_double_up_to_the_maximum():
    recorder = _Recorder()
    engine = _engine(recorder, max_context=1500)
    logits = engine.prefill(np.zeros(1100, np.int32))  # past chunkThreshold (1024): chunks of 512
    assert [ids.shape[1] for ids, _, _ in recorder.calls] == [512, 512, 76]
    assert [capacity for _, _, capacity in recorder.calls] == [512, 1024, 1500]  # 256 doubled, then the maximum
    assert logits.shape == (1100, 8)
    np.testing.assert_array_equal(logits.argmax(-1), np.arange(1100) % 8)
    kept = engine._read(engine._arrays["key_cache"])[0, 0, 0, :1100, 0]
    np.testing.assert_array_equal(kept, np.arange(1100))  # every grown copy kept the filled prefix
    with pytest.raises(BadInput, match="exceeds the maximum 1500"):
        engine.process(np.zeros(401, np.int32))


def test_the_pipelined_engine_warms_up_and_keeps_a_prefix():
    """The GPU engine's caches start at 256 slots whatever the maximum context; warmup leaves its
    call's slot written and the count at 0; ``generate`` grows once for prompt + tokens, sends
    the previous argmax and stops at the maximum; ``reset_to`` keeps a prefix."""
    recorder = _Recorder()
    shapes = {"key_cache": (2, 1, 1, -1, 4), "value_cache": (2, 1, 1, -1, 4)}
    engine = PipelinedEngine(recorder, shapes, max_context=40)
    assert engine.capacity == 256 and engine.sequence_axis == 3
    engine.warmup()
    (ids, positions, _), = recorder.calls
    np.testing.assert_array_equal(ids, [[1]])
    np.testing.assert_array_equal(positions, [[0]])
    assert engine.processed == 0
    rows, generated = engine.generate([3, 4, 5], max_tokens=4)
    assert generated == [2, 3, 4, 5]  # the recorder's logits are one-hot at each row's position
    assert [c[0].tolist() for c in recorder.calls[1:]] == [[[3, 4, 5]], [[2]], [[3]], [[4]]]
    assert [c[1].shape[1] for c in recorder.calls[1:]] == [3, 4, 5, 6] and rows.shape == (6, 8)
    engine.reset_to(2)
    engine.process([9])
    np.testing.assert_array_equal(recorder.calls[-1][1], np.arange(3)[None])
    with pytest.raises(ValueError, match="out of range"):
        engine.reset_to(4)
    with pytest.raises(BadInput, match="no room"):
        engine.generate(np.zeros(37, np.int32), max_tokens=1)
    small = PipelinedEngine(_Recorder(), shapes, max_context=1500, initial_capacity=2)
    small.generate(np.zeros(5, np.int32), max_tokens=100)
    assert (small.grown, small.capacity) == (1, 128)  # once, for 105 slots: 2 doubled six times


def test_a_conversation_kept_as_a_prefix_is_computed_as_a_fresh_one(apple_asset):
    """What ``LanguageModelSession`` does between turns on the pipelined engine: warmup, a first
    turn, ``reset(to:)`` back into it, then new tokens. Every logit of the new tokens equals a
    fresh session's over the same sequence (float32 compute)."""
    sessions = function_sessions(apple_asset.output)
    first = sessions("rs")()
    engine = first.engine
    history = [5, 17, 33, 2, 8]
    _, generated = engine.generate(history, max_tokens=6)
    assert engine.processed == 10  # the last token generated is not sent
    engine.reset_to(7)  # the prompt and the first two tokens generated
    continued = engine.prefill([11, 12])  # slot 9 still holds the first turn's last key and value
    fresh = sessions("rs")(engine="sequential").engine
    whole = fresh.prefill(history + generated[:2] + [11, 12])
    assert np.isfinite(continued).all()
    np.testing.assert_allclose(continued, whole[-2:], atol=1e-4)


def test_a_signature_apple_s_engine_refuses_is_bad_input():
    ids = ("input_ids", "int32", "(1, ?)")
    positions = ("position_ids", "int32", "(1, ?)")
    logits = [("logits", "float16", "(1, ?, 8)")]
    caches = [("key_cache", "float16", "(2, 1, 1, ?, 4)"), ("value_cache", "float16", "(2, 1, 1, ?, 4)")]
    check_signature("f", [ids, positions], logits, caches)
    with pytest.raises(BadInput, match="2 inputs"):
        check_signature("f", [ids, positions, ("causalMask", "float16", "(1, 1, ?, ?)")], logits, caches)
    with pytest.raises(BadInput, match="float16 logits"):
        check_signature("f", [ids, positions], [("logits", "float32", "(1, ?, 8)")], caches)
    with pytest.raises(BadInput, match="2 to 4 states"):
        check_signature("f", [ids, positions], logits, caches + caches[:1] * 3)
    with pytest.raises(BadInput, match="Int32"):
        check_signature("f", [ids, ("position_ids", "float16", "(1, ?)")], logits, caches)


def test_the_contract_is_refused_where_it_cannot_apply(tmp_path):
    root = make_project(tmp_path, "name: f\nbase: {path: base}\ninclude_base: base\nexport: {max_context: 32}\n", {})
    manifest = root / "m.yaml"
    bogus = run_cli("build", manifest, "--format", "aimodel", "--contract", "coreml")
    assert bogus.returncode == 2 and "--contract 'coreml'" in bogus.stderr
    mlpackage = run_cli("build", manifest, "--contract", "apple")
    assert mlpackage.returncode == 2 and "contract apple applies to format aimodel" in mlpackage.stderr
    manifest.write_text("name: f\nbase: {path: base}\ninclude_base: base\nexport: {contract: apple}\n")
    written = run_cli("validate", manifest)
    assert written.returncode == 2 and "contract apple applies to format aimodel" in written.stderr and "m.yaml:4" in written.stderr
    assert not (root / "build").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_runs_under_apple_s_contract(tmp_path, family):
    _assert_exact(_apple_asset(tmp_path, family, "float32"))


@pytest.fixture(scope="session")
def apple_release(tmp_path_factory):
    """The llama family project released for Apple's runtime (float32 compute)."""
    from adapterpack.distribution.artifacts import release
    from test_generate import write_byte_level_tokenizer

    root = tmp_path_factory.mktemp("apple-release")
    manifest = make_family_project(root, "llama")
    write_byte_level_tokenizer(root / "base")
    manifest.write_text(manifest.read_text().replace(
        "export: {max_context: 40}", "export: {max_context: 40, format: aimodel, compute_precision: float32}"
    ))
    return manifest, release(manifest, root / "dist", options=BuildOptions(contract="apple"))


@pytest.mark.slow
def test_a_release_has_a_bundle_per_function_that_runs_as_peft_computes(apple_release):
    """Each bundle folder, loaded as ``LanguageBundle`` reads it, names the shared asset and its
    function; the emulated engine runs that function there as the unmerged peft reference does."""
    import json

    from adapterpack.formats.aimodel.bundle import BundleMetadata, load_bundle
    from adapterpack.inputs.checked import check_inputs

    manifest, released = apple_release
    checked = check_inputs(manifest)
    folder = released.bundle
    asset = folder / f"{checked.manifest.name}.aimodel"
    names = list(checked.manifest.function_names)
    tokens = verification_tokens(int(checked.base.config["vocab_size"]), checked.manifest.verify)
    _, base_reference, references = random_references(checked, [n for n in names if n != "base"])
    references["base"] = base_reference
    sums = (released.sums).read_text()
    for function in names:
        BundleMetadata.model_validate(json.loads((folder / function / "metadata.json").read_text()))
        found, runs, max_context, tokenizer = load_bundle(folder / function)
        assert (found, runs, max_context) == (asset.resolve(), function, 40)
        assert tokenizer is not None and (tokenizer / "tokenizer_config.json").is_file()
        assert f"{folder.name}/{function}/metadata.json" in sums
        got = run_drive(function_sessions(found)(runs)(), tokens, 9, "apple")
        reference = references[function][: len(tokens)]
        cosine = float((got * reference).sum() / np.linalg.norm(got) / np.linalg.norm(reference))
        assert cosine >= 0.9999, (function, cosine)
    assert sorted(p.name for p in folder.glob("*.aimodel")) == [asset.name]  # one asset, shared
    assert "CoreAILanguageModel(resourcesAt: url)" in (folder / "README.md").read_text()


def test_the_bundle_schema_refuses_what_the_swift_decoders_refuse(tmp_path):
    import json

    from adapterpack.formats.aimodel.bundle import bundle_metadata_schema, load_bundle

    schema = bundle_metadata_schema()
    assert set(schema["required"]) == {"metadata_version", "kind", "name", "assets", "language"}
    (tmp_path / "x.aimodel").mkdir()
    good = {
        "metadata_version": "0.2", "kind": "llm", "name": "n", "assets": {"main": "../x.aimodel"},
        "language": {"tokenizer": "t", "vocab_size": 8, "max_context_length": 16, "function_map": {"main": ["f"]}},
        "something_new": 1,  # Swift's decoders ignore keys they do not know
    }
    bundle = tmp_path / "f"
    bundle.mkdir()
    (bundle / "metadata.json").write_text(json.dumps(good))
    assert load_bundle(bundle)[1:3] == ("f", 16)
    for broken, reason in [
        ({**good, "metadata_version": "0.1"}, "metadata_version"),
        ({**good, "kind": "diffusion"}, "expected bundle kind llm"),
        ({k: v for k, v in good.items() if k != "language"}, "language"),
        ({**good, "assets": {}}, "assets.main"),
        ({**good, "assets": {"main": "../missing.aimodel"}}, "not found"),
        ({**good, "language": {**good["language"], "vocab_size": "8"}}, "language.vocab_size"),
    ]:
        (bundle / "metadata.json").write_text(json.dumps(broken))
        with pytest.raises(BadInput, match=reason):
            load_bundle(bundle)
