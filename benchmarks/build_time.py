"""Build time and peak memory: adapterpack vs the straightforward per-function pipeline.

The straightforward pipeline, for every function: load the float32 base, merge the adapter with
peft, trace (with adapterpack's export forward: transformers' own forward does not convert),
``ct.convert``, palettize with coremltools' k-means, save; then merge with
``MultiFunctionDescriptor``. adapterpack: ``adapterpack build`` (the base converted and
compressed once, fused functions patched into it, vectorized deterministic palettization,
streaming merge, build cache). Both get the same inputs in one run; the report gives seconds,
peak RSS, package sizes and ratios, and the rebuild after one adapter changed (with
``--with-verify`` also for the default, verifying build).

    .venv/bin/pip install -e ".[bench]"                              # the baseline's k-means needs these
    .venv/bin/python benchmarks/build_time.py --with-verify         # ~25M-parameter Llama, 4 adapters
    .venv/bin/python benchmarks/build_time.py --shape 25m 1b 3b --baseline-shapes 25m --verify-package --keep
    .venv/bin/python benchmarks/build_time.py --shape 1b 3b --skip-baseline --verify-package --verify-previous
    .venv/bin/python benchmarks/build_time.py --shape 3b --settings default --skip-baseline --verify-only --verify-package --verify-previous
    .venv/bin/python benchmarks/build_time.py --shape 1b --skip-baseline --disk-previous    # peak disk, before and after
    .venv/bin/python benchmarks/build_time.py --shape 3b --skip-baseline --parts-previous   # parts sharing the base's blob
    .venv/bin/python benchmarks/build_time.py --shape 1b --settings default --skip-baseline --calibration-previous

Shapes: 25m (a small Llama), and the published Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B
shapes with random float16 weights (made once under ``--work``). Each build runs in its own
process (peak RSS is that process's high-water mark); the JSON records the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from results import Table, add_record_option, machine, record  # noqa: E402  (the benchmarks' own module)

PYTHON = sys.executable

SHAPES = {
    # ~25M parameters: a small Llama with GQA and untied embeddings.
    "25m": dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    # The published Llama-3.2-1B shape (random weights).
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The published Llama-3.2-3B shape (3.21B parameters).
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The published Llama-3.1-8B shape (8.0B parameters, untied embeddings).
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
ADAPTERS = ("a1", "a2", "a3", "a4")


# How each manifest compresses (``--settings``): "grouped", everything palettized in groups of 16,
# embeddings included, exactly as the baseline does it; "default", no compression block at all,
# what a user who writes the plain manifest gets (4-bit palettes, one per output channel,
# compensated on text the base writes itself; embeddings float16); "auto", calibration text
# beside the base and every adapter and ``compression: auto``, what the docs recommend for quality.
SETTINGS = {
    "grouped": "compression: {method: palettize, nbits: 4, granularity: per_grouped_channel, group_size: 16, keep_float16: []}\n",
    "default": "",
    "auto": "compression: auto\n",
}


def make_inputs(root: Path, shape: str, lora: str = "fuse", settings: str = "grouped") -> Path:
    """Base and adapters (made once, see ``make_models``) and the manifest (``lora``: fuse or
    keep; ``settings``: a ``SETTINGS`` name)."""
    if not (root / ADAPTERS[-1] / "adapter_config.json").exists():
        make_models(root, shape)
    if not (root / "base" / "tokenizer.json").exists():  # a base made before tokenizers were written
        write_tokenizer(root / "base", SHAPES[shape]["vocab_size"])
    calibration = ""
    if settings == "auto":
        text = root / "calibration.txt"
        text.write_text((REPO / "src" / "adapterpack" / "verification" / "english_sample.txt").read_text())
        calibration = f", calibration: {text.name}"
    adapters = "".join(f"  - {{name: {n}, path: {n}{calibration}}}\n" for n in ADAPTERS)
    suffix = "".join(f"-{part}" for part in (lora, settings) if part not in ("fuse", "grouped"))
    manifest = root / f"m{suffix}.yaml"
    manifest.write_text(
        f"name: bench\nbase: {{path: base{calibration}}}\nlora: {lora}\nadapters:\n" + adapters
        + "export: {max_context: 256}\n"
        + SETTINGS[settings]
        # Random weights lose more at 4 bits everywhere than trained ones: the benchmark times
        # verification (both verdicts), it does not judge these weights' quality.
        + "verify: {max_perplexity_ratio: 1000, min_agreement: 0, min_retention: -1}\n"
    )
    return manifest


def make_models(root: Path, shape: str) -> None:
    """Base (float16 safetensors, as published models are) and 4 LoRA adapters on q/k/v/o."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=2048, **SHAPES[shape])
    # Created in float16: an 8B model in float32 alone would be 32 GB.
    torch.set_default_dtype(torch.float16)
    model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(root / "base", safe_serialization=True)
    write_tokenizer(root / "base", config.vocab_size)
    for index, name in enumerate(ADAPTERS):
        peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        generator = torch.Generator().manual_seed(index + 1)
        with torch.no_grad():
            for key, parameter in peft_model.named_parameters():
                if "lora_B" in key:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
        peft_model.save_pretrained(root / name)
        model = peft_model.unload()


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A real tokenizer beside the random weights, so verify drives real text as it does for a
    user's base: SmolLM2's (49,152 ids, chat template) where the vocabulary holds its ids, else
    the demo's byte-level one."""
    smollm2 = REPO / "models" / "smollm2-135m-instruct"
    source = smollm2 if vocab_size >= 49152 and (smollm2 / "tokenizer.json").is_file() else REPO / "adapters" / "demo" / "base"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


