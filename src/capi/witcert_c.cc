// The C API (include/witcert/witcert.h) over the library: every entry point checks its arguments,
// runs the C++ call inside one exception boundary and turns what it throws into a status and the
// thread's error message.
#include "witcert/witcert.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "base/thread_pool.h"
#include "capi/internal.h"
#include "cert/meter.h"
#include "cert/subgaussian.h"
#include "cert/witness.h"
#include "engine/cache_factory.h"
#include "engine/meter_object.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/batch.h"
#include "formats/dither/dither.h"
#include "formats/external/external.h"
#include "formats/kv_format.h"
#include "gate/meter_cell.h"
#include "gate/telemetry.h"
#include "kvcache/page_pool.h"
#include "model/gguf.h"
#include "model/llama.h"

using namespace witcert;
using namespace witcert::capi;

namespace {

// The checks every attend call shares: a layer, KV head and group of the geometry, queries at
// positions [pos0, pos0 + tokens) whose keys are written, and finite queries within fp16's range.
void check_attend(const witcert_cache& c, int layer, int kv_head, const float* q, int group, std::int64_t pos0,
                  std::int64_t tokens, const float* out) {
  const model::LlamaConfig& g = c.pool->geometry;
  if (!(layer >= 0 && layer < g.layers))
    refuse("layer " + std::to_string(layer) + " is outside [0, " + std::to_string(g.layers) + ")");
  if (!(kv_head >= 0 && kv_head < g.kv_heads))
    refuse("kv_head " + std::to_string(kv_head) + " is outside [0, " + std::to_string(g.kv_heads) + ")");
  if (group != g.heads / g.kv_heads)
    refuse("group must be q_heads / kv_heads = " + std::to_string(g.heads / g.kv_heads) + ", got " +
           std::to_string(group));
  const std::int64_t end = pos0 + tokens;
  if (!(end >= 1 && end <= c.pool->capacity))
    refuse("n_ctx (end) " + std::to_string(end) + " is outside [1, " + std::to_string(c.pool->capacity) + "]",
           WITCERT_ERROR_OUT_OF_RANGE);
  not_null(q, "q");
  not_null(out, "out");
  check_activations(q, static_cast<std::size_t>(tokens) * group * g.head_dim, "q");
  const std::int64_t written = c.written[static_cast<std::size_t>(layer) * g.kv_heads + kv_head];
  if (end > written)
    refuse("n_ctx (end) is " + std::to_string(end) + " but only " + std::to_string(written) +
           " positions of this (layer, kv_head) are written", WITCERT_ERROR_OUT_OF_RANGE);
}

// The cells of the group's heads at positions [pos0, pos0 + tokens), position-major, from what the
// cache recorded (all zero for the plain cache). A head whose output is not finite certifies
// nothing: its cell reads no guarantee whatever the meter said, and the call fails, so that neither
// the status nor a cell vouches for it.
void serve_cells(const witcert_cache& c, int layer, int kv_head, int group, std::int64_t pos0, std::int64_t tokens,
                 const float* out, witcert_cell* cells) {
  const std::size_t d = static_cast<std::size_t>(c.pool->geometry.head_dim);
  const std::size_t n = static_cast<std::size_t>(tokens) * group;
  std::vector<char> finite(n);
  for (std::size_t i = 0; i < n; ++i)
    finite[i] = std::all_of(out + i * d, out + (i + 1) * d, [](float y) { return std::isfinite(y); });
  if (cells) {
    for (std::size_t i = 0; i < n; ++i)
      cells[i] = {layer, kv_head * group + static_cast<int>(i % group), pos0 + static_cast<std::int64_t>(i / group),
                  0.0, 0.0, 0.0, 0.0, 0};
    for (const gate::MeterCell& m : c.cells.cells_) {
      const int h = m.q_head - kv_head * group;
      const std::int64_t t = m.pos - pos0;
      if (h >= 0 && h < group && t >= 0 && t < tokens)
        cells[t * group + h] = {m.layer, m.q_head, m.pos, m.eform_raw, m.meter, m.v_meter, m.output_bound,
                                m.repaired ? 1 : 0};
    }
    for (std::size_t i = 0; i < n; ++i) {
      witcert_cell& cell = cells[i];
      if (!finite[i] || std::isnan(cell.raw)) cell.raw = HUGE_VAL;
      if (!finite[i] || !(cell.meter <= 1.0)) cell.meter = 1.0;
      if (!finite[i] || std::isnan(cell.v_meter)) cell.v_meter = HUGE_VAL;
      if (!finite[i] || std::isnan(cell.output_bound)) cell.output_bound = HUGE_VAL;
    }
  }
  const auto bad = std::find(finite.begin(), finite.end(), 0);
  if (bad != finite.end()) {
    const std::size_t i = static_cast<std::size_t>(bad - finite.begin());
    refuse("the output of q_head " + std::to_string(kv_head * group + static_cast<int>(i % group)) + " at position " +
               std::to_string(pos0 + static_cast<std::int64_t>(i / group)) + " is not finite",
           WITCERT_ERROR_NON_FINITE);
  }
}

// One query position's attention over [begin, end), end − 1 its position.
void attend_range(witcert_cache* c, int layer, int kv_head, const float* q, int group, std::int64_t begin,
                  std::int64_t end, float* out, witcert_cell* cells) {
  check_attend(*c, layer, kv_head, q, group, end - 1, 1, out);
  if (!(begin >= 0 && begin < end))
    refuse("begin " + std::to_string(begin) + " is outside [0, end = " + std::to_string(end) + ")",
           WITCERT_ERROR_OUT_OF_RANGE);
  c->cells.cells_.clear();
  c->cache.kv->attend(layer, kv_head, q, group, begin, end, out);
  serve_cells(*c, layer, kv_head, group, end - 1, 1, out, cells);
}

bool external(const engine::CacheOptions& o, formats::KvSide side) {
  const formats::KvFormat& f = side == formats::KvSide::key ? o.k_format : o.v_format;
  return o.certified && f == formats::KvFormat::external();
}

// A new report of the cells at positions ≥ first_pos (none for the plain cache, which has no meter),
// its τ the gate's where it certifies, else the defaults of the coverage figures.
void start_report(witcert_cache& c, std::int64_t first_pos) {
  c.cells.report = nullptr;
  c.cells.drained.clear();
  c.cells.report_from = first_pos;
  c.report.reset();
  if (!c.options.certified) return;
  const model::LlamaConfig& g = c.pool->geometry;
  const gate::Policy& gate = c.options.gate;
  const double tau_v = gate.on() ? gate.tau_v : engine::kDefaultCoverageTauV;
  c.report = std::make_unique<gate::Telemetry>(
      g.layers, g.heads,
      gate::Telemetry::Options{engine::coverage_tau(gate, std::nullopt), tau_v, c.options.bound, first_pos});
  c.cells.report = c.report.get();
}

}  // namespace

