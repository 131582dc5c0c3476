/* WitCert's C API: the sound meter of a quantized KV cache, its certificates, the certified cache
 * and the engine, for programs that compute attention themselves or run a GGUF model.
 *
 * Conventions, for every function:
 *  - It returns a witcert_status; on anything but WITCERT_OK, witcert_last_error() gives a message
 *    naming the offending argument, kept per thread until that thread's next call.
 *  - Buffers are the caller's: the library never keeps a pointer it was given past the call,
 *    except a handle's, and never frees one it did not allocate.
 *  - Sizes are element counts. Null pointers, zero or negative sizes, mismatched lengths and NaN in
 *    inputs are refused with WITCERT_ERROR_INVALID_ARGUMENT, the message naming the argument and
 *    the index; nothing crashes on them. Keys, values, queries and the dither's inputs (float) must
 *    be finite and within fp16's range, |x| <= 65504. An infinity in a double or fp16 input is
 *    accepted only where its function says so, and then the result reads "no guarantee" (+inf
 *    bound, meter 1); no call returns WITCERT_OK with a finite certificate for a non-finite input.
 *  - fp16 values travel as their IEEE binary16 bits in uint16_t.
 *  - Handles are freed by their *_free function, which accepts NULL. The library keeps the set of
 *    live handles: a freed or foreign pointer is refused with WITCERT_ERROR_INVALID_HANDLE without
 *    being read (unless a later handle got the same address, which then answers).
 *  - Functions on distinct handles may run on distinct threads at once; one handle is not to be
 *    used from two threads at the same time.
 *
 * The meter (paper: Wei and Liu, "WitCert: Sound Runtime Risk Observability and Gating for
 * KV-Cache Quantization", §3–§4; docs/c-api.md): given compressed attention logits z̃_t and
 * per-token bounds c_t ≥ |ε_t| on their error, every bound below is at least TV(p, p̃) between the
 * attention distributions over exact and compressed keys. +inf means "no guarantee". */
#ifndef WITCERT_WITCERT_H
#define WITCERT_WITCERT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define WITCERT_EXPORT __attribute__((visibility("default")))
#else
#define WITCERT_EXPORT
#endif

/* The version of this header's API; witcert_api_version() gives the library's. A program built
 * against version N runs with a library of the same version. */
#define WITCERT_API_VERSION 3

typedef enum witcert_status {
  WITCERT_OK = 0,
  WITCERT_ERROR_INVALID_ARGUMENT = 1, /* a null pointer, a bad size or value, NaN */
  WITCERT_ERROR_INVALID_HANDLE = 2,   /* a handle already freed, or not one of ours */
  WITCERT_ERROR_OUT_OF_RANGE = 3,     /* a position beyond the cache or the context, a full pool */
  WITCERT_ERROR_BUFFER_TOO_SMALL = 4, /* the caller's buffer cannot hold the result; *needed says how much */
  WITCERT_ERROR_IO = 5,               /* a file that cannot be read (a missing or malformed GGUF) */
  WITCERT_ERROR_NON_FINITE = 6,       /* the model or an attention produced NaN or infinite values */
  WITCERT_ERROR_INTERNAL = 7,         /* a bug: please report it with witcert_last_error() */
  /* Not statuses: they make each enum of this header as wide as int, so that any int a caller
   * passes is refused as a bad value rather than being undefined behaviour in C++. */
  WITCERT_STATUS_MIN_ = -2147483647 - 1,
  WITCERT_STATUS_MAX_ = 2147483647
} witcert_status;

/* WITCERT_API_VERSION of the library that is loaded, and its release, e.g. "0.1.0". */
WITCERT_EXPORT int witcert_api_version(void);
WITCERT_EXPORT const char* witcert_version(void);
/* The message of this thread's last failed call ("" when none failed). Valid until the thread's
 * next call into the library. */
WITCERT_EXPORT const char* witcert_last_error(void);
/* "ok", "invalid argument", ...: the status's name. */
WITCERT_EXPORT const char* witcert_status_name(witcert_status status);

