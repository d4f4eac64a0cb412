"""Hostile input, third round: nothing an input holds is lost or leaked, nothing silently wrong.

Each class of the round by its mechanism: one overlap rule for every writer (build, parts, merge,
release, the build cache), cache commands that act only on a marked cache, a release that copies
only regular files from inside its inputs, a base checked against the weights its family reads,
strict JSON, one rule for names, one-line errors for every bad argument. Property-based where it
fits (names, numbers, paths, links); a fault injected at random points of every writer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapterpack.errors import BadInput
from factories import invoke_cli, make_demo_project, run_cli, run_with_fault

MANIFEST = (
    "name: d\nbase: {path: base}\nadapters: [{name: zen, path: zen}]\ninclude_base: base\n"
    "export: {max_context: 32}\ncompression: {method: none}\nverify: {prefill: 6, decode_steps: 2}\n"
)


def _snapshot(root: Path) -> dict[str, object]:
    """Every file under ``root`` (bytes, or where a link points), skipping what a command may
    write: build outputs, release folders, caches, staging."""
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_file():
            found[name] = path.read_bytes()
    return found


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """The demo's base and zen skill with a float16 manifest, and a release of them in dist/."""
    root = make_demo_project(tmp_path_factory.mktemp("outputs"), MANIFEST)
    result = invoke_cli("release", root / "m.yaml", "--out-dir", root / "dist", "--quiet", "--no-cache")
    assert result.returncode == 0, result.stderr
    return root


@pytest.fixture
def project(pristine, tmp_path) -> Path:
    root = tmp_path / "p"
    shutil.copytree(pristine, root, symlinks=True)
    return root


def _one_error(result, code: int = 2) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code, result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# -- no output over, into or around an input -----------------------------------------------------


def test_release_force_never_replaces_an_adapter_folder_named_like_the_bundle(project):
    """The bundle folder is ``OUT/NAME``: with the manifest named like its adapter folder and
    --out-dir the project, it would be the adapter. Refused even with --force; nothing changes."""
    (project / "m.yaml").write_text(MANIFEST.replace("name: d", "name: zen"))
    before = _snapshot(project)
    error = _one_error(invoke_cli("release", project / "m.yaml", "--out-dir", project, "--force", "--quiet"))
    assert "is an input" in error and str(project / "zen") in error
    assert _snapshot(project) == before


def test_release_force_never_overwrites_a_manifest_named_like_a_release_file(project):
    (project / "m.yaml").rename(project / "SHA256SUMS")
    before = _snapshot(project)
    for force in ([], ["--force"]):
        error = _one_error(invoke_cli("release", project / "SHA256SUMS", "--out-dir", project, "--quiet", *force))
        assert "SHA256SUMS" in error
    assert _snapshot(project) == before


def test_release_force_replaces_an_earlier_release_but_never_a_foreign_file(project):
    dist = project / "dist"
    replaced = invoke_cli("release", project / "m.yaml", "--out-dir", dist, "--force", "--quiet", "--no-cache")
    assert replaced.returncode == 0, replaced.stderr
    (dist / "build-info.json").write_text("my own notes\n")
    before = _snapshot(project)
    error = _one_error(invoke_cli("release", project / "m.yaml", "--out-dir", dist, "--force", "--quiet"))
    assert "not a file of an earlier release" in error
    assert _snapshot(project) == before


@pytest.mark.parametrize("output", ["mini.zip", "mini", "zen/x.mlpackage", "base", ".adapterpack-cache/parts/x.mlpackage"])
def test_a_build_output_that_is_no_package_name_or_overlaps_is_refused(project, output):
    from adapterpack.assemble.cache import BuildCache

    BuildCache(project / ".adapterpack-cache").mark()
    before = _snapshot(project)
    error = _one_error(invoke_cli("build", project / "m.yaml", "-o", project / output, "--force", "--no-verify", "--quiet"))
    assert ("a package is a folder named" in error) or ("input" in error) or ("build cache" in error), error
    assert _snapshot(project) == before


