#!/usr/bin/env bash
# Make .venv-peer (onnxruntime-genai and its model builder) and convert the bundled
# target's own weights (models/fixture/target/model.safetensors) with that builder into
# .cache/peer/genai_target. Idempotent; used by bench/peer_genai.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
[ -x .venv-peer/bin/python ] || "$PYTHON" -m venv .venv-peer
.venv-peer/bin/python -m pip install --quiet --disable-pip-version-check torch==2.13.0  # the CPU build; never let a dependency pull CUDA's
.venv-peer/bin/python -m pip install --quiet --disable-pip-version-check -r bench/peer/requirements.txt
OUT=.cache/peer/genai_target
if [ ! -f "$OUT/model.onnx" ]; then
  mkdir -p .cache/peer
  if ! .venv-peer/bin/python -m onnxruntime_genai.models.builder -i models/fixture/target -o "$OUT" -p fp32 -e cpu \
      -c .cache/peer/builder-cache >.cache/peer/build.log 2>&1; then
    tail -20 .cache/peer/build.log >&2
    exit 1
  fi
  echo "built $OUT with onnxruntime-genai's model builder"
fi
