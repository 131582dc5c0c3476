// A request's report kept apart from its cache: the cache's cells drained, carried elsewhere (another
// process, or the ranks of a tensor-parallel model) and counted into a report there, which writes the
// same `witcert` object as witcert_cache_report.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "capi/internal.h"
#include "engine/meter_object.h"
#include "gate/telemetry.h"
#include "witcert/witcert.h"

using namespace witcert;
using namespace witcert::capi;

struct witcert_report {
  engine::CacheOptions options;
  int layers = 0, q_heads = 0;
  std::unique_ptr<gate::Telemetry> telemetry;
  std::int64_t page_ins = 0, page_in_bytes = 0;
};

namespace {

witcert_report_cell to_c(const gate::MeterCell& m) {
  return {m.layer,        m.q_head,       m.pos,          m.eform_raw,      m.meter, m.v_meter, m.output_bound,
          m.raw_before,   m.meter_before, m.v_meter_before, m.v_meter_sure, m.tv,    m.v_true,  m.repaired ? 1 : 0};
}

gate::MeterCell from_c(const witcert_report_cell& c) {
  gate::MeterCell m{};
  m.layer = c.layer;
  m.q_head = c.q_head;
  m.pos = c.pos;
  m.eform_raw = c.raw;
  m.meter = c.meter;
  m.v_meter = c.v_meter;
  m.tv = c.tv;
  m.raw_before = c.raw_before;
  m.meter_before = c.meter_before;
  m.v_meter_before = c.v_meter_before;
  m.repaired = c.repaired != 0;
  m.output_bound = c.output_bound;
  m.v_true = c.v_true;
  m.v_meter_sure = c.v_meter_sure;
  return m;
}

// A cell a cache could have served: its place within the geometry, meters in [0, 1] (the raw score
// may be +inf: no guarantee), bounds not negative, the checked errors NaN or not negative.
void check_cell(const witcert_report& r, const witcert_report_cell& c, std::size_t i) {
  const auto bad = [&](const char* what) { refuse_entry("cells", i, what); };
  if (c.layer < 0 || c.layer >= r.layers) bad("layer is outside the report's layers");
  if (c.q_head < 0 || c.q_head >= r.q_heads) bad("q_head is outside the report's query heads");
  if (c.pos < 0) bad("pos is negative");
  for (const double m : {c.meter, c.meter_before})
    if (!(m >= 0 && m <= 1)) bad("a K meter is outside [0, 1]");
  for (const double x : {c.raw, c.raw_before, c.v_meter, c.v_meter_before, c.v_meter_sure, c.output_bound})
    if (!(x >= 0)) bad("a score or bound is negative or NaN");
  for (const double x : {c.tv, c.v_true})
    if (!(std::isnan(x) || x >= 0)) bad("a checked error is negative");
  if (c.repaired != 0 && c.repaired != 1) bad("repaired is neither 0 nor 1");
}

}  // namespace

witcert_status witcert_cache_keep_cells(witcert_cache* cache, int keep) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    require(keep == 0 || keep == 1, "keep must be 0 or 1");
    c->cells.keep = keep == 1;
    c->cells.drained.clear();
  });
}

witcert_status witcert_cache_drain_cells(witcert_cache* cache, witcert_report_cell* cells, size_t cap, size_t* n) {
  return guarded(__func__, [&] {
    witcert_cache* c = live(cache, "cache");
    not_null(n, "n");
    std::vector<gate::MeterCell>& kept = c->cells.drained;
    *n = kept.size();
    if (kept.size() > cap)
      refuse(std::to_string(kept.size()) + " cells are kept; the buffer holds " + std::to_string(cap),
             WITCERT_ERROR_BUFFER_TOO_SMALL);
    if (!kept.empty()) not_null(cells, "cells");
    for (std::size_t i = 0; i < kept.size(); ++i) cells[i] = to_c(kept[i]);
    kept.clear();
  });
}

witcert_status witcert_report_create(const char* options_json, int layers, int q_heads, int64_t first_pos,
                                     witcert_report** out) {
  return guarded(__func__, [&] {
    not_null(out, "report");
    *out = nullptr;
    require(layers >= 1 && layers <= 4096, "layers must be in [1, 4096]");
    require(q_heads >= 1 && q_heads <= 65536, "q_heads must be in [1, 65536]");
    require(first_pos >= 0, "first_pos is negative");
    auto r = std::make_unique<witcert_report>();
    r->options = engine::CacheOptions::from_json(parse_object(options_json, "options_json"), true);
    r->layers = layers;
    r->q_heads = q_heads;
    if (r->options.certified) {
      const gate::Policy& gate = r->options.gate;
      r->telemetry = std::make_unique<gate::Telemetry>(
          layers, q_heads,
          gate::Telemetry::Options{engine::coverage_tau(gate, std::nullopt),
                                   gate.on() ? gate.tau_v : engine::kDefaultCoverageTauV, r->options.bound,
                                   first_pos});
    }
    register_handle(r.get());
    *out = r.release();
  });
}

witcert_status witcert_report_record(witcert_report* report, const witcert_report_cell* cells, size_t n) {
  return guarded(__func__, [&] {
    witcert_report* r = live(report, "report");
    if (n == 0) return;
    not_null(cells, "cells");
    require(r->telemetry != nullptr, "the exact cache's report has no meter to count cells into");
    for (std::size_t i = 0; i < n; ++i) check_cell(*r, cells[i], i);
    std::vector<gate::MeterCell> m(n);
    for (std::size_t i = 0; i < n; ++i) m[i] = from_c(cells[i]);
    r->telemetry->record(m);
  });
}

witcert_status witcert_report_add_page_ins(witcert_report* report, int64_t page_ins, int64_t page_in_bytes) {
  return guarded(__func__, [&] {
    witcert_report* r = live(report, "report");
    require(page_ins >= 0 && page_in_bytes >= 0, "page-ins must not be negative");
    r->page_ins += page_ins;
    r->page_in_bytes += page_in_bytes;
  });
}

std::string witcert::capi::report_text(const engine::CacheOptions& options, const gate::Telemetry* telemetry,
                                       std::int64_t page_ins, std::int64_t page_in_bytes) {
  engine::BatchResult b;
  if (telemetry) {
    b.has_meter = true;
    b.meter = telemetry->summary();
    b.page_ins = page_ins;
    b.page_in_bytes = page_in_bytes;
    b.meter.page_ins = page_ins;
  }
  return engine::meter_object(options, b).dump();
}

witcert_status witcert_report_json(const witcert_report* report, char* json, size_t cap, size_t* needed) {
  return guarded(__func__, [&] {
    const witcert_report* r = live(report, "report");
    not_null(needed, "needed");
    const std::string text = report_text(r->options, r->telemetry.get(), r->page_ins, r->page_in_bytes);
    *needed = text.size() + 1;
    copy_text(text, json, cap, "report");
  });
}

void witcert_report_free(witcert_report* report) {
  const witcert_status s = guarded(__func__, [&] {
    if (!report) return;
    unregister_handle(live(report, "report"));
    delete report;
  });
  (void)s;
}