def test_a_build_cache_that_is_an_input_is_refused(project):
    before = _snapshot(project)
    error = _one_error(invoke_cli("build", project / "m.yaml", "-o", project / "o.mlpackage", "--cache-dir", project / "zen", "--quiet"))
    assert "build cache" in error and "input" in error
    assert _snapshot(project) == before


def test_parts_and_merge_never_write_over_their_inputs(project):
    before = _snapshot(project)
    error = _one_error(invoke_cli("build", project / "m.yaml", "--function", "zen", "--parts", project / "base", "--quiet"))
    assert "parts folder" in error and "input" in error
    parts = project / "parts"
    for function in ("zen", "base"):
        made = invoke_cli("build", project / "m.yaml", "--function", function, "--parts", parts, "--quiet")
        assert made.returncode == 0, made.stderr
    error = _one_error(invoke_cli("merge", parts, "-o", parts / "x.mlpackage", "--force", "--quiet"))
    assert "parts are its input" in error
    assert {k: v for k, v in _snapshot(project).items() if not k.startswith("parts/")} == before


# -- the cache commands act only on a marked cache -----------------------------------------------


@pytest.mark.parametrize("command", [["info"], ["verify"], ["prune"], ["prune", "--max-size", "0"], ["prune", "--older-than", "0"]])
@pytest.mark.parametrize("folder", ["dist", "parts", "."])
def test_cache_commands_never_touch_a_folder_that_is_not_a_cache(project, command, folder):
    """`cache prune build` (the output folder), a --parts folder, a project: exit 2, nothing
    deleted, nothing listed as stale."""
    (project / "parts").mkdir()
    (project / "parts" / "zen.part.json").write_text("{}")
    (project / "calibration").mkdir()
    (project / "calibration" / "x.txt").write_text("text")
    before = _snapshot(project)
    error = _one_error(invoke_cli("cache", command[0], project / folder, *command[1:]))
    assert "not a build cache" in error
    assert _snapshot(project) == before


def test_a_build_marks_its_cache_and_the_commands_accept_it(project):
    cache = project / "build" / ".adapterpack-cache"
    built = invoke_cli("build", project / "m.yaml", "-o", project / "build" / "d.mlpackage", "--no-verify", "--quiet")
    assert built.returncode == 0, built.stderr
    assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert invoke_cli("cache", "verify", cache).returncode == 0
    assert invoke_cli("cache", "prune", cache, "--older-than", "0").returncode == 0
    assert (project / "build" / "d.mlpackage").is_dir()


# -- a release carries nothing from outside its inputs -------------------------------------------


@pytest.mark.parametrize("kind", ["outside link", "dangling link", "fifo", "outsized"])
def test_release_copies_only_regular_files_from_inside_the_base(project, tmp_path, kind):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0\n")
    target = project / "base" / "special_tokens_map.json"
    target.unlink(missing_ok=True)
    if kind == "outside link":
        target.symlink_to(secret)
    elif kind == "dangling link":
        target.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        with (project / "base" / "merges.txt").open("wb") as sparse:
            sparse.truncate(300 << 20)  # a 300 MB file that takes no disk
    before = _snapshot(project)
    out = tmp_path / "out"
    error = _one_error(invoke_cli("release", project / "m.yaml", "--out-dir", out, "--quiet", "--no-cache"))
    assert ("merges.txt" if kind == "outsized" else "special_tokens_map.json") in error
    assert not out.exists() or not any(out.rglob("*"))
    assert _snapshot(project) == before


def test_a_link_that_stays_inside_the_base_is_copied_as_its_file(project, tmp_path):
    shutil.copy(project / "base" / "tokenizer_config.json", project / "base" / "real_config.json")
    (project / "base" / "tokenizer_config.json").unlink()
    (project / "base" / "tokenizer_config.json").symlink_to("real_config.json")
    out = tmp_path / "out"
    made = invoke_cli("release", project / "m.yaml", "--out-dir", out, "--quiet", "--no-cache")
    assert made.returncode == 0, made.stderr
    copied = out / "d" / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_bytes() == (project / "base" / "real_config.json").read_bytes()


# -- silently wrong packages ---------------------------------------------------------------------


