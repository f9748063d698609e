#!/usr/bin/env bash
# Create .venv-convert (if missing) for `python -m specserve.modelbuild.convert` and tests/convert:
# torch (CPU build), mobius-onnx, transformers, onnxruntime-genai's model builder; see
# modelbuild/convert-requirements.txt for why it is a venv of its own. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv-convert/bin/python ] || "$PYTHON" -m venv .venv-convert
.venv-convert/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0  # first: the CPU build
.venv-convert/bin/python -m pip install --quiet --disable-pip-version-check -r modelbuild/convert-requirements.txt
# specserve itself, editable and without its runtime pins (this venv runs plain onnxruntime)
.venv-convert/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
