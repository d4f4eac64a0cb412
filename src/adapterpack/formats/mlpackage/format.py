"""The Core ML ``.mlpackage`` as a ``Format``."""

from __future__ import annotations

from pathlib import Path

from adapterpack.formats.format import CardText, Format
from adapterpack.formats.listing import PackageFunctions
from adapterpack.formats.metadata import METADATA_PREFIX
from adapterpack.formats.mlpackage.digest import function_digests, weights_digest
from adapterpack.formats.mlpackage.functions import package_functions, package_metadata


def _integrity(path: Path, listing: PackageFunctions) -> list[str]:
    recorded = listing.metadata.get(METADATA_PREFIX + "weightsSha256")
    if recorded and recorded != weights_digest(path):
        return ["weight blob differs from the one written at build time (file altered?)"]
    return []


def _introduction(package_name: str, hub_name: str, max_context: int, deployment_target: str) -> str:
    return (
        f"One Core ML ML Program, `{package_name}` ({deployment_target}+), with one function per LoRA "
        f"adapter over the base `{hub_name}` and a stateful KV-cache of {max_context} positions. "
        "An app picks the function when it loads the model (`MLModelConfiguration.functionName`); weights the "
        "functions share are stored once. Built and verified by adapterpack."
    )


def _swift(package_name: str, bundle_name: str, swift_type: str, first_case: str, tokenizer: str) -> tuple[str, list[str], str]:
    code = [
        "import CoreML",
        "import Tokenizers",
        "",
        f"let folder = Bundle.main.url(forResource: \"{bundle_name}\", withExtension: nil)!",
        "let config = MLModelConfiguration()",
        "// CPU and GPU, as swift-transformers' own loadCompiled defaults to: a stateful model of this kind is",
        "// reported to fail on the Neural Engine (apple/coremltools#2716, huggingface/swift-chat#31).",
        "config.computeUnits = .cpuAndGPU",
        f"config.functionName = {swift_type}.{first_case}.rawValue   // {swift_type}.swift",
        f"let modelURL = Bundle.main.url(forResource: \"{Path(package_name).stem}\", withExtension: \"mlmodelc\")!",
        "let model = try await MLModel.load(contentsOf: modelURL, configuration: config)",
        "let tokenizer = try await AutoTokenizer.from(modelFolder: folder)",
        "let state = model.makeState()",
    ]
    lead = f"Add the folder to the app (Xcode compiles `{package_name}` to `.mlmodelc`) and {tokenizer}:"
    return lead, code, " swift-transformers' `LanguageModelWithStatefulKVCache` makes these calls."


MLPACKAGE = Format(
    name="mlpackage",
    suffix=".mlpackage",
    title="Core ML package",
    platforms="Core ML, iOS/macOS 18+",
    contracts=("swift-transformers",),
    compute_precisions=("float16",),
    libraries=("coremltools",),
    fans_out=True,
    runtime=None,
    read_functions=package_functions,
    metadata=package_metadata,
    integrity=_integrity,
    function_digests=lambda path, names: function_digests(path),
    card=CardText(library="coreml", introduction=_introduction, swift=_swift),
)