def _rewrite_base(base: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(base / "model.safetensors")
    change(tensors)
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "case, named",
    [
        ("missing up_proj", "model.layers.2.mlp.up_proj.weight"),
        ("untied without lm_head", "lm_head.weight"),
        ("another architecture's norms", "model.layers.0.pre_feedforward_layernorm.weight"),
    ],
)
def test_a_base_must_hold_exactly_the_weights_its_family_reads(project, case, named):
    """transformers fills a missing weight at random (and the reference shares it: verify would
    pass) and ignores one it does not read: both are refused before any work, naming the weight."""
    import torch

    if case == "missing up_proj":
        _rewrite_base(project / "base", lambda t: t.pop(named))
    elif case == "untied without lm_head":
        config = json.loads((project / "base" / "config.json").read_text())
        (project / "base" / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
        _rewrite_base(project / "base", lambda t: t.pop("lm_head.weight"))
    else:  # a Gemma-style checkpoint relabelled as a Llama: four norms per layer
        _rewrite_base(project / "base", lambda t: t.update({named: torch.ones(128)}))
    for command in ("validate", "build"):
        error = _one_error(invoke_cli(command, project / "m.yaml", *(["-o", project / "o.mlpackage"] if command == "build" else [])))
        assert named in error, error
    assert not (project / "o.mlpackage").exists()


def test_a_layer_exception_that_decides_no_weight_is_refused_naming_its_line(project):
    text = MANIFEST.replace("compression: {method: none}", "compression:\n  method: palettize\n  layers:\n    model.layers.9.mlp.down_proj: {nbits: 8}")
    (project / "m.yaml").write_text(text)
    error = _one_error(invoke_cli("validate", project / "m.yaml"))
    line = text.splitlines().index("    model.layers.9.mlp.down_proj: {nbits: 8}") + 1
    assert f"m.yaml:{line}:" in error and "model.layers.9.mlp.down_proj" in error and "decides no weight" in error
    (project / "m.yaml").write_text(text.replace("layers.9", "layers.1"))
    assert invoke_cli("validate", project / "m.yaml").returncode == 0


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_in_a_manifest_are_refused(project, value):
    text = MANIFEST.replace("compression: {method: none}", f"compression: {{auto: {{max_perplexity_ratio: {value}}}}}")
    text = text.replace("adapters: [{name: zen, path: zen}]", "adapters: [{name: zen, path: zen, calibration: m.yaml}]")
    (project / "m.yaml").write_text(text.replace("include_base: base\n", ""))
    error = _one_error(invoke_cli("validate", project / "m.yaml"))
    assert "max_perplexity_ratio" in error


def _strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@given(value=st.recursive(st.floats(allow_nan=True, allow_infinity=True) | st.integers() | st.text(max_size=5) | st.none(),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=10))
@settings(max_examples=200, deadline=None)
def test_everything_written_as_json_is_standard_json(value):
    from adapterpack.formats.metadata import finite, strict_json

    decoded = _strict_loads(strict_json(value))
    floats = [v for v in _leaves(decoded) if isinstance(v, float)]
    assert all(math.isfinite(v) for v in floats)
    assert decoded == json.loads(json.dumps(finite(value)))


def _leaves(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def test_a_packages_metadata_and_release_files_are_standard_json(pristine):
    """What strict readers (Swift's JSONDecoder) read: the package's metadata values, build-info.json."""
    from adapterpack.formats.registry import read_functions

    listing = read_functions(pristine / "dist" / "d" / "d.mlpackage")
    for _key, value in listing.metadata.items():
        if value.startswith(("{", "[")):
            _strict_loads(value)
    _strict_loads((pristine / "dist" / "build-info.json").read_text())


# -- one rule for names --------------------------------------------------------------------------


@pytest.mark.parametrize("name", [".", "..", "a\nb", "a\0b", "o" * 300, "a b", "-x", "x/y", ""])
def test_a_package_name_no_file_system_or_sums_file_can_hold_is_refused_by_validate(project, name):
    (project / "m.yaml").write_text(MANIFEST.replace("name: d", f"name: {json.dumps(name)}"))
    error = _one_error(invoke_cli("validate", project / "m.yaml"))
    assert "m.yaml:1:" in error and "name" in error


@given(name=st.text(max_size=140))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_name_the_rule_accepts_can_be_written_everywhere_it_goes(tmp_path, name):
    """Every name either fails the rule with a ValueError or names every file it becomes: the
    package, its zip and staging folder, a part, a SHA256SUMS line that reads back."""
    from adapterpack.config.names import check_function_name, check_package_name

    for check, files in (
        (check_package_name, ["{}.mlpackage", "{}.mlpackage.zip", ".{}.release.adapterpack-staging-4194304-abcdef12"]),
        (check_function_name, ["{}.mlpackage", "{}.part.json", ".{}.mlpackage.adapterpack-staging-4194304-abcdef12"]),
    ):
        try:
            check(name)
        except ValueError as error:
            assert "\n" not in str(error)
            continue
        for pattern in files:
            path = tmp_path / pattern.format(name)
            path.write_text("x")
            assert path.read_text() == "x"
            path.unlink()
        line = f"{'0' * 64}  {name}.mlpackage.zip"
        assert line.splitlines() == [line]


@pytest.mark.parametrize("swift_type", ["1 bad-name", "enum", "a.b", "x" * 200])
def test_functions_swift_refuses_a_type_name_that_would_not_compile(pristine, swift_type):
    error = _one_error(invoke_cli("functions", pristine / "dist" / "d" / "d.mlpackage", "--swift", "--swift-type", swift_type))
    assert "--swift-type" in error


# -- arguments: one line, documented exit code ---------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-1"],
        ["--max-new-tokens", "0"], ["--max-new-tokens", "-1"], ["--top-k", "0"], ["--top-p", "nan"],
    ],
)
def test_bad_generation_settings_are_one_line_errors(pristine, args):
    package = pristine / "dist" / "d" / "d.mlpackage"
    result = run_cli("generate", package, "-f", "zen", "-p", "Beautiful", "-m", pristine / "m.yaml", *args)
    assert args[0] in _one_error(result)


