#include "kvcache/kv_store.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "cert/round_up.h"
#include "formats/dither/code_pack.h"
#include "kvcache/kv_cache.h"

namespace witcert::kvcache {
namespace {

constexpr int kDitherGroup = formats::kDefaultGroup;

std::invalid_argument config_error(const std::string& what) { return std::invalid_argument("KV cache: " + what); }

// ρ of a dither-int8 value from its group scales: |x̂ − x| ≤ s/2 per channel, plus the float
// rounding of the decode (≤ 127.5·2^-24·s).
double dither_value_rho(const f16* scales, int groups) {
  double sum = 0.0;
  for (int g = 0; g < groups; ++g) {
    const double half = fp16_to_double(scales[g]) * (0.5 + 0x1p-17);
    sum += kDitherGroup * half * half;
  }
  return std::sqrt(sum) * cert::kRoundUpMargin;
}

}  // namespace

bool CacheConfig::reference_keys() const {
  return k_format.kind() == FormatKind::dither &&
         (dither == DitherMode::none || key_scales == formats::ScaleGranularity::channel);
}

std::size_t KvPool::Side::bytes() const {
  return packed.size() + meta.size() * sizeof(f16) + codes.size() + code_runs.size() + outlier_values.size() * sizeof(f16) +
         norm_max.size() * sizeof(float) + rows.size() * sizeof(f16);
}

double value_norm_bound(std::span<const float> v_hat, const f16* scales, int groups) {
  double norm2 = 0.0;
  for (const float x : v_hat) norm2 += static_cast<double>(x) * x;
  return std::sqrt(norm2) + dither_value_rho(scales, groups);
}

KvPool::KvPool(const CacheConfig& cfg)
    : cfg_(cfg),
      bands_(cfg.head_dim, cfg.bands, cfg.rope_layout),
      pages_(cfg.pool_pages > 0 ? cfg.pool_pages : (cfg.capacity + cfg.page_size - 1) / std::max(1, cfg.page_size),
             cfg.page_size, cfg.shuffle_pages) {
  if (cfg.layers <= 0 || cfg.kv_heads <= 0 || cfg.head_dim <= 0 || cfg.capacity <= 0)
    throw config_error("layers, KV heads, head dimension and capacity must be positive");
  if (cfg.pool_pages < 0) throw config_error("the pool's page count is negative");
  if (!cfg.windows.empty()) {
    if (cfg.windows.size() != static_cast<std::size_t>(cfg.layers))
      throw config_error(std::to_string(cfg.windows.size()) + " layer windows for " + std::to_string(cfg.layers) +
                         " layers");
    for (const std::int64_t w : cfg.windows) {
      if (w < 0) throw config_error("a layer's attention window is negative");
      window_ = std::max(window_, w);
    }
  }
  if (window_ > 0) window_pages_ = std::make_unique<PagePool>(pages_.pages(), cfg.page_size, cfg.shuffle_pages);
  names_.assign(static_cast<std::size_t>(pages_.pages()) * (window_pages_ ? 2 : 1), 0);
  const std::size_t streams = static_cast<std::size_t>(cfg.layers) * cfg.kv_heads;
  if (cfg.exact_tier) exact_ = std::make_unique<BackingTier>(streams * slots(), cfg.head_dim, cfg.backing);
  init_side(k_, cfg.k_format, formats::KvSide::key);
  init_side(v_, cfg.v_format, formats::KvSide::value);
  if (exact_) return;
  for (Side* sd : {&k_, &v_})
    if (sd->kind == FormatKind::exact) sd->rows = ReservedArray<f16>(streams * slots() * cfg.head_dim);
}

std::size_t KvPool::bytes() const {
  std::size_t b = k_.bytes() + v_.bytes() + names_.size() * sizeof(std::uint32_t);
  if (exact_ && k_.kind == FormatKind::exact) b += exact_->bytes() / 2;  // fp16 is served from the tier itself
  if (exact_ && v_.kind == FormatKind::exact) b += exact_->bytes() / 2;
  return b;
}

SequenceState::SequenceState(KvPool& pool)
    : table_(pool.pages_, pool.cfg_.capacity),
      window_table_(pool.window_pages_ ? *pool.window_pages_ : pool.pages_, pool.window_pages_ ? pool.cfg_.capacity : 0) {
  const CacheConfig& cfg = pool.cfg_;
  const std::size_t streams = static_cast<std::size_t>(cfg.layers) * cfg.kv_heads;
  outlier_mask_.assign(streams * cfg.head_dim, 0);
  outliers_fixed_.assign(streams, 0);
  written_.assign(streams, 0);
  logical_pages_ = (cfg.capacity + cfg.page_size - 1) / cfg.page_size;
  promoted_ = std::make_unique<std::atomic<std::int32_t>[]>(streams * logical_pages_);
  for (std::size_t i = 0; i < streams * logical_pages_; ++i) promoted_[i].store(kNotPromoted);
  for (auto [pool_side, side] : {std::pair{&pool.k_, &k_}, std::pair{&pool.v_, &v_}})
    if (pool_side->kind == FormatKind::scheme && pool_side->T > 1)
      side->groups =
          ReservedArray<std::uint8_t>(streams * ((cfg.capacity + pool_side->T - 1) / pool_side->T) * pool_side->block_bytes);
  if (pool.channel_scales())
    k_.scales = ReservedArray<f16>(streams * cfg.scale_blocks() * static_cast<std::size_t>(cfg.head_dim));
  if (pool.exact_) return;
  // The ring holds a packed side's rows until they are encoded: a group scheme's unfilled block,
  // dither-int8 keys before calibration, a block of channel scales (which may start inside a
  // page), one row otherwise; whole pages, so that a page's rows follow one another.
  std::int64_t unencoded = 1;
  for (const KvPool::Side* sd : {&pool.k_, &pool.v_}) unencoded = std::max<std::int64_t>(unencoded, sd->T);
  if (pool.k_.kind == FormatKind::dither) unencoded = std::max<std::int64_t>(unencoded, cfg.calibration_tokens);
  if (pool.channel_scales()) unencoded = std::max<std::int64_t>(unencoded, cfg.scale_block + cfg.page_size - 1);
  ring_ = (unencoded + cfg.page_size - 1) / cfg.page_size * cfg.page_size;
  for (auto [pool_side, side] : {std::pair{&pool.k_, &k_}, std::pair{&pool.v_, &v_}})
    if (pool_side->kind != FormatKind::exact) side->ring.assign(streams * ring_ * cfg.head_dim, 0);
}

std::size_t SequenceState::bytes() const {
  const std::size_t streams = written_.size();
  return k_.bytes() + v_.bytes() + outlier_mask_.size() + outliers_fixed_.size() +
         written_.size() * sizeof(std::int64_t) + streams * static_cast<std::size_t>(logical_pages_) * sizeof(std::int32_t) +
         table_.bytes() + window_table_.bytes();
}

void SequenceState::clear() {
  const std::size_t streams = written_.size();
  for (std::size_t i = 0; i < streams * logical_pages_; ++i) promoted_[i].store(kNotPromoted);
  page_ins_ = 0;
  page_in_bytes_ = 0;
  shared_page_ins_ = 0;
  prompt_length_ = 0;
  retired_at_ = 0;
  table_.clear();
  window_table_.clear();
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(outliers_fixed_.begin(), outliers_fixed_.end(), 0);
  std::fill(outlier_mask_.begin(), outlier_mask_.end(), 0);
}

KvStore::WriteScratch::WriteScratch(const KvPool& pool) {
  const std::size_t d = static_cast<std::size_t>(pool.cfg_.head_dim);
  std::size_t T = static_cast<std::size_t>(std::max(pool.k_.T, pool.v_.T));
  if (pool.channel_scales()) T = std::max(T, static_cast<std::size_t>(pool.cfg_.scale_block));
  x.resize(T * d);
  x_hat.resize(T * d);
  xi.resize(d);
  codes.resize(d);
  no_outliers.assign(d, 0);
  energy.resize(d / 2);
}

KvStore::KvStore(const CacheConfig& cfg) : pool_(std::make_shared<KvPool>(cfg)), seq_(*pool_), scratch_(*pool_) {}

KvStore::KvStore(std::shared_ptr<KvPool> pool)
    : pool_(pool ? std::move(pool) : throw std::invalid_argument("KV cache: no pool")),
      seq_(*pool_),
      scratch_(*pool_) {}

f16* KvStore::exact_row(formats::KvSide which, std::size_t st, std::int64_t pos) {
  return const_cast<f16*>(std::as_const(*this).exact_row(which, st, pos));
}

const f16* KvStore::exact_row(formats::KvSide which, std::size_t st, std::int64_t pos) const {
  const bool key = which == formats::KvSide::key;
  const std::size_t d = static_cast<std::size_t>(cfg().head_dim);
  const std::size_t slot_row = st * slots() + static_cast<std::size_t>(table(st).slot(pos));
  if (pool_->exact_) return key ? pool_->exact_->key_row(slot_row) : pool_->exact_->value_row(slot_row);
  const Side& side = key ? pool_->k_ : pool_->v_;
  if (side.kind == FormatKind::exact) return &side.rows[slot_row * d];
  return &seq_side(which).ring[(st * seq_.ring_ + static_cast<std::size_t>(pos % seq_.ring_)) * d];
}

bool KvStore::served_exact(int layer, int kv_head, std::int64_t begin, std::int64_t end) const {
  const std::size_t st = stream(layer, kv_head);
  const std::int64_t k_end = packed_prefix(pool_->k_, formats::KvSide::key, st),
                     v_end = packed_prefix(pool_->v_, formats::KvSide::value, st);
  const std::int64_t packed = std::min(end, std::max(k_end, v_end));
  const std::int64_t page = cfg().page_size;
  for (std::int64_t pos = begin / page * page; pos < packed; pos += page)
    if (!page_promoted(st, pos)) return false;
  return true;
}

void KvPool::init_side(Side& side, const formats::KvFormat& format, formats::KvSide which) {
  const std::size_t streams = static_cast<std::size_t>(cfg_.layers) * cfg_.kv_heads;
  const int d = cfg_.head_dim;
  const bool key = which == formats::KvSide::key;
  if (format.kind() == FormatKind::exact) {
    side.kind = FormatKind::exact;
    return;
  }
  if (format.kind() == FormatKind::dither) {
    formats::check_group(d, kDitherGroup);
    if (key && (cfg_.outlier_pairs < 0 || 2 * cfg_.outlier_pairs >= d))
      throw config_error("outlier pairs must lie in [0, " + std::to_string(d / 2) + "), got " +
                         std::to_string(cfg_.outlier_pairs));
    side.kind = FormatKind::dither;
    side.code_bits = format.dither_bits();
    if (side.code_bits == 8)
      side.codes = ReservedArray<std::int8_t>(streams * slots() * d);
    else
      side.code_runs = ReservedArray<std::uint8_t>(formats::packed_code_bytes(streams * slots() * d, side.code_bits));
    const bool channel_scales = key && cfg_.key_scales == formats::ScaleGranularity::channel;
    if (channel_scales && cfg_.scale_block <= 0) throw config_error("the block of channel scales must hold a token");
    side.meta_per_token = channel_scales ? 0 : d / kDitherGroup;  // channel scales follow the sequence
    side.meta = ReservedArray<f16>(streams * slots() * side.meta_per_token);
    if (key) side.outlier_values = ReservedArray<f16>(streams * slots() * 2 * cfg_.outlier_pairs);
    if (!key) side.norm_max = ReservedArray<float>(streams * pages_.pages());
    return;
  }
  side.kind = FormatKind::scheme;
  side.scheme = format.scheme(which);
  side.scheme->check_head_dim(d);
  side.T = side.scheme->tokens_per_block();
  side.block_bytes = side.scheme->block_bytes(d);
  // Group blocks follow the sequence.
  if (side.T == 1) side.packed = ReservedArray<std::uint8_t>(streams * slots() * side.block_bytes);
  side.meta_per_token = key ? cfg_.bands : 1;  // Tier-A witness, or ρ_t
  side.meta = ReservedArray<f16>(streams * slots() * side.meta_per_token);
}

void KvStore::clear() { seq_.clear(); }

std::uint32_t KvStore::dither_counter_slot(std::size_t st, std::int64_t pos) const {
  // A shared ξ names the page, in a counter range disjoint from slots (top bit set).
  if (shared_dither(pos)) return pool_->names_[name_index(st, table(st).page_of(pos))] | 0x80000000u;
  return slot_counter(st, pos);
}

std::uint32_t KvStore::slot_counter(std::size_t st, std::int64_t pos) const {
  const std::uint32_t name = pool_->names_[name_index(st, table(st).page_of(pos))];
  return name * static_cast<std::uint32_t>(cfg().page_size) + static_cast<std::uint32_t>(pos % cfg().page_size);
}

void KvStore::set_prompt_length(std::int64_t n) {
  if (n < 0) throw std::invalid_argument("the prompt length is negative");
  if (std::any_of(seq_.written_.begin(), seq_.written_.end(), [](std::int64_t w) { return w > 0; }))
    throw std::logic_error("the prompt length is set before anything is written to the cache");
  seq_.prompt_length_ = n;
}

const char* dither_mode_name(DitherMode mode) {
  switch (mode) {
    case DitherMode::per_slot: return "per-slot";
    case DitherMode::shared_page: return "shared-page";
    case DitherMode::shared_prompt: return "shared-prompt";
    case DitherMode::none: return "none";
  }
  return "?";
}

DitherMode parse_dither_mode(const std::string& name) {
  for (DitherMode m : {DitherMode::per_slot, DitherMode::shared_page, DitherMode::shared_prompt, DitherMode::none})
    if (name == dither_mode_name(m)) return m;
  throw std::invalid_argument("unknown dither mode '" + name + "' (per-slot, shared-page, shared-prompt or none)");
}

bool KvStore::share_prefix(const KvStore& donor, std::int64_t n) {
  if (donor.pool_ != pool_) throw std::logic_error("KV cache: sharing a prefix of a sequence over another pool");
  if (std::any_of(seq_.written_.begin(), seq_.written_.end(), [](std::int64_t w) { return w > 0; }))
    throw std::logic_error("KV cache: a sequence shares a prefix before it writes");
  const int P = cfg().page_size;
  if (n <= 0 || n % P != 0) return false;
  for (const Side* sd : {&pool_->k_, &pool_->v_})
    if (sd->kind == FormatKind::scheme && n % sd->T != 0) return false;
  if (pool_->k_.kind == FormatKind::dither && n < cfg().calibration_tokens) return false;
  if (channel_scales() && n % cfg().scale_block != 0) return false;
  if (std::any_of(donor.seq_.written_.begin(), donor.seq_.written_.end(), [n](std::int64_t w) { return w < n; }))
    return false;
  if (seq_.prompt_length_ < n || donor.seq_.prompt_length_ < n) return false;
  if (pool_->window_ > 0 && donor.seq_.window_table_.released() > window_begin(n, pool_->window_) / P) return false;
  seq_.table_.share_prefix(donor.seq_.table_, n / P);
  if (pool_->window_ > 0) seq_.window_table_.share_prefix(donor.seq_.window_table_, n / P);
  std::fill(seq_.written_.begin(), seq_.written_.end(), n);
  for (std::size_t st = 0; st < seq_.written_.size(); ++st)
    for (std::int64_t j = 0; j < n / P; ++j) {
      const std::size_t at = st * static_cast<std::size_t>(seq_.logical_pages_) + static_cast<std::size_t>(j);
      const std::int32_t by = donor.seq_.promoted_[at].load(std::memory_order_acquire);
      if (by == SequenceState::kNotPromoted || by >= n) continue;
      seq_.promoted_[at].store(by, std::memory_order_release);
      seq_.shared_page_ins_ += 1;
    }
  seq_.outlier_mask_ = donor.seq_.outlier_mask_;
  seq_.outliers_fixed_ = donor.seq_.outliers_fixed_;
  if (channel_scales()) {  // blocks of [0, n) lie at multiples of scale_block in both prompts
    const std::size_t d = static_cast<std::size_t>(cfg().head_dim), used = static_cast<std::size_t>(n / cfg().scale_block);
    for (std::size_t st = 0; st < seq_.written_.size(); ++st)
      std::copy_n(&donor.seq_.k_.scales[key_scales_index(st, 0)], used * d, &seq_.k_.scales[key_scales_index(st, 0)]);
  }
  for (const formats::KvSide which : {formats::KvSide::key, formats::KvSide::value}) {
    const Side& sd = which == formats::KvSide::key ? pool_->k_ : pool_->v_;
    if (sd.kind != FormatKind::scheme || sd.T == 1) continue;
    const std::size_t blocks = group_blocks(sd), used = static_cast<std::size_t>(n / sd.T);
    for (std::size_t st = 0; st < seq_.written_.size(); ++st)
      std::copy_n(&donor.seq_side(which).groups[st * blocks * sd.block_bytes], used * sd.block_bytes,
                  &seq_side(which).groups[st * blocks * sd.block_bytes]);
  }
  return true;
}

void KvStore::retire_before(std::int64_t pos) {
  seq_.retired_at_ = std::max(seq_.retired_at_, pos);
  if (pool_->window_ == 0) return;
  // Rows still to be encoded stay too: a group scheme's unfilled block, dither keys before their
  // outlier pairs are fixed or their block of channel scales is complete (each reads the exact
  // rows of every position it covers).
  std::int64_t keep = window_begin(pos, pool_->window_);
  for (std::size_t st = 0; st < seq_.written_.size(); ++st) {
    if (!windowed(st)) continue;
    for (const Side* sd : {&pool_->k_, &pool_->v_})
      if (sd->kind == FormatKind::scheme) keep = std::min(keep, seq_.written_[st] / sd->T * sd->T);
    if (pool_->k_.kind == FormatKind::dither) keep = std::min(keep, packed_prefix(pool_->k_, formats::KvSide::key, st));
  }
  seq_.window_table_.release_before(keep / cfg().page_size);
}

bool KvStore::promote(int layer, int kv_head, std::int64_t logical_page, std::int64_t at) {
  if (!pool_->exact_) throw std::logic_error("KV cache: repair reads the exact backing tier, and this cache keeps none");
  if (at < 0 || at >= cfg().capacity || at > std::numeric_limits<std::int32_t>::max())
    throw std::out_of_range("KV cache: a repair asked for at position " + std::to_string(at) +
                            ", outside the capacity of " + std::to_string(cfg().capacity));
  if (logical_page < table(stream(layer, kv_head)).released()) return false;  // read no more
  std::int32_t expected = SequenceState::kNotPromoted;
  if (!seq_.promoted_[stream(layer, kv_head) * seq_.logical_pages_ + logical_page].compare_exchange_strong(
          expected, static_cast<std::int32_t>(at)))
    return false;
  const std::int64_t first = logical_page * cfg().page_size;
  const std::int64_t tokens = std::clamp<std::int64_t>(seq_.written_[stream(layer, kv_head)] - first, 0, cfg().page_size);
  seq_.page_ins_ += 1;
  seq_.page_in_bytes_ += tokens * cfg().head_dim * 2 * static_cast<std::int64_t>(sizeof(f16));
  return true;
}

bool KvStore::promoted(int layer, int kv_head, std::int64_t logical_page) const {
  return page_promoted(stream(layer, kv_head), logical_page * cfg().page_size);
}

std::int64_t KvStore::packed_prefix(const Side& side, formats::KvSide which, std::size_t st) const {
  switch (side.kind) {
    case FormatKind::exact:
      return 0;
    case FormatKind::scheme:
      return seq_.written_[st] / side.T * side.T;  // whole blocks only
    case FormatKind::dither:
      if (which == formats::KvSide::value) return seq_.written_[st];
      return seq_.outliers_fixed_[st] ? keys_encodable_end(st) : 0;
  }
  return 0;
}

std::int64_t KvStore::scale_block_index(std::int64_t pos) const {
  const std::int64_t T = cfg().scale_block, p = seq_.prompt_length_;
  return pos < p ? pos / T : (p + T - 1) / T + (pos - p) / T;
}

std::int64_t KvStore::scale_block_begin(std::int64_t pos) const {
  const std::int64_t T = cfg().scale_block, p = seq_.prompt_length_;
  return pos < p ? pos / T * T : p + (pos - p) / T * T;
}

std::int64_t KvStore::scale_block_end(std::int64_t pos) const {
  const std::int64_t T = cfg().scale_block, p = seq_.prompt_length_;
  return pos < p ? std::min(pos / T * T + T, p) : scale_block_begin(pos) + T;
}

std::int64_t KvStore::keys_encodable_end(std::size_t st) const {
  const std::int64_t w = seq_.written_[st];
  if (!channel_scales() || w == 0) return w;
  return scale_block_end(w - 1) == w ? w : scale_block_begin(w - 1);
}

void KvStore::write(int layer, int kv_head, std::int64_t pos, const float* k, const float* v) {
  if (layer < 0 || layer >= cfg().layers || kv_head < 0 || kv_head >= cfg().kv_heads)
    throw std::out_of_range("KV cache: no stream for layer " + std::to_string(layer) + ", KV head " +
                            std::to_string(kv_head));
  if (pos < 0 || pos >= cfg().capacity)
    throw std::out_of_range("KV cache: position " + std::to_string(pos) + " outside the capacity of " +
                            std::to_string(cfg().capacity));
  const std::size_t st = stream(layer, kv_head);
  if (pos != seq_.written_[st])
    throw std::invalid_argument("KV cache: position " + std::to_string(pos) + " written out of order (expected " +
                                std::to_string(seq_.written_[st]) + ")");
  PageTable& pages = table(st);
  if (pos >= pages.positions_mapped()) {
    pages.slot_for_write(pos);
    pool_->names_[name_index(st, pages.page_of(pos))] = static_cast<std::uint32_t>(pos / cfg().page_size);
  }
  const int d = cfg().head_dim;
  f16* ek = exact_row(formats::KvSide::key, st, pos);
  f16* ev = exact_row(formats::KvSide::value, st, pos);
  for (int i = 0; i < d; ++i) {
    ek[i] = fp16_from_float(k[i]);  // the backing tier (or the side's rows), written on every write
    ev[i] = fp16_from_float(v[i]);
  }
  seq_.written_[st] = pos + 1;

  if (pool_->k_.kind == FormatKind::dither && !seq_.outliers_fixed_[st]) {
    if (pos + 1 >= cfg().calibration_tokens) fix_outliers(st);  // encodes what it can of [0, pos]
  } else if (channel_scales()) {
    if (pos + 1 == scale_block_end(pos)) encode_key_block(st, scale_block_begin(pos), pos + 1);
  } else if (pool_->k_.kind == FormatKind::scheme && pool_->k_.T > 1) {
    if ((pos + 1) % pool_->k_.T == 0) encode_group(pool_->k_, formats::KvSide::key, st, pos / pool_->k_.T);
  } else if (pool_->k_.kind != FormatKind::exact) {
    encode_token(pool_->k_, formats::KvSide::key, st, pos);
  }
  if (pool_->v_.kind == FormatKind::scheme && pool_->v_.T > 1) {
    if ((pos + 1) % pool_->v_.T == 0) encode_group(pool_->v_, formats::KvSide::value, st, pos / pool_->v_.T);
  } else if (pool_->v_.kind != FormatKind::exact) {
    encode_token(pool_->v_, formats::KvSide::value, st, pos);
  }
}

void KvStore::fix_outliers(std::size_t st) {
  const int d = cfg().head_dim;
  // Pair energy Σ_t k_lo² + k_hi² over the tokens seen so far picks the m outlier pairs.
  std::vector<double>& energy = scratch_.energy;
  energy.assign(d / 2, 0.0);
  for (std::int64_t pos = 0; pos < seq_.written_[st]; ++pos) {
    const f16* ek = exact_row(formats::KvSide::key, st, pos);
    for (int j = 0; j < d / 2; ++j) {
      const cert::RopePair p = cert::rope_pair(cfg().rope_layout, d, j);
      const double a = fp16_to_float(ek[p.lo]), b = fp16_to_float(ek[p.hi]);
      energy[j] += a * a + b * b;
    }
  }
  std::uint8_t* mask = &seq_.outlier_mask_[st * d];
  for (int m = 0; m < cfg().outlier_pairs; ++m) {
    const int j = static_cast<int>(std::max_element(energy.begin(), energy.end()) - energy.begin());
    energy[j] = -1.0;
    const cert::RopePair p = cert::rope_pair(cfg().rope_layout, d, j);
    mask[p.lo] = mask[p.hi] = 1;
  }
  seq_.outliers_fixed_[st] = 1;
  if (channel_scales()) {
    for (std::int64_t begin = 0; begin < keys_encodable_end(st); begin = scale_block_end(begin))
      encode_key_block(st, begin, scale_block_end(begin));
    return;
  }
  for (std::int64_t pos = 0; pos < seq_.written_[st]; ++pos) encode_token(pool_->k_, formats::KvSide::key, st, pos);
}

void KvStore::encode_key_block(std::size_t st, std::int64_t begin, std::int64_t end) {
  Side& side = pool_->k_;
  const int d = cfg().head_dim, n = static_cast<int>(end - begin);
  const std::span<float> x(scratch_.x.data(), static_cast<std::size_t>(n) * d);
  load_exact_rows(formats::KvSide::key, st, begin, n, x.data());
  const std::span<const std::uint8_t> mask(&seq_.outlier_mask_[st * d], d);
  const std::span<f16> scales(&seq_.k_.scales[key_scales_index(st, begin)], d);
  formats::dither_channel_scales(side.code_bits, x, n, mask, scales);
  const std::span<float> xi(scratch_.xi.data(), d);
  const std::span<std::int8_t> codes(scratch_.codes.data(), d);
  const std::size_t n_out = 2 * static_cast<std::size_t>(cfg().outlier_pairs);
  const formats::DitherStream stream = dither_stream(st);
  for (int t = 0; t < n; ++t) {
    const std::size_t at = st * slots() + static_cast<std::size_t>(table(st).slot(begin + t));
    std::fill(xi.begin(), xi.end(), 0.0f);
    if (key_dither()) formats::dither_values(stream, dither_counter_slot(st, begin + t), xi);
    formats::encode_dither_scaled(std::span<const float>(&x[t * d], d), xi, mask, scales, 1, codes,
                                  std::span<f16>(n_out ? &side.outlier_values[at * n_out] : nullptr, n_out));
    for (int c = 0; c < d; ++c) set_code(side, key_code(at, c), codes[c]);
  }
}

void KvStore::load_exact_rows(formats::KvSide which, std::size_t st, std::int64_t begin, int n, float* x) const {
  const int d = cfg().head_dim;
  for (int t = 0; t < n; ++t) {
    const f16* exact = exact_row(which, st, begin + t);
    for (int i = 0; i < d; ++i) x[t * d + i] = fp16_to_float(exact[i]);
  }
}

void KvStore::encode_token(Side& side, formats::KvSide which, std::size_t st, std::int64_t pos) {
  const int d = cfg().head_dim;
  const bool key = which == formats::KvSide::key;
  const std::int64_t slot = table(st).slot(pos);
  const std::size_t at = st * slots() + slot;
  const std::span<float> x(scratch_.x.data(), d), x_hat(scratch_.x_hat.data(), d);
  load_exact_rows(which, st, pos, 1, x.data());

  if (side.kind == FormatKind::dither) {
    const std::span<float> xi(scratch_.xi.data(), d);
    std::fill(xi.begin(), xi.end(), 0.0f);
    const std::uint8_t* mask = key ? &seq_.outlier_mask_[st * d] : scratch_.no_outliers.data();
    const formats::DitherStream stream = dither_stream(st);
    if (key && key_dither()) formats::dither_values(stream, dither_counter_slot(st, pos), xi);
    if (!key && value_dither()) formats::dither_values(formats::value_stream(stream), slot_counter(st, pos), xi);
    const std::size_t n_out = key ? 2 * static_cast<std::size_t>(cfg().outlier_pairs) : 0;
    const std::span<std::int8_t> codes(scratch_.codes.data(), d);
    formats::encode_dither(side.code_bits, x, xi, std::span<const std::uint8_t>(mask, d), kDitherGroup, codes,
                              std::span<f16>(&side.meta[at * side.meta_per_token], side.meta_per_token),
                              std::span<f16>(n_out ? &side.outlier_values[at * n_out] : nullptr, n_out));
    for (int c = 0; c < d; ++c) set_code(side, key ? key_code(at, c) : at * d + c, codes[c]);
    if (!key) {  // the page's max_t (‖v̂_t‖ + ρ_t), restarted by its first token
      const f16* scales = &side.meta[at * side.meta_per_token];
      formats::decode_dither(codes, std::span<const f16>(scales, side.meta_per_token), xi,
                             std::span<const std::uint8_t>(mask, d), {}, kDitherGroup, x_hat);
      const float bound = cert::float_round_up(value_norm_bound(x_hat, scales, side.meta_per_token));
      float& page_max = side.norm_max[st * pool_->pages() + static_cast<std::size_t>(slot / cfg().page_size)];
      page_max = pos % cfg().page_size == 0 ? bound : std::max(page_max, bound);
    }
    return;
  }
  std::uint8_t* packed = &side.packed[at * side.block_bytes];
  side.scheme->encode(x.data(), d, packed);
  side.scheme->decode(packed, d, x_hat.data());
  scheme_meta(which, x, x_hat, &side.meta[at * side.meta_per_token]);
}

void KvStore::scheme_meta(formats::KvSide which, std::span<const float> x, std::span<const float> x_hat, f16* meta) const {
  if (which == formats::KvSide::key) {
    cert::tier_a_witness(pool_->bands_, x_hat, x, std::span<f16>(meta, cfg().bands));
    return;
  }
  double rho = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) rho += (double(x_hat[i]) - x[i]) * (double(x_hat[i]) - x[i]);
  meta[0] = fp16_from_double(std::sqrt(rho) * cert::kRoundUpMargin, Round::up);
}