extern "C" {

int witcert_api_version(void) { return WITCERT_API_VERSION; }
const char* witcert_version(void) { return WITCERT_VERSION_STRING; }
const char* witcert_last_error(void) { return t_error.c_str(); }

const char* witcert_status_name(witcert_status status) {
  switch (status) {
    case WITCERT_OK: return "ok";
    case WITCERT_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case WITCERT_ERROR_INVALID_HANDLE: return "invalid handle";
    case WITCERT_ERROR_OUT_OF_RANGE: return "out of range";
    case WITCERT_ERROR_BUFFER_TOO_SMALL: return "buffer too small";
    case WITCERT_ERROR_IO: return "i/o error";
    case WITCERT_ERROR_NON_FINITE: return "non-finite activations";
    case WITCERT_ERROR_INTERNAL: return "internal error";
    default: break;
  }
  return "unknown status";
}

// ---- Level 1 -------------------------------------------------------------------------------

witcert_status witcert_meter_logits(const double* z, const double* c, size_t n, witcert_bounds* out) {
  return guarded(__func__, [&] {
    not_null(z, "z");
    not_null(c, "c");
    not_null(out, "out");
    require(n >= 1, "n must be at least 1");
    *out = meter_logits_row({z, n}, {c, n});
  });
}

witcert_status witcert_meter_probs(const double* p_tilde, const double* c, size_t n, witcert_bounds* out) {
  return guarded(__func__, [&] {
    not_null(p_tilde, "p_tilde");
    not_null(c, "c");
    not_null(out, "out");
    require(n >= 1, "n must be at least 1");
    *out = meter_probs_row({p_tilde, n}, {c, n});
  });
}

witcert_status witcert_meter_tanh(double c_max, double* tanh_bound, double* tanh_half_bound) {
  return guarded(__func__, [&] {
    require(!std::isnan(c_max) && c_max >= 0.0, "c_max must be >= 0 (not NaN)");
    require(tanh_bound || tanh_half_bound, "tanh_bound and tanh_half_bound are both NULL");
    if (tanh_bound) *tanh_bound = cert::tanh_shape(c_max);
    if (tanh_half_bound) *tanh_half_bound = cert::tanh_half_shape(c_max);
  });
}

witcert_status witcert_meter_log_domain(double log_a, double log_a_minus, double* eform, double* two_sided) {
  return guarded(__func__, [&] {
    require(!std::isnan(log_a) && log_a >= 0.0, "log_a must be >= 0 (A >= 1 for c >= 0), not NaN");
    require(!std::isnan(log_a_minus) && log_a_minus <= 0.0 && log_a_minus != -HUGE_VAL,
            "log_a_minus must be finite and <= 0 (A- <= 1 for c >= 0)");
    require(eform || two_sided, "eform and two_sided are both NULL");
    if (eform) *eform = cert::eform_raw(log_a);
    if (two_sided) *two_sided = cert::two_sided_raw(log_a, log_a_minus);
  });
}

witcert_status witcert_bounds_meter(const witcert_bounds* b, witcert_bound_shape shape, double* meter) {
  return guarded(__func__, [&] {
    not_null(b, "b");
    not_null(meter, "meter");
    require(shape >= WITCERT_BOUND_EFORM && shape <= WITCERT_BOUND_MIN, "shape is not a witcert_bound_shape");
    // Every field is a bound (+inf: no guarantee) or a meter: NaN or a negative value is none.
    const struct {
      const char* name;
      double value;
    } fields[] = {{"b->eform", b->eform}, {"b->two_sided", b->two_sided}, {"b->retention", b->retention},
                  {"b->tanh", b->tanh},   {"b->tanh_half", b->tanh_half}, {"b->raw", b->raw},
                  {"b->meter", b->meter}};
    for (const auto& f : fields)
      if (!(f.value >= 0.0))
        refuse(std::string(f.name) + " is " + show(f.value) + ", not a bound (>= 0, not NaN)");
    const cert::Bounds x{b->eform, b->two_sided, b->retention, b->tanh, b->tanh_half};
    *meter = x.meter(static_cast<cert::BoundShape>(shape));
  });
}

witcert_status witcert_true_tv(const double* p_tilde, const double* eps, size_t n, double* tv) {
  return guarded(__func__, [&] {
    not_null(p_tilde, "p_tilde");
    not_null(eps, "eps");
    not_null(tv, "tv");
    require(n >= 1, "n must be at least 1");
    check_probabilities(p_tilde, n);
    check_values(eps, n, "eps", false, false);
    *tv = cert::true_tv({p_tilde, n}, {eps, n});
  });
}

// ---- Level 2 -------------------------------------------------------------------------------

witcert_status witcert_witness(int d, int bands, witcert_rope_layout layout, const float* k_hat, const float* k,
                               uint16_t* witness) {
  return guarded(__func__, [&] {
    check_d(d);
    const cert::BandLayout bl(d, bands, rope(layout));
    not_null(k_hat, "k_hat");
    not_null(k, "k");
    not_null(witness, "witness");
    const std::size_t n = static_cast<std::size_t>(d);
    witness_row(bl, {k_hat, n}, {k, n}, {witness, static_cast<std::size_t>(bands)});
  });
}

witcert_status witcert_tier_a_bounds(int d, int bands, witcert_rope_layout layout, const float* q,
                                     const uint16_t* witnesses, size_t n_tokens, double sm, double* c) {
  return guarded(__func__, [&] {
    check_d(d);
    const cert::BandLayout bl(d, bands, rope(layout));
    not_null(q, "q");
    not_null(witnesses, "witnesses");
    not_null(c, "c");
    require(n_tokens >= 1, "n_tokens must be at least 1");
    require(std::isfinite(sm) && sm > 0.0, "sm must be finite and > 0");
    check_activations(q, static_cast<std::size_t>(d), "q");
    check_f16(witnesses, n_tokens * static_cast<std::size_t>(bands), "witnesses", true, true);
    std::vector<double> q_norm;
    tier_a_row(bl, {q, static_cast<std::size_t>(d)}, witnesses, n_tokens, sm, q_norm, c);
  });
}

witcert_status witcert_dither_values(uint64_t seed, uint32_t layer, uint32_t kv_head, uint32_t slot, float* xi,
                                     size_t d) {
  return guarded(__func__, [&] {
    not_null(xi, "xi");
    require(d >= 1, "d must be at least 1");
    formats::dither_values(formats::DitherStream{seed, layer, kv_head}, slot, {xi, d});
  });
}

witcert_status witcert_dither_encode(const float* x, const float* xi, const uint8_t* outlier, size_t d, int group,
                                     int8_t* codes, uint16_t* scales, uint16_t* outlier_values, size_t n_outliers) {
  return guarded(__func__, [&] {
    not_null(x, "x");
    not_null(xi, "xi");
    not_null(codes, "codes");
    not_null(scales, "scales");
    const std::vector<std::uint8_t> mask = dither_layout(d, group, outlier, outlier_values, n_outliers);
    check_activations(x, d, "x");
    check_dither(xi, d);
    formats::encode_dither(8, {x, d}, {xi, d}, mask, group, {codes, d}, {scales, d / static_cast<std::size_t>(group)},
                              {outlier_values, n_outliers});
  });
}

witcert_status witcert_dither_decode(const int8_t* codes, const uint16_t* scales, const float* xi,
                                     const uint8_t* outlier, const uint16_t* outlier_values, size_t n_outliers,
                                     size_t d, int group, float* out) {
  return guarded(__func__, [&] {
    not_null(codes, "codes");
    not_null(scales, "scales");
    not_null(xi, "xi");
    not_null(out, "out");
    const std::vector<std::uint8_t> mask = dither_layout(d, group, outlier, outlier_values, n_outliers);
    check_f16(scales, d / static_cast<std::size_t>(group), "scales", true, false);
    check_f16(outlier_values, n_outliers, "outlier_values", false, false);
    check_dither(xi, d);
    formats::decode_dither({codes, d}, {scales, d / static_cast<std::size_t>(group)}, {xi, d}, mask,
                              {outlier_values, n_outliers}, group, {out, d});
  });
}

witcert_status witcert_delta_loc(double delta_req, long layers, long q_heads, long steps, double* delta_loc) {
  return guarded(__func__, [&] {
    not_null(delta_loc, "delta_loc");
    *delta_loc = cert::delta_loc(delta_req, layers, q_heads, steps);
  });
}

witcert_status witcert_dither_radius(const float* q, const uint16_t* scales, const uint8_t* outlier, size_t d,
                                     int group, double sm, long n_tokens, double delta_loc, double* u) {
  return guarded(__func__, [&] {
    not_null(q, "q");
    not_null(scales, "scales");
    not_null(u, "u");
    check_group(d, group);
    check_activations(q, d, "q");
    require(std::isfinite(sm) && sm > 0.0, "sm must be finite and > 0");
    require(n_tokens >= 1, "n_tokens must be at least 1");
    require(delta_loc > 0.0 && delta_loc < 1.0, "delta_loc must be in (0, 1)");
    std::size_t ones = 0;
    const std::vector<std::uint8_t> mask = outlier_mask(outlier, d, &ones);
    const std::size_t groups = d / static_cast<std::size_t>(group);
    check_f16(scales, groups, "scales", true, false);
    const double varsigma2 = cert::dither_variance_proxy({q, d}, {scales, groups}, mask, group, sm);
    *u = cert::subgaussian_radius(varsigma2, n_tokens, delta_loc, static_cast<int>(d - ones));
  });
}

witcert_status witcert_value_bound(double tv_k, double v_max_norm, double weighted_rho, double* bound,
                                   double* v_meter) {
  return guarded(__func__, [&] {
    require(!std::isnan(tv_k) && tv_k >= 0.0, "tv_k must be >= 0 (not NaN)");
    // An infinite norm would make the V meter 0, a certificate for values that are not numbers.
    require(std::isfinite(v_max_norm) && v_max_norm >= 0.0, "v_max_norm must be finite and >= 0");
    require(!std::isnan(weighted_rho) && weighted_rho >= 0.0, "weighted_rho must be >= 0 (not NaN)");
    require(bound || v_meter, "bound and v_meter are both NULL");
    if (bound) *bound = cert::value_output_bound(tv_k, v_max_norm, weighted_rho);
    if (v_meter) *v_meter = cert::value_meter(weighted_rho, v_max_norm);
  });
}

// ---- Level 3 -------------------------------------------------------------------------------

witcert_status witcert_pool_create(const witcert_geometry* g, const char* options_json, int64_t pool_bytes,
                                   witcert_pool** out) {
  return guarded(__func__, [&] {
    not_null(g, "g");
    not_null(out, "pool");
    *out = nullptr;
    require(g->layers >= 1 && g->layers <= 4096, "g->layers must be in [1, 4096]");
    require(g->kv_heads >= 1 && g->kv_heads <= 4096, "g->kv_heads must be in [1, 4096]");
    require(g->q_heads >= g->kv_heads && g->q_heads % g->kv_heads == 0 && g->q_heads <= 65536,
            "g->q_heads must be a multiple of g->kv_heads");
    require(g->head_dim >= 2 && g->head_dim <= 4096 && g->head_dim % 2 == 0, "g->head_dim must be even, in [2, 4096]");
    require(g->capacity >= 1 && g->capacity <= (std::int64_t{1} << 24), "g->capacity must be in [1, 2^24]");
    require(pool_bytes >= 0, "pool_bytes is negative");
    auto p = std::make_unique<witcert_pool>();
    p->geometry.arch = "c-api";
    p->geometry.layers = g->layers;
    p->geometry.heads = g->q_heads;
    p->geometry.kv_heads = g->kv_heads;
    p->geometry.head_dim = g->head_dim;
    p->geometry.context = g->capacity;
    p->geometry.rope_layout = rope(g->rope_layout);
    p->capacity = g->capacity;
    p->options = parse_object(options_json, "options_json");
    p->cache = engine::CacheOptions::from_json(p->options, true);
    std::int64_t pages = (g->capacity + p->cache.page_size - 1) / p->cache.page_size;
    if (pool_bytes > 0) pages = engine::size_pool(p->geometry, g->capacity, p->cache, pool_bytes, 1).pages;
    p->pool = engine::make_pool(p->geometry, g->capacity, pages, p->cache, false);
    register_handle(p.get());
    *out = p.release();
  });
}

witcert_status witcert_pool_stats_get(const witcert_pool* pool, witcert_pool_stats* stats) {
  return guarded(__func__, [&] {
    const witcert_pool* p = live(pool, "pool");
    not_null(stats, "stats");
    *stats = {p->pool.pages(), p->pool.free_pages(), p->pool.page_size(), p->pool.bytes(), p->pool.backing_bytes()};
  });
}

void witcert_pool_free(witcert_pool* pool) {
  const witcert_status s = guarded(__func__, [&] {
    if (!pool) return;
    witcert_pool* p = live(pool, "pool");
    if (p->caches.load() != 0)
      refuse(std::to_string(p->caches.load()) + " caches over the pool are not freed");
    unregister_handle(p);
    delete p;
  });
  (void)s;  // the message stays in witcert_last_error()
}

witcert_status witcert_cache_create(witcert_pool* pool, const char* policy_json, int64_t decode_budget,
                                    witcert_cache** out) {
  return guarded(__func__, [&] {
    witcert_pool* p = live(pool, "pool");
    not_null(out, "cache");
    *out = nullptr;
    require(decode_budget >= 1 && decode_budget <= (std::int64_t{1} << 30), "decode_budget must be in [1, 2^30]");
    const nlohmann::json policy = parse_object(policy_json, "policy_json");
    nlohmann::json merged = p->options;
    for (const auto& item : policy.items()) {
      const std::string& key = item.key();
      const auto& policy_keys = engine::CacheOptions::kPolicyKeys;
      if (key != "check_soundness" && std::find(std::begin(policy_keys), std::end(policy_keys), key) == std::end(policy_keys)) {
        std::string settings;
        for (const char* k : policy_keys) settings += std::string(k) + ", ";
        refuse("policy_json: '" + key + "' is not a sequence's setting (" + settings +
               "check_soundness); the pool fixes the formats");
      }
      merged[key] = item.value();
    }
    const engine::CacheOptions opts = engine::CacheOptions::from_json(merged, true);
    auto c = std::make_unique<witcert_cache>();
    c->pool = p;
    std::vector<gate::MeterSink*> sinks;
    if (opts.certified) sinks.push_back(&c->cells);
    c->cache = engine::make_sequence_cache(p->pool, p->geometry, decode_budget, opts, sinks);
    c->options = opts;
    start_report(*c, 0);
    c->written.assign(static_cast<std::size_t>(p->geometry.layers) * p->geometry.kv_heads, 0);
    p->caches += 1;
    register_handle(c.get());
    *out = c.release();
  });
}

witcert_status witcert_cache_write(witcert_cache* cache, int layer, int kv_head, int64_t pos, const float* k,
                                   const float* v) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    const model::LlamaConfig& g = c->pool->geometry;
    if (!(layer >= 0 && layer < g.layers))
      refuse("layer " + std::to_string(layer) + " is outside [0, " + std::to_string(g.layers) + ")");
    if (!(kv_head >= 0 && kv_head < g.kv_heads))
      refuse("kv_head " + std::to_string(kv_head) + " is outside [0, " + std::to_string(g.kv_heads) + ")");
    if (!(pos >= 0 && pos < c->pool->capacity))
      refuse("pos " + std::to_string(pos) + " is outside the capacity [0, " + std::to_string(c->pool->capacity)
             + ")", WITCERT_ERROR_OUT_OF_RANGE);
    not_null(k, "k");
    not_null(v, "v");
    if (external(c->options, formats::KvSide::key) || external(c->options, formats::KvSide::value))
      refuse("an external format is written with its reconstructions: witcert_cache_write_rows with k_hat, v_hat");
    const std::size_t d = static_cast<std::size_t>(g.head_dim);
    check_activations(k, d, "k");
    check_activations(v, d, "v");
    std::int64_t& written = c->written[static_cast<std::size_t>(layer) * g.kv_heads + kv_head];
    if (pos != written)
      refuse("positions of a (layer, kv_head) are written in order: expected pos " + std::to_string(written)
             + ", got " + std::to_string(pos));
    c->cache.kv->write(layer, kv_head, pos, k, v);
    written += 1;
  });
}

