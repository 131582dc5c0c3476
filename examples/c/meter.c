/* An engine that computes attention itself asks libwitcert for the meter of one step: its own
 * quantized keys give logits and per-token bounds c_t (here a toy: keys rounded to a grid of
 * step h, so |ε_t| ≤ sm·‖q‖₁·h/2), and witcert_meter_logits bounds the attention's TV. Built
 * against the installed package with CMake (find_package) or pkg-config; see docs/c-api.md. */
#include <math.h>
#include <stdio.h>
#include <witcert/witcert.h>

#define D 8
#define S 6

int main(void) {
  const float q[D] = {0.9f, -0.3f, 0.5f, 0.1f, -0.7f, 0.2f, 0.4f, -0.6f};
  const double h = 0.05; /* the engine's key grid */
  const double sm = 1.0 / sqrt((double)D);
  double z[S], c[S], q_l1 = 0.0;
  for (int i = 0; i < D; ++i) q_l1 += fabs(q[i]);
  for (int t = 0; t < S; ++t) {
    double dot = 0.0;
    for (int i = 0; i < D; ++i) {
      const double k = sin(0.7 * t + 0.3 * i);       /* the exact key */
      const double k_hat = h * floor(k / h + 0.5);    /* what the engine stores */
      dot += q[i] * k_hat;
    }
    z[t] = sm * dot;
    c[t] = sm * q_l1 * h / 2 * (1 + 1e-12); /* rounded up: a bound, not an estimate */
  }
  witcert_bounds b;
  if (witcert_meter_logits(z, c, S, &b) != WITCERT_OK) {
    fprintf(stderr, "witcert: %s\n", witcert_last_error());
    return 1;
  }
  printf("libwitcert %s (API %d)\n", witcert_version(), witcert_api_version());
  printf("meter %.6f  raw %.6f  two-sided %.6f  tanh-half %.6f\n", b.meter, b.raw, b.two_sided, b.tanh_half);
  /* Bad input is an error status, never a crash. */
  const witcert_status s = witcert_meter_logits(z, c, 0, &b);
  printf("n = 0: %s (%s)\n", witcert_status_name(s), witcert_last_error());
  return s == WITCERT_ERROR_INVALID_ARGUMENT ? 0 : 1;
}
