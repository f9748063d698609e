#!/usr/bin/env bash
# Install specserve and generate text with the bundled models, in-process (EAGLE-3 speculation).
# Usage: bash scripts/quickstart.sh ["prompt"] [extra 'python -m engine generate' flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PROMPT=${1:-'import os
import sys


def main(argv):'}
shift || true
# EAGLE-3 speculation by default: the text is exactly the target's own greedy output.
exec .venv/bin/python -m engine generate --model models/target --prompt "$PROMPT" --max-new-tokens 96 \
    --speculative eagle3 "$@"
