#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <random>
#include <sstream>
#include <stdexcept>

#include "apps/eval/eval.h"
#include "engine/options.h"

namespace witcert::apps::eval {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string csv_cell(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s.find_first_of(",\"\n") == std::string::npos) return s;
    std::string q = "\"";
    for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  }
  if (v.is_null()) return "";
  if (v.is_number_float() && std::isinf(v.get<double>())) return v.get<double>() > 0 ? "inf" : "-inf";
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string md_cell(const json& v) {
  if (v.is_number_float()) {
    const double x = v.get<double>();
    if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
    if (x != 0 && (std::fabs(x) < 1e-3 || std::fabs(x) >= 1e6)) return fmt::format("{:.3g}", x);
    return fmt::format("{:.4g}", x);
  }
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "–";
  return v.dump();
}

}  // namespace

ResultStore::ResultStore(std::string path) : path_(std::move(path)) {
  fs::create_directories(fs::path(path_).parent_path());
  std::ifstream in(path_);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    // A line cut short by a killed run, or any other that is not a record (engine::parse_json
    // refuses text nested too deep): its cell is computed again.
    try {
      json j = engine::parse_json(line);
      const std::string key = j.at("key").get<std::string>();
      rows_[key] = std::move(j);
    } catch (const std::invalid_argument&) {
    } catch (const json::exception&) {
    }
  }
}

void ResultStore::put(const std::string& key, json record) {
  record["key"] = key;
  std::ofstream out(path_, std::ios::app);
  out << record.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  out.flush();
  if (!out) throw std::runtime_error("cannot append to '" + path_ + "'");
  rows_[key] = std::move(record);
}

std::string format_duration(double seconds) {
  if (!(seconds >= 0) || std::isinf(seconds)) return "?";
  const long s = std::lround(seconds);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

EtaBar::EtaBar(std::ostream& err, std::string label, std::int64_t total, bool terminal)
    : err_(err), label_(std::move(label)), total_(total), start_(now_seconds()), terminal_(terminal) {
  draw();
}

void EtaBar::skip() {
  ++done_;
  draw();
}

void EtaBar::advance() {
  ++done_;
  ++computed_;
  draw();
}

void EtaBar::finish() {
  if (terminal_) err_ << "\n" << std::flush;
}

void EtaBar::draw() {
  const std::int64_t n = std::max<std::int64_t>(1, total_);
  const bool tenth = done_ == 0 || done_ == total_ || done_ * 10 / n != (done_ - 1) * 10 / n;
  if (!terminal_ && !tenth) return;
  const double elapsed = now_seconds() - start_;
  const int width = 24, filled = static_cast<int>(width * done_ / n);
  const std::string eta = computed_ > 0 ? format_duration(elapsed / computed_ * static_cast<double>(total_ - done_)) : "?";
  err_ << fmt::format("{}  {:<22} [{}{}] {}/{}  {} elapsed, ETA {}{}", terminal_ ? "\r" : "", label_,
                      std::string(filled, '#'), std::string(width - filled, '.'), done_, total_,
                      format_duration(elapsed), done_ == total_ ? "0s" : eta, terminal_ ? "   " : "\n")
       << std::flush;
}

void write_table(const std::string& dir, const std::string& name, const std::vector<std::string>& columns,
                 const std::vector<json>& rows, const std::string& title) {
  fs::create_directories(dir);
  std::ofstream csv(fs::path(dir) / (name + ".csv")), md(fs::path(dir) / (name + ".md"));
  for (std::size_t i = 0; i < columns.size(); ++i) csv << (i ? "," : "") << columns[i];
  csv << "\n";
  md << "**" << title << "**\n\n|";
  for (const std::string& c : columns) md << " " << c << " |";
  md << "\n|";
  for (std::size_t i = 0; i < columns.size(); ++i) md << "---|";
  md << "\n";
  for (const json& r : rows) {
    md << "|";
    for (std::size_t i = 0; i < columns.size(); ++i) {
      const json v = r.contains(columns[i]) ? r.at(columns[i]) : json(nullptr);
      csv << (i ? "," : "") << csv_cell(v);
      md << " " << md_cell(v) << " |";
    }
    csv << "\n";
    md << "\n";
  }
  if (!csv || !md) throw std::runtime_error("cannot write the table '" + name + "' under " + dir);
}

double auroc(const std::vector<double>& score, const std::vector<bool>& positive) {
  if (score.size() != positive.size()) throw std::invalid_argument("auroc: score and label lengths differ");
  std::vector<std::size_t> idx(score.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return score[a] < score[b]; });
  // Mann–Whitney U from average ranks (ties share their mean rank).
  double rank_sum = 0.0;
  std::int64_t pos = 0;
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    while (j < idx.size() && score[idx[j]] == score[idx[i]]) ++j;
    const double mean_rank = (static_cast<double>(i) + static_cast<double>(j) + 1.0) / 2.0;
    for (std::size_t k = i; k < j; ++k)
      if (positive[idx[k]]) rank_sum += mean_rank, ++pos;
    i = j;
  }
  const std::int64_t neg = static_cast<std::int64_t>(score.size()) - pos;
  if (pos == 0 || neg == 0) return NAN;
  return (rank_sum - static_cast<double>(pos) * (pos + 1) / 2.0) / (static_cast<double>(pos) * static_cast<double>(neg));
}

