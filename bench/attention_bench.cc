// Decode attention of one KV head's GQA group over S cached tokens (one thread), per cache format:
// fp16 through the exact path (attn::exact_attention, scalar: what CertifiedKvCache runs for fp16)
// and through the fast kernel, rtn-int8, q8_0 (Tier A) and dither-int8 with per-slot and
// shared-page dither (Tier B), each with the meter on and off (attend_range_fast's switch). Counters: GB/s of cache bytes read (K + V as measured from the KvStore allocations:
// payload and meter metadata), B/tok/head (K + V) and the KV capacity at equal memory relative to
// fp16. BM_StreamRead measures the machine's read bandwidth at working sets around the caches'.
//
//   cmake --build build --target witcert_bench &&
//   build/witcert_bench --benchmark_filter='Attention|StreamRead' --benchmark_repetitions=5
//     --benchmark_report_aggregates_only=true --benchmark_out=attention.json --benchmark_out_format=json &&
//   python3 tools/attention_bench_table.py attention.json
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attn/certified_attention.h"
#include "attn/certified_attention_fast.h"
#include "attn/exact_cache.h"
#include "cache/kv_store.h"
#include "cert/subgaussian.h"

namespace witcert::attn {
namespace {

struct Variant {
  const char* name;
  const char* format;  // both sides
  cache::DitherMode dither;
  bool meter;
  bool exact_path;  // attn::exact_attention, as CertifiedKvCache runs fp16
};

// Variants of one format are adjacent, so that consecutive benchmarks share the store.
constexpr Variant kVariants[] = {
    {"fp16", "fp16", cache::DitherMode::per_slot, false, true},
    {"fp16/fast-kernel", "fp16", cache::DitherMode::per_slot, false, false},
    {"rtn-int8/meter-off", "rtn-int8", cache::DitherMode::per_slot, false, false},
    {"rtn-int8", "rtn-int8", cache::DitherMode::per_slot, true, false},
    {"q8_0/meter-off", "q8_0", cache::DitherMode::per_slot, false, false},
    {"q8_0", "q8_0", cache::DitherMode::per_slot, true, false},
    {"dither-int8/per-slot/meter-off", cache::kDitherInt8, cache::DitherMode::per_slot, false, false},
    {"dither-int8/per-slot", cache::kDitherInt8, cache::DitherMode::per_slot, true, false},
    {"dither-int8/shared/meter-off", cache::kDitherInt8, cache::DitherMode::shared_page, false, false},
    {"dither-int8/shared", cache::kDitherInt8, cache::DitherMode::shared_page, true, false},
};

// The store of the last benchmark (one at a time keeps the resident set to one cache), filled
// with keys that have a few massive RoPE-pair channels, as real models have.
cache::KvStore& store_for(const Variant& v, int d, std::int64_t S) {
  static std::unique_ptr<cache::KvStore> store;
  static std::string key;
  const std::string want = std::string(v.format) + "/" + std::to_string(static_cast<int>(v.dither)) + "/" +
                           std::to_string(d) + "/" + std::to_string(S);
  if (key == want) return *store;
  store.reset();
  cache::CacheConfig c;
  c.layers = 1;
  c.kv_heads = 1;
  c.head_dim = d;
  c.capacity = S;
  c.k_format = c.v_format = v.format;
  c.dither = v.dither;
  store = std::make_unique<cache::KvStore>(c);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> gain(d), k(d), val(d);
  for (float& x : gain) x = std::exp(0.8f * g(rng));
  gain[6] = gain[7] = 12.0f;
  for (std::int64_t p = 0; p < S; ++p) {
    for (int i = 0; i < d; ++i) k[i] = gain[i] * g(rng), val[i] = g(rng);
    store->write(0, 0, p, k.data(), val.data());
  }
  key = want;
  return *store;
}

// Args: variant, S, head dim, GQA group.
void BM_DecodeAttention(benchmark::State& state) {
  const Variant& v = kVariants[state.range(0)];
  const std::int64_t S = state.range(1);
  const int d = static_cast<int>(state.range(2)), group = static_cast<int>(state.range(3));
  cache::KvStore& store = store_for(v, d, S);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(group) * d), out(q.size());
  for (float& x : q) x = g(rng);
  // δ_loc of SmolLM2-135M (30 layers, 9 query heads) at the default budget.
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), S, cert::delta_loc(1e-2, 30, 9, 256)};
  std::vector<HeadPartial> partials;
  for (auto _ : state) {
    cache::KvStore::Reader reader(store, 0, 0);
    if (v.exact_path) {
      for (int h = 0; h < group; ++h)
        exact_attention(
            &q[h * d], [&](std::int64_t t) { return reader.exact_key_row(t); },
            [&](std::int64_t t) { return reader.exact_value_row(t); }, S, d, &out[h * d]);
    } else {
      partials.assign(group, HeadPartial{});
      attend_range_fast(reader, q.data(), group, d, 0, S, ctx, partials, v.meter);
      for (int h = 0; h < group; ++h) finish(partials[h], d, &out[h * d]);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double per_token = store.bytes_per_token_head(quant::KvSide::key) + store.bytes_per_token_head(quant::KvSide::value);
  state.counters["GB/s"] =
      benchmark::Counter(per_token * static_cast<double>(S) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["B/tok/head"] = per_token;
  state.counters["capacity_x"] = 4.0 * d / per_token;
  state.SetLabel(v.name);
}

void attention_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"variant", "S", "d", "group"});
  for (std::int64_t S : {4096, 32768})
    for (std::int64_t d : {64, 128})
      for (std::int64_t v = 0; v < static_cast<std::int64_t>(std::size(kVariants)); ++v)
        for (std::int64_t group : {3, 7}) b->Args({v, S, d, group});
}
BENCHMARK(BM_DecodeAttention)->Apply(attention_args)->Unit(benchmark::kMicrosecond);

// A sequential read of `bytes` (64-bit integer sums, which the compiler vectorizes): the read
// bandwidth the attention kernels are held against, from cache-resident to DRAM-sized sets.
void BM_StreamRead(benchmark::State& state) {
  std::vector<std::uint64_t> a(static_cast<std::size_t>(state.range(0)) / sizeof(std::uint64_t), 1);
  for (auto _ : state) {
    std::uint64_t sum = 0;
    for (std::uint64_t x : a) sum += x;
    benchmark::DoNotOptimize(sum);
  }
  state.counters["GB/s"] =
      benchmark::Counter(static_cast<double>(state.range(0)) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_StreamRead)->ArgName("bytes")->Arg(4 << 20)->Arg(16 << 20)->Arg(256 << 20)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace witcert::attn
