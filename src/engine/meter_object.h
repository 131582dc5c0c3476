// The request's `witcert` object: what `witcert serve` returns beside usage and
// `witcert generate --json` prints, so that both say the same of the same request.
#pragma once

#include <nlohmann/json.hpp>

#include "engine/batch.h"
#include "engine/options.h"

namespace witcert::engine {

// The formats, the gate, the meter summary of the decode steps (coverage, raw-score quantiles,
// worst cells, verdict and reason), the page-ins and `certified`; for the plain cache, the
// formats, `cells` 0 and the verdict `unmetered`.
nlohmann::json meter_object(const CacheOptions& cache, const BatchResult& r);

}  // namespace witcert::engine
