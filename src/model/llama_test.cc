// The engine against a plain scalar forward pass written from the equations (llama2.c style),
// on a tiny random model that the test writes as a GGUF file; and the real model's sanity.
#include "model/llama.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "base/alloc_counter.h"
#include "base/fp16.h"
#include "base/test_scratch.h"
#include "formats/ggml/ggml_types.h"
#include "model/gguf.h"
#include "model/real_model_fixture.h"
#include "model/tokenizer.h"

namespace witcert::model {
namespace {

struct Tiny {
  int layers = 2, d = 64, heads = 4, kv_heads = 2, ff = 96, vocab = 40, ctx = 64;
  float theta = 10000.0f, eps = 1e-5f;
  // Metadata written in place of the value above under the same key, or added (bad-file tests).
  std::map<std::string, GgufValue> meta;
};

// Random weights of several storage types, so the test covers the dequantizing matmul paths.
struct TinyWeights {
  std::vector<float> embd, out_norm;
  struct Layer {
    std::vector<float> attn_norm, ffn_norm, wq, wk, wv, wo, gate, up, down;
  };
  std::vector<Layer> layers;
};

std::vector<std::uint8_t> quantized(formats::GgmlType t, const std::vector<float>& w, std::int64_t cols,
                                    std::vector<float>& as_stored) {
  const std::int64_t rows = static_cast<std::int64_t>(w.size()) / cols;
  const std::size_t rb = formats::ggml_row_bytes(t, cols);
  std::vector<std::uint8_t> bytes(rb * rows);
  as_stored.resize(w.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    formats::quantize_row(t, &w[r * cols], &bytes[r * rb], cols);
    formats::dequantize_row(t, &bytes[r * rb], &as_stored[r * cols], cols);
  }
  return bytes;
}

std::string write_tiny_model(const Tiny& c, TinyWeights& tw, const std::string& path) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> n(0.0f, 1.0f);
  auto randn = [&](std::size_t count, float scale) {
    std::vector<float> v(count);
    for (float& x : v) x = scale * n(rng);
    return v;
  };
  const int hd = c.d / c.heads;
  GgufWriter w;
  std::map<std::string, GgufValue> meta = {
      {"general.architecture", {GgufType::STRING, std::string("llama")}},
      {"llama.block_count", {GgufType::UINT32, std::uint64_t(c.layers)}},
      {"llama.embedding_length", {GgufType::UINT32, std::uint64_t(c.d)}},
      {"llama.attention.head_count", {GgufType::UINT32, std::uint64_t(c.heads)}},
      {"llama.attention.head_count_kv", {GgufType::UINT32, std::uint64_t(c.kv_heads)}},
      {"llama.feed_forward_length", {GgufType::UINT32, std::uint64_t(c.ff)}},
      {"llama.context_length", {GgufType::UINT32, std::uint64_t(c.ctx)}},
      {"llama.rope.freq_base", {GgufType::FLOAT32, double{c.theta}}},
      {"llama.attention.layer_norm_rms_epsilon", {GgufType::FLOAT32, double{c.eps}}},
  };
  for (const auto& [key, value] : c.meta) meta.insert_or_assign(key, value);
  for (const auto& [key, value] : meta) w.add(key, value);
  auto add = [&](const std::string& name, formats::GgmlType t, std::int64_t cols, std::int64_t rows, float scale,
                 std::vector<float>& stored) {
    const std::vector<float> raw = randn(cols * rows, scale);
    w.add_tensor(name, {cols, rows}, t, quantized(t, raw, cols, stored));
  };
  add("token_embd.weight", formats::GgmlType::Q8_0, c.d, c.vocab, 1.0f, tw.embd);
  tw.out_norm = randn(c.d, 0.1f);
  for (float& x : tw.out_norm) x += 1.0f;
  w.add_f32_tensor("output_norm.weight", {c.d}, tw.out_norm);
  tw.layers.resize(c.layers);
  for (int l = 0; l < c.layers; ++l) {
    auto& L = tw.layers[l];
    const std::string p = "blk." + std::to_string(l) + ".";
    L.attn_norm = randn(c.d, 0.1f);
    L.ffn_norm = randn(c.d, 0.1f);
    for (float& x : L.attn_norm) x += 1.0f;
    for (float& x : L.ffn_norm) x += 1.0f;
    w.add_f32_tensor(p + "attn_norm.weight", {c.d}, L.attn_norm);
    w.add_f32_tensor(p + "ffn_norm.weight", {c.d}, L.ffn_norm);
    const float s = 1.0f / std::sqrt(static_cast<float>(c.d));
    add(p + "attn_q.weight", formats::GgmlType::Q4_1, c.d, c.heads * hd, s, L.wq);
    add(p + "attn_k.weight", formats::GgmlType::Q8_0, c.d, c.kv_heads * hd, s, L.wk);
    add(p + "attn_v.weight", formats::GgmlType::F16, c.d, c.kv_heads * hd, s, L.wv);
    add(p + "attn_output.weight", formats::GgmlType::Q4_0, c.heads * hd, c.d, s, L.wo);
    add(p + "ffn_gate.weight", formats::GgmlType::Q5_1, c.d, c.ff, s, L.gate);
    add(p + "ffn_up.weight", formats::GgmlType::Q5_0, c.d, c.ff, s, L.up);
    add(p + "ffn_down.weight", formats::GgmlType::F32, c.ff, c.d, 1.0f / std::sqrt(static_cast<float>(c.ff)), L.down);
  }
  w.write(path);
  return path;
}

// The reference: every equation written out in double, keys and values rounded to fp16 as the
// exact tier stores them.
class Reference {
 public:
  Reference(const Tiny& c, const TinyWeights& w) : c_(c), w_(w), hd_(c.d / c.heads) {
    k_.assign(c.layers, {});
    v_.assign(c.layers, {});
  }

