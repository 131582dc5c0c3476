// The CUDA kernel's block program (split_block.h) run on the host, thread by thread and phase by
// phase, over a mirror of real CPU pools: first the per-token reads in the scalar reference's
// order, bit for bit; then the kernel's own order of tiles and splits, against the scalar
// reference within the rounding the order changes, and its meters against the true TV.
#include "attention/cuda/split_block.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <vector>

#include "attention/cuda/mirror.h"
#include "attention/cuda/test_stores.h"

namespace witcert::cuda {
namespace {

using testing::Formats;

bool same_bits(double a, double b) { return std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b) || (a != a && b != b); }

// attention::attend_range_reference's loop over the mirror with the kernel's per-token reads: it must
// reproduce the reference's partials bit for bit.
std::vector<attention::HeadPartial> scalar_order(const PoolView& pool, const BatchView& b, int seq, int kv_head) {
  const int d = pool.d, group = b.group, stream = b.layer * pool.kv_heads + kv_head;
  const float* q = b.q + (static_cast<std::size_t>(seq) * pool.kv_heads + kv_head) * group * d;
  std::vector<double> q_norm(static_cast<std::size_t>(group) * pool.bands);
  for (int h = 0; h < group; ++h)
    for (int band = 0; band < pool.bands; ++band) q_norm[h * pool.bands + band] = band_norm(q + h * d, pool.neox, d, pool.bands, band);
  std::vector<attention::HeadPartial> partials(group);
  std::vector<MeterStats> meters(group);
  for (attention::HeadPartial& p : partials) p.acc.assign(d, 0.0);
  std::vector<float> k(d), v(d);
  for (std::int64_t pos = 0; pos < b.n_ctx[seq]; ++pos) {
    const TokenAt t = locate(pool, b, seq, stream, pos);
    for (int j = 0; j < d / 4; ++j) key_quad(pool, b, seq, stream, t, j, &k[4 * j]);
    for (int c = 0; c < d; ++c) v[c] = value_at(pool, b.layer, stream, t, c);
    const double rho = value_rho(pool, stream, t);
    double n2 = 0.0;
    for (int c = 0; c < d; ++c) n2 += double(v[c]) * v[c];
    const double v_norm = std::sqrt(n2);
    for (int h = 0; h < group; ++h) {
      double dot = 0.0;
      for (int c = 0; c < d; ++c) dot += double(q[h * d + c]) * k[c];
      const double z = b.sm[seq] * dot;
      const double c_t = key_bound(pool, b, seq, stream, t, q + h * d, &q_norm[h * pool.bands]);
      if (t.shared && t.k_packed && pool.k.format == Format::dither_int8)
        meters[h].add_moment(z, c_t);
      else
        meters[h].add(z, c_t);
      partials[h].add(z, v.data(), d, rho, v_norm);
    }
  }
  for (int h = 0; h < group; ++h) {
    const MeterStats& m = meters[h];
    cert::MeterStats& c = partials[h].meter;
    c.z = {m.z.m, m.z.s}, c.z_plus_c = {m.z_plus_c.m, m.z_plus_c.s}, c.z_minus_c = {m.z_minus_c.m, m.z_minus_c.s};
    c.c_max = m.c_max, c.n = static_cast<long>(m.n), c.mom_w = m.mom_w, c.mom_c1 = m.mom_c1, c.mom_c2 = m.mom_c2;
  }
  return partials;
}

// The device buffers of a step, on the host.
struct HostStep {
  std::vector<HeadState> states;
  std::vector<double> acc;
  std::vector<float> out;
  std::vector<HeadReport> reports;
  StepBuffers buffers(int heads, int splits, int d) {
    states.assign(static_cast<std::size_t>(heads) * splits, HeadState{});
    acc.assign(static_cast<std::size_t>(heads) * splits * d, 0.0);
    out.assign(static_cast<std::size_t>(heads) * d, 0.0f);
    reports.assign(heads, HeadReport{});
    return {states.data(), acc.data(), out.data(), reports.data()};
  }
};

// The kernels' grid on the host: every block's phases in the order split_kernel runs them, each
// phase for every thread id before the next (the barrier), then merge_kernel's.
template <bool Meter>
void run_step(const PoolView& pool, const BatchView& b, int splits, HostStep& step) {
  const int heads = b.batch * pool.kv_heads * b.group;
  const StepBuffers out = step.buffers(heads, splits, pool.d);
  std::vector<double> storage(shared_bytes(b.group, pool.d, pool.bands) / sizeof(double) + 1);
  Shared s;
  carve(reinterpret_cast<unsigned char*>(storage.data()), b.group, pool.d, pool.bands, &s);
  const int threads = block_threads(b.group);
  const auto phase = [&](auto&& body) {
    for (int tid = 0; tid < threads; ++tid) body(tid);
  };
  for (int seq = 0; seq < b.batch; ++seq)
    for (int kv = 0; kv < pool.kv_heads; ++kv)
      for (int split = 0; split < splits; ++split) {
        SplitBlock<Meter> blk(pool, b, out, s, seq, kv, split, splits);
        phase([&](int t) { blk.begin(t); });
        if (Meter) phase([&](int t) { blk.norms(t); });
        while (blk.more_tiles()) {
          phase([&](int t) { blk.locate(t); });
          phase([&](int t) { blk.decode(t); });
          phase([&](int t) { blk.logits(t); });
          phase([&](int t) { blk.maxima(t); });
          phase([&](int t) { blk.weights(t); });
          phase([&](int t) { blk.accumulate(t); });
          blk.next_tile();
        }
        phase([&](int t) { blk.end(t); });
      }
  std::vector<double> factors(2 * splits);
  HeadState merged;
  for (int head = 0; head < heads; ++head) {
    MergeBlock m{out, splits, pool.d, head, factors.data(), &merged};
    m.states(0);
    for (int t = 0; t < 128; ++t) m.channels(t, 128);
  }
}

struct Case {
  Formats f;
  int page;
  std::vector<std::int64_t> lengths;
};

// A batch of sequences of different lengths over one pool configuration (2 layers, 2 KV heads,
// GQA 4:1, d = 64), mirrored with shuffled pages; the step attends layer 1.
struct Batch {
  static constexpr int kLayers = 2, kKvHeads = 2, kGroup = 4, kD = 64, kLayer = 1;
  std::vector<std::unique_ptr<kvcache::KvStore>> stores;
  std::vector<std::vector<float>> q;
  HostPool pool;
  HostBatch batch;
  double delta;
  explicit Batch(const Case& c, std::uint64_t seed) {
    std::vector<const kvcache::KvStore*> ptrs;
    const std::int64_t capacity = *std::max_element(c.lengths.begin(), c.lengths.end());
    const kvcache::CacheConfig cfg = testing::config(c.f, kLayers, kKvHeads, kD, capacity, c.page, seed);
    for (std::size_t s = 0; s < c.lengths.size(); ++s) {
      stores.push_back(testing::filled_store(cfg, c.lengths[s], seed + 100 * s));
      ptrs.push_back(stores.back().get());
      q.push_back(testing::queries(kKvHeads * kGroup, kD, seed + 7 * s));
    }
    delta = testing::step_delta_loc(kLayers, kKvHeads * kGroup);
    mirror(ptrs, c.lengths, kLayer, kGroup, q, delta, seed, pool, batch);
  }
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Formats& f : testing::kernel_formats())
    for (int page : {1, 16}) out.push_back({f, page, {1, 45, 160}});
  return out;
}

