// A report kept apart from its cache (witcert_cache_keep_cells, witcert_cache_drain_cells,
// witcert_report_*): the cells drained from a cache, counted elsewhere, give the cache's own
// `witcert` object, also when they arrive split by heads as tensor-parallel ranks send them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "witcert/witcert.h"

namespace {

// The text a C call writes with the library's two-call protocol: asked for its size, then written.
template <class Call>
std::string text_of(Call call) {
  size_t needed = 0;
  EXPECT_EQ(call(nullptr, 0, &needed), WITCERT_ERROR_BUFFER_TOO_SMALL);
  std::string text(needed, '\0');
  EXPECT_EQ(call(text.data(), text.size(), &needed), WITCERT_OK) << witcert_last_error();
  text.resize(needed - 1);
  return text;
}

std::string cache_report(const witcert_cache* c) {
  return text_of([&](char* json, size_t cap, size_t* n) { return witcert_cache_report(c, json, cap, n); });
}

std::string report_json(const witcert_report* r) {
  return text_of([&](char* json, size_t cap, size_t* n) { return witcert_report_json(r, json, cap, n); });
}

std::vector<witcert_report_cell> drain(witcert_cache* c) {
  size_t n = 0;
  const witcert_status s = witcert_cache_drain_cells(c, nullptr, 0, &n);
  EXPECT_TRUE(s == WITCERT_OK || s == WITCERT_ERROR_BUFFER_TOO_SMALL) << witcert_last_error();
  std::vector<witcert_report_cell> cells(n);
  EXPECT_EQ(witcert_cache_drain_cells(c, cells.data(), cells.size(), &n), WITCERT_OK) << witcert_last_error();
  cells.resize(n);
  return cells;
}

// One sequence of `geometry` under `options`: a prompt of `prompt` positions, then decode steps to
// `n`, every layer and KV head written and attended at each position, with keys whose channel 3 is
// an outlier (so that q4_0's meter spreads over τ).
struct Metered {
  witcert_pool* pool = nullptr;
  witcert_cache* cache = nullptr;
  Metered(const witcert_geometry& g, const char* options, std::int64_t prompt, std::int64_t n, bool keep,
      unsigned seed) {
    EXPECT_EQ(witcert_pool_create(&g, options, 0, &pool), WITCERT_OK) << witcert_last_error();
    EXPECT_EQ(witcert_cache_create(pool, nullptr, g.capacity, &cache), WITCERT_OK) << witcert_last_error();
    EXPECT_EQ(witcert_cache_report_start(cache, prompt), WITCERT_OK);
    EXPECT_EQ(witcert_cache_keep_cells(cache, keep ? 1 : 0), WITCERT_OK);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    const int group = g.q_heads / g.kv_heads, d = g.head_dim;
    std::vector<float> k(d), v(d), q(group * d), out(group * d);
    std::vector<witcert_cell> cells(group);
    for (std::int64_t p = 0; p < n; ++p)
      for (int l = 0; l < g.layers; ++l)
        for (int h = 0; h < g.kv_heads; ++h) {
          for (int i = 0; i < d; ++i) k[i] = nd(rng) * (i == 3 ? 9.0f : 1.0f), v[i] = nd(rng);
          for (float& x : q) x = nd(rng);
          EXPECT_EQ(witcert_cache_write(cache, l, h, p, k.data(), v.data()), WITCERT_OK) << witcert_last_error();
          EXPECT_EQ(witcert_cache_attend(cache, l, h, q.data(), group, p + 1, out.data(), cells.data()), WITCERT_OK);
        }
  }
  ~Metered() {
    witcert_cache_free(cache);
    witcert_pool_free(pool);
  }
};

const witcert_geometry kGeometry{2, 4, 2, 64, 40, WITCERT_ROPE_NEOX};

TEST(CApiReport, DrainedCellsGiveTheCachesOwnObjectWholeOrSplitByHeads) {
  for (const char* options :
       {R"({"kv": "q4_0", "tau_k": 0.2, "check_soundness": true})", R"({"kv": "q4_0", "check_soundness": true})",
        R"({"kv": "dither-int8"})", R"({"kv": "q8_0", "kv_v": "q4_0", "tau_k": 0.1, "tau_v": 0.02,
            "granularity": "head"})"}) {
    SCOPED_TRACE(options);
    Metered run(kGeometry, options, 12, 40, true, 5);
    const std::string own = cache_report(run.cache);
    const std::vector<witcert_report_cell> cells = drain(run.cache);
    ASSERT_EQ(cells.size(), (40u - 12u) * 2 * 4);  // decode steps × layers × query heads
    EXPECT_TRUE(drain(run.cache).empty());         // drained once
    witcert_cache_stats st{};
    ASSERT_EQ(witcert_cache_stats_get(run.cache, &st), WITCERT_OK);

    witcert_report* whole = nullptr;
    ASSERT_EQ(witcert_report_create(options, 2, 4, 12, &whole), WITCERT_OK) << witcert_last_error();
    ASSERT_EQ(witcert_report_record(whole, cells.data(), cells.size()), WITCERT_OK) << witcert_last_error();
    ASSERT_EQ(witcert_report_add_page_ins(whole, st.page_ins, st.page_in_bytes), WITCERT_OK);
    EXPECT_EQ(report_json(whole), own);

    // Two ranks, each with its own heads, arriving step by step in either order.
    std::vector<witcert_report_cell> rank[2];
    for (const witcert_report_cell& c : cells) rank[c.q_head / 2].push_back(c);
    witcert_report* merged = nullptr;
    ASSERT_EQ(witcert_report_create(options, 2, 4, 12, &merged), WITCERT_OK);
    for (int r : {1, 0}) ASSERT_EQ(witcert_report_record(merged, rank[r].data(), rank[r].size()), WITCERT_OK);
    ASSERT_EQ(witcert_report_add_page_ins(merged, st.page_ins, st.page_in_bytes), WITCERT_OK);
    EXPECT_EQ(report_json(merged), own);
    const nlohmann::json j = nlohmann::json::parse(own);
    EXPECT_EQ(j.at("cells"), 28 * 8);
    witcert_report_free(whole);
    witcert_report_free(merged);
  }
}

