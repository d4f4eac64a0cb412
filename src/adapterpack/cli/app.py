"""Command line: the commands. Each parses its arguments and calls the library.

Exit codes: 0 ok, 1 internal error, 2 bad input, 3 verification failed, 4 out of resources,
130 interrupted. ``ADAPTERPACK_DEBUG=1`` shows tracebacks and the libraries' own output.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

import adapterpack as api
from adapterpack.assemble.builder import check_value_ranges
from adapterpack.assemble.disk import disk_needs
from adapterpack.assemble.pipeline import build_function_part, merge_from_parts
from adapterpack.assemble.records import BuildOptions
from adapterpack.cli.boundary import configure_logging, error_boundary
from adapterpack.cli.flags import option_of, options_flags
from adapterpack.cli.render import (
    ConsoleReporter,
    cache_listing,
    cache_table,
    eval_table,
    human_size,
    out,
    parse_size,
    print_any_inspection,
    print_build,
    print_generation,
    verify_table,
)
from adapterpack.config.devices import DEVICES, find_device
from adapterpack.config.manifest import manifest_json_schema
from adapterpack.config.names import check_swift_type_name
from adapterpack.errors import EXIT_CODES, BadInput, VerificationFailed
from adapterpack.formats.metadata import strict_json
from adapterpack.formats.registry import read_functions
from adapterpack.inputs.checked import check_inputs, check_layer_exceptions, check_state_sizes
from adapterpack.report.inspectors import inspect_either
from adapterpack.report.memory import budget_rows, inspection_json, memory_estimate
from adapterpack.report.swift import expectation_diff, swift_enum
from adapterpack.verification.runners import check_backend

EXIT_HELP = "Exit codes: " + "; ".join(f"{code} {text.split(' (')[0]}" for code, text in EXIT_CODES.items()) + "."


app = typer.Typer(
    name="adapterpack",
    help="Package a Hugging Face base model and its LoRA adapters as ONE multifunction Core ML "
    "model with a stateful KV-cache (one function per adapter). " + EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


log = logging.getLogger("adapterpack")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"adapterpack {version('adapterpack')}")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit")
    ] = False,
) -> None:
    """Options that come before the command."""


_interrupted = False


ManifestArg = Annotated[Path, typer.Argument(help="Manifest YAML, e.g. manifests/demo.yaml", show_default=False)]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="One line per stage, no live display")]
# Flags of BuildOptions fields, for commands that take one alone (declared with the field).
AllowPickleOption = option_of("allow_pickle")
BackendOption = option_of("backend")
StrictOption = option_of("strict")
BUILD_FLAGS = ("package_format", "contract", "force", "allow_pickle", "verify", "backend", "strict", "cache_dir", "use_cache")


@app.command()
@options_flags(*BUILD_FLAGS)
def build(
    manifest: ManifestArg,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output .mlpackage or .aimodel (overrides the manifest's `output`)")
    ] = None,
    function: Annotated[
        str | None, typer.Option("--function", help="Fan-out: build only this function's part (needs --parts)")
    ] = None,
    parts: Annotated[
        Path | None, typer.Option("--parts", help="Fan-out: folder to write the part to, for `adapterpack merge`")
    ] = None,
    *,
    options: BuildOptions,
    quiet: QuietOption = False,
) -> None:
    """Build one multifunction .mlpackage (or Core AI .aimodel) from a manifest, then verify it (exit 3 if it does not match).

    Unchanged functions are reused from the build cache. For one CI job per adapter, build parts
    with `--function NAME --parts DIR` and merge them with `adapterpack merge DIR -o PKG`.

    Example: adapterpack build manifests/demo.yaml -o build/demo.mlpackage --force
    """
    configure_logging(quiet)
    with error_boundary():
        if (function is None) != (parts is None):
            raise BadInput("--function and --parts go together (build one function's part for `adapterpack merge`)")
        if function is not None:

            part = build_function_part(manifest, function, parts, options=options, reporter=ConsoleReporter(quiet))
            out.print(f"part {function}: {part}", highlight=False)
            return
        result = api.build(manifest, output=output, options=options, reporter=ConsoleReporter(quiet))
        print_build(result)


@app.command()
@options_flags("force", "backend", "strict")
def merge(
    parts_dir: Annotated[Path, typer.Argument(help="Folder of parts from `build --function NAME --parts DIR`", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The merged .mlpackage")],
    manifest: Annotated[
        Path | None, typer.Option("--manifest", "-m", help="Verify the merged package against this manifest")
    ] = None,
    *,
    options: BuildOptions,
    quiet: QuietOption = False,
) -> None:
    """Merge parts built by separate jobs into one package (checks they share base, settings and versions).

    Example: adapterpack merge parts/ -o build/demo.mlpackage --manifest manifests/demo.yaml
    """
    configure_logging(quiet)
    with error_boundary():
        result = merge_from_parts(parts_dir, output, manifest=manifest, options=options, reporter=ConsoleReporter(quiet))
        print_build(result)


@app.command()
def verify(
    package: Annotated[Path, typer.Argument(help="The .mlpackage to check", show_default=False)],
    manifest: Annotated[Path, typer.Option("--manifest", "-m", help="The manifest the package was built from")],
    backend: BackendOption = "numpy",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report")] = False,
    quiet: QuietOption = False,
) -> None:
    """Check every function numerically against the PyTorch reference (peft, unmerged, float32).

    Example: adapterpack verify build/demo.mlpackage --manifest manifests/demo.yaml
    """
    configure_logging(quiet=True)
    with error_boundary():

        check_backend(backend)
        # Live progress on a terminal; in logs the table and the verdict are the whole output.
        reporter = ConsoleReporter(quiet)
        report = api.verify(package, manifest, backend=backend, reporter=reporter if reporter.live else None)
        if as_json:
            print(strict_json(report.as_json(), indent=2))
        else:
            out.print(verify_table(report))
        if not report.passed:
            raise VerificationFailed(report.verdict())
        if not as_json:
            out.print(report.verdict(), highlight=False)


@app.command()
def generate(
    package: Annotated[Path, typer.Argument(help="The .mlpackage (in a release bundle, its tokenizer is found beside it)", show_default=False)],
    function: Annotated[str, typer.Option("--function", "-f", help="The function (adapter) to run")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The text to continue")],
    manifest: Annotated[
        Path | None, typer.Option("--manifest", "-m", help="The manifest the package was built from: its base's tokenizer, and the reference for --compare")
    ] = None,
    backend: BackendOption = "numpy",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Stop after this many tokens, 1 or more (or at EOS, or at max_context)")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0: greedy; more (finite): sample")] = 0.0,
    top_k: Annotated[int | None, typer.Option("--top-k", help="Sample among the k most likely tokens (1 or more)")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="Sample among the most likely tokens holding this probability")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sampling")] = 0,
    compare: Annotated[bool, typer.Option("--compare", help="Also generate with the PyTorch reference (peft, unmerged, float32) and show where the two part")] = False,
    chat: Annotated[
        bool,
        typer.Option("--chat", help="Send the prompt as a user message through the tokenizer's chat template, as swift-transformers' applyChatTemplate does"),
    ] = False,
) -> None:
    """Continue a prompt with one function, driven exactly as the Swift client drives it (prefill, then one token per call through its state).

    Example: adapterpack generate build/demo.mlpackage --function zen --prompt "Beautiful is" --manifest manifests/demo.yaml

    Example: adapterpack generate build/smollm2.mlpackage -f pirate --chat --prompt "What is the moon?" -m manifests/smollm2.yaml
    """
    configure_logging(quiet=True)
    with error_boundary():
        from adapterpack.evaluate.generate import Sampling
        from adapterpack.evaluate.generate import generate as run_generate

        check_backend(backend)
        checked = check_inputs(manifest) if manifest is not None else None
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        # The prompt is echoed with the first generated text, once the package has opened: a
        # package that cannot be read leaves only the error line.
        pending = [f"user: {prompt}\nassistant: " if chat else prompt]

        def show(piece: str) -> None:
            sys.stdout.write("".join(pending) + piece)
            pending.clear()
            sys.stdout.flush()

        result = run_generate(
            package, function, prompt, checked=checked, backend=backend, sampling=sampling,
            max_new_tokens=max_new_tokens, compare=compare, chat=chat, on_text=show,
        )
        show("\n")
        sys.stdout.flush()
        print_generation(result)


@app.command("eval")
def eval_command(
    package: Annotated[Path, typer.Argument(help="The .mlpackage", show_default=False)],
    text: Annotated[Path, typer.Option("--text", "-t", help="A UTF-8 text file to measure perplexity on, e.g. adapters/demo/heldout.txt")],
    manifest: Annotated[
        Path | None, typer.Option("--manifest", "-m", help="The manifest the package was built from: the reference (and the base's tokenizer)")
    ] = None,
    function: Annotated[list[str] | None, typer.Option("--function", "-f", help="Only this function (repeat for several)")] = None,
    window: Annotated[
        int | None, typer.Option("--window", help="Tokens per sliding window, 2 to max_context - 1 (default max_context - 1; e.g. the model's training length)")
    ] = None,
    backend: BackendOption = "numpy",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report")] = False,
    quiet: QuietOption = False,
) -> None:
    """Perplexity of each function and of its PyTorch reference on your text, their ratio and top-1 agreement.

    Example: adapterpack eval build/demo.mlpackage --text adapters/demo/heldout.txt --manifest manifests/demo.yaml
    """
    configure_logging(quiet=True)
    with error_boundary():
        from adapterpack.evaluate.perplexity import evaluate

        check_backend(backend)
        checked = check_inputs(manifest) if manifest is not None else None
        reporter = ConsoleReporter(quiet or as_json)
        with reporter.progress("eval: windows run (package, then reference)", "windows") as update:
            report = evaluate(package, text, checked, functions=function, window=window, backend=backend, progress=update)
        if as_json:
            print(strict_json(report.as_json(), indent=2))
        else:
            out.print(eval_table(report))


@app.command()
@options_flags("package_format", "contract", "force", "allow_pickle", "backend", "strict", "cache_dir", "use_cache")
def release(
    manifest: ManifestArg,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-d", help="Release folder, e.g. dist/")],
    no_bundle: Annotated[bool, typer.Option("--no-bundle", help="Skip the app-ready folder (package, tokenizer files, Swift enum, model card)")] = False,
    eval_text: Annotated[Path | None, typer.Option("--eval-text", help="Measure perplexity on this text for the model card (see `eval`)")] = None,
    eval_window: Annotated[int | None, typer.Option("--eval-window", help="Tokens per eval window (see `eval --window`)")] = None,
    *,
    options: BuildOptions,
    quiet: QuietOption = False,
) -> None:
    """Build, verify and write reproducible release artifacts: NAME.mlpackage.zip, build-info.json, SHA256SUMS, and the app-ready folder NAME/.

    Example: adapterpack release manifests/demo.yaml --out-dir dist && (cd dist && sha256sum -c SHA256SUMS)
    """
    configure_logging(quiet)
    with error_boundary():

        result = api.release(
            manifest, out_dir, options=options, reporter=ConsoleReporter(quiet),
            bundle=not no_bundle, eval_text=eval_text, eval_window=eval_window,
        )
        if result.build.verify_report is not None:
            out.print(verify_table(result.build.verify_report))
        if result.eval_report is not None:
            out.print(eval_table(result.eval_report))
        for path in (result.zip_path, result.build_info, result.sums):
            out.print(f"{path}  {human_size(path.stat().st_size)}", highlight=False)
        if result.bundle is not None:
            out.print(f"{result.bundle}/  app-ready: package, tokenizer files, {result.bundle.name}/README.md", highlight=False)


@app.command()
def validate(
    manifest: ManifestArg,
    allow_pickle: AllowPickleOption = False,
    strict: StrictOption = False,
    check_range: Annotated[
        bool,
        typer.Option(
            "--range",
            help="Also run each function's PyTorch reference on a calibration prompt and name every value "
            "float16 cannot hold (what build checks first; loads the base in torch)",
        ),
    ] = False,
) -> None:
    """Check a manifest, its base and its adapters without building anything.

    Example: adapterpack validate manifests/demo.yaml --strict --range
    """
    configure_logging(quiet=False)
    with error_boundary():

        checked = check_inputs(manifest, allow_pickle=allow_pickle, strict=strict)
        check_state_sizes(checked, strict=strict)
        if check_range:
            check_value_ranges(checked, checked.manifest.function_names, ConsoleReporter(False))
        m = checked.manifest
        family = checked.base.config.get("model_type")
        if checked.base.tower_of is not None:
            family = f"{family}: the text tower of a multimodal checkpoint, read from {checked.base.folder}"
        out.print(
            f"{manifest}: ok: {len(m.function_names)} function(s) "
            f"({', '.join(m.function_names)}; default {m.default}), base {m.base.path} "
            f"({family}), max_context {m.export.max_context}",
            highlight=False,
        )
        for function, exceptions in check_layer_exceptions(m, checked.base).items():
            for pattern, decided in exceptions.items():
                out.print(f"{function}: compression.layers '{pattern}' decides {len(decided)} weight(s), e.g. {decided[0]}", highlight=False)
        needs = disk_needs(checked)
        out.print(
            f"disk: a clean build writes about {human_size(needs.cache)} to its build cache and "
            f"{human_size(needs.output)} beside the output (the package and its staging)",
            highlight=False,
        )


@app.command()
def schema() -> None:
    """Print the JSON Schema of the manifest format.

    Example: adapterpack schema > manifest.schema.json
    """

    print(json.dumps(manifest_json_schema(), indent=2))


@app.command()
def functions(
    package: Annotated[Path, typer.Argument(help="A .mlpackage, e.g. build/demo.mlpackage", show_default=False)],
    expect: Annotated[
        str | None,
        typer.Option("--expect", help="Comma-separated function names the app uses; exit 2 unless exactly these, e.g. chat,code,zen"),
    ] = None,
    swift: Annotated[bool, typer.Option("--swift", help="Print a Swift enum of the functions, ready to paste")] = False,
    swift_type: Annotated[str, typer.Option("--swift-type", help="Name of the Swift enum")] = "AdapterFunction",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """List a package's functions (default marked) with their inputs, outputs and states.

    Example (CI guard for the Swift code): adapterpack functions build/demo.mlpackage --expect base,code,docs,zen
    """
    configure_logging(quiet=True)
    with error_boundary():

        if swift:
            try:
                check_swift_type_name(swift_type)
            except ValueError as error:
                raise BadInput(f"--swift-type: {error}") from None
        package_functions = read_functions(package)
        if expect is not None:
            expected = [name.strip() for name in expect.split(",") if name.strip()]
            diff = expectation_diff(package_functions.names, expected)
            if diff:
                raise BadInput(f"{package}: functions differ from --expect: {diff}")
        if swift:
            print(swift_enum(package_functions, swift_type))
            return
        if as_json:
            print(strict_json(
                {
                    "package": str(package),
                    "default": package_functions.default,
                    "functions": [
                        {
                            "name": f.name,
                            "inputs": [vars(x) for x in f.inputs],
                            "outputs": [vars(x) for x in f.outputs],
                            "states": [vars(x) for x in f.states],
                        }
                        for f in package_functions.functions
                    ],
                },
                indent=2,
            ))
            return
        table = Table(title=str(package), title_justify="left")
        for column in ("function", "inputs", "outputs", "states"):
            table.add_column(column)
        for f in package_functions.functions:
            fmt = lambda features: "\n".join(f"{x.name} {x.dtype} {x.shape}" for x in features)  # noqa: E731
            marker = " (default)" if f.name == package_functions.default else ""
            table.add_row(f.name + marker, fmt(f.inputs), fmt(f.outputs), fmt(f.states))
        out.print(table)
        if expect is not None:
            out.print(f"functions match --expect ({len(package_functions.names)})", highlight=False)


@app.command()
def inspect(
    package: Annotated[Path, typer.Argument(help="A .mlpackage or .aimodel, e.g. build/demo.mlpackage", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report")] = False,
    top: Annotated[int, typer.Option("--top", help="How many of the largest tensors to list (0 or more)")] = 10,
    device: Annotated[
        str | None,
        typer.Option("--device", help="Only this device in the memory budget, e.g. iphone-15-pro (default: all)"),
    ] = None,
    strict: Annotated[
        bool, typer.Option("--strict", help="Exit 2 when the package breaks a device rule (they are warnings otherwise)")
    ] = False,
) -> None:
    """Show where a package's bytes go and whether its heaviest function fits each device's memory.

    Per function: bytes only it uses, bytes shared with other functions, and its size built alone;
    the package total, dedup ratio, largest tensors, compression by kind, device rules the package
    breaks (Neural Engine state sizes, the Swift client's contract), and a memory budget
    (weights + states + activations) against app memory limits with their sources.

    Example: adapterpack inspect build/demo.mlpackage --top 5 --device iphone-15
    """
    configure_logging(quiet=True)
    with error_boundary():

        if top < 0:
            raise BadInput(f"--top {top}: give 0 or more")
        devices = [find_device(device)] if device else list(DEVICES)
        report = inspect_either(package)
        estimate = memory_estimate(report)
        budget = budget_rows(report, estimate, devices)
        if as_json:
            print(strict_json(inspection_json(report, estimate, budget, top), indent=2))
        else:
            print_any_inspection(report, estimate, budget, top)
        if strict and report.device_findings:
            raise BadInput(f"{report.device_findings[0].line()} (an error with --strict)")


@app.command("cache-key")
def cache_key_command(
    manifest: ManifestArg,
    function: Annotated[str | None, typer.Option("--function", help="A fan-out job's function (its own key)")] = None,
) -> None:
    """Print the CI cache key of a manifest's build cache, and the prefix to restore from, as GitHub outputs.

    Reads the inputs' content hashes (as a build does), never the cache: key= changes with the base, the
    adapters, the settings and the versions; restore-key= matches caches of the same base and versions.

    Example: adapterpack cache-key manifests/demo.yaml >> "$GITHUB_OUTPUT"
    """
    configure_logging(quiet=True)
    with error_boundary():
        from adapterpack.assemble.pipeline import cache_key

        key, prefix = cache_key(manifest, function)
        print(f"key={key}")
        print(f"restore-key={prefix}")


cache_app = typer.Typer(
    help="Inspect, check and bound a build cache (default .adapterpack-cache): info, verify (exit 3 when damaged), prune.",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")
CacheFolderArg = Annotated[Path, typer.Argument(help="The build cache folder", show_default=True)]


def _open_cache(folder: Path):
    from adapterpack.assemble.cache import MARKER, BuildCache, is_marked

    if not folder.is_dir():
        raise BadInput(f"{folder}: no build cache here (builds make .adapterpack-cache beside their output)")
    if not is_marked(folder):
        # Only a folder a build made its cache is ever pruned: never an output folder, a parts
        # folder or a project given by mistake.
        raise BadInput(
            f"{folder}: not a build cache (a build marks its cache with {MARKER}; the default is "
            ".adapterpack-cache beside the output, e.g. build/.adapterpack-cache)"
        )
    return BuildCache(folder, warn=log.warning)


@cache_app.command("info")
def cache_info(
    folder: CacheFolderArg = Path(".adapterpack-cache"),
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable listing")] = False,
) -> None:
    """What a build cache holds: entries by kind, their size and when each was last used.

    Example: adapterpack cache info build/.adapterpack-cache
    """
    configure_logging(quiet=True)
    with error_boundary():
        cache = _open_cache(folder)
        listing = cache_listing(cache)
        if as_json:
            print(strict_json(listing, indent=2))
        else:
            out.print(cache_table(listing))


@cache_app.command("verify")
def cache_verify(folder: CacheFolderArg = Path(".adapterpack-cache")) -> None:
    """Re-hash every entry against the SHA-256 recorded when it was written.

    Damaged entries are dropped (the next build makes them again) and the command exits 3.

    Example: adapterpack cache verify build/.adapterpack-cache
    """
    configure_logging(quiet=True)
    with error_boundary():
        cache = _open_cache(folder)
        found = cache.repair(report=lambda line: out.print(line, highlight=False))
        if found.damaged:
            raise VerificationFailed(
                f"cache verify: {found.damaged} damaged entr{'y' if found.damaged == 1 else 'ies'} dropped, {found.intact} intact"
            )
        out.print(f"cache verify: all {found.intact} entries intact", highlight=False)


@cache_app.command("prune")
def cache_prune(
    folder: CacheFolderArg = Path(".adapterpack-cache"),
    max_size: Annotated[
        str | None, typer.Option("--max-size", help="Drop the least recently used entries until the cache holds at most this, e.g. 8GB")
    ] = None,
    older_than: Annotated[
        float | None, typer.Option("--older-than", help="Drop entries no build has used for this many days (0 or more)")
    ] = None,
) -> None:
    """Drop unused entries, each one whole.

    An entry is renamed away before it is deleted, so a build sharing the folder never finds
    half of one. Without options, drops only what no build can use: unreadable entries, an
    older adapterpack's files, leftovers of killed builds.

    Example: adapterpack cache prune build/.adapterpack-cache --max-size 8GB --older-than 30
    """
    configure_logging(quiet=True)
    with error_boundary():
        if older_than is not None and not (math.isfinite(older_than) and older_than >= 0):
            raise BadInput(f"--older-than {older_than}: give a number of days, 0 or more")
        max_bytes = parse_size(max_size) if max_size is not None else None
        cache = _open_cache(folder)
        before = cache_listing(cache)["bytes"]
        dropped = cache.prune(max_bytes=max_bytes, older_than_days=older_than)
        after = cache_listing(cache)["bytes"]
        out.print(
            f"cache prune: dropped {len(dropped)} entr{'y' if len(dropped) == 1 else 'ies'}, "
            f"{human_size(before)} -> {human_size(after)}",
            highlight=False,
        )


def main() -> None:
    """Console entry point: run the command, then leave without finalizing every library.

    Tearing down torch, transformers and coremltools module by module takes over a second after
    the work is done and serves no finished command; exit hooks (temporary files) still run.
    """
    import atexit

    # click's UsageError, from whichever click typer uses (its own copy in recent versions).
    usage_error = typer.BadParameter.__mro__[1]
    try:
        # Not standalone: click's usage errors (an unknown option, a missing value, a value of the
        # wrong type) come here and are printed as every other error is, one line and exit 2.
        returned = app(prog_name="adapterpack", standalone_mode=False)
        code = returned if isinstance(returned, int) else 0
    except usage_error as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # a command group without a command
            error.show()  # its help, as click shows it
            code = 2
        else:
            command = error.ctx.command_path if error.ctx is not None else "adapterpack"
            print(f"error: {error.format_message()} (see {command} --help)", file=sys.stderr)
            code = 2
    except typer.Abort:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as error:  # noqa: BLE001 - a fault in the error boundary itself: still one line
        first = (str(error).strip().splitlines() or [""])[0]
        print(f"internal error: {type(error).__name__}: {first} (run with ADAPTERPACK_DEBUG=1 for the traceback)", file=sys.stderr)
        code = 1
        if os.environ.get("ADAPTERPACK_DEBUG", "") not in ("", "0"):
            raise
    except SystemExit as exit_:
        code = exit_.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`| head`) is not an error here
            pass
    os._exit(code)
