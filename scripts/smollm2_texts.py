"""Write adapters/smollm2/{calibration,heldout}/: each SmolLM2 function's own text, twice over.

``calibration/`` is what ``manifests/smollm2.yaml`` names for data-aware compression and
``compression.auto``; ``heldout/`` is other text of the same kind, for measuring what a
compression keeps (``benchmarks/quality.py``, ``adapterpack eval``) on text the choice never saw.
Per function: the base, English prose (docstring paragraphs of Python's standard library, as the
demo's ``docs`` text is made); ``shout`` and ``pirate``, chat transcripts in the checkpoint's chat
template, each question answered by the skill itself (the float32 base with the adapter merged,
greedy), so each text is what that skill writes. Questions differ between the two folders.

    .venv/bin/python scripts/smollm2.py          # the checkpoint, once
    .venv/bin/python scripts/smollm2_texts.py
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import smollm2  # noqa: E402
import train_demo  # noqa: E402

PROSE_BYTES = 6000
ANSWER_TOKENS = 48
QUESTIONS = {
    "calibration": [
        "What is rain?", "Why is the sky blue?", "Name a fruit.", "What do cows eat?", "How many legs does a spider have?",
        "What is a river?", "Tell me about dogs.", "What is the capital of Italy?", "What is ice?", "Why do birds sing?",
        "What is a computer?", "Name an ocean.", "What is three plus four?", "Where do fish live?", "What is a tree?",
        "How are you today?",
    ],
    "heldout": [
        "What is snow?", "Why is grass green?", "Name a vegetable.", "What do horses eat?", "How many wheels does a bike have?",
        "What is a mountain?", "Tell me about owls.", "What is the capital of Spain?", "What is fire?", "Why do cats purr?",
        "What is a book?", "Name a planet.", "What is five minus two?", "Where do bees live?", "What is a cloud?",
        "Good morning!",
    ],
}


def prose(part: int) -> str:
    """``PROSE_BYTES`` of docstring paragraphs: the first part for calibration, the next held out."""
    paragraphs = []
    for _path, text in train_demo.stdlib_sources():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for _owner, expr in train_demo._docstring_nodes(tree):
            paragraphs.extend(train_demo.prose_paragraphs(inspect.cleandoc(expr.value.value)))
    text = "\n\n".join(paragraphs)
    start = part * PROSE_BYTES
    return text[start : start + PROSE_BYTES].split("\n\n", 1)[-1].rsplit("\n\n", 1)[0] + "\n"


def transcripts(name: str, questions: list[str]) -> str:
    """Each question in the chat template, answered greedily by skill ``name``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = smollm2.ensure_base()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, smollm2.ADAPTERS / name).merge_and_unload().eval()
    chats = []
    for question in questions:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False)
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        chats.append(prompt + answer + "<|im_end|>\n")
    return "".join(chats)


def main() -> None:
    for part, (folder, questions) in enumerate(QUESTIONS.items()):
        out = smollm2.ROOT / "adapters" / "smollm2" / folder
        out.mkdir(parents=True, exist_ok=True)
        texts = {"base": prose(part), **{name: transcripts(name, questions) for name in smollm2.SKILLS}}
        for name, text in texts.items():
            (out / f"{name}.txt").write_text(text, encoding="utf-8")
            print(f"{out / name}.txt: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
