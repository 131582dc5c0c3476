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
    with pytest.raises(TypeError, match="k_hat is float64"):
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


@pytest.mark.parametrize("kv,gate", [("q4_0", None), ("q8_0", 0.2), ("kivi-2bit", 0.1), ("dither-int8", None),
                                     ("dither-int4", 0.2), ("dither-int6", None)])
def test_cache_outputs_within_their_bounds(kv, gate):
    rng = np.random.default_rng(3)
    cache = witcert.Cache(2, 4, 2, 64, 200, kv=kv, tau_k=gate, layout="neox")
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
    r = engine.generate("The capital of France is", kv="q4_0", tau_k=0.2, max_tokens=8,
                        on_token=lambda t, piece, m: steps.append(m))
    assert "Paris" in r["text"]
    assert r["completion_tokens"] == len(r["tokens"]) == len(steps) <= 8
    assert r["meter"]["cells"] > 0 and r["meter"]["coverage_k"] == 1.0
    # Gated at τ 0.2: every cell met it, q4_0 with the gate's repairs.
    assert r["verdict"] == ("repaired" if r["meter"]["page_ins"] > 0 else "certified"), r
    assert "cells met tau_K 0.2" in r["reason"]
    assert all(s["cells"] == 30 * 9 and s["meter_max"] <= 0.2 for s in steps)
    # The CLI's greedy answer for the same request.
    cli = subprocess.run([BIN, "generate", "--model", MODEL, "--prompt", "The capital of France is", "--n", "8",
                          "--kv", "q4_0", "--gate", "0.2"], capture_output=True, text=True, check=True).stdout
    assert cli.strip() == r["text"].strip()
    plain = engine.generate("The capital of France is", max_tokens=3, on_token=lambda t, p, m: len(p) > 0)
    assert plain["finish_reason"] == "cancelled" and plain["completion_tokens"] == 1 and plain["meter"] is None
    assert plain["verdict"] == "unmetered" and "no meter" in plain["reason"]


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


# NaN, +inf, -inf and 1e5 (fp16's range ends at 65504; a float16 argument receives +inf) in every
# float argument of every function and method that takes one. Each answer is an exception naming
# the argument, or no guarantee (an infinite bound, a meter of 1), never a finite certificate; a
# finite answer only for the values listed in LEGIT, checked against an equivalent clean input.
POISONS = {"NaN": math.nan, "+inf": math.inf, "-inf": -math.inf, "1e5": 1e5}
Z0, C0, P0, EPS0 = [0.0, 1.0, -0.5], [0.1, 0.2, 0.05], [0.25, 0.5, 0.25], [0.1, -0.1, 0.05]


