#include "gate/telemetry.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <cstdarg>
#include <cstdio>
#include <string>

namespace witcert::gate {
namespace {

// printf into a string (the library does not link fmt).
std::string printf_string(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string printf_string(const char* format, ...) {
  std::va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out(static_cast<std::size_t>(std::max(n, 0)) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), format, again);
  va_end(again);
  out.resize(out.size() - 1);
  return out;
}

nlohmann::json number(double v) {
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

// The order of the worst cells: the larger raw score first, then the earlier (position, layer,
// head), so that the kept cells do not depend on which thread served which.
bool worse(const MeterCell& a, const MeterCell& b) {
  const bool a_nan = std::isnan(a.raw_before), b_nan = std::isnan(b.raw_before);
  if (a_nan != b_nan) return a_nan;  // NaN (no guarantee) ranks first
  if (!a_nan && a.raw_before != b.raw_before) return a.raw_before > b.raw_before;
  if (a.pos != b.pos) return a.pos < b.pos;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.q_head < b.q_head;
}

nlohmann::json coverage_json(const Coverage& c) {
  return {{"joint", number(c.joint)}, {"k", number(c.k)}, {"v", number(c.v)}, {"eform", number(c.eform)}};
}

}  // namespace

double LogHistogram::upper_edge(int b) {
  // Computed once: bucket_of reads them for every cell the attention path records.
  static const std::array<double, kBuckets> edges = [] {
    std::array<double, kBuckets> e{};
    e[0] = 0.0;
    e[1] = kLow;
    for (int i = 2; i < kBuckets - 2; ++i) e[i] = kLow * std::pow(10.0, static_cast<double>(i - 1) / kPerDecade);
    e[kBuckets - 2] = kHigh;  // exactly, whatever pow's rounding
    e[kBuckets - 1] = INFINITY;
    return e;
  }();
  return edges[std::clamp(b, 0, kBuckets - 1)];
}

int LogHistogram::bucket_of(double x) {
  if (!(x <= kHigh)) return kBuckets - 1;  // above, +inf or NaN
  if (x <= 0.0) return 0;
  if (x <= kLow) return 1;
  // The log gives the bucket to within rounding; the edges, computed one way, decide.
  int b = 1 + static_cast<int>(std::ceil(std::log10(x / kLow) * kPerDecade));
  b = std::clamp(b, 2, kBuckets - 2);
  while (b < kBuckets - 2 && x > upper_edge(b)) ++b;
  while (b > 2 && x <= upper_edge(b - 1)) --b;
  return b;
}

void LogHistogram::add(double x) {
  ++counts_[bucket_of(x)];
  ++n_;
  if (std::isnan(x)) x = INFINITY;
  max_ = std::max(max_, x);
}

void LogHistogram::merge(const LogHistogram& o) {
  for (int b = 0; b < kBuckets; ++b) counts_[b] += o.counts_[b];
  n_ += o.n_;
  max_ = std::max(max_, o.max_);
}

double LogHistogram::quantile(double q) const {
  if (n_ == 0) return NAN;
  const std::int64_t rank = std::min(n_ - 1, static_cast<std::int64_t>(q * static_cast<double>(n_)));
  std::int64_t below = 0;
  for (int b = 0; b < kBuckets; ++b) {
    below += counts_[b];
    if (below > rank) return std::min(upper_edge(b), max_);
  }
  return max_;
}

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::certified: return "certified";
    case Verdict::repaired: return "repaired";
    case Verdict::at_risk: return "at-risk";
    case Verdict::unmetered: return "unmetered";
  }
  return "unmetered";
}

Verdict TelemetrySummary::verdict() const {
  if (cells == 0) return Verdict::unmetered;
  if (violations > 0 || coverage.joint < 1.0) return Verdict::at_risk;
  return repaired > 0 || page_ins > 0 ? Verdict::repaired : Verdict::certified;
}

