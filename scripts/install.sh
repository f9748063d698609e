#!/usr/bin/env bash
# Create .venv (if missing) and install specserve with its test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
# onnxruntime-gpu and plain onnxruntime share one import name; both installed breaks it.
if .venv/bin/python -m pip show onnxruntime >/dev/null 2>&1; then
  echo "error: plain 'onnxruntime' is installed beside 'onnxruntime-gpu' in .venv; uninstall it" >&2
  exit 1
fi
