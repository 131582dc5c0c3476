#include "model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "formats/ggml/ggml_types.h"

namespace witcert::model {
namespace {

// Query positions per attention job in a forward pass (see KvCache::attend_causal).
constexpr std::int64_t kAttnRun = 16;

std::runtime_error model_error(const std::string& what) { return std::runtime_error("model: " + what); }

std::string shape_string(const std::vector<std::int64_t>& ne) {
  std::string s = "{";
  for (std::size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "}";
}

WeightMatrix bind_matrix(const GgufFile& f, const std::string& name, std::int64_t cols, std::int64_t rows) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.ne.size() != 2 || t.ne[0] != cols || t.ne[1] != rows)
    throw model_error("tensor '" + name + "' has shape " + shape_string(t.ne) + ", expected {" +
                      std::to_string(cols) + ", " + std::to_string(rows) + "}");
  const formats::GgmlTypeInfo* info = formats::ggml_type_info(t.type);
  if (!info || !info->dequantizable)
    throw model_error("tensor '" + name + "' has unsupported type " + (info ? info->name : std::string("?")));
  return WeightMatrix{t.type, f.tensor_data(t).data(), rows, cols};
}

std::vector<float> load_vector(const GgufFile& f, const std::string& name, std::int64_t n) {
  const GgufTensorInfo& t = f.tensor(name);
  if (t.elements() != n)
    throw model_error("tensor '" + name + "' has shape " + shape_string(t.ne) + ", expected {" + std::to_string(n) + "}");
  const formats::GgmlTypeInfo* info = formats::ggml_type_info(t.type);
  if (!info || !info->dequantizable)
    throw model_error("tensor '" + name + "' has unsupported type " + (info ? info->name : std::string("?")));
  std::vector<float> v(n);
  formats::dequantize_row(t.type, f.tensor_data(t).data(), v.data(), n);
  return v;
}

// A size the file gives under `key`: at least 1 and within int, else an error naming the key
// (a wrapped or zero size would make the model's shapes wrong without any other error).
int config_size(const std::string& key, std::uint32_t v) {
  if (v < 1 || v > static_cast<std::uint32_t>(std::numeric_limits<int>::max()))
    throw model_error(key + " must lie in [1, " + std::to_string(std::numeric_limits<int>::max()) + "], got " +
                      std::to_string(v));
  return static_cast<int>(v);
}

// A real number the file gives under `key`: finite and in [lo, hi], else an error naming the
// key. NaN, infinities and values no llama model uses would otherwise turn every logit wrong
// without any error.
double config_real(const std::string& key, double v, double lo, double hi) {
  if (!(std::isfinite(v) && v >= lo && v <= hi)) {
    std::ostringstream msg;
    msg << key << " must be finite and lie in [" << lo << ", " << hi << "], got " << v;
    throw model_error(msg.str());
  }
  return v;
}

// out may be x.
void rms_norm(const float* x, const float* w, int d, float eps, float* out) {
  double ss = 0.0;
  for (int i = 0; i < d; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / d + eps));
  for (int i = 0; i < d; ++i) out[i] = x[i] * scale * w[i];
}

void add_bias(float* x, const std::vector<float>& b) {
  for (std::size_t i = 0; i < b.size(); ++i) x[i] += b[i];
}

// gelu(x) with the tanh approximation, as GGML's gelu: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))),
// in float as GGML computes it (a double tanh took 8 % of a Gemma prefill).
float gelu_tanh(float x) {
  const float t = std::tanh(0.7978845608f * x * (1.0f + 0.044715f * x * x));
  return 0.5f * x * (1.0f + t);
}

// The blocks whose tensors the file holds: the distinct N of its "blk.N.*" tensor names.
std::size_t blocks_held(const GgufFile& f) {
  std::set<std::string_view> blocks;
  for (const GgufTensorInfo& t : f.tensors()) {
    const std::string_view name = t.name;
    if (!name.starts_with("blk.")) continue;
    const std::size_t dot = name.find('.', 4);
    if (dot != std::string_view::npos) blocks.insert(name.substr(4, dot - 4));
  }
  return blocks.size();
}

// Grows v to at least n elements; never shrinks it, so a buffer that has held a pass allocates
// nothing for any pass as large.
template <class T>
T* at_least(std::vector<T>& v, std::int64_t n) {
  if (v.size() < static_cast<std::size_t>(n)) v.resize(static_cast<std::size_t>(n));
  return v.data();
}

}  // namespace

