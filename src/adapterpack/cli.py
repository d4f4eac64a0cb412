"""Command line: parses arguments, calls the library, and is the one error boundary.

Exit codes: 0 ok, 1 internal error, 2 bad input, 3 verification failed, 4 out of resources,
130 interrupted. ``ADAPTERPACK_DEBUG=1`` shows tracebacks and the libraries' own output.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

from .errors import EXIT_CODES, AdapterpackError, BadInput

EXIT_HELP = "Exit codes: " + "; ".join(f"{code} {text.split(' (')[0]}" for code, text in EXIT_CODES.items()) + "."

app = typer.Typer(
    name="adapterpack",
    help="Package a Hugging Face base model and its LoRA adapters as ONE multifunction Core ML "
    "model with a stateful KV-cache (one function per adapter). " + EXIT_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# CI logs are not terminals; rich would wrap tables at 80 columns there.
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
log = logging.getLogger("adapterpack")


def _debug() -> bool:
    return os.environ.get("ADAPTERPACK_DEBUG", "") not in ("", "0")


def _configure_logging(quiet: bool) -> None:
    level = logging.DEBUG if _debug() else (logging.WARNING if quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("adapterpack")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    if not _debug():
        from .quiet import silence_libraries

        silence_libraries()


_interrupted = False


def _on_sigint(signum, frame) -> None:
    # Remember the interrupt: libraries (torch.jit) may wrap the KeyboardInterrupt in their own
    # error type on its way out, and Ctrl-C must still exit 130.
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def error_boundary() -> Iterator[None]:
    """Turn every failure into one line on stderr and a documented exit code."""
    import signal

    try:
        signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread (e.g. under a test runner's worker)
        pass
    try:
        yield
    except AdapterpackError as error:
        if _debug():
            raise
        if getattr(error, "report", None) is not None:
            out.print(verify_table(error.report))
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        err.print("interrupted", highlight=False)
        raise typer.Exit(130) from None
    except typer.Exit:
        raise
    except MemoryError:
        err.print("[bold red]error:[/] out of memory", highlight=False)
        raise typer.Exit(4) from None
    except OSError as error:
        if _debug():
            raise
        if getattr(error, "errno", None) == 28:  # ENOSPC
            err.print(f"[bold red]error:[/] out of disk space: {error}", highlight=False, soft_wrap=True)
            raise typer.Exit(4) from None
        err.print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except Exception as error:  # noqa: BLE001 - the one place that catches everything
        if _interrupted:
            err.print("interrupted", highlight=False)
            raise typer.Exit(130) from None
        if _debug():
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        err.print(
            f"[bold red]internal error:[/] {type(error).__name__}: {first} "
            "(run with ADAPTERPACK_DEBUG=1 for the traceback)",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from None


class ConsoleReporter:
    """Progress for long builds: a spinner per stage on a terminal, one log line per stage otherwise."""

    def __init__(self, quiet: bool):
        self.live = err.is_terminal and not quiet and not os.environ.get("CI")
        self.quiet = quiet

    @contextlib.contextmanager
    def stage(self, label: str) -> Iterator[None]:
        started = time.perf_counter()
        if self.live:
            with err.status(f"{label} ..."):
                yield
        else:
            yield
        seconds = time.perf_counter() - started
        if self.live:
            err.print(f"[green]✓[/] {label} [dim]({seconds:.1f} s)[/]", highlight=False)
        else:  # CI logs: still one line per stage
            print(f"{label} ({seconds:.1f} s)", file=sys.stderr, flush=True)

    def info(self, message: str) -> None:
        if not self.quiet:
            err.print(message, highlight=False)


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def verify_table(report) -> Table:
    """The per-function checklist of a verification."""
    from .verify import REUSED_NOTE

    table = Table(title=f"verify {report.package.name} ({report.backend} backend)", title_justify="left")
    columns = ("function", "compression", "worse drive", "cosine", "max |err|", "top-1", "KL", "retention", "result")
    for column in columns:
        table.add_column(column, justify="right" if column not in ("function", "compression", "worse drive", "result") else "left")
    for f in report.functions:
        kept = "-" if f.retention is None else f"{f.retention:.3f}"
        result = "[green]pass[/]" if f.passed else "[red]FAIL[/]: " + "; ".join(f.failures)
        if REUSED_NOTE in f.notes:
            result += " (unchanged, verified before)"
        table.add_row(
            f.name, f.compression, f.drive or "-", f"{f.cosine:.5f}", f"{f.max_abs_error:.3g}", f"{f.top1:.1%}",
            f"{f.kl:.2e}", kept, result,
        )
    for problem in report.integrity:
        table.add_row("(package)", "", "", "", "", "", "", "", f"[red]FAIL[/]: {problem}")
    return table


ManifestArg = Annotated[Path, typer.Argument(help="Manifest YAML, e.g. manifests/demo.yaml", show_default=False)]


@app.command()
def build(
    manifest: ManifestArg,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Output .mlpackage (overrides the manifest's `output`)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output (only once the build succeeded)")] = False,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept pickle (.bin) adapters, loaded with weights_only")
    ] = False,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip verifying every function against PyTorch")] = False,
    backend: Annotated[str, typer.Option("--backend", help="Verification backend: numpy (any OS) or coreml (macOS)")] = "numpy",
    strict: Annotated[
        bool, typer.Option("--strict", help="Treat warnings (an adapter trained on a differently named base, a device rule the package breaks) as errors")
    ] = False,
    cache_dir: Annotated[
        Optional[Path],
        typer.Option("--cache-dir", help="Build cache (default: .adapterpack-cache beside the output; parts: none unless given)"),
    ] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Rebuild every function; do not read or write the cache")] = False,
    function: Annotated[
        Optional[str], typer.Option("--function", help="Fan-out: build only this function's part (needs --parts)")
    ] = None,
    parts: Annotated[
        Optional[Path], typer.Option("--parts", help="Fan-out: folder to write the part to, for `adapterpack merge`")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per stage, no live display")] = False,
) -> None:
    """Build one multifunction .mlpackage from a manifest, then verify it (exit 3 if it does not match).

    Unchanged functions are reused from the build cache. For one CI job per adapter, build parts
    with `--function NAME --parts DIR` and merge them with `adapterpack merge DIR -o PKG`.

    Example: adapterpack build manifests/demo.yaml -o build/demo.mlpackage --force
    """
    _configure_logging(quiet)
    with error_boundary():
        from .pipeline import build as run_build

        _check_backend(backend)
        if (function is None) != (parts is None):
            raise BadInput("--function and --parts go together (build one function's part for `adapterpack merge`)")
        if function is not None:
            from .pipeline import build_function_part

            part = build_function_part(
                manifest, function, parts, allow_pickle=allow_pickle, strict=strict, reporter=ConsoleReporter(quiet),
                cache_dir=None if no_cache else cache_dir,
            )
            out.print(f"part {function}: {part}", highlight=False)
            return
        result = run_build(
            manifest,
            output=output,
            force=force,
            allow_pickle=allow_pickle,
            reporter=ConsoleReporter(quiet),
            verify=not no_verify,
            backend=backend,
            strict=strict,
            cache_dir=cache_dir,
            use_cache=not no_cache,
        )
        _print_build(result)


def _print_build(result) -> None:
    """The build summary: functions, sizes, reuse, and the verification table."""
    table = Table(title=f"{result.output}", title_justify="left")
    for column in ("function", "adapter", "lora", "compression", "alone"):
        table.add_column(column)
    for record in result.functions:
        default = " (default)" if record.name == result.default_function else ""
        table.add_row(
            record.name + default,
            record.adapter or "(base)",
            record.lora or "-",
            record.compression,
            _human(result.part_sizes.get(record.name, 0)),
        )
    out.print(table)
    alone = sum(result.part_sizes.values())
    reused = f"; reused from cache: {', '.join(result.reused)}" if getattr(result, "reused", None) else ""
    out.print(
        f"package {_human(result.package_size)} (functions built alone: {_human(alone)}) "
        f"in {result.seconds:.0f} s{reused}",
        highlight=False,
    )
    if result.verify_report is not None:
        out.print(verify_table(result.verify_report))
        out.print(result.verify_report.verdict(), highlight=False)


@app.command()
def merge(
    parts_dir: Annotated[Path, typer.Argument(help="Folder of parts from `build --function NAME --parts DIR`", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The merged .mlpackage")],
    manifest: Annotated[
        Optional[Path], typer.Option("--manifest", "-m", help="Verify the merged package against this manifest")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output (only once the merge succeeded)")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per stage, no live display")] = False,
) -> None:
    """Merge parts built by separate jobs into one package (checks they share base, settings and versions).

    Example: adapterpack merge parts/ -o build/demo.mlpackage --manifest manifests/demo.yaml
    """
    _configure_logging(quiet)
    with error_boundary():
        from .pipeline import merge_from_parts

        result = merge_from_parts(parts_dir, output, force=force, manifest=manifest, reporter=ConsoleReporter(quiet))
        _print_build(result)


def _check_backend(backend: str) -> None:
    from .errors import BadInput

    if backend not in ("numpy", "coreml"):
        raise BadInput(f"--backend {backend!r}: choose numpy or coreml")
    if backend == "coreml" and sys.platform != "darwin":
        raise BadInput("--backend coreml needs macOS (the Core ML runtime); use the default numpy backend here")


@app.command()
def verify(
    package: Annotated[Path, typer.Argument(help="The .mlpackage to check", show_default=False)],
    manifest: Annotated[Path, typer.Option("--manifest", "-m", help="The manifest the package was built from")],
    backend: Annotated[str, typer.Option("--backend", help="numpy (any OS, default) or coreml (macOS only)")] = "numpy",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report")] = False,
) -> None:
    """Check every function numerically against the PyTorch reference (peft, unmerged, float32).

    Example: adapterpack verify build/demo.mlpackage --manifest manifests/demo.yaml
    """
    _configure_logging(quiet=True)
    with error_boundary():
        from .errors import VerificationFailed
        from .manifest import load_manifest
        from .verify import verify_package

        _check_backend(backend)
        loaded = load_manifest(manifest)
        if not package.exists():
            from .errors import BadInput

            raise BadInput(f"{package}: package not found")
        report = verify_package(package, loaded, backend=backend)
        if as_json:
            print(json.dumps(report.as_json(), indent=2))
        else:
            out.print(verify_table(report))
        if not report.passed:
            raise VerificationFailed(report.verdict())
        if not as_json:
            out.print(report.verdict(), highlight=False)


@app.command()
def release(
    manifest: ManifestArg,
    out_dir: Annotated[Path, typer.Option("--out-dir", "-d", help="Release folder, e.g. dist/")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing release (only once the new one succeeded)")] = False,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept pickle (.bin) adapters, loaded with weights_only")
    ] = False,
    strict: Annotated[
        bool, typer.Option("--strict", help="Treat warnings (an adapter trained on a differently named base, a device rule the package breaks) as errors")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per stage, no live display")] = False,
) -> None:
    """Build, verify and write reproducible release artifacts: NAME.mlpackage.zip, build-info.json, SHA256SUMS.

    Example: adapterpack release manifests/demo.yaml --out-dir dist && (cd dist && sha256sum -c SHA256SUMS)
    """
    _configure_logging(quiet)
    with error_boundary():
        from .release import release as run_release

        result = run_release(
            manifest, out_dir, force=force, allow_pickle=allow_pickle, strict=strict, reporter=ConsoleReporter(quiet)
        )
        if result.build.verify_report is not None:
            out.print(verify_table(result.build.verify_report))
        for path in (result.zip_path, result.build_info, result.sums):
            out.print(f"{path}  {_human(path.stat().st_size)}", highlight=False)


@app.command()
def validate(
    manifest: ManifestArg,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Accept pickle (.bin) adapters")] = False,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Treat warnings (an adapter trained on a differently named base, a device rule the package breaks) as errors",
        ),
    ] = False,
) -> None:
    """Check a manifest, its base and its adapters without building anything.

    Example: adapterpack validate manifests/demo.yaml --strict
    """
    _configure_logging(quiet=False)
    with error_boundary():
        from .pipeline import check_inputs, check_state_sizes

        checked = check_inputs(manifest, allow_pickle=allow_pickle, strict=strict)
        check_state_sizes(checked, strict=strict)
        m = checked.manifest
        out.print(
            f"{manifest}: ok: {len(m.function_names)} function(s) "
            f"({', '.join(m.function_names)}; default {m.default}), base {m.base.path} "
            f"({checked.base.config.get('model_type')}), max_context {m.export.max_context}",
            highlight=False,
        )


@app.command()
def schema() -> None:
    """Print the JSON Schema of the manifest format.

    Example: adapterpack schema > manifest.schema.json
    """
    from .manifest import manifest_json_schema

    print(json.dumps(manifest_json_schema(), indent=2))


@app.command()
def functions(
    package: Annotated[Path, typer.Argument(help="A .mlpackage, e.g. build/demo.mlpackage", show_default=False)],
    expect: Annotated[
        Optional[str],
        typer.Option("--expect", help="Comma-separated function names the app uses; exit 2 unless exactly these, e.g. chat,code,zen"),
    ] = None,
    swift: Annotated[bool, typer.Option("--swift", help="Print a Swift enum of the functions, ready to paste")] = False,
    swift_type: Annotated[str, typer.Option("--swift-type", help="Name of the Swift enum")] = "AdapterFunction",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """List a package's functions (default marked) with their inputs, outputs and states.

    Example (CI guard for the Swift code): adapterpack functions build/demo.mlpackage --expect base,code,docs,zen
    """
    _configure_logging(quiet=True)
    with error_boundary():
        from .errors import BadInput
        from .functions import expectation_diff, read_functions, swift_enum

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
            print(json.dumps(
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
    package: Annotated[Path, typer.Argument(help="A .mlpackage, e.g. build/demo.mlpackage", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report")] = False,
    top: Annotated[int, typer.Option("--top", min=0, help="How many of the largest tensors to list")] = 10,
    device: Annotated[
        Optional[str],
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
    _configure_logging(quiet=True)
    with error_boundary():
        from .devices import DEVICES, find_device
        from .inspect_package import inspect_package, memory_estimate

        devices = [find_device(device)] if device else list(DEVICES)
        report = inspect_package(package)
        estimate = memory_estimate(report)
        budget = _budget_rows(report, estimate, devices)
        if as_json:
            document = report.as_json(top=top)
            document["memory"] = None if estimate is None else {
                "function": estimate.function,
                "weights_bytes": estimate.weights_bytes,
                "kv_bytes": estimate.kv_bytes,
                "activation_bytes": estimate.activation_bytes,
                "activations_known": estimate.activations_known,
                "need_bytes": estimate.need_bytes,
                "devices": budget,
            }
            print(json.dumps(document, indent=2))
        else:
            _print_inspection(report, estimate, budget, top)
        if strict and report.device_findings:
            raise BadInput(f"{report.device_findings[0].line()} (an error with --strict)")


def _budget_rows(report, estimate, devices) -> list[dict]:
    """The memory budget per device, with and without the increased-memory-limit entitlement."""
    from .devices import largest_context_that_fits, memory_budget

    if estimate is None:
        return []
    plain = memory_budget(estimate.weights_bytes, estimate.kv_bytes, estimate.activation_bytes, devices)
    raised = memory_budget(
        estimate.weights_bytes, estimate.kv_bytes, estimate.activation_bytes, devices, increased_limit=True
    )
    shape = report.shape
    rows = []
    for default_row, raised_row in zip(plain, raised):
        dev = default_row.device
        context = None
        if estimate.activations_known:
            context = largest_context_that_fits(
                dev, estimate.weights_bytes, shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.vocab,
                shape.hidden, n_heads=shape.n_heads, intermediate=shape.intermediate,
            )
        rows.append({
            "device": dev.key,
            "name": dev.name,
            "ram_bytes": dev.ram_bytes,
            "limit_bytes": default_row.limit,
            "fits": default_row.fits,
            "headroom_bytes": default_row.headroom,
            "increased_limit_bytes": dev.increased_limit_bytes,
            "fits_increased": raised_row.fits if dev.increased_limit_bytes is not None else None,
            "headroom_increased_bytes": raised_row.headroom if dev.increased_limit_bytes is not None else None,
            "largest_context": context,
            "estimate": dev.estimate,
            "source": dev.source,
        })
    return rows


def _signed(size: int) -> str:
    return ("-" if size < 0 else "") + _human(abs(size))


def _print_inspection(report, estimate, budget: list[dict], top: int) -> None:
    default = report.default_function
    out.print(
        f"{report.path}: {len(report.functions)} function(s) (default {default}), "
        f"{_human(report.total_bytes)} on disk",
        highlight=False,
    )
    table = Table(title="bytes per function", title_justify="left")
    for column in ("function", "unique", "shared", "references", "alone", "weights by kind"):
        table.add_column(column, justify="left" if column in ("function", "weights by kind") else "right")
    for f in report.functions:
        kinds = "; ".join(f"{kind} {_human(size)}" for kind, size in f.bytes_by_kind.items())
        table.add_row(
            f.name + (" (default)" if f.default else ""),
            _human(f.unique_bytes),
            _human(f.shared_bytes),
            _human(f.referenced_bytes),
            _human(f.alone_bytes),
            kinds,
        )
    out.print(table)
    others = ", ".join(f"{Path(name).name} {_human(size)}" for name, size in report.other_files.items())
    out.print(
        f"total {_human(report.total_bytes)} = weights {_human(report.weight_bytes)} (tensor data "
        f"{_human(report.weight_data_bytes)} + headers/padding {_human(report.overhead_bytes)}) + other files "
        f"{_human(report.other_bytes)} ({others})",
        highlight=False,
    )
    out.print(
        f"stored once for 2+ functions: {_human(report.shared_bytes)}; functions built alone: "
        f"{_human(report.sum_alone_bytes)}; dedup ratio {report.dedup_ratio:.2f}x",
        highlight=False,
    )
    if report.unreferenced_bytes:
        out.print(f"[yellow]unreferenced weight data: {_human(report.unreferenced_bytes)}[/]", highlight=False)

    if top:
        tensors = Table(title=f"largest tensors (top {top})", title_justify="left")
        for column in ("tensor", "functions", "size", "shape", "kind", "stored as"):
            tensors.add_column(column, justify="right" if column == "size" else "left")
        for t in report.largest(top):
            shape = "x".join("?" if d is None else str(d) for d in t.shape)
            names = t.names[0] + (f" (+{len(t.names) - 1} name(s))" if len(t.names) > 1 else "")
            tensors.add_row(names, ", ".join(t.functions), _human(t.bytes), shape, t.kind, ", ".join(t.storage))
        out.print(tensors)

    kinds = Table(title="compression (each stored tensor once)", title_justify="left")
    for column in ("kind", "bytes", "share"):
        kinds.add_column(column, justify="left" if column == "kind" else "right")
    for kind, size in report.bytes_by_kind.items():
        share = size / report.weight_data_bytes if report.weight_data_bytes else 0.0
        kinds.add_row(kind, _human(size), f"{share:.1%}")
    out.print(kinds)

    for finding in report.device_findings:
        out.print(f"[yellow]warning[/]: {finding.line()}", highlight=False)
    if estimate is None:
        out.print("memory budget: no keyCache state in this package, so no KV-cache size to estimate", highlight=False)
        return
    shape = report.shape
    activations = f"{_human(estimate.activation_bytes)}" if estimate.activations_known else "unknown (no vocab/hidden)"
    out.print(
        f"model: {shape.n_layers} layers, {shape.n_kv_heads} kv heads x {shape.head_dim}, max_context "
        f"{shape.max_context}, vocab {shape.vocab or '?'}, hidden {shape.hidden or '?'}. Largest function "
        f"{estimate.function}: weights {_human(estimate.weights_bytes)} + states (KV-cache) {_human(estimate.kv_bytes)} + "
        f"activations {activations} (estimate) = {_human(estimate.need_bytes)}",
        highlight=False,
    )
    memory = Table(title="memory budget (one function loaded)", title_justify="left")
    for column in ("device", "RAM", "app limit", "fits", "headroom", "with entitlement", "fits", "headroom", "max context", "ref"):
        memory.add_column(column, justify="left" if column in ("device", "fits", "ref") else "right")
    verdict = lambda fits: "-" if fits is None else ("[green]yes[/]" if fits else "[red]no[/]")  # noqa: E731
    for index, row in enumerate(budget, start=1):
        raised = row["increased_limit_bytes"]
        memory.add_row(
            row["name"],
            _human(row["ram_bytes"]),
            _human(row["limit_bytes"]) + ("*" if row["estimate"] else ""),
            verdict(row["fits"]),
            _signed(row["headroom_bytes"]),
            "-" if raised is None else _human(raised),
            verdict(row["fits_increased"]),
            "-" if row["headroom_increased_bytes"] is None else _signed(row["headroom_increased_bytes"]),
            "-" if row["largest_context"] is None else str(row["largest_context"]),
            f"[{index}]",
        )
    out.print(memory)
    out.print(
        "* estimate. Limits are for the whole app; keep headroom for its own memory. max context: largest "
        "max_context (steps of 256) that fits the app limit with a full-length prefill.",
        highlight=False,
    )
    for index, row in enumerate(budget, start=1):
        out.print(f"[{index}] {row['source']}", highlight=False, markup=False)


def main() -> None:
    """Console entry point: run the command, then leave without finalizing every library.

    Tearing down torch, transformers and coremltools module by module takes over a second after
    the work is done and serves no finished command; exit hooks (temporary files) still run.
    """
    import atexit

    try:
        app(prog_name="adapterpack")
        code = 0
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