/* ---------------------------------------------------------------------------------------------
 * Level 1: the meter.
 * ------------------------------------------------------------------------------------------- */

/* The bound shapes (docs/c-api.md): every one is sound. MIN is the least of e-form, two-sided and
 * tanh(c_max/2); RETENTION is the per-token form of Proposition 1. */
typedef enum witcert_bound_shape {
  WITCERT_BOUND_EFORM = 0,
  WITCERT_BOUND_TWO_SIDED = 1,
  WITCERT_BOUND_RETENTION = 2,
  WITCERT_BOUND_TANH = 3,
  WITCERT_BOUND_TANH_HALF = 4,
  WITCERT_BOUND_MIN = 5,
  WITCERT_BOUND_SHAPE_MIN_ = -2147483647 - 1, /* not values: as wide as int */
  WITCERT_BOUND_SHAPE_MAX_ = 2147483647
} witcert_bound_shape;

/* Every bound shape of one attention distribution, unclamped (+inf: no guarantee), and the meter:
 * the least of them clamped to [0, 1]. raw is the e-form, the paper's risk score. */
typedef struct witcert_bounds {
  double eform;
  double two_sided;
  double retention;
  double tanh;
  double tanh_half;
  double raw;
  double meter;
} witcert_bounds;

/* From n ≥ 1 compressed logits z (any additive offset; -inf for a masked token, at least one
 * finite) and bounds c (c_t ≥ 0, +inf allowed). */
WITCERT_EXPORT witcert_status witcert_meter_logits(const double* z, const double* c, size_t n, witcert_bounds* out);
/* The same from probabilities p̃ (≥ 0, summing to 1 within 1e-9) instead of logits. */
WITCERT_EXPORT witcert_status witcert_meter_probs(const double* p_tilde, const double* c, size_t n,
                                                  witcert_bounds* out);
/* From c alone (c_max = max_t c_t ≥ 0, +inf allowed): tanh(c_max) and tanh(c_max/2). */
WITCERT_EXPORT witcert_status witcert_meter_tanh(double c_max, double* tanh_bound, double* tanh_half_bound);
/* In the log domain, from log A = log Σ p̃_t e^{c_t} and log A⁻ = log Σ p̃_t e^{-c_t} (an engine that
 * accumulates these itself): the e-form ½(A² − 1) and the two-sided sinh(log A − log A⁻). log A
 * may be +inf. */
WITCERT_EXPORT witcert_status witcert_meter_log_domain(double log_a, double log_a_minus, double* eform,
                                                       double* two_sided);
/* One shape of `b`, clamped to [0, 1] (MIN: the least of the five). Every field of `b` must be >= 0
 * (+inf allowed: no guarantee); a NaN or negative field is refused. */
WITCERT_EXPORT witcert_status witcert_bounds_meter(const witcert_bounds* b, witcert_bound_shape shape, double* meter);
/* The exact TV(p, p̃) for p ∝ p̃·e^{-ε}: what every bound must dominate (for tests and studies). p̃ as
 * witcert_meter_probs takes it; ε finite. */
WITCERT_EXPORT witcert_status witcert_true_tv(const double* p_tilde, const double* eps, size_t n, double* tv);

/* Many attention steps at once (a batch × heads × steps tensor flattened into rows), with arrays of
 * any float type, read in place and widened exactly to double. */
typedef enum witcert_dtype {
  WITCERT_DTYPE_F64 = 0,
  WITCERT_DTYPE_F32 = 1,
  WITCERT_DTYPE_F16 = 2,  /* IEEE binary16 */
  WITCERT_DTYPE_BF16 = 3, /* bfloat16: the top half of a binary32 */
  WITCERT_DTYPE_MIN_ = -2147483647 - 1, /* not values: as wide as int */
  WITCERT_DTYPE_MAX_ = 2147483647
} witcert_dtype;

/* witcert_meter_logits for `rows` rows of n tokens: row r's logits are z[r·n, r·n + n) and its bounds
 * c[r·n, r·n + n); out receives `rows` bounds. Every row is checked as one call checks it, and the
 * first bad row fails the call, its index in the message. threads ≤ 0: one per core; 1: the calling
 * thread only. */
