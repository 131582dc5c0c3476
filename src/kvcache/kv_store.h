// The certified KV cache's storage (DESIGN §2, the kvcache layer): for every (layer, KV head), the real
// packed bytes of the chosen formats in a paged pool, the metadata the meter needs beside them,
// and an exact fp16 backing tier written on every cache write.
//
// Formats, per side (K and V may differ):
//   fp16             exact; the meter is 0.
//   <scheme>         any black-box scheme of formats/schemes.h. Keys carry the Tier-A witness:
//                    B band norms of the residual, fp16 rounded up (paper §4.1). Values carry
//                    ρ_t = ‖v̂_t − v_t‖, fp16 rounded up, for the value-side term.
//   dither-int8      Tier B (§4.2): int8 codes + one fp16 scale per token × 32 channels (keys may
//                    instead take one per channel × block of tokens, CacheConfig::key_scales); keys
//                    also keep m fixed outlier RoPE pairs per (layer, KV head) in fp16, excluded
//                    from the amax. The key dither is regenerated from Philox at read time from
//                    the token's page name and offset (or the page name alone,
//                    DitherMode::shared_page). Values are rounded without
//                    dither: their bound ρ_t ≤ ‖s/2‖ is deterministic. Each page of values also
//                    keeps max_t (‖v̂_t‖ + ρ_t) over its tokens, a float rounded up, for the
//                    value-side term (4 bytes a page: 0.25 a token at page size 16).
// Tokens whose group-scheme block has not filled, dither-int8 keys written before the outlier
// pairs are fixed (the first calibration_tokens positions), and keys whose block of channel
// scales has not filled are served from the exact tier with a zero bound.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/fp16.h"
#include "cert/witness.h"
#include "formats/dither/dither.h"
#include "formats/kv_format.h"
#include "formats/schemes.h"
#include "kvcache/backing_tier.h"
#include "kvcache/page_pool.h"

