"""The user's text and tokenizer files, read safely: a text file named for a command (a prompt, a
text to score, a calibration text) and the tokenizer of a base or a release bundle."""

from __future__ import annotations

from pathlib import Path

from adapterpack.errors import BadInput
from adapterpack.files import refuse_special_file

# Bytes that do not occur in text: a file holding them is binary.
_BINARY = set(range(0, 9)) | {11, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 127}


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's content; BadInput naming it when it is missing, empty or binary."""
    path = Path(path)
    # A FIFO or device named as the text would block the read forever.
    refuse_special_file(path, "a UTF-8 text file")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise BadInput(f"{path}: cannot read: {error.strerror or error}") from None
    if not data.strip():
        raise BadInput(f"{path}: the text file is empty")
    if any(byte in _BINARY for byte in data[:65536]):
        raise BadInput(f"{path}: not a text file (it holds control bytes); give UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BadInput(f"{path}: not UTF-8 text (byte {error.start})") from None


def load_tokenizer(folder: Path):
    """The tokenizer in ``folder``, loaded as an app's client would and tried on one string;
    BadInput naming the folder when its files cannot be (a truncated tokenizer.json, a
    mistyped tokenizer_config.json key: transformers raises many kinds of error for those)."""
    from adapterpack.quiet import captured_output

    try:
        with captured_output():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
            tokenizer("a")
    except Exception as error:  # noqa: BLE001 - any failure of the user's files is bad input
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise BadInput(f"{folder}: the tokenizer files cannot be loaded: {first}") from None
    return tokenizer


def chat_template(folder: Path) -> str | None:
    """The chat template swift-transformers renders (Hub.swift, LanguageModelConfigurationFromHub
    at eec09bd): ``chat_template.jinja`` first, then ``chat_template.json``, then
    ``tokenizer_config.json``'s ``chat_template`` (a list: the entry named ``default``); None
    when the tokenizer has none."""
    import json

    try:
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        for name in ("chat_template.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                found = json.loads((folder / name).read_text(encoding="utf-8")).get("chat_template")
                if isinstance(found, list):
                    found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
                if isinstance(found, str):
                    return found
    except (OSError, ValueError, AttributeError) as error:
        raise BadInput(f"{folder}: the chat template cannot be read: {error}") from None
    return None


def encode_chat(tokenizer, template: str, message: str, folder: Path) -> list[int]:
    """``message`` as one user turn, as swift-transformers' ``applyChatTemplate(messages:)``
    makes it (TokenizersTemplates.swift at eec09bd): ``template`` rendered with ``messages``,
    ``add_generation_prompt: true`` and the tokenizer's special tokens, then encoded with
    ``addSpecialTokens: false`` (no BOS added: the template writes what it needs)."""
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], chat_template=template, add_generation_prompt=True, tokenize=False,
        )
    except Exception as error:  # jinja2's errors: a template this tokenizer cannot render
        raise BadInput(f"{folder}: the chat template cannot be rendered: {type(error).__name__}: {error}") from None
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)
