// The C API against the C++ library it wraps: the same numbers bit for bit, every function refusing
// each kind of bad argument with a status and a message, handles refused after their free, and
// the certified cache's outputs within their meters' bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "base/fp16.h"
#include "cert/meter.h"
#include "engine/cache_factory.h"
#include "engine/model.h"
#include "engine/session.h"
#include "model/real_model_fixture.h"
#include "witcert/witcert.h"

namespace {

using namespace witcert;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

std::string model_path() { return std::string(WITCERT_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }

// A status and a non-empty message that names `arg`.
void expect_refused_at(witcert_status s, witcert_status want, const std::string& arg, int line) {
  SCOPED_TRACE("capi_test.cc:" + std::to_string(line));
  EXPECT_EQ(s, want) << witcert_status_name(s) << ": " << witcert_last_error();
  const std::string msg = witcert_last_error();
  EXPECT_NE(msg.find(arg), std::string::npos) << "message '" << msg << "' does not name " << arg;
}

#define expect_refused(...) expect_refused_at(__VA_ARGS__, __LINE__)

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(CApi, VersionAndStatusNames) {
  EXPECT_EQ(witcert_api_version(), WITCERT_API_VERSION);
  EXPECT_STREQ(witcert_version(), "0.1.0");
  EXPECT_STREQ(witcert_status_name(WITCERT_OK), "ok");
  EXPECT_STREQ(witcert_status_name(WITCERT_ERROR_BUFFER_TOO_SMALL), "buffer too small");
  EXPECT_STREQ(witcert_status_name(static_cast<witcert_status>(99)), "unknown status");
}

TEST(CApi, TheMeterIsTheLibrarysBitForBit) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nz(0.0, 3.0);
  std::exponential_distribution<double> ec(20.0);
  for (std::size_t n : {1u, 2u, 7u, 64u, 1000u}) {
    std::vector<double> z(n), c(n);
    for (std::size_t t = 0; t < n; ++t) z[t] = nz(rng), c[t] = ec(rng);
    witcert_bounds b{};
    ASSERT_EQ(witcert_meter_logits(z.data(), c.data(), n, &b), WITCERT_OK) << witcert_last_error();
    EXPECT_STREQ(witcert_last_error(), "");
    const cert::Bounds want = cert::evaluate_logits(z, c);
    EXPECT_TRUE(same_bits(b.eform, want.eform) && same_bits(b.two_sided, want.two_sided) &&
                same_bits(b.retention, want.retention) && same_bits(b.tanh, want.tanh) &&
                same_bits(b.tanh_half, want.tanh_half) && same_bits(b.meter, want.meter()) &&
                same_bits(b.raw, want.eform));
    for (int shape = WITCERT_BOUND_EFORM; shape <= WITCERT_BOUND_MIN; ++shape) {
      double m = -1;
      ASSERT_EQ(witcert_bounds_meter(&b, static_cast<witcert_bound_shape>(shape), &m), WITCERT_OK);
      EXPECT_TRUE(same_bits(m, want.meter(static_cast<cert::BoundShape>(shape))));
    }
    // The same distribution as probabilities.
    std::vector<double> p(n);
    double mx = *std::max_element(z.begin(), z.end()), s = 0;
    for (std::size_t t = 0; t < n; ++t) s += p[t] = std::exp(z[t] - mx);
    for (double& x : p) x /= s;
    ASSERT_EQ(witcert_meter_probs(p.data(), c.data(), n, &b), WITCERT_OK) << witcert_last_error();
    EXPECT_TRUE(same_bits(b.eform, cert::evaluate(p, c).eform));
    // Sound on an adversarial ε: the true TV under |ε_t| = c_t with alternating signs.
    std::vector<double> eps(n);
    for (std::size_t t = 0; t < n; ++t) eps[t] = (t % 2 ? 1 : -1) * c[t];
    double tv = -1;
    ASSERT_EQ(witcert_true_tv(p.data(), eps.data(), n, &tv), WITCERT_OK);
    EXPECT_LE(tv, b.meter);
  }
  // +inf c: no guarantee, meter 1; masked tokens (-inf logits) drop out.
  const double z[3] = {0.0, -kInf, 1.0}, c[3] = {0.1, 5.0, kInf};
  witcert_bounds b{};
  ASSERT_EQ(witcert_meter_logits(z, c, 3, &b), WITCERT_OK) << witcert_last_error();
  EXPECT_EQ(b.raw, kInf);
  EXPECT_EQ(b.meter, 1.0);
  double t = 0, th = 0, ef = 0, ts = 0;
  ASSERT_EQ(witcert_meter_tanh(0.5, &t, &th), WITCERT_OK);
  EXPECT_TRUE(same_bits(t, cert::tanh_shape(0.5)) && same_bits(th, cert::tanh_half_shape(0.5)));
  ASSERT_EQ(witcert_meter_tanh(kInf, &t, nullptr), WITCERT_OK);
  EXPECT_TRUE(same_bits(t, cert::tanh_shape(kInf)));
  EXPECT_GE(t, 1.0);
  ASSERT_EQ(witcert_meter_log_domain(0.01, -0.02, &ef, &ts), WITCERT_OK);
  EXPECT_TRUE(same_bits(ef, cert::eform_raw(0.01)) && same_bits(ts, cert::two_sided_raw(0.01, -0.02)));
  ASSERT_EQ(witcert_meter_log_domain(kInf, -0.02, &ef, nullptr), WITCERT_OK);
  EXPECT_EQ(ef, kInf);
}

// The CLI's `witcert bound` prints the same doubles (JSON round-trips them exactly).
TEST(CApi, TheCliBoundAgreesBitForBit) {
  const std::vector<double> z = {0.25, -1.5, 3.0, 0.0, 2.75}, c = {0.01, 0.2, 0.003, 1.5, 0.07};
  witcert_bounds b{};
  ASSERT_EQ(witcert_meter_logits(z.data(), c.data(), z.size(), &b), WITCERT_OK);
  const std::string in = std::string(testing::TempDir()) + "capi_bound.jsonl";
  std::FILE* f = std::fopen(in.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fprintf(f, "%s\n", nlohmann::json{{"z", z}, {"c", c}}.dump().c_str());
  std::fclose(f);
  std::FILE* p = popen((std::string(WITCERT_BIN) + " bound < " + in).c_str(), "r");
  ASSERT_NE(p, nullptr);
  char line[4096] = {0};
  ASSERT_NE(std::fgets(line, sizeof line, p), nullptr);
  EXPECT_EQ(pclose(p), 0);
  const nlohmann::json j = nlohmann::json::parse(line);
  for (const auto& [key, v] : {std::pair<const char*, double>{"eform", b.eform}, {"two_sided", b.two_sided},
                               {"retention", b.retention}, {"tanh", b.tanh}, {"tanh_half", b.tanh_half},
                               {"raw", b.raw}, {"meter", b.meter}}) {
    EXPECT_TRUE(same_bits(j.at(key).get<double>(), v)) << key << ": " << j.at(key) << " vs " << v;
  }
}

TEST(CApi, EveryMeterAndCertificateFunctionRefusesBadArguments) {
  const double z[2] = {0.0, 1.0}, c[2] = {0.1, 0.2}, nanv[2] = {0.0, kNaN}, neg[2] = {0.1, -0.1}, pinf[2] = {0.0, kInf};
  witcert_bounds b{};
  const auto A = WITCERT_ERROR_INVALID_ARGUMENT;
  expect_refused(witcert_meter_logits(nullptr, c, 2, &b), A, "z");
  expect_refused(witcert_meter_logits(z, nullptr, 2, &b), A, "c");
  expect_refused(witcert_meter_logits(z, c, 2, nullptr), A, "out");
  expect_refused(witcert_meter_logits(z, c, 0, &b), A, "n");
  expect_refused(witcert_meter_logits(nanv, c, 2, &b), A, "z[1]");
  expect_refused(witcert_meter_logits(pinf, c, 2, &b), A, "z[1]");
  expect_refused(witcert_meter_logits(z, nanv, 2, &b), A, "c[1]");
  expect_refused(witcert_meter_logits(z, neg, 2, &b), A, "c[1]");
  const double masked[2] = {-kInf, -kInf};
  expect_refused(witcert_meter_logits(masked, c, 2, &b), A, "z");
  const double p[2] = {0.5, 0.5}, p_bad[2] = {0.5, 0.6}, p_neg[2] = {1.5, -0.5};
  expect_refused(witcert_meter_probs(nullptr, c, 2, &b), A, "p_tilde");
  expect_refused(witcert_meter_probs(p_bad, c, 2, &b), A, "sums");
  expect_refused(witcert_meter_probs(p_neg, c, 2, &b), A, "p_tilde[0]");  // 1.5: above 1
  expect_refused(witcert_meter_probs(nanv, c, 2, &b), A, "p_tilde[1]");
  expect_refused(witcert_meter_probs(p, neg, 2, &b), A, "c[1]");
  expect_refused(witcert_meter_probs(p, c, 0, &b), A, "n");
  double out = 0;
  expect_refused(witcert_meter_tanh(kNaN, &out, &out), A, "c_max");
  expect_refused(witcert_meter_tanh(-1, &out, &out), A, "c_max");
  expect_refused(witcert_meter_tanh(1, nullptr, nullptr), A, "NULL");
  expect_refused(witcert_meter_log_domain(kNaN, -0.1, &out, &out), A, "log_a");
  expect_refused(witcert_meter_log_domain(-0.1, -0.1, &out, &out), A, "log_a");
  expect_refused(witcert_meter_log_domain(0.1, 0.1, &out, &out), A, "log_a_minus");
  expect_refused(witcert_meter_log_domain(0.1, -kInf, &out, &out), A, "log_a_minus");
  expect_refused(witcert_bounds_meter(nullptr, WITCERT_BOUND_MIN, &out), A, "b");
  expect_refused(witcert_bounds_meter(&b, static_cast<witcert_bound_shape>(6), &out), A, "shape");
  expect_refused(witcert_bounds_meter(&b, WITCERT_BOUND_MIN, nullptr), A, "meter");
  expect_refused(witcert_true_tv(p, nanv, 2, &out), A, "eps[1]");
  expect_refused(witcert_true_tv(nullptr, c, 2, &out), A, "p_tilde");
  expect_refused(witcert_true_tv(p, nullptr, 2, &out), A, "eps");
  expect_refused(witcert_true_tv(p, c, 2, nullptr), A, "tv");
  expect_refused(witcert_true_tv(p, c, 0, &out), A, "n");

  // Certificates.
  std::vector<float> k(64, 0.5f), kh(64, 0.25f), q(64, 1.0f);
  std::vector<uint16_t> w(16);
  expect_refused(witcert_witness(63, 16, WITCERT_ROPE_NEOX, kh.data(), k.data(), w.data()), A, "even");
  expect_refused(witcert_witness(0, 16, WITCERT_ROPE_NEOX, kh.data(), k.data(), w.data()), A, "d");
  expect_refused(witcert_witness(64, 5, WITCERT_ROPE_NEOX, kh.data(), k.data(), w.data()), A, "band");
  expect_refused(witcert_witness(64, 16, static_cast<witcert_rope_layout>(2), kh.data(), k.data(), w.data()), A, "layout");
  expect_refused(witcert_witness(64, 16, WITCERT_ROPE_NEOX, nullptr, k.data(), w.data()), A, "k_hat");
  expect_refused(witcert_witness(64, 16, WITCERT_ROPE_NEOX, kh.data(), nullptr, w.data()), A, "k");
  expect_refused(witcert_witness(64, 16, WITCERT_ROPE_NEOX, kh.data(), k.data(), nullptr), A, "witness");
  k[3] = std::nanf("");
  expect_refused(witcert_witness(64, 16, WITCERT_ROPE_NEOX, kh.data(), k.data(), w.data()), A, "k[3]");
  k[3] = 0.5f;
  ASSERT_EQ(witcert_witness(64, 16, WITCERT_ROPE_NEOX, kh.data(), k.data(), w.data()), WITCERT_OK);
  double cs[2];
  std::vector<uint16_t> w2(w);
  w2.insert(w2.end(), w.begin(), w.end());
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 0, 0.125, cs), A, "n_tokens");
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 2, kNaN, cs), A, "sm");
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 2, 0.0, cs), A, "sm");
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, nullptr, w2.data(), 2, 0.125, cs), A, "q");
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), nullptr, 2, 0.125, cs), A, "witnesses");
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 2, 0.125, nullptr), A, "c");
  w2[20] = 0x7e00;  // fp16 NaN
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 2, 0.125, cs), A, "witnesses[20]");
  w2[20] = 0xbc00;  // -1
  expect_refused(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w2.data(), 2, 0.125, cs), A, "witnesses[20]");

  std::vector<float> xi(64), x(64, 0.3f), dec(64);
  std::vector<int8_t> codes(64);
  std::vector<uint16_t> scales(2), ov(1);
  std::vector<uint8_t> mask(64, 0);
  expect_refused(witcert_dither_values(1, 0, 0, 0, nullptr, 64), A, "xi");
  expect_refused(witcert_dither_values(1, 0, 0, 0, xi.data(), 0), A, "d");
  ASSERT_EQ(witcert_dither_values(1, 0, 0, 0, xi.data(), 64), WITCERT_OK);
  expect_refused(witcert_dither_encode(nullptr, xi.data(), nullptr, 64, 32, codes.data(), scales.data(), nullptr, 0), A, "x");
  expect_refused(witcert_dither_encode(x.data(), nullptr, nullptr, 64, 32, codes.data(), scales.data(), nullptr, 0), A, "xi");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), nullptr, 64, 32, nullptr, scales.data(), nullptr, 0), A, "codes");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), nullptr, 64, 32, codes.data(), nullptr, nullptr, 0), A, "scales");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), nullptr, 64, 30, codes.data(), scales.data(), nullptr, 0), A, "group");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), nullptr, 64, 0, codes.data(), scales.data(), nullptr, 0), A, "group");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), nullptr, 0, 32, codes.data(), scales.data(), nullptr, 0), A, "d");
  mask[5] = 1;
  expect_refused(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), ov.data(), 0), A, "n_outliers");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), nullptr, 1), A, "outlier_values");
  mask[6] = 2;
  expect_refused(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), ov.data(), 1), A, "outlier[6]");
  mask[6] = 0;
  x[9] = std::nanf("");
  expect_refused(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), ov.data(), 1), A, "x[9]");
  x[9] = 0.3f;
  xi[2] = 0.5f;
  expect_refused(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), ov.data(), 1), A, "xi[2]");
  expect_refused(witcert_dither_decode(codes.data(), scales.data(), xi.data(), mask.data(), ov.data(), 1, 64, 32, dec.data()), A, "xi[2]");
  ASSERT_EQ(witcert_dither_values(1, 0, 0, 0, xi.data(), 64), WITCERT_OK);
  ASSERT_EQ(witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(), scales.data(), ov.data(), 1), WITCERT_OK);
  expect_refused(witcert_dither_decode(nullptr, scales.data(), xi.data(), mask.data(), ov.data(), 1, 64, 32, dec.data()), A, "codes");
  expect_refused(witcert_dither_decode(codes.data(), scales.data(), xi.data(), mask.data(), ov.data(), 1, 64, 32, nullptr), A, "out");
  expect_refused(witcert_dither_decode(codes.data(), scales.data(), xi.data(), mask.data(), ov.data(), 2, 64, 32, dec.data()), A, "n_outliers");
  double dl = 0, u = 0;
  expect_refused(witcert_delta_loc(0.0, 30, 9, 256, &dl), A, "delta");
  expect_refused(witcert_delta_loc(kNaN, 30, 9, 256, &dl), A, "");
  expect_refused(witcert_delta_loc(0.01, 0, 9, 256, &dl), A, "");
  expect_refused(witcert_delta_loc(0.01, 30, 9, 256, nullptr), A, "delta_loc");
  ASSERT_EQ(witcert_delta_loc(0.01, 30, 9, 256, &dl), WITCERT_OK);
  expect_refused(witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32, 0.125, 10, 0.0, &u), A, "delta_loc");
  expect_refused(witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32, 0.125, 0, dl, &u), A, "n_tokens");
  expect_refused(witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32, -1, 10, dl, &u), A, "sm");
  expect_refused(witcert_dither_radius(nullptr, scales.data(), mask.data(), 64, 32, 0.125, 10, dl, &u), A, "q");
  expect_refused(witcert_dither_radius(q.data(), nullptr, mask.data(), 64, 32, 0.125, 10, dl, &u), A, "scales");
  expect_refused(witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32, 0.125, 10, dl, nullptr), A, "u");
  expect_refused(witcert_value_bound(kNaN, 1, 0, &out, &out), A, "tv_k");
  expect_refused(witcert_value_bound(0.1, -1, 0, &out, &out), A, "v_max_norm");
  expect_refused(witcert_value_bound(0.1, 1, kNaN, &out, &out), A, "weighted_rho");
  expect_refused(witcert_value_bound(0.1, 1, 0, nullptr, nullptr), A, "NULL");
  // A failed call leaves the message; the next successful one clears it.
  ASSERT_EQ(witcert_value_bound(0.1, 1, 0.01, &out, nullptr), WITCERT_OK);
  EXPECT_STREQ(witcert_last_error(), "");
  EXPECT_DOUBLE_EQ(out, cert::value_output_bound(0.1, 1, 0.01));
}