witcert_status witcert_cache_write_rows(witcert_cache* cache, int layer, int64_t pos0, int64_t tokens, const float* k,
                                        const float* v, const float* k_hat, const float* v_hat) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    const model::LlamaConfig& g = c->pool->geometry;
    if (!(layer >= 0 && layer < g.layers))
      refuse("layer " + std::to_string(layer) + " is outside [0, " + std::to_string(g.layers) + ")");
    require(tokens >= 0, "tokens is negative");
    if (!(pos0 >= 0 && tokens <= c->pool->capacity - pos0))
      refuse("positions [" + std::to_string(pos0) + ", " + std::to_string(pos0 + tokens) +
             ") are outside the capacity [0, " + std::to_string(c->pool->capacity) + ")", WITCERT_ERROR_OUT_OF_RANGE);
    not_null(k, "k");
    not_null(v, "v");
    const bool ext_k = external(c->options, formats::KvSide::key), ext_v = external(c->options, formats::KvSide::value);
    if (ext_k != (k_hat != nullptr))
      refuse(ext_k ? "k_hat is NULL: the key format is external" : "k_hat is given but the key format is not external");
    if (ext_v != (v_hat != nullptr))
      refuse(ext_v ? "v_hat is NULL: the value format is external"
                   : "v_hat is given but the value format is not external");
    const std::size_t d = static_cast<std::size_t>(g.head_dim), T = static_cast<std::size_t>(tokens);
    const std::size_t n = static_cast<std::size_t>(g.kv_heads) * T * d;
    const auto entry = [&](const char* name, std::size_t i, const std::string& what) {
      refuse(std::string(name) + "[" + std::to_string(i / (T * d)) + "][" + std::to_string(i / d % T) + "][" +
             std::to_string(i % d) + "] is " + what);
    };
    for (const auto& [x, name] : {std::pair{k, "k"}, std::pair{v, "v"}})
      for (std::size_t i = 0; i < n; ++i)
        if (!within_fp16(x[i])) entry(name, i, show(x[i]) + kNotWithinFp16);
    // A reconstruction may overflow (its witness is then +inf: no guarantee), never be NaN.
    for (const auto& [x, name] : {std::pair{k_hat, "k_hat"}, std::pair{v_hat, "v_hat"}})
      if (x)
        for (std::size_t i = 0; i < n; ++i)
          if (std::isnan(x[i])) entry(name, i, "NaN");
    for (int h = 0; h < g.kv_heads; ++h) {
      const std::int64_t written = c->written[static_cast<std::size_t>(layer) * g.kv_heads + h];
      if (pos0 != written)
        refuse("positions of a (layer, kv_head) are written in order: expected pos0 " + std::to_string(written) +
               " for kv_head " + std::to_string(h) + ", got " + std::to_string(pos0));
    }
    // A side's reconstruction of one row (empty where that side is not external).
    const auto hat = [&](const float* x, std::size_t off) {
      return x ? std::span<const float>(x + off, d) : std::span<const float>{};
    };
    for (int h = 0; h < g.kv_heads; ++h) {
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t off = (static_cast<std::size_t>(h) * T + t) * d;
        const formats::ExternalReconstruction hats(hat(k_hat, off), hat(v_hat, off));
        c->cache.kv->write(layer, h, pos0 + static_cast<std::int64_t>(t), k + off, v + off);
      }
      c->written[static_cast<std::size_t>(layer) * g.kv_heads + h] += tokens;
    }
  });
}

