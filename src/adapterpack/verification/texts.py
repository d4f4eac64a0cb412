"""The token sequences verify runs every function on: seeded random ids, and real text as an app
sends it.

Random ids reach every token of the vocabulary but never what real prompts do: a pretrained
checkpoint puts its massive activations on the first token of real text (the BOS, a chat
template's opening token), which random ids do not start with (Gemma 3 270M: 103,821 at
``<bos>``, 35,897 on random ids). So each function also runs on real text: its own calibration
text where the manifest names one, else a short English sample shipped with adapterpack, put
through the base's chat template as swift-transformers' ``applyChatTemplate`` renders it, or,
without a template, encoded as its tokenizer encodes a prompt (with the BOS it adds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adapterpack.config.manifest import VerifySettings
from adapterpack.verification.drives import verification_tokens

log = logging.getLogger(__name__)

SAMPLE = Path(__file__).with_name("english_sample.txt")
# Real-text tokens per function the quality verdict scores (fewer when max_context is smaller):
# enough for a perplexity, few enough that a 128k vocabulary's float32 logits stay small (65 MB).
QUALITY_TOKENS = 128
# Characters of a text tried first (a calibration text may be megabytes long): about four per token.
_FIRST_CHARACTERS = 8 * QUALITY_TOKENS


@dataclass(frozen=True)
class VerifyTokens:
    """What every function runs on: ``random`` ids, and by function its ``text`` ids (each as
    long as the others), or none with the ``reason``."""

    random: np.ndarray
    text: dict[str, np.ndarray] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # by function: what its text is
    reason: str | None = None  # why there is no real text

    def drive_text(self, function: str, settings: VerifySettings) -> np.ndarray | None:
        """The real-text ids the drives send for ``function``: as many as the random ones."""
        found = self.text.get(function)
        return None if found is None else found[: settings.prefill + settings.decode_steps]

    def groups(self) -> list[tuple[np.ndarray, list[str]]]:
        """[(text ids, the functions that run on them)]: functions sharing a text share a pass."""
        found: dict[bytes, tuple[np.ndarray, list[str]]] = {}
        for function, ids in self.text.items():
            found.setdefault(ids.tobytes(), (ids, []))[1].append(function)
        return list(found.values())


def verify_tokens(checked, names: list[str]) -> VerifyTokens:
    """The random ids and each of ``names``' real text (``checked``: inputs.checked.CheckedInputs)."""
    from adapterpack.inputs.text import chat_template, load_tokenizer

    manifest = checked.manifest
    # The Swift client's mask is one slot wider than the tokens, so it holds max_context - 1 of them.
    limit = int(manifest.export.max_context) - 1
    random = verification_tokens(int(_text_config(checked.base.config)["vocab_size"]), manifest.verify)[:limit]
    folder = checked.base.folder
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return VerifyTokens(random, reason=f"{folder} has no tokenizer files: no real-text drive")
    tokenizer = load_tokenizer(folder)
    template = chat_template(folder)
    want = min(QUALITY_TOKENS, limit)
    texts, sources = {}, {}
    for function in names:
        calibration = checked.calibration.get(function)  # the base's is under include_base
        text = calibration.text if calibration is not None else SAMPLE.read_text(encoding="utf-8")
        source = calibration.path.name if calibration is not None else "adapterpack's English sample"
        texts[function] = _encoded(tokenizer, template, folder, text, want)
        sources[function] = f"{source}, {'through the chat template' if template else 'as the tokenizer encodes a prompt'}"
    length = min(len(ids) for ids in texts.values())
    if length < 2:
        return VerifyTokens(random, reason="the real text encodes to fewer than 2 tokens: no real-text drive")
    return VerifyTokens(random, {f: np.asarray(ids[:length], np.int64) for f, ids in texts.items()}, sources)


def _encoded(tokenizer, template: str | None, folder: Path, text: str, want: int) -> list[int]:
    """At least ``want`` ids of ``text`` as an app sends it (fewer when the text has no more)."""
    from adapterpack.inputs.text import encode_chat

    characters = _FIRST_CHARACTERS
    while True:
        excerpt = text[:characters]
        ids = encode_chat(tokenizer, template, excerpt, folder) if template else list(tokenizer(excerpt).input_ids)
        if len(ids) >= want or characters >= len(text):
            return ids[:want]
        characters *= 4


def _text_config(config: dict) -> dict:
    # multimodal configs nest the decoder's under text_config
    return config.get("text_config") or config