// ---- Poisoned inputs ------------------------------------------------------------------------

// What one call answered with one input poisoned: an error status (with its message), an answer
// that reads no guarantee (an infinite bound, a meter of 1), a finite certificate, or `legit`: a
// finite answer for a value with a meaning in its argument (a masked logit, an offset, a loose
// bound), which the call's runner has checked against the answer to an equivalent clean input.
enum class Answer { refused, no_guarantee, certifies, legit };

struct Outcome {
  Answer answer;
  witcert_status status = WITCERT_OK;
  std::string message;
};

Outcome refusal(witcert_status s) { return {Answer::refused, s, witcert_last_error()}; }
Outcome verdict(bool finite_certificate) {
  return {finite_certificate ? Answer::certifies : Answer::no_guarantee, WITCERT_OK, ""};
}
Outcome legit() { return {Answer::legit, WITCERT_OK, ""}; }

// One entry point: its float, double and fp16 inputs as its error messages name them (an array
// by its poisoned entry), and a runner that calls it with input `arg` set to `v` (an fp16 input
// takes v's fp16 rounding; 1e5 rounds to +inf) and every other input valid.
struct Call {
  std::string name;
  std::vector<std::string> args;
  std::function<Outcome(std::size_t arg, double v)> run;
};

constexpr double kPoisons[] = {kNaN, kInf, -kInf, 1e5};

