// Decode attention of one KV head's GQA group over S cached tokens (one thread), per cache format:
// fp16 through the exact path (exact_attention_group, what CertifiedKvCache runs; its scalar
// oracle exact_attention) and through the fast kernel, rtn-int8, q8_0 (Tier A) and dither-int8 with
// per-slot and shared-page dither (Tier B), each with the meter on and off (kernel::attend_range's
// switch). Counters: GB/s of cache bytes read (K + V as measured from the KvStore allocations:
// payload and meter metadata), B/tok/head (K + V) and the KV capacity at equal memory relative to
// fp16. BM_StreamRead measures the machine's read bandwidth from cache-resident to DRAM-sized sets.
//
// Two residencies (the `cold` argument):
//   cold:0  hot: every iteration attends over the same (layer, KV head), whose K and V stay in the
//           last-level cache between iterations (compute-bound).
//   cold:1  cold, as a real decode step: the store holds `streams` independent (layer, KV head)
//           caches and iteration i attends over stream i mod streams, so a stream is read once per
//           rotation. The rotation is sized so that even the int8 formats' bytes exceed
//           kColdL3Multiple × the L3 size (the fp16 tier is about twice that): nothing read by one
//           iteration is still cached when the rotation comes back to it.
//
//   cmake --build build --target witcert_bench &&
//   build/witcert_bench --benchmark_filter='Attention|PairedRatio|StreamRead' --benchmark_repetitions=5
//     --benchmark_report_aggregates_only=true --benchmark_out=attention.json --benchmark_out_format=json &&
//   build/witcert_bench --benchmark_filter=KvBytes --benchmark_out=kv_bytes.json --benchmark_out_format=json &&
//   python3 tools/attention_bench_table.py attention.json kv_bytes.json
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <utility>
#include <iterator>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "attention/cpu/attend.h"
#include "attention/cpu/exact_attention_fast.h"
#include "attention/cpu/exact_cache.h"
#include "attention/reference/certified_attention.h"
#include "attention/reference/exact_attention.h"
#include "cert/subgaussian.h"
#include "kvcache/kv_store.h"