@pytest.mark.parametrize("args", [["--max-size"], ["--max-size", "8XB"], ["--older-than", "-1"], ["--older-than", "nan"], ["--frob"]])
def test_bad_cache_prune_arguments_are_one_line_errors(pristine, args):
    result = run_cli("cache", "prune", pristine / "dist", *args)
    _one_error(result)


@given(value=st.floats(allow_nan=True, allow_infinity=True))
@settings(max_examples=200, deadline=None)
def test_a_sampling_temperature_is_finite_and_not_negative_or_refused(value):
    from adapterpack.evaluate.generate import Sampling

    try:
        sampling = Sampling(temperature=value)
    except BadInput as error:
        assert "--temperature" in str(error)
        assert not (math.isfinite(value) and value >= 0)
        return
    assert math.isfinite(sampling.temperature) and sampling.temperature >= 0


@pytest.mark.parametrize("command", ["functions", "inspect"])
@pytest.mark.parametrize("given", ["/dev/null", "empty file", "garbage Manifest.json", "no Manifest.json"])
def test_read_commands_refuse_what_is_no_package(pristine, tmp_path, command, given):
    """`functions /dev/null --expect main` listed a phantom main (exit 0): the CI guard passed on
    a file that is no package."""
    if given == "/dev/null":
        path = Path("/dev/null")
    elif given == "empty file":
        path = tmp_path / "e.mlpackage"
        path.write_bytes(b"")
    else:
        path = tmp_path / "g.mlpackage"
        shutil.copytree(pristine / "dist" / "d" / "d.mlpackage", path)
        if given == "garbage Manifest.json":
            (path / "Manifest.json").write_text("garbage")
        else:
            (path / "Manifest.json").unlink()
    args = ["--expect", "main"] if command == "functions" else []
    _one_error(invoke_cli(command, path, *args))


def test_a_calibration_path_that_is_a_symlink_loop_is_bad_input(project):
    (project / "loop.txt").symlink_to(project / "loop.txt")
    (project / "m.yaml").write_text(MANIFEST.replace("path: base}", "path: base, calibration: loop.txt}"))
    error = _one_error(invoke_cli("validate", project / "m.yaml"))
    assert "loop.txt" in error


# -- paths and links, generated ------------------------------------------------------------------