std::string label(double v) { return std::isnan(v) ? "NaN" : v == kInf ? "+inf" : v == -kInf ? "-inf" : "1e5"; }

// A clean cache of geometry (1 layer, 2 query heads, 1 KV head, d = 64) under `options`, with
// `written` positions of small keys and values; freed with the pool by the caller's `done`.
struct SmallCache {
  witcert_pool* pool = nullptr;
  witcert_cache* cache = nullptr;
  explicit SmallCache(const std::string& options, int written) {
    const witcert_geometry g{1, 2, 1, 64, 16, WITCERT_ROPE_NEOX};
    EXPECT_EQ(witcert_pool_create(&g, options.c_str(), 0, &pool), WITCERT_OK) << witcert_last_error();
    EXPECT_EQ(witcert_cache_create(pool, nullptr, 16, &cache), WITCERT_OK) << witcert_last_error();
    for (int p = 0; p < written; ++p) EXPECT_EQ(write(p, 1), WITCERT_OK) << witcert_last_error();
  }
  ~SmallCache() {
    witcert_cache_free(cache);
    witcert_pool_free(pool);
  }
  static std::vector<float> row(int p, float scale) {
    std::vector<float> x(64);
    for (int i = 0; i < 64; ++i) x[i] = scale * static_cast<float>(std::sin(0.37 * (i + 1) * (p + 1)));
    return x;
  }
  witcert_status write(int p, float scale) {
    const std::vector<float> k = row(p, scale), v = row(p + 100, scale);
    return witcert_cache_write(cache, 0, 0, p, k.data(), v.data());
  }
  // Attends the two heads over n_ctx positions: refused, or the cells' verdict (a cell certifies
  // unless it reads no guarantee, meter 1).
  Outcome attend(const std::vector<float>& q, int n_ctx) {
    std::vector<float> out(q.size());
    witcert_cell cells[2];
    const witcert_status s = witcert_cache_attend(cache, 0, 0, q.data(), 2, n_ctx, out.data(), cells);
    if (s != WITCERT_OK) return refusal(s);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float y) { return std::isfinite(y); }))
        << "an OK attend with a non-finite output";
    return verdict(cells[0].meter < 1.0 || cells[1].meter < 1.0);
  }
};

