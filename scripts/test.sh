#!/usr/bin/env bash
# Install specserve with its test tools and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
