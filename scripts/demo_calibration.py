"""Write adapters/demo/calibration/: each demo function's own text, for data-aware compression.

``manifests/demo.yaml`` names one text per function (``base.calibration`` and each adapter's
``calibration``): palettes are weighted by the activations these texts cause, and
``compression.auto`` measures each function on its own. They come from the sources
scripts/train_demo.py trains on: ``code`` and ``docs`` from the held-out standard-library files
(after the part ``adapters/demo/heldout.txt`` takes, so calibration and evaluation text differ),
``zen`` from its own training text (the Zen of Python, then Python's LICENSE), the base from
code and prose alike.

    .venv/bin/python scripts/demo_calibration.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import demo_heldout  # noqa: E402
import train_demo  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "adapters" / "demo" / "calibration"
TEXT_BYTES = 3000  # the byte-level demo tokenizer reads 2,048 of them (inputs.calibration.CALIBRATION_TOKENS)


def _cut(text: str, start: int, size: int) -> str:
    """``size`` bytes of ``text`` from ``start``, whole lines only."""
    piece = text[start : start + size]
    return piece.split("\n", 1)[-1].rsplit("\n", 1)[0] + "\n"


def main() -> None:
    code, prose = demo_heldout.held_out_sources()
    code_text, prose_text = "\n".join(code), "\n\n".join(prose)
    license_path = train_demo.stdlib_root() / "LICENSE.txt"
    license_text = license_path.read_text(encoding="utf-8") if license_path.is_file() else ""
    # past what heldout.txt takes from the same held-out files
    code_start, prose_start = 2 * demo_heldout.CODE_BYTES, 2 * demo_heldout.PROSE_BYTES
    texts = {
        "code": _cut(code_text, code_start, TEXT_BYTES),
        "docs": _cut(prose_text, prose_start, TEXT_BYTES),
        "zen": train_demo.zen_of_python() + "\n" + license_text[:TEXT_BYTES],
        "base": _cut(code_text, code_start + TEXT_BYTES, TEXT_BYTES // 2) + "\n" + _cut(prose_text, prose_start + TEXT_BYTES, TEXT_BYTES // 2),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (OUT / f"{name}.txt").write_text(text, encoding="utf-8")
        print(f"{OUT / name}.txt: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