witcert_status witcert_cache_attend(witcert_cache* cache, int layer, int kv_head, const float* q, int group,
                                    int64_t n_ctx, float* out, witcert_cell* cells) {
  return guarded(__func__, [&] { attend_range(live(cache, "cache"), layer, kv_head, q, group, 0, n_ctx, out, cells); });
}

witcert_status witcert_cache_attend_range(witcert_cache* cache, int layer, int kv_head, const float* q, int group,
                                          int64_t begin, int64_t end, float* out, witcert_cell* cells) {
  return guarded(__func__,
                 [&] { attend_range(live(cache, "cache"), layer, kv_head, q, group, begin, end, out, cells); });
}

witcert_status witcert_cache_attend_causal(witcert_cache* cache, int layer, int kv_head, const float* q, int group,
                                           int64_t pos0, int64_t tokens, int64_t window, float* out,
                                           witcert_cell* cells) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    require(tokens >= 1, "tokens must be at least 1");
    require(pos0 >= 0, "pos0 is negative");
    require(window >= 0, "window must be >= 0 (0: none)");
    check_attend(*c, layer, kv_head, q, group, pos0, tokens, out);
    const std::int64_t row = static_cast<std::int64_t>(group) * c->pool->geometry.head_dim;
    c->cells.cells_.clear();
    c->cache.kv->attend_causal(layer, kv_head, q, row, group, pos0, tokens, window, out, row);
    serve_cells(*c, layer, kv_head, group, pos0, tokens, out, cells);
  });
}