  std::vector<double> step(int token, int pos) {
    std::vector<double> x(w_.embd.begin() + token * c_.d, w_.embd.begin() + (token + 1) * c_.d);
    for (int l = 0; l < c_.layers; ++l) {
      const auto& L = w_.layers[l];
      const std::vector<double> xn = norm(x, L.attn_norm);
      std::vector<double> q = mat(L.wq, xn, c_.heads * hd_), k = mat(L.wk, xn, c_.kv_heads * hd_),
                          v = mat(L.wv, xn, c_.kv_heads * hd_);
      rope(q, pos);
      rope(k, pos);
      for (double& e : k) e = fp16_to_double(fp16_from_double(e));
      for (double& e : v) e = fp16_to_double(fp16_from_double(e));
      k_[l].push_back(k);
      v_[l].push_back(v);
      std::vector<double> att(c_.heads * hd_, 0.0);
      const int group = c_.heads / c_.kv_heads;
      for (int h = 0; h < c_.heads; ++h) {
        const int kvh = h / group;
        std::vector<double> s(pos + 1);
        double mx = -1e300;
        for (int t = 0; t <= pos; ++t) {
          double dot = 0.0;
          for (int i = 0; i < hd_; ++i) dot += q[h * hd_ + i] * k_[l][t][kvh * hd_ + i];
          s[t] = dot / std::sqrt(static_cast<double>(hd_));
          mx = std::max(mx, s[t]);
        }
        double z = 0.0;
        for (double& e : s) z += e = std::exp(e - mx);
        for (int t = 0; t <= pos; ++t)
          for (int i = 0; i < hd_; ++i) att[h * hd_ + i] += s[t] / z * v_[l][t][kvh * hd_ + i];
      }
      const std::vector<double> o = mat(L.wo, att, c_.d);
      for (int i = 0; i < c_.d; ++i) x[i] += o[i];
      const std::vector<double> xf = norm(x, L.ffn_norm);
      std::vector<double> g = mat(L.gate, xf, c_.ff);
      const std::vector<double> u = mat(L.up, xf, c_.ff);
      for (int i = 0; i < c_.ff; ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const std::vector<double> dn = mat(L.down, g, c_.d);
      for (int i = 0; i < c_.d; ++i) x[i] += dn[i];
    }
    return mat(w_.embd, norm(x, w_.out_norm), c_.vocab);  // tied output head
  }

 private:
  std::vector<double> norm(const std::vector<double>& x, const std::vector<float>& w) const {
    double ss = 0.0;
    for (double e : x) ss += e * e;
    const double r = 1.0 / std::sqrt(ss / x.size() + c_.eps);
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] * r * w[i];
    return y;
  }
  static std::vector<double> mat(const std::vector<float>& w, const std::vector<double>& x, int rows) {
    std::vector<double> y(rows, 0.0);
    for (int r = 0; r < rows; ++r)
      for (std::size_t i = 0; i < x.size(); ++i) y[r] += static_cast<double>(w[r * x.size() + i]) * x[i];
    return y;
  }
  // GGML "normal" RoPE: adjacent pairs (2j, 2j+1), θ_j = base^{−2j/d}.
  void rope(std::vector<double>& x, int pos) const {
    for (std::size_t h = 0; h < x.size() / hd_; ++h)
      for (int j = 0; j < hd_ / 2; ++j) {
        const double th = pos * std::pow(static_cast<double>(c_.theta), -2.0 * j / hd_);
        double& a = x[h * hd_ + 2 * j];
        double& b = x[h * hd_ + 2 * j + 1];
        const double a0 = a, b0 = b;
        a = a0 * std::cos(th) - b0 * std::sin(th);
        b = a0 * std::sin(th) + b0 * std::cos(th);
      }
  }