TEST(CudaSplitBlock, PerTokenReadsInTheScalarOrderMatchTheReferenceBitForBit) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.f.name() + " page " + std::to_string(c.page));
    Batch b(c, 5);
    const PoolView pool = b.pool.view();
    const BatchView view = b.batch.view();
    for (std::size_t s = 0; s < c.lengths.size(); ++s)
      for (int kv = 0; kv < Batch::kKvHeads; ++kv) {
        const std::vector<attention::HeadPartial> want = testing::reference_partials(
            *b.stores[s], Batch::kLayer, kv, b.q[s].data() + kv * Batch::kGroup * Batch::kD, Batch::kGroup, c.lengths[s], b.delta);
        const std::vector<attention::HeadPartial> got = scalar_order(pool, view, static_cast<int>(s), kv);
        for (int h = 0; h < Batch::kGroup; ++h) {
          ASSERT_TRUE(same_bits(got[h].m, want[h].m) && same_bits(got[h].l, want[h].l)) << "seq " << s << " head " << h;
          ASSERT_TRUE(same_bits(got[h].rho, want[h].rho) && same_bits(got[h].v_max, want[h].v_max));
          for (int i = 0; i < Batch::kD; ++i) ASSERT_TRUE(same_bits(got[h].acc[i], want[h].acc[i])) << i;
          const cert::MeterStats &gm = got[h].meter, &wm = want[h].meter;
          ASSERT_TRUE(same_bits(gm.log_A(), wm.log_A()) && same_bits(gm.log_A_minus(), wm.log_A_minus()));
          ASSERT_TRUE(same_bits(gm.c_max, wm.c_max) && same_bits(gm.mom_c2, wm.mom_c2));
        }
      }
  }
}

// The reference's output and report of one query head, for comparison with a step's.
struct Want {
  std::vector<float> out;
  attention::HeadResult r;
  double tv;
};
Want reference(const Batch& b, int s, int kv, int h) {
  const auto partials = testing::reference_partials(*b.stores[s], Batch::kLayer, kv, b.q[s].data() + kv * Batch::kGroup * Batch::kD,
                                                    Batch::kGroup, b.batch.n_ctx[s], b.delta);
  Want w;
  w.out.resize(Batch::kD);
  w.r = attention::finish(partials[h], Batch::kD, w.out.data());
  kvcache::KvStore::Reader reader(*b.stores[s], Batch::kLayer, kv);
  w.tv = attention::true_tv(reader, b.q[s].data() + (kv * Batch::kGroup + h) * Batch::kD, Batch::kD, 0, b.batch.n_ctx[s]);
  return w;
}

