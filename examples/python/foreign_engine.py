"""A foreign engine asks WitCert for the meter of every decode step, through the Python package.

The engine (numpy attention, standing in for any engine that computes attention itself) stores its
keys with its own 4-bit scheme, keeps one Tier-A witness per key (band norms of the key's error,
16 float16 values), and at each step turns them into bounds c_t for the query and the bounds into
the meter. It also keeps the exact keys, only to show the true TV under the meter.

    .venv/bin/pip install .  &&  .venv/bin/python examples/python/foreign_engine.py
"""
import numpy as np

import witcert

D, STEPS = 64, 48
rng = np.random.default_rng(0)


def quantize_int4(k: np.ndarray) -> np.ndarray:
    """The engine's own scheme: 4-bit codes, one absmax scale per group of 16 channels."""
    g = k.reshape(-1, 16)
    s = np.abs(g).max(axis=1, keepdims=True) / 7.0
    s[s == 0] = 1.0
    return (s * np.round(g / s)).reshape(k.shape).astype(np.float32)


keys, keys_hat, witnesses = [], [], []
scale = np.where(np.arange(D) % 16 == 0, 3.0, 1.0)  # a few large channels, as real keys have
for t in range(STEPS):
    k = (rng.normal(size=D) * scale).astype(np.float32)
    k_hat = quantize_int4(k)
    keys.append(k)
    keys_hat.append(k_hat)
    witnesses.append(witcert.witness(k_hat, k, bands=16, layout="neox"))
    q = (0.5 * rng.normal(size=D)).astype(np.float32)

    K, K_hat, W = np.array(keys), np.array(keys_hat), np.array(witnesses)
    sm = 1.0 / np.sqrt(D)
    z = sm * (K_hat.astype(np.float64) @ q.astype(np.float64))  # the engine's logits
    c = witcert.tier_a_bounds(q, W, sm, layout="neox")            # c_t >= |eps_t|
    m = witcert.meter(z, c)

    p = np.exp(z - z.max())
    p /= p.sum()
    eps = z - sm * (K.astype(np.float64) @ q.astype(np.float64))
    tv = witcert.true_tv(p, eps)
    assert tv <= m["meter"], (t, tv, m["meter"])
    if t % 8 == 7:
        print(f"step {t:2d}: meter {m['meter']:.4f}  raw {m['raw']:.4f}  true TV {tv:.4f}")
