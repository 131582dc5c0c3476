// The C API against the C++ library it wraps: the same numbers bit for bit, every function refusing
// each kind of bad argument with a status and a message, handles refused after their free, and
// the certified cache's outputs within their meters' bounds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
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
  expect_refused(witcert_meter_probs(p_neg, c, 2, &b), A, "p_tilde[1]");
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
  for (const Case& cs : {Case{R"({"kv": "q4_0"})", false}, Case{R"({"kv": "q8_0", "kv_v": "q4_0", "gate": 0.2})", true},
                         Case{R"({"kv": "dither-int8"})", false}, Case{R"({"kv": "kivi-2bit", "gate": 0.1})", true},
                         Case{R"({"kv": "fp8-e4m3", "gate": 0.3, "granularity": "head"})", true},
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
          EXPECT_LE(cell.meter, nlohmann::json::parse(cs.options).at("gate").get<double>() + 1e-12);
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
  expect_refused(witcert_pool_create(&g, R"({"kv": "q4_0", "gate": -1})", 0, &pool), A, "");
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
  expect_refused(witcert_cache_create(pool, R"({"gate": 0.2})", 16, &cache), A, "exact");  // the pool keeps no exact tier
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
    const nlohmann::json req = {{"max_tokens", max_tokens}, {"kv", kv}, {"gate", 0.2}};
    engine::CacheOptions co = engine::CacheOptions::from_json({{"kv", kv}, {"gate", 0.2}});
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
    for (const witcert_step_meter& s : col.steps) {
      EXPECT_EQ(s.cells, static_cast<int64_t>(cfg.layers) * cfg.heads);
      EXPECT_LE(s.meter_max, 0.2 + 1e-12);
      EXPECT_DOUBLE_EQ(s.coverage_k, 1.0);
    }
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
  expect_refused(witcert_engine_generate(e, prompt.c_str(), R"({"kv": "q4_0", "gate": -0.5})", nullptr, nullptr, &r, nullptr, 0, nullptr), A, "");
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