void KvStore::encode_group(Side& side, formats::KvSide which, std::size_t st, std::int64_t group) {
  const int d = cfg().head_dim, T = side.T;
  float *x = scratch_.x.data(), *x_hat = scratch_.x_hat.data();  // T × d each
  load_exact_rows(which, st, group * T, T, x);
  std::uint8_t* packed = &seq_side(which).groups[(st * group_blocks(side) + group) * side.block_bytes];
  side.scheme->encode(x, d, packed);
  side.scheme->decode(packed, d, x_hat);
  for (int t = 0; t < T; ++t) {
    f16* meta = &side.meta[(st * slots() + table(st).slot(group * T + t)) * side.meta_per_token];
    scheme_meta(which, std::span<const float>(&x[t * d], d), std::span<const float>(&x_hat[t * d], d), meta);
  }
}

std::size_t KvStore::compressed_bytes() const {
  return pool_->bytes() + seq_.k_.bytes() + seq_.v_.bytes() + seq_.outlier_mask_.size();
}

std::size_t KvStore::backing_bytes() const { return pool_->backing_bytes(); }

double KvStore::bytes_per_token_head(formats::KvSide side) const {
  const Side& s = side == formats::KvSide::key ? pool_->k_ : pool_->v_;
  const double tokens = static_cast<double>(cfg().layers) * cfg().kv_heads * static_cast<double>(slots());
  if (s.kind == FormatKind::exact && pool_->exact_) return static_cast<double>(pool_->exact_->bytes()) / 2 / tokens;
  // The sequence's group blocks count; its ring is a fixed staging buffer per stream, not a cost per token.
  double b = static_cast<double>(s.bytes() + seq_side(side).groups.size() + seq_side(side).scales.size() * sizeof(f16));
  if (side == formats::KvSide::key && s.kind == FormatKind::dither) b += seq_.outlier_mask_.size();
  return b / tokens;
}

