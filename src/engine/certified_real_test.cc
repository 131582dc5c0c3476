// Soundness of the certified cache on the real SmolLM2-135M: a teacher-forced run over a fixed
// paragraph (non-adaptive: the query of layer l depends only on the dither of layers < l), every
// (layer, query head, position) cell checked against the true TV from the exact tier.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <tuple>
#include <string>
#include <vector>

#include "engine/cache_factory.h"
#include "engine/session.h"
#include "gate/certified_cache.h"
#include "model/real_model_fixture.h"

namespace witcert::engine {
namespace {

class CertifiedRealModel : public model::RealModelFixture {
 protected:
  void SetUp() override {
    model::RealModelFixture::SetUp();
    if (HasFatalFailure()) return;
    tokens_ = tok_->encode(
        "Gutenberg's press spread across Europe within decades. Scholars could now compare identical copies "
        "of the same text, and the price of books fell so far that ordinary merchants began to own them.",
        false);
  }

  struct Outcome {
    long cells = 0, violations = 0, covered = 0;
    double worst = 0.0;
  };

  Outcome run(const std::string& k_fmt, const std::string& v_fmt,
              kvcache::DitherMode dither = kvcache::DitherMode::per_slot) {
    const model::LlamaConfig& cfg = model_->config();
    CacheOptions opts;
    opts.certified = true;
    opts.k_format = formats::KvFormat::parse(k_fmt);
    opts.v_format = formats::KvFormat::parse(v_fmt);
    opts.dither = dither;
    opts.check_soundness = true;
    gate::CellLog log;
    const Cache cache = make_cache(cfg, static_cast<std::int64_t>(tokens_.size()), 256, opts, {&log});
    ThreadPool pool(2);
    Session(*model_, *cache.kv, pool, 16).prefill(tokens_);
    Outcome o;
    for (const gate::MeterCell& c : log.cells()) {
      ++o.cells;
      o.covered += c.meter <= 0.2;
      if (c.meter > 0) o.worst = std::max(o.worst, c.tv / c.meter);
      if (!(c.tv <= c.meter * (1 + 1e-9) + 1e-12)) ++o.violations;
    }
    return o;
  }

  std::vector<std::int32_t> tokens_;
};

TEST_F(CertifiedRealModel, EveryTierASchemeHasZeroViolations) {
  for (const std::string& scheme : formats::kv_scheme_names()) {
    const Outcome o = run(scheme, scheme);
    std::printf("[certified-real] %-16s %ld cells, coverage@0.2 %.3f, violations %ld, worst TV/meter %.3f\n",
                scheme.c_str(), o.cells, static_cast<double>(o.covered) / o.cells, o.violations, o.worst);
    EXPECT_EQ(o.violations, 0) << scheme;
    EXPECT_EQ(o.cells, static_cast<long>(model_->config().layers) * model_->config().heads *
                           static_cast<long>(tokens_.size()))
        << "every (layer, query head, position) cell is metered";
  }
}

TEST_F(CertifiedRealModel, DitherInt8HasZeroViolationsTeacherForced) {
  const Outcome o = run(kvcache::kDitherInt8, kvcache::kDitherInt8);
  std::printf("[certified-real] dither-int8      %ld cells, coverage@0.2 %.3f, violations %ld, worst TV/meter %.3f\n",
              o.cells, static_cast<double>(o.covered) / o.cells, o.violations, o.worst);
  EXPECT_EQ(o.violations, 0);
  EXPECT_GT(static_cast<double>(o.covered) / o.cells, 0.5) << "8-bit certified coverage should be high";
}

TEST_F(CertifiedRealModel, SharedPageDitherHasZeroViolationsTeacherForced) {
  // One ξ per page and channel: within the same non-adaptive scope, the same certificate
  // (docs/dither-cost.md).
  const Outcome o = run(kvcache::kDitherInt8, kvcache::kDitherInt8, kvcache::DitherMode::shared_page);
  std::printf("[certified-real] dither-int8 shared-page %ld cells, coverage@0.2 %.3f, violations %ld, worst TV/meter %.3f\n",
              o.cells, static_cast<double>(o.covered) / o.cells, o.violations, o.worst);
  EXPECT_EQ(o.violations, 0);
  EXPECT_GT(static_cast<double>(o.covered) / o.cells, 0.5);
}



// A gated prefill repairs pages that later positions of the same head read; with the cache's
// per-head (and, for request granularity, serial) concurrency the result does not depend on the
// thread count or timing: logits, page-ins and every cell are the same at 1 and 2 threads.
TEST_F(CertifiedRealModel, GatedPrefillIsIndependentOfThreads) {
  std::vector<std::int32_t> prompt;
  for (int i = 0; i < 4; ++i) prompt.insert(prompt.end(), tokens_.begin(), tokens_.end());
  const model::LlamaConfig& cfg = model_->config();
  for (const gate::Granularity gran : {gate::Granularity::block, gate::Granularity::request}) {
    struct Result {
      std::vector<float> logits;
      std::int64_t page_in_bytes;
      std::vector<gate::MeterCell> cells;
    };
    const auto prefill = [&](int threads) {
      CacheOptions opts;
      opts.certified = true;
      opts.k_format = opts.v_format = formats::KvFormat::parse("q4_0");
      opts.gate = gate::Policy::from_tau_k(0.3, gran);
      gate::CellLog log;
      const Cache cache = make_cache(cfg, static_cast<std::int64_t>(prompt.size()), 256, opts, {&log});
      ThreadPool pool(threads);
      Result r;
      Session session(*model_, *cache.kv, pool, static_cast<int>(prompt.size()));
      const std::span<const float> last = session.prefill(prompt);
      r.logits.assign(last.begin(), last.end());
      r.page_in_bytes = cache.certified->store().page_in_stats().page_in_bytes;
      r.cells = log.cells();
      std::sort(r.cells.begin(), r.cells.end(), [](const gate::MeterCell& a, const gate::MeterCell& b) {
        return std::tie(a.layer, a.q_head, a.pos) < std::tie(b.layer, b.q_head, b.pos);
      });
      return r;
    };
    const Result one = prefill(1), two = prefill(2);
    EXPECT_GT(one.page_in_bytes, 0);
    EXPECT_EQ(one.page_in_bytes, two.page_in_bytes);
    EXPECT_EQ(one.logits, two.logits);
    ASSERT_EQ(one.cells.size(), two.cells.size());
    for (std::size_t i = 0; i < one.cells.size(); ++i) {
      ASSERT_EQ(one.cells[i].pos, two.cells[i].pos);
      ASSERT_EQ(one.cells[i].meter, two.cells[i].meter) << "cell " << i;
      ASSERT_EQ(one.cells[i].repaired, two.cells[i].repaired) << "cell " << i;
    }
  }
}

}  // namespace
}  // namespace witcert::engine
