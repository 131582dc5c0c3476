#include "apps/report/run.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <ostream>


#include "apps/report/heatmap.h"
#include "attention/cpu/exact_cache.h"
#include "engine/cache_factory.h"
#include "model/sampler.h"

namespace witcert::apps {
namespace {

constexpr int kChunk = 64;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Greedy decoding from a prefilled session, up to n tokens or a stop token; rows receives the
// logits that chose each token.
std::vector<std::int32_t> greedy(const engine::Model& e, engine::Session& session, int n,
                                 std::vector<std::vector<float>>* rows) {
  engine::GenerateOptions opts;
  opts.max_new_tokens = n;
  opts.stop_tokens = e.stop_tokens();
  return engine::decode(session, opts, {}, [&](std::span<const float> logits) {
           if (rows) rows->emplace_back(logits.begin(), logits.end());
         }).tokens;
}

void check_request(const model::LlamaConfig& cfg, std::int64_t len, int n) {
  if (len == 0) throw std::invalid_argument("the prompt is empty");
  if (n < 0) throw std::invalid_argument("the number of new tokens must not be negative");
  if (len + n > cfg.context)
    throw std::out_of_range("the prompt has " + std::to_string(len) + " tokens; with " + std::to_string(n) +
                            " new tokens that exceeds the model's context of " + std::to_string(cfg.context));
}

// Whether text contains answer, ignoring case.
bool contains_answer(std::string text, std::string answer) {
  const auto lower = [](std::string& s) {
    std::transform(s.begin(), s.end(), s.begin(), [](unsigned char ch) { return std::tolower(ch); });
  };
  lower(text);
  lower(answer);
  return text.find(answer) != std::string::npos;
}

std::string join_text(const engine::Model& e, const std::vector<std::int32_t>& t) { return e.tokenizer->decode(t); }

std::string fmt_bytes(double b) {
  if (b >= 1 << 20) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (b >= 1 << 10) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{:.0f} B", b);
}

std::string gate_label(const gate::Policy& g) {
  if (!g.on()) return "raw";
  return fmt::format("{} {}/{} {}", g.certified() ? "cert" : "risk", g.tau_k(), g.tau_v, gate::granularity_name(g.granularity));
}

std::string ratio(bool has, double v) { return has ? fmt::format("{:.3f}", v) : "-"; }

}  // namespace

Progress progress_bar(std::ostream& err, const std::string& label, bool terminal) {
  return [&err, label, terminal](std::int64_t done, std::int64_t total) {
    // A log file gets one line when the prefill is done, not a line rewritten with carriage returns.
    if (!terminal && done != total) return;
    const int width = 30, filled = static_cast<int>(width * done / std::max<std::int64_t>(1, total));
    err << fmt::format("{}  {:<28} [{}{}] {}/{} prompt tokens", terminal ? "\r" : "", label, std::string(filled, '#'),
                       std::string(width - filled, '.'), done, total)
        << (done == total ? "\n" : "") << std::flush;
  };
}


Fp16Reference run_fp16(const engine::Model& engine, const std::vector<std::int32_t>& prompt, int n, int threads,
                       const Progress& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const model::LlamaConfig& cfg = engine.model->config();
  const std::int64_t len = static_cast<std::int64_t>(prompt.size());
  check_request(cfg, len, n);
  auto cache = std::make_shared<attention::ExactKvCache>(cfg.kv_geometry(len + n));
  ThreadPool pool(threads);
  Fp16Reference ref;
  engine::Session prefill(*engine.model, *cache, pool, kChunk);
  const std::span<const float> last = prefill.prefill(prompt, progress);
  ref.logits.assign(last.begin(), last.end());
  ref.prefilled = cache;
  attention::ExactKvCache decode = *cache;
  engine::Session session(*engine.model, decode, pool, kChunk);
  session.resume(len, ref.logits);
  RunOutcome& r = ref.run;
  r.config.label = "fp16 (plain)";
  r.tokens = greedy(engine, session, n, nullptr);
  r.text = join_text(engine, r.tokens);
  r.top1 = r.top5 = 1.0;
  r.kv_bytes_per_token = 2.0 * 2 * cfg.head_dim * cfg.layers * cfg.kv_heads;
  r.seconds = seconds_since(t0);
  return ref;
}

RunOutcome run_request(const engine::Model& engine, const std::vector<std::int32_t>& prompt, int n, const RunConfig& rc,
                       int threads, const Fp16Reference& ref, const Progress& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  const model::LlamaConfig& cfg = engine.model->config();
  const std::int64_t len = static_cast<std::int64_t>(prompt.size());
  check_request(cfg, len, n);
  if (!ref.prefilled || ref.prefilled->geometry().capacity < len + n)
    throw std::invalid_argument("run_request: the fp16 reference was not prefilled for this request");
  if (!rc.cache.certified) throw std::invalid_argument("run_request: the run needs a certified cache");
  // The telemetry aggregates the decode-step cells as they are served; the cache keeps no log.
  gate::Telemetry tel(cfg.layers, cfg.heads, {rc.coverage_tau, rc.cache.gate.tau_v, rc.cache.bound, len, rc.stride});
  const engine::Cache made = engine::make_cache(cfg, len + n, std::max(1, n), rc.cache, {&tel});
  gate::CertifiedKvCache& cache = *made.certified;
  ThreadPool pool(threads);

  RunOutcome r;
  r.config = rc;
  std::vector<std::vector<float>> rows;
  engine::Session session(*engine.model, cache, pool, kChunk);
  session.prefill(prompt, progress);
  r.tokens = greedy(engine, session, n, &rows);
  r.text = join_text(engine, r.tokens);

  // fp16 teacher-forced on the same tokens, from a copy of the reference's prefilled cache: the
  // distribution each generated token was drawn from.
  attention::ExactKvCache exact = *ref.prefilled;
  engine::Session forced(*engine.model, exact, pool, kChunk);
  forced.resume(len, ref.logits);
  std::span<const float> logits = forced.logits();
  double kl = 0.0;
  int top1 = 0, top5 = 0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const std::vector<double> lp = engine::log_softmax(logits), lq = engine::log_softmax(rows[i]);
    double d = 0.0;
    for (std::size_t v = 0; v < lp.size(); ++v) d += std::exp(lp[v]) * (lp[v] - lq[v]);
    kl += d;
    const std::int32_t want = model::argmax(logits);
    top1 += model::argmax(rows[i]) == want;
    int rank = 0;
    for (float x : rows[i]) rank += x > rows[i][want];
    top5 += rank < 5;
    if (i < r.tokens.size() && i + 1 < rows.size()) logits = forced.step(r.tokens[i]);
  }
  if (!rows.empty()) {
    r.kl = kl / rows.size();
    r.top1 = static_cast<double>(top1) / rows.size();
    r.top5 = static_cast<double>(top5) / rows.size();
  }
  r.meter = tel.summary();
  r.samples = tel.samples();
  r.heatmap = tel.heatmap();
  r.heatmap_svg = heatmap_svg(r.heatmap, tel.layers(), tel.heads(), "mean served meter: " + rc.label);
  const kvcache::KvStore::PageInStats pi = cache.store().page_in_stats();
  r.page_ins = pi.page_ins;
  r.page_in_bytes = pi.page_in_bytes;
  r.meter.page_ins = pi.page_ins + pi.shared_page_ins;
  r.kv_bytes_per_token = (cache.store().bytes_per_token_head(formats::KvSide::key) +
                          cache.store().bytes_per_token_head(formats::KvSide::value)) *
                         cfg.layers * cfg.kv_heads;
  r.seconds = seconds_since(t0);
  return r;
}