witcert_status witcert_cache_stats_get(const witcert_cache* cache, witcert_cache_stats* stats) {
  return guarded(__func__, [&] {
    const witcert_cache* c = live(cache, "cache");
    not_null(stats, "stats");
    *stats = {0, 0, 0};
    if (c->cache.certified) {
      const kvcache::KvStore::PageInStats pi = c->cache.certified->store().page_in_stats();
      *stats = {pi.page_ins, pi.page_in_bytes, c->cache.certified->store().sequence().bytes()};
    }
  });
}

witcert_status witcert_cache_promote_all(witcert_cache* cache, int64_t at, int64_t* pages) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    if (!c->cache.certified || !c->options.gate.on()) refuse("the cache has no gate: nothing to promote into");
    require(at >= 0 && at < c->pool->capacity, "at is outside the cache's positions");
    const std::int64_t n = c->cache.certified->promote_all(at);
    if (pages) *pages = n;
  });
}

witcert_status witcert_cache_report_start(witcert_cache* cache, int64_t first_pos) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    if (!(first_pos >= 0 && first_pos <= c->pool->capacity))
      refuse("first_pos " + std::to_string(first_pos) + " is outside [0, " + std::to_string(c->pool->capacity) + "]");
    start_report(*c, first_pos);
  });
}