WITCERT_EXPORT witcert_status witcert_meter_logits_batch(const void* z, witcert_dtype z_type, const void* c,
                                                         witcert_dtype c_type, size_t rows, size_t n, int threads,
                                                         witcert_bounds* out);
/* The same from probabilities p̃ (each row as witcert_meter_probs takes it). */
WITCERT_EXPORT witcert_status witcert_meter_probs_batch(const void* p_tilde, witcert_dtype p_type, const void* c,
                                                        witcert_dtype c_type, size_t rows, size_t n, int threads,
                                                        witcert_bounds* out);

/* ---------------------------------------------------------------------------------------------
 * Level 2: the certificates.
 * ------------------------------------------------------------------------------------------- */

/* Which coordinates form RoPE frequency pair j of a d-dimensional head. */
typedef enum witcert_rope_layout {
  WITCERT_ROPE_INTERLEAVED = 0, /* (2j, 2j+1): GGML's "normal" rope, llama */
  WITCERT_ROPE_NEOX = 1,        /* (j, j + d/2) */
  WITCERT_ROPE_LAYOUT_MIN_ = -2147483647 - 1, /* not values: as wide as int */
  WITCERT_ROPE_LAYOUT_MAX_ = 2147483647
} witcert_rope_layout;

/* Tier A (black-box schemes). A key k of d floats and its compressed value k_hat: the witness is
 * one fp16 per band (d even, `bands` dividing d/2), each ≥ the band's error norm. k_hat may hold
 * ±inf or values beyond fp16 (a scheme that overflowed): the band's witness is then +inf. */
WITCERT_EXPORT witcert_status witcert_witness(int d, int bands, witcert_rope_layout layout, const float* k_hat,
                                              const float* k, uint16_t* witness);
/* The bounds c_t ≥ |ε_t| of n_tokens keys for one query q (d floats) at softmax scale sm > 0 (
 * 1/sqrt(d) for standard attention): witnesses holds n_tokens × bands fp16, each ≥ 0; a witness of
 * +inf gives c_t = +inf (where q's band is not zero). */
WITCERT_EXPORT witcert_status witcert_tier_a_bounds(int d, int bands, witcert_rope_layout layout, const float* q,
                                                    const uint16_t* witnesses, size_t n_tokens, double sm,
                                                    double* c);

/* Witnesses of n keys at once: k_hat and k hold n × d values each (of their own dtypes: float32,
 * float16 or bfloat16; float64 is refused, as it would be rounded), witness receives n × bands fp16. */
WITCERT_EXPORT witcert_status witcert_witness_batch(int d, int bands, witcert_rope_layout layout, const void* k_hat,
                                                    witcert_dtype k_hat_type, const void* k, witcert_dtype k_type,
                                                    size_t n, uint16_t* witness);
/* The bounds c of a batch of queries over their KV heads' keys: q holds batch × q_heads × d values
 * (float32, float16 or bfloat16; query head h reads KV head h / (q_heads / kv_heads)), witnesses
 * batch × kv_heads × n_tokens × bands fp16, and c receives batch × q_heads × n_tokens bounds, each as
 * witcert_tier_a_bounds gives it. threads as for witcert_meter_logits_batch. */
WITCERT_EXPORT witcert_status witcert_tier_a_bounds_batch(int d, int bands, witcert_rope_layout layout, const void* q,
                                                          witcert_dtype q_type, const uint16_t* witnesses,
                                                          size_t batch, int q_heads, int kv_heads, size_t n_tokens,
                                                          double sm, int threads, double* c);

/* Tier B (dithered INT8). The dither ξ of channels 0 .. d−1 of a physical slot, from the Philox
 * counter (slot, channel/4, kv_head, layer) under `seed`: every value on the grid k·2^-24 − ½. */
WITCERT_EXPORT witcert_status witcert_dither_values(uint64_t seed, uint32_t layer, uint32_t kv_head, uint32_t slot,
                                                    float* xi, size_t d);
