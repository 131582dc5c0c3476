// Filled stores for the host and GPU tests (no test framework: the GPU check builds without one):
// keys with a few massive RoPE-pair channels and a spread of channel gains, values of varied
// norms, as real models have, and the scalar reference's partials over them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention/reference/certified_attention.h"
#include "cert/subgaussian.h"
#include "kvcache/kv_store.h"
#include "kvcache/test_config.h"

namespace witcert::cuda::testing {

struct Formats {
  std::string k, v;
  kvcache::DitherMode dither = kvcache::DitherMode::per_slot;
  std::string name() const {
    const bool mode = k == kvcache::kDitherInt8 && dither != kvcache::DitherMode::per_slot;
    return k + (mode ? std::string("(") + kvcache::dither_mode_name(dither) + ")" : "") + "/" + v;
  }
};

// Every format the CUDA kernel runs, on both sides and against fp16, and dither-int8 keys in each
// dither mode.
inline std::vector<Formats> kernel_formats() {
  std::vector<Formats> f;
  for (const char* name : {"fp16", "dither-int8", "q8_0", "q4_0", "fp8-e4m3"}) {
    f.push_back({name, name});
    if (std::string(name) != "fp16") f.push_back({name, "fp16"}), f.push_back({"fp16", name});
  }
  f.push_back({"dither-int8", "dither-int8", kvcache::DitherMode::shared_page});
  f.push_back({"dither-int8", "q4_0", kvcache::DitherMode::shared_prompt});
  return f;
}

inline kvcache::CacheConfig config(const Formats& f, int layers, int kv_heads, int d, std::int64_t capacity, int page,
                                 std::uint64_t seed) {
  kvcache::CacheConfig c = kvcache::test_config(layers, kv_heads, d, capacity, page, f.k, f.v, seed);
  c.dither = f.dither;
  c.calibration_tokens = 8;
  c.seed = seed * 0x9E3779B97F4A7C15ull + 1;
  c.exact_tier = true;  // the true TV reads it
  c.backing = kvcache::BackingPlace::in_ram();
  return c;
}

// One sequence of n tokens written to every (layer, KV head); the prompt (shared-prompt dither) ends
// inside a page.
inline std::unique_ptr<kvcache::KvStore> filled_store(const kvcache::CacheConfig& c, std::int64_t n, std::uint64_t seed) {
  auto store = std::make_unique<kvcache::KvStore>(c);
  store->set_prompt_length(n / 2 - 1 > 0 ? n / 2 - 1 : 0);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int d = c.head_dim;
  std::vector<float> gain(d);
  for (float& x : gain) x = std::exp(0.8f * g(rng));
  gain[6] = gain[7] = 12.0f;
  std::vector<float> k(d), v(d);
  for (std::int64_t p = 0; p < n; ++p)
    for (int l = 0; l < c.layers; ++l)
      for (int h = 0; h < c.kv_heads; ++h) {
        for (int i = 0; i < d; ++i) {
          k[i] = gain[i] * g(rng);
          v[i] = g(rng) * (1.0f + static_cast<float>(p % 5));
        }
        store->write(l, h, p, k.data(), v.data());
      }
  return store;
}

// Queries of one step: kv_heads·group heads of d values, scaled so that the softmax is neither flat
// nor one-hot.
inline std::vector<float> queries(int heads, int d, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.3f);
  std::vector<float> q(static_cast<std::size_t>(heads) * d);
  for (float& x : q) x = g(rng);
  return q;
}

// δ_loc of a step (the budget of a request over layers × query heads × the decode budget).
inline double step_delta_loc(int layers, int q_heads) {
  return cert::delta_loc(1e-2, layers, q_heads, cert::kDefaultDecodeBudget);
}

// The scalar reference over [0, n_ctx) of (layer, kv_head), one range: the oracle's partials.
inline std::vector<attention::HeadPartial> reference_partials(const kvcache::KvStore& store, int layer, int kv_head,
                                                         const float* q, int group, std::int64_t n_ctx, double delta_loc) {
  const int d = store.config().head_dim;
  kvcache::KvStore::Reader reader(store, layer, kv_head);
  const attention::BoundContext ctx{1.0 / std::sqrt(static_cast<double>(d)), n_ctx, delta_loc};
  std::vector<attention::HeadPartial> partials;
  attention::attend_range_reference(reader, q, group, d, 0, n_ctx, ctx, partials);
  return partials;
}

}  // namespace witcert::cuda::testing
