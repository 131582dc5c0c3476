// The paged pool as the CUDA kernel reads it (plain pointers, host or device memory alike), and the
// per-token reads every path shares: where a position lives, its decoded key and value, and the
// bound c_t of its logit error. A page holds page_size slots of every (layer, KV head) stream; a
// sequence's page table maps its logical pages to pool pages, as kvcache::PageTable does.
#pragma once

#include <cstdint>

#include "attention/cuda/formats.h"

namespace witcert::cuda {

// One side (keys or values) of the pool; the arrays a format does not use are null. Every array is
// [stream][page][...].
struct SideView {
  Format format = Format::fp16;
  const std::uint16_t* rows = nullptr;   // fp16 rows [slot][d]: an fp16 side, and positions served exact
  const std::uint8_t* packed = nullptr;  // q8_0 / q4_0 / fp8-e4m3: [slot][row_bytes]
  const std::uint16_t* meta = nullptr;   // [slot][meta]: B witness bands (scheme keys), ρ_t (scheme values),
                                         // d/32 scales (dither-int8)
  const std::int8_t* codes = nullptr;    // dither-int8: keys [d][page_size] per page, values [slot][d]
  const std::uint16_t* outliers = nullptr;  // dither-int8 keys: [slot][2m], channel order
  int row_bytes = 0;
  int meta_per_token = 0;
};

struct PoolView {
  int d = 0, page_size = 0, kv_heads = 0, bands = 16, outlier_values = 0;  // outlier_values = 2m
  std::int64_t pages = 0;    // pages per stream
  bool neox = false;         // RoPE pair layout of the band map
  std::uint64_t seed = 0;    // dither-int8's Philox key
  bool value_dither = false; // dithered values with their own ξ per slot (KvStore::value_dither)
  SideView k, v;
  const std::uint32_t* page_counter = nullptr;  // [page]: Philox counter word of the page's shared ξ
  const std::uint32_t* slot_counter = nullptr;  // [page]: that of its first slot's own ξ
};

// The sequences of one decode step over the pool. Arrays indexed [seq][stream] have
// layers·kv_heads streams per sequence; a step attends one layer.
struct BatchView {
  int batch = 0, layer = 0, streams = 0, group = 1;  // group: query heads per KV head
  int max_pages = 0;
  const std::int32_t* n_ctx = nullptr;       // [seq] positions attended
  const std::int32_t* page_table = nullptr;  // [seq][max_pages] pool page of each logical page
  // [seq][stream][max_pages]: rows [0, n) of a logical page are served packed, the rest exact
  // (tokens before calibration, repaired pages).
  const std::int16_t* k_packed_rows = nullptr;
  const std::int16_t* v_packed_rows = nullptr;
  const std::int32_t* shared_end = nullptr;  // [seq]: positions below take their page's shared ξ
  const std::int8_t* outlier_rank = nullptr;  // [seq][stream][d]: j for the j-th outlier channel, −1 otherwise
  const double* kappa = nullptr;             // [seq][stream]: tail + bias of Lemma 2's radius
  const float* q = nullptr;                  // [seq][kv_heads·group][d] the step's queries
  const double* sm = nullptr;                // [seq] 1/sqrt(d)
};

// Where position pos of (seq, stream) lives.
struct TokenAt {
  std::int64_t slot = 0;      // stream-relative slot: page·page_size + row
  std::int64_t page = 0;
  int row = 0;
  bool k_packed = false, v_packed = false;
  bool shared = false;        // takes its page's shared ξ
  std::uint32_t counter = 0;  // the Philox counter word of its ξ
};

WITCERT_HD TokenAt locate(const PoolView& pool, const BatchView& b, int seq, int stream, std::int64_t pos) {
  TokenAt t;
  const int P = pool.page_size;
  const std::int64_t logical = pos / P;
  t.row = static_cast<int>(pos % P);
  t.page = b.page_table[static_cast<std::int64_t>(seq) * b.max_pages + logical];
  t.slot = t.page * P + t.row;
  const std::int64_t at = (static_cast<std::int64_t>(seq) * b.streams + stream) * b.max_pages + logical;
  t.k_packed = t.row < b.k_packed_rows[at];
  t.v_packed = t.row < b.v_packed_rows[at];
  t.shared = pos < b.shared_end[seq];
  t.counter = t.shared ? pool.page_counter[t.page] : pool.slot_counter[t.page] + static_cast<std::uint32_t>(t.row);
  return t;
}

// Index of a stream-relative slot in a [stream][slot] array of `per` elements a slot.
WITCERT_HD std::int64_t slot_index(const PoolView& pool, int stream, std::int64_t slot, int per) {
  return (stream * pool.pages * pool.page_size + slot) * per;
}

// k̂ channels 4j .. 4j+3 of a token as Reader::key decodes them (float).
WITCERT_HD void key_quad(const PoolView& pool, const BatchView& b, int seq, int stream, const TokenAt& t, int j, float out[4]) {
  const int d = pool.d;
  const SideView& k = pool.k;
  if (!t.k_packed || k.format == Format::fp16) {
    const std::uint16_t* row = k.rows + slot_index(pool, stream, t.slot, d);
    for (int i = 0; i < 4; ++i) out[i] = half_to_float(row[4 * j + i]);
    return;
  }
  if (k.format != Format::dither_int8) {
    const std::uint8_t* row = k.packed + slot_index(pool, stream, t.slot, k.row_bytes);
    for (int i = 0; i < 4; ++i) out[i] = packed_decode(k.format, row, 4 * j + i);
    return;
  }
  const int P = pool.page_size;
  const std::int8_t* codes = k.codes + (stream * pool.pages + t.page) * static_cast<std::int64_t>(d) * P;
  const std::uint16_t* scales = k.meta + slot_index(pool, stream, t.slot, d / kGroup);
  const std::int8_t* rank = b.outlier_rank + (static_cast<std::int64_t>(seq) * b.streams + stream) * d;
  const int kv_head = stream % pool.kv_heads;
  float xi[4];
  dither_quad(pool.seed, static_cast<std::uint32_t>(b.layer), static_cast<std::uint32_t>(kv_head), t.counter,
              static_cast<std::uint32_t>(j), xi);
  for (int i = 0; i < 4; ++i) {
    const int c = 4 * j + i;
    if (rank[c] >= 0)
      out[i] = half_to_float(k.outliers[slot_index(pool, stream, t.slot, pool.outlier_values) + rank[c]]);
    else
      out[i] = dither_decode(codes[c * P + t.row], scales[c / kGroup], xi[i]);
  }
}

// v̂ channel c of a token as Reader::value decodes it (layer: the step's, for the values' own ξ).
WITCERT_HD float value_at(const PoolView& pool, int layer, int stream, const TokenAt& t, int c) {
  const int d = pool.d;
  const SideView& v = pool.v;
  if (!t.v_packed || v.format == Format::fp16) return half_to_float(v.rows[slot_index(pool, stream, t.slot, d) + c]);
  if (v.format != Format::dither_int8) return packed_decode(v.format, v.packed + slot_index(pool, stream, t.slot, v.row_bytes), c);
  const std::uint16_t* scales = v.meta + slot_index(pool, stream, t.slot, d / kGroup);
  float xi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (pool.value_dither)  // formats::value_stream: the layer word's top bit set; the slot's own counter
    dither_quad(pool.seed, static_cast<std::uint32_t>(layer) | 0x80000000u, static_cast<std::uint32_t>(stream % pool.kv_heads),
                pool.slot_counter[t.page] + static_cast<std::uint32_t>(t.row), static_cast<std::uint32_t>(c / 4), xi);
  return dither_decode(v.codes[slot_index(pool, stream, t.slot, d) + c], scales[c / kGroup], xi[c % 4]);
}

// ρ_t of a token's value (Reader::value).
WITCERT_HD double value_rho(const PoolView& pool, int stream, const TokenAt& t) {
  const SideView& v = pool.v;
  if (!t.v_packed || v.format == Format::fp16) return 0.0;
  if (v.format != Format::dither_int8) return half_to_double(v.meta[slot_index(pool, stream, t.slot, 1)]);
  return dither_value_rho(v.meta + slot_index(pool, stream, t.slot, pool.d / kGroup), pool.d / kGroup);
}

// c_t of a token for query head q in the reference's BoundEvaluator order, bit for bit: Theorem 2 from the
// witness and the head's band norms q_norm, Lemma 2's u_t from the dither scales, 0 for a token
// served exact. The tests' scalar order; the kernel sums Lemma 2's ς_t² by groups (key_bound_grouped).
WITCERT_HD double key_bound(const PoolView& pool, const BatchView& b, int seq, int stream, const TokenAt& t, const float* q,
                            const double* q_norm) {
  const SideView& k = pool.k;
  if (!t.k_packed || k.format == Format::fp16) return 0.0;
  const double sm = b.sm[seq];
  if (k.format != Format::dither_int8)
    return tier_a_c(q_norm, k.meta + slot_index(pool, stream, t.slot, pool.bands), pool.bands, sm);
  const std::int64_t at = static_cast<std::int64_t>(seq) * b.streams + stream;
  const double v2 = dither_variance_proxy(q, k.meta + slot_index(pool, stream, t.slot, pool.d / kGroup),
                                          b.outlier_rank + at * pool.d, pool.d, sm);
  return subgaussian_radius(v2, b.kappa[at]);
}

// key_bound as the kernel evaluates it: Lemma 2's ς_t² from the query's Q_g (q2, d/32 of them) rather
// than channel by channel; Theorem 2's c_t and exact tokens as key_bound.
WITCERT_HD double key_bound_grouped(const PoolView& pool, const BatchView& b, int seq, int stream, const TokenAt& t,
                                    const double* q2, const double* q_norm) {
  const SideView& k = pool.k;
  if (!t.k_packed || k.format == Format::fp16) return 0.0;
  const double sm = b.sm[seq];
  if (k.format != Format::dither_int8)
    return tier_a_c(q_norm, k.meta + slot_index(pool, stream, t.slot, pool.bands), pool.bands, sm);
  const int groups = pool.d / kGroup;
  const double v2 = dither_variance_grouped(q2, k.meta + slot_index(pool, stream, t.slot, groups), groups, sm);
  return subgaussian_radius(v2, b.kappa[static_cast<std::int64_t>(seq) * b.streams + stream]);
}

}  // namespace witcert::cuda