/* Encodes one token x of d floats with dither xi; outlier[c] = 1 keeps channel c exact (may be
 * NULL: none). group divides d. Writes d codes, d/group fp16 scales, and the fp16 value of each
 * outlier channel in channel order (n_outliers entries: the number of ones in `outlier`). */
WITCERT_EXPORT witcert_status witcert_dither_encode(const float* x, const float* xi, const uint8_t* outlier, size_t d,
                                                    int group, int8_t* codes, uint16_t* scales,
                                                    uint16_t* outlier_values, size_t n_outliers);
WITCERT_EXPORT witcert_status witcert_dither_decode(const int8_t* codes, const uint16_t* scales, const float* xi,
                                                    const uint8_t* outlier, const uint16_t* outlier_values,
                                                    size_t n_outliers, size_t d, int group, float* out);
/* δ_loc = δ_req/(L·H·T) for a request of `layers` layers, `q_heads` query heads and `steps` decode
 * steps, 0 < δ_req < 1. */
WITCERT_EXPORT witcert_status witcert_delta_loc(double delta_req, long layers, long q_heads, long steps,
                                                double* delta_loc);
/* The radius u_t ≥ |ε_t| (with probability ≥ 1 − δ_loc jointly over the S tokens) of one stored
 * key for query q at scale sm, from its scales and outlier mask (NULL: none). */
WITCERT_EXPORT witcert_status witcert_dither_radius(const float* q, const uint16_t* scales, const uint8_t* outlier,
                                                    size_t d, int group, double sm, long n_tokens,
                                                    double delta_loc, double* u);
/* The value side: ‖y − ŷ‖ ≤ 2·TV_K·max_t‖v_t‖ + Σ_t p̃_t ρ_t (bound), and the V meter, the second term
 * relative to max_t‖v_t‖. tv_k and weighted_rho may be +inf (no guarantee); v_max_norm is finite. */
WITCERT_EXPORT witcert_status witcert_value_bound(double tv_k, double v_max_norm, double weighted_rho,
                                                  double* bound, double* v_meter);

/* ---------------------------------------------------------------------------------------------
 * Level 3: the certified cache. A pool of pages holds the compressed K and V of many sequences;
 * each sequence is a cache over it that writes post-RoPE keys and values and attends a group of
 * query heads, returning the output and the meter of every head.
 * ------------------------------------------------------------------------------------------- */

typedef struct witcert_pool witcert_pool;
typedef struct witcert_cache witcert_cache;

typedef struct witcert_geometry {
  int layers;
  int q_heads;  /* query heads per layer: a multiple of kv_heads */
  int kv_heads;
  int head_dim;
  int64_t capacity; /* positions of one sequence */
  witcert_rope_layout rope_layout;
} witcert_geometry;

/* A pool for sequences of `g`. options_json is a JSON object (docs/c-api.md): "kv" (the key
 * scheme, e.g. "q4_0", "dither-int8"), "kv_v", "tau_k" (τ_K of the gate; a gate keeps the exact tier),
 * "tau_v", "granularity", "delta", "bound", "page_size", ... as `witcert generate` takes them;
 * "{}" is the plain fp16 cache without a meter. pool_bytes bounds the pool's measured bytes; 0:
 * room for one sequence of capacity. */
WITCERT_EXPORT witcert_status witcert_pool_create(const witcert_geometry* g, const char* options_json,
                                                  int64_t pool_bytes, witcert_pool** pool);
typedef struct witcert_pool_stats {
  int64_t pages;
  int64_t free_pages;
  int page_size;
  uint64_t bytes;         /* measured bytes of the compressed pool */
  uint64_t backing_bytes; /* of the exact tier (0 without one) */
} witcert_pool_stats;
WITCERT_EXPORT witcert_status witcert_pool_stats_get(const witcert_pool* pool, witcert_pool_stats* stats);
/* Frees the pool; its caches must be freed first (WITCERT_ERROR_INVALID_ARGUMENT otherwise). */
WITCERT_EXPORT void witcert_pool_free(witcert_pool* pool);