void KvStore::set_code(Side& side, std::size_t i, std::int8_t code) {
  if (side.code_bits == 8)
    side.codes[i] = code;
  else
    formats::pack_code(side.code_runs.data(), i, side.code_bits, code);
}

std::int8_t KvStore::code(const Side& side, std::size_t i) {
  return side.code_bits == 8 ? side.codes[i] : formats::unpack_code(side.code_runs.data(), i, side.code_bits);
}

// --- Reader ---

KvStore::Reader::Reader(const KvStore& store, int layer, int kv_head)
    : s_(store), layer_(layer), kv_head_(kv_head), stream_(store.stream(layer, kv_head)) {}

const f16* KvStore::Reader::exact_key_row(std::int64_t pos) const {
  return s_.exact_row(formats::KvSide::key, stream_, pos);
}

const f16* KvStore::Reader::exact_value_row(std::int64_t pos) const {
  return s_.exact_row(formats::KvSide::value, stream_, pos);
}

void KvStore::Reader::exact_key(std::int64_t pos, float* k) const {
  const f16* e = exact_key_row(pos);
  for (int i = 0; i < s_.cfg().head_dim; ++i) k[i] = fp16_to_float(e[i]);
}

void KvStore::Reader::exact_value(std::int64_t pos, float* v) const {
  const f16* e = exact_value_row(pos);
  for (int i = 0; i < s_.cfg().head_dim; ++i) v[i] = fp16_to_float(e[i]);
}