std::vector<Call> poisonable_calls() {
  std::vector<Call> calls;
  // Level 1. The clean inputs: three logits and their bounds, a distribution, finite log A, A⁻.
  const std::vector<double> z0{0.0, 1.0, -0.5}, c0{0.1, 0.2, 0.05}, p0{0.25, 0.5, 0.25}, eps0{0.1, -0.1, 0.05};
  calls.push_back({"witcert_meter_logits", {"z[1]", "c[1]"}, [=](std::size_t arg, double v) {
                     std::vector<double> z = z0, c = c0;
                     (arg == 0 ? z : c)[1] = v;
                     witcert_bounds b{};
                     const witcert_status s = witcert_meter_logits(z.data(), c.data(), 3, &b);
                     if (s != WITCERT_OK) return refusal(s);
                     if (arg == 0 && (v == -kInf || v == 1e5)) {
                       // -inf masks the token: the meter of the other two. 1e5 is an offset: the
                       // meter of the same logits shifted down by 1e5.
                       std::vector<double> zs{z0[0], z0[2]}, cs{c0[0], c0[2]};
                       if (v == 1e5) zs = {z0[0] - 1e5, 0.0, z0[2] - 1e5}, cs = c0;
                       witcert_bounds want{};
                       EXPECT_EQ(witcert_meter_logits(zs.data(), cs.data(), zs.size(), &want), WITCERT_OK);
                       EXPECT_NEAR(b.meter, want.meter, 1e-6 * want.meter) << label(v);
                       return legit();
                     }
                     return verdict(b.meter < 1.0);
                   }});
  calls.push_back({"witcert_meter_probs", {"p_tilde[1]", "c[1]"}, [=](std::size_t arg, double v) {
                     std::vector<double> p = p0, c = c0;
                     (arg == 0 ? p : c)[1] = v;
                     witcert_bounds b{};
                     const witcert_status s = witcert_meter_probs(p.data(), c.data(), 3, &b);
                     return s != WITCERT_OK ? refusal(s) : verdict(b.meter < 1.0);
                   }});
  calls.push_back({"witcert_meter_tanh", {"c_max"}, [](std::size_t, double v) {
                     double t = 0, th = 0;
                     const witcert_status s = witcert_meter_tanh(v, &t, &th);
                     return s != WITCERT_OK ? refusal(s) : verdict(t < 1.0 || th < 1.0);
                   }});
  calls.push_back({"witcert_meter_log_domain", {"log_a", "log_a_minus"}, [](std::size_t arg, double v) {
                     double e = 0, ts = 0;
                     const witcert_status s = witcert_meter_log_domain(arg == 0 ? v : 0.1, arg == 1 ? v : -0.05, &e, &ts);
                     return s != WITCERT_OK ? refusal(s) : verdict(e < 1.0 || ts < 1.0);
                   }});
  calls.push_back(
      {"witcert_bounds_meter",
       {"b->eform", "b->two_sided", "b->retention", "b->tanh", "b->tanh_half", "b->raw", "b->meter"},
       [=](std::size_t arg, double v) {
         witcert_bounds clean{};
         EXPECT_EQ(witcert_meter_logits(z0.data(), c0.data(), 3, &clean), WITCERT_OK);
         witcert_bounds b = clean;
         double* fields[] = {&b.eform, &b.two_sided, &b.retention, &b.tanh, &b.tanh_half, &b.raw, &b.meter};
         *fields[arg] = v;
         double got[6], want[6];
         for (int shape = WITCERT_BOUND_EFORM; shape <= WITCERT_BOUND_MIN; ++shape) {
           const witcert_status s = witcert_bounds_meter(&b, static_cast<witcert_bound_shape>(shape), &got[shape]);
           if (s != WITCERT_OK) return refusal(s);
           EXPECT_EQ(witcert_bounds_meter(&clean, static_cast<witcert_bound_shape>(shape), &want[shape]), WITCERT_OK);
           EXPECT_TRUE(got[shape] >= 0.0 && got[shape] <= 1.0) << shape << ": " << got[shape];
         }
         // Every shape but the poisoned one answers as before, and MIN is the least of the others.
         for (int shape = WITCERT_BOUND_EFORM; shape < WITCERT_BOUND_MIN; ++shape)
           if (static_cast<std::size_t>(shape) != arg) {
             EXPECT_EQ(got[shape], want[shape]) << shape;
           }
         EXPECT_EQ(got[WITCERT_BOUND_MIN], *std::min_element(got, got + WITCERT_BOUND_MIN));
         if (arg >= 5) return legit();  // raw and meter are reports, not read by any shape
         return verdict(got[arg] < 1.0);
       }});
  calls.push_back({"witcert_true_tv", {"p_tilde[1]", "eps[1]"}, [=](std::size_t arg, double v) {
                     std::vector<double> p = p0, eps = eps0;
                     (arg == 0 ? p : eps)[1] = v;
                     double tv = 0;
                     const witcert_status s = witcert_true_tv(p.data(), eps.data(), 3, &tv);
                     if (s != WITCERT_OK) return refusal(s);
                     if (arg == 1 && v == 1e5) {  // e^{-1e5} = 0: the token's exact mass is 0
                       const double w0 = p0[0] * std::exp(-eps0[0]), w2 = p0[2] * std::exp(-eps0[2]);
                       const double want = 0.5 * (std::fabs(w0 / (w0 + w2) - p0[0]) + p0[1] + std::fabs(w2 / (w0 + w2) - p0[2]));
                       EXPECT_NEAR(tv, want, 1e-15);
                       return legit();
                     }
                     return verdict(true);  // a TV computed from a non-finite input is garbage
                   }});
  // Level 2. Keys of 64 channels in 16 bands; two tokens' witnesses; a dither-int8 token of two
  // groups of 32 with one outlier channel.
  calls.push_back({"witcert_witness", {"k_hat[1]", "k[1]"}, [](std::size_t arg, double v) {
                     std::vector<float> k_hat(64, 0.25f), k(64, 0.5f);
                     (arg == 0 ? k_hat : k)[1] = static_cast<float>(v);
                     std::vector<uint16_t> w(16);
                     const witcert_status s = witcert_witness(64, 16, WITCERT_ROPE_NEOX, k_hat.data(), k.data(), w.data());
                     if (s != WITCERT_OK) return refusal(s);
                     return verdict(std::all_of(w.begin(), w.end(), [](uint16_t x) { return std::isfinite(fp16_to_double(x)); }));
                   }});
  std::vector<uint16_t> w0(32);
  {
    const std::vector<float> k_hat(64, 0.25f), k(64, 0.5f);
    EXPECT_EQ(witcert_witness(64, 16, WITCERT_ROPE_NEOX, k_hat.data(), k.data(), w0.data()), WITCERT_OK);
    std::copy(w0.begin(), w0.begin() + 16, w0.begin() + 16);
  }
  calls.push_back({"witcert_tier_a_bounds", {"q[1]", "witnesses[1]", "sm"}, [=](std::size_t arg, double v) {
                     std::vector<float> q(64, 1.0f);
                     std::vector<uint16_t> w = w0;
                     if (arg == 0) q[1] = static_cast<float>(v);
                     if (arg == 1) w[1] = fp16_from_double(v);
                     double c[2], clean[2];
                     const witcert_status s = witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w.data(), 2,
                                                                    arg == 2 ? v : 0.125, c);
                     if (s != WITCERT_OK) return refusal(s);
                     if (arg == 2 && v == 1e5) {  // a larger softmax scale: c scales with it
                       EXPECT_EQ(witcert_tier_a_bounds(64, 16, WITCERT_ROPE_NEOX, q.data(), w.data(), 2, 0.125, clean), WITCERT_OK);
                       EXPECT_NEAR(c[0], clean[0] * 8e5, 1e-9 * c[0]);
                       return legit();
                     }
                     return verdict(std::isfinite(c[0]) && std::isfinite(c[1]));
                   }});
  std::vector<float> xi0(64), x0(64);
  for (int i = 0; i < 64; ++i) x0[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
  EXPECT_EQ(witcert_dither_values(1, 0, 0, 0, xi0.data(), 64), WITCERT_OK);
  std::vector<uint8_t> mask(64, 0);
  mask[5] = 1;
  std::vector<int8_t> codes0(64);
  std::vector<uint16_t> scales0(2), ov0(1);
  EXPECT_EQ(witcert_dither_encode(x0.data(), xi0.data(), mask.data(), 64, 32, codes0.data(), scales0.data(), ov0.data(), 1),
            WITCERT_OK);
  calls.push_back({"witcert_dither_encode", {"x[1]", "xi[1]"}, [=](std::size_t arg, double v) {
                     std::vector<float> x = x0, xi = xi0;
                     (arg == 0 ? x : xi)[1] = static_cast<float>(v);
                     std::vector<int8_t> codes(64);
                     std::vector<uint16_t> scales(2), ov(1);
                     const witcert_status s = witcert_dither_encode(x.data(), xi.data(), mask.data(), 64, 32, codes.data(),
                                                                    scales.data(), ov.data(), 1);
                     return s != WITCERT_OK ? refusal(s) : verdict(true);
                   }});
  calls.push_back({"witcert_dither_decode", {"scales[1]", "xi[1]", "outlier_values[0]"}, [=](std::size_t arg, double v) {
                     std::vector<uint16_t> scales = scales0, ov = ov0;
                     std::vector<float> xi = xi0, out(64);
                     if (arg == 0) scales[1] = fp16_from_double(v);
                     if (arg == 1) xi[1] = static_cast<float>(v);
                     if (arg == 2) ov[0] = fp16_from_double(v);
                     const witcert_status s = witcert_dither_decode(codes0.data(), scales.data(), xi.data(), mask.data(),
                                                                    ov.data(), 1, 64, 32, out.data());
                     return s != WITCERT_OK ? refusal(s) : verdict(true);
                   }});
  calls.push_back({"witcert_delta_loc", {"delta"}, [](std::size_t, double v) {
                     double dl = 0;
                     const witcert_status s = witcert_delta_loc(v, 30, 9, 256, &dl);
                     return s != WITCERT_OK ? refusal(s) : verdict(true);
                   }});
  calls.push_back({"witcert_dither_radius", {"q[1]", "scales[1]", "sm", "delta_loc"}, [=](std::size_t arg, double v) {
                     std::vector<float> q(64, 1.0f);
                     std::vector<uint16_t> scales = scales0;
                     if (arg == 0) q[1] = static_cast<float>(v);
                     if (arg == 1) scales[1] = fp16_from_double(v);
                     double u = 0, clean = 0;
                     const witcert_status s = witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32,
                                                                    arg == 2 ? v : 0.125, 10, arg == 3 ? v : 1e-6, &u);
                     if (s != WITCERT_OK) return refusal(s);
                     if (arg == 2 && v == 1e5) {  // the radius scales with sm
                       EXPECT_EQ(witcert_dither_radius(q.data(), scales.data(), mask.data(), 64, 32, 0.125, 10, 1e-6, &clean),
                                 WITCERT_OK);
                       EXPECT_NEAR(u, clean * 8e5, 1e-9 * u);
                       return legit();
                     }
                     return verdict(std::isfinite(u));
                   }});
  calls.push_back({"witcert_value_bound", {"tv_k", "v_max_norm", "weighted_rho"}, [](std::size_t arg, double v) {
                     double in[3] = {0.1, 2.0, 0.01};
                     in[arg] = v;
                     double bound = 0, v_meter = 0;
                     const witcert_status s = witcert_value_bound(in[0], in[1], in[2], &bound, &v_meter);
                     if (s != WITCERT_OK) return refusal(s);
                     if (v == 1e5) {  // a loose but true input: the formulas, evaluated
                       EXPECT_DOUBLE_EQ(bound, 2 * in[0] * in[1] + in[2]);
                       EXPECT_DOUBLE_EQ(v_meter, in[2] / in[1]);
                       return legit();
                     }
                     return verdict(std::isfinite(bound) && std::isfinite(v_meter));
                   }});
  // Level 3, for the plain fp16 cache, two schemes and a gated one. A write that is accepted is
  // followed by a clean write and an attend over both: its cells are the certificate.
  for (const std::string& options :
       {std::string("{}"), std::string(R"({"kv": "q4_0"})"), std::string(R"({"kv": "dither-int8"})"),
        std::string(R"({"kv": "dither-int4"})"),
        std::string(R"({"kv": "q8_0", "tau_k": 0.2})")}) {
    calls.push_back({"witcert_cache_write " + options, {"k[1]", "v[1]"}, [=](std::size_t arg, double v) {
                       SmallCache sc(options, 0);
                       std::vector<float> k = SmallCache::row(0, 1), val = SmallCache::row(100, 1);
                       (arg == 0 ? k : val)[1] = static_cast<float>(v);
                       const witcert_status s = witcert_cache_write(sc.cache, 0, 0, 0, k.data(), val.data());
                       if (s != WITCERT_OK) return refusal(s);
                       EXPECT_EQ(sc.write(1, 1), WITCERT_OK);
                       return sc.attend(std::vector<float>(128, 0.5f), 2);
                     }});
    calls.push_back({"witcert_cache_attend " + options, {"q[1]"}, [=](std::size_t, double v) {
                       SmallCache sc(options, 3);
                       std::vector<float> q(128, 0.5f);
                       q[1] = static_cast<float>(v);
                       return sc.attend(q, 3);
                     }});
  }
  return calls;
}

