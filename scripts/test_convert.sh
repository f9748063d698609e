#!/usr/bin/env bash
# Install .venv-convert and run the conversion tests (tests/convert) in it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_convert.sh
TQDM_DISABLE=1 exec .venv-convert/bin/python -m pytest tests/convert "$@"