const std::uint8_t* KvStore::Reader::outlier_mask() const { return &s_.seq_.outlier_mask_[stream_ * s_.cfg().head_dim]; }

int KvStore::Reader::non_outlier_channels() const {
  const std::uint8_t* m = outlier_mask();
  return static_cast<int>(s_.cfg().head_dim - std::count(m, m + s_.cfg().head_dim, 1));
}

KvStore::Reader::RawPage KvStore::Reader::raw_page(std::int64_t pos) const {
  const int P = s_.cfg().page_size, d = s_.cfg().head_dim;
  RawPage r;
  r.begin = pos / P * P;
  r.end = r.begin + P;
  const std::int64_t page = s_.table(stream_).page_of(pos);
  const std::size_t first = stream_ * s_.slots() + static_cast<std::size_t>(page) * P;
  const std::uint32_t name = s_.pool_->names_[s_.name_index(stream_, page)];
  r.page_counter = name | 0x80000000u;
  r.slot_counter = name * static_cast<std::uint32_t>(P);
  r.shared_end = std::clamp(s_.shared_dither_end(), r.begin, r.end);
  const bool repaired = s_.page_promoted(stream_, pos);  // a repaired page is served exact
  auto view = [&](const Side& sd, formats::KvSide which, const f16* exact) {
    RawSide v;
    v.packed_end = repaired ? r.begin : std::clamp(s_.packed_prefix(sd, which, stream_), r.begin, r.end);
    v.exact = exact;
    if (sd.kind == FormatKind::scheme && sd.T == 1) v.packed = &sd.packed[first * sd.block_bytes];
    if (sd.kind != FormatKind::exact && sd.meta_per_token > 0) v.meta = &sd.meta[first * sd.meta_per_token];
    if (sd.kind == FormatKind::dither && sd.code_bits == 8) v.codes = &sd.codes[first * d];
    if (sd.kind == FormatKind::dither && sd.code_bits < 8) {
      v.code_run = &sd.code_runs[formats::packed_code_bytes(first * d, sd.code_bits)];
      v.code_bits = sd.code_bits;
    }
    if (!sd.outlier_values.empty()) v.outlier_values = &sd.outlier_values[first * 2 * s_.cfg().outlier_pairs];
    if (!sd.norm_max.empty()) v.norm_max = &sd.norm_max[stream_ * s_.pool_->pages() + static_cast<std::size_t>(page)];
    return v;
  };
  // A page's slots, and its rows in a ring, follow one another from the row of its first position.
  r.k = view(s_.pool_->k_, formats::KvSide::key, s_.exact_row(formats::KvSide::key, stream_, r.begin));
  r.v = view(s_.pool_->v_, formats::KvSide::value, s_.exact_row(formats::KvSide::value, stream_, r.begin));
  r.v.dithered = s_.value_dither();
  return r;
}

