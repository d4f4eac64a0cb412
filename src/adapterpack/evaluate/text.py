"""Text in and out of a package: its tokenizer (from the manifest's base, or from the release
bundle the package sits in), its context limit, and a user's text file read safely."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.formats.registry import read_functions
from adapterpack.inputs.text import chat_template, encode_chat, load_tokenizer

log = logging.getLogger(__name__)


# Files a Hugging Face tokenizer is loaded from (any one of the first two is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class PackageText:
    """What running a package on text needs: its tokenizer, stop tokens and context limit."""

    package: Path
    functions: list[str]
    tokenizer: object  # transformers PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    max_context: int
    manifest: object | None = None  # the Manifest the package is run against, if any
    folder: Path | None = None  # where the tokenizer files are

    @property
    def max_tokens(self) -> int:
        """Tokens a sequence may hold: the Swift client's mask is one wider than the tokens."""
        return self.max_context - 1

    def check_function(self, function: str) -> None:
        """BadInput unless the package, and the manifest when there is one, have ``function``."""
        if function not in self.functions:
            raise BadInput(f"{self.package}: no function {function!r}: it has {', '.join(self.functions)}")
        if self.manifest is not None and function not in self.manifest.function_names:
            raise BadInput(f"{self.manifest.source}: no function {function!r}: the package is not built from this manifest")

    def encode(self, text: str, *, where: str = "--prompt") -> list[int]:
        _check_utf8(text, where)
        ids = list(self.tokenizer(text).input_ids)
        if not ids:
            raise BadInput(f"{where}: the text encodes to no tokens")
        return ids

    def chat_template(self) -> str:
        """The chat template swift-transformers renders (``inputs.text.chat_template``)."""
        folder = self.folder or Path(".")
        found = chat_template(folder)
        if found is None:
            raise BadInput(f"{folder}: the tokenizer has no chat template (chat_template.jinja or a chat_template entry); drop --chat")
        return found

    def encode_chat(self, message: str, *, where: str = "--prompt") -> list[int]:
        """``message`` as one user turn, as swift-transformers' ``applyChatTemplate(messages:)``
        makes it (``inputs.text.encode_chat``)."""
        _check_utf8(message, where)
        ids = encode_chat(self.tokenizer, self.chat_template(), message, self.folder)
        if not ids:
            raise BadInput(f"{where}: the chat prompt encodes to no tokens")
        return ids


def _check_utf8(text: str, where: str) -> None:
    # Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer can encode.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadInput(f"{where}: not UTF-8 text (character {error.start})") from None


def tokenizer_folder(package: Path, checked=None) -> Path:
    """Where the tokenizer files are: beside the package in a release bundle, else the
    manifest's base; BadInput when neither has them."""
    bundle = package.resolve().parent
    if any((bundle / name).is_file() for name in TOKENIZER_FILES):
        return bundle
    if checked is not None:
        folder = checked.base.folder
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            return folder
        raise BadInput(f"{folder}: the base has no tokenizer files ({' or '.join(TOKENIZER_FILES)})")
    raise BadInput(
        f"{package}: no tokenizer files beside it ({' or '.join(TOKENIZER_FILES)}, as a release bundle has): "
        "pass --manifest to take the base's"
    )


def package_text(package: str | Path, checked=None) -> PackageText:
    """The tokenizer and limits of ``package`` (``checked``: the manifest's CheckedInputs, for
    its base's tokenizer)."""
    import json

    package = Path(package)
    if not package.exists():
        raise BadInput(f"{package}: package not found")
    listing = read_functions(package)
    folder = tokenizer_folder(package, checked)
    tokenizer = load_tokenizer(folder)
    eos = set()
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            found = json.loads(generation.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            found = None
        eos.update(int(i) for i in (found if isinstance(found, list) else [found]) if isinstance(i, int))
    try:
        max_context = int(listing.metadata["co.adapterpack.maxContext"])
    except (KeyError, ValueError):
        raise BadInput(f"{package}: not built by adapterpack (no maxContext in its metadata)") from None
    return PackageText(
        package, listing.names, tokenizer, frozenset(eos), max_context, checked.manifest if checked is not None else None, folder
    )


