#!/usr/bin/env bash
# Install specserve and generate text with the bundled target model, in-process.
# Usage: bash scripts/quickstart.sh ["prompt"] [extra 'python -m engine generate' flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PROMPT=${1:-'def read_config(path):
    """Read a configuration file and return a dict."""
'}
shift || true
exec .venv/bin/python -m engine generate --model models/target --prompt "$PROMPT" --max-new-tokens 96 "$@"