const formats::KvScheme* KvStore::Reader::scheme(formats::KvSide side) const {
  return (side == formats::KvSide::key ? s_.pool_->k_ : s_.pool_->v_).scheme;
}

const std::uint8_t* KvStore::Reader::group_block(formats::KvSide side, std::int64_t block) const {
  const Side& sd = side == formats::KvSide::key ? s_.pool_->k_ : s_.pool_->v_;
  return &s_.seq_side(side).groups[(stream_ * s_.group_blocks(sd) + block) * sd.block_bytes];
}

formats::DitherStream KvStore::Reader::dither_stream() const { return s_.dither_stream(stream_); }

void KvStore::Reader::decode_scheme(formats::KvSide side, std::int64_t pos, float* out, BlockCache& cache) {
  const Side& sd = side == formats::KvSide::key ? s_.pool_->k_ : s_.pool_->v_;
  const int d = s_.cfg().head_dim;
  if (sd.T == 1) {
    sd.scheme->decode(&sd.packed[(stream_ * s_.slots() + s_.table(stream_).slot(pos)) * sd.block_bytes], d, out);
    return;
  }
  const std::int64_t group = pos / sd.T;
  if (cache.group != group) {  // a group scheme decodes its whole block once per call
    cache.decoded.resize(static_cast<std::size_t>(sd.T) * d);
    sd.scheme->decode(group_block(side, group), d, cache.decoded.data());
    cache.group = group;
  }
  std::copy_n(&cache.decoded[(pos % sd.T) * d], d, out);
}

