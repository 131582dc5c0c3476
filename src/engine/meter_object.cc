#include "engine/meter_object.h"

#include <algorithm>

#include "gate/telemetry.h"

namespace witcert::engine {

nlohmann::json meter_object(const CacheOptions& c, const BatchResult& r) {
  nlohmann::json w;
  w["kv"] = c.format_name(formats::KvSide::key);
  w["kv_v"] = c.format_name(formats::KvSide::value);
  if (c.gate.on()) {
    w["gate"] = {{"tau_k", c.gate.tau_k()},
                 {"tau_v", c.gate.tau_v},
                 {"granularity", gate::granularity_name(c.gate.granularity)},
                 {"label", c.gate.certified() ? "certified" : "risk-ranked"}};
  } else {
    w["gate"] = nullptr;
  }
  if (!r.has_meter) {
    w["cells"] = 0;
    w["certified"] = false;  // the plain exact cache has no meter
    w["verdict"] = gate::verdict_name(gate::Verdict::unmetered);
    w["reason"] = "the exact fp16 cache has no meter: nothing is quantized";
    return w;
  }
  w.update(r.meter.to_json());
  w["overflow_fraction"] = r.meter.cells > 0 ? static_cast<double>(r.meter.overflow) / r.meter.cells : 0.0;
  w["page_ins"] = r.page_ins;
  w["page_in_bytes"] = r.page_in_bytes;
  w["shared_page_ins"] = r.shared_page_ins;
  // Every served cell met τ_K and τ_V (coverage is a ratio of integer counts: 1 exactly).
  w["certified"] = r.meter.cells > 0 && r.meter.coverage.joint == 1.0;
  return w;
}

}  // namespace witcert::engine
