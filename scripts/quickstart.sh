#!/usr/bin/env bash
# Install specserve and start the full distributed server on the bundled models:
# a local Ray head on 127.0.0.1, the target, the proposer heads, the KV manager and the
# OpenAI-compatible router. Prints the API URL, the Ray dashboard URL and a curl to try.
# Ctrl-C stops it. Usage: bash scripts/quickstart.sh [--port 8000] [--default-mode eagle3] [--modes eagle3,mtp] ...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/specserve serve "$@"
