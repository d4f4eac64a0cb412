"""What the command line prints: consoles, progress for long stages, and the tables of build,
verify and inspect.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from adapterpack.assemble.records import ProgressLines, progress_text
from adapterpack.errors import BadInput
from adapterpack.report.memory import human_size

# CI logs are not terminals; rich would wrap tables at 80 columns there.
out = Console(width=None if sys.stdout.isatty() else 160)


err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


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

    @contextlib.contextmanager
    def progress(self, label: str, unit: str = "weights") -> Iterator:
        """A bar with the rate and time left on a terminal; elsewhere (CI, --quiet) a line every
        PROGRESS_LINE_SECONDS, so a long stage is never minutes of silence."""
        if not self.live:
            with self.stage(label):
                yield ProgressLines(label, unit, lambda line: print(line, file=sys.stderr, flush=True))
            return
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[text]}"),
        )
        started = time.perf_counter()
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(label, total=None, text="")

            def update(done: int, total: int) -> None:
                text = progress_text(done, total, time.perf_counter() - started, unit) if total else ""
                bar.update(task, completed=done, total=total or None, text=text)

            yield update
        err.print(f"[green]✓[/] {label} [dim]({time.perf_counter() - started:.1f} s)[/]", highlight=False)

    def info(self, message: str) -> None:
        if not self.quiet:
            err.print(message, highlight=False)


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size like 8GB, 500MB, 1.5G or 1000000 (binary units, as ``human_size`` prints)."""
    import re

    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = found.group(2).upper().removesuffix("IB") if found else ""
    if found is None or unit not in _SIZE_UNITS:
        raise BadInput(f"--max-size {text!r}: give a size such as 8GB, 500MB or 1000000 (bytes)")
    return int(float(found.group(1)) * _SIZE_UNITS[unit])


def cache_listing(cache) -> dict:
    """What a build cache holds, by kind (``assemble.cache.BuildCache``): JSON-ready."""
    import time

    from adapterpack.assemble.cache import KINDS, Entry

    kinds = {kind: {"entries": 0, "bytes": 0, "last_used": None, "holds": what} for kind, what in KINDS.items()}
    unreadable = []
    counted = set()  # a file linked into several entries counts once, with the first (bases before parts)
    for entry in cache.entries(sorted(KINDS, key=lambda kind: kind != "bases")):
        if not isinstance(entry, Entry):
            unreadable.append(str(entry))
            continue
        row = kinds[entry.kind]
        row["entries"] += 1
        for inode, size in entry.stored().items():
            if inode not in counted:
                counted.add(inode)
                row["bytes"] += size
        row["last_used"] = max(row["last_used"] or 0, entry.last_used)
    legacy = cache.legacy()
    for row in kinds.values():
        if row["last_used"] is not None:
            row["last_used"] = time.strftime("%Y-%m-%d %H:%M", time.localtime(row["last_used"]))
    return {
        "folder": str(cache.folder),
        "bytes": sum(row["bytes"] for row in kinds.values()),
        "kinds": kinds,
        "unreadable": unreadable,
        "older_layout": [str(p) for p in legacy],
    }


def cache_table(listing: dict) -> Table:
    table = Table(title=f"{listing['folder']}: {human_size(listing['bytes'])}", title_justify="left")
    for column in ("kind", "entries", "size", "last used", "holds"):
        table.add_column(column, justify="right" if column in ("entries", "size") else "left")
    for kind, row in listing["kinds"].items():
        table.add_row(kind, str(row["entries"]), human_size(row["bytes"]), row["last_used"] or "-", row["holds"])
    if listing["unreadable"] or listing["older_layout"]:
        stale = len(listing["unreadable"]) + len(listing["older_layout"])
        table.add_row("(stale)", str(stale), "", "", "unreadable entries or an older adapterpack's files: `adapterpack cache prune` drops them")
    return table


def print_generation(result) -> None:
    """After the streamed text: speed on stderr, and with --compare both continuations side by side."""
    stop = "EOS" if result.stopped_at_eos else f"{len(result.tokens)} tokens"
    sys.stdout.flush()  # the streamed text first, then the figures
    err.print(
        f"{result.function}: {len(result.tokens)} tokens after a {result.prompt_tokens}-token prompt "
        f"(prefill {result.prefill_seconds:.2f} s, {result.tokens_per_second:.1f} tokens/s, {result.backend} backend; stopped at {stop})",
        highlight=False,
    )
    if result.reference_tokens is None:
        return
    table = Table(title=f"{result.function}: package vs PyTorch reference (peft, unmerged, float32)", title_justify="left")
    table.add_column(f"package ({result.backend})")
    table.add_column("reference")
    table.add_row(result.text, result.reference_text)
    out.print(table)
    if result.parted_at is None:
        out.print(f"identical: the same {len(result.tokens)} tokens", highlight=False)
    else:
        index = result.parted_at
        ours = result.tokens[index] if index < len(result.tokens) else None
        theirs = result.reference_tokens[index] if index < len(result.reference_tokens) else None
        why = ""
        if result.parting_gap is not None:
            kind = "a tie at float16 precision" if result.parting_is_tie else "not a tie"
            why = f"; the reference puts the package's token {result.parting_gap:.3g} below its own ({kind})"
        out.print(
            f"they part at generated token {index + 1}: package {ours} vs reference {theirs} "
            f"(the first {index} agree{why})",
            highlight=False,
        )