// Within 1e-6 relative (equal infinities included).
bool near(double got, double want) { return got == want || std::fabs(got - want) <= 1e-6 * std::fabs(want); }

// Relative closeness of two outputs, on the scale of the reference's largest component.
double output_error(const float* got, const std::vector<float>& want) {
  double scale = 0.0, err = 0.0;
  for (float x : want) scale = std::max(scale, static_cast<double>(std::fabs(x)));
  for (std::size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(static_cast<double>(got[i]) - want[i]));
  return err / std::max(scale, 1e-30);
}

TEST(CudaSplitBlock, KernelOrderMatchesTheReferenceAndIsSound) {
  for (const Case& c : cases()) {
    Batch b(c, 9);
    for (int splits : {1, 4, 16}) {
      SCOPED_TRACE(c.f.name() + " page " + std::to_string(c.page) + " splits " + std::to_string(splits));
      HostStep step;
      run_step<true>(b.pool.view(), b.batch.view(), splits, step);
      for (int s = 0; s < static_cast<int>(c.lengths.size()); ++s)
        for (int kv = 0; kv < Batch::kKvHeads; ++kv)
          for (int h = 0; h < Batch::kGroup; ++h) {
            const Want w = reference(b, s, kv, h);
            const int head = (s * Batch::kKvHeads + kv) * Batch::kGroup + h;
            EXPECT_LE(output_error(&step.out[head * Batch::kD], w.out), 1e-5) << "seq " << s << " head " << head;
            const HeadReport& r = step.reports[head];
            EXPECT_TRUE(near(r.eform_raw, w.r.eform_raw)) << r.eform_raw << " vs " << w.r.eform_raw;
            EXPECT_TRUE(near(r.v_meter, w.r.v_meter)) << r.v_meter << " vs " << w.r.v_meter;
            EXPECT_TRUE(near(r.meter, w.r.meter)) << r.meter << " vs " << w.r.meter;
            EXPECT_GE(r.meter, w.tv) << "soundness: the meter is below the true TV";
          }
    }
  }
}

TEST(CudaSplitBlock, WithoutTheMeterTheOutputStillMatches) {
  for (const Case& c : cases()) {
    Batch b(c, 13);
    SCOPED_TRACE(c.f.name() + " page " + std::to_string(c.page));
    HostStep step;
    run_step<false>(b.pool.view(), b.batch.view(), 4, step);
    for (int s = 0; s < static_cast<int>(c.lengths.size()); ++s)
      for (int kv = 0; kv < Batch::kKvHeads; ++kv)
        for (int h = 0; h < Batch::kGroup; ++h) {
          const int head = (s * Batch::kKvHeads + kv) * Batch::kGroup + h;
          EXPECT_LE(output_error(&step.out[head * Batch::kD], reference(b, s, kv, h).out), 1e-4) << head;
        }
  }
}

TEST(CudaSplitBlock, FormatsWithoutADevicePathAreRefused) {
  for (const Formats& f : {Formats{"q4_1", "fp16"}, Formats{"fp16", "iq4_nl"}, Formats{"dither-int8", "fp16", kvcache::DitherMode::none}}) {
    const kvcache::CacheConfig cfg = testing::config(f, 1, 1, 64, 32, 16, 3);
    const auto store = testing::filled_store(cfg, 32, 3);
    HostPool pool;
    HostBatch batch;
    EXPECT_THROW(mirror({store.get()}, {32}, 0, 1, {testing::queries(1, 64, 1)}, 1e-3, 0, pool, batch), std::invalid_argument)
        << f.name();
  }
}

// A test that cannot fail is a defect: one flipped byte of a page's keys must show.
TEST(CudaSplitBlock, ACorruptedPageIsSeen) {
  for (const char* format : {"dither-int8", "q8_0", "fp16"}) {
    Batch b({{format, format}, 16, {40}}, 21);
    HostStep clean, dirty;
    run_step<true>(b.pool.view(), b.batch.view(), 1, clean);
    if (!b.pool.k_codes.empty()) b.pool.k_codes[b.pool.k_codes.size() / 2 + 3] ^= 0x40;
    if (!b.pool.k_packed.empty()) b.pool.k_packed[b.pool.k_packed.size() / 2 + 3] ^= 0x40;
    for (std::uint16_t& x : b.pool.k_rows) x ^= 0x0200;
    run_step<true>(b.pool.view(), b.batch.view(), 1, dirty);
    EXPECT_NE(clean.out, dirty.out) << format;
  }
}

}  // namespace
}  // namespace witcert::cuda