def poisoned(values, v, dtype, where=1):
    a = np.array(values, dtype=dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        a.flat[where] = v
    return a


def no_guarantee_unless(finite):
    return "certifies" if finite else "no guarantee"


def run_meter_logits(arg, v):
    z = poisoned(Z0, v, np.float64) if arg == "z" else np.array(Z0)
    c = poisoned(C0, v, np.float64) if arg == "c" else np.array(C0)
    b = witcert.meter(z, c)
    if arg == "z" and v in (-math.inf, 1e5):
        # -inf masks the token: the meter of the other two; 1e5 is an offset of the same logits.
        if v < 0:
            zs, cs = np.array([Z0[0], Z0[2]]), np.array([C0[0], C0[2]])
        else:
            zs, cs = np.array([Z0[0] - 1e5, 0.0, Z0[2] - 1e5]), np.array(C0)
        assert b["meter"] == pytest.approx(witcert.meter(zs, cs)["meter"], rel=1e-6)
        return "legit"
    return no_guarantee_unless(b["meter"] < 1)


def run_meter_probs(arg, v):
    p = poisoned(P0, v, np.float64) if arg == "p_tilde" else np.array(P0)
    c = poisoned(C0, v, np.float64) if arg == "c" else np.array(C0)
    return no_guarantee_unless(witcert.meter(p_tilde=p, c=c)["meter"] < 1)


def run_meter_tanh(arg, v):
    return no_guarantee_unless(min(witcert.meter_tanh(v)) < 1)


def run_meter_log_domain(arg, v):
    e, ts = witcert.meter_log_domain(v if arg == "log_a" else 0.1, v if arg == "log_a_minus" else -0.05)
    return no_guarantee_unless(min(e, ts) < 1)


def run_true_tv(arg, v):
    p = poisoned(P0, v, np.float64) if arg == "p_tilde" else np.array(P0)
    eps = poisoned(EPS0, v, np.float64) if arg == "eps" else np.array(EPS0)
    tv = witcert.true_tv(p, eps)
    if arg == "eps" and v == 1e5:  # e^-1e5 = 0: the token's exact mass is 0
        w = np.array(P0) * np.exp(-np.array(EPS0))
        w[1] = 0
        assert tv == pytest.approx(0.5 * np.abs(w / w.sum() - np.array(P0)).sum(), abs=1e-15)
        return "legit"
    return "certifies"  # a TV of a non-finite input is garbage


def run_witness(arg, v):
    k_hat = poisoned(np.full(64, 0.25), v, np.float32) if arg == "k_hat" else np.full(64, 0.25, np.float32)
    k = poisoned(np.full(64, 0.5), v, np.float32) if arg == "k" else np.full(64, 0.5, np.float32)
    return no_guarantee_unless(np.all(np.isfinite(witcert.witness(k_hat, k, layout="neox"))))


W0 = np.repeat(witcert.witness(np.full(64, 0.25, np.float32), np.full(64, 0.5, np.float32), layout="neox")[None], 2, 0)


def run_tier_a_bounds(arg, v):
    q = poisoned(np.ones(64), v, np.float32) if arg == "q" else np.ones(64, np.float32)
    w = poisoned(W0, v, np.float16) if arg == "witnesses" else W0.copy()
    c = witcert.tier_a_bounds(q, w, sm=v if arg == "sm" else 0.125, layout="neox")
    if arg == "sm" and v == 1e5:  # a larger softmax scale: c scales with it
        assert c == pytest.approx(witcert.tier_a_bounds(q, w, sm=0.125, layout="neox") * 8e5, rel=1e-9)
        return "legit"
    return no_guarantee_unless(np.all(np.isfinite(c)))


Q8 = witcert.DitherInt8(64, group=32, seed=1, outliers=[5])
XI0 = Q8.dither(0, 0, 0)
X0 = (0.1 * (np.arange(64) % 7) - 0.3).astype(np.float32)
CODES0, SCALES0, OV0 = Q8.encode(X0, XI0)


def run_encode(arg, v):
    x = poisoned(X0, v, np.float32) if arg == "x" else X0.copy()
    xi = poisoned(XI0, v, np.float32) if arg == "xi" else XI0.copy()
    Q8.encode(x, xi)
    return "certifies"


def run_decode(arg, v):
    scales = poisoned(SCALES0, v, np.float16) if arg == "scales" else SCALES0.copy()
    xi = poisoned(XI0, v, np.float32) if arg == "xi" else XI0.copy()
    ov = poisoned(OV0, v, np.float16, where=0) if arg == "outlier_values" else OV0.copy()
    Q8.decode(CODES0, scales, xi, ov)
    return "certifies"


def run_delta_loc(arg, v):
    witcert.delta_loc(v, 30, 9, 256)
    return "certifies"


def run_radius(arg, v):
    q = poisoned(np.ones(64), v, np.float32) if arg == "q" else np.ones(64, np.float32)
    scales = poisoned(SCALES0, v, np.float16) if arg == "scales" else SCALES0.copy()
    u = Q8.radius(q, scales, n_tokens=10, delta_loc=v if arg == "delta_loc" else 1e-6, sm=v if arg == "sm" else 0.125)
    if arg == "sm" and v == 1e5:  # the radius scales with sm
        assert u == pytest.approx(Q8.radius(q, scales, n_tokens=10, delta_loc=1e-6, sm=0.125) * 8e5, rel=1e-9)
        return "legit"
    return no_guarantee_unless(math.isfinite(u))


def run_value_bound(arg, v):
    inputs = {"tv_k": 0.1, "v_max_norm": 2.0, "weighted_rho": 0.01}
    inputs[arg] = v
    bound, v_meter = witcert.value_bound(**inputs)
    if v == 1e5:  # a loose but true input: the formulas, evaluated
        assert bound == pytest.approx(2 * inputs["tv_k"] * inputs["v_max_norm"] + inputs["weighted_rho"], rel=1e-15)
        assert v_meter == pytest.approx(inputs["weighted_rho"] / inputs["v_max_norm"], rel=1e-15)
        return "legit"
    return no_guarantee_unless(math.isfinite(bound) and math.isfinite(v_meter))


CACHES = {"fp16": {}, "q4_0": {"kv": "q4_0"}, "dither-int8": {"kv": "dither-int8"}, "q8_0 gated": {"kv": "q8_0", "tau_k": 0.2}}


def row(p):
    return np.sin(0.37 * np.arange(1, 65) * (p + 1)).astype(np.float32)


def attend_verdict(cache, q, n_ctx):
    out, cells = cache.attend(0, 0, q, n_ctx)
    assert np.all(np.isfinite(out))
    return no_guarantee_unless(any(c["meter"] < 1 for c in cells))


def run_cache_write(options):
    def run(arg, v):
        cache = witcert.Cache(1, 2, 1, 64, 16, layout="neox", **options)
        cache.write(0, 0, 0, poisoned(row(0), v, np.float32) if arg == "k" else row(0),
                    poisoned(row(100), v, np.float32) if arg == "v" else row(100))
        cache.write(0, 0, 1, row(1), row(101))
        return attend_verdict(cache, np.full((2, 64), 0.5, np.float32), 2)
    return run


def run_cache_attend(options):
    def run(arg, v):
        cache = witcert.Cache(1, 2, 1, 64, 16, layout="neox", **options)
        for p in range(3):
            cache.write(0, 0, p, row(p), row(p + 100))
        return attend_verdict(cache, poisoned(np.full((2, 64), 0.5), v, np.float32), 3)
    return run


CALLS = {
    "meter_logits": (["z", "c"], run_meter_logits),
    "meter_probs": (["p_tilde", "c"], run_meter_probs),
    "meter_tanh": (["c_max"], run_meter_tanh),
    "meter_log_domain": (["log_a", "log_a_minus"], run_meter_log_domain),
    "true_tv": (["p_tilde", "eps"], run_true_tv),
    "witness": (["k_hat", "k"], run_witness),
    "tier_a_bounds": (["q", "witnesses", "sm"], run_tier_a_bounds),
    "DitherInt8.encode": (["x", "xi"], run_encode),
    "DitherInt8.decode": (["scales", "xi", "outlier_values"], run_decode),
    "delta_loc": (["delta"], run_delta_loc),
    "DitherInt8.radius": (["q", "scales", "sm", "delta_loc"], run_radius),
    "value_bound": (["tv_k", "v_max_norm", "weighted_rho"], run_value_bound),
}
for _name, _options in CACHES.items():
    CALLS[f"Cache.write {_name}"] = (["k", "v"], run_cache_write(_options))
    CALLS[f"Cache.attend {_name}"] = (["q"], run_cache_attend(_options))
SCALARS = {"c_max", "log_a", "log_a_minus", "sm", "delta", "delta_loc", "tv_k", "v_max_norm", "weighted_rho"}
LEGIT = {("meter_logits", "z", "-inf"), ("meter_logits", "z", "1e5"), ("true_tv", "eps", "1e5"),
         ("tier_a_bounds", "sm", "1e5"), ("DitherInt8.radius", "sm", "1e5"), ("value_bound", "tv_k", "1e5"),
         ("value_bound", "v_max_norm", "1e5"), ("value_bound", "weighted_rho", "1e5")}
CASES = [(call, arg, label) for call, (args, _) in CALLS.items() for arg in args for label in POISONS]


@pytest.mark.parametrize("call,arg,label", CASES, ids=[" ".join(c) for c in CASES])
def test_no_call_certifies_a_poisoned_input(call, arg, label):
    args, run = CALLS[call]
    try:
        answer = run(arg, POISONS[label])
    except ValueError as e:
        index = "" if arg in SCALARS else "[0]" if arg == "outlier_values" else "[1]"
        assert arg + index in str(e), f"'{e}' does not name {arg}{index}"
        return
    assert answer != "certifies", "a finite certificate for a poisoned input"
    assert (answer == "legit") == ((call, arg, label) in LEGIT)


def test_every_legit_case_is_a_case():
    assert len(CASES) == 4 * (2 + 2 + 1 + 2 + 2 + 2 + 3 + 2 + 3 + 1 + 4 + 3 + 4 * 3)
    assert LEGIT <= set(CASES)


def test_deeply_nested_options_are_refused():
    deep = json.loads("[" * 100 + "]" * 100)  # beyond the C API's 64 levels
    with pytest.raises(ValueError, match="deeper"):
        witcert.Cache(1, 2, 1, 64, 16, kv="q4_0", deep=deep)
