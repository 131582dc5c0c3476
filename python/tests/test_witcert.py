"""The Python package against libwitcert's C API (through ctypes) and the CLI, and its handling of
bad input. Environment: WITCERT_BIN (the `witcert` binary), WITCERT_LIB (libwitcert.so) and
WITCERT_MODEL (the GGUF); scripts/python-test.sh sets them."""
import ctypes
import json
import math
import os
import subprocess

import numpy as np
import pytest

import witcert

BIN = os.environ.get("WITCERT_BIN", "build/witcert")
LIB = os.environ.get("WITCERT_LIB", "build/libwitcert.so")
MODEL = os.environ.get("WITCERT_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
FIELDS = ["eform", "two_sided", "retention", "tanh", "tanh_half", "raw", "meter"]


class CBounds(ctypes.Structure):
    _fields_ = [(f, ctypes.c_double) for f in FIELDS]


def c_meter(z, c):
    lib = ctypes.CDLL(LIB)
    lib.witcert_meter_logits.restype = ctypes.c_int
    out = CBounds()
    arr = ctypes.c_double * len(z)
    status = lib.witcert_meter_logits(arr(*z), arr(*c), ctypes.c_size_t(len(z)), ctypes.byref(out))
    assert status == 0
    return {f: getattr(out, f) for f in FIELDS}


def cli_meter(z, c):
    line = json.dumps({"z": list(map(float, z)), "c": list(map(float, c))})
    out = subprocess.run([BIN, "bound"], input=line + "\n", capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    return {f: float(got[f]) for f in FIELDS}


def bits(x):
    return np.float64(x).tobytes()


@pytest.mark.parametrize("n", [1, 3, 64, 500])
def test_python_c_and_cli_agree_bit_for_bit(n):
    rng = np.random.default_rng(n)
    z = rng.normal(0, 3, n)
    c = rng.exponential(0.05, n)
    py = witcert.meter(z, c)
    c_api = c_meter(z, c)
    cli = cli_meter(z, c)
    for f in FIELDS:
        assert bits(py[f]) == bits(c_api[f]) == bits(cli[f]), f
    # Sound on the worst signs: the true TV under |eps_t| = c_t stays below the meter.
    p = np.exp(z - z.max())
    p /= p.sum()
    for sign in (1, -1):
        eps = sign * np.where(np.arange(n) % 2 == 0, c, -c)
        assert witcert.true_tv(p, eps) <= py["meter"]
    assert witcert.meter(p_tilde=p, c=c)["meter"] == pytest.approx(py["meter"], rel=1e-9)


def test_no_guarantee_and_shapes():
    b = witcert.meter(np.array([0.0, 1.0]), np.array([0.1, math.inf]))
    assert b["raw"] == math.inf and b["meter"] == 1.0
    t, th = witcert.meter_tanh(0.4)
    assert t == pytest.approx(math.tanh(0.4), rel=1e-12) and th == pytest.approx(math.tanh(0.2), rel=1e-12)
    e, ts = witcert.meter_log_domain(0.01, -0.01)
    assert e == pytest.approx(0.5 * math.expm1(0.02), rel=1e-12) and ts == pytest.approx(math.sinh(0.02), rel=1e-12)
    assert witcert.delta_loc(0.01, 30, 9, 256) == pytest.approx(0.01 / (30 * 9 * 256))


def test_bad_arrays_name_the_argument():
    z = np.zeros(4)
    c = np.full(4, 0.1)
    with pytest.raises(TypeError, match="z must have dtype float64"):
        witcert.meter(z.astype(np.float32), c)
    with pytest.raises(TypeError, match="c must be C-contiguous"):
        witcert.meter(np.zeros(4), np.full(8, 0.1)[::2])
    with pytest.raises(TypeError, match="z must be a numpy array"):
        witcert.meter([0.0, 1.0], c)
    with pytest.raises(ValueError, match="z has 4 entries, c has 3"):
        witcert.meter(z, c[:3])
    with pytest.raises(ValueError, match=r"z\[2\] is NaN"):
        witcert.meter(np.array([0.0, 1.0, math.nan, 2.0]), c)
    with pytest.raises(ValueError, match=r"c\[1\] is negative"):
        witcert.meter(z, np.array([0.1, -0.1, 0.1, 0.1]))
    with pytest.raises(ValueError, match="n must be at least 1"):
        witcert.meter(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match="either z"):
        witcert.meter(c=c)
    with pytest.raises(ValueError, match="sums to"):
        witcert.meter(p_tilde=np.array([0.5, 0.6]), c=np.array([0.1, 0.1]))
    with pytest.raises(ValueError, match="c_max"):
        witcert.meter_tanh(math.nan)


def test_tier_a_bounds_every_token():
    rng = np.random.default_rng(1)
    for layout in ("interleaved", "neox"):
        k = rng.normal(size=(40, 64)).astype(np.float32)
        k_hat = (k + 0.05 * rng.normal(size=k.shape)).astype(np.float32)
        q = rng.normal(size=64).astype(np.float32)
        w = witcert.witness(k_hat, k, bands=16, layout=layout)
        assert w.dtype == np.float16 and w.shape == (40, 16)
        assert np.array_equal(witcert.witness(k_hat[3], k[3], layout=layout), w[3])
        c = witcert.tier_a_bounds(q, w, layout=layout)
        eps = (k_hat.astype(np.float64) - k) @ q.astype(np.float64) / 8.0
        assert np.all(c >= np.abs(eps))
    with pytest.raises(TypeError, match="k_hat must have dtype float32"):
        witcert.witness(k_hat.astype(np.float64), k)
    with pytest.raises(ValueError, match="same shape"):
        witcert.witness(k_hat[:, :32].copy(), k)
    with pytest.raises(ValueError, match="band"):
        witcert.witness(k_hat, k, bands=5)
    with pytest.raises(TypeError, match="witnesses must have dtype float16"):
        witcert.tier_a_bounds(q, w.astype(np.float32))


def test_dither_int8_round_trip_and_radius():
    q8 = witcert.DitherInt8(64, group=32, seed=7, outliers=[3, 50])
    rng = np.random.default_rng(2)
    x = (3 * rng.normal(size=64)).astype(np.float32)
    xi = q8.dither(layer=1, kv_head=0, slot=12)
    assert xi.dtype == np.float32 and np.all((xi >= -0.5) & (xi < 0.5))
    assert np.array_equal(xi, q8.dither(1, 0, 12))  # the stream is a function of its counter
    assert not np.array_equal(xi, q8.dither(1, 0, 13))
    codes, scales, ov = q8.encode(x, xi)
    assert codes.dtype == np.int8 and scales.dtype == np.float16 and ov.shape == (2,)
    y = q8.decode(codes, scales, xi, ov)
    ref = x.astype(np.float16).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), 32)
    err = np.abs(y - ref)
    assert err[3] == 0 and err[50] == 0
    assert np.all(err <= s / 2 * (1 + 1e-6) + 1e-6)
    u = q8.radius(rng.normal(size=64).astype(np.float32), scales, n_tokens=100, delta_loc=1e-6)
    assert 0 < u < math.inf
    with pytest.raises(ValueError, match="xi must hold d = 64"):
        q8.encode(x, xi[:32].copy())
    with pytest.raises(ValueError, match="outlier channel 64"):
        witcert.DitherInt8(64, outliers=[64])
    with pytest.raises(ValueError, match="group"):
        witcert.DitherInt8(64, group=30)


