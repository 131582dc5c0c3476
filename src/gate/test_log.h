// Tests: certified-cache options whose every served cell goes to a CellLog.
#pragma once

#include "gate/certified_cache.h"
#include "gate/meter_cell.h"

namespace witcert::gate {

inline CertifiedOptions logged(CertifiedOptions o, CellLog& log) {
  o.sinks.push_back(&log);
  return o;
}

}  // namespace witcert::gate
