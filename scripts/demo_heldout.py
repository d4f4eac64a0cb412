"""Write adapters/demo/heldout.txt: text for `adapterpack eval` that the demo never trained on.

It comes from the same standard-library sources as the demo's training text (scripts/train_demo.py)
but only from the files that script holds out (every HELD_OUT_EVERY-th one): their source with
docstrings removed, then their docstring prose, as the `code` and `docs` corpora are made.

    .venv/bin/python scripts/demo_heldout.py
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_demo  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "adapters" / "demo" / "heldout.txt"
CODE_BYTES = 4000
PROSE_BYTES = 3000


def held_out_sources() -> tuple[list[str], list[str]]:
    """(code with docstrings removed, docstring prose paragraphs) of the files the demo's
    training holds out, as its ``code`` and ``docs`` corpora are made."""
    code, prose = [], []
    for index, (_path, text) in enumerate(train_demo.stdlib_sources()):
        if index % train_demo.HELD_OUT_EVERY:
            continue  # a training file
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        code.append(train_demo.strip_docstrings(text, tree))
        for _owner, expr in train_demo._docstring_nodes(tree):
            prose.extend(train_demo.prose_paragraphs(inspect.cleandoc(expr.value.value)))
    return code, prose


def main() -> None:
    code, prose = held_out_sources()
    text = "\n".join(code)[:CODE_BYTES].rsplit("\n", 1)[0] + "\n\n" + "\n\n".join(prose)[:PROSE_BYTES].rsplit("\n", 1)[0] + "\n"
    OUT.write_text(text, encoding="utf-8")
    print(f"{OUT}: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