std::string TelemetrySummary::reason() const {
  const long long n = cells;
  switch (verdict()) {
    case Verdict::unmetered: return "no decode step was metered";
    case Verdict::certified: return printf_string("every one of %lld cells met tau_K %g and tau_V %g", n, tau_k, tau_v);
    case Verdict::repaired:
      return printf_string("every one of %lld cells met tau_K %g and tau_V %g; the gate repaired %lld of them and "
                           "promoted %lld pages", n, tau_k, tau_v, static_cast<long long>(repaired),
                           static_cast<long long>(page_ins));
    case Verdict::at_risk: break;
  }
  if (violations > 0)
    return printf_string("the soundness check found %lld of %lld checked cells above their meter",
                         static_cast<long long>(violations), static_cast<long long>(checked));
  const long long above = std::llround((1.0 - coverage.joint) * static_cast<double>(cells));
  std::string line = printf_string("%lld of %lld cells (%.1f %%) exceed tau_K %g or tau_V %g", above, n,
                                   100.0 * (1.0 - coverage.joint), tau_k, tau_v);
  if (!worst.empty()) {
    const MeterCell& w = worst.front();
    line += printf_string("; worst: layer %d, head %d, step %lld, meter %.3f", w.layer, w.q_head,
                          static_cast<long long>(w.pos - first_pos), w.meter_before);
  }
  line += repaired > 0 ? printf_string("; the gate repaired %lld cells (its own tau or budget is looser than these)", static_cast<long long>(repaired))
                       : std::string("; a gate (tau_k) would repair them");
  return line;
}

nlohmann::json TelemetrySummary::to_json() const {
  nlohmann::json worst_cells = nlohmann::json::array();
  for (const MeterCell& c : worst)
    worst_cells.push_back({{"layer", c.layer},
                           {"q_head", c.q_head},
                           {"step", c.pos - first_pos},
                           {"raw", number(c.raw_before)},
                           {"meter", number(c.meter_before)},
                           {"repaired", c.repaired}});
  nlohmann::json by_layer = nlohmann::json::array();
  for (double share : above_tau_by_layer) by_layer.push_back(number(share));
  return {{"cells", cells},
          {"bound", cert::bound_shape_name(bound)},
          {"bound_label", cert::bound_shape_label(bound)},
          {"tau_k", tau_k},
          {"tau_v", tau_v},
          {"coverage", coverage_json(coverage)},
          {"coverage_before_gate", coverage_json(coverage_before)},
          {"raw_p50", number(raw_p50)},
          {"raw_p90", number(raw_p90)},
          {"raw_p99", number(raw_p99)},
          {"raw_max", number(raw_max)},
          {"v_meter_p50", number(v_meter_p50)},
          {"worst", worst_cells},
          {"overflow", overflow},
          {"repaired", repaired},
          {"soundness_checked", checked},
          {"soundness_violations", violations},
          {"saturated", saturated},
          {"above_tau_by_layer", by_layer},
          {"verdict", verdict_name(verdict())},
          {"reason", reason()}};
}

void Telemetry::Covered::add(double meter, double v_meter, double eform_raw, double tau_k, double tau_v) {
  const bool pk = meter <= tau_k, pv = v_meter <= tau_v;
  joint += pk && pv;
  k += pk;
  v += pv;
  eform += std::min(1.0, eform_raw) <= tau_k;
}

void Telemetry::Covered::merge(const Covered& o) {
  joint += o.joint;
  k += o.k;
  v += o.v;
  eform += o.eform;
}

Coverage Telemetry::Covered::over(std::int64_t cells) const {
  if (cells == 0) return {};
  const double n = static_cast<double>(cells);
  return {joint / n, k / n, v / n, eform / n};
}

