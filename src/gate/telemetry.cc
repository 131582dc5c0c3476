#include "gate/telemetry.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>

namespace witcert::gate {
namespace {

nlohmann::json number(double v) {
  if (std::isnan(v)) return nullptr;
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return NAN;
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + i, v.end());
  return v[i];
}

nlohmann::json coverage_json(const Coverage& c) {
  return {{"joint", number(c.joint)}, {"k", number(c.k)}, {"v", number(c.v)}, {"eform", number(c.eform)}};
}

}  // namespace

nlohmann::json TelemetrySummary::to_json() const {
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
          {"overflow", overflow},
          {"repaired", repaired},
          {"soundness_checked", checked},
          {"soundness_violations", violations}};
}

void Telemetry::Covered::add(double meter, double v_meter, double eform_raw, double tau_k, double tau_v) {
  const bool pk = meter <= tau_k, pv = v_meter <= tau_v;
  joint += pk && pv;
  k += pk;
  v += pv;
  eform += std::min(1.0, eform_raw) <= tau_k;
}

Coverage Telemetry::Covered::over(std::int64_t cells) const {
  if (cells == 0) return {};
  const double n = static_cast<double>(cells);
  return {joint / n, k / n, v / n, eform / n};
}

Telemetry::Telemetry(int layers, int heads, const Options& opts) : layers_(layers), heads_(heads), opts_(opts) {
  if (layers <= 0 || heads <= 0) throw std::invalid_argument("telemetry needs at least one layer and head");
  if (!(opts.tau_k > 0.0) || !std::isfinite(opts.tau_k) || !(opts.tau_v > 0.0) || !std::isfinite(opts.tau_v))
    throw std::invalid_argument("the coverage thresholds tau and tau_v must be finite and positive");
  if (opts.stride < 1) throw std::invalid_argument("the sampling stride must be at least 1");
  sum_meter_.assign(static_cast<std::size_t>(layers) * heads, 0.0);
  count_.assign(sum_meter_.size(), 0);
}

void Telemetry::record(std::span<const attn::MeterCell> cells) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const attn::MeterCell& c : cells) {
    if (c.pos < opts_.first_pos) continue;
    if (c.layer < 0 || c.layer >= layers_ || c.q_head < 0 || c.q_head >= heads_)
      throw std::out_of_range("telemetry: cell of layer " + std::to_string(c.layer) + ", head " +
                              std::to_string(c.q_head) + " outside " + std::to_string(layers_) + " x " +
                              std::to_string(heads_));
    const std::size_t at = static_cast<std::size_t>(c.layer) * heads_ + c.q_head;
    ++cells_;
    covered_.add(c.meter, c.v_meter, c.eform_raw, opts_.tau_k, opts_.tau_v);
    covered_before_.add(c.meter_before, c.v_meter_before, c.raw_before, opts_.tau_k, opts_.tau_v);
    overflow_ += std::isinf(c.raw_before);
    repaired_ += c.repaired;
    raw_max_ = std::max(raw_max_, c.raw_before);
    if (!std::isnan(c.tv)) {
      ++checked_;
      violations_ += !(c.tv <= c.meter * (1 + 1e-9) + 1e-12);
    }
    sum_meter_[at] += c.meter;
    ++count_[at];
    if ((c.pos - opts_.first_pos) % opts_.stride == 0) samples_.push_back(c);
  }
}

TelemetrySummary Telemetry::summary() const {
  std::lock_guard<std::mutex> lock(mu_);
  TelemetrySummary s;
  s.cells = cells_;
  s.bound = opts_.bound;
  s.tau_k = opts_.tau_k;
  s.tau_v = opts_.tau_v;
  s.coverage = covered_.over(cells_);
  s.coverage_before = covered_before_.over(cells_);
  std::vector<double> raw;
  raw.reserve(samples_.size());
  for (const attn::MeterCell& c : samples_) raw.push_back(c.raw_before);
  s.raw_p50 = quantile(raw, 0.5);
  s.raw_p90 = quantile(raw, 0.9);
  s.raw_p99 = quantile(raw, 0.99);
  s.raw_max = raw_max_;
  s.overflow = overflow_;
  s.repaired = repaired_;
  s.checked = checked_;
  s.violations = violations_;
  return s;
}

std::vector<attn::MeterCell> Telemetry::samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return samples_;
}

std::vector<double> Telemetry::heatmap() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<double> h(sum_meter_.size(), NAN);
  for (std::size_t i = 0; i < h.size(); ++i)
    if (count_[i] > 0) h[i] = sum_meter_[i] / count_[i];
  return h;
}

std::string Telemetry::heatmap_svg(const std::string& title) const {
  const std::vector<double> h = heatmap();
  const int cell = 18, left = 60, top = 40;
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << left + heads_ * cell + 140 << "' height='"
      << top + layers_ * cell + 30 << "' font-family='sans-serif' font-size='11'>\n";
  svg << "<text x='4' y='16' font-size='13'>" << title << "</text>\n";
  svg << "<text x='" << left << "' y='32'>query head →</text>\n";
  for (int l = 0; l < layers_; ++l) {
    svg << "<text x='4' y='" << top + l * cell + 13 << "'>layer " << l << "</text>\n";
    for (int q = 0; q < heads_; ++q) {
      const double m = h[static_cast<std::size_t>(l) * heads_ + q];
      // White (meter 0) to red (meter 1); grey where the cell was never seen.
      const int shade = std::isnan(m) ? -1 : static_cast<int>(255.0 * (1.0 - std::clamp(m, 0.0, 1.0)));
      svg << "<rect x='" << left + q * cell << "' y='" << top + l * cell << "' width='" << cell - 1 << "' height='"
          << cell - 1 << "' fill='" << (shade < 0 ? std::string("#bbbbbb")
                                                  : "rgb(255," + std::to_string(shade) + "," + std::to_string(shade) + ")")
          << "'><title>layer " << l << " head " << q << ": mean meter " << m << "</title></rect>\n";
    }
  }
  const int lx = left + heads_ * cell + 20;
  for (int i = 0; i <= 10; ++i) {
    const int shade = static_cast<int>(255.0 * (1.0 - i / 10.0));
    svg << "<rect x='" << lx << "' y='" << top + (10 - i) * 12 << "' width='14' height='12' fill='rgb(255," << shade
        << "," << shade << ")'/>\n";
  }
  svg << "<text x='" << lx + 18 << "' y='" << top + 10 << "'>meter 1</text>\n";
  svg << "<text x='" << lx + 18 << "' y='" << top + 130 << "'>meter 0</text>\n";
  svg << "</svg>\n";
  return svg.str();
}

void write_cells_jsonl(std::ostream& out, std::span<const attn::MeterCell> cells) {
  for (const attn::MeterCell& c : cells) {
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
    if (!std::isnan(c.tv)) j["tv"] = c.tv;
    out << j.dump() << "\n";
  }
}

}  // namespace witcert::gate
