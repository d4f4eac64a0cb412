"""Byte-level tokenizer of the demo model in ``adapters/demo``.

The demo model reads raw UTF-8 bytes: ids 0-255 are the bytes themselves and three special
tokens follow. A byte vocabulary needs no training data and no merges file, so any machine can
rebuild it exactly, and every string (code, prose, non-ASCII) round-trips.

``encode``/``decode`` are plain Python (no dependencies) so tests and READMEs can sample the
model without loading a Hugging Face tokenizer. ``write_hf_tokenizer`` writes the same
tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` for apps that load tokenizers the
Hugging Face way (``transformers.AutoTokenizer``, swift-transformers): a byte-level BPE with an
empty merge list, whose ids are identical to ``encode``'s.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIAL_TOKENS = {BOS: BOS_ID, EOS: EOS_ID, PAD: PAD_ID}
# Ids the tokenizer can produce. The model's embedding has VOCAB_SIZE rows: padded to a multiple
# of 8 for friendlier matrix shapes; the padding rows are never produced by the tokenizer.
NUM_TOKENS = 259
VOCAB_SIZE = 264
MODEL_MAX_LENGTH = 512


def encode(text: str, add_bos: bool = True) -> list[int]:
    """UTF-8 bytes of ``text`` as ids, after ``<bos>`` unless ``add_bos`` is false.

    The default matches ``tokenizer.json`` (whose post-processor prepends ``<bos>``), so a prompt
    encoded here and one encoded by an app give the model the same ids.
    """
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def decode(ids) -> str:
    """Text of ``ids``: special and padding ids are dropped, bytes decoded as UTF-8.

    Invalid UTF-8 (a model can stop in the middle of a multi-byte character) becomes U+FFFD,
    as the ``tokenizers`` ByteLevel decoder does.
    """
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (the ByteLevel alphabet).

    Byte-level BPE vocabularies store bytes as these characters; printable ASCII and Latin-1
    map to themselves, the rest to code points from U+0100 upwards.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_hf_tokenizer():
    """The byte tokenizer as a ``tokenizers.Tokenizer`` (ids identical to :func:`encode`)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    # No merges: BPE then maps every byte-character to its own id, i.e. id == byte value.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: without merges, word splitting cannot change the ids, so skip it.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order, so they get 256, 257, 258.
    tokenizer.add_special_tokens(
        [AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS]
    )
    assert all(tokenizer.token_to_id(t) == i for t, i in SPECIAL_TOKENS.items())
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)],
    )
    return tokenizer


def write_hf_tokenizer(directory: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_hf_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        # The generic class: transformers loads tokenizer.json as is, and swift-transformers
        # maps it (after dropping "Fast") to its BPE tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": tok,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for tok, i in SPECIAL_TOKENS.items()
        },
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