namespace witcert::kvcache {

enum class DitherMode {
  per_slot,       // the paper's: one ξ per (slot, channel)
  shared_page,    // one ξ per (page, channel), shared by the page's tokens (docs/dither-cost.md)
  shared_prompt,  // the prompt's tokens share their page's ξ, every later token has its own: as sound
                  // as per slot in free decoding (docs/dither-cost.md §2), nearly as fast as shared
  none,           // no dither: keys rounded to nearest on the same scales and outliers (RTN), bounded
                  // by the deterministic |k̂ − k| ≤ s/2 per channel; the δ = 0 reference of the
                  // evaluation, served by the scalar reference path
};

// "per-slot", "shared-page", "shared-prompt", "none"; parse_dither_mode throws
// std::invalid_argument on anything else.
const char* dither_mode_name(DitherMode mode);
DitherMode parse_dither_mode(const std::string& name);

using formats::kDitherInt8;
using formats::FormatKind;

struct CacheConfig {
  int layers = 0;
  int kv_heads = 0;
  int head_dim = 0;
  std::int64_t capacity = 0;  // positions of one sequence
  int page_size = 16;
  // Pages of the pool, shared by every sequence over it; 0: enough for one sequence of capacity.
  std::int64_t pool_pages = 0;
  formats::KvFormat k_format;  // fp16 unless set
  formats::KvFormat v_format;
  int outlier_pairs = 4;        // m (dither-int8 keys)
  int calibration_tokens = 16;  // dither-int8 keys stay exact until the outlier pairs are fixed
  // What a dithered key's scale covers. With `channel`, a channel over a block of scale_block
  // tokens: blocks start at multiples of scale_block inside the prompt, the prompt's last block
  // ends with it, and later blocks follow the prompt; a block's keys are encoded when it is
  // complete, so the whole prompt is encoded once it is written.
  formats::ScaleGranularity key_scales = formats::ScaleGranularity::token;
  int scale_block = formats::kChannelBlock;
  // The most blocks of channel scales a sequence has: the prompt's last one may be short.
  std::size_t scale_blocks() const { return static_cast<std::size_t>((capacity + scale_block - 1) / scale_block + 1); }
  // Dithered keys that only the scalar reference path serves (evaluation options, not serving
  // formats): rounded without dither (DitherMode::none), or with channel scales.
  bool reference_keys() const;
  int bands = cert::kDefaultBands;
  cert::RopeLayout rope_layout = cert::RopeLayout::interleaved;
  std::uint64_t seed = 0x5EED;
  DitherMode dither = DitherMode::per_slot;
  std::uint64_t shuffle_pages = 0;  // ≠ 0: physical pages in a shuffled order (tests)
  // The exact backing tier, kept only when something reads it (a gate's repair, the soundness
  // check): without it a packed side keeps only the rows it has not encoded yet (a ring of a few
  // pages per stream) and an fp16 side its own rows, so a quantized cache holds its packed bytes
  // and little else.
  bool exact_tier = false;
  BackingPlace backing;  // where the tier lives (default: a private memory-mapped temporary file)
  // Per layer, its attention window (kvcache::window_begin; 0: every position); empty: none. The
  // layers with a window keep their slots in a page table of their own, from which the pages
  // before every later query's window go back to the pool (KvStore::retire_before), so that a
  // sliding-window layer holds its window's pages, not the whole context's.
  std::vector<std::int64_t> windows;
};

// ‖v̂‖ + ρ of a dithered value from its decoded v̂ (Reader::value's) and its group scales s_g:
// sqrt(Σ_c v̂_c²) + sqrt(Σ_g 32·(s_g·(½ + 2^-17))²)·kRoundUpMargin, in double, ρ being Reader::value's.
double value_norm_bound(std::span<const float> v_hat, const f16* scales, int groups);

// How the meter bounds one stored key.
struct KeyBound {
  // rounded: dither-int8 keys without dither (DitherMode::none), c_t from the scales alone.
  enum Kind { exact, tier_a, tier_b, rounded } kind = exact;
  const f16* witness = nullptr;  // B band norms (tier_a)
  const f16* scales = nullptr;   // head_dim / scale_group scales (tier_b, rounded)
  // tier_b with the page's shared ξ: the fast kernel's float tiles, whose c_t the meter takes
  // through its moments (cert::MeterStats::add_moment); the reference does the same.
  bool shared_dither = false;
  int scale_group = formats::kDefaultGroup;  // channels per scale: 32, or 1 with channel scales
};

// The bytes a pool of pages holds for every sequence it serves, indexed by slot: every format's
// packed bytes and meter metadata, an fp16 side's own rows, and the exact backing tier. A slot's
// bytes carry nothing of the sequence that wrote them before: every read of a slot is of a
// position its current sequence has written. Each page also keeps its name, the logical page
// its writer gave it, which names its tokens' dither: a page read by any sequence, at any
// physical place, regenerates the ξ it was written with, and a sequence draws the same ξ alone
// or beside others.
class KvPool {
 public:
  // Throws std::invalid_argument for an impossible shape, a format the head size cannot hold or
  // bad outlier pairs. Holds capacity positions of every (layer, KV head).
  explicit KvPool(const CacheConfig& cfg);

  const CacheConfig& config() const { return cfg_; }
  FormatKind kind(formats::KvSide side) const { return side == formats::KvSide::key ? k_.kind : v_.kind; }
  // Dithered keys with channel scales (CacheConfig::key_scales).
  bool channel_scales() const {
    return k_.kind == FormatKind::dither && cfg_.key_scales == formats::ScaleGranularity::channel;
  }
  int code_bits(formats::KvSide side) const { return side == formats::KvSide::key ? k_.code_bits : v_.code_bits; }
  // Pages of the layers without a window (those with one take theirs from a pool of as many, which
  // never runs out first: a sequence holds no more of its pages than of these).
  std::int64_t pages() const { return pages_.pages(); }
  std::int64_t free_pages() const { return pages_.free_pages(); }
  std::size_t slots() const { return static_cast<std::size_t>(pages_.pages()) * cfg_.page_size; }
  bool has_exact_tier() const { return exact_ != nullptr; }
  // Measured bytes of the allocations: every page's compressed form (payload, meter metadata,
  // an fp16 side's rows, page names) and the exact backing tier.
  std::size_t bytes() const;
  std::size_t backing_bytes() const { return exact_ ? exact_->bytes() : 0; }

