#include <fmt/format.h>

#include <array>
#include <cmath>
#include <ostream>

#include "apps/cli/commands.h"
#include "cert/meter.h"
#include "formats/dither/philox.h"

namespace witcert::apps {

int run_selfcheck(std::ostream& out) {
  // Paper §3: p̃ = (½, ½), c = (0.1, 0.1), ε = (0.1, −0.1).
  const std::array<double, 2> p = {0.5, 0.5}, c = {0.1, 0.1}, eps = {0.1, -0.1};
  const double tv = cert::true_tv(p, eps);
  const cert::Bounds b = cert::evaluate(p, c);
  bool ok = true;

  out << "WitCert self-check\n\n";
  out << "The counterexample of paper §3: p~ = (0.5, 0.5), c = (0.1, 0.1), eps = (0.1, -0.1)\n";
  out << "(the unsound form (1) of §3 is kept only in the test suite, which checks that it\n"
         " falls below this TV)\n\n";
  out << fmt::format("  {:<40} {:>10}  {}\n", "form", "value", "bounds TV");
  out << fmt::format("  {:<40} {:>10.6f}\n", "true TV(p, p~)", tv);
  const std::array<std::pair<const char*, double>, 6> rows = {{
      {"Theorem 1 e-form  (A^2-1)/2", b.eform},
      {"Prop. 1 two-sided  (A/A- - A-/A)/2", b.two_sided},
      {"Prop. 1 per-token retention", b.retention},
      {"tanh(max c)  (Runtime-Certified)", b.tanh},
      {"tanh(max c / 2)", b.tanh_half},
      {"meter = min(1, sound forms)", b.meter()},
  }};
  for (const auto& [name, value] : rows) {
    const bool bounds = value >= tv;
    ok = ok && bounds;
    out << fmt::format("  {:<40} {:>10.6f}  {}\n", name, value, bounds ? "yes" : "NO (unsound!)");
  }

  // Random123's published known-answer vectors for Philox4x32-10.
  struct Kat {
    formats::PhiloxCounter ctr;
    formats::PhiloxKey key;
    formats::PhiloxCounter expect;
  };
  const std::array<Kat, 3> kats = {{
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  }};
  int matched = 0;
  for (const Kat& k : kats) matched += formats::philox4x32_10(k.ctr, k.key) == k.expect;
  ok = ok && matched == static_cast<int>(kats.size());
  out << fmt::format("\nPhilox4x32-10 known-answer vectors: {}/{} match\n", matched, kats.size());
  out << (ok ? "self-check passed\n" : "self-check FAILED\n");
  return ok ? 0 : 1;
}

}  // namespace witcert::apps