BASELINE = r'''
import sys, time, gc
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, sys.argv[3])
from adapterpack.quiet import captured_output
from adapterpack.convert.export_decoder import ExportDecoder
from adapterpack.formats.mlpackage.conversion import STATE_NAMES
sys.path.insert(0, sys.argv[4])
from palettize_throughput import install_kmeans1d_shim
with captured_output():
    import coremltools as ct  # with its scikit-learn k-means, which this pipeline uses
from coremltools.optimize import coreml as cto
from coremltools.models.utils import MultiFunctionDescriptor, save_multifunction
from transformers import AutoModelForCausalLM
from peft import PeftModel
install_kmeans1d_shim()
root, out = Path(sys.argv[1]), Path(sys.argv[2])
names = ["a1", "a2", "a3", "a4"]
parts = out.parent / "baseline_parts"
parts.mkdir(parents=True, exist_ok=True)
config = cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(mode="kmeans", nbits=4,
    granularity="per_grouped_channel", group_size=16, weight_threshold=2048))
started = time.time()
for name in names:
    model = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, root / name).merge_and_unload().eval()
    decoder = ExportDecoder(model, 256).eval()
    example = (torch.zeros((1, 2), dtype=torch.int32), torch.zeros((1, 1, 2, 5)))
    with torch.no_grad(), captured_output():
        traced = torch.jit.trace(decoder, example, check_trace=False)
    rng = ct.RangeDim(1, 256, default=1)
    with captured_output():
        ml = ct.convert(traced, inputs=[ct.TensorType("inputIds", shape=(1, rng), dtype=np.int32),
            ct.TensorType("causalMask", shape=(1, 1, ct.RangeDim(1, 256, default=1), ct.RangeDim(1, 256, default=1)), dtype=np.float16)],
            outputs=[ct.TensorType("logits", dtype=np.float16)],
            states=[ct.StateType(wrapped_type=ct.TensorType(shape=getattr(decoder, n).shape, dtype=np.float16), name=n) for n in STATE_NAMES],
            minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT16, skip_model_load=True)
        del traced, decoder, model; gc.collect()
    print(f"baseline {name} converted at {time.time() - started:.0f} s, palettizing", flush=True)
    with captured_output():
        ml = cto.palettize_weights(ml, config=config)
        ml.save(str(parts / f"{name}.mlpackage"))
    del ml; gc.collect()
    print(f"baseline {name} done at {time.time() - started:.0f} s", flush=True)
desc = MultiFunctionDescriptor()
for name in names:
    desc.add_function(str(parts / f"{name}.mlpackage"), src_function_name="main", target_function_name=name)
desc.default_function_name = names[0]
with captured_output():
    save_multifunction(desc, str(out))
'''


