"""Train the demo model shipped in ``adapters/demo``: a tiny Llama base plus three LoRA adapters.

adapterpack turns one base model and several LoRA adapters into one Core ML package with one
function per adapter. Demonstrating that needs a real model whose adapters visibly change its
output, yet is small enough to commit and can be rebuilt on any machine without downloading
anything. So everything here is trained from scratch on text every Python installation carries:

* ``base``: a ~0.86M-parameter ``LlamaForCausalLM`` (byte-level vocabulary, grouped-query
  attention) trained on the standard library's source code and docstrings, half and half.
* ``code``: LoRA r=4 on q/v, trained on stdlib source with docstrings removed.
* ``docs``: LoRA r=4 on v and the MLP's down projection, trained on the English prose of stdlib
  docstrings.
* ``zen``: LoRA r=8 on q/v/o, trained on the Zen of Python and Python's LICENSE, so
  "Beautiful is" continues with "better than ugly."

Together the adapters have 4.8% of the base's parameters, a realistic proportion.

Run from the repository root (about ten minutes on two idle CPU cores, most of it the base)::

    .venv/bin/python scripts/train_demo.py

It rewrites ``adapters/demo/{base,code,docs,zen}`` and ``adapters/demo/SAMPLES.md``. To change
only the adapters, ``--adapters-only`` loads the base already saved in ``adapters/demo/base``
instead of training it, and rewrites everything but the base; the base's training row of
SAMPLES.md is carried over from the existing file. Seeds, sorted file lists, a fixed thread
count and deterministic kernels make a rerun on the same Python and torch versions reproduce
the same weights, and adapters trained with ``--adapters-only`` are the ones a full run would
give; another Python version has slightly different stdlib text and so gives slightly
different (equally usable) weights. ``--base-steps``/``--adapter-steps``/``--out`` allow a
quick smoke run into another folder.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import inspect
import io
import json
import math
import platform
import sys
import sysconfig
import time
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_tokenizer as bt  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "adapters" / "demo"
# Recorded as the base's name in its config.json and as base_model_name_or_path in every
# adapter_config.json. It is a label, not a hub id: the weights only exist in this repository.
BASE_NAME = "adapterpack/demo-base"

SEED = 1234
SEQ_LEN = 128
BATCH = 32
BASE_STEPS = 1500
ADAPTER_STEPS = 500
EVAL_BATCHES = 8

# Stdlib parts left out: tests (huge, repetitive, full of deliberately odd code), generated
# tables (encodings, pydoc_data, _sysconfigdata) and packages that distributions often strip or
# newer Pythons removed, so the corpus is as similar as possible across installations.
EXCLUDED_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "encodings", "pydoc_data", "ensurepip", "idlelib", "turtledemo", "lib2to3", "distutils",
    "__phello__",
}
MAX_FILE_BYTES = 200_000
# Every HELD_OUT_EVERY-th source file is kept out of training to measure held-out loss.
HELD_OUT_EVERY = 25

BASE_CONFIG = dict(
    vocab_size=bt.VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=bt.MODEL_MAX_LENGTH,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    # Untied: a separate lm_head is the common Llama layout, so the demo exercises the general
    # export path; it costs 34k parameters.
    tie_word_embeddings=False,
    bos_token_id=bt.BOS_ID,
    eos_token_id=bt.EOS_ID,
    pad_token_id=bt.PAD_ID,
)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    lr: float
    description: str


# Different ranks and target sets on purpose: the packager must handle adapters that touch
# different layers, and each function of the package then patches a different weight subset
# (attention only, attention plus MLP). The sizes are realistic: together the three have under
# 5% of the base's parameters (40,960 of 855,168), so a package that stores the base once plus
# every adapter's float16 A/B matrices weighs less than 10% more than the base alone. A LoRA
# on an in x out linear layer has r * (in + out) parameters; per block here q/o 128x128, k/v
# 128x64, down 384x128. lora_alpha = 2r throughout, so the scale is the same for every rank.
ADAPTERS = (
    AdapterSpec("code", 4, 8, ("q_proj", "v_proj"), 3e-3,  # 7,168 parameters
                "stdlib source code with docstrings removed"),
    AdapterSpec("docs", 4, 8, ("v_proj", "down_proj"), 3e-3,  # 11,264
                "English prose paragraphs of stdlib docstrings"),
    # Memorising the Zen needs the most capacity; r=8 on q/v/o is enough for greedy decoding to
    # recite it, where r=4 adapters only shift style.
    AdapterSpec("zen", 8, 16, ("q_proj", "v_proj", "o_proj"), 3e-3,  # 22,528
                "the Zen of Python and Python's LICENSE.txt"),
)

BASE_TEXT = "stdlib code (50%) + docstring prose (50%)"
PROMPTS = ("def ", "The ", "Beautiful is")
SAMPLE_BYTES = 60


# --------------------------------------------------------------------------------------------
# Corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib modules used, sorted by path."""
    root = stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        if rel.parts[0].startswith("config-") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            with tokenize.open(path) as f:  # honours PEP 263 coding cookies
                text = f.read()
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        out.append((rel.as_posix(), text))
    out.sort()
    return out