PLACES = ["base", "zen", "m.yaml", "dist", "dist/d", "base/tokenizer.json", "zen/adapter_config.json", "new", "."]


@given(place=st.sampled_from(PLACES), tail=st.sampled_from(["", "x.mlpackage", "d", "SHA256SUMS", "d.mlpackage.zip", "build-info.json"]),
       command=st.sampled_from(["build", "release", "parts"]))
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_generated_output_places_never_change_an_input(pristine, tmp_path_factory, place, tail, command):
    """Any output place among and inside the inputs, with --force: a documented exit code, and
    every input byte for byte (only what the command owns may change)."""
    root = tmp_path_factory.mktemp("place") / "p"
    shutil.copytree(pristine, root, symlinks=True)
    inputs = {k: v for k, v in _snapshot(root).items() if k.split("/")[0] in ("base", "zen", "m.yaml")}
    where = root / place / tail if tail else root / place
    args = {
        "build": ["build", root / "m.yaml", "-o", where, "--force", "--no-verify", "--no-cache", "--quiet"],
        "release": ["release", root / "m.yaml", "--out-dir", where, "--force", "--no-cache", "--quiet", "--no-bundle"],
        "parts": ["build", root / "m.yaml", "--function", "zen", "--parts", where, "--quiet"],
    }[command]
    result = invoke_cli(*args)
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    assert {k: v for k, v in _snapshot(root).items() if k in inputs} == inputs


@given(target=st.sampled_from(["secret", "base/tokenizer.json", "../p/base/config.json", "zen/adapter_config.json", "/etc/hostname"]),
       name=st.sampled_from(["special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json"]))
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_generated_links_in_the_base_never_carry_an_outside_file(pristine, tmp_path_factory, target, name):
    """A link in the base folder to anywhere: the release bundle holds only bytes of files inside
    the base, or the release is refused naming the link."""
    from adapterpack.distribution.bundle import check_tokenizer_files
    from adapterpack.inputs.checked import check_inputs

    root = tmp_path_factory.mktemp("link") / "p"
    shutil.copytree(pristine, root, symlinks=True)
    (root / "secret").write_text("do not ship")
    link = root / "base" / name
    link.unlink(missing_ok=True)
    link.symlink_to(target if target.startswith("/") else (root / target if not target.startswith("..") else target))
    try:
        checked = check_inputs(root / "m.yaml")
        check_tokenizer_files(checked)
    except BadInput as error:
        assert name in str(error)
        return
    data = checked.base.shipped_file(name)
    assert link.resolve().parent == (root / "base").resolve() and data == link.resolve().read_bytes()


def test_cli_main_turns_a_fault_in_the_error_boundary_into_one_line(pristine, monkeypatch, capsys):
    """The console entry point's last resort: an exception escaping the error boundary itself is
    one line and exit 1, never a traceback."""
    import adapterpack.cli.app as cli

    def broken():
        raise RuntimeError("injected fault in the boundary")

    monkeypatch.delenv("ADAPTERPACK_DEBUG", raising=False)
    monkeypatch.setattr(cli, "error_boundary", broken)
    monkeypatch.setattr(cli.sys, "argv", ["adapterpack", "validate", str(pristine / "m.yaml")])
    monkeypatch.setattr(cli.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    # main() runs the exit hooks before it leaves: the test process's own (torch's) must stay
    import atexit

    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: None)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert exited.value.code == 1
    assert lines == ["internal error: RuntimeError: injected fault in the boundary (run with ADAPTERPACK_DEBUG=1 for the traceback)"]


# -- a fault at any point of any writer ----------------------------------------------------------


def _entry_of(name: str) -> str | None:
    """The cache entry (``.../.adapterpack-cache/KIND/KEY``) a file belongs to, or None."""
    parts = name.split("/")
    if ".adapterpack-cache" not in parts:
        return None
    at = parts.index(".adapterpack-cache")
    return "/".join(parts[: at + 3]) if len(parts) > at + 3 else None