namespace witcert::attention {
namespace {

enum class Path {
  fast,          // kernel::attend_range
  exact_group,   // exact_attention_group: what CertifiedKvCache runs for fp16
  exact_scalar,  // exact_attention per query head: the scalar oracle (ExactKvCache)
};

struct Variant {
  const char* name;
  const char* format;  // both sides
  kvcache::DitherMode dither;
  bool meter;
  Path path;
};

// Variants of one format are adjacent, so that consecutive benchmarks share the store.
constexpr Variant kVariants[] = {
    {"fp16", "fp16", kvcache::DitherMode::per_slot, false, Path::exact_group},
    {"fp16/scalar", "fp16", kvcache::DitherMode::per_slot, false, Path::exact_scalar},
    {"fp16/fast-kernel", "fp16", kvcache::DitherMode::per_slot, false, Path::fast},
    {"rtn-int8/meter-off", "rtn-int8", kvcache::DitherMode::per_slot, false, Path::fast},
    {"rtn-int8", "rtn-int8", kvcache::DitherMode::per_slot, true, Path::fast},
    {"q8_0/meter-off", "q8_0", kvcache::DitherMode::per_slot, false, Path::fast},
    {"q8_0", "q8_0", kvcache::DitherMode::per_slot, true, Path::fast},
    {"dither-int8/per-slot/meter-off", kvcache::kDitherInt8, kvcache::DitherMode::per_slot, false, Path::fast},
    {"dither-int8/per-slot", kvcache::kDitherInt8, kvcache::DitherMode::per_slot, true, Path::fast},
    {"dither-int8/shared/meter-off", kvcache::kDitherInt8, kvcache::DitherMode::shared_page, false, Path::fast},
    {"dither-int8/shared", kvcache::kDitherInt8, kvcache::DitherMode::shared_page, true, Path::fast},
    // The Tier-A formats whose fast paths came last, against fp16 through the kernel with its meter
    // (what `--kv fp16` runs): only in the last pairs of paired_args.
    {"fp16/meter", "fp16", kvcache::DitherMode::per_slot, true, Path::fast},
    {"kivi-2bit", "kivi-2bit", kvcache::DitherMode::per_slot, true, Path::fast},
    {"kvquant-4", "kvquant-4", kvcache::DitherMode::per_slot, true, Path::fast},
    {"rot-4bit", "rot-4bit", kvcache::DitherMode::per_slot, true, Path::fast},
    // The dithered formats below 8 bits (packed codes, unpacked a page at a time), shared-page
    // dither as `generate` runs a prompt: only in the last pairs of paired_args.
    {"dither-int6/shared", "dither-int6", kvcache::DitherMode::shared_page, true, Path::fast},
    {"dither-int5/shared", "dither-int5", kvcache::DitherMode::shared_page, true, Path::fast},
    {"dither-int4/shared", "dither-int4", kvcache::DitherMode::shared_page, true, Path::fast},
    {"rtn-2bit", "rtn-2bit", kvcache::DitherMode::per_slot, true, Path::fast},
    {"sign-1bit", "sign-1bit", kvcache::DitherMode::per_slot, true, Path::fast},
};
// The variants of attention_args' full grid: the first kGridVariants.
constexpr std::int64_t kGridVariants = 11;

constexpr double kColdL3Multiple = 3.0;

// The L3 size the benchmark library reports (the largest level-3 cache), 32 MiB if it reports none.
double l3_bytes() {
  double l3 = 0.0;
  for (const auto& c : benchmark::CPUInfo::Get().caches)
    if (c.level == 3) l3 = std::max(l3, static_cast<double>(c.size));
  return l3 > 0.0 ? l3 : 32.0 * (1 << 20);
}

// (layer, KV head) streams of a cold store: the int8 codes and scales of K and V (2·d + d/8 bytes
// a token, at most the bytes of any int8 format) times `streams` exceed kColdL3Multiple × L3,
// capped so that the store's exact fp16 tier (4·d bytes a token, its largest part) stays within
// 3 GiB.
std::int64_t cold_streams(int d, std::int64_t S) {
  const double per_stream_int8 = (2.0 * d + d / 8.0) * static_cast<double>(S);
  const double cap = 3.0 * (1ull << 30) / (4.0 * d * static_cast<double>(S));
  return std::max<std::int64_t>(
      2, static_cast<std::int64_t>(std::min(std::ceil(kColdL3Multiple * l3_bytes() / per_stream_int8), cap)));
}

// The store of the last benchmark (one at a time keeps the resident set to one store), filled
// with keys that have a few massive RoPE-pair channels, as real models have. `streams` layers of
// one KV head; stream l holds the same token rows as stream 0 rotated by 97·l positions (its own
// bytes: the dither and the pages differ).
// The last two stores are kept (BM_PairedRatio reads two formats at once); at most one is built
// while two are held.
kvcache::KvStore& store_for(const Variant& v, int d, std::int64_t S, std::int64_t streams) {
  static std::unique_ptr<kvcache::KvStore> stores[2];
  static std::string keys[2];
  const std::string want = std::string(v.format) + "/" + std::to_string(static_cast<int>(v.dither)) + "/" +
                           std::to_string(d) + "/" + std::to_string(S) + "/" + std::to_string(streams);
  if (keys[0] == want) return *stores[0];
  if (keys[1] == want) {
    std::swap(stores[0], stores[1]);
    std::swap(keys[0], keys[1]);
    return *stores[0];
  }
  stores[1].reset();  // the older one goes
  keys[1].clear();
  std::swap(stores[0], stores[1]);
  std::swap(keys[0], keys[1]);
  std::unique_ptr<kvcache::KvStore>& store = stores[0];
  kvcache::CacheConfig c;
  c.layers = static_cast<int>(streams);
  c.kv_heads = 1;
  c.head_dim = d;
  c.capacity = S;
  c.k_format = c.v_format = formats::KvFormat::parse(v.format);
  c.dither = v.dither;
  store = std::make_unique<kvcache::KvStore>(c);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> gain(d), k(static_cast<std::size_t>(S) * d), val(k.size());
  for (float& x : gain) x = std::exp(0.8f * g(rng));
  gain[6] = gain[7] = 12.0f;
  for (std::int64_t p = 0; p < S; ++p)
    for (int i = 0; i < d; ++i) k[p * d + i] = gain[i] * g(rng), val[p * d + i] = g(rng);
  for (std::int64_t l = 0; l < streams; ++l)
    for (std::int64_t p = 0; p < S; ++p) {
      const std::int64_t row = (p + 97 * l) % S;
      store->write(static_cast<int>(l), 0, p, &k[row * d], &val[row * d]);
    }
  keys[0] = want;
  return *store;
}

// One decode attention call of variant v on stream `next` of the store, which then moves on to the
// next stream of the rotation.
void decode_call(const Variant& v, kvcache::KvStore& store, std::int64_t streams, std::int64_t& next,
                 const std::vector<float>& q, int group, int d, std::int64_t S, const BoundContext& ctx,
                 std::vector<float>& out) {
  kvcache::KvStore::Reader reader(store, static_cast<int>(next), 0);
  next = next + 1 == streams ? 0 : next + 1;
  if (v.path == Path::exact_group) {
    std::vector<const f16*> keys(S), values(S);
    for (std::int64_t t = 0; t < S; ++t) keys[t] = reader.exact_key_row(t), values[t] = reader.exact_value_row(t);
    exact_attention_group(q.data(), group, keys.data(), values.data(), S, d, out.data());
  } else if (v.path == Path::exact_scalar) {
    for (int h = 0; h < group; ++h)
      exact_attention(
          &q[h * d], [&](std::int64_t t) { return reader.exact_key_row(t); },
          [&](std::int64_t t) { return reader.exact_value_row(t); }, S, d, &out[h * d]);
  } else {
    static kernel::Workspace work;  // reused, as the cache's per-thread workspace is
    std::vector<HeadPartial> partials(group);
    kernel::attend_range(work, reader, q.data(), group, d, 0, S, ctx, partials, v.meter);
    for (int h = 0; h < group; ++h) finish(partials[h], d, &out[h * d]);
  }
  benchmark::DoNotOptimize(out.data());
  benchmark::ClobberMemory();
}

// Args: variant, S, head dim, GQA group, cold (0: one stream, cache-resident; 1: a rotation of
// cold_streams(d, S) streams).
void BM_DecodeAttention(benchmark::State& state) {
  const Variant& v = kVariants[state.range(0)];
  const std::int64_t S = state.range(1);
  const int d = static_cast<int>(state.range(2)), group = static_cast<int>(state.range(3));
  const std::int64_t streams = state.range(4) ? cold_streams(d, S) : 1;
  kvcache::KvStore& store = store_for(v, d, S, streams);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(group) * d), out(q.size());
  for (float& x : q) x = g(rng);
  // δ_loc of SmolLM2-135M (30 layers, 9 query heads) at the default budget.
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), S, cert::delta_loc(1e-2, 30, 9, 256)};
  // The rotation goes on across runs and repetitions: a run starts where the last one stopped.
  static std::int64_t next = 0;
  next %= streams;
  for (auto _ : state) decode_call(v, store, streams, next, q, group, d, S, ctx, out);
  const double per_token = store.bytes_per_token_head(formats::KvSide::key) + store.bytes_per_token_head(formats::KvSide::value);
  state.counters["GB/s"] =
      benchmark::Counter(per_token * static_cast<double>(S) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["B/tok/head"] = per_token;
  state.counters["capacity_x"] = 4.0 * d / per_token;
  state.counters["streams"] = static_cast<double>(streams);
  // The bytes one rotation reads, in multiples of the L3 size.
  state.counters["rotation_x_L3"] = per_token * static_cast<double>(S) * static_cast<double>(streams) / l3_bytes();
  state.SetLabel(v.name);
}

