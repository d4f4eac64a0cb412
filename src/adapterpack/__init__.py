"""adapterpack: package a Hugging Face base model and its LoRA adapters as one multifunction
Core ML model (or Core AI asset) with a stateful KV-cache, verified against PyTorch.

The Python API is what the command line runs::

    import adapterpack as ap

    result = ap.build("manifests/demo.yaml", output="build/demo.mlpackage", options=ap.BuildOptions(force=True))
    report = ap.verify(result.output, "manifests/demo.yaml")
    assert report.passed

Importing this package loads nothing heavy: torch, coremltools and transformers load when a
function first needs them (the names below resolve on first use).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapterpack.assemble.records import BuildOptions, BuildResult, Reporter
    from adapterpack.config.manifest import Manifest
    from adapterpack.distribution.artifacts import ReleaseResult
    from adapterpack.verification.reports import FunctionReport, VerifyReport

__all__ = [
    "AdapterpackError",
    "BadInput",
    "BuildOptions",
    "BuildResult",
    "FunctionReport",
    "Manifest",
    "OutOfResources",
    "OutputExists",
    "ReleaseResult",
    "Reporter",
    "VerificationFailed",
    "VerifyReport",
    "__version__",
    "build",
    "load_manifest",
    "release",
    "verify",
]

# Where each public type lives; loaded on first use (PEP 562), so that importing adapterpack,
# which every submodule import does first, stays light.
_TYPES = {
    "BuildOptions": "adapterpack.assemble.records",
    "BuildResult": "adapterpack.assemble.records",
    "Reporter": "adapterpack.assemble.records",
    "Manifest": "adapterpack.config.manifest",
    "ReleaseResult": "adapterpack.distribution.artifacts",
    "FunctionReport": "adapterpack.verification.reports",
    "VerifyReport": "adapterpack.verification.reports",
    "AdapterpackError": "adapterpack.errors",
    "BadInput": "adapterpack.errors",
    "OutputExists": "adapterpack.errors",
    "VerificationFailed": "adapterpack.errors",
    "OutOfResources": "adapterpack.errors",
}


def __getattr__(name: str):
    if name in _TYPES:
        return getattr(importlib.import_module(_TYPES[name]), name)
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("adapterpack")
        except PackageNotFoundError:  # run from a source tree that was never installed
            return "0+unknown"
    raise AttributeError(f"module 'adapterpack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest file.

    Raises ``BadInput`` (exit code 2 on the command line) naming the file and line of the first
    problem. Paths in the manifest are resolved against its folder.
    """
    from adapterpack.config.manifest import load_manifest as load

    return load(path)


def build(
    manifest: Manifest | str | Path,
    *,
    output: str | Path | None = None,
    options: BuildOptions | None = None,
    reporter: Reporter | None = None,
) -> BuildResult:
    """Build the package ``manifest`` describes (a path or a loaded ``Manifest``), verify every
    function, then move it into place; what ``adapterpack build`` runs.

    ``output`` overrides the manifest's ``output`` (its suffix, ``.mlpackage`` or ``.aimodel``,
    chooses the format). ``options``: ``BuildOptions`` (``force`` replaces an existing output,
    ``verify=False`` skips verification, ``cache_dir``/``use_cache`` the build cache...).
    ``reporter``: progress hooks (the default logs each stage).

    Raises ``BadInput`` for a bad manifest, model or adapter, ``OutputExists`` when the output
    exists without ``force``, ``VerificationFailed`` (with ``.report``) when a function does
    not match its PyTorch reference: a previous output is then left as it was.
    """
    from adapterpack.assemble.pipeline import build as run
    from adapterpack.assemble.records import BuildOptions

    return run(manifest, output=output, options=options or BuildOptions(), reporter=reporter)


def verify(
    package: str | Path, manifest: Manifest | str | Path, *, backend: str = "numpy", reporter: Reporter | None = None
) -> VerifyReport:
    """Check every function of ``package`` against the PyTorch reference of ``manifest`` (the
    manifest it was built from); what ``adapterpack verify`` runs.

    Never raises on a mismatch: ``report.passed`` says whether every function passed both
    verdicts, ``report.functions`` holds each function's figures and failures. ``backend``:
    ``numpy`` executes the ML Program on any OS; ``coreml`` runs Core ML itself (macOS).
    ``reporter``: progress hooks around each long step (the default shows none).
    """
    from adapterpack.config.manifest import Manifest
    from adapterpack.config.manifest import load_manifest as load
    from adapterpack.errors import BadInput
    from adapterpack.verification.package import verify_package
    from adapterpack.verification.runners import check_backend

    check_backend(backend)
    if not Path(package).exists():
        raise BadInput(f"{package}: package not found")
    loaded = manifest if isinstance(manifest, Manifest) else load(manifest)
    return verify_package(package, loaded, backend=backend, stage=reporter.stage if reporter is not None else None)


def release(
    manifest: Manifest | str | Path,
    out_dir: str | Path,
    *,
    options: BuildOptions | None = None,
    reporter: Reporter | None = None,
    bundle: bool = True,
    eval_text: str | Path | None = None,
    eval_window: int | None = None,
) -> ReleaseResult:
    """Build and verify afresh, then write a reproducible release into ``out_dir``: the zipped
    package, ``build-info.json``, ``SHA256SUMS`` and (``bundle``) the app-ready folder (package,
    tokenizer files, Swift enum, model card); what ``adapterpack release`` runs. ``eval_text``
    adds a perplexity table on that text to the model card (``eval_window`` tokens per window)."""
    from adapterpack.assemble.records import BuildOptions
    from adapterpack.distribution.artifacts import release as run

    return run(
        manifest, out_dir, options=options or BuildOptions(), reporter=reporter, bundle=bundle,
        eval_text=None if eval_text is None else Path(eval_text), eval_window=eval_window,
    )
