"""The Core AI ``.aimodel`` as a ``Format``."""

from __future__ import annotations

from pathlib import Path

from adapterpack.formats.aimodel.asset import PROGRAM_FILE, asset_functions, asset_metadata, program_digest, program_intact
from adapterpack.formats.format import CardText, Format
from adapterpack.formats.listing import PackageFunctions

# What runs an .aimodel, whatever --backend says: Apple's Core AI runtime (on the CPU off device).
CORE_AI_RUNTIME = "coreai-cpu"


def _integrity(path: Path, listing: PackageFunctions) -> list[str]:
    return [] if program_intact(path) else [f"{PROGRAM_FILE} differs from the digest written beside it (file altered?)"]


def _introduction(package_name: str, hub_name: str, max_context: int, deployment_target: str) -> str:
    return (
        f"One Core AI asset, `{package_name}` (iOS/macOS 27+), with one entry point per LoRA adapter over the base "
        f"`{hub_name}` and a stateful KV-cache of {max_context} positions. An app loads the entry "
        "point it needs (`AIModel.loadFunction(named:)`); weights the entry points share are stored once. Built and "
        "verified by adapterpack (with Core AI's own runtime)."
    )


def _swift(package_name: str, bundle_name: str, swift_type: str, first_case: str, tokenizer: str) -> tuple[str, list[str], str]:
    code = [
        "import CoreAI",
        "import Tokenizers",
        "",
        f"let folder = Bundle.main.url(forResource: \"{bundle_name}\", withExtension: nil)!",
        f"let model = try await AIModel(contentsOf: folder.appending(path: \"{package_name}\"))",
        f"let function = try model.loadFunction(named: {swift_type}.{first_case}.rawValue)!   // {swift_type}.swift",
        "let tokenizer = try await AutoTokenizer.from(modelFolder: folder)",
        "// States keyCache, valueCache, writtenSlots: zero-filled, shaped as function.descriptor says; each",
        "// run(inputs:states:) reads and updates them.",
        "let outputs = try await function.run(inputs: [\"inputIds\": ids, \"causalMask\": mask], states: states)",
    ]
    return f"Add the folder to the app and {tokenizer}:", code, ""


AIMODEL = Format(
    name="aimodel",
    suffix=".aimodel",
    title="Core AI asset",
    platforms="Core AI, iOS/macOS 27+",
    contracts=("swift-transformers", "apple"),
    compute_precisions=("float16", "float32"),
    libraries=("coreai-core", "coreai-torch"),
    # Core AI shares weights only between entry points converted in one session, so separate
    # jobs' assets could not be merged without storing the base again.
    fans_out=False,
    runtime=CORE_AI_RUNTIME,
    read_functions=asset_functions,
    metadata=asset_metadata,
    integrity=_integrity,
    # One program holds every entry point: its digest stands for each function's bytes.
    function_digests=lambda path, names: dict.fromkeys(names, program_digest(path)),
    card=CardText(library="coreai", introduction=_introduction, swift=_swift),
)