void attention_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"variant", "S", "d", "group", "cold"});
  for (std::int64_t S : {4096, 32768})
    for (std::int64_t d : {64, 128})
      for (std::int64_t v = 0; v < kGridVariants; ++v)
        for (std::int64_t group : {3, 7}) b->Args({v, S, d, group, 0});
  // Cold at S = 32768, the target size (each cold store writes about 3·L3 of int8), for
  // every variant but the scalar oracle and the per-slot dither (the same bytes as shared).
  for (std::int64_t d : {64, 128})
    for (std::int64_t v = 0; v < kGridVariants; ++v)
      if (kVariants[v].path != Path::exact_scalar &&
          !(kVariants[v].format == std::string_view(kvcache::kDitherInt8) && kVariants[v].dither == kvcache::DitherMode::per_slot))
        for (std::int64_t group : {3, 7}) b->Args({v, 32768, d, group, 1});
}
BENCHMARK(BM_DecodeAttention)->Apply(attention_args)->Unit(benchmark::kMicrosecond);

// The two targets as paired ratios: each iteration times one call of variant b and one of
// variant a (thread CPU time each, the order alternating), on the same query and residency, and the
// counters are the median and quartiles of the per-pair ratios b ÷ a. This guest's slowdowns come
// and go over seconds and hit both calls of a pair alike, so the paired ratio resolves far smaller
// differences than the ratio of two medians taken minutes apart. Args: a, b (variants), S, head
// dim, GQA group, cold.
double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void BM_PairedRatio(benchmark::State& state) {
  const Variant& a = kVariants[state.range(0)];
  const Variant& b = kVariants[state.range(1)];
  const std::int64_t S = state.range(2);
  const int d = static_cast<int>(state.range(3)), group = static_cast<int>(state.range(4));
  const std::int64_t streams = state.range(5) ? cold_streams(d, S) : 1;
  kvcache::KvStore& store_a = store_for(a, d, S, streams);
  kvcache::KvStore& store_b = store_for(b, d, S, streams);  // store_a stays: two are kept
  std::mt19937_64 rng(2);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(group) * d), out(q.size());
  for (float& x : q) x = g(rng);
  const BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), S, cert::delta_loc(1e-2, 30, 9, 256)};
  std::int64_t next_a = 0, next_b = streams / 2;  // in cold mode the two read different streams
  std::vector<double> ratios, time_a, time_b;
  for (auto _ : state) {
    double ta = 0.0, tb = 0.0;
    const auto time = [&](const Variant& v, kvcache::KvStore& st, std::int64_t& next) {
      const double t0 = thread_seconds();
      decode_call(v, st, streams, next, q, group, d, S, ctx, out);
      return thread_seconds() - t0;
    };
    if (ratios.size() % 2 == 0) {
      ta = time(a, store_a, next_a);
      tb = time(b, store_b, next_b);
    } else {
      tb = time(b, store_b, next_b);
      ta = time(a, store_a, next_a);
    }
    ratios.push_back(tb / ta);
    time_a.push_back(ta);
    time_b.push_back(tb);
  }
  const auto quantile = [](std::vector<double> x, double p) {
    std::sort(x.begin(), x.end());
    return x.empty() ? 0.0 : x[static_cast<std::size_t>(p * static_cast<double>(x.size() - 1) + 0.5)];
  };
  state.counters["ratio"] = quantile(ratios, 0.5);
  state.counters["ratio_q1"] = quantile(ratios, 0.25);
  state.counters["ratio_q3"] = quantile(ratios, 0.75);
  state.counters["a_us"] = 1e6 * quantile(time_a, 0.5);
  state.counters["b_us"] = 1e6 * quantile(time_b, 0.5);
  state.counters["a_min_us"] = 1e6 * quantile(time_a, 0.0);  // the fastest calls: the least disturbed
  state.counters["b_min_us"] = 1e6 * quantile(time_b, 0.0);
  state.counters["pairs"] = static_cast<double>(ratios.size());
  state.SetLabel(std::string(b.name) + " / " + a.name);
}