/* A new, empty sequence over the pool, with the pool's policy or, from policy_json (may be NULL),
 * its own: "tau_k", "tau_v", "granularity", "delta", "bound". decode_budget is T of δ_loc. */
WITCERT_EXPORT witcert_status witcert_cache_create(witcert_pool* pool, const char* policy_json, int64_t decode_budget,
                                                   witcert_cache** cache);
/* Stores the post-RoPE key and value (head_dim floats each) of position pos < capacity. */
WITCERT_EXPORT witcert_status witcert_cache_write(witcert_cache* cache, int layer, int kv_head, int64_t pos,
                                                  const float* k, const float* v);

/* Positions [pos0, pos0 + tokens) of every KV head of `layer` in one call: k and v hold kv_heads ×
 * tokens × head_dim floats. Every value is checked before any is stored, so a refused call writes
 * nothing. k_hat and v_hat (same shape; NULL otherwise) are the reconstructions of a side whose
 * format is "external": the caller's own scheme, whose Tier-A witness the store computes against k
 * as for any scheme (a reconstruction may be infinite, giving no guarantee, never NaN). A pool's
 * "kv" or "kv_v" may name "external"; witcert_cache_write refuses such a cache. */
WITCERT_EXPORT witcert_status witcert_cache_write_rows(witcert_cache* cache, int layer, int64_t pos0, int64_t tokens,
                                                       const float* k, const float* v, const float* k_hat,
                                                       const float* v_hat);

/* The meter of one query head at one step. */
typedef struct witcert_cell {
  int layer;
  int q_head;
  int64_t pos;    /* the query's position; it attended over [0, pos] */
  double raw;     /* the e-form, unclamped (+inf: no guarantee) */
  double meter;   /* the K meter: the chosen bound shape, clamped to 1 */
  double v_meter; /* the V meter */
  double output_bound; /* ‖y − ŷ‖ ≤ output_bound for this head's output y (absolute) */
  int repaired;   /* the gate repaired pages for this cell before serving it */
} witcert_cell;

/* Attention of the `group` query heads sharing kv_head over positions [0, n_ctx), all written:
 * q holds group × head_dim queries, out receives group × head_dim outputs, and cells (may be NULL)
 * group cells, one per query head (all zero for the plain fp16 cache, which is exact). A gated
 * cache repairs here. A head whose output is not finite fails the call with
 * WITCERT_ERROR_NON_FINITE, and its cell reads no guarantee (meter 1, raw and bounds +inf). */
WITCERT_EXPORT witcert_status witcert_cache_attend(witcert_cache* cache, int layer, int kv_head, const float* q,
                                                   int group, int64_t n_ctx, float* out, witcert_cell* cells);
/* witcert_cache_attend over positions [begin, end) only: a left-padded row of a batch (begin: its
 * padding) or a sliding window. 0 ≤ begin < end ≤ the positions written. */
WITCERT_EXPORT witcert_status witcert_cache_attend_range(witcert_cache* cache, int layer, int kv_head, const float* q,
                                                         int group, int64_t begin, int64_t end, float* out,
                                                         witcert_cell* cells);
/* Causal attention of `tokens` consecutive query positions [pos0, pos0 + tokens) in one call, each
 * over its own positions (the last `window` of them when window > 0; 0: all): q and out hold tokens ×
 * group × head_dim floats, cells (may be NULL) tokens × group, position-major. The run reads the
 * positions every one of its queries sees once for all of them (a prefill), and each query's meter
 * takes the run's widest span in its union bound, so it may read slightly above the one-position
 * call's. */
WITCERT_EXPORT witcert_status witcert_cache_attend_causal(witcert_cache* cache, int layer, int kv_head,
                                                          const float* q, int group, int64_t pos0, int64_t tokens,
                                                          int64_t window, float* out, witcert_cell* cells);