// The activations of a pass over n tokens, token-major, and its bookkeeping: sized by the first
// pass and grown only when a pass runs more tokens or rows, so that a decode step allocates
// nothing once warm. Every element a pass reads it has written first.
struct LlamaModel::RunState {
  std::mutex busy;                  // held by the pass using the state
  std::vector<float> x, xb;         // the residual stream and a normed copy (or a block's output): n × d
  std::vector<float> q, att;        // queries and attention outputs: n × heads·head_dim
  std::vector<float> k, v;          // keys and values: n × kv_heads·head_dim
  std::vector<float> gate, up;      // the MLP's hidden activations: n × d_ff
  std::vector<std::int64_t> first;  // row r's tokens are [first[r], first[r + 1])
  // An attention job: a (row, KV head, run) triple, or a row's KV head taking its runs in order,
  // or a whole row, as the row's cache asks (KvCache::attend_concurrency).
  struct Job {
    std::size_t row;
    int head;          // −1: every KV head
    std::int64_t run;  // −1: every run, in order
  };
  std::vector<Job> jobs;
};

LlamaModel::~LlamaModel() = default;

LlamaModel::LlamaModel(const GgufFile& f) : state_(std::make_unique<RunState>()) {
  cfg_.arch = f.get_string("general.architecture");
  traits_ = &architecture(cfg_.arch);
  const Architecture& arch = *traits_;
  const std::string a = cfg_.arch + ".";
  const auto size = [&](const std::string& key) { return config_size(key, f.get_u32(key)); };
  cfg_.layers = size(a + "block_count");
  // A count below the blocks held would run a shallower model without any error; one above fails
  // on a missing tensor that does not say why.
  if (const std::size_t held = blocks_held(f); held != static_cast<std::size_t>(cfg_.layers))
    throw model_error(a + "block_count is " + std::to_string(cfg_.layers) + " but the file holds the tensors of " +
                      std::to_string(held) + " blocks (blk.N.*)");
  cfg_.d_model = size(a + "embedding_length");
  cfg_.heads = size(a + "attention.head_count");
  cfg_.kv_heads = f.find(a + "attention.head_count_kv") ? size(a + "attention.head_count_kv") : cfg_.heads;
  cfg_.d_ff = size(a + "feed_forward_length");
  cfg_.context = size(a + "context_length");
  // RoPE bases in use run from 1e4 to about 1e8 and ε from 1e-6 to 1e-5; ε's lower bound keeps it a
  // positive normal float, as the model stores it.
  const std::string theta_key = a + "rope.freq_base", eps_key = a + "attention.layer_norm_rms_epsilon";
  cfg_.rope_theta = static_cast<float>(config_real(theta_key, f.get_f64_or(theta_key, 10000.0), 1.0, 1e9));
  cfg_.rms_eps = static_cast<float>(config_real(eps_key, f.get_f64_or(eps_key, 1e-5), 1e-30, 0.1));
  if (cfg_.heads % cfg_.kv_heads != 0)
    throw model_error(a + "attention.head_count " + std::to_string(cfg_.heads) + " and " + a +
                      "attention.head_count_kv " + std::to_string(cfg_.kv_heads) +
                      " are inconsistent: the KV head count must divide the head count");
  if (f.find(a + "attention.key_length")) {
    cfg_.head_dim = size(a + "attention.key_length");
    const int v_len = f.find(a + "attention.value_length") ? size(a + "attention.value_length") : cfg_.head_dim;
    if (v_len != cfg_.head_dim)
      throw model_error(a + "attention.value_length " + std::to_string(v_len) + " differs from key_length " +
                        std::to_string(cfg_.head_dim) + " (not supported)");
  } else {
    if (cfg_.d_model % cfg_.heads != 0)
      throw model_error(a + "embedding_length " + std::to_string(cfg_.d_model) + " and " + a +
                        "attention.head_count " + std::to_string(cfg_.heads) +
                        " are inconsistent: the head count must divide the width");
    cfg_.head_dim = cfg_.d_model / cfg_.heads;
  }
  if (cfg_.head_dim % 2 != 0) throw model_error("head dimension must be even for RoPE");
  const std::uint32_t rope_dims = f.get_u32_or(a + "rope.dimension_count", cfg_.head_dim);
  if (static_cast<int>(rope_dims) != cfg_.head_dim)
    throw model_error("partial rotary embeddings (" + std::to_string(rope_dims) + " of " +
                      std::to_string(cfg_.head_dim) + " dimensions) are not supported");
  const std::string scaling = f.get_string_or(a + "rope.scaling.type", "none");
  if (scaling == "linear") {
    const std::string factor_key = a + "rope.scaling.factor";
    cfg_.rope_freq_scale = static_cast<float>(1.0 / config_real(factor_key, f.get_f64(factor_key), 1.0 / 1024, 1024.0));
  } else if (scaling != "none" && scaling != "llama3") {  // llama3: the factors are rope_freqs.weight
    throw model_error("unsupported RoPE scaling '" + scaling + "' (supported: none, linear, llama3)");
  }
  cfg_.rope_layout = arch.rope_layout;
  const std::string cap_key = a + "final_logit_softcapping";
  if (f.find(cap_key)) cfg_.logit_softcap = static_cast<float>(config_real(cap_key, f.get_f64(cap_key), 1e-3, 1e6));
  int swa_period = arch.swa_period;
  if (swa_period > 0) {
    cfg_.sliding_window = size(a + "attention.sliding_window");
    // The file may name its own period: every period-th layer is global.
    if (f.find(a + "attention.sliding_window_pattern")) swa_period = size(a + "attention.sliding_window_pattern");
  }

  const GgufTensorInfo& embd = f.tensor("token_embd.weight");
  if (embd.ne.size() != 2) throw model_error("token_embd.weight must be a matrix");
  cfg_.vocab = static_cast<int>(embd.ne[1]);
  tok_embd_ = bind_matrix(f, "token_embd.weight", cfg_.d_model, cfg_.vocab);
  output_norm_ = load_vector(f, "output_norm.weight", cfg_.d_model);
  cfg_.tied_output = f.find_tensor("output.weight") == nullptr;
  output_ = cfg_.tied_output ? tok_embd_ : bind_matrix(f, "output.weight", cfg_.d_model, cfg_.vocab);

  // RoPE frequencies θ_j = base^{−2j/d}, divided by the file's per-frequency factors where it has
  // them (Llama 3.1 / 3.2); sliding-window layers have their own base.
  const int pairs = cfg_.head_dim / 2;
  std::vector<float> factors(pairs, 1.0f);
  if (f.find_tensor("rope_freqs.weight")) {
    factors = load_vector(f, "rope_freqs.weight", pairs);
    for (int j = 0; j < pairs; ++j)
      if (!(std::isfinite(factors[j]) && factors[j] > 0.0f))
        throw model_error("rope_freqs.weight[" + std::to_string(j) + "] must be finite and positive");
  }
  const auto frequencies = [&](double base) {
    std::vector<float> inv(pairs);
    for (int j = 0; j < pairs; ++j)
      inv[j] = static_cast<float>(std::pow(base, -2.0 * j / cfg_.head_dim) / factors[j]);
    return inv;
  };
  inv_freq_ = frequencies(cfg_.rope_theta);
  swa_inv_freq_ = frequencies(arch.swa_rope_theta);

  const std::int64_t d = cfg_.d_model, q_dim = cfg_.heads * cfg_.head_dim, kv_dim = cfg_.kv_heads * cfg_.head_dim;
  for (int l = 0; l < cfg_.layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer L;
    L.attn_norm = load_vector(f, p + "attn_norm.weight", d);
    L.ffn_norm = load_vector(f, p + "ffn_norm.weight", d);
    L.wq = bind_matrix(f, p + "attn_q.weight", d, q_dim);
    L.wk = bind_matrix(f, p + "attn_k.weight", d, kv_dim);
    L.wv = bind_matrix(f, p + "attn_v.weight", d, kv_dim);
    L.wo = bind_matrix(f, p + "attn_output.weight", q_dim, d);
    L.w_gate = bind_matrix(f, p + "ffn_gate.weight", d, cfg_.d_ff);
    L.w_up = bind_matrix(f, p + "ffn_up.weight", d, cfg_.d_ff);
    L.w_down = bind_matrix(f, p + "ffn_down.weight", cfg_.d_ff, d);
    if (arch.qkv_bias) {
      L.bq = load_vector(f, p + "attn_q.bias", q_dim);
      L.bk = load_vector(f, p + "attn_k.bias", kv_dim);
      L.bv = load_vector(f, p + "attn_v.bias", kv_dim);
    }
    if (arch.qk_norm) {
      L.q_norm = load_vector(f, p + "attn_q_norm.weight", cfg_.head_dim);
      L.k_norm = load_vector(f, p + "attn_k_norm.weight", cfg_.head_dim);
    }
    if (arch.post_norms) {
      L.post_attn_norm = load_vector(f, p + "post_attention_norm.weight", d);
      L.post_ffw_norm = load_vector(f, p + "post_ffw_norm.weight", d);
    }
    layers_.push_back(std::move(L));
  }
  // Pointers into the frequency tables once the layers no longer move.
  cfg_.windows.assign(static_cast<std::size_t>(cfg_.layers), 0);
  for (int l = 0; l < cfg_.layers; ++l) {
    const bool sliding = swa_period > 0 && l % swa_period != swa_period - 1;
    layers_[l].inv_freq = sliding ? swa_inv_freq_.data() : inv_freq_.data();
    if (sliding) cfg_.windows[static_cast<std::size_t>(l)] = cfg_.sliding_window;
  }
}

