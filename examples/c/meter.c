/* A foreign engine asks libwitcert for the meter of every decode step. The engine computes
 * attention itself over its own quantized keys (int4, absmax per group of 16 channels: a scheme
 * WitCert does not know), keeps one Tier-A witness per key (witcert_witness: band norms of its error, 16 fp16
 * values), and at each step turns them into bounds c_t for the query (witcert_tier_a_bounds) and
 * the bounds into the meter (witcert_meter_logits). It also keeps the exact keys, only to show
 * that the true TV stays under the meter. Built against the installed package with CMake
 * (find_package) or pkg-config; see docs/c-api.md. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <witcert/witcert.h>

#define D 64
#define BANDS 16
#define STEPS 48

static float key(int t, int i) { return (float)(sin(0.37 * t + 0.11 * i * i) * (i % 16 == 0 ? 6.0 : 1.0)); }
static float query(int t, int i) { return (float)cos(0.23 * t * i + 0.5); }

/* The engine's own scheme: 4-bit codes with one absmax scale per group of 16 channels. */
static void quantize_int4(const float* k, float* k_hat) {
  for (int g = 0; g < D; g += 16) {
    float amax = 0.0f;
    for (int i = g; i < g + 16; ++i) amax = fmaxf(amax, fabsf(k[i]));
    const float s = amax > 0 ? amax / 7.0f : 1.0f;
    for (int i = g; i < g + 16; ++i) k_hat[i] = s * roundf(k[i] / s);
  }
}

static int check(witcert_status s) {
  if (s != WITCERT_OK) fprintf(stderr, "witcert: %s\n", witcert_last_error());
  return s == WITCERT_OK;
}

int main(void) {
  static float keys[STEPS][D], keys_hat[STEPS][D];
  static uint16_t witness[STEPS][BANDS];
  const double sm = 1.0 / sqrt((double)D);
  printf("libwitcert %s (API %d)\n", witcert_version(), witcert_api_version());
  for (int t = 0; t < STEPS; ++t) {
    for (int i = 0; i < D; ++i) keys[t][i] = key(t, i);
    quantize_int4(keys[t], keys_hat[t]);
    if (!check(witcert_witness(D, BANDS, WITCERT_ROPE_NEOX, keys_hat[t], keys[t], witness[t]))) return 1;
    float q[D];
    for (int i = 0; i < D; ++i) q[i] = query(t, i);
    /* The engine's attention logits over its quantized keys, and WitCert's meter for them. */
    double z[STEPS], c[STEPS], p[STEPS], eps[STEPS], mx = -INFINITY, sum = 0.0;
    const int n = t + 1;
    for (int s = 0; s < n; ++s) {
      double dot = 0.0, dot_exact = 0.0;
      for (int i = 0; i < D; ++i) dot += (double)q[i] * keys_hat[s][i], dot_exact += (double)q[i] * keys[s][i];
      z[s] = sm * dot;
      eps[s] = sm * (dot - dot_exact);
      mx = fmax(mx, z[s]);
    }
    if (!check(witcert_tier_a_bounds(D, BANDS, WITCERT_ROPE_NEOX, q, &witness[0][0], (size_t)n, sm, c))) return 1;
    witcert_bounds b;
    if (!check(witcert_meter_logits(z, c, (size_t)n, &b))) return 1;
    for (int s = 0; s < n; ++s) sum += p[s] = exp(z[s] - mx);
    for (int s = 0; s < n; ++s) p[s] /= sum;
    double tv = 0.0;
    if (!check(witcert_true_tv(p, eps, (size_t)n, &tv))) return 1;
    if (tv > b.meter) {
      fprintf(stderr, "step %d: true TV %.6f above the meter %.6f\n", t, tv, b.meter);
      return 1;
    }
    if (t % 8 == 7) printf("step %2d: meter %.4f  raw %.4f  true TV %.4f\n", t, b.meter, b.raw, tv);
  }
  /* Bad input is an error status, never a crash. */
  witcert_bounds b;
  const double one = 0.0;
  const witcert_status s = witcert_meter_logits(&one, &one, 0, &b);
  printf("n = 0: %s (%s)\n", witcert_status_name(s), witcert_last_error());
  return s == WITCERT_ERROR_INVALID_ARGUMENT ? 0 : 1;
}
