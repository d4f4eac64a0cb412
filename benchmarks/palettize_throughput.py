"""Palettization throughput and reconstruction error: adapterpack vs coremltools' k-means.

Both compress the same float16 linear weights of one ML Program with the same settings (4-bit,
per_grouped_channel, group_size 16, iOS18), through coremltools' own ``palettize_weights``:
coremltools in ``kmeans`` mode, adapterpack with its vectorized 1-D k-means (``compress.py``).
Reports parameters per second, the mean squared reconstruction error of each (weights
decompressed by coremltools' ``decompress_weights``), and the ratios, from one run.

    .venv/bin/python benchmarks/palettize_throughput.py [--layers 8] [--size 1024]

coremltools 9.0 calls ``kmeans1d.cluster(values, k, weights=counts)`` but no published kmeans1d
release takes ``weights``; the shim below expands the weights into repeated values, which is
the same weighted problem, so coremltools' exact k-means runs as its authors intended.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from results import Table, add_record_option, record

from adapterpack.quiet import captured_output


def install_kmeans1d_shim() -> None:
    from collections import namedtuple

    import kmeans1d
    from coremltools.models.neural_network import quantization_utils

    Clustered = namedtuple("Clustered", ["clusters", "centroids"])

    def cluster(values, k, weights=None):
        values = np.asarray(values, dtype=np.float64)
        if weights is None:
            return Clustered(*kmeans1d.cluster(values, k))
        counts = np.asarray(weights, dtype=np.int64)
        expanded = np.repeat(values, counts)
        labels, centroids = kmeans1d.cluster(expanded, k)
        # Equal values share a label; read each distinct value's label at its first copy.
        first = np.concatenate(([0], np.cumsum(counts)[:-1]))
        return Clustered(np.asarray(labels)[first].tolist(), centroids)

    shim = type("kmeans1d_shim", (), {"cluster": staticmethod(cluster)})
    quantization_utils._kmeans1d = shim
    quantization_utils._HAS_KMEANS1D = True


def coremltools_with_sklearn():
    """coremltools as the baseline needs it: its k-means mode uses scikit-learn (adapterpack's
    own import skips that probe)."""
    with captured_output():
        import coremltools
    return coremltools


def make_model(layers: int, size: int, seed: int = 0):
    """An ML Program of ``layers`` float16 linear layers with Gaussian weights."""
    ct = coremltools_with_sklearn()
    from coremltools.converters.mil import Builder as mb

    rng = np.random.default_rng(seed)
    weights = [(rng.standard_normal((size, size)) * 0.02).astype(np.float16) for _ in range(layers)]

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, size), dtype=ct.converters.mil.mil.types.fp16)],
                opset_version=ct.target.iOS18)
    def program(x):
        for index, weight in enumerate(weights):
            x = mb.linear(x=x, weight=mb.const(val=weight, name=f"w{index}"), name=f"linear{index}")
        return x

    with captured_output():
        model = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                           compute_precision=ct.precision.FLOAT16, skip_model_load=True)
    return model, {f"w{i}": w for i, w in enumerate(weights)}


def reconstruction_mse(model, originals: dict[str, np.ndarray]) -> float:
    from coremltools.optimize.coreml import decompress_weights, get_weights_metadata

    with captured_output():
        dense = get_weights_metadata(decompress_weights(model), weight_threshold=1)
    errors = []
    for name, original in originals.items():
        value = next(meta.val for key, meta in dense.items() if key.startswith(name))
        errors.append(np.mean((value.astype(np.float64) - original.astype(np.float64)) ** 2))
    return float(np.mean(errors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_record_option(parser)
    args = parser.parse_args()

    ct = coremltools_with_sklearn()
    from coremltools.optimize import coreml as cto

    from adapterpack.config.compression import Compression
    from adapterpack.formats.mlpackage.weights import compress_model

    install_kmeans1d_shim()
    params = args.layers * args.size * args.size
    model, originals = make_model(args.layers, args.size)

    config = cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(
        mode="kmeans", nbits=4, granularity="per_grouped_channel", group_size=16, weight_threshold=2048))
    started = time.perf_counter()
    with captured_output():
        baseline = cto.palettize_weights(model, config=config)
    baseline_seconds = time.perf_counter() - started

    model, _ = make_model(args.layers, args.size)
    started = time.perf_counter()
    ours = compress_model(model, Compression(method="palettize", nbits=4, granularity="per_grouped_channel",
                                             group_size=16, keep_float16=()))
    ours_seconds = time.perf_counter() - started

    # Determinism: the same weights must give the same palettes, run to run.
    model_again, _ = make_model(args.layers, args.size)
    again = compress_model(model_again, Compression(method="palettize", nbits=4, keep_float16=()))
    import tempfile

    with tempfile.TemporaryDirectory() as folder, captured_output():
        ours.save(f"{folder}/a.mlpackage")
        again.save(f"{folder}/b.mlpackage")
        blob = "Data/com.apple.CoreML/weights/weight.bin"
        identical = Path(f"{folder}/a.mlpackage/{blob}").read_bytes() == Path(f"{folder}/b.mlpackage/{blob}").read_bytes()

    baseline_mse = reconstruction_mse(baseline, originals)
    ours_mse = reconstruction_mse(ours, originals)
    figures = {
        "parameters": params,
        "coremltools_seconds": round(baseline_seconds, 2),
        "adapterpack_seconds": round(ours_seconds, 2),
        "coremltools_params_per_s": round(params / baseline_seconds),
        "adapterpack_params_per_s": round(params / ours_seconds),
        "speedup": round(baseline_seconds / ours_seconds, 1),
        "coremltools_mse": baseline_mse,
        "adapterpack_mse": ours_mse,
        "error_ratio": round(ours_mse / baseline_mse, 4),
        "bit_identical_run_to_run": identical,
        "coremltools_version": ct.__version__,
    }
    print(f"palettization, 4-bit per_grouped_channel/16, {params / 1e6:.1f}M float16 parameters")
    print(f"  coremltools kmeans : {baseline_seconds:7.2f} s  {params / baseline_seconds / 1e6:6.2f}M params/s  mse {baseline_mse:.4e}")
    print(f"  adapterpack        : {ours_seconds:7.2f} s  {params / ours_seconds / 1e6:6.2f}M params/s  mse {ours_mse:.4e}")
    print(f"  speedup {figures['speedup']}x, error ratio {figures['error_ratio']} (adapterpack / coremltools), "
          f"bit-identical run to run: {identical}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    if args.record:
        rows = [
            ["coremltools k-means (kmeans1d / scikit-learn)", f"{baseline_seconds:.2f}", f"{params / baseline_seconds / 1e6:.2f}M", f"{baseline_mse:.4e}"],
            ["adapterpack (vectorized 1-D k-means)", f"{ours_seconds:.2f}", f"{params / ours_seconds / 1e6:.2f}M", f"{ours_mse:.4e}"],
            ["ratio", f"**{figures['speedup']}x faster**", "", f"**{(figures['error_ratio'] - 1) * 100:+.2f}% error**"],
        ]
        record(args.record, {"palettization": Table(["", "seconds", "params/s", "reconstruction MSE"], rows)}, figures)


if __name__ == "__main__":
    main()