void LlamaModel::rope(float* q, float* k, std::int64_t pos, const float* inv_freq) const {
  const double p = static_cast<double>(pos) * cfg_.rope_freq_scale;
  for (int j = 0; j < cfg_.head_dim / 2; ++j) {
    const double theta = p * inv_freq[j];
    const float c = static_cast<float>(std::cos(theta)), s = static_cast<float>(std::sin(theta));
    const cert::RopePair pr = cert::rope_pair(cfg_.rope_layout, cfg_.head_dim, j);
    const auto rotate = [&](float* x, int n_heads) {
      for (int h = 0; h < n_heads; ++h) {
        float* v = x + h * cfg_.head_dim;
        const float a = v[pr.lo], b = v[pr.hi];
        v[pr.lo] = a * c - b * s;
        v[pr.hi] = a * s + b * c;
      }
    };
    rotate(q, cfg_.heads);
    rotate(k, cfg_.kv_heads);
  }
}

void LlamaModel::forward(std::span<const std::int32_t> tokens, std::int64_t pos0, kvcache::KvCache& cache,
                         ThreadPool& pool, std::span<float> logits, bool all_logits) const {
  BatchRow row{tokens, pos0, &cache, all_logits, true};
  forward_batch(std::span<BatchRow>(&row, 1), pool, logits);
  if (row.logits_ok) return;
  const std::int64_t n = static_cast<std::int64_t>(tokens.size());
  const std::size_t want = static_cast<std::size_t>(all_logits ? n : 1) * cfg_.vocab;
  for (std::size_t i = 0; i < want; ++i)
    if (!std::isfinite(logits[i]))
      throw NonFiniteError("forward: non-finite logit at position " +
                               std::to_string(pos0 + (all_logits ? 0 : n - 1) + static_cast<std::int64_t>(i / cfg_.vocab)) +
                               " (NaN or Inf in the activations)");
}