// The values of an input that carry a meaning, and so may answer with a finite certificate (each
// runner checks that answer against an equivalent clean input): a masked or offset logit, a loose
// bound in a report field or in the value side's inputs, a larger softmax scale, an ε that removes
// its token.
const std::set<std::string> kLegit = {
    "witcert_meter_logits z[1] -inf",   "witcert_meter_logits z[1] 1e5",     "witcert_bounds_meter b->raw +inf",
    "witcert_bounds_meter b->raw 1e5",  "witcert_bounds_meter b->meter +inf", "witcert_bounds_meter b->meter 1e5",
    "witcert_true_tv eps[1] 1e5",       "witcert_tier_a_bounds sm 1e5",      "witcert_dither_radius sm 1e5",
    "witcert_value_bound tv_k 1e5",     "witcert_value_bound v_max_norm 1e5", "witcert_value_bound weighted_rho 1e5",
};

// NaN, +inf, -inf and 1e5 in every float, double and fp16 input of every call that takes one (the
// others take handles, sizes, enums, strings and JSON): each is refused with a message naming the
// input, or answered with no guarantee, never with a finite certificate; a finite answer only for
// the listed meaningful values, matching an equivalent clean input.
TEST(CApi, NoCallCertifiesANonFiniteOrOutOfRangeInput) {
  std::set<std::string> legit_seen;
  int cases = 0;
  for (const Call& call : poisonable_calls())
    for (std::size_t arg = 0; arg < call.args.size(); ++arg)
      for (double v : kPoisons) {
        const std::string where = call.name + " " + call.args[arg] + " " + label(v);
        SCOPED_TRACE(where);
        ++cases;
        const Outcome o = call.run(arg, v);
        switch (o.answer) {
          case Answer::refused:
            EXPECT_EQ(o.status, WITCERT_ERROR_INVALID_ARGUMENT) << o.message;
            EXPECT_NE(o.message.find(call.args[arg]), std::string::npos) << "'" << o.message << "' does not name the input";
            break;
          case Answer::no_guarantee: break;
          case Answer::certifies: ADD_FAILURE() << "a finite certificate for a poisoned input"; break;
          case Answer::legit:
            EXPECT_EQ(kLegit.count(call.name.substr(0, call.name.find(' ')) + " " + call.args[arg] + " " + label(v)), 1u)
                << "a finite answer for a value not listed as meaningful";
            legit_seen.insert(where);
            break;
        }
      }
  EXPECT_EQ(cases, 4 * (2 + 2 + 1 + 2 + 7 + 2 + 2 + 3 + 2 + 3 + 1 + 4 + 3 + 5 * (2 + 1)));
  EXPECT_EQ(legit_seen.size(), kLegit.size());  // every listed value was met, each once
}

// witcert_bounds_meter stays in [0, 1] for any bounds it accepts and refuses a NaN or negative field
// by name: a negative field once came back as a meter of -1.
TEST(CApi, BoundsMeterIsAlwaysInTheUnitInterval) {
  const witcert_bounds good{0.3, 0.2, 0.1, 0.5, 0.25, 0.3, 0.1};
  double m = -7;
  for (int shape = WITCERT_BOUND_EFORM; shape <= WITCERT_BOUND_MIN; ++shape) {
    ASSERT_EQ(witcert_bounds_meter(&good, static_cast<witcert_bound_shape>(shape), &m), WITCERT_OK);
    EXPECT_TRUE(m >= 0.0 && m <= 1.0) << m;
  }
  EXPECT_EQ(m, 0.1);
  const char* names[] = {"b->eform", "b->two_sided", "b->retention", "b->tanh", "b->tanh_half", "b->raw", "b->meter"};
  for (int field = 0; field < 7; ++field)
    for (double bad : {-1.0, -1e-300, -kInf, kNaN}) {
      witcert_bounds b = good;
      double* f[] = {&b.eform, &b.two_sided, &b.retention, &b.tanh, &b.tanh_half, &b.raw, &b.meter};
      *f[field] = bad;
      for (int shape = WITCERT_BOUND_EFORM; shape <= WITCERT_BOUND_MIN; ++shape) {
        m = -7;
        expect_refused(witcert_bounds_meter(&b, static_cast<witcert_bound_shape>(shape), &m),
                       WITCERT_ERROR_INVALID_ARGUMENT, names[field]);
        EXPECT_EQ(m, -7);  // untouched
      }
    }
  // Large and infinite fields are bounds that guarantee nothing: meter 1.
  const witcert_bounds loose{kInf, 1e300, 2.0, kInf, 1.0, kInf, 1.0};
  for (int shape = WITCERT_BOUND_EFORM; shape <= WITCERT_BOUND_MIN; ++shape) {
    ASSERT_EQ(witcert_bounds_meter(&loose, static_cast<witcert_bound_shape>(shape), &m), WITCERT_OK);
    EXPECT_EQ(m, 1.0);
  }
  // The library's own Bounds read a negative or NaN shape as no guarantee, never below 0.
  EXPECT_EQ((cert::Bounds{-1.0, 0.1, 0.1, 0.1, 0.1}.meter()), 1.0);
  EXPECT_EQ((cert::Bounds{0.1, 0.1, 0.1, 0.1, -0.5}.meter(cert::BoundShape::tanh_half)), 1.0);
  EXPECT_EQ(cert::clamp_meter(-1.0), 1.0);
}

// Option strings nested 100,000 deep are refused by name: the parser stops at its depth limit.
TEST(CApi, DeeplyNestedJsonIsRefusedNotACrash) {
  const std::string arrays(100000, '['), objects = [] {
    std::string s;
    for (int i = 0; i < 100000; ++i) s += "{\"a\":";
    return s;
  }();
  const witcert_geometry g{1, 2, 1, 64, 16, WITCERT_ROPE_NEOX};
  witcert_pool* pool = nullptr;
  for (const std::string& deep : {arrays, objects, "{\"kv\": " + arrays}) {
    expect_refused(witcert_pool_create(&g, deep.c_str(), 0, &pool), WITCERT_ERROR_INVALID_ARGUMENT, "options_json");
    EXPECT_EQ(pool, nullptr);
  }
  ASSERT_EQ(witcert_pool_create(&g, R"({"kv": "q4_0"})", 0, &pool), WITCERT_OK);
  witcert_cache* cache = nullptr;
  expect_refused(witcert_cache_create(pool, arrays.c_str(), 16, &cache), WITCERT_ERROR_INVALID_ARGUMENT, "policy_json");
  EXPECT_EQ(cache, nullptr);
  witcert_pool_free(pool);
}