def _tree_rss_gib(pid: int) -> float:
    """Resident memory of a process and its descendants (Linux /proc), in GiB."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next((int(line.split()[1]) for line in status if line.startswith("VmRSS")), 0)
            with open(f"/proc/{current}/task/{current}/children") as children:
                stack.extend(int(child) for child in children.read().split())
        except OSError:
            continue
    return total / 2**20


def peak_rss_of(command: list[str], timeout: float | None, disk: Path | None = None) -> dict:
    """Seconds, peak RSS (GiB) and whether ``command`` finished; with ``disk``, also the most
    its filesystem's used bytes rose above where they started (GiB, sampled twice a second:
    nothing else should write there meanwhile).

    Peak RSS is the process's own high-water mark when it finishes; when it is cut off at
    ``timeout``, the highest RSS sampled (twice a second) until then. The command runs in its
    own process group, so a timeout stops everything it started.
    """
    import signal
    import threading

    wrapper = [PYTHON, "-c", (
        "import resource, subprocess, sys;"
        "r = subprocess.run(sys.argv[1:]);"
        "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)"
    ), *command]
    started = time.perf_counter()
    # stderr passes through: the builds' progress lines show how a long run is going
    process = subprocess.Popen(wrapper, stdout=subprocess.PIPE, stderr=None, text=True, start_new_session=True)
    sampled = [0.0]
    used_at_start = shutil.disk_usage(disk).used if disk is not None else 0
    disk_peak = [0]

    def sample() -> None:
        while process.poll() is None:
            sampled[0] = max(sampled[0], _tree_rss_gib(process.pid))
            if disk is not None:
                disk_peak[0] = max(disk_peak[0], shutil.disk_usage(disk).used - used_at_start)
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    try:
        stdout, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        return {"seconds": round(time.perf_counter() - started, 1), "peak_rss_gib": round(sampled[0], 2),
                "finished": False, "cut_off_after_seconds": timeout,
                "progress": [line for line in stdout.splitlines() if line.startswith("baseline")]}
    line = next((text for text in stdout.splitlines() if text.startswith("PEAK")), "PEAK 0 1")
    _, kib, code = line.split()
    finished = code == "0"
    if not finished and code != "3":  # 3: a verification verdict, printed above it already
        print(stdout[-3000:], file=sys.stderr)
    figures = {"seconds": round(time.perf_counter() - started, 1), "peak_rss_gib": round(int(kib) / 2**20, 2), "finished": finished,
               "exit_code": int(code)}
    if disk is not None:
        figures["peak_disk_gib"] = round(disk_peak[0] / 2**30, 2)
    return figures


def stored_gib(folder: Path) -> float:
    """What ``folder`` takes on disk, each hard-linked file once (GiB)."""
    seen, total = set(), 0
    for path in folder.rglob("*"):
        info = path.lstat()
        if path.is_file() and (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            total += info.st_blocks * 512
    return round(total / 2**30, 2)


def full_and_rebuild(
    root: Path, manifest: Path, output: Path, *, verify: bool, launcher: list[str] | None = None, tag: str | None = None, after_clean=None
) -> dict:
    """A clean build, then a rebuild after one adapter (a2) changed, with a cache of their own;
    the clean build's peak disk (its cache and staging, beside the output) and the cache it
    leaves. ``launcher``: how the CLI is started (default: ``adapterpack``); ``after_clean()``:
    figures taken of the clean build's package before the rebuild replaces it (its a2 then
    differs from the manifest's)."""
    from safetensors.torch import load_file, save_file

    cli = launcher or [str(Path(PYTHON).parent / "adapterpack")]
    tag = tag if tag is not None else ("_verified" if verify else "")
    cache = output.parent / f"cache{tag}"
    shutil.rmtree(cache, ignore_errors=True)
    command = [*cli, "build", str(manifest), "-o", str(output), "--quiet", "--force", "--cache-dir", str(cache)]
    if not verify:
        command.append("--no-verify")
    output.parent.mkdir(parents=True, exist_ok=True)
    figures = {f"adapterpack_full{tag}": peak_rss_of(command, None, disk=output.parent)}
    figures[f"adapterpack_full{tag}"]["cache_gib"] = stored_gib(cache)
    if after_clean is not None:
        figures.update(after_clean())
    # A new a2 (a different B), everything else unchanged.
    weights = root / "a2" / "adapter_model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    save_file({k: v + 0.001 if "lora_B" in k else v for k, v in tensors.items()}, weights)
    try:
        figures[f"adapterpack_rebuild_one{tag}"] = peak_rss_of(command, None)
    finally:
        weights.write_bytes(original)
    figures[f"rebuild_over_full{tag}"] = round(
        figures[f"adapterpack_rebuild_one{tag}"]["seconds"] / figures[f"adapterpack_full{tag}"]["seconds"], 3
    )
    return figures


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# `adapterpack verify` with the executor's float16 products widened in numpy (its previous way).
# The build's disk use as before: the converted base kept in the cache beside the compressed one,
# coremltools' temporary copy of every model it converts or compresses kept until the process
# exits, and a byte per palette index in the palette cache.
PREVIOUS_DISK = """
import io, sys
import numpy as np
import adapterpack.assemble.builder as builder
import adapterpack.formats.mlpackage.weights as model
import adapterpack.compress.palettes as palettes
import adapterpack.formats.mlpackage.spec as spec
from adapterpack.quiet import captured_output

builder._PartBuilder._drop_uncompressed_when_done = lambda self: None

def save_copy(mlmodel, path):
    with captured_output():
        mlmodel.save(str(path))

spec.save_model = model.save_model = save_copy

def store_bytes(self, key, found):
    if key is not None:
        buffer = io.BytesIO()
        np.savez(buffer, luts=found[0], indices=found[1])
        self.files.write(key, buffer.getvalue())

palettes.PaletteStore._store = store_bytes
from adapterpack.cli.app import main
sys.argv[0] = "adapterpack"
main()
"""
# The build with each fused function's part a whole copy of the compressed base, its own
# records written over the base's in place (the parts' way before they shared the base's blob).
PREVIOUS_PARTS = """
import shutil, sys
import adapterpack.assemble.builder as builder
import adapterpack.formats.mlpackage.weight_patch as patch

def patched_copy(source, destination, changes):
    replacements = patch._replacements(source, patch.load_spec_file(source.joinpath(*patch.MODEL_FOLDER, patch.SPEC_NAME)), changes)
    if destination.exists():
        shutil.rmtree(destination)
    if replacements is None:
        return False
    shutil.copytree(source, destination)
    for (file_name, offset), data in replacements.items():
        with patch.blob_file(destination, file_name).open("r+b") as handle:
            handle.seek(patch.record_metadata(handle, offset)[2])
            handle.write(data)
    return True

builder.patch_weights = patched_copy
from adapterpack.cli.app import main
sys.argv[0] = "adapterpack"
main()
"""
# The executor as it was before KV-cache updates ran in place and row palettes were gathered:
# a copy of the whole cache on every update, numpy's indexing for every palette lookup.
# Calibration as before: the Gram matrices measured in a forward of their own on the first palette
# worker that needs one (one torch thread), and each Gram factored again for every tensor.
PREVIOUS_CALIBRATION = (
    "import sys; import adapterpack.assemble.calibration as c; import adapterpack.compress.importance as i;"
    "c.GRAMS_WITH_ENERGIES = False; i.FACTOR_ONCE = False;"
    "from adapterpack.cli.app import main; sys.argv[0] = 'adapterpack'; main()"
)
PREVIOUS_VERIFY = (
    "import sys; from adapterpack.formats.mlpackage.executor import constexpr, interpreter;"
    "interpreter.STATE_UPDATES_IN_PLACE = False; constexpr.ROW_LOOKUPS = False;"
    "from adapterpack.cli.app import main; sys.argv[0] = 'adapterpack'; main()"
)