void print_table(std::ostream& out, const std::vector<RunOutcome>& runs, const std::string& answer) {
  out << fmt::format("{:<22} {:<22} {:<9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>6} {:>6} {:>6} {:>10} {:>8} {:>7}\n",
                     "run", "gate", "bound", "joint", "K", "V", "e-form", "pre", "KL/tok", "top-1", "top-5", "answer",
                     "page-in", "KV B/tok", "time");
  for (const RunOutcome& r : runs) {
    const bool m = r.meter.cells > 0;
    const std::string correct = answer.empty() ? "-" : (contains_answer(r.text, answer) ? "yes" : "NO");
    out << fmt::format(
        "{:<22} {:<22} {:<9} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8.4f} {:>6.2f} {:>6.2f} {:>6} {:>10} {:>8.0f} {:>6.1f}s\n",
        r.config.label, m ? gate_label(r.config.cache.gate) : "-", m ? cert::bound_shape_name(r.config.cache.bound) : "-",
        ratio(m, r.meter.coverage.joint), ratio(m, r.meter.coverage.k), ratio(m, r.meter.coverage.v),
        ratio(m, r.meter.coverage.eform), ratio(m, r.meter.coverage_before.joint), r.kl, r.top1, r.top5, correct,
        fmt_bytes(static_cast<double>(r.page_in_bytes)), r.kv_bytes_per_token, r.seconds);
  }
}

