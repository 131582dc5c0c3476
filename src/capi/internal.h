// What every C API entry point shares: the exception boundary that turns a throw into a status and
// the thread's message, the argument checks whose messages name the argument, the handle registry,
// and the handles' own structs.
#pragma once

#include "witcert/witcert.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "base/fp16.h"
#include "base/thread_pool.h"
#include "cert/meter.h"
#include "cert/witness.h"
#include "engine/model.h"
#include "engine/options.h"
#include "engine/batch.h"
#include "gate/meter_cell.h"
#include "gate/telemetry.h"
#include "kvcache/page_pool.h"
#include "model/gguf.h"
#include "model/llama.h"

namespace witcert::capi {

inline thread_local std::string t_error;

// A failed check: the status and the message naming the argument.
struct Refusal {
  witcert_status status;
  std::string message;
};

[[noreturn]] inline void refuse(std::string message, witcert_status status = WITCERT_ERROR_INVALID_ARGUMENT) {
  throw Refusal{status, std::move(message)};
}

// A check whose message is a literal, so that a passing check builds nothing (the per-token entry
// points run their checks on every call); a formatted message is built under `if (!ok) refuse(…)`.
inline void require(bool ok, const char* message, witcert_status status = WITCERT_ERROR_INVALID_ARGUMENT) {
  if (!ok) refuse(message, status);
}

// Runs f, turning every exception into a status; the error message is cleared on success.
template <class F>
inline witcert_status guarded(const char* fn, F&& f) {
  const auto fail = [&](witcert_status s, const std::string& what) {
    t_error = std::string(fn) + ": " + what;
    return s;
  };
  try {
    f();
    t_error.clear();
    return WITCERT_OK;
  } catch (const Refusal& r) {
    return fail(r.status, r.message);
  } catch (const kvcache::PoolExhausted& e) {
    return fail(WITCERT_ERROR_OUT_OF_RANGE, e.what());
  } catch (const model::NonFiniteError& e) {
    return fail(WITCERT_ERROR_NON_FINITE, e.what());
  } catch (const model::GgufError& e) {
    return fail(WITCERT_ERROR_IO, e.what());
  } catch (const std::invalid_argument& e) {
    return fail(WITCERT_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return fail(WITCERT_ERROR_OUT_OF_RANGE, e.what());
  } catch (const nlohmann::json::exception& e) {
    return fail(WITCERT_ERROR_INVALID_ARGUMENT, std::string("malformed JSON: ") + e.what());
  } catch (const std::bad_alloc&) {
    return fail(WITCERT_ERROR_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return fail(WITCERT_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(WITCERT_ERROR_INTERNAL, "unknown exception");
  }
}

inline void not_null(const void* p, const char* name) {
  if (!p) refuse(std::string(name) + " is NULL");
}

// x as a message shows it: "NaN", "+inf", "-inf", "100000".
inline std::string show(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "+inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Refuses entry i of array `name`: "name[i] is <what>". Callers build `what` only on failure.
[[noreturn]] inline void refuse_entry(const char* name, std::size_t i, const std::string& what) {
  throw Refusal{WITCERT_ERROR_INVALID_ARGUMENT, std::string(name) + "[" + std::to_string(i) + "] is " + what};
}

// n values, none NaN; finite unless allowed otherwise.
inline void check_values(const double* v, std::size_t n, const char* name, bool allow_pos_inf, bool allow_neg_inf) {
  for (std::size_t i = 0; i < n; ++i) {
    const double x = v[i];
    if (std::isnan(x) || (x == HUGE_VAL && !allow_pos_inf) || (x == -HUGE_VAL && !allow_neg_inf))
      refuse_entry(name, i, show(x));
  }
}

// Keys, values, queries and the dither's inputs: the library keeps them as fp16 (the cache, the exact
// tier, outlier channels) or bounds errors in their fp16 units, so each must be finite and within
// fp16's range; anything else would come back as NaN outputs or an infinite witness.
inline bool within_fp16(float x) { return std::fabs(x) <= 65504.0f; }  // false for NaN too
inline const char* const kNotWithinFp16 = ", not a finite value within fp16's range (|x| <= 65504)";

inline void check_activations(const float* v, std::size_t n, const char* name) {
  for (std::size_t i = 0; i < n; ++i)
    if (!within_fp16(v[i])) refuse_entry(name, i, show(v[i]) + kNotWithinFp16);
}

// n fp16 values (IEEE binary16 bits): never NaN; non-negative when they are norms or scales; +inf
// only where it means "no guarantee" (a witness of an overflowed key).
inline void check_f16(const std::uint16_t* v, std::size_t n, const char* name, bool nonnegative, bool allow_pos_inf) {
  for (std::size_t i = 0; i < n; ++i) {
    const double x = fp16_to_double(v[i]);
    if (std::isnan(x)) refuse_entry(name, i, "NaN");
    if (nonnegative && x < 0.0) refuse_entry(name, i, "negative (" + show(x) + ")");
    if (!std::isfinite(x) && !(allow_pos_inf && x > 0.0)) refuse_entry(name, i, show(x) + ", not finite");
  }
}

inline void check_bounds_c(const double* c, std::size_t n) {
  check_values(c, n, "c", true, false);
  for (std::size_t i = 0; i < n; ++i)
    if (c[i] < 0.0) refuse_entry("c", i, "negative (" + show(c[i]) + ")");
}

// A distribution p̃: each entry in [0, 1], the sum 1 within 1e-9.
inline void check_probabilities(const double* p, std::size_t n) {
  double total = 0.0;
  for (std::size_t t = 0; t < n; ++t) {
    if (!(p[t] >= 0.0 && p[t] <= 1.0)) refuse_entry("p_tilde", t, show(p[t]) + ", outside [0, 1]");
    total += p[t];
  }
  if (!(std::fabs(total - 1.0) <= 1e-9))
    refuse("p_tilde sums to " + std::to_string(total) + ", not 1 within 1e-9");
}

inline witcert_bounds to_c(const cert::Bounds& b) {
  return {b.eform, b.two_sided, b.retention, b.tanh, b.tanh_half, b.eform, b.meter()};
}

inline cert::RopeLayout rope(witcert_rope_layout layout) {
  require(layout == WITCERT_ROPE_INTERLEAVED || layout == WITCERT_ROPE_NEOX,
          "layout is neither WITCERT_ROPE_INTERLEAVED nor WITCERT_ROPE_NEOX");
  return layout == WITCERT_ROPE_NEOX ? cert::RopeLayout::neox : cert::RopeLayout::interleaved;
}

// The outlier mask as the quantizer takes it (all zero for NULL) and the number of ones.
inline std::vector<std::uint8_t> outlier_mask(const std::uint8_t* outlier, std::size_t d, std::size_t* ones) {
  std::vector<std::uint8_t> m(d, 0);
  *ones = 0;
  if (outlier)
    for (std::size_t i = 0; i < d; ++i) {
      if (outlier[i] > 1)
        refuse("outlier[" + std::to_string(i) + "] is neither 0 nor 1");
      m[i] = outlier[i];
      *ones += outlier[i];
    }
  return m;
}

inline void check_group(std::size_t d, int group) {
  if (!(d >= 1 && d <= 1 << 16))
    refuse("d must be in [1, 65536], got " + std::to_string(d));
  if (!(group >= 1 && d % static_cast<std::size_t>(group) == 0))
    refuse("group must be positive and divide d (" + std::to_string(d) + "), got " + std::to_string(group));
}

// The outlier mask of a dither-int8 token after checking the shape: group divides d, the mask
// holds 0s and 1s, n_outliers counts its 1s and outlier_values is there when any.
inline std::vector<std::uint8_t> dither_layout(std::size_t d, int group, const std::uint8_t* outlier,
                                        const void* outlier_values, std::size_t n_outliers) {
  check_group(d, group);
  std::size_t ones = 0;
  std::vector<std::uint8_t> mask = outlier_mask(outlier, d, &ones);
  if (n_outliers != ones)
    refuse("n_outliers is " + std::to_string(n_outliers) + ", the mask has " + std::to_string(ones)
           + " outlier channels");
  require(ones == 0 || outlier_values, "outlier_values is NULL");
  return mask;
}

// A dither: every value on [−½, ½).
inline void check_dither(const float* xi, std::size_t d) {
  for (std::size_t i = 0; i < d; ++i)
    if (!(xi[i] >= -0.5f && xi[i] < 0.5f))
      refuse("xi[" + std::to_string(i) + "] is outside [-1/2, 1/2)");
}

// Every live handle, so that a freed or foreign pointer is refused without being read (its
// address may be reused by a later handle, which then reads as live).
inline std::mutex g_handles_mu;
inline std::unordered_set<const void*> g_handles;

inline void register_handle(const void* h) {
  std::lock_guard lock(g_handles_mu);
  g_handles.insert(h);
}

inline void unregister_handle(const void* h) {
  std::lock_guard lock(g_handles_mu);
  g_handles.erase(h);
}

template <class H>
inline H* live(H* h, const char* name) {
  if (!h)
    refuse(std::string(name) + " is NULL");
  std::lock_guard lock(g_handles_mu);
  if (g_handles.count(h) != 1)
    refuse(std::string(name) + " is not a live handle (freed, or not one of ours)", WITCERT_ERROR_INVALID_HANDLE);
  return h;
}

// A JSON object from the caller, parsed under engine::parse_json's limits (nesting depth, size), so
// that no text can exhaust the stack.
inline nlohmann::json parse_object(const char* text, const char* name) {
  if (!text) return nlohmann::json::object();
  nlohmann::json j;
  try {
    j = engine::parse_json(text);
  } catch (const std::invalid_argument& e) {
    throw Refusal{WITCERT_ERROR_INVALID_ARGUMENT, std::string(name) + ": " + e.what()};
  }
  if (!j.is_object())
    refuse(std::string(name) + " must be a JSON object");
  return j;
}

// Copies s and its NUL into buf (cap bytes), or refuses with WITCERT_ERROR_BUFFER_TOO_SMALL.
inline void copy_text(const std::string& s, char* buf, std::size_t cap, const char* what) {
  if (!buf || s.size() >= cap)
    refuse(std::string("the ") + what + " has " + std::to_string(s.size()) + " bytes and its NUL; the buffer holds " +
               std::to_string(cap),
           WITCERT_ERROR_BUFFER_TOO_SMALL);
  std::memcpy(buf, s.c_str(), s.size() + 1);
}

// A report's `witcert` object as JSON text: the summary of `telemetry` (null: the exact cache, which
// has no meter) with the gate's page-ins (witcert_report.cc).
std::string report_text(const engine::CacheOptions& options, const gate::Telemetry* telemetry, std::int64_t page_ins,
                        std::int64_t page_in_bytes);

// Runs f; a refusal it throws comes back with where() and ": " before its message (a batch's row).
template <class F, class Where>
void located(F&& f, Where&& where) {
  try {
    f();
  } catch (const Refusal& r) {
    throw Refusal{r.status, where() + ": " + r.message};
  }
}

inline void check_d(int d) {
  if (!(d >= 2 && d <= 65536)) refuse("d must be in [2, 65536], got " + std::to_string(d));
}

// The bodies the one-step calls and their batches share, checks included, so that a batch's row is
// its one-step call bit for bit.
inline witcert_bounds meter_logits_row(std::span<const double> z, std::span<const double> c) {
  check_values(z.data(), z.size(), "z", false, true);
  require(std::any_of(z.begin(), z.end(), [](double x) { return std::isfinite(x); }), "z has no finite logit");
  check_bounds_c(c.data(), c.size());
  return to_c(cert::evaluate_logits(z, c));
}

inline witcert_bounds meter_probs_row(std::span<const double> p_tilde, std::span<const double> c) {
  check_probabilities(p_tilde.data(), p_tilde.size());
  check_bounds_c(c.data(), c.size());
  return to_c(cert::evaluate(p_tilde, c));
}

// k_hat may hold an infinity or a value beyond fp16 (a scheme that overflowed): its witness is then
// +inf, which reads as no guarantee; never NaN.
inline void witness_row(const cert::BandLayout& bl, std::span<const float> k_hat, std::span<const float> k,
                        std::span<f16> witness) {
  check_activations(k.data(), k.size(), "k");
  for (std::size_t i = 0; i < k_hat.size(); ++i)
    if (std::isnan(k_hat[i])) refuse_entry("k_hat", i, "NaN");
  cert::tier_a_witness(bl, k_hat, k, witness);
}

// The bounds c of n_tokens keys for query q from their witnesses (both checked by the caller).
inline void tier_a_row(const cert::BandLayout& bl, std::span<const float> q, const f16* witnesses,
                       std::size_t n_tokens, double sm, std::vector<double>& q_norm, double* c) {
  const std::size_t nb = static_cast<std::size_t>(bl.bands);
  q_norm.resize(nb);
  cert::band_norms(bl, q, q_norm);
  for (std::size_t t = 0; t < n_tokens; ++t) c[t] = cert::tier_a_c(q_norm, {witnesses + t * nb, nb}, sm);
}

// Collects the cells one attend call serves (one handle is used by one thread at a time; the
// cache calls record from the calling thread for a single attend).
class LastCells final : public gate::MeterSink {
 public:
  void record(std::span<const gate::MeterCell> cells) override {
    cells_.insert(cells_.end(), cells.begin(), cells.end());
    if (!report) return;
    report->record(cells);
    if (keep)
      for (const gate::MeterCell& c : cells)
        if (c.pos >= report_from) drained.push_back(c);
  }
  std::vector<gate::MeterCell> cells_;
  gate::MeterSink* report = nullptr;  // the request's report, once started
  std::int64_t report_from = 0;       // its first position
  bool keep = false;                  // witcert_cache_keep_cells
  std::vector<gate::MeterCell> drained;  // the report's cells since it started or was last drained
};

}  // namespace witcert::capi

// The handles the C API hands out.
struct witcert_pool {
  witcert::model::LlamaConfig geometry;  // the cache's shape only: layers, heads, kv_heads, head_dim, rope
  std::int64_t capacity = 0;
  nlohmann::json options;  // as given, for the sequences' own policies
  witcert::engine::CacheOptions cache;
  witcert::engine::Pool pool;
  std::atomic<int> caches{0};
};

struct witcert_cache {
  witcert_pool* pool = nullptr;
  witcert::capi::LastCells cells;
  witcert::engine::Cache cache;
  witcert::engine::CacheOptions options;  // the pool's formats with this sequence's policy
  std::unique_ptr<witcert::gate::Telemetry> report;  // witcert_cache_report_start's summary
  std::vector<std::int64_t> written;  // positions written per (layer, KV head): [0, written) hold data
};

struct witcert_engine {
  witcert::engine::Model model;
  std::unique_ptr<witcert::ThreadPool> threads;
};
