// The live dashboard served at GET /: one self-contained HTML page that polls GET /state.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

namespace witcert::apps {

const char* dashboard_html();

// A row-major [layer][head] table as nested arrays, null where it holds NaN (no cell seen).
nlohmann::json layer_head_grid(const std::vector<double>& v, int layers, int heads);

}  // namespace witcert::apps
