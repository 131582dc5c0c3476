// An SVG heatmap of the telemetry's mean meter per (layer, query head): layers down, heads across,
// white (meter 0) to red (meter 1), grey where no cell was seen.
#pragma once

#include <span>
#include <string>

namespace witcert::apps {

// mean: row-major [layer][head], layers × heads values (NaN: never seen).
std::string heatmap_svg(std::span<const double> mean, int layers, int heads, const std::string& title);

}  // namespace witcert::apps
