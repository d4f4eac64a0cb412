"""MkDocs hooks: the manifest and command-line references, generated at every docs build from
the code itself (the manifest's pydantic schema, the typer app), so neither can drift from what
adapterpack accepts, and benchmark tables, rendered from the results the benchmarks wrote. A page
asks for one with a marker line: ``<!-- manifest-reference -->``, ``<!-- cli-reference -->`` or
``<!-- benchmark: NAME TABLE -->`` (table TABLE of ``benchmarks/results/NAME.json``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
BENCHMARK_MARKER = re.compile(r"<!-- benchmark: ([\w.-]+) ([\w.-]+) -->")


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, generate in {"<!-- manifest-reference -->": manifest_reference, "<!-- cli-reference -->": cli_reference}.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return BENCHMARK_MARKER.sub(lambda found: benchmark_table(found[1], found[2]), markdown)


def benchmark_table(name: str, table: str) -> str:
    """Table ``table`` of ``benchmarks/results/NAME.json`` in Markdown, then what measured it: the
    command, the machine, the commit and the date. A missing result or table fails the build."""
    result = json.loads((RESULTS / f"{name}.json").read_text())
    found = result["tables"][table]
    lines = ["| " + " | ".join(found["columns"]) + " |", "|" + "---|" * len(found["columns"])]
    lines += ["| " + " | ".join(row) + " |" for row in found["rows"]]
    machine = result["machine"]
    lines += [
        "",
        f"*Measured by `{result['command']}` on {result['date']}, at commit {machine.get('adapterpack_commit') or 'unknown'}: "
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, Python {machine['python']}, "
        f"torch {machine['torch']} (`benchmarks/results/{name}.json`).*",
    ]
    return "\n".join(lines)


def _type(schema: dict | bool) -> str:
    """A short type name for one property's schema."""
    if not isinstance(schema, dict):
        return "any"
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "anyOf" in schema:
        return " \\| ".join(_type(option) for option in schema["anyOf"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"mapping to {_type(schema['additionalProperties'])}"
    return {"null": "null", "string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}.get(kind, kind)


def _default(name: str, schema: dict, required: set[str]) -> str:
    if name in required:
        return "required"
    if "default" not in schema:
        return ""
    value = schema["default"]
    if isinstance(value, dict):
        return "see below"
    return f"`{json.dumps(value)}`"


def _table(title: str, schema: dict) -> list[str]:
    required = set(schema.get("required", []))
    lines = [f"### {title}", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, prop in schema.get("properties", {}).items():
        meaning = " ".join(prop.get("description", "").split()).replace("|", "\\|").replace("[", "\\[")
        lines.append(f"| `{name}` | {_type(prop)} | {_default(name, prop, required)} | {meaning} |")
    return lines + [""]


def manifest_reference() -> str:
    """Every key of the manifest, from ``manifest_json_schema()``: one table per section."""
    from adapterpack.config.manifest import manifest_json_schema

    schema = manifest_json_schema()
    lines = _table("Manifest", schema)
    for name, section in schema.get("$defs", {}).items():
        lines += _table(name, section)
    return "\n".join(lines)


def cli_reference() -> str:
    """Every command, its arguments and options, from the typer app (typer's own docs writer)."""
    import typer
    from typer.cli import get_docs_for_click

    from adapterpack.cli.app import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="adapterpack", title="adapterpack")
    # One level below the page's own headings; code blocks are left alone.
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and re.match(r"^#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out)