 private:
  friend class KvStore;
  friend class SequenceState;
  struct Side {
    FormatKind kind = FormatKind::exact;
    const formats::KvScheme* scheme = nullptr;
    int T = 1;                       // tokens per block
    std::size_t block_bytes = 0;     // packed bytes per block
    // Every per-slot array is reserved for the whole pool and committed as its slots are written.
    ReservedArray<std::uint8_t> packed;  // per-token schemes: [stream][slot][block_bytes]
    ReservedArray<f16> meta;           // witness / ρ / dither scales, [stream][slot][meta_per_token]
    int meta_per_token = 0;
    // dither-int8 values: [stream][slot][head_dim]; keys page by page, channel-major inside a page
    // ([stream][page][head_dim][page_size], key_code), so that a page's tokens of one channel are
    // contiguous for the fast kernel, which reads them with the tokens in SIMD lanes.
    ReservedArray<std::int8_t> codes;
    // Dithered codes of B < 8 bits: the same indices as `codes`, packed (formats/dither/code_pack.h),
    // so that each page's codes are one run of page_size·head_dim·B/8 bytes.
    ReservedArray<std::uint8_t> code_runs;
    int code_bits = 8;                 // B of a dithered side
    ReservedArray<f16> outlier_values; // dither-int8 keys: [stream][slot][2m]
    ReservedArray<float> norm_max;     // dither-int8 values: [stream][page] max_t (‖v̂_t‖ + ρ_t)
    ReservedArray<f16> rows;           // an fp16 side without the exact tier: [stream][slot][head_dim]
    std::size_t bytes() const;
  };
  void init_side(Side& side, const formats::KvFormat& format, formats::KvSide which);

  CacheConfig cfg_;
  cert::BandLayout bands_;
  PagePool pages_;
  std::unique_ptr<PagePool> window_pages_;  // the windowed layers' pages; null without a window
  std::int64_t window_ = 0;                 // the largest window of a layer (0: none)
  Side k_, v_;
  // [page], then [page] of window_pages_: the logical page its writer gave it
  std::vector<std::uint32_t> names_;
  std::unique_ptr<BackingTier> exact_;  // rows [stream][slot], head_dim each; null without a tier
};

// One sequence's state in a pool: its page table, the positions written per (layer, KV head), its
// prompt length, repaired pages, outlier pairs, the rows it has not encoded yet, its group-scheme
// blocks (a block spans T positions, so it follows the sequence, not a slot) and its page-in
// statistics. clear() returns its pages to the pool.
class SequenceState {
 public:
  explicit SequenceState(KvPool& pool);
  void clear();
  // Measured bytes of the sequence's own allocations (page table, group blocks, ring, outlier
  // pairs, lengths, repair flags); its pages are the pool's.
  std::size_t bytes() const;
  std::int64_t pages() const { return table_.page_count(); }  // of the layers without a window
  // Pages the layers with a window hold now.
  std::int64_t window_pages() const { return window_table_.page_count() - window_table_.released(); }

 private:
  friend class KvStore;
  struct Side {
    // Group schemes: [stream][group][block_bytes], committed as the sequence's blocks are written.
    ReservedArray<std::uint8_t> groups;
    // Dithered keys with channel scales: [stream][block][head_dim], committed as blocks are encoded.
    ReservedArray<f16> scales;
    // A packed side without the exact tier: the rows it has not encoded yet,
    // [stream][ring][head_dim], position pos in row pos % ring.
    std::vector<f16> ring;
    std::size_t bytes() const { return groups.size() + scales.size() * sizeof(f16) + ring.size() * sizeof(f16); }
  };

  PageTable table_;         // the layers without a window
  PageTable window_table_;  // the layers with one (KvPool::window_pages_)
  Side k_, v_;
  std::int64_t ring_ = 0;                           // rows per stream of a packed side's ring
  std::vector<std::uint8_t> outlier_mask_;          // [stream][head_dim]
  std::vector<char> outliers_fixed_;                // [stream]
  std::vector<std::int64_t> written_;               // [stream]
  std::int64_t prompt_length_ = 0;                  // DitherMode::shared_prompt
  std::int64_t retired_at_ = 0;                     // KvStore::retire_before
  std::int64_t logical_pages_ = 0;                  // per stream
  // [stream][logical page]: the position whose attention repaired the page, or kNotPromoted.
  std::unique_ptr<std::atomic<std::int32_t>[]> promoted_;
  static constexpr std::int32_t kNotPromoted = -1;
  std::atomic<std::int64_t> page_ins_{0}, page_in_bytes_{0};
  std::int64_t shared_page_ins_ = 0;  // repairs taken over with a shared prefix
};

// One sequence's store, the one the certified cache reads and writes: over a pool of its own, or
// over a pool it shares with other sequences (each write and read names only this sequence's
// pages; destroying or clearing the store returns them).
class KvStore {
 public:
  // Throws std::invalid_argument for an unknown format or a shape the format cannot hold.
  explicit KvStore(const CacheConfig& cfg);
  // A new sequence over a shared pool (not null).
  explicit KvStore(std::shared_ptr<KvPool> pool);

