// The C API's batched entry points: the meter and Tier A over many rows (batch × heads × steps) in
// one call, on arrays of any float type read in place. Each row is computed by the same function
// the one-row call uses, so a batch is bit for bit the rows' single calls.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "base/fp16.h"
#include "capi/internal.h"
#include "cert/meter.h"
#include "cert/witness.h"
#include "witcert/witcert.h"

using namespace witcert;
using namespace witcert::capi;

namespace {

// Element i of an array of `type`, widened exactly to double.
double load(const void* p, witcert_dtype type, std::size_t i) {
  switch (type) {
    case WITCERT_DTYPE_F64: return static_cast<const double*>(p)[i];
    case WITCERT_DTYPE_F32: return static_cast<const float*>(p)[i];
    case WITCERT_DTYPE_F16: return fp16_to_double(static_cast<const std::uint16_t*>(p)[i]);
    case WITCERT_DTYPE_BF16: {
      const std::uint32_t bits = std::uint32_t{static_cast<const std::uint16_t*>(p)[i]} << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    default: break;
  }
  return 0.0;
}

void check_dtype(witcert_dtype type, const char* name) {
  if (!(type >= WITCERT_DTYPE_F64 && type <= WITCERT_DTYPE_BF16))
    refuse(std::string(name) + "'s dtype is not a witcert_dtype");
}

// Row `row` of `n` elements from `p`, widened into `out`.
void widen_row(const void* p, witcert_dtype type, std::size_t row, std::size_t n, double* out) {
  if (type == WITCERT_DTYPE_F64) {
    std::memcpy(out, static_cast<const double*>(p) + row * n, n * sizeof(double));
    return;
  }
  for (std::size_t t = 0; t < n; ++t) out[t] = load(p, type, row * n + t);
}

void widen_row(const void* p, witcert_dtype type, std::size_t row, std::size_t n, float* out) {
  for (std::size_t t = 0; t < n; ++t) out[t] = static_cast<float>(load(p, type, row * n + t));
}

// Runs row(r, scratch) for r in [0, rows) on up to `threads` threads (≤ 0: one per core), each
// with its own scratch; the failure of the lowest row is rethrown, with the row named.
template <class Scratch, class Row>
void for_rows(std::size_t rows, std::size_t work_per_row, int threads, Row row) {
  if (rows == 0) return;
  unsigned want = threads > 0 ? static_cast<unsigned>(threads) : std::max(1u, std::thread::hardware_concurrency());
  // A thread costs tens of microseconds to start: worth it only for some 64k elements of work each.
  const std::size_t work = rows * std::max<std::size_t>(work_per_row, 1);
  want = static_cast<unsigned>(std::min<std::size_t>({want, rows, std::max<std::size_t>(1, work / 65536)}));
  std::vector<std::exception_ptr> errors(want);
  std::vector<std::size_t> failed_row(want, rows);
  const auto run = [&](unsigned w) {
    Scratch scratch;
    const std::size_t begin = rows * w / want, end = rows * (w + 1) / want;
    for (std::size_t r = begin; r < end; ++r) {
      try {
        row(r, scratch);
      } catch (...) {
        errors[w] = std::current_exception();
        failed_row[w] = r;
        return;
      }
    }
  };
  if (want <= 1) {
    run(0);
  } else {
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < want; ++w) pool.emplace_back(run, w);
    run(0);
    for (std::thread& t : pool) t.join();
  }
  for (unsigned w = 0; w < want; ++w)
    if (errors[w])
      located([&] { std::rethrow_exception(errors[w]); }, [&] { return "row " + std::to_string(failed_row[w]); });
}

struct MeterScratch {
  std::vector<double> a, c;
};

template <bool kLogits>
void meter_batch(const void* x, witcert_dtype x_type, const void* c, witcert_dtype c_type, std::size_t rows,
                 std::size_t n, int threads, witcert_bounds* out) {
  const char* x_name = kLogits ? "z" : "p_tilde";
  not_null(x, x_name);
  not_null(c, "c");
  not_null(out, "out");
  check_dtype(x_type, x_name);
  check_dtype(c_type, "c");
  require(n >= 1, "n must be at least 1");
  require(rows <= (std::size_t{1} << 40) / n, "rows × n is beyond 2^40 elements");
  for_rows<MeterScratch>(rows, n, threads, [&](std::size_t r, MeterScratch& s) {
    s.a.resize(n);
    s.c.resize(n);
    widen_row(x, x_type, r, n, s.a.data());
    widen_row(c, c_type, r, n, s.c.data());
    out[r] = kLogits ? meter_logits_row(s.a, s.c) : meter_probs_row(s.a, s.c);
  });
}

// Keys and queries are held as float32 (the cache's exact tier, the witness's arithmetic): a float64
// array would be rounded, and a witness of the rounded keys need not bound the given ones' error.
void check_narrow(witcert_dtype type, const char* name) {
  check_dtype(type, name);
  if (type == WITCERT_DTYPE_F64)
    refuse(std::string(name) +
           " is float64: keys and queries are taken as float32, float16 or bfloat16, which "
           "float32 holds exactly");
}

}  // namespace