def run_shape(args, shape: str, settings: str) -> dict:
    """Every figure of one shape at one ``SETTINGS`` entry, in one place."""
    root = args.work / shape
    root.mkdir(parents=True, exist_ok=True)
    manifest = make_inputs(root, shape, settings=settings)
    figures: dict = {"shape": shape, "settings": settings}

    ours = root / "out" / "ours.mlpackage"
    if args.verify_only:  # the package an earlier run of these settings built
        if not ours.exists():
            raise SystemExit(f"--verify-only: {ours} is missing: run once without it first")
    else:
        for stale in (root / "out", root / ".adapterpack-cache"):
            shutil.rmtree(stale, ignore_errors=True)
    cli = str(Path(PYTHON).parent / "adapterpack")

    def verified() -> dict:
        """verify alone, of the package the manifest's adapters built: its own peak, apart from the build's."""
        found = {"adapterpack_bytes": size(ours)}
        if args.verify_package:
            found["adapterpack_verify"] = peak_rss_of([cli, "verify", str(ours), "--manifest", str(manifest)], None)
            # exit 3 is a verdict (a FAIL): random weights at 4 bits fail the larger shapes' thresholds
            found["adapterpack_verify"]["ran_to_a_verdict"] = found["adapterpack_verify"]["exit_code"] in (0, 3)
        return found

    if not args.verify_only and not args.calibration_previous:
        figures.update(full_and_rebuild(root, manifest, ours, verify=False, after_clean=verified))
    else:
        figures.update(verified())
    if "adapterpack_verify" in figures and "adapterpack_full" in figures:
        figures["verify_over_build"] = round(figures["adapterpack_verify"]["seconds"] / figures["adapterpack_full"]["seconds"], 3)
    if args.verify_previous:  # the same verify on the executor as before (PREVIOUS_VERIFY)
        previous = [PYTHON, "-c", PREVIOUS_VERIFY, "verify", str(ours), "--manifest", str(manifest)]
        figures["verify_copying_executor"] = peak_rss_of(previous, None)
        if "adapterpack_verify" in figures:
            figures["verify_speedup"] = round(figures["verify_copying_executor"]["seconds"] / figures["adapterpack_verify"]["seconds"], 2)
    if args.disk_previous:  # the same build with its disk use as before (PREVIOUS_DISK)
        previous = full_and_rebuild(root, manifest, root / "out" / "previous.mlpackage", verify=False,
                                    launcher=[PYTHON, "-c", PREVIOUS_DISK], tag="_keeping_converted_base")
        figures.update(previous)
        ours_peak, before = figures["adapterpack_full"]["peak_disk_gib"], previous["adapterpack_full_keeping_converted_base"]["peak_disk_gib"]
        figures["peak_disk_ratio"] = round(ours_peak / before, 3) if before else None
        base_gib = sum(p.stat().st_size for p in (root / "base").glob("*.safetensors")) / 2**30
        figures["peak_disk_over_package_and_base"] = round(ours_peak / (figures["adapterpack_bytes"] / 2**30 + base_gib), 3)
    if args.parts_previous:  # the same build with whole-copy parts (PREVIOUS_PARTS)
        previous = full_and_rebuild(root, manifest, root / "out" / "previous.mlpackage", verify=False,
                                    launcher=[PYTHON, "-c", PREVIOUS_PARTS], tag="_whole_parts")
        figures.update(previous)
        ours_peak, before = figures["adapterpack_full"]["peak_disk_gib"], previous["adapterpack_full_whole_parts"]["peak_disk_gib"]
        figures["peak_disk_ratio_to_whole_parts"] = round(ours_peak / before, 3) if before else None
        figures["cache_ratio_to_whole_parts"] = round(figures["adapterpack_full"]["cache_gib"] / previous["adapterpack_full_whole_parts"]["cache_gib"], 3)
    if args.calibration_previous:  # the same clean build with calibration as before (PREVIOUS_CALIBRATION)
        for tag, launcher in (("", None), ("_calibration_as_before", [PYTHON, "-c", PREVIOUS_CALIBRATION])):
            cli = launcher or [str(Path(PYTHON).parent / "adapterpack")]
            output = root / "out" / f"clean{tag}.mlpackage"
            command = [*cli, "build", str(manifest), "-o", str(output), "--quiet", "--force", "--no-verify", "--no-cache"]
            figures[f"clean_build{tag}"] = peak_rss_of(command, None)
        figures["calibration_speedup"] = round(figures["clean_build_calibration_as_before"]["seconds"] / figures["clean_build"]["seconds"], 2)
        blobs = [root / "out" / f"clean{tag}.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin" for tag in ("", "_calibration_as_before")]
        # the Grams' sums split over another thread count may flip a rare compensated entry
        figures["calibration_identical_weights"] = all(b.exists() for b in blobs) and blobs[0].read_bytes() == blobs[1].read_bytes()
    if args.with_verify:  # the default build verifies every function; unchanged ones keep their verdict
        figures.update(full_and_rebuild(root, manifest, root / "out" / "verified.mlpackage", verify=True))
    if args.keep:
        kept = make_inputs(root, shape, lora="keep", settings=settings)
        figures["keep"] = full_and_rebuild(root, kept, root / "out" / "kept.mlpackage", verify=False)
        figures["keep"]["adapterpack_bytes"] = size(root / "out" / "kept.mlpackage")

    if settings != "grouped" and not args.skip_baseline:
        # The baseline palettizes as "grouped" says; coremltools' own k-means one palette per
        # channel runs at about 0.3M weights/s, over two hours for a 3B base alone.
        figures["baseline_full"] = "not run: the baseline compresses as --settings grouped does"
    elif not args.skip_baseline and (args.baseline_shapes is None or shape in args.baseline_shapes):
        script = root / "baseline.py"
        script.write_text(BASELINE)
        baseline_out = root / "out" / "baseline.mlpackage"
        figures["baseline_full"] = peak_rss_of(
            [PYTHON, str(script), str(root), str(baseline_out), str(REPO / "src"), str(REPO / "benchmarks")],
            args.baseline_timeout)
        figures["baseline_bytes"] = size(baseline_out)
        if figures["baseline_full"]["finished"]:
            figures["speedup"] = round(figures["baseline_full"]["seconds"] / figures["adapterpack_full"]["seconds"], 2)
            figures["size_ratio"] = round(figures["adapterpack_bytes"] / figures["baseline_bytes"], 3)
        else:
            figures["speedup"] = f">{round(figures['baseline_full']['seconds'] / figures['adapterpack_full']['seconds'], 2)} (baseline cut off)"
    print(json.dumps(figures, indent=2), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), nargs="+", default=["25m"], help="one or more, run in this order")
    parser.add_argument("--work", type=Path, default=Path("/tmp/adapterpack-bench"))
    parser.add_argument("--baseline-timeout", type=float, default=None, help="cut the baseline off after N seconds")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--baseline-shapes", nargs="+", choices=sorted(SHAPES), help="run the baseline for these shapes only")
    parser.add_argument("--with-verify", action="store_true", help="also time full and rebuild with verification on")
    parser.add_argument("--verify-package", action="store_true", help="also time `adapterpack verify` of the built package")
    parser.add_argument("--verify-previous", action="store_true",
                        help="also time verify on the executor as before: the KV-cache copied on every update, palettes looked up by numpy indexing")
    parser.add_argument("--verify-only", action="store_true",
                        help="time only the verify figures, of the package an earlier run of the same shape and settings built")
    parser.add_argument("--keep", action="store_true", help="also time full and rebuild with lora: keep")
    parser.add_argument("--disk-previous", action="store_true",
                        help="also build with the disk use of before (PREVIOUS_DISK): peak disk side by side")
    parser.add_argument("--parts-previous", action="store_true",
                        help="also build with whole-copy parts (PREVIOUS_PARTS): peak disk and cache side by side")
    parser.add_argument("--calibration-previous", action="store_true",
                        help="also time two clean builds alone (no cache, no verify): as now, and with calibration as before "
                             "(Grams measured apart on a palette worker, factored again per tensor)")
    parser.add_argument("--settings", choices=list(SETTINGS), nargs="+", default=["grouped"],
                        help="how the manifests compress, one or more (each shape runs them in this order, side by side): "
                             "grouped (the default here, as the baseline does), default (no compression block: what a plain "
                             "manifest gets), auto (calibration text, compression: auto)")
    parser.add_argument("--json", type=Path)
    add_record_option(parser)
    args = parser.parse_args()
    if args.verify_only and not args.skip_baseline:
        parser.error("--verify-only times verify alone: add --skip-baseline")

    report = {"machine": machine(), "runs": []}
    for shape in args.shape:
        for settings in args.settings:
            report["runs"].append(run_shape(args, shape, settings))
            if args.json:  # written after every run: a long one keeps what it measured
                args.json.write_text(json.dumps(report, indent=2))
            if args.record:
                table = calibration_table(report["runs"]) if args.calibration_previous else build_table(report["runs"])
                record(args.record, {"build": table}, report, report["machine"])
    print(json.dumps(report["machine"], indent=2))


