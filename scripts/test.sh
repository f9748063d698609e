#!/usr/bin/env bash
# Install specserve with its test tools (and the convert venv), run the whole test suite:
# the conversion tests in .venv-convert (torch, mobius-onnx), everything else in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
bash scripts/test_convert.sh "$@"
exec .venv/bin/python -m pytest --durations=20 "$@"  # the slowest: where CI's 20 minutes go