std::string coverage_legend(const std::vector<RunOutcome>& runs) {
  double tau_k = 0.2, tau_v = 0.05;
  for (const RunOutcome& r : runs)
    if (r.meter.cells > 0) tau_k = r.meter.tau_k, tau_v = r.meter.tau_v;
  return fmt::format(
      "Coverage: the fraction of (layer, query head, decode step) cells that pass, as served (after the step's repair):\n"
      "joint = K meter <= {0} and V meter <= {1} (pass_K and pass_V); K, V = each side alone; e-form = the K coverage of\n"
      "Theorem 1's e-form, comparable with the paper whatever the bound; pre = joint before the step's own repair (pages\n"
      "repaired at earlier steps stay exact). bound: the K meter's shape (min = min of sound forms: e-form, two-sided,\n"
      "tanh(c_max/2)). gate: certified or risk-ranked, tau_K/tau_V, granularity. KL/tok: mean KL(p_fp16 || p_run) over\n"
      "the generated tokens, fp16 teacher-forced. page-in: exact K/V bytes read from the backing tier by repair.\n",
      tau_k, tau_v);
}

nlohmann::json report_json(const std::string& prompt, const RunOutcome& fp16, const std::vector<RunOutcome>& runs,
                           const std::string& answer) {
  nlohmann::json j;
  j["prompt"] = prompt;
  j["fp16_text"] = fp16.text;
  j["runs"] = nlohmann::json::array();
  for (const RunOutcome& r : runs) {
    nlohmann::json run = {{"label", r.config.label},
                          {"kv_k", r.config.cache.k_format.name()},
                          {"kv_v", r.config.cache.v_format.name()},
                          {"gate", gate_label(r.config.cache.gate)},
                          {"tau_k", r.config.cache.gate.tau_k()},
                          {"tau_v", r.config.cache.gate.tau_v},
                          {"bound", cert::bound_shape_name(r.config.cache.bound)},
                          {"bound_label", cert::bound_shape_label(r.config.cache.bound)},
                          {"text", r.text},
                          {"kl_vs_fp16", r.kl},
                          {"top1_agreement", r.top1},
                          {"top5_agreement", r.top5},
                          {"meter", r.meter.to_json()},
                          {"page_ins", r.page_ins},
                          {"page_in_bytes", r.page_in_bytes},
                          {"kv_bytes_per_token", r.kv_bytes_per_token},
                          {"seconds", r.seconds}};
    if (r.config.cache.k_format.kind() == formats::FormatKind::dither) {
      run["dither"] = kvcache::dither_mode_name(r.config.cache.dither);
      run["key_scales"] = formats::scale_granularity_name(r.config.cache.key_scales);
    }
    if (!answer.empty()) run["answer_correct"] = contains_answer(r.text, answer);
    j["runs"].push_back(run);
  }
  return j;
}

void write_report(const std::string& dir, const std::string& prompt, const RunOutcome& fp16,
                  const std::vector<RunOutcome>& runs, const std::string& answer) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const nlohmann::json j = report_json(prompt, fp16, runs, answer);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const std::string n = std::to_string(i + 1);
    std::ofstream(fs::path(dir) / ("heatmap-" + n + ".svg")) << runs[i].heatmap_svg;
    std::ofstream cells(fs::path(dir) / ("meter-" + n + ".jsonl"));
    gate::write_cells_jsonl(cells, runs[i].samples);
  }
  std::ofstream(fs::path(dir) / "report.json") << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  std::ofstream md(fs::path(dir) / "report.md");
  md << "# WitCert run report\n\n## Table\n\n```\n";
  print_table(md, runs, answer);
  md << "```\n\n" << coverage_legend(runs) << "\n## fp16 text\n\n" << fp16.text << "\n";
  int i = 0;
  for (const RunOutcome& r : runs) {
    md << "\n## " << r.config.label << " (" << gate_label(r.config.cache.gate) << ", bound: "
       << cert::bound_shape_label(r.config.cache.bound) << ")\n\n" << r.text << "\n\n![heatmap](heatmap-"
       << ++i << ".svg)\n";
  }
}

}  // namespace witcert::apps