  const CacheConfig& config() const { return pool_->cfg_; }
  const KvPool& pool() const { return *pool_; }
  const std::shared_ptr<KvPool>& shared_pool() const { return pool_; }
  const SequenceState& sequence() const { return seq_; }
  FormatKind kind(formats::KvSide side) const { return pool_->kind(side); }

  // Stores the post-RoPE key and value of `pos` for (layer, kv_head); positions arrive in order
  // for each (layer, kv_head). Throws std::out_of_range beyond the capacity.
  void write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v);
  void clear();
  // DitherMode::shared_prompt: positions [0, n) are the request's prompt, whose keys do not depend
  // on this cache's dither; they take their page's shared ξ, later positions their slot's. Set
  // before anything is written (std::logic_error otherwise); clear() resets it to 0.
  void set_prompt_length(std::int64_t n);
  std::int64_t prompt_length() const { return seq_.prompt_length_; }
  // Positions below this take their page's shared ξ, the rest their slot's.
  std::int64_t shared_dither_end() const {
    switch (config().dither) {
      case DitherMode::shared_page: return std::numeric_limits<std::int64_t>::max();
      case DitherMode::shared_prompt: return seq_.prompt_length_;
      case DitherMode::per_slot:
      case DitherMode::none: break;
    }
    return 0;
  }
  bool shared_dither(std::int64_t pos) const { return pos < shared_dither_end(); }
  // Dithered keys take their dither in every mode but `none` (rounded to nearest there, the δ = 0
  // reference). Dithered values (dither-int4/5/6/8 on the value side) take a dither of their own only per
  // slot: the value side's Tier-B bound sums the errors of many tokens and needs each token's
  // dither independent of every other's, which a shared ξ is not. Otherwise they are rounded to
  // nearest and bounded deterministically.
  bool key_dither() const {
    return config().dither != DitherMode::none && config().k_format.kind() == FormatKind::dither;
  }
  bool value_dither() const {
    return config().dither == DitherMode::per_slot && config().v_format.kind() == FormatKind::dither;
  }

  // Prefix sharing: this empty sequence takes positions [0, n) of `donor`, a sequence of the
  // same pool whose tokens there are this one's, by sharing its pages (payload, metadata, exact
  // tier) and copying its own state of those positions (outlier pairs, group blocks): what this
  // sequence reads of [0, n) is then what it would have written itself. Returns false, sharing
  // nothing, unless n is a whole number of pages and of group-scheme blocks, the donor has
  // written it, it covers the dither-int8 calibration tokens, and it lies inside both prompts
  // (set_prompt_length first). Throws std::logic_error for a donor over another pool or a
  // sequence that has written.
  // The donor's repairs of those pages made at positions below n are taken over too: this
  // sequence then holds the repairs it would have made itself while computing [0, n) with the
  // donor's policy, and their page-in stays charged to the donor (PageInStats::shared_page_ins
  // counts them). Repairs the donor made later, at positions ≥ n, are its own.
  // With windowed layers, the donor must still hold the pages of [window_begin(n, window), n).
  bool share_prefix(const KvStore& donor, std::int64_t n);
  // Every query below pos has been answered at every layer (the next forward pass starts at pos):
  // the windowed layers' pages wholly before window_begin(pos, window) go back to the pool, unless
  // a group-scheme block or the dither keys' calibration still has to encode their rows. Those
  // positions are read no more, and repairing them (promote) is a no-op.
  void retire_before(std::int64_t pos);
  std::int64_t retired_at() const { return seq_.retired_at_; }  // the largest pos retire_before was given
  // Positions of `layer` below this are retired (their pages gone back to the pool).
  std::int64_t retired_end(int layer) const {
    return windowed(stream(layer, 0)) ? seq_.window_table_.released() * cfg().page_size : 0;
  }
  std::int64_t length(int layer, int kv_head) const { return seq_.written_[stream(layer, kv_head)]; }

