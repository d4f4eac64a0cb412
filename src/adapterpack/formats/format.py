"""What a package format is to the rest of adapterpack: ``Format``.

Each format (``formats.mlpackage``, ``formats.aimodel``) describes itself with one ``Format``;
``formats.registry`` holds them. Code outside this layer asks a format for what it needs (its
reader, integrity check, digests, the runtime that must run it, its card text) and never tests
which format it holds or what a path ends with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from adapterpack.formats.listing import PackageFunctions

if TYPE_CHECKING:  # numpy loads with the first function that runs, not with the CLI
    import numpy as np

# A session of one function, as a runtime gives it: (inputIds, causalMask) -> logits (tokens,
# vocab), each call reading and updating the session's state.
Predict = Callable[["np.ndarray", "np.ndarray"], "np.ndarray"]


@dataclass(frozen=True)
class CardText:
    """What a release's model card says of a package of this format."""

    library: str  # Hugging Face card's library_name and tag
    # (package file name, hub name, max_context, deployment target) -> the card's opening paragraph
    introduction: Callable[[str, str, int, str], str]
    # (package file name, bundle folder, Swift type, first case, tokenizer sentence) -> (lead, code lines, contract note)
    swift: Callable[[str, str, str, str, str], tuple[str, list[str], str]]


@dataclass(frozen=True)
class Format:
    name: str  # as the manifest's export.format and --format say it
    suffix: str  # of a package of this format
    title: str  # in messages: "Core ML package"
    platforms: str  # what runs it, in help texts: "Core ML, iOS/macOS 18+"
    # What the manifest's export may ask of it: how apps call its functions (the first is the
    # default), and the precisions it computes in.
    contracts: tuple[str, ...]
    compute_precisions: tuple[str, ...]
    # Libraries besides torch, transformers and peft whose versions shape the package's bytes.
    libraries: tuple[str, ...]
    # Built one function per part and merged (fan-out, merge); else written whole in one session.
    fans_out: bool
    # The backend that runs it whatever --backend says (None: the user's choice).
    runtime: str | None
    read_functions: Callable[[Path], PackageFunctions]
    metadata: Callable[[Path], dict[str, str]]
    # (package, its listing) -> what no longer matches what was written (empty: intact)
    integrity: Callable[[Path, PackageFunctions], list[str]]
    # (package, function names) -> each function's digest (equal digests, equal bytes run)
    function_digests: Callable[[Path, list[str]], dict[str, str]]
    card: CardText