witcert_status witcert_cache_report(const witcert_cache* cache, char* json, size_t cap, size_t* needed) {
  return guarded(__func__, [&] {
    const witcert_cache* c = live(cache, "cache");
    not_null(needed, "needed");
    kvcache::KvStore::PageInStats pi;
    if (c->report) pi = c->cache.certified->store().page_in_stats();
    const std::string text = report_text(c->options, c->report.get(), pi.page_ins, pi.page_in_bytes);
    *needed = text.size() + 1;
    copy_text(text, json, cap, "report");
  });
}

void witcert_cache_free(witcert_cache* cache) {
  const witcert_status s = guarded(__func__, [&] {
    if (!cache) return;
    witcert_cache* c = live(cache, "cache");
    c->pool->caches -= 1;
    unregister_handle(c);
    delete c;
  });
  (void)s;
}

// ---- Level 4 -------------------------------------------------------------------------------

witcert_status witcert_engine_load(const char* gguf_path, int threads, witcert_engine** out) {
  return guarded(__func__, [&] {
    not_null(gguf_path, "gguf_path");
    not_null(out, "engine");
    *out = nullptr;
    if (!(threads >= 1 && threads <= 256))
      refuse("threads must be in [1, 256], got " + std::to_string(threads));
    auto e = std::make_unique<witcert_engine>();
    try {
      e->model = engine::Model::load(gguf_path);
    } catch (const std::runtime_error& err) {
      throw Refusal{WITCERT_ERROR_IO, err.what()};
    }
    e->threads = std::make_unique<ThreadPool>(threads);
    register_handle(e.get());
    *out = e.release();
  });
}