  // Reads for the attention kernel. Not thread-safe on one Reader; make one per call.
  class Reader {
   public:
    Reader(const KvStore& store, int layer, int kv_head);
    const CacheConfig& config() const { return s_.config(); }
    bool has_exact_tier() const { return s_.has_exact_tier(); }
    bool served_exact(std::int64_t begin, std::int64_t end) const { return s_.served_exact(layer_, kv_head_, begin, end); }
    // The fp16 exact-tier rows of a position (what the exact attention path reads).
    const f16* exact_key_row(std::int64_t pos) const;
    const f16* exact_value_row(std::int64_t pos) const;
    // k̂ as the runtime sees it (head_dim floats) and what bounds its logit error.
    void key(std::int64_t pos, float* k_hat, KeyBound& bound);
    // v̂ and an upper bound ρ_t ≥ ‖v̂ − v‖.
    void value(std::int64_t pos, float* v_hat, double& rho);
    // The exact tier (the fp16 the model produced).
    void exact_key(std::int64_t pos, float* k) const;
    void exact_value(std::int64_t pos, float* v) const;
    const std::uint8_t* outlier_mask() const;  // dither-int8 keys: 1 on the m outlier pairs
    int non_outlier_channels() const;

    // Raw views for the fast attention kernel (src/attention/cpu/), which decodes a
    // page at a time. The slots of one page are consecutive, so every per-slot array of a page is
    // one run starting at the page's first slot: row i of a view belongs to position begin + i.
    struct RawSide {
      std::int64_t packed_end = 0;   // [begin, packed_end) come from the packed form, the rest exact
      const f16* exact = nullptr;    // [slot][head_dim]: the exact tier
      const std::uint8_t* packed = nullptr;  // per-token schemes: [slot][block_bytes]
      const f16* meta = nullptr;     // [slot][·]: B witness bands (keys), ρ_t (values) or d/32 dither scales
      const std::int8_t* codes = nullptr;       // dither-int8 keys: [head_dim][page_size]; values: [slot][head_dim]
      // Dithered codes of B < 8 bits: the page's codes, in the order of `codes`, packed in one run
      // (formats::unpack_codes gives `codes`); codes is then null.
      const std::uint8_t* code_run = nullptr;
      int code_bits = 8;
      const f16* outlier_values = nullptr;      // dither-int8 keys: [slot][2m], in channel order
      // dither-int8 values: max_t (‖v̂_t‖ + ρ_t) over [begin, packed_end), as value_norm_bound
      // computes it, rounded up to float.
      const float* norm_max = nullptr;
      bool dithered = false;  // dithered values with their own ξ (KvStore::value_dither): v̂ = s·(code − ξ)
    };
    struct RawPage {
      std::int64_t begin = 0, end = 0;  // the positions of the page
      std::int64_t shared_end = 0;       // [begin, shared_end) take the page's shared ξ, the rest their slot's
      std::uint32_t page_counter = 0;    // Philox counter word of the page's shared ξ
      std::uint32_t slot_counter = 0;    // Philox counter word of the page's first token
      RawSide k, v;
      std::uint32_t counter(std::int64_t pos) const {
        return pos < shared_end ? page_counter : slot_counter + static_cast<std::uint32_t>(pos - begin);
      }
    };
    RawPage raw_page(std::int64_t pos) const;  // the page that holds pos
    FormatKind kind(formats::KvSide side) const { return s_.kind(side); }
    int code_bits(formats::KvSide side) const { return s_.pool_->code_bits(side); }
    const formats::KvScheme* scheme(formats::KvSide side) const;  // nullptr unless FormatKind::scheme
    // Group schemes: the packed block of positions [block·T, block·T + T).
    const std::uint8_t* group_block(formats::KvSide side, std::int64_t block) const;
    formats::DitherStream dither_stream() const;
    bool value_dither() const { return s_.value_dither(); }