TEST(CApiReport, CellsAreKeptOnlyWhenAskedAndADrainThatDoesNotFitMovesNone) {
  Metered off(kGeometry, R"({"kv": "q4_0"})", 30, 40, false, 6);
  EXPECT_TRUE(drain(off.cache).empty());
  Metered on(kGeometry, R"({"kv": "q4_0"})", 30, 40, true, 6);
  size_t n = 0;
  std::vector<witcert_report_cell> few(5);
  EXPECT_EQ(witcert_cache_drain_cells(on.cache, few.data(), few.size(), &n), WITCERT_ERROR_BUFFER_TOO_SMALL);
  EXPECT_EQ(n, 10u * 8);
  EXPECT_EQ(drain(on.cache).size(), 10u * 8);  // the refused drain moved none
  EXPECT_EQ(witcert_cache_drain_cells(on.cache, nullptr, 0, nullptr), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_cache_keep_cells(on.cache, 2), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_cache_keep_cells(nullptr, 1), WITCERT_ERROR_INVALID_ARGUMENT);
}

TEST(CApiReport, EveryImpossibleCellIsRefusedAndNoneOfItsBatchCounted) {
  Metered run(kGeometry, R"({"kv": "q4_0"})", 30, 34, true, 7);
  const std::vector<witcert_report_cell> cells = drain(run.cache);
  ASSERT_FALSE(cells.empty());
  witcert_report* r = nullptr;
  ASSERT_EQ(witcert_report_create(R"({"kv": "q4_0"})", 2, 4, 30, &r), WITCERT_OK);
  const std::string empty = report_json(r);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = HUGE_VAL;
  using Edit = void (*)(witcert_report_cell&, double, double);
  const std::vector<std::pair<const char*, Edit>> edits = {
      {"layer", [](witcert_report_cell& c, double, double) { c.layer = 2; }},
      {"layer", [](witcert_report_cell& c, double, double) { c.layer = -1; }},
      {"q_head", [](witcert_report_cell& c, double, double) { c.q_head = 4; }},
      {"pos", [](witcert_report_cell& c, double, double) { c.pos = -3; }},
      {"meter", [](witcert_report_cell& c, double n, double) { c.meter = n; }},
      {"meter", [](witcert_report_cell& c, double, double) { c.meter = 1.5; }},
      {"meter", [](witcert_report_cell& c, double, double i) { c.meter_before = i; }},
      {"score", [](witcert_report_cell& c, double n, double) { c.raw = n; }},
      {"score", [](witcert_report_cell& c, double, double) { c.v_meter = -0.1; }},
      {"score", [](witcert_report_cell& c, double n, double) { c.output_bound = n; }},
      {"checked", [](witcert_report_cell& c, double, double) { c.tv = -1; }},
      {"repaired", [](witcert_report_cell& c, double, double) { c.repaired = 2; }},
  };
  for (const auto& [what, edit] : edits) {
    std::vector<witcert_report_cell> bad = cells;
    edit(bad[3], nan, inf);
    EXPECT_EQ(witcert_report_record(r, bad.data(), bad.size()), WITCERT_ERROR_INVALID_ARGUMENT) << what;
    EXPECT_NE(std::string(witcert_last_error()).find("cells[3]"), std::string::npos) << witcert_last_error();
  }
  EXPECT_EQ(report_json(r), empty);  // nothing of a refused batch was counted
  std::vector<witcert_report_cell> no_guarantee = cells;
  no_guarantee[0].raw = no_guarantee[0].raw_before = inf;  // +inf raw: a cell without a guarantee
  no_guarantee[0].meter = no_guarantee[0].meter_before = 1.0;
  EXPECT_EQ(witcert_report_record(r, no_guarantee.data(), no_guarantee.size()), WITCERT_OK) << witcert_last_error();
  EXPECT_EQ(witcert_report_add_page_ins(r, -1, 0), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_record(r, nullptr, 1), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_record(r, nullptr, 0), WITCERT_OK);
  witcert_report_free(r);
  EXPECT_EQ(witcert_report_json(r, nullptr, 0, nullptr), WITCERT_ERROR_INVALID_HANDLE);  // freed
}