std::vector<std::pair<double, double>> roc_curve(const std::vector<double>& score, const std::vector<bool>& positive) {
  std::vector<std::size_t> idx(score.size());
  for (std::size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return score[a] > score[b]; });
  const double pos = static_cast<double>(std::count(positive.begin(), positive.end(), true));
  const double neg = static_cast<double>(positive.size()) - pos;
  std::vector<std::pair<double, double>> pts = {{0.0, 0.0}};
  double tp = 0, fp = 0;
  for (std::size_t i = 0; i < idx.size();) {
    std::size_t j = i;
    for (; j < idx.size() && score[idx[j]] == score[idx[i]]; ++j) positive[idx[j]] ? ++tp : ++fp;
    pts.emplace_back(neg > 0 ? fp / neg : 0.0, pos > 0 ? tp / pos : 0.0);
    i = j;
  }
  if (pts.back() != std::make_pair(1.0, 1.0)) pts.emplace_back(1.0, 1.0);
  return pts;
}

double rule_of_three(std::int64_t n) {
  if (n <= 0) return 1.0;
  return -std::expm1(std::log(0.05) / static_cast<double>(n));
}

std::vector<std::string> domain_prompts(const engine::Model& m, const EvalOptions& opts, const std::string& domain,
                                        int count, int tokens, std::uint64_t seed) {
  const fs::path dir = fs::path(opts.data) / domain;
  if (!fs::is_directory(dir))
    throw std::runtime_error("no corpus for '" + domain + "' under " + opts.data + ": run scripts/fetch-eval-data.sh");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
  std::sort(files.begin(), files.end());
  if (files.empty()) throw std::runtime_error("the corpus '" + dir.string() + "' is empty: run scripts/fetch-eval-data.sh");
  std::vector<std::vector<std::int32_t>> docs;
  for (const fs::path& f : files) {
    std::ifstream in(f);
    std::stringstream ss;
    ss << in.rdbuf();
    std::vector<std::int32_t> ids = m.tokenizer->encode(ss.str(), false);
    if (static_cast<int>(ids.size()) > tokens) docs.push_back(std::move(ids));
  }
  if (docs.empty()) throw std::runtime_error("no document of '" + dir.string() + "' holds " + std::to_string(tokens) + " tokens");
  std::mt19937_64 rng(seed);
  std::vector<std::string> prompts;
  for (int i = 0; i < count; ++i) {
    const auto& d = docs[rng() % docs.size()];
    const std::size_t start = rng() % (d.size() - static_cast<std::size_t>(tokens));
    std::string text;
    for (std::size_t t = start; t < start + static_cast<std::size_t>(tokens); ++t) text += m.tokenizer->token_piece(d[t]);
    prompts.push_back(std::move(text));
  }
  return prompts;
}

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return NAN;
  std::sort(values.begin(), values.end());
  const std::size_t rank = static_cast<std::size_t>(std::ceil(p * static_cast<double>(values.size())));
  return values[std::min(values.size() - 1, rank == 0 ? 0 : rank - 1)];
}

std::pair<double, double> paired_bootstrap_ci(const std::vector<double>& a, const std::vector<double>& b,
                                              int resamples, std::uint64_t seed) {
  if (a.size() != b.size() || a.empty()) return {NAN, NAN};
  std::mt19937_64 rng(seed);
  std::vector<double> means(static_cast<std::size_t>(resamples));
  const std::size_t n = a.size();
  for (double& mean : means) {
    double sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t j = rng() % n;
      sum += b[j] - a[j];
    }
    mean = sum / static_cast<double>(n);
  }
  return {percentile(means, 0.025), percentile(means, 0.975)};
}

double mcnemar_p(std::int64_t b01, std::int64_t b10) {
  // Exact binomial: under H0 each discordant pair goes either way with probability ½. The terms
  // C(n, i)·2^-n by their ratios (exact in binary for small n), in the log domain past 2^-1000.
  const std::int64_t n = b01 + b10, k = std::min(b01, b10);
  if (n == 0) return 1.0;
  double tail = 0.0;
  if (n <= 1000) {
    double term = std::ldexp(1.0, -static_cast<int>(n));
    for (std::int64_t i = 0; i <= k; ++i) {
      tail += term;
      term = term * static_cast<double>(n - i) / static_cast<double>(i + 1);
    }
  } else {
    for (std::int64_t i = 0; i <= k; ++i)
      tail += std::exp(std::lgamma(double(n) + 1) - std::lgamma(double(i) + 1) - std::lgamma(double(n - i) + 1) -
                       static_cast<double>(n) * std::log(2.0));
  }
  return std::min(1.0, 2.0 * tail);
}

}  // namespace witcert::apps::eval