SHAPE_TITLES = {"25m": "25M", "1b": "Llama-3.2-1B shape", "3b": "Llama-3.2-3B shape", "8b": "Llama-3.1-8B shape"}
SETTINGS_TITLES = {
    "grouped": "4-bit palettes in groups of 16, embeddings too",
    "default": "plain manifest (no compression block)",
    "auto": "calibration text, compression: auto",
}


def calibration_table(runs: list[dict]) -> Table:
    """Clean builds side by side: calibration as before and as now."""

    def timed(found: dict) -> str:
        return f"{found['seconds']:,.1f} s / {found['peak_rss_gib']:.2f} GiB"

    rows = [
        ["Grams measured apart, on a palette worker; each factored again per tensor (before)", *(timed(r["clean_build_calibration_as_before"]) for r in runs)],
        ["Grams measured with the statistics; each factored once (now)", *(timed(r["clean_build"]) for r in runs)],
        ["now against before", *(f"**{r['calibration_speedup']}x faster**" for r in runs)],
    ]
    return Table(["clean build, 4 fused adapters, plain manifest: seconds / peak RSS", *(SHAPE_TITLES[r["shape"]] for r in runs)], rows)


def build_table(runs: list[dict]) -> Table:
    """The docs' table of a run: a column per shape (and settings, when it ran more than one),
    what a user waits for per row."""

    def timed(run: dict, key: str) -> str:
        found = run.get(key)
        if not isinstance(found, dict):
            return "-"
        outcome = "" if found.get("finished", True) else " (verdict: FAIL)" if found.get("exit_code") == 3 else " (cut off)"
        return f"{found['seconds']:,.1f} s / {found['peak_rss_gib']:.2f} GiB{outcome}"

    def total(run: dict) -> str:
        build, verify = run.get("adapterpack_full"), run.get("adapterpack_verify")
        return f"{(build['seconds'] + verify['seconds']) / 60:.1f} min" if build and verify else "-"

    rows = [
        ["clean build: seconds / peak RSS", *(timed(r, "adapterpack_full") for r in runs)],
        ["rebuild after one adapter changed", *(timed(r, "adapterpack_rebuild_one") for r in runs)],
        ["`adapterpack verify` of the package", *(timed(r, "adapterpack_verify") for r in runs)],
        ["build and verify", *(total(r) for r in runs)],
        ["package", *(f"{r['adapterpack_bytes']:,} B" for r in runs)],
    ]
    if any(isinstance(r.get("baseline_full"), dict) for r in runs):
        rows.append(["straightforward coremltools pipeline", *(timed(r, "baseline_full") for r in runs)])
        rows.append(["clean build against it", *(f"**{r['speedup']}x faster**" if "speedup" in r else "-" for r in runs)])
    settings = sorted({r["settings"] for r in runs}, key=list(SETTINGS).index)
    if len(settings) == 1:
        return Table([f"4 fused adapters, {SETTINGS_TITLES[settings[0]]}", *(SHAPE_TITLES[r["shape"]] for r in runs)], rows)
    plain = {r["shape"]: r for r in runs if r["settings"] == "default"}
    if plain and any(r["settings"] == "auto" for r in runs):
        rows.append(["auto's build over the plain manifest's, against one verify", *(_auto_cost(r, plain.get(r["shape"])) for r in runs)])
    return Table(["4 fused adapters", *(f"{SHAPE_TITLES[r['shape']]}, {SETTINGS_TITLES[r['settings']]}" for r in runs)], rows)


def _auto_cost(run: dict, plain: dict | None) -> str:
    """What ``compression: auto``'s measurements add to the build, in verifies of the package."""
    if run["settings"] != "auto" or plain is None or "adapterpack_verify" not in run:
        return "-"
    extra = run["adapterpack_full"]["seconds"] - plain["adapterpack_full"]["seconds"]
    return f"+{extra:,.1f} s = {extra / run['adapterpack_verify']['seconds']:.2f} verifies"


if __name__ == "__main__":
    main()