typedef struct witcert_cache_stats {
  int64_t page_ins;      /* pages the gate promoted to the exact tier */
  int64_t page_in_bytes; /* exact K and V bytes read for them */
  uint64_t bytes;        /* measured bytes of this sequence's own state */
} witcert_cache_stats;
WITCERT_EXPORT witcert_status witcert_cache_stats_get(const witcert_cache* cache, witcert_cache_stats* stats);
/* The request's report, the `witcert` object a `witcert serve` response carries (docs/serve.md):
 * formats, gate, cells, coverage, raw-score quantiles, worst cells, page-ins, verdict and reason.
 * witcert_cache_report_start begins it: the cells of every later attend at positions ≥ first_pos
 * (the prompt's length: the decode steps) are summarised; calling it again starts over. Its τ are
 * the gate's, else 0.2 and 0.05. witcert_cache_report writes it as JSON into json (cap bytes, NUL
 * included) and *needed the bytes it takes; WITCERT_ERROR_BUFFER_TOO_SMALL when they do not fit.
 * A new cache's report starts at position 0; the plain cache's reads `unmetered`. */
WITCERT_EXPORT witcert_status witcert_cache_report_start(witcert_cache* cache, int64_t first_pos);
WITCERT_EXPORT witcert_status witcert_cache_report(const witcert_cache* cache, char* json, size_t cap,
                                                   size_t* needed);
/* A request-level repair decided elsewhere, by the other ranks of a tensor-parallel model whose
 * heads asked for it: every written page of every layer and KV head is served from the exact tier
 * from now on, as the cache's own "request" granularity does (asked for by position `at`, counted
 * as page-ins). *pages (may be NULL) receives the pages promoted. Refused for a cache without a
 * gate (nothing keeps its exact tier for serving). */
WITCERT_EXPORT witcert_status witcert_cache_promote_all(witcert_cache* cache, int64_t at, int64_t* pages);
/* One cell as a report counts it: witcert_cell's fields, the values before the step's own repair,
 * the V meter's sure form, and under "check_soundness" the true TV and value error (else NaN). */
typedef struct witcert_report_cell {
  int layer;
  int q_head;
  int64_t pos;
  double raw, meter, v_meter, output_bound;
  double raw_before, meter_before, v_meter_before;
  double v_meter_sure;
  double tv, v_true;
  int repaired;
} witcert_report_cell;
/* A report kept elsewhere from this cache's cells (another process's, or one merging the ranks of
 * a tensor-parallel model, each metering its own heads). keep = 1: from now on the cells the report
 * counts are also kept until drained; 0: they are dropped and no longer kept.
 * witcert_cache_drain_cells moves the kept cells into cells (cap of them) and sets *n to their
 * number; WITCERT_ERROR_BUFFER_TOO_SMALL, moving none, when they do not fit. */
WITCERT_EXPORT witcert_status witcert_cache_keep_cells(witcert_cache* cache, int keep);
WITCERT_EXPORT witcert_status witcert_cache_drain_cells(witcert_cache* cache, witcert_report_cell* cells, size_t cap,
                                                        size_t* n);
/* Releases the sequence: its pages return to the pool. */
WITCERT_EXPORT void witcert_cache_free(witcert_cache* cache);

/* A request's report assembled from drained cells: the `witcert` object of witcert_cache_report,
 * for `layers` × `q_heads` cells a step at positions ≥ first_pos, with the formats, gate and bound
 * of options_json (witcert_pool_create's options). witcert_report_record checks each cell's layer,
 * head and values before it counts any; witcert_report_add_page_ins adds the gate's page-ins. */
typedef struct witcert_report witcert_report;
WITCERT_EXPORT witcert_status witcert_report_create(const char* options_json, int layers, int q_heads,
                                                    int64_t first_pos, witcert_report** report);
WITCERT_EXPORT witcert_status witcert_report_record(witcert_report* report, const witcert_report_cell* cells,
                                                    size_t n);
WITCERT_EXPORT witcert_status witcert_report_add_page_ins(witcert_report* report, int64_t page_ins,
                                                          int64_t page_in_bytes);