// Tier A and Tier B through the C API against a brute-force check of what each promises.
TEST(CApi, CertificatesBoundTheirErrorsPerToken) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (witcert_rope_layout layout : {WITCERT_ROPE_INTERLEAVED, WITCERT_ROPE_NEOX})
    for (int d : {64, 128}) {
      const int bands = 16, n = 50;
      std::vector<float> q(d);
      for (float& x : q) x = nd(rng);
      std::vector<uint16_t> w(static_cast<std::size_t>(n) * bands);
      std::vector<double> eps(n);
      for (int t = 0; t < n; ++t) {
        std::vector<float> k(d), kh(d);
        for (int i = 0; i < d; ++i) k[i] = nd(rng), kh[i] = k[i] + 0.05f * nd(rng);
        ASSERT_EQ(witcert_witness(d, bands, layout, kh.data(), k.data(), w.data() + t * bands), WITCERT_OK);
        double e = 0;
        for (int i = 0; i < d; ++i) e += static_cast<double>(q[i]) * (kh[i] - k[i]);
        eps[t] = e / std::sqrt(static_cast<double>(d));
      }
      std::vector<double> c(n);
      ASSERT_EQ(witcert_tier_a_bounds(d, bands, layout, q.data(), w.data(), n, 1.0 / std::sqrt(d), c.data()), WITCERT_OK);
      for (int t = 0; t < n; ++t) EXPECT_GE(c[t], std::fabs(eps[t])) << "d " << d << " token " << t;
    }
  // Dither: the decode is within s/2 of x on every non-outlier channel, outliers are exact fp16.
  for (int group : {16, 32, 64}) {
    const std::size_t d = 64;
    std::vector<float> x(d), xi(d), dec(d);
    for (float& v : x) v = nd(rng) * 3;
    std::vector<uint8_t> mask(d, 0);
    mask[1] = mask[40] = 1;
    ASSERT_EQ(witcert_dither_values(0x5EED, 2, 1, 17, xi.data(), d), WITCERT_OK);
    for (float v : xi) ASSERT_TRUE(v >= -0.5f && v < 0.5f);
    std::vector<int8_t> codes(d);
    std::vector<uint16_t> scales(d / group), ov(2);
    ASSERT_EQ(witcert_dither_encode(x.data(), xi.data(), mask.data(), d, group, codes.data(), scales.data(), ov.data(), 2), WITCERT_OK);
    ASSERT_EQ(witcert_dither_decode(codes.data(), scales.data(), xi.data(), mask.data(), ov.data(), 2, d, group, dec.data()), WITCERT_OK);
    for (std::size_t i = 0; i < d; ++i) {
      const double ref = fp16_to_double(fp16_from_double(x[i]));
      if (mask[i]) EXPECT_EQ(dec[i], static_cast<float>(ref));
      else EXPECT_LE(std::fabs(dec[i] - ref), fp16_to_double(scales[i / group]) / 2 * (1 + 1e-6) + 1e-6) << i;
    }
    double u = 0, dl = 0;
    ASSERT_EQ(witcert_delta_loc(0.01, 30, 9, 256, &dl), WITCERT_OK);
    ASSERT_EQ(witcert_dither_radius(x.data(), scales.data(), mask.data(), d, group, 0.125, 100, dl, &u), WITCERT_OK);
    EXPECT_GT(u, 0.0);
    EXPECT_TRUE(std::isfinite(u));
  }
}

// A cache over a pool, per scheme, gated and not, page sizes 1 and 16, short and long contexts:
// every output is within the bound its cells give, ‖y − ŷ‖ ≤ (2·meter_K + v_meter)·max‖v‖, and a
// gated cache serves every cell within τ_K.
TEST(CApi, CacheOutputsStayWithinTheirMeters) {
  const witcert_geometry g{2, 4, 2, 64, 300, WITCERT_ROPE_NEOX};
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Case {
    const char* options;
    bool gated;
  };
  for (const Case& cs : {Case{R"({"kv": "q4_0"})", false}, Case{R"({"kv": "q8_0", "kv_v": "q4_0", "tau_k": 0.2})", true},
                         Case{R"({"kv": "dither-int8"})", false}, Case{R"({"kv": "kivi-2bit", "tau_k": 0.1})", true},
                         Case{R"({"kv": "dither-int5", "kv_v": "dither-int4", "tau_k": 0.2})", true},
                         Case{R"({"kv": "fp8-e4m3", "tau_k": 0.3, "granularity": "head"})", true},
                         Case{R"({"kv": "rtn-int4", "page_size": 1})", false}, Case{"{}", false}})
    for (std::int64_t n : {5, 300}) {
      SCOPED_TRACE(std::string(cs.options) + " n " + std::to_string(n));
      witcert_pool* pool = nullptr;
      ASSERT_EQ(witcert_pool_create(&g, cs.options, 0, &pool), WITCERT_OK) << witcert_last_error();
      witcert_cache* cache = nullptr;
      ASSERT_EQ(witcert_cache_create(pool, nullptr, 16, &cache), WITCERT_OK) << witcert_last_error();
      // Keys with a few large channels, as real keys have; values of unit scale.
      std::vector<std::vector<float>> ks, vs;
      for (std::int64_t p = 0; p < n; ++p)
        for (int l = 0; l < g.layers; ++l)
          for (int h = 0; h < g.kv_heads; ++h) {
            std::vector<float> k(64), v(64);
            for (int i = 0; i < 64; ++i) k[i] = nd(rng) * (i % 17 == 0 ? 8.0f : 1.0f), v[i] = nd(rng);
            ASSERT_EQ(witcert_cache_write(cache, l, h, p, k.data(), v.data()), WITCERT_OK) << witcert_last_error();
            if (l == 1 && h == 1) ks.push_back(k), vs.push_back(v);
          }
      const int group = g.q_heads / g.kv_heads;
      std::vector<float> q(static_cast<std::size_t>(group) * 64), out(q.size());
      for (float& x : q) x = nd(rng) * 2;
      std::vector<witcert_cell> cells(group);
      ASSERT_EQ(witcert_cache_attend(cache, 1, 1, q.data(), group, n, out.data(), cells.data()), WITCERT_OK)
          << witcert_last_error();
      double vmax = 0;  // max‖v_t‖ of the exact values; the cache's own max bounds it from above
      for (const auto& v : vs) {
        double s = 0;
        for (float x : v) s += static_cast<double>(fp16_to_double(fp16_from_double(x))) * fp16_to_double(fp16_from_double(x));
        vmax = std::max(vmax, std::sqrt(s));
      }
      for (int h = 0; h < group; ++h) {
        // The exact attention over the fp16 keys and values the exact tier holds.
        std::vector<double> logit(n);
        double mx = -kInf;
        for (std::int64_t t = 0; t < n; ++t) {
          double s = 0;
          for (int i = 0; i < 64; ++i) s += static_cast<double>(q[h * 64 + i]) * fp16_to_double(fp16_from_double(ks[t][i]));
          logit[t] = s / 8.0;
          mx = std::max(mx, logit[t]);
        }
        double z = 0;
        for (double& x : logit) z += x = std::exp(x - mx);
        double err2 = 0;
        for (int i = 0; i < 64; ++i) {
          double y = 0;
          for (std::int64_t t = 0; t < n; ++t) y += logit[t] / z * fp16_to_double(fp16_from_double(vs[t][i]));
          err2 += (y - out[h * 64 + i]) * (y - out[h * 64 + i]);
        }
        const witcert_cell& cell = cells[h];
        EXPECT_EQ(cell.layer, 1);
        EXPECT_EQ(cell.q_head, group + h);
        EXPECT_EQ(cell.pos, n - 1);
        // The served output within its bound, and the bound no looser than the meters say.
        EXPECT_LE(std::sqrt(err2), cell.output_bound * (1 + 1e-5) + 1e-5)
            << "head " << h << " meter " << cell.meter << " v_meter " << cell.v_meter;
        EXPECT_GE(cell.output_bound, (2 * cell.meter + cell.v_meter) * vmax * (1 - 1e-9));
        if (cs.gated) {
          EXPECT_LE(cell.meter, nlohmann::json::parse(cs.options).at("tau_k").get<double>() + 1e-12);
        }
      }
      witcert_cache_stats st{};
      ASSERT_EQ(witcert_cache_stats_get(cache, &st), WITCERT_OK);
      if (!cs.gated) {
        EXPECT_EQ(st.page_ins, 0);
      }
      witcert_pool_stats ps{};
      ASSERT_EQ(witcert_pool_stats_get(pool, &ps), WITCERT_OK);
      EXPECT_LT(ps.free_pages, ps.pages);
      witcert_cache_free(cache);
      ASSERT_EQ(witcert_pool_stats_get(pool, &ps), WITCERT_OK);
      EXPECT_EQ(ps.free_pages, ps.pages);  // the sequence's pages came back
      witcert_pool_free(pool);
    }
}