  Tiny c_;
  const TinyWeights& w_;
  int hd_;
  std::vector<std::vector<std::vector<double>>> k_, v_;
};

void expect_close(const float* got, const std::vector<double>& want, const std::string& what) {
  double scale = 0.0, worst = 0.0;
  for (double e : want) scale = std::max(scale, std::fabs(e));
  for (std::size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  EXPECT_LE(worst, 1e-4 * scale) << what << ": max |Δ| " << worst << " vs logit scale " << scale;
}

class TinyModel : public ::testing::Test {
 protected:
  void SetUp() override {
    // Per process: ctest runs tests in parallel, and rewriting a file another test has mapped
    // would crash it.
    path_ = testing_util::scratch_path("tiny_llama.gguf");
    write_tiny_model(c_, w_, path_);
    file_ = std::make_unique<GgufFile>(GgufFile::open(path_));
    model_ = std::make_unique<LlamaModel>(*file_);
  }
  Tiny c_;
  TinyWeights w_;
  std::string path_;
  std::unique_ptr<GgufFile> file_;
  std::unique_ptr<LlamaModel> model_;
};

TEST_F(TinyModel, ConfigFromMetadata) {
  const LlamaConfig& cfg = model_->config();
  EXPECT_EQ(cfg.layers, 2);
  EXPECT_EQ(cfg.head_dim, 16);
  EXPECT_EQ(cfg.group(), 2);
  EXPECT_EQ(cfg.vocab, 40);
  EXPECT_TRUE(cfg.tied_output);
}

TEST_F(TinyModel, PrefillDecodeAndBothMatchTheScalarReference) {
  const std::vector<std::int32_t> tokens = {3, 17, 5, 39, 0, 22, 8, 8, 11, 30, 2, 7};
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    const int V = c_.vocab;
    // Prefill of all tokens at once, every position's logits.
    {
      attention::ExactKvCache cache(model_->config().kv_geometry(c_.ctx));
      Reference ref(c_, w_);
      std::vector<float> logits(tokens.size() * V);
      model_->forward(tokens, 0, cache, pool, logits, true);
      for (std::size_t i = 0; i < tokens.size(); ++i)
        expect_close(&logits[i * V], ref.step(tokens[i], static_cast<int>(i)), "prefill pos " + std::to_string(i));
    }
    // Decode one token at a time.
    {
      attention::ExactKvCache cache(model_->config().kv_geometry(c_.ctx));
      Reference ref(c_, w_);
      std::vector<float> logits(V);
      for (std::size_t i = 0; i < tokens.size(); ++i) {
        model_->forward({&tokens[i], 1}, static_cast<std::int64_t>(i), cache, pool, logits);
        expect_close(logits.data(), ref.step(tokens[i], static_cast<int>(i)), "decode pos " + std::to_string(i));
      }
    }
    // A prefill of 7 tokens followed by decode.
    {
      attention::ExactKvCache cache(model_->config().kv_geometry(c_.ctx));
      Reference ref(c_, w_);
      std::vector<float> logits(V);
      model_->forward(std::span<const std::int32_t>(tokens).first(7), 0, cache, pool, logits);
      std::vector<double> want;
      for (int i = 0; i < 7; ++i) want = ref.step(tokens[i], i);
      expect_close(logits.data(), want, "prefill of 7");
      for (std::size_t i = 7; i < tokens.size(); ++i) {
        model_->forward({&tokens[i], 1}, static_cast<std::int64_t>(i), cache, pool, logits);
        expect_close(logits.data(), ref.step(tokens[i], static_cast<int>(i)), "decode after prefill " + std::to_string(i));
      }
    }
  }
}

TEST_F(TinyModel, RejectsBadInput) {
  ThreadPool pool(1);
  attention::ExactKvCache cache(model_->config().kv_geometry(8));
  std::vector<float> logits(c_.vocab);
  const std::vector<std::int32_t> bad_id = {1, 40};
  EXPECT_THROW(model_->forward(bad_id, 0, cache, pool, logits), std::out_of_range);
  const std::vector<std::int32_t> nine(9, 1);
  EXPECT_THROW(model_->forward(nine, 0, cache, pool, logits), std::out_of_range);  // beyond the cache
}

TEST_F(TinyModel, QkvHookSeesPostRopeKeysAsCached) {
  ThreadPool pool(1);
  attention::ExactKvCache cache(model_->config().kv_geometry(c_.ctx));
  int calls = 0;
  LlamaModel& m = *model_;
  m.qkv_hook = [&](const QkvCapture& cap) {
    ++calls;
    for (int i = 0; i < 16; ++i)
      EXPECT_EQ(fp16_from_float(cap.k[16 + i]), cache.key(cap.layer, 1, cap.pos)[i]);
  };
  std::vector<float> logits(c_.vocab);
  const std::vector<std::int32_t> tokens = {1, 2, 3};
  m.forward(tokens, 0, cache, pool, logits);
  EXPECT_EQ(calls, 2 * 3);
}

// An architecture WitCert does not run is refused naming it and the supported ones; a supported
// one's own metadata that is missing or impossible is refused naming its key.
TEST(TinyModelMetadata, ArchitecturesRefuseWhatTheyCannotRun) {
  const auto str = [](const std::string& v) { return GgufValue{GgufType::STRING, v}; };
  const auto u32 = [](std::uint64_t v) { return GgufValue{GgufType::UINT32, v}; };
  const auto f32 = [](double v) { return GgufValue{GgufType::FLOAT32, v}; };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::map<std::string, GgufValue>, std::vector<std::string>>> bad = {
      {{{"general.architecture", str("mamba")}}, {"'mamba'", "llama, qwen2, qwen3, gemma3"}},
      {{{"general.architecture", str("qwen2")}}, {"qwen2.block_count"}},  // the file's keys are llama.*
      {{{"llama.attention.key_length", u32(0)}}, {"llama.attention.key_length"}},
      {{{"llama.attention.key_length", u32(16)}, {"llama.attention.value_length", u32(32)}}, {"value_length"}},
      {{{"llama.attention.key_length", u32(15)}}, {"even"}},
      {{{"llama.final_logit_softcapping", f32(nan)}}, {"llama.final_logit_softcapping"}},
      {{{"llama.final_logit_softcapping", f32(0.0)}}, {"llama.final_logit_softcapping"}},
      {{{"llama.rope.scaling.type", str("yarn")}}, {"'yarn'"}},
  };
  for (const auto& [meta, words] : bad) {
    Tiny c;
    c.meta = meta;
    TinyWeights w;
    const GgufFile file = GgufFile::open(write_tiny_model(c, w, testing_util::scratch_path("bad_arch.gguf")));
    try {
      LlamaModel model(file);
      ADD_FAILURE() << words[0] << ": accepted";
    } catch (const std::runtime_error& e) {
      for (const std::string& word : words) EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
    }
  }
  // key_length apart from the width: 4 heads of 16 over a width of 64 is the default; 24 loads too.
  Tiny c;
  c.meta = {{"llama.attention.key_length", u32(24)}};
  TinyWeights w;
  const GgufFile file = GgufFile::open(write_tiny_model(c, w, testing_util::scratch_path("key_length.gguf")));
  EXPECT_THROW(LlamaModel{file}, std::runtime_error);  // its q projection has 64 rows, not 4 × 24
}

// Metadata that would make every logit silently wrong is rejected at load, naming its key; the
// ends of the accepted ranges load.
TEST(TinyModelMetadata, RejectsValuesOutOfRangeNamingTheKey) {
  const auto f32 = [](double v) { return GgufValue{GgufType::FLOAT32, v}; };
  const auto f64 = [](double v) { return GgufValue{GgufType::FLOAT64, v}; };
  const auto u32 = [](std::uint64_t v) { return GgufValue{GgufType::UINT32, v}; };
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  const std::string eps = "llama.attention.layer_norm_rms_epsilon", theta = "llama.rope.freq_base";
  const std::vector<std::pair<std::string, GgufValue>> bad = {
      {eps, f32(nan)}, {eps, f32(inf)}, {eps, f32(-inf)}, {eps, f32(-1e-5)}, {eps, f32(0.0)}, {eps, f32(0.5)},
      {eps, f64(1e-40)}, {eps, f64(1e300)},
      {theta, f32(nan)}, {theta, f32(inf)}, {theta, f32(0.0)}, {theta, f32(-10000.0)}, {theta, f32(0.5)},
      {theta, f32(1e10)}, {theta, f64(1e300)},
      {"llama.context_length", u32(0)}, {"llama.block_count", u32(0)}, {"llama.block_count", u32(0x80000000u)},
      {"llama.embedding_length", u32(0)}, {"llama.feed_forward_length", u32(0)},
      {"llama.attention.head_count", u32(0)}, {"llama.attention.head_count_kv", u32(0)},
      {"llama.attention.head_count", u32(5)},     // does not divide the width 64
      {"llama.attention.head_count_kv", u32(3)},  // does not divide the 4 heads
  };
  for (const auto& [key, value] : bad) {
    Tiny c;
    c.meta = {{key, value}};
    TinyWeights w;
    const std::string path = write_tiny_model(c, w, testing_util::scratch_path("bad_meta.gguf"));
    const GgufFile file = GgufFile::open(path);
    try {
      LlamaModel model(file);
      ADD_FAILURE() << key << " accepted a bad value";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  // Linear RoPE scaling's factor: a NaN, an infinity or zero would put every position at one angle.
  for (double factor : {nan, inf, 0.0, -2.0, 1e6}) {
    Tiny c;
    c.meta = {{"llama.rope.scaling.type", {GgufType::STRING, std::string("linear")}},
              {"llama.rope.scaling.factor", f32(factor)}};
    TinyWeights w;
    const GgufFile file = GgufFile::open(write_tiny_model(c, w, testing_util::scratch_path("bad_scaling.gguf")));
    try {
      LlamaModel model(file);
      ADD_FAILURE() << "rope.scaling.factor " << factor << " accepted";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("llama.rope.scaling.factor"), std::string::npos) << e.what();
    }
  }
  // The ends of the ranges load.
  for (const auto& [key, v] : std::vector<std::pair<std::string, double>>{
           {"llama.attention.layer_norm_rms_epsilon", 0.1}, {"llama.attention.layer_norm_rms_epsilon", 1e-6},
           {"llama.rope.freq_base", 1.0}, {"llama.rope.freq_base", 1e9}, {"llama.rope.freq_base", 5e5}}) {
    Tiny c;
    c.meta = {{key, {GgufType::FLOAT64, v}}};  // 0.1f lies above 0.1
    TinyWeights w;
    const GgufFile file = GgufFile::open(write_tiny_model(c, w, testing_util::scratch_path("good_meta.gguf")));
    EXPECT_NO_THROW(LlamaModel model(file)) << key << " = " << v;
  }
}

// block_count must be the number of blocks whose tensors the file holds: one below would run a
// shallower model silently, one above fail on a tensor it cannot name the cause of.
TEST(TinyModelMetadata, BlockCountMustMatchTheBlocksHeld) {
  for (std::uint64_t declared : {1u, 3u}) {
    Tiny c;  // two blocks of tensors
    c.meta = {{"llama.block_count", {GgufType::UINT32, declared}}};
    TinyWeights w;
    const GgufFile file = GgufFile::open(write_tiny_model(c, w, testing_util::scratch_path("block_count.gguf")));
    try {
      LlamaModel model(file);
      ADD_FAILURE() << "block_count " << declared << " accepted for a file of 2 blocks";
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("llama.block_count is " + std::to_string(declared)), std::string::npos) << what;
      EXPECT_NE(what.find("tensors of 2 blocks"), std::string::npos) << what;
    }
  }
}

using RealLlama = RealModelFixture;

// The model reuses one run state: a decode step of the real model allocates nothing on any thread
// once a step has warmed the state, the pool's workers and the cache's buffers, and what a larger
// pass of another sequence left in the state changes no logit.
TEST_F(RealLlama, DecodeStepAllocatesNothingOnceWarmAndReusedStateKeepsNoTrace) {
  const int V = model_->config().vocab;
  const std::vector<std::int32_t> prompt = tok_->encode("The capital of France is");
  const auto argmax = [](const std::vector<float>& l) {
    return static_cast<std::int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
  };
  // Prompt then steps, each step's logits appended to `all`; the steps past the second counted.
  const auto run = [&](const LlamaModel& m, ThreadPool& pool, std::vector<float>& all, long& allocations) {
    attention::ExactKvCache cache(m.config().kv_geometry(64));
    std::vector<float> logits(V);
    m.forward(prompt, 0, cache, pool, logits);
    std::int64_t pos = static_cast<std::int64_t>(prompt.size());
    all.reserve(all.size() + 6 * static_cast<std::size_t>(V));
    long before = 0;
    for (int step = 0; step < 6; ++step) {
      if (step == 2) before = testing_util::process_allocations();
      const std::int32_t next = argmax(logits);
      m.forward({&next, 1}, pos++, cache, pool, logits);
      all.insert(all.end(), logits.begin(), logits.end());
    }
    allocations = testing_util::process_allocations() - before;
  };
  ThreadPool pool(2);
  {
    // Another sequence's 40-token pass first grows the state past anything the run needs.
    attention::ExactKvCache other(model_->config().kv_geometry(64));
    std::vector<std::int32_t> long_prompt(40);
    for (std::size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = static_cast<std::int32_t>(100 + 7 * i);
    std::vector<float> logits(V);
    model_->forward(long_prompt, 0, other, pool, logits);
  }
  std::vector<float> reused, fresh;
  long allocations = -1, ignored = -1;
  run(*model_, pool, reused, allocations);
  EXPECT_EQ(allocations, 0) << "allocations over 4 decode steps";
  run(LlamaModel(*file_), pool, fresh, ignored);
  ASSERT_EQ(reused.size(), fresh.size());
  EXPECT_EQ(std::memcmp(reused.data(), fresh.data(), reused.size() * sizeof(float)), 0);
}

}  // namespace
}  // namespace witcert::model