void paired_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"a", "b", "S", "d", "group", "cold"});
  const auto index = [](std::string_view name) {
    for (std::size_t v = 0; v < std::size(kVariants); ++v)
      if (kVariants[v].name == name) return static_cast<std::int64_t>(v);
    throw std::logic_error("no variant " + std::string(name));
  };
  // dither-int8/shared against fp16, the shared dither's meter on against off, and meter-off
  // against itself: the pairing's own bias on the machine at hand (an A/A control, about 1.00).
  for (const auto& [va, vb] : {std::pair{index("fp16"), index("dither-int8/shared")},
                               std::pair{index("dither-int8/shared/meter-off"), index("dither-int8/shared")},
                               std::pair{index("dither-int8/shared/meter-off"), index("dither-int8/shared/meter-off")}})
    for (std::int64_t cold : {0, 1})
      for (std::int64_t d : {64, 128})
        for (std::int64_t group : {3, 7}) b->Args({va, vb, 32768, d, group, cold});
  // Every Tier-A format that once decoded through its scalar KvScheme::decode against fp16 with
  // the meter, at SmolLM2-135M's shape (d 64, GQA group 3) and the end-to-end table's longest
  // context (4,433 tokens), hot; q8_0 (0.72× fp16 end to end in docs/BENCHMARKS.md) as the yardstick.
  for (const char* name : {"kivi-2bit", "kvquant-4", "rot-4bit", "rtn-2bit", "sign-1bit", "q8_0"})
    b->Args({index("fp16/meter"), index(name), 4433, 64, 3, 0});
  // The dithered formats below 8 bits against dither-int8 at the same shape (target ≥ 0.9×).
  for (const char* name : {"dither-int6/shared", "dither-int5/shared", "dither-int4/shared"})
    b->Args({index("dither-int8/shared"), index(name), 4433, 64, 3, 0});
}
BENCHMARK(BM_PairedRatio)->Apply(paired_args)->Unit(benchmark::kMicrosecond)->MinTime(3.0);