WITCERT_EXPORT witcert_status witcert_report_json(const witcert_report* report, char* json, size_t cap,
                                                  size_t* needed);
WITCERT_EXPORT void witcert_report_free(witcert_report* report);

/* ---------------------------------------------------------------------------------------------
 * Level 4: the engine. A GGUF model (llama architecture) on the CPU, generating over a certified
 * cache.
 * ------------------------------------------------------------------------------------------- */

typedef struct witcert_engine witcert_engine;

/* Loads a GGUF file with `threads` worker threads (1 .. 256). */
WITCERT_EXPORT witcert_status witcert_engine_load(const char* gguf_path, int threads, witcert_engine** engine);
WITCERT_EXPORT void witcert_engine_free(witcert_engine* engine);
/* The token ids of text (chat ≠ 0: wrapped as one user turn of the model's chat template) into
 * tokens[0 .. capacity); *n receives the count, also when the buffer is too small. */
WITCERT_EXPORT witcert_status witcert_engine_tokenize(const witcert_engine* engine, const char* text, int chat,
                                                      int32_t* tokens, size_t capacity, size_t* n);

/* The meter of one generated token's step: every (layer, query head) cell of the forward pass
 * that produced it. */
typedef struct witcert_step_meter {
  int64_t cells;
  double coverage_k; /* fraction of cells whose K meter met coverage τ_K (1 without cells) */
  double coverage_v; /* ... whose V meter met τ_V */
  double raw_max;    /* the largest raw score (+inf: some cell had no guarantee) */
  double meter_max;  /* the largest K meter */
  int64_t repaired;  /* cells the gate repaired */
} witcert_step_meter;

/* Called for each generated token with its text piece (NUL-terminated; may be part of a UTF-8
 * character) and its step's meter (NULL for the plain cache). Returning non-zero cancels the
 * generation after this token. */
typedef int (*witcert_token_callback)(void* user, int32_t token, const char* piece, const witcert_step_meter* meter);

/* What a request's meter says (the `verdict` of the server's witcert object): every served cell
 * met τ_K and τ_V with no repair; met them with the gate's repairs; some did not; no cell. */
typedef enum witcert_verdict {
  WITCERT_VERDICT_CERTIFIED = 0,
  WITCERT_VERDICT_REPAIRED = 1,
  WITCERT_VERDICT_AT_RISK = 2,
  WITCERT_VERDICT_UNMETERED = 3
} witcert_verdict;

typedef struct witcert_generation {
  int64_t prompt_tokens;
  int64_t completion_tokens;
  int stopped;   /* ended at a stop token */
  int cancelled; /* the callback asked to stop */
  int has_meter;
  int64_t cells;     /* the request's metered cells */
  double coverage_k; /* over the whole request */
  double coverage_v;
  double raw_median;
  double raw_p90;
  double raw_max;
  int64_t page_ins;
  int64_t page_in_bytes;
  witcert_verdict verdict; /* WITCERT_VERDICT_UNMETERED without a meter */
  char reason[256];        /* the verdict's one-line reason, NUL-terminated (cut to fit) */
} witcert_generation;

/* Generates from `prompt`. request_json (may be NULL) holds the request and its cache: "chat",
 * "max_tokens", "temperature", "top_p", "seed", "coverage_tau", "coverage_tau_v" and the cache's
 * keys as witcert_pool_create takes them ("kv", "tau_k", ...). The text goes to text[0 ..
 * text_capacity) NUL-terminated (text may be NULL with capacity 0); *text_needed (may be NULL)
 * receives its length + 1. A text buffer too small still runs the generation and fills result,
 * then returns WITCERT_ERROR_BUFFER_TOO_SMALL. */
WITCERT_EXPORT witcert_status witcert_engine_generate(witcert_engine* engine, const char* prompt,
                                                      const char* request_json, witcert_token_callback on_token,
                                                      void* user, witcert_generation* result, char* text,
                                                      size_t text_capacity, size_t* text_needed);

#ifdef __cplusplus
}
#endif

#endif /* WITCERT_WITCERT_H */