TEST(CApi, CacheAndPoolRefuseBadArgumentsAndStaleHandles) {
  const auto A = WITCERT_ERROR_INVALID_ARGUMENT;
  witcert_geometry g{2, 4, 2, 64, 64, WITCERT_ROPE_NEOX};
  witcert_pool* pool = nullptr;
  expect_refused(witcert_pool_create(nullptr, "{}", 0, &pool), A, "g");
  expect_refused(witcert_pool_create(&g, "{}", 0, nullptr), A, "pool");
  expect_refused(witcert_pool_create(&g, "{}", -1, &pool), A, "pool_bytes");
  expect_refused(witcert_pool_create(&g, "{\"kv\": ", 0, &pool), A, "options_json");
  expect_refused(witcert_pool_create(&g, "[1]", 0, &pool), A, "options_json");
  expect_refused(witcert_pool_create(&g, R"({"kv": "q5_9"})", 0, &pool), A, "q5_9");
  expect_refused(witcert_pool_create(&g, R"({"kv": "q4_0", "tau_k": -1})", 0, &pool), A, "");
  expect_refused(witcert_pool_create(&g, R"({"kv": "q4_0", "delta": 2})", 0, &pool), A, "");
  expect_refused(witcert_pool_create(&g, R"({"kv": "q4_0"})", 10, &pool), A, "");  // not one page
  for (auto bad : {witcert_geometry{0, 4, 2, 64, 64, WITCERT_ROPE_NEOX}, witcert_geometry{2, 3, 2, 64, 64, WITCERT_ROPE_NEOX},
                   witcert_geometry{2, 4, 0, 64, 64, WITCERT_ROPE_NEOX}, witcert_geometry{2, 4, 2, 63, 64, WITCERT_ROPE_NEOX},
                   witcert_geometry{2, 4, 2, 64, 0, WITCERT_ROPE_NEOX},
                   witcert_geometry{2, 4, 2, 64, 64, static_cast<witcert_rope_layout>(7)}}) {
    EXPECT_EQ(witcert_pool_create(&bad, "{}", 0, &pool), A) << witcert_last_error();
    EXPECT_EQ(pool, nullptr);
  }
  // A pool of two 16-token pages: the third page is refused, and comes back on free.
  ASSERT_EQ(witcert_pool_create(&g, R"({"kv": "q4_0", "page_size": 16})", 0, &pool), WITCERT_OK);
  witcert_pool_stats ps{};
  expect_refused(witcert_pool_stats_get(pool, nullptr), A, "stats");
  expect_refused(witcert_pool_stats_get(nullptr, &ps), A, "pool");
  ASSERT_EQ(witcert_pool_stats_get(pool, &ps), WITCERT_OK);
  EXPECT_EQ(ps.pages, 4);
  EXPECT_EQ(ps.page_size, 16);
  EXPECT_GT(ps.bytes, 0u);
  witcert_cache* cache = nullptr;
  expect_refused(witcert_cache_create(nullptr, nullptr, 16, &cache), A, "pool");
  expect_refused(witcert_cache_create(pool, nullptr, 16, nullptr), A, "cache");
  expect_refused(witcert_cache_create(pool, nullptr, 0, &cache), A, "decode_budget");
  expect_refused(witcert_cache_create(pool, R"({"kv": "q8_0"})", 16, &cache), A, "kv");
  expect_refused(witcert_cache_create(pool, R"({"tau_k": 0.2})", 16, &cache), A, "exact");  // the pool keeps no exact tier
  ASSERT_EQ(witcert_cache_create(pool, R"({"bound": "tanh-half"})", 16, &cache), WITCERT_OK) << witcert_last_error();
  std::vector<float> k(64, 0.5f), v(64, 0.25f), q(128, 1.0f), out(128);
  witcert_cell cells[2];
  expect_refused(witcert_cache_write(cache, 2, 0, 0, k.data(), v.data()), A, "layer");
  expect_refused(witcert_cache_write(cache, 0, -1, 0, k.data(), v.data()), A, "kv_head");
  expect_refused(witcert_cache_write(cache, 0, 0, 64, k.data(), v.data()), WITCERT_ERROR_OUT_OF_RANGE, "pos");
  expect_refused(witcert_cache_write(cache, 0, 0, 1, k.data(), v.data()), A, "in order");
  expect_refused(witcert_cache_write(cache, 0, 0, 0, nullptr, v.data()), A, "k");
  expect_refused(witcert_cache_write(cache, 0, 0, 0, k.data(), nullptr), A, "v");
  k[7] = std::nanf("");
  expect_refused(witcert_cache_write(cache, 0, 0, 0, k.data(), v.data()), A, "k[7]");
  k[7] = 0.5f;
  ASSERT_EQ(witcert_cache_write(cache, 0, 0, 0, k.data(), v.data()), WITCERT_OK);
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 2, 2, out.data(), cells), WITCERT_ERROR_OUT_OF_RANGE, "n_ctx");
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 2, 0, out.data(), cells), WITCERT_ERROR_OUT_OF_RANGE, "n_ctx");
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 3, 1, out.data(), cells), A, "group");
  expect_refused(witcert_cache_attend(cache, 0, 0, nullptr, 2, 1, out.data(), cells), A, "q");
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 2, 1, nullptr, cells), A, "out");
  q[100] = std::nanf("");
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 2, 1, out.data(), cells), A, "q[100]");
  q[100] = 1.0f;
  ASSERT_EQ(witcert_cache_attend(cache, 0, 0, q.data(), 2, 1, out.data(), nullptr), WITCERT_OK) << witcert_last_error();
  expect_refused(witcert_cache_attend(nullptr, 0, 0, q.data(), 2, 1, out.data(), cells), A, "cache");
  expect_refused(witcert_cache_write(nullptr, 0, 0, 0, k.data(), v.data()), A, "cache");
  expect_refused(witcert_cache_stats_get(cache, nullptr), A, "stats");
  // Fill two pages of one stream: the layer-1 streams then find no page left.
  for (std::int64_t p = 1; p < 32; ++p) ASSERT_EQ(witcert_cache_write(cache, 0, 0, p, k.data(), v.data()), WITCERT_OK);
  witcert_cache* other = nullptr;
  ASSERT_EQ(witcert_cache_create(pool, nullptr, 16, &other), WITCERT_OK);
  witcert_status s = WITCERT_OK;
  for (std::int64_t p = 0; p < 64 && s == WITCERT_OK; ++p) s = witcert_cache_write(other, 1, 1, p, k.data(), v.data());
  expect_refused(s, WITCERT_ERROR_OUT_OF_RANGE, "exhausted");
  // A pool with live caches is not freed.
  witcert_pool_free(pool);
  EXPECT_NE(std::string(witcert_last_error()).find("not freed"), std::string::npos);
  ASSERT_EQ(witcert_pool_stats_get(pool, &ps), WITCERT_OK);
  // Stale handles: refused without being read.
  witcert_cache_free(cache);
  witcert_cache_free(other);
  witcert_cache_free(nullptr);
  witcert_cache_stats st{};
  expect_refused(witcert_cache_stats_get(cache, &st), WITCERT_ERROR_INVALID_HANDLE, "cache");
  expect_refused(witcert_cache_write(cache, 0, 0, 0, k.data(), v.data()), WITCERT_ERROR_INVALID_HANDLE, "cache");
  expect_refused(witcert_cache_attend(cache, 0, 0, q.data(), 2, 1, out.data(), cells), WITCERT_ERROR_INVALID_HANDLE, "cache");
  witcert_cache_free(cache);  // a second free is refused, not a double free
  expect_refused(WITCERT_ERROR_INVALID_HANDLE, WITCERT_ERROR_INVALID_HANDLE, "not a live handle");
  ASSERT_EQ(witcert_pool_stats_get(pool, &ps), WITCERT_OK);
  EXPECT_EQ(ps.free_pages, ps.pages);
  witcert_pool_free(pool);
  expect_refused(witcert_pool_stats_get(pool, &ps), WITCERT_ERROR_INVALID_HANDLE, "pool");
  expect_refused(witcert_cache_create(pool, nullptr, 16, &cache), WITCERT_ERROR_INVALID_HANDLE, "pool");
  int not_a_handle = 0;
  expect_refused(witcert_pool_stats_get(reinterpret_cast<witcert_pool*>(&not_a_handle), &ps), WITCERT_ERROR_INVALID_HANDLE,
                 "pool");
  witcert_pool_free(nullptr);
}

