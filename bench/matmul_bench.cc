// Weight matrix products at SmolLM2-135M's shapes: matvec (decode, 1 token) and matmul (prefill,
// 16 or 64 tokens) for Q4_1 576×1536, 1536×576 and Q8_0 49152×576 at 1 and 2 threads, and the matvecs
// of one whole decode step. Reports GFLOP/s (2·rows·cols·tokens) and GB/s of weight bytes.
//
//   cmake --build build --target witcert_bench &&
//   build/witcert_bench --benchmark_filter='Matmul|DecodeStep' --benchmark_repetitions=5
//     --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "model/matmul.h"

namespace witcert::model {
namespace {

using formats::GgmlType;

struct Matrix {
  std::vector<std::uint8_t> bytes;
  WeightMatrix w;
};

Matrix make_matrix(GgmlType t, std::int64_t rows, std::int64_t cols, std::mt19937_64& rng) {
  Matrix m;
  const std::size_t row_bytes = formats::ggml_row_bytes(t, cols);
  m.bytes.resize(rows * row_bytes);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> row(cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = normal(rng);
    formats::quantize_row(t, row.data(), m.bytes.data() + r * row_bytes, cols);
  }
  m.w = {t, m.bytes.data(), rows, cols};
  return m;
}

void set_counters(benchmark::State& state, double flops, double bytes) {
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Args: type, rows, cols, tokens, threads.
void BM_Matmul(benchmark::State& state) {
  const GgmlType type = static_cast<GgmlType>(state.range(0));
  const std::int64_t rows = state.range(1), cols = state.range(2), tokens = state.range(3);
  std::mt19937_64 rng(1);
  const Matrix m = make_matrix(type, rows, cols, rng);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(tokens * cols), y(tokens * rows);
  for (float& v : x) v = normal(rng);
  ThreadPool pool(static_cast<int>(state.range(4)));
  for (auto _ : state) {
    matmul(m.w, x.data(), tokens, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, 2.0 * rows * cols * tokens, static_cast<double>(m.bytes.size()));
  state.SetLabel(formats::ggml_type_info(type)->name);
}

void matmul_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"type", "rows", "cols", "tokens", "threads"});
  const std::int64_t q4_1 = static_cast<std::int64_t>(GgmlType::Q4_1), q8_0 = static_cast<std::int64_t>(GgmlType::Q8_0);
  for (std::int64_t tokens : {1, 16, 64})
    for (std::int64_t threads : {1, 2}) {
      b->Args({q4_1, 576, 1536, tokens, threads});
      b->Args({q4_1, 1536, 576, tokens, threads});
      b->Args({q8_0, 49152, 576, tokens, threads});
    }
}
BENCHMARK(BM_Matmul)->Apply(matmul_args)->UseRealTime()->Unit(benchmark::kMicrosecond);

// Every matvec of one SmolLM2-135M decode step, each layer with its own weights (so they stream
// from memory as in the model): per layer q 576×576, k and v 192×576, o 576×576, gate and up
// 1536×576 and down 576×1536 in Q4_1, times 30 layers, then the Q8_0 output 49152×576.
void BM_DecodeStepMatvecs(benchmark::State& state) {
  std::mt19937_64 rng(2);
  std::vector<Matrix> ms;
  for (int layer = 0; layer < 30; ++layer) {
    for (const auto& [rows, cols] : {std::pair<std::int64_t, std::int64_t>{576, 576},
                                     {192, 576},
                                     {192, 576},
                                     {576, 576},
                                     {1536, 576},
                                     {1536, 576},
                                     {576, 1536}})
      ms.push_back(make_matrix(GgmlType::Q4_1, rows, cols, rng));
  }
  ms.push_back(make_matrix(GgmlType::Q8_0, 49152, 576, rng));
  std::vector<float> x(1536, 0.01f), y(49152);
  ThreadPool pool(static_cast<int>(state.range(0)));
  double flops = 0.0, bytes = 0.0;
  for (const Matrix& m : ms) {
    flops += 2.0 * m.w.rows * m.w.cols;
    bytes += static_cast<double>(m.bytes.size());
  }
  for (auto _ : state) {
    for (const Matrix& m : ms) matmul(m.w, x.data(), 1, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, flops, bytes);
}
BENCHMARK(BM_DecodeStepMatvecs)->ArgName("threads")->Arg(1)->Arg(2)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace witcert::model
