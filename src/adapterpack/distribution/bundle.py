"""The app-ready bundle: everything an app needs to run the package, in one folder laid out like
a Hugging Face model repository (it can be uploaded as it is).

    NAME/
      README.md            model card: functions, adapters and their hashes, compression,
                           verification, evaluation, memory per device, how to load a function
      NAME.mlpackage/      the package
      AdapterFunction.swift   the functions as a Swift enum, for MLModelConfiguration.functionName
      tokenizer.json, tokenizer_config.json (chat template), special_tokens_map.json,
      generation_config.json, config.json   as the base carries them

swift-transformers looks a tokenizer up on the Hub by the package's
``co.huggingface.exporters.name``, which fails offline and for private bases; with the files in
the bundle the app loads it with ``AutoTokenizer.from(modelFolder:)``. Nothing in the bundle
depends on when or where it was made, so it is byte-reproducible like the zip.
"""

from __future__ import annotations

import logging
from pathlib import Path

from adapterpack.assemble.parts import place
from adapterpack.config.names import swift_case_name
from adapterpack.errors import BadInput
from adapterpack.files import sha256_files
from adapterpack.formats.aimodel.bundle import write_apple_bundles
from adapterpack.formats.registry import read_functions
from adapterpack.report.memory import human_size
from adapterpack.report.swift import swift_enum

log = logging.getLogger(__name__)


# What the app needs from the base's folder, as Hugging Face names them (those present are copied).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json", "config.json",
)
# At least one of these, or the app has no tokenizer to load.
REQUIRED_ANY = ("tokenizer.json", "tokenizer.model", "vocab.json")
SWIFT_TYPE = "AdapterFunction"


def check_tokenizer_files(checked) -> None:
    """BadInput (before anything is built) when the base has no tokenizer to bundle."""
    folder = checked.base.folder
    # Every file the bundle would carry is read now as it will be copied: a link leading outside
    # the base, a special file or an outsized one is refused before anything is built.
    for name in TOKENIZER_FILES:
        checked.base.shipped_file(name)
    if not any((folder / name).is_file() for name in REQUIRED_ANY):
        raise BadInput(
            f"{folder}: no tokenizer files ({', '.join(REQUIRED_ANY)}) for the release bundle: an app cannot "
            "tokenize without them; add the base's tokenizer, or pass --no-bundle"
        )
    # Shipped files must load: a truncated tokenizer.json would reach the app unnoticed.
    from adapterpack.inputs.text import load_tokenizer

    load_tokenizer(folder)


def write_bundle(folder: Path, checked, result, package: Path, *, eval_report=None) -> dict[str, str]:
    """Write the bundle into ``folder`` (new); returns {path relative to ``folder``'s parent: sha256}
    of every file in it."""
    folder.mkdir(parents=True)
    place(package, folder / package.name)
    copied = []
    for name in TOKENIZER_FILES:
        data = checked.base.shipped_file(name)
        if data is not None:
            (folder / name).write_bytes(data)
            copied.append(name)
    listing = read_functions(folder / package.name)
    (folder / f"{SWIFT_TYPE}.swift").write_text(swift_enum(listing, SWIFT_TYPE) + "\n")
    # Only a Core AI asset can follow Apple's contract (config.manifest.Export.check_for_format).
    if checked.manifest.export.contract == "apple":
        from adapterpack.inputs.checked import hf_name

        write_apple_bundles(
            folder, asset_name=package.name, functions=list(checked.manifest.function_names), name=checked.manifest.name,
            tokenizer_id=hf_name(checked), vocab_size=int(checked.base.config["vocab_size"]),
            max_context=int(checked.manifest.export.max_context), tokenizer_source=checked.base,
        )
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    hashes = {p.relative_to(folder.parent).as_posix(): sha256_files([p]) for p in files}
    card = model_card(checked, result, package.name, copied, hashes, folder.name, eval_report)
    (folder / "README.md").write_text(card)
    hashes[f"{folder.name}/README.md"] = sha256_files([folder / "README.md"])
    log.debug("bundle %s: %d files", folder, len(hashes))
    return dict(sorted(hashes.items()))