namespace {

// The validated dimensions of a telemetry: throws before anything is sized from them.
std::size_t heat_cells(int layers, int heads, double tau_k, double tau_v, int stride) {
  if (layers <= 0 || heads <= 0) throw std::invalid_argument("telemetry needs at least one layer and head");
  if (!(tau_k > 0.0) || !std::isfinite(tau_k) || !(tau_v > 0.0) || !std::isfinite(tau_v))
    throw std::invalid_argument("the coverage thresholds tau and tau_v must be finite and positive");
  if (stride < 0) throw std::invalid_argument("the sampling stride must not be negative");
  return static_cast<std::size_t>(layers) * heads;
}

}  // namespace

Telemetry::Telemetry(int layers, int heads, const Options& opts)
    : layers_(layers),
      heads_(heads),
      opts_(opts),
      shards_([&] {
        Shard s;
        s.sum_meter.assign(heat_cells(layers, heads, opts.tau_k, opts.tau_v, opts.stride), 0.0);
        s.count.assign(s.sum_meter.size(), 0);
        s.above_tau.assign(static_cast<std::size_t>(layers), 0);
        return s;
      }()) {}

void Telemetry::Shard::keep_if_worst(const MeterCell& c) {
  if (n_worst < kWorstCells) {
    worst[n_worst++] = c;
  } else {
    MeterCell* least = std::min_element(worst.begin(), worst.end(), [](const MeterCell& a, const MeterCell& b) {
      return worse(b, a);
    });
    if (!worse(c, *least)) return;
    *least = c;
  }
}

void Telemetry::record(std::span<const MeterCell> cells) {
  Shard& s = shards_.local();
  for (const MeterCell& c : cells) {
    if (c.pos < opts_.first_pos) continue;
    if (c.layer < 0 || c.layer >= layers_ || c.q_head < 0 || c.q_head >= heads_)
      throw std::out_of_range("telemetry: cell of layer " + std::to_string(c.layer) + ", head " +
                              std::to_string(c.q_head) + " outside " + std::to_string(layers_) + " x " +
                              std::to_string(heads_));
    const std::size_t at = static_cast<std::size_t>(c.layer) * heads_ + c.q_head;
    ++s.cells;
    s.covered.add(c.meter, c.v_meter, c.eform_raw, opts_.tau_k, opts_.tau_v);
    s.covered_before.add(c.meter_before, c.v_meter_before, c.raw_before, opts_.tau_k, opts_.tau_v);
    s.overflow += std::isinf(c.raw_before);
    s.saturated += !(c.raw_before < 1.0);
    s.above_tau[c.layer] += !(c.meter <= opts_.tau_k && c.v_meter <= opts_.tau_v);
    s.repaired += c.repaired;
    s.raw_max = std::max(s.raw_max, c.raw_before);
    s.raw.add(c.raw_before);
    s.v_meter.add(c.v_meter);
    const double r = c.raw_before;
    s.raw_buckets[std::lower_bound(std::begin(kRawScoreBounds), std::end(kRawScoreBounds), r) - std::begin(kRawScoreBounds)] += 1;
    if (std::isfinite(r)) s.raw_finite_sum += r;
    s.keep_if_worst(c);
    if (!std::isnan(c.tv)) {
      ++s.checked;
      s.violations += violates(c);
      if (c.meter > 0) s.worst_tv_ratio = std::max(s.worst_tv_ratio, c.tv / c.meter);
    }
    s.sum_meter[at] += c.meter;
    ++s.count[at];
    if (opts_.stride > 0 && (c.pos - opts_.first_pos) % opts_.stride == 0) s.samples.push_back(c);
  }
}