   private:
    struct BlockCache {
      std::int64_t group = -1;
      std::vector<float> decoded;
    };
    void decode_scheme(formats::KvSide side, std::int64_t pos, float* out, BlockCache& cache);

    const KvStore& s_;
    int layer_, kv_head_;
    std::size_t stream_;
    BlockCache k_block_, v_block_;
    std::vector<float> xi_;
    std::vector<std::int8_t> codes_;  // one token's codes, gathered from its page
    std::vector<std::uint8_t> no_outliers_;
  };

  // Repair (§6.3.5): serve one logical page of (layer, kv_head) from the exact tier from now on,
  // for the rest of the request (the request-level repair cache, §6.3.9 (c)), asked for by the
  // attention of position `at` (which share_prefix reads). Returns false, and moves nothing, when
  // the page was already promoted. Thread-safe.
  bool promote(int layer, int kv_head, std::int64_t logical_page, std::int64_t at);
  bool promoted(int layer, int kv_head, std::int64_t logical_page) const;

  struct PageInStats {
    std::int64_t page_ins = 0;       // promotions
    std::int64_t page_in_bytes = 0;  // exact K and V bytes read from the backing tier
    // Promotions taken over with a shared prefix: paged in, and counted above, by the donor.
    std::int64_t shared_page_ins = 0;
  };
  PageInStats page_in_stats() const {
    return {seq_.page_ins_.load(), seq_.page_in_bytes_.load(), seq_.shared_page_ins_};
  }

  // Measured bytes of the allocations: the compressed cache (payload + meter metadata + the rows
  // not yet encoded) and the exact backing tier (0 without one).
  std::size_t compressed_bytes() const;
  std::size_t backing_bytes() const;
  bool has_exact_tier() const { return pool_->has_exact_tier(); }
  // Whether every token of [begin, end) of (layer, kv_head) is served exact (unencoded, fp16 or
  // on a promoted page) on both sides.
  bool served_exact(int layer, int kv_head, std::int64_t begin, std::int64_t end) const;
  // Compressed bytes per token per KV head, per side, from the allocations (without the ring of
  // unencoded rows, a fixed buffer per stream that compressed_bytes counts).
  double bytes_per_token_head(formats::KvSide side) const;