def eval_table(report) -> Table:
    """Perplexity per function, package against reference."""
    table = Table(
        title=f"eval {report.package.name} on {report.text.name}: {report.tokens} tokens, windows of {report.window} "
        f"every {report.stride} ({report.backend} backend)",
        title_justify="left",
    )
    for column in ("function", "perplexity", "reference", "ratio", "top-1 agreement", "retention"):
        table.add_column(column, justify="left" if column == "function" else "right")
    for f in report.functions:
        missing = f.reference_perplexity is None
        table.add_row(
            f.function, f"{f.perplexity:.3f}", "-" if missing else f"{f.reference_perplexity:.3f}",
            "-" if missing else f"{f.ratio:.3f}", "-" if missing else f"{f.top1_agreement:.1%}",
            "-" if f.retention is None else f"{f.retention:.3f}",
        )
    return table


def verify_table(report) -> Table:
    """The per-function checklist of a verification: the exact verdict (the package against its
    reference holding the package's weights, every drive on random ids and real text, the worse
    one shown) and the quality verdict (that reference against the float32 one on real text)."""

    table = Table(title=f"verify {report.package.name} ({report.backend} backend)", title_justify="left")
    columns = (
        "function", "compression", "exact: worse drive", "cosine", "max |err|", "top-1",
        "quality: perplexity", "agreement", "retention", "result",
    )
    left = ("function", "compression", "exact: worse drive", "result")
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    for f in report.functions:
        kept = "-" if f.retention is None else f"{f.retention:.3f}"
        quality = f.quality or {}
        ratio = f"{quality['perplexity_ratio']:.3f}x" if quality.get("perplexity_ratio") is not None else "-"
        agreement = f"{quality['agreement']:.1%}" if quality.get("agreement") is not None else "-"
        result = "[green]pass[/]" if f.passed else "[red]FAIL[/]: " + "; ".join(f.failures)
        result += f" ({f.provenance()})"
        drive = (f.drive or "-") + ("" if f.reference == "own weights" else " (vs float32)")
        table.add_row(
            f.name, f.compression, drive, f"{f.cosine:.5f}", f"{f.max_abs_error:.3g}", f"{f.top1:.1%}", ratio, agreement, kept, result,
        )
    for problem in report.integrity:
        table.add_row("(package)", "", "", "", "", "", "", "", "", f"[red]FAIL[/]: {problem}")
    return table


def print_build(result) -> None:
    """The build summary: functions, sizes, reuse, and the verification table."""
    table = Table(title=f"{result.output}", title_justify="left")
    # An .aimodel is written whole: there are no parts whose size alone could be shown.
    columns = ("function", "adapter", "lora", "compression") + (("alone",) if result.part_sizes else ())
    for column in columns:
        table.add_column(column)
    for record in result.functions:
        default = " (default)" if record.name == result.default_function else ""
        row = [record.name + default, record.adapter or "(base)", record.lora or "-", record.compression]
        if result.part_sizes:
            row.append(human_size(result.part_sizes.get(record.name, 0)))
        table.add_row(*row)
    out.print(table)
    alone = f" (functions built alone: {human_size(sum(result.part_sizes.values()))})" if result.part_sizes else ""
    reused = f"; reused from cache: {', '.join(result.reused)}" if getattr(result, "reused", None) else ""
    out.print(f"package {human_size(result.package_size)}{alone} in {result.seconds:.0f} s{reused}", highlight=False)
    if result.verify_report is not None:
        out.print(verify_table(result.verify_report))
        out.print(result.verify_report.verdict(), highlight=False)


def _signed(size: int) -> str:
    return ("-" if size < 0 else "") + human_size(abs(size))


def print_any_inspection(report, estimate, budget: list[dict], top: int) -> None:
    """The inspection of a package of any format, as its report type prints."""
    from adapterpack.formats.aimodel.inspection import AssetReport

    if isinstance(report, AssetReport):
        print_asset_inspection(report, estimate, budget)
    else:
        print_inspection(report, estimate, budget, top)


