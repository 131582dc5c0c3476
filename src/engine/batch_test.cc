// Many sequences over one pool on the real SmolLM2-135M: every sequence's tokens, meters and
// page-ins equal its run alone bit for bit, whatever runs beside it, for the plain cache and
// every kind of certified format, gated or not; preemption and recompute change nothing; the
// measured bytes never exceed the budget; a bad request fails alone.
#include "engine/batch.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "attention/cpu/exact_cache.h"
#include "engine/cache_factory.h"
#include "engine/session.h"
#include "model/real_model_fixture.h"

namespace witcert::engine {
namespace {

using RealModel = model::RealModelFixture;

struct Solo {
  std::vector<std::int32_t> tokens;
  bool stopped = false;
  gate::TelemetrySummary meter;
  std::int64_t page_ins = 0, page_in_bytes = 0;
};

CacheOptions format(const std::string& k, const std::string& v, double tau, gate::Granularity g) {
  CacheOptions o;
  if (k.empty()) return o;
  o.certified = true;
  o.k_format = formats::KvFormat::parse(k);
  o.v_format = formats::KvFormat::parse(v);
  o.gate.set_tau_k(tau);
  o.gate.granularity = g;
  o.backing = kvcache::BackingPlace::in_ram();
  return o;
}

// The request alone, through the one-sequence session (as `witcert generate` runs it).
Solo solo(const model::LlamaModel& m, const BatchRequest& q, const std::vector<std::int32_t>& stop, ThreadPool& pool) {
  const model::LlamaConfig& cfg = m.config();
  const std::int64_t capacity = std::min<std::int64_t>(cfg.context, static_cast<std::int64_t>(q.prompt.size()) + q.max_tokens);
  gate::Telemetry tel(cfg.layers, cfg.heads,
                      {q.coverage_tau, q.coverage_tau_v, q.cache.bound, static_cast<std::int64_t>(q.prompt.size()), 1});
  Cache cache = make_cache(cfg, capacity, q.max_tokens, q.cache, {&tel});
  Session session(m, *cache.kv, pool);
  GenerateOptions opts;
  opts.max_new_tokens = q.max_tokens;
  opts.sampler = q.sampler;
  opts.stop_tokens = stop;
  const GenerateResult r = generate(session, q.prompt, opts);
  Solo s{r.tokens, r.stopped, tel.summary(), 0, 0};
  if (cache.certified) {
    s.page_ins = cache.certified->store().page_in_stats().page_ins;
    s.page_in_bytes = cache.certified->store().page_in_stats().page_in_bytes;
    s.meter.page_ins = s.page_ins;  // as the engine sets it, prefill's promotions included
  }
  return s;
}

void expect_same(const Solo& a, const BatchResult& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(b.tokens, a.tokens);
  EXPECT_EQ(b.finish == Finish::stop, a.stopped);
  // A shared prefix brings the donor's repairs of it, paged in (and counted) once, by the donor.
  EXPECT_EQ(b.page_ins + b.shared_page_ins, a.page_ins);
  if (b.shared_page_ins == 0) {
    EXPECT_EQ(b.page_in_bytes, a.page_in_bytes);
  } else {
    EXPECT_LT(b.page_in_bytes, a.page_in_bytes);
  }
  if (!b.has_meter) return;
  // Every figure of the summary, compared as its JSON (doubles print round-trip exact).
  EXPECT_EQ(b.meter.to_json().dump(), a.meter.to_json().dump());
}

// Eight requests of different lengths, budgets and samplers (five shorter ones under the sanitizers).
std::vector<BatchRequest> requests(const model::Tokenizer& tok, const CacheOptions& cache,
                                   int count = model::kSanitized ? 5 : 8) {
  const char* texts[] = {
      "The capital of France is",
      "Once upon a time, in a small village by the sea, there lived an old fisherman who",
      "def fibonacci(n):",
      "List three colors:",
      "The river town kept its records in a long stone hall by the water, and every spring the clerks counted the "
      "boats, the nets, the bales of wool and the barrels of salted fish that came down from the hills. The river "
      "town kept its records in a long stone hall by the water. Question: what did the clerks count?",
      "Water boils at",
      "A haiku about autumn:",
      "In 1969, the first humans",
  };
  std::vector<BatchRequest> out;
  for (int i = 0; i < count; ++i) {
    BatchRequest q;
    q.prompt = tok.encode(texts[i], false);
    q.max_tokens = model::kSanitized ? 3 + 2 * (i % 4) : 6 + 5 * (i % 4);
    q.sampler.temperature = i % 3 == 2 ? 0.8f : 0.0f;  // some sample: the sampler's stream is the request's own
    q.sampler.seed = 17 + i;
    q.cache = cache;
    out.push_back(q);
  }
  return out;
}

// One cache kind: K and V formats, τ_K and the gate's granularity; empty formats are the plain cache.
struct Kind {
  std::string k, v;
  double tau;
  gate::Granularity g;
  bool sanitized;  // also run in the sanitizer build
};

void PrintTo(const Kind& c, std::ostream* os) {
  *os << (c.k.empty() ? std::string("plain") : c.k + "/" + c.v + " tau " + std::to_string(c.tau));
}

std::string kind_name(const ::testing::TestParamInfo<Kind>& info) {
  const Kind& c = info.param;
  std::string n = c.k.empty() ? "plain" : c.k + "_" + c.v + (c.tau > 0 ? "_gated" : "");
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

class BatchKind : public model::RealModelFixture, public ::testing::WithParamInterface<Kind> {
 protected:
  void SetUp() override {
    if (model::kSanitized && !GetParam().sanitized) GTEST_SKIP() << "run in the release build";
    model::RealModelFixture::SetUp();
  }
  CacheOptions cache() const { return format(GetParam().k, GetParam().v, GetParam().tau, GetParam().g); }
};

using BatchInvariance = BatchKind;
using BatchPreemption = BatchKind;
using BatchSharedPrefix = BatchKind;
using BatchRepairPolicy = BatchKind;

TEST_P(BatchInvariance, EverySequenceEqualsItsSoloRun) {
  ThreadPool pool(2);
  const std::vector<std::int32_t> stop = {tok_->eos()};
  const std::vector<BatchRequest> all = requests(*tok_, cache());
  std::vector<Solo> alone;
  for (const BatchRequest& q : all) alone.push_back(solo(*model_, q, stop, pool));
  // One at a time, a few, and all at once, with pages that join and leave mid-run.
  const std::vector<int> widths = model::kSanitized ? std::vector<int>{8} : std::vector<int>{1, 3, 8};
  for (int seqs : widths) {
    BatchOptions bo;
    bo.max_seqs = seqs;
    bo.prefill_chunk = 64;
    BatchEngine engine(*model_, pool, cache(), bo);
    const std::vector<BatchResult> got = engine.run(all, stop);
    ASSERT_EQ(got.size(), all.size());
    for (std::size_t i = 0; i < all.size(); ++i)
      expect_same(alone[i], got[i], "max_seqs " + std::to_string(seqs) + ", request " + std::to_string(i));
    EXPECT_LE(engine.stats().max_running, seqs);
    if (seqs == 8) {
      EXPECT_GT(engine.stats().max_running, 1);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RealModel, BatchInvariance,
                         ::testing::Values(Kind{"", "", 0.0, gate::Granularity::block, true},
                                           Kind{"fp16", "fp16", 0.0, gate::Granularity::block, false},
                                           Kind{"dither-int8", "dither-int8", 0.0, gate::Granularity::block, false},
                                           Kind{"dither-int8", "dither-int8", 0.05, gate::Granularity::block, true},
                                           Kind{"q4_0", "q4_0", 0.0, gate::Granularity::block, false},
                                           Kind{"q8_0", "rtn-int4", 0.2, gate::Granularity::head, true},
                                           Kind{"kivi-2bit", "kivi-2bit", 0.2, gate::Granularity::block, false},
                                           Kind{"fp8-e4m3", "fp8-e4m3", 0.3, gate::Granularity::request, false}),
                         kind_name);

TEST_P(BatchPreemption, RecomputeGivesTheUninterruptedTokensWithinTheBudget) {
  ThreadPool pool(2);
  const std::vector<std::int32_t> stop = {tok_->eos()};
  std::vector<BatchRequest> all = requests(*tok_, cache());
  for (BatchRequest& q : all) q.max_tokens = model::kSanitized ? 24 : 40;  // long enough to outgrow a tight pool
  std::vector<Solo> alone;
  for (const BatchRequest& q : all) alone.push_back(solo(*model_, q, stop, pool));
  // A budget of a few sequences' pages: admission fills it, growth preempts the youngest.
  const int n = static_cast<int>(all.size());
  const PoolSizing one = size_pool(model_->config(), 200, cache(), std::int64_t{1} << 30, n);
  BatchOptions bo;
  bo.max_seqs = n;
  bo.kv_memory = static_cast<std::int64_t>(one.fixed_bytes + n * one.sequence_bytes + 2 * n * one.page_bytes);
  BatchEngine engine(*model_, pool, cache(), bo);
  const std::vector<BatchResult> got = engine.run(all, stop);
  for (std::size_t i = 0; i < all.size(); ++i) expect_same(alone[i], got[i], "request " + std::to_string(i));
  EXPECT_GT(engine.stats().preemptions, 0);
  EXPECT_LE(engine.stats().peak_bytes, static_cast<std::size_t>(bo.kv_memory));
  std::printf("[batch] %lld pages, %lld preemptions, peak %zu of %lld bytes\n",
              static_cast<long long>(engine.stats().pool_pages), static_cast<long long>(engine.stats().preemptions),
              engine.stats().peak_bytes, static_cast<long long>(bo.kv_memory));
}

INSTANTIATE_TEST_SUITE_P(RealModel, BatchPreemption,
                         ::testing::Values(Kind{"", "", 0.0, gate::Granularity::block, false},
                                           Kind{"dither-int8", "dither-int8", 0.0, gate::Granularity::block, true},
                                           Kind{"q8_0", "rtn-int4", 0.2, gate::Granularity::head, false}),
                         kind_name);

TEST_P(BatchSharedPrefix, SharedPrefixesGiveTheSoloResults) {
  const std::string system =
      "You are a careful assistant for a river town's archive. The town keeps its records in a long stone hall by "
      "the water. Every spring the clerks count the boats, the nets, the bales of wool and the barrels of salted "
      "fish that come down from the hills, and they write each count in a ledger bound in green leather. The "
      "ledgers go back two hundred years, and the oldest are kept in a locked chest under the stairs. Answer "
      "questions about the archive briefly and plainly. When a visitor asks for a ledger, the keeper of the hall "
      "fetches it, sets it on the reading table by the window, and stays beside it until it is returned; no "
      "ledger leaves the hall, and no page is copied without the keeper's leave.\n";
  const char* questions[] = {"Question: where are the records kept?", "Question: what do the clerks count?",
                             "Question: what colour are the ledgers?", "Question: where are the oldest ledgers?",
                             "Question: how old are the ledgers?", "Question: who counts the boats?"};
  const int count = model::kSanitized ? 3 : 6;
  ThreadPool pool(2);
  const std::vector<std::int32_t> stop = {tok_->eos()};
  std::vector<BatchRequest> all;
  for (int i = 0; i < count; ++i) {
    BatchRequest r;
    r.prompt = tok_->encode(system + questions[i], false);
    r.max_tokens = model::kSanitized ? 2 : 5;
    r.cache = cache();
    all.push_back(r);
  }
  ASSERT_GT(all[0].prompt.size(), 128u);
  std::vector<Solo> alone;
  for (const BatchRequest& q : all) alone.push_back(solo(*model_, q, stop, pool));
  BatchOptions bo;
  bo.max_seqs = 2;  // later requests find a running or retired sequence that has run the shared text
  BatchEngine engine(*model_, pool, cache(), bo);
  const std::vector<BatchResult> got = engine.run(all, stop);
  std::int64_t taken = 0, solo_page_ins = 0, page_ins = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    expect_same(alone[i], got[i], "request " + std::to_string(i));
    taken += got[i].shared_page_ins;
    solo_page_ins += alone[i].page_ins;
    page_ins += got[i].page_ins;
  }
  EXPECT_GE(engine.stats().shared_tokens, (count - 2) * 128) << "the shared text is taken, not recomputed";
  if (GetParam().tau > 0) {
    // The prompt's repairs are made once, by the first request, and taken by the others.
    EXPECT_GT(taken, 0);
    EXPECT_EQ(page_ins + taken, solo_page_ins);
  }
}

// The certified kinds of the prefix-sharing tests: Tier B, Tier A and a group scheme, ungated
// and gated by block, head and request.
const std::vector<Kind> kSharingKinds = {
    Kind{"dither-int8", "dither-int8", 0.0, gate::Granularity::block, true},
    Kind{"kivi-2bit", "kivi-2bit", 0.0, gate::Granularity::block, false},
    Kind{"q8_0", "rtn-int4", 0.2, gate::Granularity::head, true},
    Kind{"dither-int8", "dither-int8", 0.05, gate::Granularity::block, false},
    Kind{"kivi-2bit", "kivi-2bit", 0.2, gate::Granularity::request, false},
};

std::vector<Kind> plain_and(std::vector<Kind> kinds) {
  kinds.insert(kinds.begin(), Kind{"", "", 0.0, gate::Granularity::block, false});
  return kinds;
}

INSTANTIATE_TEST_SUITE_P(RealModel, BatchSharedPrefix, ::testing::ValuesIn(plain_and(kSharingKinds)), kind_name);

// Requests of one prompt with different repair policies in one pool: a repair changes the keys
// and values of the layers above it, so each request equals its solo run only if it shares with
// requests that repair as it does, and it still shares with those.
TEST_P(BatchRepairPolicy, SharingFollowsTheRepairPolicy) {
  const std::string text =
      "The river town kept its records in a long stone hall by the water, and every spring the clerks counted the "
      "boats, the nets, the bales of wool and the barrels of salted fish that came down from the hills. They wrote "
      "each count in a ledger bound in green leather, and the ledgers went back two hundred years, the oldest kept "
      "in a locked chest under the stairs of the hall, where the keeper sat by the window with a lamp. ";
  const char* tails[] = {"Question: what did the clerks count?", "Question: where were the oldest ledgers?"};
  CacheOptions gated = cache(), plain = cache(), other = cache();
  gated.gate.set_tau_k(GetParam().tau > 0 ? GetParam().tau : 0.05);
  plain.gate.set_tau_k(0.0);
  other.gate = gated.gate;
  other.gate.granularity = gated.gate.granularity == gate::Granularity::head ? gate::Granularity::block
                                                                             : gate::Granularity::head;
  // Three at a time: the first three run side by side, and every later one finds a retired or
  // running sequence of each policy, the first donor it meets being one of another policy.
  const std::vector<CacheOptions> policies = {gated, plain, other, plain, gated, other, gated};
  ThreadPool pool(2);
  const std::vector<std::int32_t> stop = {tok_->eos()};
  std::vector<BatchRequest> all;
  for (std::size_t i = 0; i < policies.size(); ++i) {
    BatchRequest r;
    r.prompt = tok_->encode(text + tails[i % 2], false);
    r.max_tokens = model::kSanitized ? 2 : 4;
    r.cache = policies[i];
    all.push_back(r);
  }
  ASSERT_GT(all[0].prompt.size(), 64u);
  std::vector<Solo> alone;
  for (const BatchRequest& q : all) alone.push_back(solo(*model_, q, stop, pool));
  BatchOptions bo;
  bo.max_seqs = 3;
  bo.kv_memory = std::int64_t{256} << 20;  // room for every donor to stay
  BatchEngine engine(*model_, pool, gated, bo);
  const std::vector<BatchResult> got = engine.run(all, stop);
  for (std::size_t i = 0; i < all.size(); ++i) expect_same(alone[i], got[i], "request " + std::to_string(i));
  // Requests 3 to 6 each find a donor of their own policy.
  EXPECT_GE(engine.stats().shared_tokens, 4 * 64);
  EXPECT_GT(got[4].shared_page_ins + got[6].shared_page_ins, 0) << "gated requests take the first one's repairs";
}

INSTANTIATE_TEST_SUITE_P(RealModel, BatchRepairPolicy, ::testing::ValuesIn(kSharingKinds), kind_name);

TEST_F(RealModel, ASnapshotShowsARequestAsItRuns) {
  ThreadPool pool(2);
  const CacheOptions cache = format("q8_0", "rtn-int4", 0.2, gate::Granularity::head);
  BatchOptions bo;
  bo.max_seqs = 1;  // the second request waits for the first
  BatchEngine engine(*model_, pool, cache, bo);
  engine.open(256, true);
  std::vector<BatchRequest> two = requests(*tok_, cache, 2);
  for (BatchRequest& q : two) q.max_tokens = 6;
  std::vector<BatchResult> done(2);
  std::vector<std::uint64_t> ids;
  for (int i = 0; i < 2; ++i) {
    RequestEvents events;
    events.on_done = [&done, i](const BatchResult& r) { done[i] = r; };
    ids.push_back(engine.submit(two[i], std::move(events), {}));
  }
  EXPECT_FALSE(engine.snapshot(ids[1] + 1).has_value()) << "no such request";
  std::vector<RequestSnapshot> last(2);
  std::vector<bool> seen_waiting(2, false), seen_running(2, false);
  while (!engine.idle()) {
    engine.step();
    for (int i = 0; i < 2; ++i) {
      const std::optional<RequestSnapshot> s = engine.snapshot(ids[i]);
      if (!s) {
        EXPECT_FALSE(done[i].tokens.empty()) << "gone from the engine only when finished";
        continue;
      }
      (s->running ? seen_running : seen_waiting)[i] = true;
      // Counters only grow, and the tokens so far begin every later list.
      EXPECT_GE(s->so_far.meter.cells, last[i].so_far.meter.cells);
      EXPECT_GE(s->so_far.page_ins, last[i].so_far.page_ins);
      ASSERT_GE(s->so_far.tokens.size(), last[i].so_far.tokens.size());
      EXPECT_TRUE(std::equal(last[i].so_far.tokens.begin(), last[i].so_far.tokens.end(), s->so_far.tokens.begin()));
      last[i] = *s;
    }
  }
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(i);
    EXPECT_TRUE(seen_running[i]);
    EXPECT_TRUE(last[i].so_far.has_meter);
    EXPECT_GT(last[i].so_far.meter.cells, 0) << "decode cells counted while it runs";
    EXPECT_LT(last[i].so_far.meter.cells, done[i].meter.cells) << "the final step's cells come after";
    EXPECT_EQ(last[i].so_far.tokens.size() + 1, done[i].tokens.size());
    EXPECT_LE(last[i].so_far.page_ins, done[i].page_ins);
    EXPECT_EQ(last[i].so_far.prompt_tokens, done[i].prompt_tokens);
  }
  EXPECT_TRUE(seen_waiting[1]) << "the second request waited behind the first";
  EXPECT_FALSE(engine.snapshot(ids[0]).has_value());
}

using BatchAlone = BatchKind;

// A request alone (`generate`, the C API, Python) is a batch of one: the same tokens, meter and
// page-ins as the session's run; its sinks hear every cell once, prompt positions included; a
// handler that ends it leaves the tokens so far; a request that cannot run throws its reason.
TEST_P(BatchAlone, ARequestAloneIsABatchOfOne) {
  ThreadPool pool(2);
  const std::vector<std::int32_t> stop = {tok_->eos()};
  const std::vector<BatchRequest> all = requests(*tok_, cache(), model::kSanitized ? 2 : 5);
  for (std::size_t i = 0; i < all.size(); ++i) {
    BatchRequest q = all[i];
    gate::CellLog log;
    if (q.cache.certified) q.sinks = {&log};
    std::vector<std::int32_t> heard;
    const BatchResult got = run_alone(*model_, pool, q, stop, [&](std::int32_t t, std::span<const float> logits) {
      EXPECT_EQ(logits.size(), static_cast<std::size_t>(model_->config().vocab));
      heard.push_back(t);
      return false;
    });
    const Solo want = solo(*model_, all[i], stop, pool);
    expect_same(want, got, "request " + std::to_string(i));
    EXPECT_EQ(heard, got.tokens);
    EXPECT_EQ(got.has_meter, q.cache.certified);
    if (q.cache.certified) {
      // Every (layer, query head) of every position run: the prompt and each token but the last.
      const model::LlamaConfig& cfg = model_->config();
      const std::int64_t positions = got.prompt_tokens + static_cast<std::int64_t>(got.tokens.size()) -
                                     (got.finish == Finish::stop ? 0 : 1);
      EXPECT_EQ(static_cast<std::int64_t>(log.cells().size()), positions * cfg.layers * cfg.heads);
    }
    // Ended after its second token: those two, and no further forward pass.
    if (want.tokens.size() >= 3) {
      int n = 0;
      const BatchResult ended = run_alone(*model_, pool, all[i], stop, [&](std::int32_t, std::span<const float>) {
        return ++n == 2;
      });
      EXPECT_EQ(ended.finish, Finish::cancelled);
      EXPECT_EQ(ended.tokens, std::vector<std::int32_t>(want.tokens.begin(), want.tokens.begin() + 2));
    }
  }
  BatchRequest empty = all[0];
  empty.prompt.clear();
  EXPECT_THROW(run_alone(*model_, pool, empty, stop), std::invalid_argument);
  BatchRequest bad = all[0];
  bad.sampler.top_p = 1.5f;
  EXPECT_THROW(run_alone(*model_, pool, bad, stop), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(RealModel, BatchAlone,
                         ::testing::Values(Kind{"", "", 0.0, gate::Granularity::block, true},
                                           Kind{"dither-int8", "dither-int8", 0.05, gate::Granularity::block, true},
                                           Kind{"q4_0", "q4_0", 0.5, gate::Granularity::request, false},
                                           Kind{"kivi-2bit", "fp8-e4m3", 0.2, gate::Granularity::head, false}),
                         kind_name);

TEST_F(RealModel, ABadRequestFailsAloneWithItsReason) {
  ThreadPool pool(2);
  const CacheOptions cache = format("q4_0", "q4_0", 0.0, gate::Granularity::block);
  std::vector<BatchRequest> all = requests(*tok_, cache, 8);
  all.push_back(all[0]);
  all.push_back(all[6]);
  all[1].prompt.clear();
  all[2].prompt.assign(static_cast<std::size_t>(model_->config().context) + 1, 1);
  all[3].cache.delta = 2.0;
  all[4].max_tokens = -1;
  all[5].cache.k_format = formats::KvFormat::parse("q8_0");
  all[8].sampler.temperature = -1.0;  // the sampler refuses it: this request fails, not the run
  all[9].sampler.top_p = 1.5;
  BatchEngine engine(*model_, pool, cache, BatchOptions{});
  const std::vector<BatchResult> got = engine.run(all, {tok_->eos()});
  EXPECT_EQ(got[1].error, "the prompt is empty");
  EXPECT_NE(got[2].error.find("more than the context"), std::string::npos) << got[2].error;
  EXPECT_NE(got[3].error.find("delta"), std::string::npos) << got[3].error;
  EXPECT_NE(got[4].error.find("max_tokens"), std::string::npos) << got[4].error;
  EXPECT_NE(got[5].error.find("formats"), std::string::npos) << got[5].error;
  EXPECT_NE(got[8].error.find("temperature"), std::string::npos) << got[8].error;
  EXPECT_NE(got[9].error.find("top"), std::string::npos) << got[9].error;
  for (int i : {1, 2, 3, 4, 5, 8, 9}) EXPECT_EQ(got[i].finish, Finish::error);
  for (int i : {0, 6, 7}) {
    EXPECT_NE(got[i].finish, Finish::error) << got[i].error;
    EXPECT_TRUE(got[i].has_meter);
  }
  // A budget below one page beside the sequences' state is refused, naming the flag.
  BatchOptions tiny;
  tiny.kv_memory = 1000;
  BatchEngine small(*model_, pool, cache, tiny);
  try {
    small.run(all, {tok_->eos()});
    ADD_FAILURE() << "a budget of 1000 bytes was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kv_memory 1000 bytes"), std::string::npos) << e.what();
  }
}

// Resident bytes of this process (/proc/self/statm).
std::int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// SmolLM2-135M's KV geometry, without its weights.
model::LlamaConfig smollm2_geometry() {
  model::LlamaConfig g;
  g.layers = 30;
  g.heads = 9;
  g.kv_heads = 3;
  g.head_dim = 64;
  g.context = 8192;
  return g;
}

// Writes positions [0, tokens) of every (layer, KV head) of `seq` with smooth made-up keys and values.
template <class Seq>
void write_pages(Seq& seq, const model::LlamaConfig& g, std::int64_t tokens) {
  std::vector<float> k(static_cast<std::size_t>(g.head_dim)), v(k.size());
  for (int layer = 0; layer < g.layers; ++layer)
    for (int h = 0; h < g.kv_heads; ++h)
      for (std::int64_t pos = 0; pos < tokens; ++pos) {
        for (std::size_t i = 0; i < k.size(); ++i) {
          k[i] = std::sin(0.1f * static_cast<float>(pos + i));
          v[i] = std::cos(0.2f * static_cast<float>(pos * 3 + i));
        }
        seq.write(layer, h, pos, k.data(), v.data());
      }
}

TEST(PoolMemory, ABudgetTakesMemoryOnlyAsItsPagesAreWritten) {
  const model::LlamaConfig g = smollm2_geometry();
  CacheOptions opts = format("dither-int8", "dither-int8", 0.0, gate::Granularity::block);
  const std::int64_t budget = std::int64_t{2} << 30, capacity = 4096;
  const PoolSizing sizing = size_pool(g, capacity, opts, budget, 16);
  const std::int64_t before = resident_bytes();
  const Pool pool = make_pool(g, capacity, sizing.pages, opts, false);
  const std::int64_t built = resident_bytes();
  // The measured bytes, and so admission, still charge the whole budget...
  EXPECT_GT(pool.bytes(), static_cast<std::size_t>(budget) / 10 * 9);
  // ...but building the pool commits only its bookkeeping.
  EXPECT_LT(built - before, std::int64_t{8} << 20) << "a pool of " << pool.bytes() << " bytes";

  // Writing commits about what was written: 64 pages of every (layer, KV head).
  kvcache::KvStore seq(pool.kv);
  write_pages(seq, g, 64 * opts.page_size);
  const std::int64_t written = 64 * static_cast<std::int64_t>(sizing.page_bytes);
  const std::int64_t grown = resident_bytes() - built;
  EXPECT_GT(grown, written / 2) << "wrote " << written << " bytes of pages";
  // (Under AddressSanitizer the write path's freed heap stays in its quarantine: no upper bound there.)
  if (!model::kSanitized) {
    EXPECT_LT(grown, 2 * written + (std::int64_t{8} << 20)) << "wrote " << written << " bytes of pages";
  }
  std::printf("[pool memory] %zu-byte pool: built +%lld bytes resident; %lld bytes of pages written: +%lld bytes\n",
              pool.bytes(), static_cast<long long>(built - before), static_cast<long long>(written),
              static_cast<long long>(grown));

  // An exact tier in RAM beside the pool is reserved the same way.
  const std::int64_t tier_before = resident_bytes();
  const Pool gated = make_pool(g, capacity, sizing.pages, opts, true);
  EXPECT_GT(gated.backing_bytes(), static_cast<std::size_t>(budget));
  EXPECT_LT(resident_bytes() - tier_before, std::int64_t{8} << 20)
      << "an exact tier of " << gated.backing_bytes() << " bytes";
}

// The plain exact cache's pool is reserved the same way: building it for a 2 GiB budget commits
// next to nothing, and writing commits about what was written.
TEST(PoolMemory, ThePlainCachesBudgetTakesMemoryOnlyAsItsPagesAreWritten) {
  const model::LlamaConfig g = smollm2_geometry();
  const CacheOptions plain;
  const std::int64_t budget = std::int64_t{2} << 30, capacity = 4096;
  const PoolSizing sizing = size_pool(g, capacity, plain, budget, 16);
  const std::int64_t before = resident_bytes();
  const Pool pool = make_pool(g, capacity, sizing.pages, plain, false);
  const std::int64_t built = resident_bytes();
  ASSERT_TRUE(pool.kv && !pool.certified);
  EXPECT_GT(pool.bytes(), static_cast<std::size_t>(budget) / 10 * 9);
  EXPECT_LT(built - before, std::int64_t{8} << 20) << "a pool of " << pool.bytes() << " bytes";
  attention::ExactKvCache seq(pool.kv);
  write_pages(seq, g, 64 * plain.page_size);
  const std::int64_t written = 64 * static_cast<std::int64_t>(sizing.page_bytes);
  const std::int64_t grown = resident_bytes() - built;
  EXPECT_GT(grown, written / 2) << "wrote " << written << " bytes of pages";
  EXPECT_LT(grown, 2 * written + (std::int64_t{8} << 20)) << "wrote " << written << " bytes of pages";
}

TEST(PoolMemory, ABudgetBeyondTheAvailableMemoryIsRefusedNamingBoth) {
  const model::LlamaConfig g = smollm2_geometry();
  CacheOptions opts = format("dither-int8", "dither-int8", 0.0, gate::Granularity::block);
  const std::int64_t gib = std::int64_t{1} << 30;
  const AvailableMemory m{true, gib, gib / 2};
  const std::int64_t pages = 2000;  // an exact tier of 23 040 B a slot × 32 000 slots = 737 MB
  EXPECT_NO_THROW(check_kv_memory(g, opts, gib, pages, false, m));
  try {
    check_kv_memory(g, opts, 2 * gib, pages, false, m);
    ADD_FAILURE() << "a budget of 2 GiB was accepted beside 1.5 GiB";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    for (const char* part :
         {"kv_memory 2147483648 bytes", "MemAvailable 1073741824 bytes", "SwapFree 536870912 bytes"})
      EXPECT_NE(what.find(part), std::string::npos) << what;
  }
  // The exact tier counts when it lives in RAM; a file-backed one does not.
  EXPECT_THROW(check_kv_memory(g, opts, gib, pages, true, m), std::invalid_argument);
  opts.backing = kvcache::BackingPlace{};
  EXPECT_NO_THROW(check_kv_memory(g, opts, gib, pages, true, m));
  // Unknown memory refuses nothing.
  EXPECT_NO_THROW(check_kv_memory(g, opts, std::int64_t{1} << 50, pages, false, AvailableMemory{}));
}

TEST_F(RealModel, AKvMemoryBeyondThisMachineIsRefusedWhenThePoolOpens) {
  ASSERT_TRUE(available_memory().known) << "/proc/meminfo has no MemAvailable or SwapFree";
  ThreadPool pool(1);
  BatchOptions bo;
  bo.kv_memory = std::int64_t{1} << 50;  // 1 PiB
  BatchEngine engine(*model_, pool, format("dither-int8", "dither-int8", 0.0, gate::Granularity::block), bo);
  try {
    engine.open(256, false);
    ADD_FAILURE() << "a budget of 1 PiB was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("kv_memory 1125899906842624 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("MemAvailable"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace witcert::engine