void KvStore::Reader::key(std::int64_t pos, float* k_hat, KeyBound& bound) {
  const Side& sd = s_.pool_->k_;
  if (!s_.encoded(sd, formats::KvSide::key, stream_, pos)) {
    exact_key(pos, k_hat);
    bound = KeyBound{};
    return;
  }
  const int d = s_.cfg().head_dim;
  const std::size_t at = stream_ * s_.slots() + s_.table(stream_).slot(pos);
  if (sd.kind == FormatKind::scheme) {
    decode_scheme(formats::KvSide::key, pos, k_hat, k_block_);
    bound = KeyBound{KeyBound::tier_a, &sd.meta[at * sd.meta_per_token], nullptr};
    return;
  }
  const bool rounded = s_.cfg().dither == DitherMode::none;
  xi_.assign(d, 0.0f);  // sized on first use: the fast kernel reads raw pages and never needs it
  if (!rounded) formats::dither_values(dither_stream(), s_.dither_counter_slot(stream_, pos), xi_);
  const std::size_t n_out = 2 * static_cast<std::size_t>(s_.cfg().outlier_pairs);
  codes_.resize(d);
  for (int c = 0; c < d; ++c) codes_[c] = code(sd, s_.key_code(at, c));
  const bool channel = s_.channel_scales();
  const int group = channel ? 1 : kDitherGroup;
  const f16* scales = channel ? &s_.seq_.k_.scales[s_.key_scales_index(stream_, pos)] : &sd.meta[at * sd.meta_per_token];
  formats::decode_dither(codes_, std::span<const f16>(scales, d / group), xi_, std::span<const std::uint8_t>(outlier_mask(), d),
                         std::span<const f16>(n_out ? &sd.outlier_values[at * n_out] : nullptr, n_out), group,
                         std::span<float>(k_hat, d));
  bound = rounded ? KeyBound{KeyBound::rounded, nullptr, scales, false, group}
                  : KeyBound{KeyBound::tier_b, nullptr, scales, s_.shared_dither(pos), group};
}