@pytest.mark.parametrize("kv,gate", [("q4_0", None), ("q8_0", 0.2), ("kivi-2bit", 0.1), ("dither-int8", None)])
def test_cache_outputs_within_their_bounds(kv, gate):
    rng = np.random.default_rng(3)
    cache = witcert.Cache(2, 4, 2, 64, 200, kv=kv, gate=gate, layout="neox")
    keys, vals = [], []
    for pos in range(200):
        for layer in range(2):
            for h in range(2):
                k = (rng.normal(size=64) * np.where(np.arange(64) % 17 == 0, 8, 1)).astype(np.float32)
                v = rng.normal(size=64).astype(np.float32)
                cache.write(layer, h, pos, k, v)
                if layer == 0 and h == 1:
                    keys.append(k)
                    vals.append(v)
    q = (2 * rng.normal(size=(2, 64))).astype(np.float32)
    out, cells = cache.attend(0, 1, q, 200)
    K = np.array(keys).astype(np.float16).astype(np.float64)
    V = np.array(vals).astype(np.float16).astype(np.float64)
    for h in range(2):
        logits = K @ q[h].astype(np.float64) / 8.0
        p = np.exp(logits - logits.max())
        p /= p.sum()
        err = np.linalg.norm(p @ V - out[h])
        assert err <= cells[h]["output_bound"] * (1 + 1e-5) + 1e-5
        if gate is not None:
            assert cells[h]["meter"] <= gate
    st = cache.stats()
    assert st["pool_pages"] > st["pool_free_pages"]
    with pytest.raises(IndexError, match="n_ctx"):
        cache.attend(0, 1, q, 201)
    with pytest.raises(ValueError, match="in order"):
        cache.write(0, 0, 150, keys[0], vals[0])
    with pytest.raises(IndexError, match="capacity"):
        cache.write(0, 0, 200, keys[0], vals[0])
    with pytest.raises(ValueError, match=r"= \(2, 64\)"):
        cache.attend(0, 1, q[:1].copy(), 10)