// Measured bytes per token per KV head (K + V, from the KvStore allocations, the outlier mask
// amortized over S = 32768) and the capacity at equal memory relative to fp16, for dither-int8
// with m outlier pairs (m = 0: no bypass). Args: head dim, m. Times nothing.
void BM_KvBytes(benchmark::State& state) {
  kvcache::CacheConfig c;
  c.layers = c.kv_heads = 1;
  c.head_dim = static_cast<int>(state.range(0));
  c.capacity = 32768;
  c.k_format = c.v_format = formats::KvFormat::dither();
  c.outlier_pairs = static_cast<int>(state.range(1));
  const kvcache::KvStore store(c);
  for (auto _ : state) benchmark::DoNotOptimize(store.compressed_bytes());
  const double per_token = store.bytes_per_token_head(formats::KvSide::key) + store.bytes_per_token_head(formats::KvSide::value);
  state.counters["B/tok/head"] = per_token;
  state.counters["K_B/tok/head"] = store.bytes_per_token_head(formats::KvSide::key);
  state.counters["V_B/tok/head"] = store.bytes_per_token_head(formats::KvSide::value);
  state.counters["capacity_x"] = 4.0 * c.head_dim / per_token;
}
BENCHMARK(BM_KvBytes)->ArgNames({"d", "m"})->Args({64, 0})->Args({64, 4})->Args({128, 0})->Args({128, 4});

// A sequential read of `bytes` (64-bit integer sums, which the compiler vectorizes): the read
// bandwidth the attention kernels are held against, from cache-resident to DRAM-sized sets (1 GiB
// is 4× the L3 of the machines of docs/BENCHMARKS.md).
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
BENCHMARK(BM_StreamRead)->ArgName("bytes")->Arg(4 << 20)->Arg(16 << 20)->Arg(256 << 20)->Arg(1 << 30)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace witcert::attention
