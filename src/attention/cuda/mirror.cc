#include "attention/cuda/mirror.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "formats/dither/code_pack.h"

namespace witcert::cuda {

PoolView HostPool::view() const {
  PoolView p = shape;
  const auto ptr = [](const auto& v) { return v.empty() ? nullptr : v.data(); };
  p.k.rows = ptr(k_rows), p.v.rows = ptr(v_rows);
  p.k.meta = ptr(k_meta), p.v.meta = ptr(v_meta);
  p.k.packed = ptr(k_packed), p.v.packed = ptr(v_packed);
  p.k.codes = ptr(k_codes), p.v.codes = ptr(v_codes);
  p.k.outliers = ptr(k_outliers);
  p.page_counter = ptr(page_counter), p.slot_counter = ptr(slot_counter);
  return p;
}

BatchView HostBatch::view() const {
  BatchView b = shape;
  b.n_ctx = n_ctx.data(), b.page_table = page_table.data(), b.shared_end = shared_end.data();
  b.k_packed_rows = k_packed_rows.data(), b.v_packed_rows = v_packed_rows.data();
  b.outlier_rank = outlier_rank.data(), b.kappa = kappa.data(), b.sm = sm.data(), b.q = q.data();
  return b;
}

Format cuda_format(const kvcache::KvStore& store, formats::KvSide side) {
  switch (store.kind(side)) {
    case formats::FormatKind::exact: return Format::fp16;
    case formats::FormatKind::dither:
      // The keys the CPU serves on its reference path only have no device path either.
      if (side == formats::KvSide::key && store.config().reference_keys())
        throw std::invalid_argument("the CUDA kernel has no path for dithered keys without dither (--dither none) or "
                                    "with channel scales (--key-scales channel)");
      return Format::dither_int8;
    case formats::FormatKind::scheme: break;
  }
  const formats::KvFormat& format = side == formats::KvSide::key ? store.config().k_format : store.config().v_format;
  const std::string name(format.scheme(side)->name());
  if (name == "q8_0") return Format::q8_0;
  if (name == "q4_0") return Format::q4_0;
  if (name == "fp8-e4m3") return Format::fp8_e4m3;
  throw std::invalid_argument("the CUDA kernel has no decoder for '" + name + "' (it runs fp16, dither-int8, q8_0, q4_0, fp8-e4m3)");
}

double subgaussian_kappa(long S, double delta_loc, int non_outlier_channels) {
  const double tail = std::sqrt(2.0 * (std::log(2.0 * static_cast<double>(S)) - std::log(delta_loc)));
  const double bias = 0x1p-17 * std::sqrt(12.0 * non_outlier_channels);
  return tail + bias;
}

namespace {

// Sizes one side's arrays for `pages` pages per stream.
void size_side(Format f, bool key, const PoolView& p, int streams, std::vector<std::uint16_t>& rows,
               std::vector<std::uint16_t>& meta, std::vector<std::uint8_t>& packed, std::vector<std::int8_t>& codes,
               std::vector<std::uint16_t>* outliers, SideView& side) {
  const std::size_t slots = static_cast<std::size_t>(streams) * p.pages * p.page_size;
  side.format = f;
  rows.assign(slots * p.d, 0);
  if (f == Format::dither_int8) {
    side.meta_per_token = p.d / kGroup;
    codes.assign(slots * p.d, 0);
    if (key) outliers->assign(slots * std::max(1, p.outlier_values), 0);
  } else if (f != Format::fp16) {
    side.row_bytes = packed_row_bytes(f, p.d);
    side.meta_per_token = key ? p.bands : 1;
    packed.assign(slots * side.row_bytes, 0);
  }
  meta.assign(slots * std::max(1, side.meta_per_token), 0);
}

}  // namespace

void mirror(const std::vector<const kvcache::KvStore*>& stores, const std::vector<std::int64_t>& n_ctx, int layer, int group,
            const std::vector<std::vector<float>>& q, double delta_loc, std::uint64_t shuffle_seed, HostPool& pool,
            HostBatch& batch) {
  if (stores.empty() || stores.size() != n_ctx.size() || stores.size() != q.size())
    throw std::invalid_argument("mirror: one n_ctx and one query set per store");
  const kvcache::CacheConfig& cfg = stores[0]->config();
  const int P = cfg.page_size, d = cfg.head_dim, streams = cfg.layers * cfg.kv_heads;
  const int B = static_cast<int>(stores.size());
  std::vector<std::int64_t> logical(B);
  std::int64_t total = 0, max_pages = 1;
  for (int s = 0; s < B; ++s) {
    logical[s] = (n_ctx[s] + P - 1) / P;
    total += logical[s];
    max_pages = std::max(max_pages, logical[s]);
  }
  PoolView& p = pool.shape;
  p = PoolView{};
  p.d = d, p.page_size = P, p.kv_heads = cfg.kv_heads, p.bands = cfg.bands, p.outlier_values = 2 * cfg.outlier_pairs;
  p.pages = std::max<std::int64_t>(1, total);
  p.neox = cfg.rope_layout == cert::RopeLayout::neox;
  p.seed = cfg.seed;
  p.value_dither = stores[0]->value_dither();
  const Format kf = cuda_format(*stores[0], formats::KvSide::key), vf = cuda_format(*stores[0], formats::KvSide::value);
  size_side(kf, true, p, streams, pool.k_rows, pool.k_meta, pool.k_packed, pool.k_codes, &pool.k_outliers, p.k);
  size_side(vf, false, p, streams, pool.v_rows, pool.v_meta, pool.v_packed, pool.v_codes, nullptr, p.v);
  pool.page_counter.assign(p.pages, 0);
  pool.slot_counter.assign(p.pages, 0);

  BatchView& bv = batch.shape;
  bv = BatchView{};
  bv.batch = B, bv.layer = layer, bv.streams = streams, bv.group = group, bv.max_pages = static_cast<int>(max_pages);
  batch.n_ctx.assign(B, 0);
  batch.page_table.assign(static_cast<std::size_t>(B) * max_pages, 0);
  batch.shared_end.assign(B, 0);
  batch.k_packed_rows.assign(static_cast<std::size_t>(B) * streams * max_pages, 0);
  batch.v_packed_rows = batch.k_packed_rows;
  batch.outlier_rank.assign(static_cast<std::size_t>(B) * streams * d, -1);
  batch.kappa.assign(static_cast<std::size_t>(B) * streams, 0.0);
  batch.sm.assign(B, 1.0 / std::sqrt(static_cast<double>(d)));
  batch.q.clear();

  std::vector<std::int64_t> order(p.pages);
  std::iota(order.begin(), order.end(), 0);
  if (shuffle_seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937_64(shuffle_seed));
  std::int64_t next = 0;
  const std::size_t n_out = static_cast<std::size_t>(p.outlier_values);
  for (int s = 0; s < B; ++s) {
    const kvcache::KvStore& store = *stores[s];
    batch.n_ctx[s] = static_cast<std::int32_t>(n_ctx[s]);
    batch.shared_end[s] = static_cast<std::int32_t>(std::min<std::int64_t>(store.shared_dither_end(), INT32_MAX));
    batch.q.insert(batch.q.end(), q[s].begin(), q[s].end());
    for (std::int64_t j = 0; j < logical[s]; ++j) batch.page_table[s * max_pages + j] = static_cast<std::int32_t>(order[next++]);
    for (int st = 0; st < streams; ++st) {
      kvcache::KvStore::Reader reader(store, st / cfg.kv_heads, st % cfg.kv_heads);
      const std::size_t at = static_cast<std::size_t>(s) * streams + st;
      int non_outlier = d;
      if (kf == Format::dither_int8) {
        const std::uint8_t* mask = reader.outlier_mask();
        for (int c = 0, rank = 0; c < d; ++c)
          if (mask[c]) batch.outlier_rank[at * d + c] = static_cast<std::int8_t>(rank++);
        non_outlier = reader.non_outlier_channels();
      }
      batch.kappa[at] = subgaussian_kappa(static_cast<long>(n_ctx[s]), delta_loc, non_outlier);
      for (std::int64_t j = 0; j < logical[s]; ++j) {
        const std::int64_t begin = j * P, page = batch.page_table[s * max_pages + j];
        const int written = static_cast<int>(std::min<std::int64_t>(P, n_ctx[s] - begin));
        const kvcache::KvStore::Reader::RawPage raw = reader.raw_page(begin);
        pool.page_counter[page] = raw.page_counter;
        pool.slot_counter[page] = raw.slot_counter;
        const std::size_t slot0 = (static_cast<std::size_t>(st) * p.pages + page) * P;
        const auto packed_rows = [&](Format f, const kvcache::KvStore::Reader::RawSide& side) {
          if (f == Format::fp16) return 0;
          return static_cast<int>(std::clamp<std::int64_t>(side.packed_end - begin, 0, written));
        };
        const int kp = packed_rows(kf, raw.k), vp = packed_rows(vf, raw.v);
        // The device reads one int8 a code: codes packed below 8 bits are unpacked on the way.
        const auto codes = [](const kvcache::KvStore::Reader::RawSide& side, std::size_t n, std::int8_t* out) {
          if (side.code_run != nullptr)
            formats::unpack_codes(side.code_run, side.code_bits, n, out);
          else
            std::copy_n(side.codes, n, out);
        };
        batch.k_packed_rows[at * max_pages + j] = static_cast<std::int16_t>(kp);
        batch.v_packed_rows[at * max_pages + j] = static_cast<std::int16_t>(vp);
        if (kf == Format::dither_int8 && kp > 0) {
          codes(raw.k, static_cast<std::size_t>(d) * P, &pool.k_codes[slot0 * d]);
          std::copy_n(raw.k.meta, static_cast<std::size_t>(kp) * p.k.meta_per_token, &pool.k_meta[slot0 * p.k.meta_per_token]);
          if (n_out > 0) std::copy_n(raw.k.outlier_values, kp * n_out, &pool.k_outliers[slot0 * n_out]);
        } else if (kf != Format::fp16 && kp > 0) {
          std::copy_n(raw.k.packed, static_cast<std::size_t>(kp) * p.k.row_bytes, &pool.k_packed[slot0 * p.k.row_bytes]);
          std::copy_n(raw.k.meta, static_cast<std::size_t>(kp) * p.k.meta_per_token, &pool.k_meta[slot0 * p.k.meta_per_token]);
        }
        if (vf == Format::dither_int8 && vp > 0) {
          codes(raw.v, static_cast<std::size_t>(vp) * d, &pool.v_codes[slot0 * d]);
          std::copy_n(raw.v.meta, static_cast<std::size_t>(vp) * p.v.meta_per_token, &pool.v_meta[slot0 * p.v.meta_per_token]);
        } else if (vf != Format::fp16 && vp > 0) {
          std::copy_n(raw.v.packed, static_cast<std::size_t>(vp) * p.v.row_bytes, &pool.v_packed[slot0 * p.v.row_bytes]);
          std::copy_n(raw.v.meta, static_cast<std::size_t>(vp), &pool.v_meta[slot0]);
        }
        for (int i = kp; i < written; ++i) std::copy_n(reader.exact_key_row(begin + i), d, &pool.k_rows[(slot0 + i) * d]);
        for (int i = vp; i < written; ++i) std::copy_n(reader.exact_value_row(begin + i), d, &pool.v_rows[(slot0 + i) * d]);
      }
    }
  }
}

}  // namespace witcert::cuda