extern "C" {

witcert_status witcert_meter_logits_batch(const void* z, witcert_dtype z_type, const void* c, witcert_dtype c_type,
                                          size_t rows, size_t n, int threads, witcert_bounds* out) {
  return guarded(__func__, [&] { meter_batch<true>(z, z_type, c, c_type, rows, n, threads, out); });
}

witcert_status witcert_meter_probs_batch(const void* p_tilde, witcert_dtype p_type, const void* c, witcert_dtype c_type,
                                         size_t rows, size_t n, int threads, witcert_bounds* out) {
  return guarded(__func__, [&] { meter_batch<false>(p_tilde, p_type, c, c_type, rows, n, threads, out); });
}

witcert_status witcert_witness_batch(int d, int bands, witcert_rope_layout layout, const void* k_hat,
                                     witcert_dtype k_hat_type, const void* k, witcert_dtype k_type, size_t n,
                                     uint16_t* witness) {
  return guarded(__func__, [&] {
    check_d(d);
    const cert::BandLayout bl(d, bands, rope(layout));
    not_null(k_hat, "k_hat");
    not_null(k, "k");
    not_null(witness, "witness");
    check_narrow(k_hat_type, "k_hat");
    check_narrow(k_type, "k");
    const std::size_t dd = static_cast<std::size_t>(d), nb = static_cast<std::size_t>(bands);
    std::vector<float> kh(dd), kk(dd);
    for (std::size_t t = 0; t < n; ++t) {
      widen_row(k_hat, k_hat_type, t, dd, kh.data());
      widen_row(k, k_type, t, dd, kk.data());
      located([&] { witness_row(bl, kh, kk, {witness + t * nb, nb}); }, [&] { return "row " + std::to_string(t); });
    }
  });
}

witcert_status witcert_tier_a_bounds_batch(int d, int bands, witcert_rope_layout layout, const void* q,
                                           witcert_dtype q_type, const uint16_t* witnesses, size_t batch, int q_heads,
                                           int kv_heads, size_t n_tokens, double sm, int threads, double* c) {
  return guarded(__func__, [&] {
    check_d(d);
    const cert::BandLayout bl(d, bands, rope(layout));
    not_null(q, "q");
    not_null(witnesses, "witnesses");
    not_null(c, "c");
    check_narrow(q_type, "q");
    require(n_tokens >= 1, "n_tokens must be at least 1");
    require(kv_heads >= 1 && q_heads >= kv_heads && q_heads % kv_heads == 0,
            "q_heads must be a positive multiple of kv_heads");
    require(std::isfinite(sm) && sm > 0.0, "sm must be finite and > 0");
    const std::size_t dd = static_cast<std::size_t>(d), nb = static_cast<std::size_t>(bands);
    const std::size_t hq = static_cast<std::size_t>(q_heads), hk = static_cast<std::size_t>(kv_heads);
    const std::size_t group = hq / hk;
    // Each KV head's witnesses are checked once, then every query head of its group reads them.
    for (std::size_t kv = 0; kv < batch * hk; ++kv)
      located([&] { check_f16(witnesses + kv * n_tokens * nb, n_tokens * nb, "witnesses", true, true); },
              [&] { return "batch " + std::to_string(kv / hk) + ", kv_head " + std::to_string(kv % hk); });
    struct Scratch {
      std::vector<float> q;
      std::vector<double> q_norm;
    };
    for_rows<Scratch>(batch * hq, n_tokens * nb, threads, [&](std::size_t row, Scratch& s) {
      s.q.resize(dd);
      widen_row(q, q_type, row, dd, s.q.data());
      check_activations(s.q.data(), dd, "q");
      const std::size_t b = row / hq, h = row % hq;
      tier_a_row(bl, s.q, witnesses + (b * hk + h / group) * n_tokens * nb, n_tokens, sm, s.q_norm, c + row * n_tokens);
    });
  });
}

}  // extern "C"