def _docstring_nodes(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                yield node, body[0]


def strip_docstrings(text: str, tree: ast.AST) -> str:
    """Source with docstrings cut out (comments and layout kept), so the code corpus is code."""
    lines = text.splitlines(keepends=True)
    replace: dict[int, str | None] = {}
    for owner, expr in _docstring_nodes(tree):
        first, last = expr.lineno - 1, expr.end_lineno - 1
        # Only docstrings alone on their lines: `def f(): "doc"` is left intact. (ast offsets
        # count UTF-8 bytes, hence the encode.)
        before = lines[first].encode("utf-8")[: expr.col_offset]
        after = lines[last].encode("utf-8")[expr.end_col_offset:]
        if before.strip() or after.strip():
            continue
        for i in range(first, last + 1):
            replace[i] = None
        if len(owner.body) == 1 and not isinstance(owner, ast.Module):
            # The docstring was the whole body; keep the code valid.
            replace[first] = before.decode("utf-8") + "pass\n"
    kept = [replace.get(i, line) for i, line in enumerate(lines)]
    return "".join(line for line in kept if line is not None)


def prose_paragraphs(doc: str) -> list[str]:
    """Paragraphs of a docstring that read as English sentences (no doctests, tables, code)."""
    out = []
    for para in doc.split("\n\n"):
        para = para.strip()
        if len(para) < 60 or len(para.split()) < 8:
            continue
        if any(line.lstrip().startswith((">>>", "...", "$", "%")) for line in para.splitlines()):
            continue
        letters = sum(c.isalpha() or c in " \n,.;:'-()" for c in para)
        if letters / len(para) < 0.9 or not para[0].isupper():
            continue
        out.append(para)
    return out


def zen_of_python() -> str:
    # `import this` prints the Zen; keep it out of the training log.
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


@dataclass
class Corpus:
    name: str
    train: torch.Tensor  # int16 ids, documents as <bos> bytes <eos>, concatenated
    held_out: torch.Tensor | None
    n_docs: int


def pack(docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in docs:
        ids.append(bt.BOS_ID)
        ids.extend(doc.encode("utf-8"))
        ids.append(bt.EOS_ID)
    return torch.tensor(ids, dtype=torch.int16)


def build_corpora() -> dict[str, Corpus]:
    sources = stdlib_sources()
    code = {True: [], False: []}
    docs = {True: [], False: []}
    for i, (_rel, text) in enumerate(sources):
        held_out = i % HELD_OUT_EVERY == 0
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        code[held_out].append(strip_docstrings(text, tree))
        for _owner, expr in _docstring_nodes(tree):
            paragraphs = prose_paragraphs(inspect.cleandoc(expr.value.value))
            if paragraphs:
                docs[held_out].append("\n\n".join(paragraphs))

    zen = zen_of_python()
    license_path = stdlib_root() / "LICENSE.txt"
    license_text = license_path.read_text(encoding="utf-8") if license_path.is_file() else ""
    # The Zen is short, so it is repeated to weigh about as much as the LICENSE; otherwise the
    # adapter would mostly learn licence boilerplate.
    zen_docs = [zen] * max(1, len(license_text) // max(1, len(zen)))
    if license_text:
        zen_docs.append(license_text)
    return {
        "code": Corpus("code", pack(code[False]), pack(code[True]), len(code[False])),
        "docs": Corpus("docs", pack(docs[False]), pack(docs[True]), len(docs[False])),
        # The Zen is meant to be memorised, so it has no held-out split: its "eval" is the text.
        "zen": Corpus("zen", pack(zen_docs), None, len(zen_docs)),
    }


# --------------------------------------------------------------------------------------------
# Training


def sample_batch(sources: list[torch.Tensor], gen: torch.Generator, batch: int = BATCH):
    """Random SEQ_LEN windows, each from a source picked uniformly: equal mixing of corpora."""
    which = torch.randint(len(sources), (batch,), generator=gen).tolist()
    rows = []
    for s in which:
        data = sources[s]
        start = int(torch.randint(len(data) - SEQ_LEN, (1,), generator=gen))
        rows.append(data[start:start + SEQ_LEN])
    return torch.stack(rows).long()


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model, data: torch.Tensor) -> float:
    """Mean loss (nats per byte) on fixed windows of ``data``: same windows for every model."""
    gen = torch.Generator().manual_seed(SEED + 7)
    model.eval()
    losses = [lm_loss(model, sample_batch([data], gen)).item() for _ in range(EVAL_BATCHES)]
    model.train()
    return sum(losses) / len(losses)


def train(model, params, sources, steps: int, lr: float, label: str, seed: int) -> dict:
    """AdamW with linear warm-up and cosine decay; returns a loss summary."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )
    warmup = max(1, min(100, steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    model.train()
    t0 = time.perf_counter()
    history = []
    window: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = lm_loss(model, sample_batch(sources, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        window.append(loss.item())
        if (step + 1) % 50 == 0 or step == 0 or step + 1 == steps:
            mean = sum(window) / len(window)
            history.append((step + 1, mean))
            print(f"  [{label}] step {step + 1:4d}/{steps}  loss {mean:.3f}  "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
            window = []
    return {"steps": steps, "first_loss": history[0][1], "last_loss": history[-1][1],
            "seconds": time.perf_counter() - t0}


@torch.no_grad()
def greedy(model, prompt: str, n_bytes: int = SAMPLE_BYTES) -> str:
    """Greedy continuation of ``prompt`` (the prompt itself not included)."""
    model.eval()
    ids = bt.encode(prompt)
    new: list[int] = []
    for _ in range(n_bytes):
        logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1, : bt.NUM_TOKENS]
        nxt = int(logits.argmax())
        if nxt == bt.EOS_ID:
            break
        new.append(nxt)
    return bt.decode(new)


# --------------------------------------------------------------------------------------------
# Output


def md_code(text: str) -> str:
    """``text`` as its Python repr in inline code, for a Markdown table cell.

    The repr keeps the exact bytes visible (newlines, trailing spaces) on one line.
    """
    code = repr(text).replace("|", "\\|")
    ticks = "``" if "`" in code else "`"
    pad = " " if ticks == "``" else ""
    return f"{ticks}{pad}{code}{pad}{ticks}"


def write_samples(path: Path, corpora, stats, evals, samples) -> None:
    lines = [
        "# Demo model samples",
        "",
        "Written by `scripts/train_demo.py` (do not edit by hand). Greedy decoding, "
        f"{SAMPLE_BYTES} bytes at most, prompt encoded with a leading `<bos>`.",
        "",
        f"Trained with Python {platform.python_version()}, torch {torch.__version__.split('+')[0]}.",
        "",
        "## Training",
        "",
        "| function | text | steps | loss at step 1 | mean loss, last 50 steps |",
        "|---|---|---|---|---|",
    ]
    for name, s in stats.items():
        lines.append(f"| {name} | {s['text']} | {_cell(s['steps'], 'd')} "
                     f"| {_cell(s['first_loss'], '.3f')} | {_cell(s['last_loss'], '.3f')} |")
    lines += [
        "",
        "Loss is cross-entropy in nats per byte; a model that knows nothing scores ln 259 = 5.56.",
        "",
        "## Evaluation loss per text",
        "",
        f"Fixed {EVAL_BATCHES}x{BATCH} windows of {SEQ_LEN} bytes. `code` and `docs` come from "
        f"held-out stdlib files (every {HELD_OUT_EVERY}th); `zen` is the training text itself.",
        "",
        "| function | " + " | ".join(corpora) + " |",
        "|---|" + "---|" * len(corpora),
    ]
    for name, row in evals.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in corpora) + " |")
    lines += [
        "",
        "## Greedy samples",
        "",
        "Prompt followed by the model's continuation, shown as a Python string literal.",
        "",
    ]
    for prompt in PROMPTS:
        lines += [f"### Prompt {md_code(prompt)}", "", "| function | text |", "|---|---|"]
        for name, by_prompt in samples.items():
            lines.append(f"| {name} | {md_code(prompt + by_prompt[prompt])} |")
        lines.append("")
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def _cell(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def recorded_base_stats(samples_md: Path) -> dict:
    """The base's row of the training table in an earlier ``SAMPLES.md``.

    Used when the base is reused rather than retrained; unknown values (no earlier file, or no
    such row) are None and show as "n/a".
    """
    stats = {"text": BASE_TEXT, "steps": None, "first_loss": None, "last_loss": None,
             "seconds": None}
    if not samples_md.is_file():
        return stats
    for line in samples_md.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] != "base":
            continue
        with contextlib.suppress(ValueError):
            stats.update(text=cells[1], steps=int(cells[2]), first_loss=float(cells[3]),
                         last_loss=float(cells[4]))
        break
    return stats


def fix_base_name(base_dir: Path) -> None:
    """Record BASE_NAME as the config's ``_name_or_path``.

    transformers 5 no longer serialises ``_name_or_path``; writing it back keeps the saved
    config self-describing (loading still works, and older transformers wrote this key too).
    """
    path = base_dir / "config.json"
    config = json.loads(path.read_text())
    config = {"_name_or_path": BASE_NAME, **{k: v for k, v in config.items() if k != "_name_or_path"}}
    path.write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")


def tidy_adapter_folder(adapter_dir: Path) -> None:
    """Make a saved adapter folder reproducible and minimal.

    peft keeps ``target_modules`` as a set, so its JSON order changes with the string hash seed;
    sorting makes reruns byte-identical. The generated model card is a template full of
    placeholders; ``adapters/demo/README.md`` documents the adapters instead.
    """
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (adapter_dir / "README.md").unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--base-steps", type=int, default=BASE_STEPS)
    parser.add_argument("--adapter-steps", type=int, default=ADAPTER_STEPS)
    parser.add_argument("--adapters-only", action="store_true",
                        help="keep the base already in OUT/base and retrain only the adapters "
                             "(--base-steps is then ignored)")
    args = parser.parse_args()
    out: Path = args.out
    base_dir = out / "base"
    if args.adapters_only and not (base_dir / "model.safetensors").is_file():
        parser.error(f"--adapters-only needs a trained base in {base_dir}")

    # Determinism: fixed seeds, a fixed thread count (reduction order depends on it) and
    # deterministic kernels; warn_only because a few CPU ops have no deterministic variant.
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True, warn_only=True)

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)

    t0 = time.perf_counter()
    corpora = build_corpora()
    for c in corpora.values():
        held = 0 if c.held_out is None else len(c.held_out)
        print(f"corpus {c.name}: {c.n_docs} documents, {len(c.train):,} train bytes, "
              f"{held:,} held-out bytes")
    eval_data = {n: (c.held_out if c.held_out is not None else c.train) for n, c in corpora.items()}
    print(f"corpora built in {time.perf_counter() - t0:.1f}s")

    stats: dict[str, dict] = {}
    evals: dict[str, dict[str, float]] = {}
    samples: dict[str, dict[str, str]] = {}
    lora_params: dict[str, int] = {}

    # ---- base
    before: dict[str, float] | None = None
    if args.adapters_only:
        # The base's losses during training are not in its folder; the SAMPLES.md written with
        # it has them, so its training row survives an adapters-only rerun.
        stats["base"] = recorded_base_stats(out / "SAMPLES.md")
        print(f"base: reusing {base_dir} (not retrained)")
    else:
        torch.manual_seed(SEED)
        config = LlamaConfig(**BASE_CONFIG)
        model = LlamaForCausalLM(config)
        print(f"base: {sum(p.numel() for p in model.parameters()):,} parameters")
        before = {n: eval_loss(model, d) for n, d in eval_data.items()}
        print("base eval before training: "
              + ", ".join(f"{n} {v:.3f}" for n, v in before.items()))
        # The base sees code and prose equally, not the Zen, so the zen adapter's effect is its
        # own.
        s = train(model, list(model.parameters()), [corpora["code"].train, corpora["docs"].train],
                  args.base_steps, 3e-3, "base", SEED)
        stats["base"] = {**s, "text": BASE_TEXT}
        model.name_or_path = BASE_NAME
        model.save_pretrained(base_dir)
        fix_base_name(base_dir)
        bt.write_hf_tokenizer(base_dir)
        del model

    # Everything below uses the base as saved, exactly as a user of the folder would; so an
    # adapters-only run evaluates and adapts the same weights a full run would have produced.
    def load_base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)

    base = load_base()
    n_base = sum(p.numel() for p in base.parameters())
    evals["base"] = {n: eval_loss(base, d) for n, d in eval_data.items()}
    samples["base"] = {p: greedy(base, p) for p in PROMPTS}
    del base

    # ---- adapters
    for i, spec in enumerate(ADAPTERS):
        torch.manual_seed(SEED + 100 + i)
        lora = LoraConfig(
            task_type="CAUSAL_LM",
            r=spec.rank,
            lora_alpha=spec.alpha,
            target_modules=list(spec.targets),
            lora_dropout=0.0,
            bias="none",
        )
        peft_model = get_peft_model(load_base(), lora)
        # get_peft_model records the local folder it was loaded from; store the base's name.
        peft_model.peft_config["default"].base_model_name_or_path = BASE_NAME
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        lora_params[spec.name] = sum(p.numel() for p in trainable)
        print(f"adapter {spec.name}: r={spec.rank} alpha={spec.alpha} on {','.join(spec.targets)}"
              f" -> {lora_params[spec.name]:,} trainable parameters "
              f"({100 * lora_params[spec.name] / n_base:.2f}% of the base)")
        s = train(peft_model, trainable, [corpora[spec.name].train], args.adapter_steps,
                  spec.lr, spec.name, SEED + 100 + i)
        stats[spec.name] = {**s, "text": spec.description}
        # save_embedding_layers=False: no embedding is adapted, and "auto" would look the base
        # name up on the Hub to compare vocabularies.
        peft_model.save_pretrained(out / spec.name, save_embedding_layers=False)
        tidy_adapter_folder(out / spec.name)

        reloaded = PeftModel.from_pretrained(load_base(), out / spec.name)
        evals[spec.name] = {n: eval_loss(reloaded, d) for n, d in eval_data.items()}
        samples[spec.name] = {p: greedy(reloaded, p) for p in PROMPTS}
        del peft_model, reloaded

    write_samples(out / "SAMPLES.md", list(corpora), stats, evals, samples)

    print("\nseconds: " + ", ".join(f"{n} {s['seconds']:.0f}" for n, s in stats.items()
                                    if s["seconds"] is not None))
    total = sum(lora_params.values())
    print("LoRA parameters: " + ", ".join(f"{n} {k:,}" for n, k in lora_params.items())
          + f"; total {total:,} = {100 * total / n_base:.2f}% of the base's {n_base:,}"
          + f" ({2 * total / 1024:.1f} KiB of float16 A/B matrices)")
    print("eval loss (rows: function, columns: text):")
    print("        " + "".join(f"{c:>8}" for c in corpora))
    if before is not None:
        print("before  " + "".join(f"{before[c]:8.3f}" for c in corpora))
    for name, row in evals.items():
        print(f"{name:8}" + "".join(f"{row[c]:8.3f}" for c in corpora))
    for prompt in PROMPTS:
        print(f"\nprompt {prompt!r}")
        for name, by_prompt in samples.items():
            print(f"  {name:5} {prompt + by_prompt[prompt]!r}")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s; wrote {out}")


if __name__ == "__main__":
    main()