def test_cache_refuses_bad_settings():
    with pytest.raises(ValueError, match="q5_9"):
        witcert.Cache(2, 4, 2, 64, 10, kv="q5_9")
    with pytest.raises(ValueError, match="q_heads"):
        witcert.Cache(2, 3, 2, 64, 10, kv="q4_0")
    with pytest.raises(ValueError, match="layout"):
        witcert.Cache(2, 4, 2, 64, 10, kv="q4_0", layout="sideways")


@pytest.fixture(scope="module")
def engine():
    if not os.path.exists(MODEL):
        pytest.fail(f"the model is missing: run scripts/fetch-model.sh ({MODEL})")
    return witcert.Engine(MODEL)


def test_engine_generates_with_a_meter(engine):
    steps = []
    r = engine.generate("The capital of France is", kv="q4_0", gate=0.2, max_tokens=8,
                        on_token=lambda t, piece, m: steps.append(m))
    assert "Paris" in r["text"]
    assert r["completion_tokens"] == len(r["tokens"]) == len(steps) <= 8
    assert r["meter"]["cells"] > 0 and r["meter"]["coverage_k"] == 1.0
    assert all(s["cells"] == 30 * 9 and s["meter_max"] <= 0.2 for s in steps)
    # The CLI's greedy answer for the same request.
    cli = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt", "The capital of France is", "--n", "8",
                          "--kv", "q4_0", "--gate", "0.2"], capture_output=True, text=True, check=True).stdout
    assert cli.strip() == r["text"].strip()
    plain = engine.generate("The capital of France is", max_tokens=3, on_token=lambda t, p, m: len(p) > 0)
    assert plain["finish_reason"] == "cancelled" and plain["completion_tokens"] == 1 and plain["meter"] is None


def test_engine_bad_input(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("Hi", temperature=-1.0)
    with pytest.raises(ValueError, match="tools"):
        engine.generate("Hi", tools=[])
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")
    with pytest.raises(IndexError, match="context"):
        engine.generate("the boats and the nets " * 2000)
    with pytest.raises(ZeroDivisionError):
        engine.generate("Hi", max_tokens=4, on_token=lambda t, p, m: 1 / 0)
    with pytest.raises(OSError, match="nonexistent"):
        witcert.Engine("/nonexistent/model.gguf")
    assert engine.tokenize("Hello") == engine.tokenize("Hello", chat=False)


def test_the_foreign_engine_example_runs():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = subprocess.run([os.sys.executable, os.path.join(root, "examples", "python", "foreign_engine.py")],
                         capture_output=True, text=True, check=True).stdout
    lines = [l for l in out.splitlines() if l.startswith("step")]
    assert len(lines) == 6 and "meter" in lines[-1] and "true TV" in lines[-1]