void witcert_engine_free(witcert_engine* engine) {
  const witcert_status s = guarded(__func__, [&] {
    if (!engine) return;
    witcert_engine* e = live(engine, "engine");
    unregister_handle(e);
    delete e;
  });
  (void)s;
}

witcert_status witcert_engine_tokenize(const witcert_engine* engine, const char* text, int chat, int32_t* tokens,
                                       size_t capacity, size_t* n) {
  return guarded(__func__, [&] {
    const witcert_engine* e = live(engine, "engine");
    not_null(text, "text");
    not_null(n, "n");
    require(tokens || capacity == 0, "tokens is NULL with a capacity");
    const std::vector<std::int32_t> ids = e->model.prompt_tokens(text, chat != 0);
    *n = ids.size();
    if (ids.size() > capacity)
      refuse("the text has " + std::to_string(ids.size()) + " tokens; the buffer holds "
             + std::to_string(capacity), WITCERT_ERROR_BUFFER_TOO_SMALL);
    std::copy(ids.begin(), ids.end(), tokens);
  });
}

namespace {

// The cells of the forward pass behind each generated token: counted from the calling threads
// with atomics, read and reset between passes.
class StepMeter final : public gate::MeterSink {
 public:
  StepMeter(std::int64_t first_pos, double tau_k, double tau_v) : first_pos_(first_pos), tau_k_(tau_k), tau_v_(tau_v) {}
  void record(std::span<const gate::MeterCell> cells) override {
    std::int64_t n = 0, ok_k = 0, ok_v = 0, repaired = 0;
    double raw = 0.0, meter = 0.0;
    for (const gate::MeterCell& c : cells) {
      if (c.pos < first_pos_) continue;
      ++n;
      ok_k += c.meter <= tau_k_;
      ok_v += c.v_meter <= tau_v_;
      repaired += c.repaired;
      raw = std::max(raw, std::isnan(c.eform_raw) ? HUGE_VAL : c.eform_raw);
      meter = std::max(meter, std::isnan(c.meter) ? 1.0 : c.meter);
    }
    if (n == 0) return;
    cells_ += n;
    ok_k_ += ok_k;
    ok_v_ += ok_v;
    repaired_ += repaired;
    raise(raw_max_, raw);
    raise(meter_max_, meter);
  }
  // This step's figures; the next step counts from zero, and from position `next_first`.
  witcert_step_meter take(std::int64_t next_first) {
    const std::int64_t n = cells_.exchange(0);
    witcert_step_meter m{n,
                         n > 0 ? static_cast<double>(ok_k_.exchange(0)) / static_cast<double>(n) : 1.0,
                         n > 0 ? static_cast<double>(ok_v_.exchange(0)) / static_cast<double>(n) : 1.0,
                         raw_max_.exchange(0.0), meter_max_.exchange(0.0), repaired_.exchange(0)};
    first_pos_ = next_first;
    return m;
  }