WRITERS = {
    "release": lambda r: ["release", r / "m.yaml", "--out-dir", r / "dist", "--force", "--no-cache", "--quiet"],
    "parts": lambda r: ["build", r / "m.yaml", "--function", "zen", "--parts", r / "parts", "--quiet"],
    "merge": lambda r: ["merge", r / "parts", "-o", r / "merged.mlpackage", "--force", "--quiet"],
    "aimodel": lambda r: ["build", r / "m.yaml", "-o", r / "o.aimodel", "--force", "--no-cache", "--no-verify", "--quiet"],
    "cache prune": lambda r: ["cache", "prune", r / "build" / ".adapterpack-cache", "--older-than", "0"],
}
# Each run is a process of its own (about 5 s of imports); a release and a Core AI build take over
# a minute each under the trace hook. The default run injects one fault into the fastest writer;
# the slow step two into every one (a build's own fault test is in test_hostile_input).
FAST_WRITERS = ("cache prune",)


@pytest.mark.parametrize(
    "writer, points",
    [(w, 1) for w in FAST_WRITERS] + [pytest.param(w, 2, marks=pytest.mark.slow, id=f"{w}-at-length") for w in WRITERS],
)
def test_a_fault_at_a_random_point_of_every_writer_leaves_outputs_whole_and_inputs_untouched(pristine, tmp_path, monkeypatch, writer, points):
    """A RuntimeError raised inside any adapterpack function a writer calls (seeded random
    points), in a process of its own: the one-line internal error, exit 1, every input byte for
    byte and the output either as it was or whole (a fault after the move into place, while the
    result is printed), no staging left behind."""
    import random

    monkeypatch.delenv("ADAPTERPACK_DEBUG", raising=False)
    root = tmp_path / "p"
    shutil.copytree(pristine, root, symlinks=True)
    setup = {
        "merge": [["build", root / "m.yaml", "--function", name, "--parts", root / "parts", "--quiet"] for name in ("zen", "base")],
        "cache prune": [["build", root / "m.yaml", "-o", root / "build" / "d.mlpackage", "--no-verify", "--quiet"]],
    }.get(writer, [])
    for command in setup:
        assert invoke_cli(*command).returncode == 0
    args = WRITERS[writer](root)
    report = tmp_path / "fault.json"
    # Every run starts from the same files (a prune that ran to its end leaves nothing to prune).
    before = tmp_path / "before"
    shutil.copytree(root, before, symlinks=True)
    previous = _snapshot(root)

    def fresh() -> None:
        shutil.rmtree(root)
        shutil.copytree(before, root, symlinks=True)

    counted, state = run_with_fault(args, 0, report)
    assert counted.returncode == 0, counted.stderr
    assert state["calls"] > 20
    after = _snapshot(root)  # what the writer leaves when it runs to its end
    for at in sorted(random.Random(42).sample(range(1, state["calls"] + 1), points)):
        fresh()
        result, state = run_with_fault(args, at, report)
        where = state["where"]
        assert where is not None, at
        if result.returncode == 3:
            # A fault while a function's program runs is that function failing verification: a
            # damaged package makes the executor raise the same way. The reason names it.
            assert re.search(r"cannot be (run|loaded): RuntimeError: injected fault", result.stderr), (where, result.stderr)
        else:
            assert result.returncode == 1, (where, result.stderr)
            # one line; a converter may wrap the fault raised in its callback in an error of its own
            lines = [line for line in result.stderr.splitlines() if "error" in line]
            assert len(lines) == 1 and lines[0].startswith("internal error:"), (where, result.stderr)
        assert "Traceback" not in result.stderr.replace("Traceback (most recent call last): (run with", ""), where
        now = _snapshot(root)
        if writer == "cache prune":  # an entry goes whole or stays whole; nothing else changes
            entries = {k: _entry_of(k) for k in previous}
            for entry in set(entries.values()) - {None}:
                files = [k for k, e in entries.items() if e == entry]
                assert all(now.get(k) == previous[k] for k in files) or not any(k in now for k in files), (where, entry)
            assert {k: v for k, v in now.items() if entries.get(k) is None} == {k: v for k, v in previous.items() if entries[k] is None}
        else:  # as before; or, for a fault after the output was moved into place, whole
            assert now == previous or now == after, where
        assert not [p for p in root.rglob("*staging*")], where