def model_card(checked, result, package_name: str, tokenizer_files: list[str], hashes: dict[str, str],
               bundle_name: str, eval_report=None) -> str:
    """The bundle's README.md: a Hugging Face model card (YAML front matter, then Markdown)."""
    from adapterpack.formats.metadata import library_versions

    manifest = checked.manifest
    card = result.format.card
    hub_name = manifest.base.tokenizer or checked.base.config.get("_name_or_path") or manifest.base.path
    lines = [
        "---",
        f"library_name: {card.library}",
        f"base_model: {hub_name}",
        "pipeline_tag: text-generation",
        f"tags: [{card.library}, lora, adapterpack, ios, macos]",
        "---",
        "",
        f"# {manifest.name}",
        "",
        card.introduction(package_name, hub_name, manifest.export.max_context, manifest.export.deployment_target),
    ]
    lines += _functions_section(checked, result)
    if result.verify_report is not None:
        lines += _verification_section(result.verify_report)
    if eval_report is not None:
        lines += _evaluation_section(eval_report)
    lines += _memory_section(result)
    first = result.functions[0].name
    if manifest.export.contract == "apple":
        lines += apple_usage(package_name, bundle_name, [f.name for f in result.functions])
    else:
        lines += swift_usage(card, package_name, bundle_name, first, tokenizer_files, manifest.export.max_context)
    lines += ["## Files", "", "| file | sha256 |", "|---|---|"]
    for path, digest in hashes.items():
        lines.append(f"| `{path.split('/', 1)[1]}` | `{digest}` |")
    versions = library_versions(result.format.libraries)
    lines += [
        "",
        "## Provenance",
        "",
        f"- base: `{manifest.base.path}`{' @ ' + manifest.base.revision if manifest.base.revision else ''}, "
        f"content sha256 `{checked.base.content_hash}`",
        "- built with " + ", ".join(f"{name} {version}" for name, version in sorted(versions.items())),
        "- `build-info.json` beside this folder records every input and setting; `SHA256SUMS` checks every file.",
        "",
    ]
    return "\n".join(lines)


def _functions_section(checked, result) -> list[str]:
    lines = [
        "",
        "## Functions",
        "",
        "| function | adapter | adapter sha256 | lora | scale | compression |",
        "|---|---|---|---|---|---|",
    ]
    for record in result.functions:
        default = " (default)" if record.name == result.default_function else ""
        adapter = checked.adapters.get(record.name)
        lines.append(
            f"| `{record.name}`{default} | {record.adapter or '(the base)'} | "
            f"{'`' + adapter.content_hash[:16] + '…`' if adapter else '-'} | {record.lora or '-'} | "
            f"{record.scale if record.scale is not None else '-'} | {record.compression} |"
        )
    return lines