struct Collected {
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<witcert_step_meter> steps;
  int cancel_after = -1;
};

int collect(void* user, int32_t token, const char* piece, const witcert_step_meter* meter) {
  auto* c = static_cast<Collected*>(user);
  c->tokens.push_back(token);
  c->text += piece;
  if (meter) c->steps.push_back(*meter);
  return c->cancel_after >= 0 && static_cast<int>(c->tokens.size()) >= c->cancel_after;
}

TEST(CApi, TheEngineGeneratesWhatTheLibraryGenerates) {
  witcert_engine* e = nullptr;
  expect_refused(witcert_engine_load("/nonexistent/model.gguf", 2, &e), WITCERT_ERROR_IO, "/nonexistent/model.gguf");
  expect_refused(witcert_engine_load(nullptr, 2, &e), WITCERT_ERROR_INVALID_ARGUMENT, "gguf_path");
  expect_refused(witcert_engine_load(model_path().c_str(), 0, &e), WITCERT_ERROR_INVALID_ARGUMENT, "threads");
  ASSERT_EQ(witcert_engine_load(model_path().c_str(), 2, &e), WITCERT_OK) << witcert_last_error();

  // The library's own run of the same request.
  const engine::Model m = engine::Model::load(model_path());
  const std::string prompt = "The capital of France is";
  const std::vector<std::int32_t> ids = m.prompt_tokens(prompt, false);
  size_t n = 0;
  std::vector<int32_t> got(4);
  expect_refused(witcert_engine_tokenize(e, prompt.c_str(), 0, got.data(), 2, &n), WITCERT_ERROR_BUFFER_TOO_SMALL, "buffer");
  EXPECT_EQ(n, ids.size());
  expect_refused(witcert_engine_tokenize(e, nullptr, 0, got.data(), 4, &n), WITCERT_ERROR_INVALID_ARGUMENT, "text");
  expect_refused(witcert_engine_tokenize(e, "x", 0, nullptr, 4, &n), WITCERT_ERROR_INVALID_ARGUMENT, "tokens");
  expect_refused(witcert_engine_tokenize(e, "x", 0, got.data(), 4, nullptr), WITCERT_ERROR_INVALID_ARGUMENT, "n");
  expect_refused(witcert_engine_tokenize(nullptr, "x", 0, got.data(), 4, &n), WITCERT_ERROR_INVALID_ARGUMENT, "engine");
  expect_refused(witcert_engine_load(model_path().c_str(), 2, nullptr), WITCERT_ERROR_INVALID_ARGUMENT, "engine");
  got.resize(n);
  ASSERT_EQ(witcert_engine_tokenize(e, prompt.c_str(), 0, got.data(), got.size(), &n), WITCERT_OK);
  EXPECT_EQ(got, ids);

  const int max_tokens = model::kSanitized ? 4 : 12;
  for (const char* kv : {"q4_0", "dither-int8"}) {
    SCOPED_TRACE(kv);
    const nlohmann::json req = {{"max_tokens", max_tokens}, {"kv", kv}, {"tau_k", 0.2}};
    engine::CacheOptions co = engine::CacheOptions::from_json({{"kv", kv}, {"tau_k", 0.2}});
    const model::LlamaConfig& cfg = m.model->config();
    const engine::Cache c = engine::make_cache(cfg, static_cast<std::int64_t>(ids.size()) + max_tokens, max_tokens, co);
    ThreadPool threads(2);
    engine::Session session(*m.model, *c.kv, threads);
    engine::GenerateOptions go;
    go.max_new_tokens = max_tokens;
    go.stop_tokens = m.stop_tokens();
    const engine::GenerateResult want = engine::generate(session, ids, go);

    Collected col;
    witcert_generation r{};
    char text[4096];
    size_t needed = 0;
    ASSERT_EQ(witcert_engine_generate(e, prompt.c_str(), req.dump().c_str(), collect, &col, &r, text, sizeof text, &needed),
              WITCERT_OK)
        << witcert_last_error();
    EXPECT_EQ(col.tokens, want.tokens);
    EXPECT_EQ(std::string(text), col.text);
    EXPECT_EQ(needed, col.text.size() + 1);
    EXPECT_EQ(r.prompt_tokens, static_cast<int64_t>(ids.size()));
    EXPECT_EQ(r.completion_tokens, static_cast<int64_t>(want.tokens.size()));
    EXPECT_EQ(r.has_meter, 1);
    EXPECT_GT(r.cells, 0);
    EXPECT_DOUBLE_EQ(r.coverage_k, 1.0);  // gated at the coverage τ: every served cell within it
    // One step meter per token, each over every (layer, head) cell of its forward pass.
    ASSERT_EQ(col.steps.size(), col.tokens.size());
    std::int64_t repaired = 0;
    for (const witcert_step_meter& s : col.steps) {
      EXPECT_EQ(s.cells, static_cast<int64_t>(cfg.layers) * cfg.heads);
      EXPECT_LE(s.meter_max, 0.2 + 1e-12);
      EXPECT_DOUBLE_EQ(s.coverage_k, 1.0);
      repaired += s.repaired;
    }
    // Gated at τ: every cell met it, with the gate's work or without.
    EXPECT_EQ(r.verdict, repaired > 0 || r.page_ins > 0 ? WITCERT_VERDICT_REPAIRED : WITCERT_VERDICT_CERTIFIED) << kv;
    EXPECT_NE(std::string(r.reason).find("cells met tau_K 0.2"), std::string::npos) << r.reason;
  }
  // Cancel after three tokens; a text buffer too small; bad requests.
  Collected col;
  col.cancel_after = 3;
  witcert_generation r{};
  char small[2];
  size_t needed = 0;
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"max_tokens": 8})", collect, &col, &r, small, sizeof small, &needed),
                 WITCERT_ERROR_BUFFER_TOO_SMALL, "buffer");
  EXPECT_EQ(r.completion_tokens, 3);
  EXPECT_EQ(r.cancelled, 1);
  EXPECT_EQ(r.has_meter, 0);  // the plain cache
  EXPECT_EQ(needed, col.text.size() + 1);
  const auto A = WITCERT_ERROR_INVALID_ARGUMENT;
  expect_refused(witcert_engine_generate(e, prompt.c_str(), "{", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "request_json");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"max_tokens": -1})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"temperature": -1})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "temperature");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"kv": "q4_0", "tau_k": -0.5})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"tools": []})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "tools");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"prompt": "x"})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "prompt");
  expect_refused(witcert_engine_generate(e, "", nullptr, nullptr, nullptr, &r, nullptr, 0, nullptr), A, "empty");
  expect_refused(witcert_engine_generate(e, nullptr, nullptr, nullptr, nullptr, &r, nullptr, 0, nullptr), A, "prompt");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr), A, "result");
  std::string beyond;
  while (m.prompt_tokens(beyond, false).size() <= static_cast<std::size_t>(m.model->config().context)) beyond += "the boats and the nets ";
  expect_refused(witcert_engine_generate(e, beyond.c_str(), nullptr, nullptr, nullptr, &r, nullptr, 0, nullptr),
                 WITCERT_ERROR_OUT_OF_RANGE, "context");
  expect_refused(witcert_engine_generate(nullptr, prompt.c_str(), nullptr, nullptr, nullptr, &r, nullptr, 0, nullptr), A, "engine");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), nullptr, nullptr, nullptr, &r, nullptr, 8, nullptr), A, "text");
  witcert_engine_free(e);
  witcert_engine_free(nullptr);
  expect_refused(witcert_engine_tokenize(e, "x", 0, got.data(), got.size(), &n), WITCERT_ERROR_INVALID_HANDLE, "engine");
  expect_refused(witcert_engine_generate(e, prompt.c_str(), nullptr, nullptr, nullptr, &r, nullptr, 0, nullptr),
                 WITCERT_ERROR_INVALID_HANDLE, "engine");
}

}  // namespace