TelemetrySummary Telemetry::summary() const {
  TelemetrySummary s;
  s.bound = opts_.bound;
  s.tau_k = opts_.tau_k;
  s.tau_v = opts_.tau_v;
  s.first_pos = opts_.first_pos;
  Covered covered, before;
  LogHistogram raw, v_meter;
  std::vector<std::int64_t> above(static_cast<std::size_t>(layers_), 0), layer_cells(above.size(), 0);
  shards_.for_each([&](const Shard& t) {
    s.cells += t.cells;
    s.saturated += t.saturated;
    for (int l = 0; l < layers_; ++l) {
      above[l] += t.above_tau[l];
      for (int h = 0; h < heads_; ++h) layer_cells[l] += t.count[static_cast<std::size_t>(l) * heads_ + h];
    }
    covered.merge(t.covered);
    before.merge(t.covered_before);
    s.raw_max = std::max(s.raw_max, t.raw_max);
    s.overflow += t.overflow;
    s.repaired += t.repaired;
    s.checked += t.checked;
    s.violations += t.violations;
    s.worst_tv_ratio = std::max(s.worst_tv_ratio, t.worst_tv_ratio);
    raw.merge(t.raw);
    v_meter.merge(t.v_meter);
    s.worst.insert(s.worst.end(), t.worst.begin(), t.worst.begin() + t.n_worst);
  });
  s.coverage = covered.over(s.cells);
  s.coverage_before = before.over(s.cells);
  for (int l = 0; l < layers_; ++l)
    s.above_tau_by_layer.push_back(layer_cells[l] > 0 ? static_cast<double>(above[l]) / layer_cells[l] : NAN);
  s.raw_p50 = raw.quantile(0.5);
  s.raw_p90 = raw.quantile(0.9);
  s.raw_p99 = raw.quantile(0.99);
  s.v_meter_p50 = v_meter.quantile(0.5);
  std::sort(s.worst.begin(), s.worst.end(), worse);
  if (s.worst.size() > static_cast<std::size_t>(kWorstCells)) s.worst.resize(kWorstCells);
  return s;
}

std::vector<MeterCell> Telemetry::samples() const {
  std::vector<MeterCell> all;
  shards_.for_each([&](const Shard& t) { all.insert(all.end(), t.samples.begin(), t.samples.end()); });
  sort_cells(all);
  return all;
}

std::vector<double> Telemetry::heatmap() const {
  const std::size_t n = static_cast<std::size_t>(layers_) * heads_;
  std::vector<double> sum(n, 0.0);
  std::vector<std::int64_t> count(n, 0);
  shards_.for_each([&](const Shard& t) {
    for (std::size_t i = 0; i < n; ++i) sum[i] += t.sum_meter[i], count[i] += t.count[i];
  });
  std::vector<double> h(n, NAN);
  for (std::size_t i = 0; i < n; ++i)
    if (count[i] > 0) h[i] = sum[i] / static_cast<double>(count[i]);
  return h;
}

Telemetry::RawHistogram Telemetry::raw_histogram() const {
  RawHistogram h;
  h.counts.assign(std::size(kRawScoreBounds) + 1, 0);
  shards_.for_each([&](const Shard& t) {
    for (std::size_t b = 0; b < t.raw_buckets.size(); ++b) h.counts[b] += t.raw_buckets[b];
    h.finite_sum += t.raw_finite_sum;
  });
  return h;
}

void write_cells_jsonl(std::ostream& out, std::span<const MeterCell> cells) {
  for (const MeterCell& c : cells) {
    nlohmann::json j = {{"layer", c.layer},
                        {"q_head", c.q_head},
                        {"pos", c.pos},
                        {"raw", number(c.eform_raw)},
                        {"meter", number(c.meter)},
                        {"v_meter", number(c.v_meter)},
                        {"raw_before", number(c.raw_before)},
                        {"meter_before", number(c.meter_before)},
                        {"v_meter_before", number(c.v_meter_before)},
                        {"repaired", c.repaired}};
    if (c.v_meter_sure != c.v_meter) j["v_meter_sure"] = number(c.v_meter_sure);
    if (!std::isnan(c.tv)) j["tv"] = c.tv;
    if (!std::isnan(c.v_true)) j["v_true"] = number(c.v_true);
    out << j.dump() << "\n";
  }
}

}  // namespace witcert::gate
