"""Bundles Apple's Core AI Swift runtime loads: one folder per function of an asset of Apple's
contract, what ``CoreAILanguageModel(resourcesAt:)`` takes and FoundationModels'
``LanguageModelSession(model:)`` runs.

    NAME/
      NAME.aimodel/            the asset, every function, stored once
      code/metadata.json       assets.main "../NAME.aimodel", language.function_map {"main": ["code"]}
      code/tokenizer/          tokenizer.json, tokenizer_config.json (chat template), ...
      docs/...

Read from apple/coreai-models at 86b363d (``swift/Sources``):
- ``CoreAIShared/Bundle/ModelBundle.swift``: a bundle is a folder with ``metadata.json``;
  ``metadata_version`` must be "0.2"; ``kind``, ``name`` required, ``assets`` and ``user_data``
  optional; an asset path is resolved with ``bundlePath.appending(path:)``, so a path relative
  to the bundle, ``..`` included, names a file beside it: every function's bundle shares one
  asset (one asset per bundle would store the whole asset once per function instead).
- ``CoreAIShared/Bundle/BundleKind.swift``: ``kind`` is llm, vlm, diffusion, segmenter or
  speech_recognizer.
- ``CoreAILanguageModels/Bundle/LanguageBundle.swift``: kind llm (or vlm), ``assets.main`` and
  ``language`` required; the tokenizer is ``tokenizer/tokenizer.json`` inside the bundle when it
  is there, else fetched by the ``language.tokenizer`` id.
- ``CoreAILanguageModels/Bundle/LanguageConfig.swift``: ``language`` holds ``tokenizer``,
  ``vocab_size``, ``max_context_length`` (required), ``embedded_tokenizer`` (default true),
  ``function_map`` (role -> function names), ``vision``, ``states`` (state -> kv_cache,
  sliding_cache or fixed), all optional.
- ``CoreAILanguageModels/LanguageModel/CoreAIRunner.swift``: the function run is
  ``function_map["main"][0]``, else ``main``; ``max_context_length`` bounds the caches the
  engine grows (``formats.aimodel.engine``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from adapterpack.errors import BadInput

METADATA_VERSION = "0.2"
METADATA_FILE = "metadata.json"
TOKENIZER_FOLDER = "tokenizer"
# What the Swift tokenizer loader reads from tokenizer/ (swift-transformers' AutoTokenizer.from(modelFolder:)).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "tokenizer.model", "vocab.json", "merges.txt",
)


class _Decoded(BaseModel):
    # Swift's Codable ignores keys it does not decode, so does the schema; it converts no type
    # (a "8" is no Int), so neither does the schema.
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


class Assets(_Decoded):
    main: str = Field(min_length=1, description="The .aimodel, relative to the bundle folder")


class Language(_Decoded):
    tokenizer: str = Field(min_length=1, description="Tokenizer id (Hugging Face), used when none is embedded")
    vocab_size: int = Field(gt=0)
    max_context_length: int = Field(gt=0, description="The most tokens the engine's growing caches hold")
    embedded_tokenizer: bool = True
    function_map: dict[str, list[str]] | None = Field(default=None, description="Role -> function names; main: the function run")
    states: dict[str, Literal["kv_cache", "sliding_cache", "fixed"]] | None = None


class BundleMetadata(_Decoded):
    """``metadata.json`` of a language-model bundle, as the Swift decoders read it."""

    metadata_version: Literal["0.2"]
    kind: Literal["llm", "vlm", "diffusion", "segmenter", "speech_recognizer"]
    name: str
    assets: Assets
    language: Language
    user_data: dict[str, str] | None = None


def bundle_metadata_schema() -> dict:
    """JSON Schema of a bundle's ``metadata.json`` (what ``write_apple_bundles`` checks)."""
    return BundleMetadata.model_json_schema()


def write_apple_bundles(
    folder: Path, *, asset_name: str, functions: list[str], name: str, tokenizer_id: str, vocab_size: int,
    max_context: int, tokenizer_source,
) -> list[Path]:
    """One bundle folder per function inside ``folder`` (which holds ``asset_name``); returns
    every file written. ``tokenizer_source``: the base (``inputs.base.BaseInfo``), whose
    tokenizer files are copied as it ships them. Each ``metadata.json`` is checked against
    ``BundleMetadata``."""
    written: list[Path] = []
    for function in functions:
        bundle = folder / function
        tokenizer = bundle / TOKENIZER_FOLDER
        tokenizer.mkdir(parents=True)
        for file_name in TOKENIZER_FILES:
            data = tokenizer_source.shipped_file(file_name)
            if data is not None:
                (tokenizer / file_name).write_bytes(data)
                written.append(tokenizer / file_name)
        metadata = BundleMetadata(
            metadata_version=METADATA_VERSION,
            kind="llm",
            name=f"{name}-{function}",
            assets=Assets(main=f"../{asset_name}"),
            language=Language(
                tokenizer=tokenizer_id, vocab_size=vocab_size, max_context_length=max_context,
                embedded_tokenizer=True, function_map={"main": [function]},
            ),
        )
        text = json.dumps(metadata.model_dump(mode="json", exclude_none=True), indent=2, sort_keys=True) + "\n"
        BundleMetadata.model_validate_json(text)  # what is written is what the schema accepts
        (bundle / METADATA_FILE).write_text(text)
        written.append(bundle / METADATA_FILE)
    return written


def load_bundle(folder: Path) -> tuple[Path, str, int, Path | None]:
    """What Apple's runtime takes from a bundle folder (``LanguageBundle(at:)`` then
    ``CoreAIRunner.makeConfig``): (the asset, the function it runs, the most tokens its caches
    hold, the embedded tokenizer folder or None). Bad input where the Swift decoders throw."""
    from pydantic import ValidationError

    if folder.suffix in (".aimodel", ".aimodelc"):
        raise BadInput(f"{folder}: a model asset, not a model bundle directory (BundleError.pointedAtModelAsset)")
    try:
        metadata = BundleMetadata.model_validate_json((folder / METADATA_FILE).read_bytes())
    except OSError as error:
        raise BadInput(f"{folder / METADATA_FILE}: {error.strerror or error}") from None
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadInput(f"{folder / METADATA_FILE}: {where}: {first['msg']}") from None
    if metadata.kind not in ("llm", "vlm"):
        raise BadInput(f"{folder / METADATA_FILE}: expected bundle kind llm, got {metadata.kind}")
    # ModelBundle.resolveAssetURL: bundlePath.appending(path:), the file system resolving "..".
    asset = Path(folder, metadata.assets.main)
    if not asset.exists():
        raise BadInput(f"{folder / METADATA_FILE}: asset 'main' not found at {asset}")
    function_map = metadata.language.function_map or {}
    function = (function_map.get("main") or ["main"])[0]
    tokenizer = folder / TOKENIZER_FOLDER
    return asset.resolve(), function, metadata.language.max_context_length, tokenizer if (tokenizer / "tokenizer.json").is_file() else None