TEST(CApiReport, ImpossibleOptionsAreRefusedAndTheExactCacheIsUnmetered) {
  witcert_report* r = nullptr;
  EXPECT_EQ(witcert_report_create(R"({"kv": "q9_9"})", 2, 4, 0, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_create(R"({"kv": "q4_0", "tau_k": -1})", 2, 4, 0, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_create("[1, 2", 2, 4, 0, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_create("{}", 0, 4, 0, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_create("{}", 2, 0, 0, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(witcert_report_create("{}", 2, 4, -1, &r), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(r, nullptr);
  ASSERT_EQ(witcert_report_create("{}", 2, 4, 0, &r), WITCERT_OK);
  const nlohmann::json j = nlohmann::json::parse(report_json(r));
  EXPECT_EQ(j.at("verdict"), "unmetered");
  witcert_report_cell c{};
  EXPECT_EQ(witcert_report_record(r, &c, 1), WITCERT_ERROR_INVALID_ARGUMENT);
  witcert_report_free(r);
  witcert_report_free(nullptr);
}

}  // namespace

namespace {

TEST(CApiReport, APromotionDecidedElsewhereServesEveryWrittenPageExact) {
  // The request-level repair a tensor-parallel rank takes when another rank's heads asked for it.
  // q8_0 stays well within τ_K 0.5 here, so the cache's own gate promotes nothing.
  Metered run(kGeometry, R"({"kv": "q8_0", "tau_k": 0.5, "granularity": "request", "page_size": 4})", 0, 20, false,
              8);
  witcert_cache_stats before{}, after{};
  ASSERT_EQ(witcert_cache_stats_get(run.cache, &before), WITCERT_OK);
  std::int64_t pages = -1;
  ASSERT_EQ(witcert_cache_promote_all(run.cache, 19, &pages), WITCERT_OK) << witcert_last_error();
  ASSERT_EQ(witcert_cache_stats_get(run.cache, &after), WITCERT_OK);
  EXPECT_EQ(before.page_ins, 0);
  EXPECT_EQ(pages, 2 * 2 * 5);  // layers × KV heads × pages of 20 positions: every written page
  EXPECT_EQ(after.page_ins, pages);
  ASSERT_EQ(witcert_cache_promote_all(run.cache, 19, &pages), WITCERT_OK);
  EXPECT_EQ(pages, 0);  // nothing left to promote
  // Every cell over the promoted positions now reads exact: raw score 0.
  std::vector<float> q(2 * 64, 0.3f), out(2 * 64);
  std::vector<witcert_cell> cells(2);
  ASSERT_EQ(witcert_cache_attend(run.cache, 1, 1, q.data(), 2, 20, out.data(), cells.data()), WITCERT_OK);
  EXPECT_EQ(cells[0].raw, 0.0);
  EXPECT_EQ(cells[1].meter, 0.0);
  EXPECT_EQ(witcert_cache_promote_all(run.cache, 40, nullptr), WITCERT_ERROR_INVALID_ARGUMENT);
  Metered ungated(kGeometry, R"({"kv": "q4_0"})", 0, 3, false, 8);
  EXPECT_EQ(witcert_cache_promote_all(ungated.cache, 1, nullptr), WITCERT_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(witcert_last_error()).find("no gate"), std::string::npos);
}

}  // namespace