def _verification_section(report) -> list[str]:
    lines = [
        "",
        "## Verification",
        "",
        f"Two verdicts per function ({report.backend} backend). *Exact*: the package, driven as {_clients(report)} drives "
        "it on random token ids and on real text, against its PyTorch reference holding the package's own weights, "
        "computed in float32 (the conversion adds no error of its own). *Quality*: that reference against the float32 "
        "one (the base's weights, the adapter applied by peft, not merged) on real text: perplexity ratio, next-token "
        "agreement and the share of the adapter's effect kept (retention).",
        "",
        "| function | exact: worse drive | cosine | top-1 | quality: perplexity | agreement | retention | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in report.functions:
        kept = "-" if f.retention is None else f"{f.retention:.3f}"
        quality = f.quality or {}
        ratio = f"{quality['perplexity_ratio']:.3f}x" if quality.get("perplexity_ratio") is not None else "-"
        agreement = f"{quality['agreement']:.1%}" if quality.get("agreement") is not None else "-"
        lines.append(
            f"| `{f.name}` | {f.drive or '-'} | {f.cosine:.5f} | {f.top1:.1%} | {ratio} | {agreement} | {kept} | "
            f"{'pass' if f.passed else 'FAIL'} |"
        )
    return lines


def _clients(report) -> str:
    drives = {drive for f in report.functions for drive in f.by_drive}
    return "Apple's Core AI Swift engine" if "apple" in drives else "swift-transformers"


def _evaluation_section(eval_report) -> list[str]:
    lines = [
        "",
        "## Evaluation",
        "",
        f"Perplexity on `{eval_report.text.name}` ({eval_report.tokens} tokens, windows of {eval_report.window} "
        f"every {eval_report.stride}), package against its reference:",
        "",
        "| function | perplexity | reference | ratio | top-1 agreement |",
        "|---|---|---|---|---|",
    ]
    for f in eval_report.functions:
        if f.reference_perplexity is None:
            lines.append(f"| `{f.function}` | {f.perplexity:.3f} | - | - | - |")
        else:
            lines.append(
                f"| `{f.function}` | {f.perplexity:.3f} | {f.reference_perplexity:.3f} | {f.ratio:.3f} | {f.top1_agreement:.1%} |"
            )
    return lines


def _memory_section(result) -> list[str]:
    from adapterpack.config.devices import DEVICES
    from adapterpack.report.inspectors import inspect_either
    from adapterpack.report.memory import budget_rows, memory_estimate

    lines: list[str] = []
    inspection = inspect_either(Path(result.output))
    estimate = memory_estimate(inspection)
    rows = budget_rows(inspection, estimate, list(DEVICES)) if estimate is not None else []
    if rows:
        lines += [
            "",
            "## Memory on device",
            "",
            f"The largest function needs about {human_size(estimate.weights_bytes + estimate.kv_bytes + estimate.activation_bytes)} "
            f"(weights {human_size(estimate.weights_bytes)}, KV-cache {human_size(estimate.kv_bytes)}, activations "
            f"{human_size(estimate.activation_bytes)}). Limits are per-app memory limits, most estimated from public "
            "developer reports (see `adapterpack inspect`).",
            "",
            "| device | RAM | app limit | fits | headroom |",
            "|---|---|---|---|---|",
        ]
        for row in rows:
            headroom = row["headroom_bytes"]
            lines.append(
                f"| {row['name']} | {human_size(row['ram_bytes'])} | {human_size(row['limit_bytes'])} | "
                f"{'yes' if row['fits'] else 'no'} | {'-' if headroom < 0 else human_size(headroom)} |"
            )
    return lines


def swift_usage(card, package_name: str, bundle_name: str, first: str, tokenizer_files: list[str], max_context: int) -> list[str]:
    """The model card's "Use from Swift" section, in the words of the package's format."""
    tokenizer = (
        "[swift-transformers](https://github.com/huggingface/swift-transformers) for the tokenizer, which loads from "
        f"the bundled files{' (' + ', '.join(tokenizer_files) + ')' if tokenizer_files else ''}"
    )
    contract = (
        f"Each call takes `inputIds` (Int32, 1 x n) and `causalMask` (Float16, 1 x 1 x n x end) and updates the "
        f"function's states (its KV-cache). Prefill with the prompt, then one token per call, at most {max_context - 1} "
        "tokens in all."
    )
    lead, code, note = card.swift(package_name, bundle_name, SWIFT_TYPE, swift_case_name(first), tokenizer)
    return ["", "## Use from Swift", "", lead, "", "```swift", *code, "```", "", contract + note, ""]


def apple_usage(package_name: str, bundle_name: str, functions: list[str]) -> list[str]:
    """The model card's "Use from Swift" section for Apple's runtime contract (``formats.aimodel.bundle``)."""
    first = functions[0]
    return [
        "",
        "## Use from Swift",
        "",
        f"Each function has its own bundle folder here ({', '.join(f'`{f}/`' for f in functions)}), which Apple's "
        "Core AI runtime for language models ([apple/coreai-models](https://github.com/apple/coreai-models), "
        "product `CoreAILM`) loads as a FoundationModels `LanguageModel`. Add this folder to the app as a folder "
        f"reference (so that each bundle finds `../{package_name}`, which all of them share), then:",
        "",
        "```swift",
        "import CoreAILanguageModels",
        "import FoundationModels",
        "",
        f'let url = Bundle.main.url(forResource: "{first}", withExtension: nil, subdirectory: "{bundle_name}")!',
        "let model = try await CoreAILanguageModel(resourcesAt: url)",
        "let session = LanguageModelSession(model: model)",
        'let response = try await session.respond(to: "...")',
        "print(response.content)",
        "```",
        "",
        "The runtime runs the function the bundle's `metadata.json` names (`language.function_map.main`), sends the "
        "position ids and grows the KV-cache itself; tokenization and the chat template come from the bundle's "
        "`tokenizer/` folder.",
        "",
    ]
