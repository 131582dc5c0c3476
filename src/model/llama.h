// The decoder forward pass on CPU (RMSNorm, RoPE, grouped-query attention, gated MLP) for every
// architecture of model/architecture.h — llama (Llama 2/3, Mistral, SmolLM), qwen2, qwen3,
// gemma3 — reading its weights straight from a memory-mapped GGUF file and calling attention only
// through the KvCache interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/thread_pool.h"
#include "cert/witness.h"
#include "kvcache/kv_cache.h"
#include "model/architecture.h"
#include "model/gguf.h"
#include "model/matmul.h"

namespace witcert::model {

// A forward pass produced NaN or an infinity (weights or activations out of range).
struct NonFiniteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct LlamaConfig {
  std::string arch;  // general.architecture; its traits are model::architecture(arch)
  int layers = 0;
  int d_model = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 0;  // attention.key_length, else d_model / heads
  int d_ff = 0;
  int vocab = 0;
  std::int64_t context = 0;          // the positions a sequence may reach: context_length
  std::int64_t sliding_window = 0;   // attention.sliding_window of the sliding-window layers; 0: none
  std::vector<std::int64_t> windows;  // [layer]: its attention window (kvcache::window_begin); 0: none
  float rope_theta = 10000.0f;
  float rope_freq_scale = 1.0f;  // linear RoPE scaling: positions are multiplied by this
  float logit_softcap = 0.0f;    // final_logit_softcapping: logits = cap·tanh(logits / cap); 0: none
  float rms_eps = 1e-5f;
  cert::RopeLayout rope_layout = cert::RopeLayout::interleaved;
  bool tied_output = false;

  int group() const { return heads / kv_heads; }  // query heads per KV head
  kvcache::KvGeometry kv_geometry(std::int64_t capacity) const { return {layers, kv_heads, head_dim, capacity}; }
};

// The post-RoPE q, k, v of one token at one layer, for offline studies.
struct QkvCapture {
  int layer;
  std::int64_t pos;
  std::span<const float> q;  // heads × head_dim
  std::span<const float> k;  // kv_heads × head_dim
  std::span<const float> v;  // kv_heads × head_dim
};

// One sequence's part of a batched forward pass: its tokens at positions pos0 .. pos0+n−1 and its
// cache. logits_ok is set false when the row's logits are not all finite (NaN or Inf in its
// activations); the other rows are unaffected.
struct BatchRow {
  std::span<const std::int32_t> tokens;
  std::int64_t pos0 = 0;
  kvcache::KvCache* cache = nullptr;
  bool all_logits = false;  // logits of every token, not only the last
  bool logits_ok = true;    // out
};

class LlamaModel {
 public:
  // Reads the configuration and binds the weights of a GGUF file (which must outlive the model).
  // Throws std::runtime_error naming the problem: unsupported architecture or RoPE scaling,
  // missing tensor, wrong shape.
  explicit LlamaModel(const GgufFile& file);
  ~LlamaModel();

  const LlamaConfig& config() const { return cfg_; }

  // Runs tokens at positions pos0 .. pos0+n−1 (causal over everything cached before), writing
  // their keys and values into `cache`. logits receives vocab floats for the last token, or
  // n × vocab when all_logits. Throws on an out-of-range token id, a position beyond the
  // cache, or non-finite logits.
  void forward(std::span<const std::int32_t> tokens, std::int64_t pos0, kvcache::KvCache& cache, ThreadPool& pool,
               std::span<float> logits, bool all_logits = false) const;

  // One pass over every row's tokens: each weight matrix is read once for all of them, attention
  // runs per row over its own cache. A row's logits follow the previous row's in `logits` (vocab
  // floats, or n × vocab with all_logits). Each row's results are bit for bit those of its own
  // forward call: every token's products keep their order whatever shares the pass. Throws as
  // forward does on bad input, before anything is written; non-finite logits only mark the row.
  void forward_batch(std::span<BatchRow> rows, ThreadPool& pool, std::span<float> logits) const;

  // Called for every (layer, token) with the post-RoPE q, k, v when set.
  std::function<void(const QkvCapture&)> qkv_hook;

 private:
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    WeightMatrix wq, wk, wv, wo, w_gate, w_up, w_down;
    std::vector<float> bq, bk, bv;                     // qkv_bias
    std::vector<float> q_norm, k_norm;                 // qk_norm: head_dim each
    std::vector<float> post_attn_norm, post_ffw_norm;  // post_norms
    const float* inv_freq = nullptr;                   // its RoPE frequencies (global or sliding-window)
  };

  // The buffers of a forward pass (llama2.c's RunState), defined in llama.cc.
  struct RunState;

  // Rotates one position's query heads q and key heads k, each angle computed once for both.
  void rope(float* q, float* k, std::int64_t pos, const float* inv_freq) const;
  void forward_in(std::span<BatchRow> rows, ThreadPool& pool, std::span<float> logits, RunState& s) const;

  LlamaConfig cfg_;
  const Architecture* traits_ = nullptr;
  WeightMatrix tok_embd_, output_;
  std::vector<float> output_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_, swa_inv_freq_;  // θ_j = base^{−2j/d} (÷ rope factor j), per base
  // The model's one run state, reused by every pass that finds it free; a pass that finds it
  // taken (another sequence's, on another thread) runs in a state of its own.
  std::unique_ptr<RunState> state_;
};

}  // namespace witcert::model