void LlamaModel::forward_batch(std::span<BatchRow> rows, ThreadPool& pool, std::span<float> logits) const {
  std::unique_lock<std::mutex> lock(state_->busy, std::try_to_lock);
  if (lock.owns_lock()) return forward_in(rows, pool, logits, *state_);
  RunState own;
  forward_in(rows, pool, logits, own);
}

void LlamaModel::forward_in(std::span<BatchRow> rows, ThreadPool& pool, std::span<float> logits, RunState& s) const {
  if (rows.empty()) throw std::invalid_argument("forward: no rows");
  std::int64_t n = 0, n_out = 0;  // tokens, and tokens whose logits are wanted
  for (const BatchRow& row : rows) {
    const std::int64_t m = static_cast<std::int64_t>(row.tokens.size());
    if (m == 0) throw std::invalid_argument("forward: no tokens");
    if (row.cache == nullptr) throw std::invalid_argument("forward: a row without a cache");
    const kvcache::KvGeometry& g = row.cache->geometry();
    if (g.layers != cfg_.layers || g.kv_heads != cfg_.kv_heads || g.head_dim != cfg_.head_dim)
      throw std::invalid_argument("forward: KV cache geometry does not match the model");
    if (row.pos0 < 0 || row.pos0 + m > g.capacity || row.pos0 + m > cfg_.context)
      throw std::out_of_range("forward: positions " + std::to_string(row.pos0) + ".." + std::to_string(row.pos0 + m - 1) +
                              " exceed the context of " + std::to_string(std::min(g.capacity, cfg_.context)) +
                              " tokens");
    for (std::int32_t t : row.tokens)
      if (t < 0 || t >= cfg_.vocab)
        throw std::out_of_range("forward: token id " + std::to_string(t) + " outside the vocabulary of " +
                                std::to_string(cfg_.vocab));
    n += m;
    n_out += row.all_logits ? m : 1;
  }
  if (logits.size() < static_cast<std::size_t>(n_out) * cfg_.vocab)
    throw std::invalid_argument("forward: logits buffer too small");
  // Every query before this pass's first position is answered: windowed layers may let go of what
  // only those queries read.
  for (const BatchRow& row : rows) row.cache->retire_before(row.pos0);

  const int d = cfg_.d_model, hd = cfg_.head_dim, H = cfg_.heads, KV = cfg_.kv_heads, G = cfg_.group();
  const std::int64_t q_dim = H * hd, kv_dim = KV * hd;
  float *x = at_least(s.x, n * d), *xb = at_least(s.xb, n * d), *q = at_least(s.q, n * q_dim),
        *att = at_least(s.att, n * q_dim), *k = at_least(s.k, n * kv_dim), *v = at_least(s.v, n * kv_dim),
        *gate = at_least(s.gate, n * cfg_.d_ff), *up = at_least(s.up, n * cfg_.d_ff);
  std::vector<std::int64_t>& first = s.first;
  first.assign(rows.size() + 1, 0);
  for (std::size_t r = 0; r < rows.size(); ++r) first[r + 1] = first[r] + static_cast<std::int64_t>(rows[r].tokens.size());

  // Attention jobs, as each row's cache asks. Runs of kAttnRun tokens start at the row's first
  // token, so that a cache reads its shared prefix once per run.
  std::vector<RunState::Job>& jobs = s.jobs;
  jobs.clear();
  for (std::size_t r = 0; r < rows.size(); ++r) {
    const std::int64_t runs = (static_cast<std::int64_t>(rows[r].tokens.size()) + kAttnRun - 1) / kAttnRun;
    switch (rows[r].cache->attend_concurrency()) {
      case kvcache::AttendConcurrency::any:
        for (std::int64_t run = 0; run < runs; ++run)
          for (int h = 0; h < KV; ++h) jobs.push_back({r, h, run});
        break;
      case kvcache::AttendConcurrency::per_head:
        for (int h = 0; h < KV; ++h) jobs.push_back({r, h, -1});
        break;
      case kvcache::AttendConcurrency::serial:
        jobs.push_back({r, -1, -1});
        break;
    }
  }

  const Architecture& arch = *traits_;
  for (std::size_t r = 0; r < rows.size(); ++r)
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(rows[r].tokens.size()); ++i)
      embedding_row(tok_embd_, rows[r].tokens[i], &x[(first[r] + i) * d]);
  if (arch.embed_scale) {
    const float scale = std::sqrt(static_cast<float>(d));
    for (std::int64_t i = 0; i < n * d; ++i) x[i] *= scale;
  }

  for (int l = 0; l < cfg_.layers; ++l) {
    const Layer& L = layers_[l];
    for (std::int64_t i = 0; i < n; ++i) rms_norm(&x[i * d], L.attn_norm.data(), d, cfg_.rms_eps, &xb[i * d]);
    matmul(L.wq, xb, n, q, pool);
    matmul(L.wk, xb, n, k, pool);
    matmul(L.wv, xb, n, v, pool);
    if (arch.qkv_bias)
      for (std::int64_t i = 0; i < n; ++i) {
        add_bias(&q[i * q_dim], L.bq);
        add_bias(&k[i * kv_dim], L.bk);
        add_bias(&v[i * kv_dim], L.bv);
      }
    if (arch.qk_norm)
      for (std::int64_t i = 0; i < n; ++i) {
        for (int h = 0; h < H; ++h) rms_norm(&q[i * q_dim + h * hd], L.q_norm.data(), hd, cfg_.rms_eps, &q[i * q_dim + h * hd]);
        for (int h = 0; h < KV; ++h)
          rms_norm(&k[i * kv_dim + h * hd], L.k_norm.data(), hd, cfg_.rms_eps, &k[i * kv_dim + h * hd]);
      }
    for (std::size_t r = 0; r < rows.size(); ++r)
      for (std::int64_t j = 0; j < static_cast<std::int64_t>(rows[r].tokens.size()); ++j) {
        const std::int64_t i = first[r] + j, pos = rows[r].pos0 + j;
        rope(&q[i * q_dim], &k[i * kv_dim], pos, L.inv_freq);
        for (int h = 0; h < KV; ++h) rows[r].cache->write(l, h, pos, &k[i * kv_dim + h * hd], &v[i * kv_dim + h * hd]);
        if (qkv_hook)
          qkv_hook(QkvCapture{l, pos, {&q[i * q_dim], static_cast<std::size_t>(q_dim)},
                              {&k[i * kv_dim], static_cast<std::size_t>(kv_dim)},
                              {&v[i * kv_dim], static_cast<std::size_t>(kv_dim)}});
      }
    // Causal attention: a row's token j sees positions [0, pos0 + j] of its own cache, or the last
    // `window` of them in a sliding-window layer.
    const auto attend_run = [&](std::size_t r, std::int64_t run, int h) {
      const std::int64_t m = static_cast<std::int64_t>(rows[r].tokens.size()), j = run * kAttnRun;
      const std::int64_t i = first[r] + j;
      rows[r].cache->attend_causal(l, h, &q[i * q_dim + h * G * hd], q_dim, G, rows[r].pos0 + j,
                                   std::min(kAttnRun, m - j), cfg_.windows[static_cast<std::size_t>(l)], &att[i * q_dim + h * G * hd], q_dim);
    };
    const auto attend_jobs = [&](std::int64_t b, std::int64_t e, int) {
      for (std::int64_t job = b; job < e; ++job) {
        const RunState::Job& J = jobs[job];
        const std::int64_t runs = (static_cast<std::int64_t>(rows[J.row].tokens.size()) + kAttnRun - 1) / kAttnRun;
        for (int h = J.head < 0 ? 0 : J.head; h < (J.head < 0 ? KV : J.head + 1); ++h)
          for (std::int64_t run = J.run < 0 ? 0 : J.run; run < (J.run < 0 ? runs : J.run + 1); ++run)
            attend_run(J.row, run, h);
      }
    };
    // By reference: a std::function holds a reference_wrapper without allocating.
    pool.parallel_for(static_cast<std::int64_t>(jobs.size()), std::cref(attend_jobs));
    matmul(L.wo, att, n, xb, pool);
    if (arch.post_norms)
      for (std::int64_t i = 0; i < n; ++i) rms_norm(&xb[i * d], L.post_attn_norm.data(), d, cfg_.rms_eps, &xb[i * d]);
    for (std::int64_t i = 0; i < n * d; ++i) x[i] += xb[i];

    for (std::int64_t i = 0; i < n; ++i) rms_norm(&x[i * d], L.ffn_norm.data(), d, cfg_.rms_eps, &xb[i * d]);
    matmul(L.w_gate, xb, n, gate, pool);
    matmul(L.w_up, xb, n, up, pool);
    switch (arch.mlp) {
      case Activation::silu:
        for (std::int64_t i = 0; i < n * cfg_.d_ff; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
        break;
      case Activation::gelu_tanh:
        for (std::int64_t i = 0; i < n * cfg_.d_ff; ++i) gate[i] = gelu_tanh(gate[i]) * up[i];
        break;
    }
    matmul(L.w_down, gate, n, xb, pool);
    if (arch.post_norms)
      for (std::int64_t i = 0; i < n; ++i) rms_norm(&xb[i * d], L.post_ffw_norm.data(), d, cfg_.rms_eps, &xb[i * d]);
    for (std::int64_t i = 0; i < n * d; ++i) x[i] += xb[i];
  }

  // The final norm of the tokens whose logits are wanted, in row order, then one output matmul.
  std::int64_t out = 0;
  for (std::size_t r = 0; r < rows.size(); ++r)
    for (std::int64_t i = rows[r].all_logits ? first[r] : first[r + 1] - 1; i < first[r + 1]; ++i, ++out)
      rms_norm(&x[i * d], output_norm_.data(), d, cfg_.rms_eps, &xb[out * d]);
  matmul(output_, xb, n_out, logits.data(), pool);
  if (cfg_.logit_softcap > 0.0f)
    for (std::int64_t i = 0; i < n_out * cfg_.vocab; ++i)
      logits[i] = cfg_.logit_softcap * std::tanh(logits[i] / cfg_.logit_softcap);
  out = 0;
  for (BatchRow& row : rows) {
    const std::int64_t m = row.all_logits ? static_cast<std::int64_t>(row.tokens.size()) : 1;
    row.logits_ok = std::all_of(&logits[out * cfg_.vocab], &logits[(out + m) * cfg_.vocab],
                                [](float f) { return std::isfinite(f); });
    out += m;
  }
}

}  // namespace witcert::model