 private:
  static void raise(std::atomic<double>& a, double v) {
    double cur = a.load();
    while (v > cur && !a.compare_exchange_weak(cur, v)) {
    }
  }
  std::int64_t first_pos_;
  double tau_k_, tau_v_;
  std::atomic<std::int64_t> cells_{0}, ok_k_{0}, ok_v_{0}, repaired_{0};
  std::atomic<double> raw_max_{0.0}, meter_max_{0.0};
};

}  // namespace

witcert_status witcert_engine_generate(witcert_engine* engine, const char* prompt, const char* request_json,
                                       witcert_token_callback on_token, void* user, witcert_generation* result,
                                       char* text, size_t text_capacity, size_t* text_needed) {
  return guarded(__func__, [&] {
    witcert_engine* e = live(engine, "engine");
    not_null(prompt, "prompt");
    not_null(result, "result");
    require(text || text_capacity == 0, "text is NULL with a capacity");
    *result = witcert_generation{};
    if (text_capacity > 0) text[0] = '\0';
    // The request's keys go to RequestOptions, the rest to the cache's options.
    const nlohmann::json all = parse_object(request_json, "request_json");
    nlohmann::json req = {{"prompt", prompt}}, cache = nlohmann::json::object();
    for (const auto& item : all.items()) {
      static const char* request_keys[] = {"chat", "max_tokens", "temperature", "top_p", "top_k", "seed", "coverage_tau",
                                           "coverage_tau_v"};
      const bool is_request = std::any_of(std::begin(request_keys), std::end(request_keys),
                                          [&](const char* k) { return item.key() == k; });
      require(item.key() != "prompt", "request_json: the prompt is the prompt argument");
      (is_request ? req : cache)[item.key()] = item.value();
    }
    engine::RequestOptions ro = engine::RequestOptions::from_json(req);
    const engine::CacheOptions co = engine::CacheOptions::from_json(cache);
    // The coverage τ by the rule of every entry point: the one asked for, else a certified gate's τ_K.
    ro.coverage_tau = engine::coverage_tau(
        co.gate, req.contains("coverage_tau") ? std::optional<double>(ro.coverage_tau) : std::nullopt);
    const std::vector<std::int32_t> tokens = e->model.checked_prompt(ro.prompt, ro.chat);
    const std::int64_t first = static_cast<std::int64_t>(tokens.size());
    StepMeter step(first - 1, ro.coverage_tau, ro.coverage_tau_v);
    engine::BatchRequest request;
    request.prompt = tokens;
    request.max_tokens = ro.max_new_tokens;
    request.sampler = ro.sampler;
    request.cache = co;
    request.coverage_tau = ro.coverage_tau;
    request.coverage_tau_v = ro.coverage_tau_v;
    request.sinks = {&step};
    std::string out;
    std::int64_t generated = 0;
    const engine::BatchResult r = engine::run_alone(
        *e->model.model, *e->threads, request, e->model.stop_tokens(), [&](std::int32_t t, std::span<const float>) {
          const std::string piece = e->model.tokenizer->token_piece(t);
          out += piece;
          // The token's step: the forward pass at the position before it; the next one starts after.
          const witcert_step_meter m = step.take(first + generated++);
          return on_token && on_token(user, t, piece.c_str(), co.certified ? &m : nullptr) != 0;
        });
    result->prompt_tokens = r.prompt_tokens;
    result->completion_tokens = static_cast<std::int64_t>(r.tokens.size());
    result->stopped = r.finish == engine::Finish::stop;
    result->cancelled = r.finish == engine::Finish::cancelled;
    static_assert(static_cast<int>(gate::Verdict::certified) == WITCERT_VERDICT_CERTIFIED &&
                  static_cast<int>(gate::Verdict::repaired) == WITCERT_VERDICT_REPAIRED &&
                  static_cast<int>(gate::Verdict::at_risk) == WITCERT_VERDICT_AT_RISK &&
                  static_cast<int>(gate::Verdict::unmetered) == WITCERT_VERDICT_UNMETERED);
    const std::string reason = r.has_meter ? r.meter.reason() : "the exact fp16 cache has no meter: nothing is quantized";
    result->verdict = static_cast<witcert_verdict>(r.has_meter ? r.meter.verdict() : gate::Verdict::unmetered);
    const std::size_t cut = std::min(reason.size(), sizeof result->reason - 1);
    std::memcpy(result->reason, reason.data(), cut);
    result->reason[cut] = '\0';
    if (r.has_meter) {
      const gate::TelemetrySummary& s = r.meter;
      result->has_meter = 1;
      result->cells = s.cells;
      result->coverage_k = s.coverage.k;
      result->coverage_v = s.coverage.v;
      result->raw_median = s.raw_p50;
      result->raw_p90 = s.raw_p90;
      result->raw_max = s.raw_max;
      result->page_ins = r.page_ins;
      result->page_in_bytes = r.page_in_bytes;
    }
    if (text_needed) *text_needed = out.size() + 1;
    if (!text) return;
    copy_text(out, text, text_capacity, "text");
  });
}

}  // extern "C"
