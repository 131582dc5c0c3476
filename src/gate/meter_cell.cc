#include "gate/meter_cell.h"

#include <algorithm>
#include <tuple>

namespace witcert::gate {

void sort_cells(std::vector<MeterCell>& cells) {
  std::stable_sort(cells.begin(), cells.end(), [](const MeterCell& a, const MeterCell& b) {
    return std::tie(a.pos, a.layer, a.q_head) < std::tie(b.pos, b.layer, b.q_head);
  });
}

std::vector<MeterCell> CellLog::cells() const {
  std::vector<MeterCell> all;
  shards_.for_each([&](const std::vector<MeterCell>& s) { all.insert(all.end(), s.begin(), s.end()); });
  sort_cells(all);
  return all;
}

}  // namespace witcert::gate