void KvStore::Reader::value(std::int64_t pos, float* v_hat, double& rho) {
  const Side& sd = s_.pool_->v_;
  if (!s_.encoded(sd, formats::KvSide::value, stream_, pos)) {
    exact_value(pos, v_hat);
    rho = 0.0;
    return;
  }
  const int d = s_.cfg().head_dim;
  const std::size_t at = stream_ * s_.slots() + s_.table(stream_).slot(pos);
  if (sd.kind == FormatKind::scheme) {
    decode_scheme(formats::KvSide::value, pos, v_hat, v_block_);
    rho = fp16_to_double(sd.meta[at]);
    return;
  }
  xi_.assign(d, 0.0f);
  if (s_.value_dither())
    formats::dither_values(formats::value_stream(dither_stream()), s_.slot_counter(stream_, pos), xi_);
  no_outliers_.assign(d, 0);
  codes_.resize(d);
  for (int c = 0; c < d; ++c) codes_[c] = code(sd, at * d + c);
  formats::decode_dither(codes_,
                            std::span<const f16>(&sd.meta[at * sd.meta_per_token], sd.meta_per_token), xi_,
                            no_outliers_, {}, kDitherGroup,
                            std::span<float>(v_hat, d));
  rho = dither_value_rho(&sd.meta[at * sd.meta_per_token], sd.meta_per_token);
}

}  // namespace witcert::kvcache
