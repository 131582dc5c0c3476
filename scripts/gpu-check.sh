#!/usr/bin/env bash
# The GPU check (docs/cuda.md), for a machine with a CUDA device, the CUDA toolkit, CMake, ninja and
# PyTorch and nothing else (none of the project's Debian packages, no network): builds the CUDA
# kernel's self-contained check with nvcc and the host compiler alone, runs its correctness tests
# against the CPU scalar reference (every format, page sizes 1 and 16, splits 1/4/16, shuffled page
# tables, a batch of different lengths, a CUDA graph replay), then the benchmark beside PyTorch's
# scaled_dot_product_attention on the same shapes, and writes out/gpu-check/results.json and
# results.md. The default run is sized to finish within 8 minutes on an H100/H200; --quick times
# S = 4096 only, --full the issue's whole matrix (B 1/8/64, S to 128k, GQA 4:1 and 8:1; longer).
# Usage: scripts/gpu-check.sh [--quick | --full]   (PYTHON=... names the interpreter with PyTorch)
set -euo pipefail
cd "$(dirname "$0")/.."

size=""
case "${1:-}" in
  "") ;;
  --quick | --full) size=$1 ;;
  *)
    echo "usage: scripts/gpu-check.sh [--quick | --full]" >&2
    exit 2
    ;;
esac
bench_timeout=180
[ "$size" = "--full" ] && bench_timeout=1200
out=out/gpu-check
obj=$out/build
rm -rf "$obj"
mkdir -p "$obj"
rm -f "$out"/results.json "$out"/results.md "$out"/tests.json "$out"/bench.json "$out"/sdpa.json
started=$(date +%s)
die() {
  echo "gpu-check: error: $*" >&2
  exit 1
}
elapsed() { echo $(($(date +%s) - started)); }

nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$nvcc" ] || die "nvcc not found: put the CUDA toolkit's bin/ on PATH or set NVCC"
# A host compiler with the C++20 the sources use (g++ ≥ 11 or clang++ ≥ 14); nvcc takes the same one.
cxx=""
for candidate in ${CXX:-} g++ c++ clang++; do
  command -v "$candidate" >/dev/null 2>&1 || continue
  if printf '#include <bit>\n#include <span>\nint main() { float f = 1; return std::bit_cast<int>(f) == 0 && std::span<float>(&f, 1).empty(); }\n' |
    "$candidate" -std=c++20 -x c++ - -o "$obj/cxx20-probe" >/dev/null 2>&1; then
    cxx=$(command -v "$candidate")
    break
  fi
done
[ -n "$cxx" ] || die "no host C++ compiler with C++20 (std::bit_cast, std::span): install g++ 11 or later, or set CXX"
jobs=$(nproc)

# The device's own architecture where nvidia-smi tells it; otherwise A100 and H100/H200.
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .' || true)
if [ -n "$cap" ]; then
  arch=(-gencode "arch=compute_$cap,code=sm_$cap")
else
  arch=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
fi

# The CPU scalar reference and the pool it reads: plain C++20, no third-party library.
cpu_sources=(
  src/base/fp16.cc
  src/cert/meter.cc src/cert/subgaussian.cc src/cert/witness.cc
  $(find src/formats -name '*.cc' ! -name '*_test.cc' | sort)
  src/kvcache/backing_tier.cc src/kvcache/kv_store.cc src/kvcache/page_pool.cc
  src/attention/reference/certified_attention.cc
  src/attention/cuda/mirror.cc
)
cuda_sources=(src/attention/cuda/attention.cu src/attention/cuda/cuda_check.cu src/attention/cuda/cuda_bench.cu)

echo "gpu-check: building with $nvcc (${arch[*]}) and $cxx, $jobs jobs"
{
  printf '%s\n' "${cpu_sources[@]}" |
    xargs -P "$jobs" -I{} sh -c 'o='"$obj"'/$(echo {} | tr / _).o; '"$cxx"' -std=c++20 -O2 -Isrc -c {} -o "$o"'
  for s in "${cuda_sources[@]}"; do
    "$nvcc" -ccbin "$cxx" -std=c++20 -O3 -fmad=false -Isrc "${arch[@]}" -c "$s" -o "$obj/$(echo "$s" | tr / _).o" &
  done
  wait
  "$nvcc" -ccbin "$cxx" "${arch[@]}" "$obj"/*.o -o "$obj/witcert_cuda_check" -lpthread
} >"$out/build.log" 2>&1 || {
  tail -40 "$out/build.log" >&2
  die "the build failed (full log: $out/build.log)"
}
check=$obj/witcert_cuda_check
echo "gpu-check: built in $(elapsed) s"

set +e
timeout 240 "$check" --test --json "$out/tests.json" | tee "$out/tests.log"
tests_rc=${PIPESTATUS[0]}
set -e
if [ "$tests_rc" -eq 77 ]; then
  die "no CUDA device visible (the check printed why above); run this on a machine with a GPU"
fi
echo "gpu-check: tests finished (exit $tests_rc) at $(elapsed) s"

set +e
timeout "$bench_timeout" "$check" --bench $size --json "$out/bench.json" | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
python=${PYTHON:-$(command -v python3 || command -v python || true)}
sdpa_rc=1
if [ -n "$python" ]; then
  timeout "$bench_timeout" "$python" scripts/gpu_check_sdpa.py $size --json "$out/sdpa.json" | tee "$out/sdpa.log"
  sdpa_rc=${PIPESTATUS[0]}
fi
set -e
echo "gpu-check: benchmark exit $bench_rc, SDPA exit $sdpa_rc at $(elapsed) s"

[ -n "$python" ] || die "no python3 for the report (the raw results are in $out/*.json)"
"$python" scripts/gpu_check_report.py "$out" --tests-exit "$tests_rc" --bench-exit "$bench_rc" --sdpa-exit "$sdpa_rc" \
  --seconds "$(elapsed)"
echo "gpu-check: wrote $out/results.json and $out/results.md in $(elapsed) s"
[ "$tests_rc" -eq 0 ] || die "GPU tests failed (see $out/tests.log)"
[ "$bench_rc" -eq 0 ] || die "the benchmark failed (see $out/bench.log)"
