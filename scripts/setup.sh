#!/usr/bin/env bash
# Create .venv/ at the repo root and install adapterpack with its test dependencies, the Core AI
# extra (the .aimodel format; its tests run in the default suite) and the docs site's (the suite
# builds it).
# torch is installed first from its CPU wheel: a plain `torch` requirement with nothing installed
# would pull a multi-GB CUDA build. Everything else is installed within constraints.txt, the
# versions the suite and the recorded package digests were made with. Safe to re-run; it only
# installs what is missing or outside those versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==${ADAPTERPACK_TORCH:-2.13.0}"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check --constraint constraints.txt -e ".[test,coreai,docs]"
echo "adapterpack installed: .venv/bin/adapterpack" >&2
