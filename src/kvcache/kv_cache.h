// The narrow interface between the model and attention (DESIGN §2): the model writes the
// post-RoPE key and value of every token for each (layer, KV head) and asks for the attention
// output of a group of query heads. Cache formats (exact fp16 here; the certified packed
// formats later) plug in behind it without any change to the model code.
#pragma once

#include <cstdint>

namespace witcert::kvcache {

struct KvGeometry {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t capacity = 0;  // positions per sequence
};

// Which attention calls of one forward pass may run at the same time. A cache whose attention
// changes what later calls read (the gate's repairs) asks for per_head (one call at a time per
// (layer, KV head), in position order) or serial (one call at a time), so that results do not
// depend on thread timing.
enum class AttendConcurrency { any, per_head, serial };

// The first position a query at `pos` attends under a sliding window of `window` positions (0: no
// window): key t is seen while pos − t < window, as llama.cpp and Hugging Face mask Gemma 3's
// sliding-window layers.
inline std::int64_t window_begin(std::int64_t pos, std::int64_t window) {
  return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

class KvCache {
 public:
  virtual ~KvCache() = default;

  virtual const KvGeometry& geometry() const = 0;

  // Stores the post-RoPE key and value (head_dim floats each) of position `pos`.
  virtual void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) = 0;

  // Attention of `group` query heads that share `kv_head` (GQA) over positions [begin, end), all
  // written: q holds group × head_dim post-RoPE queries, out receives group × head_dim outputs of
  // softmax(sm · q·kᵀ)·V with sm = 1/sqrt(head_dim). Not const: a gated cache repairs pages here.
  virtual void attend(int layer, int kv_head, const float* q, int group, std::int64_t begin, std::int64_t end,
                      float* out) = 0;
  // The same over [0, n_ctx).
  void attend(int layer, int kv_head, const float* q, int group, std::int64_t n_ctx, float* out) {
    attend(layer, kv_head, q, group, 0, n_ctx, out);
  }

  // Causal attention of n consecutive query positions pos0 … pos0+n−1, all already written, under
  // a sliding window of `window` positions (0: none): query i attends over
  // [window_begin(pos0 + i, window), pos0 + i + 1). Position i's group × head_dim queries start at
  // q + i·q_stride, its outputs at out + i·out_stride. The default calls attend once per position;
  // a cache may share its reads of the positions the run's queries have in common (prefill).
  virtual void attend_causal(int layer, int kv_head, const float* q, std::int64_t q_stride, int group,
                             std::int64_t pos0, std::int64_t n, std::int64_t window, float* out,
                             std::int64_t out_stride) {
    for (std::int64_t i = 0; i < n; ++i)
      attend(layer, kv_head, q + i * q_stride, group, window_begin(pos0 + i, window), pos0 + i + 1, out + i * out_stride);
  }

  virtual AttendConcurrency attend_concurrency() const { return AttendConcurrency::any; }

  // Forgets every position (a new request).
  virtual void clear() = 0;

  // The request's prompt is positions [0, n), announced before any of them is written. A cache
  // may use it (DitherMode::shared_prompt: the prompt's keys share their page's dither); the
  // default ignores it.
  virtual void set_prompt_length(std::int64_t n) { (void)n; }

  // Every query below pos has been answered at every layer: the next forward pass starts at pos.
  // A cache may free what only those queries read (a sliding-window layer's positions before
  // window_begin(pos, window)); the default keeps everything.
  virtual void retire_before(std::int64_t pos) { (void)pos; }

  // Prefix sharing, for caches over one shared pool: this cache, holding nothing yet, takes
  // positions [0, n) of `donor` (a cache of the same kind over the same pool whose tokens there
  // are this one's) without writing them, and reads them back as it would have. Returns false,
  // taking nothing, where it cannot (the default; a cache may also refuse an n that splits its
  // blocks).
  virtual bool share_prefix(const KvCache& donor, std::int64_t n) {
    (void)donor;
    (void)n;
    return false;
  }
};

}  // namespace witcert::kvcache