def print_inspection(report, estimate, budget: list[dict], top: int) -> None:
    default = report.default_function
    out.print(
        f"{report.path}: {len(report.functions)} function(s) (default {default}), "
        f"{human_size(report.total_bytes)} on disk",
        highlight=False,
    )
    table = Table(title="bytes per function", title_justify="left")
    for column in ("function", "unique", "shared", "references", "alone", "weights by kind"):
        table.add_column(column, justify="left" if column in ("function", "weights by kind") else "right")
    for f in report.functions:
        kinds = "; ".join(f"{kind} {human_size(size)}" for kind, size in f.bytes_by_kind.items())
        table.add_row(
            f.name + (" (default)" if f.default else ""),
            human_size(f.unique_bytes),
            human_size(f.shared_bytes),
            human_size(f.referenced_bytes),
            human_size(f.alone_bytes),
            kinds,
        )
    out.print(table)
    others = ", ".join(f"{Path(name).name} {human_size(size)}" for name, size in report.other_files.items())
    out.print(
        f"total {human_size(report.total_bytes)} = weights {human_size(report.weight_bytes)} (tensor data "
        f"{human_size(report.weight_data_bytes)} + headers/padding {human_size(report.overhead_bytes)}) + other files "
        f"{human_size(report.other_bytes)} ({others})",
        highlight=False,
    )
    out.print(
        f"stored once for 2+ functions: {human_size(report.shared_bytes)}; functions built alone: "
        f"{human_size(report.sum_alone_bytes)}; dedup ratio {report.dedup_ratio:.2f}x",
        highlight=False,
    )
    if report.unreferenced_bytes:
        out.print(f"[yellow]unreferenced weight data: {human_size(report.unreferenced_bytes)}[/]", highlight=False)

    if top:
        tensors = Table(title=f"largest tensors (top {top})", title_justify="left")
        for column in ("tensor", "functions", "size", "shape", "kind", "stored as"):
            tensors.add_column(column, justify="right" if column == "size" else "left")
        for t in report.largest(top):
            shape = "x".join("?" if d is None else str(d) for d in t.shape)
            names = t.names[0] + (f" (+{len(t.names) - 1} name(s))" if len(t.names) > 1 else "")
            tensors.add_row(names, ", ".join(t.functions), human_size(t.bytes), shape, t.kind, ", ".join(t.storage))
        out.print(tensors)

    kinds = Table(title="compression (each stored tensor once)", title_justify="left")
    for column in ("kind", "bytes", "share"):
        kinds.add_column(column, justify="left" if column == "kind" else "right")
    for kind, size in report.bytes_by_kind.items():
        share = size / report.weight_data_bytes if report.weight_data_bytes else 0.0
        kinds.add_row(kind, human_size(size), f"{share:.1%}")
    out.print(kinds)

    for finding in report.device_findings:
        out.print(f"[yellow]warning[/]: {finding.line()}", highlight=False)
    print_budget(report.shape, estimate, budget)


def print_budget(shape, estimate, budget: list[dict]) -> None:
    """The memory estimate of the heaviest function and the per-device budget table."""
    if estimate is None:
        out.print("memory budget: no keyCache state in this package, so no KV-cache size to estimate", highlight=False)
        return
    activations = f"{human_size(estimate.activation_bytes)}" if estimate.activations_known else "unknown (no vocab/hidden)"
    out.print(
        f"model: {shape.n_layers} layers, {shape.n_kv_heads} kv heads x {shape.head_dim}, max_context "
        f"{shape.max_context}, vocab {shape.vocab or '?'}, hidden {shape.hidden or '?'}. Largest function "
        f"{estimate.function}: weights {human_size(estimate.weights_bytes)} + states (KV-cache) {human_size(estimate.kv_bytes)} + "
        f"activations {activations} (estimate) = {human_size(estimate.need_bytes)}",
        highlight=False,
    )
    if shape.vocab:
        per_token = shape.logits_bytes_per_token()
        out.print(
            f"logits per call: (1, q, {shape.vocab}) float16, {human_size(per_token)} a token: "
            f"{human_size(per_token * shape.max_context)} for a {shape.max_context}-token prefill "
            "(prefill in chunks to hold less)",
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
            human_size(row["ram_bytes"]),
            human_size(row["limit_bytes"]) + ("*" if row["estimate"] else ""),
            verdict(row["fits"]),
            _signed(row["headroom_bytes"]),
            "-" if raised is None else human_size(raised),
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


def print_asset_inspection(report, estimate, budget: list[dict]) -> None:
    """``inspect`` of a Core AI ``.aimodel``: entry points, storage, memory budget."""
    out.print(
        f"{report.path}: Core AI asset, {len(report.functions)} entry point(s) (default {report.default_function}), "
        f"{human_size(report.total_bytes)} on disk (program {human_size(report.program_bytes)}; constants "
        "with identical bytes are stored once)",
        highlight=False,
    )
    table = Table(title="entry points", title_justify="left")
    for column in ("function", "adapter", "lora", "compression", "states"):
        table.add_column(column)
    for f in report.functions:
        table.add_row(
            f.name + (" (default)" if f.default else ""), f.adapter or "(base)", f.lora or "-", f.compression,
            "; ".join(f.signature["states"]),
        )
    out.print(table)
    signature = report.functions[0].signature
    out.print(f"inputs: {'; '.join(signature['inputs'])}; outputs: {'; '.join(signature['outputs'])}", highlight=False)
    stored = ", ".join(f"{kind} {count:,}" for kind, count in report.storage_elements.items())
    ops = ", ".join(f"{method} {count}" for method, count in report.compressed_ops.items() if count)
    out.print(f"stored elements by type: {stored}", highlight=False)
    out.print(f"decompressing ops (all entry points): {ops or 'none (float16 weights)'}", highlight=False)
    print_budget(report.shape, estimate, budget)
