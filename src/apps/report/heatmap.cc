#include "apps/report/heatmap.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace witcert::apps {

std::string heatmap_svg(std::span<const double> mean, int layers, int heads, const std::string& title) {
  const int cell = 18, left = 60, top = 40;
  std::ostringstream svg;
  svg << "<svg xmlns='http://www.w3.org/2000/svg' width='" << left + heads * cell + 140 << "' height='"
      << top + layers * cell + 30 << "' font-family='sans-serif' font-size='11'>\n";
  svg << "<text x='4' y='16' font-size='13'>" << title << "</text>\n";
  svg << "<text x='" << left << "' y='32'>query head →</text>\n";
  for (int l = 0; l < layers; ++l) {
    svg << "<text x='4' y='" << top + l * cell + 13 << "'>layer " << l << "</text>\n";
    for (int q = 0; q < heads; ++q) {
      const double m = mean[static_cast<std::size_t>(l) * heads + q];
      const int shade = std::isnan(m) ? -1 : static_cast<int>(255.0 * (1.0 - std::clamp(m, 0.0, 1.0)));
      svg << "<rect x='" << left + q * cell << "' y='" << top + l * cell << "' width='" << cell - 1 << "' height='"
          << cell - 1 << "' fill='" << (shade < 0 ? std::string("#bbbbbb")
                                                  : "rgb(255," + std::to_string(shade) + "," + std::to_string(shade) + ")")
          << "'><title>layer " << l << " head " << q << ": mean meter " << m << "</title></rect>\n";
    }
  }
  const int lx = left + heads * cell + 20;
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

}  // namespace witcert::apps
