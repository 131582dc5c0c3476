#!/usr/bin/env bash
# llama.cpp as a peer for the decode benchmarks only (none of its code enters the tree): the
# llama-cpp-python sdist from PyPI vendors llama.cpp under vendor/llama.cpp; it is extracted under
# build-peer/ (ignored), llama-bench, llama-batched-bench and llama-server are built for this CPU
# (without AMX) into build-peer/, and llama-bench's q8_0-cache decode speed after 128, 1024 and 4096 tokens of
# context is measured on the test model with 2 threads.
# Usage: bench/llama_cpp_peer.sh [MODEL]   (JOBS=n for the build's parallelism; BUILD_ONLY=1 to
# build without measuring)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
peer=$root/build-peer
mkdir -p "$peer"
tools=(llama-bench llama-batched-bench llama-server)
if [[ ! -x $peer/llama-bench || ! -x $peer/llama-batched-bench || ! -x $peer/llama-server ]]; then
  if ! ls "$peer"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    pip download --no-binary :all: --no-deps -d "$peer" llama-cpp-python
  fi
  sdist=$(ls "$peer"/llama_cpp_python-*.tar.gz | head -1)
  src=$peer/src
  if [[ ! -d $src ]]; then
    mkdir -p "$src"
    tar -xzf "$sdist" -C "$src" --strip-components=1
  fi
  # This CPU's vector extensions but not AMX: some guests advertise AMX and fault on it (llama.cpp
  # then dies with SIGILL in its AMX matmul), and -march=native would turn it on.
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  cmake -S "$src/vendor/llama.cpp" -B "$peer/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) \
    -DGGML_BMI2=$(has bmi2) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi) \
    -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AVX_VNNI=$(has avx_vnni) \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$peer/build" --target "${tools[@]}" -j "${JOBS:-2}"
  for t in "${tools[@]}"; do cp "$(find "$peer/build" -name "$t" -type f -perm -u+x | head -1)" "$peer/$t"; done
fi
[[ ${BUILD_ONLY:-0} == 1 ]] && exit 0
"$peer/llama-bench" -m "$model" -t 2 -fa 1 -ctk q8_0 -ctv q8_0 -p 0 -n 64 -d 128,1024,4096