 private:
  using Side = KvPool::Side;
  std::size_t stream(int layer, int kv_head) const { return static_cast<std::size_t>(layer) * cfg().kv_heads + kv_head; }
  // Whether stream st's layer has a window, whose slots are KvPool::window_pages_'s.
  bool windowed(std::size_t st) const {
    return !cfg().windows.empty() && cfg().windows[st / static_cast<std::size_t>(cfg().kv_heads)] > 0;
  }
  // The page table that holds stream st's slots, and the index in KvPool::names_ of its physical page.
  const PageTable& table(std::size_t st) const { return windowed(st) ? seq_.window_table_ : seq_.table_; }
  PageTable& table(std::size_t st) { return windowed(st) ? seq_.window_table_ : seq_.table_; }
  std::size_t name_index(std::size_t st, std::int64_t page) const {
    return static_cast<std::size_t>(page + (windowed(st) ? pool_->pages() : 0));
  }
  const CacheConfig& cfg() const { return pool_->cfg_; }
  std::size_t slots() const { return pool_->slots(); }
  // Code i of a dithered side (i indexes Side::codes), stored or read at the side's width.
  static void set_code(Side& side, std::size_t i, std::int8_t code);
  static std::int8_t code(const Side& side, std::size_t i);
  // Index in Side::codes of channel c of the dither-int8 key in global slot `at`.
  std::size_t key_code(std::size_t at, int c) const {
    const std::size_t P = static_cast<std::size_t>(cfg().page_size);
    return at / P * P * cfg().head_dim + static_cast<std::size_t>(c) * P + at % P;
  }
  SequenceState::Side& seq_side(formats::KvSide which) { return which == formats::KvSide::key ? seq_.k_ : seq_.v_; }
  const SequenceState::Side& seq_side(formats::KvSide which) const {
    return which == formats::KvSide::key ? seq_.k_ : seq_.v_;
  }
  // Dithered keys with channel scales (CacheConfig::key_scales): the block of scales that holds
  // pos, its first position and its end, and the most blocks a sequence has.
  bool channel_scales() const { return pool_->channel_scales(); }
  std::int64_t scale_block_index(std::int64_t pos) const;
  std::int64_t scale_block_begin(std::int64_t pos) const;
  std::int64_t scale_block_end(std::int64_t pos) const;
  std::size_t key_scales_index(std::size_t st, std::int64_t pos) const {
    return (st * cfg().scale_blocks() + static_cast<std::size_t>(scale_block_index(pos))) *
           static_cast<std::size_t>(cfg().head_dim);
  }
  // Positions [0, end) of stream st whose keys are encoded once the outlier pairs are fixed: with
  // channel scales the complete blocks, every written position otherwise.
  std::int64_t keys_encodable_end(std::size_t st) const;
  void encode_key_block(std::size_t st, std::int64_t begin, std::int64_t end);
  std::size_t group_blocks(const Side& side) const { return static_cast<std::size_t>((cfg().capacity + side.T - 1) / side.T); }
  // The exact fp16 row of pos (written before anything reads it): the tier's, the side's own fp16
  // rows or its ring of unencoded rows. A page's rows follow the row of its first position.
  f16* exact_row(formats::KvSide which, std::size_t st, std::int64_t pos);
  const f16* exact_row(formats::KvSide which, std::size_t st, std::int64_t pos) const;
  // Rows [begin, begin + n) of stream st's exact side `which`, as floats, into x ([n][head_dim]).
  void load_exact_rows(formats::KvSide which, std::size_t st, std::int64_t begin, int n, float* x) const;
  formats::DitherStream dither_stream(std::size_t st) const {
    return {cfg().seed, static_cast<std::uint32_t>(st / cfg().kv_heads), static_cast<std::uint32_t>(st % cfg().kv_heads)};
  }
  void encode_token(Side& side, formats::KvSide which, std::size_t st, std::int64_t pos);
  void encode_group(Side& side, formats::KvSide which, std::size_t st, std::int64_t group);
  // A scheme token's meter metadata from its exact x and decoded x̂: the Tier-A witness of a key,
  // ρ_t = ‖x̂ − x‖ rounded up of a value.
  void scheme_meta(formats::KvSide which, std::span<const float> x, std::span<const float> x_hat, f16* meta) const;
  void fix_outliers(std::size_t st);  // picks the m pairs, then encodes every key written so far
  // The key's Philox counter word in stream st: its slot's or its page's.
  std::uint32_t dither_counter_slot(std::size_t st, std::int64_t pos) const;
  // The Philox counter word that names a token: its page's name and offset.
  std::uint32_t slot_counter(std::size_t st, std::int64_t pos) const;
  // Positions [0, packed_prefix) of a stream are served from the packed form, the rest from the
  // exact tier (group-scheme blocks not yet full, dither-int8 keys before calibration).
  std::int64_t packed_prefix(const Side& side, formats::KvSide which, std::size_t st) const;
  bool page_promoted(std::size_t st, std::int64_t pos) const {
    return seq_.promoted_[st * seq_.logical_pages_ + pos / cfg().page_size].load(std::memory_order_acquire) !=
           SequenceState::kNotPromoted;
  }
  // Served from the packed form: encoded, and its page not repaired.
  bool encoded(const Side& side, formats::KvSide which, std::size_t st, std::int64_t pos) const {
    return !page_promoted(st, pos) && pos < packed_prefix(side, which, st);
  }

  // The write path's buffers, sized for a token (a group scheme's block) when the store is made, so
  // that a write allocates nothing. A store is written by one thread at a time.
  struct WriteScratch {
    explicit WriteScratch(const KvPool& pool);
    std::vector<float> x, x_hat;               // a token's (a block's) exact values and their decode
    std::vector<float> xi;                     // dither-int8: a key's ξ (zero for values)
    std::vector<std::int8_t> codes;            // dither-int8: a token's codes
    std::vector<std::uint8_t> no_outliers;     // all zero: the outlier mask of a value
    std::vector<double> energy;                // fix_outliers: per RoPE pair
  };

  std::shared_ptr<KvPool> pool_;
  SequenceState seq_;
  WriteScratch scratch_;
};

}  // namespace witcert::kvcache
