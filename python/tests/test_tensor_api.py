"""The tensor API: meters, witnesses and Tier-A bounds of whole batches, from numpy arrays and torch
tensors of every float dtype, read in place, against the one-row calls bit for bit; bad input refused
with the row and the entry named; the cache written and attended per layer in one call, against its
per-position calls, and its report."""
import math

import numpy as np
import pytest

import witcert
from witcert import _arrays
from test_witcert import C0, POISONS, Z0, P0

try:  # torch is optional here: without it the numpy half runs (the transformers tests require it)
    import torch
except ImportError:  # pragma: no cover
    torch = None

FIELDS = ["eform", "two_sided", "retention", "tanh", "tanh_half", "raw", "meter"]


def rows_of(shape, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(0, 3, shape)
    z[..., ::7] = -np.inf if shape[-1] > 7 else z[..., ::7]
    c = rng.exponential(0.05, shape)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return z, c, p


@pytest.mark.parametrize("shape", [(1,), (3,), (4, 64), (2, 3, 500), (32, 9, 64)])
@pytest.mark.parametrize("threads", [1, 0])
def test_meters_are_the_one_step_meter_bit_for_bit(shape, threads):
    z, c, p = rows_of(shape, sum(shape))
    m = witcert.meters(z, c, threads=threads)
    mp = witcert.meters(p_tilde=p, c=c, threads=threads)
    assert m.meter.shape == shape[:-1]
    for idx in np.ndindex(*shape[:-1]):
        one = witcert.meter(z[idx], c[idx])
        one_p = witcert.meter(p_tilde=p[idx], c=c[idx])
        for f in FIELDS:
            assert np.float64(getattr(m, f)[idx]).tobytes() == np.float64(one[f]).tobytes(), (idx, f)
            assert np.float64(getattr(mp, f)[idx]).tobytes() == np.float64(one_p[f]).tobytes(), (idx, f)


def widened(x):
    """The float64 values the C API reads from x (numpy or torch, any float dtype)."""
    if torch is not None and isinstance(x, torch.Tensor):
        return x.double().numpy()
    return x.astype(np.float64)


def dtype_cases():
    cases = [("numpy float64", lambda a: a), ("numpy float32", lambda a: a.astype(np.float32)),
             ("numpy float16", lambda a: a.astype(np.float16))]
    if torch is not None:
        cases += [(f"torch {t}", (lambda t: lambda a: torch.from_numpy(a).to(t))(t))
                  for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    return cases


@pytest.mark.parametrize("name,make", dtype_cases(), ids=[c[0] for c in dtype_cases()])
def test_every_dtype_is_read_exactly(name, make):
    z, c, _ = rows_of((3, 5, 40), 7)
    z = np.where(np.isinf(z), -60.0, z)  # finite in every dtype
    zt, ct = make(z), make(c)
    m = witcert.meters(zt, ct)
    zw, cw = widened(zt), widened(ct)
    for idx in np.ndindex(3, 5):
        assert m.meter[idx] == witcert.meter(np.ascontiguousarray(zw[idx]), np.ascontiguousarray(cw[idx]))["meter"]


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_torch_tensors_are_read_in_place():
    t = torch.randn(4, 9, 128, dtype=torch.float32)
    view, code = _arrays.view(t, "z")
    assert code == _arrays.F32 and view.ctypes.data == t.data_ptr()
    b = t.bfloat16()
    view, code = _arrays.view(b, "z")
    assert code == _arrays.BF16 and view.ctypes.data == b.data_ptr()
    with pytest.raises(TypeError, match="z must be contiguous"):
        witcert.meters(t.transpose(1, 2), t.abs().transpose(1, 2))
    with pytest.raises(TypeError, match="c must be float64, float32, float16 or bfloat16"):
        witcert.meters(t, torch.ones(4, 9, 128, dtype=torch.int32))
    # A tensor that requires grad is read through detach, without a copy.
    g = torch.randn(2, 8, requires_grad=True)
    assert witcert.meters(g, g.detach().abs()).meter.shape == (2,)


def test_bad_batches_are_refused_naming_row_and_entry():
    z, c, p = rows_of((6, 30), 3)
    z[4, 2] = np.nan
    with pytest.raises(ValueError, match=r"row 4: z\[2\] is NaN"):
        witcert.meters(z, c)
    with pytest.raises(ValueError, match="must be equal"):
        witcert.meters(p_tilde=p, c=c[:, :29].copy())
    with pytest.raises(TypeError, match="C-contiguous"):
        witcert.meters(p_tilde=p[:, ::2], c=c[:, ::2])
    with pytest.raises(TypeError, match="float64, float32, float16 or bfloat16"):
        witcert.meters(np.zeros(z.shape, np.int64), c)
    with pytest.raises(TypeError, match="numpy array or a torch tensor"):
        witcert.meters(z.tolist(), c)
    with pytest.raises(ValueError, match="no tokens"):
        witcert.meters(np.zeros((3, 0)), np.zeros((3, 0)))
    with pytest.raises(ValueError, match="either z"):
        witcert.meters(c=c)


DTYPES = [np.float64, np.float32, np.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("arg", ["z", "c", "p_tilde"])
@pytest.mark.parametrize("label", list(POISONS))
def test_no_batch_certifies_a_poisoned_row(dtype, arg, label):
    # Row 1 of three is poisoned at entry 1; the other rows are the clean step.
    base = {"z": Z0, "c": C0, "p_tilde": P0}
    arrays = {}
    for k in ("z", "c", "p_tilde"):
        a = np.tile(np.array(base[k], dtype=np.float64), (3, 1))
        if k == arg:
            with np.errstate(over="ignore", invalid="ignore"):
                a[1, 1] = POISONS[label]
        with np.errstate(over="ignore"):
            arrays[k] = a.astype(dtype)
    logits = arg != "p_tilde"
    x = arrays["z"] if logits else arrays["p_tilde"]
    try:
        m = witcert.meters(x, arrays["c"]) if logits else witcert.meters(p_tilde=x, c=arrays["c"])
    except ValueError as e:
        assert f"row 1: {arg}[1]" in str(e) or (f"row 1: {arg} sums" in str(e)), str(e)
        return
    wide = {k: arrays[k].astype(np.float64) for k in arrays}
    if logits and arg == "z" and (label == "-inf" or (label == "1e5" and dtype != np.float16)):
        # A masked token, or a logit offset: the row's meter is the one-step meter of its values.
        assert m.meter[1] == witcert.meter(wide["z"][1], wide["c"][1])["meter"]
        return
    assert m.meter[1] == 1.0 or not math.isfinite(m.raw[1]), "a finite certificate for a poisoned row"


@pytest.mark.parametrize("layout", ["interleaved", "neox"])
def test_batched_witnesses_and_bounds_are_the_single_calls(layout):
    rng = np.random.default_rng(4)
    b, hq, hk, n, d = 2, 6, 2, 33, 64
    k = rng.normal(size=(b, hk, n, d)).astype(np.float32)
    k_hat = (k + 0.05 * rng.normal(size=k.shape)).astype(np.float32)
    q = rng.normal(size=(b, hq, d)).astype(np.float32)
    w = witcert.witness(k_hat, k, layout=layout)
    assert w.shape == (b, hk, n, 16) and w.dtype == np.float16
    c = witcert.tier_a_bounds(q, w, layout=layout)
    assert c.shape == (b, hq, n)
    for i in range(b):
        for h in range(hq):
            kv = h // (hq // hk)
            assert np.array_equal(witcert.witness(k_hat[i, kv], k[i, kv], layout=layout), w[i, kv])
            one = witcert.tier_a_bounds(q[i, h], np.ascontiguousarray(w[i, kv]), layout=layout)
            assert one.tobytes() == c[i, h].tobytes()
            eps = (k_hat[i, kv].astype(np.float64) - k[i, kv]) @ q[i, h].astype(np.float64) / 8.0
            assert np.all(np.abs(eps) <= c[i, h])
    with pytest.raises(TypeError, match="k_hat is float64"):
        witcert.witness(k_hat.astype(np.float64), k.astype(np.float64))
    with pytest.raises(ValueError, match="same leading shape"):
        witcert.tier_a_bounds(q[:1], w)
    if torch is not None:
        tb = witcert.witness(torch.from_numpy(k_hat).bfloat16(), torch.from_numpy(k).bfloat16(), layout=layout)
        ref = witcert.witness(torch.from_numpy(k_hat).bfloat16().float().numpy(),
                              torch.from_numpy(k).bfloat16().float().numpy(), layout=layout)
        assert np.array_equal(tb, ref)
        assert np.array_equal(witcert.tier_a_bounds(torch.from_numpy(q), w, layout=layout), c)


FORMATS = {"fp16": {}, "q4_0": {"kv": "q4_0"}, "dither-int8": {"kv": "dither-int8", "kv_v": "dither-int8"},
           "kivi-2bit gated": {"kv": "kivi-2bit", "tau_k": 0.2}, "dither-int4 per-slot": {
               "kv": "dither-int4", "kv_v": "dither-int4", "dither": "per-slot"},
           "q8_0 gated head": {"kv": "q8_0", "kv_v": "q4_0", "tau_k": 0.1, "granularity": "head"},
           "dither-int6 channel scales gated": {"kv": "dither-int6", "key_scales": "channel", "tau_k": 0.2}}


def exact_attention(k, v, q, begin, end):
    """Attention of q over the fp16 keys and values [begin, end), in float64."""
    k16 = k[begin:end].astype(np.float16).astype(np.float64)
    v16 = v[begin:end].astype(np.float16).astype(np.float64)
    s = k16 @ q.astype(np.float64) / math.sqrt(k.shape[-1])
    w = np.exp(s - s.max())
    return (w / w.sum()) @ v16


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prompt", [3, 40, 100])
def test_rows_calls_are_the_per_position_calls(name, page_size, prompt):
    """A prompt in one call (runs of the cache's causal path), then decode steps, against one call per
    position: the same outputs, the same Tier-A scores (a dithered run's union bound over its widest
    span reads at least the position's), bit for bit at the decode steps, and every cell sound."""
    layers, hq, hk, d, steps = 2, 4, 2, 64, 3
    rng = np.random.default_rng(prompt + page_size)
    n = prompt + steps
    k = rng.normal(size=(layers, hk, n, d)).astype(np.float32)
    k[..., ::9] *= 6
    v = rng.normal(size=(layers, hk, n, d)).astype(np.float32)
    q = rng.normal(size=(layers, hq, n, d)).astype(np.float32)
    opts = dict(FORMATS[name], page_size=page_size) if FORMATS[name] else {}  # the plain cache has no pages
    gated = "tau_k" in opts
    a = witcert.Cache(layers, hq, hk, d, 128, layout="neox", **opts)
    b = witcert.Cache(layers, hq, hk, d, 128, layout="neox", **opts)
    a.report_start(prompt)
    group = hq // hk
    for pos0, t in [(0, prompt)] + [(prompt + s, 1) for s in range(steps)]:
        for layer in range(layers):
            a.write_rows(layer, pos0, k[layer, :, pos0:pos0 + t].copy(), v[layer, :, pos0:pos0 + t].copy())
            out, cells = a.attend_rows(layer, q[layer, :, pos0:pos0 + t].copy(), pos0)
            for h in range(hk):
                for p in range(pos0, pos0 + t):
                    b.write(layer, h, p, k[layer, h, p].copy(), v[layer, h, p].copy())
            for h in range(hk):
                for j in range(t):
                    pos = pos0 + j
                    o1, c1 = b.attend(layer, h, q[layer, h * group:(h + 1) * group, pos].copy(), pos + 1)
                    for g in range(group):
                        head = h * group + g
                        ref = exact_attention(k[layer, h], v[layer, h], q[layer, head, pos], 0, pos + 1)
                        bound = cells.output_bound[head, j] if opts else 2e-5
                        assert np.linalg.norm(ref - out[head, j]) <= bound * (1 + 1e-5) + 1e-5
                        if gated:
                            assert cells.meter[head, j] <= opts["tau_k"]
                            continue
                        if t == 1:  # a decode step: the one-position call itself
                            assert np.array_equal(o1[g], out[head, j])
                            for f in ("raw", "meter", "v_meter", "output_bound"):
                                assert c1[g][f] == getattr(cells, f)[head, j], f
                            continue
                        assert np.allclose(o1[g], out[head, j], atol=1e-5)
                        if "dither" in name:
                            assert cells.raw[head, j] >= c1[g]["raw"] * (1 - 1e-12)
                        else:
                            assert cells.raw[head, j] == pytest.approx(c1[g]["raw"], rel=1e-9, abs=1e-12)
    report = a.report()
    if name == "fp16":
        assert report["verdict"] == "unmetered" and report["cells"] == 0
    else:
        assert report["cells"] == steps * layers * hq
        assert report["kv"] == opts["kv"]
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.stats()


def test_left_padding_attends_from_the_first_real_position():
    rng = np.random.default_rng(8)
    d, n, begin = 64, 20, 7
    k = rng.normal(size=(1, n, d)).astype(np.float32)
    v = rng.normal(size=(1, n, d)).astype(np.float32)
    q = rng.normal(size=(2, n, d)).astype(np.float32)
    with witcert.Cache(1, 2, 1, d, 32, layout="neox") as cache:
        cache.write_rows(0, 0, k, v)
        out, _ = cache.attend_rows(0, q, 0, begin)
    k16 = k[0].astype(np.float16).astype(np.float64)
    v16 = v[0].astype(np.float16).astype(np.float64)
    for h in range(2):
        for p in range(n):
            lo = min(begin, p)  # a query inside the padding sees itself only
            s = k16[lo:p + 1] @ q[h, p].astype(np.float64) / 8.0
            w = np.exp(s - s.max())
            w /= w.sum()
            assert np.allclose(out[h, p], w @ v16[lo:p + 1], atol=2e-6), (h, p)


def test_rows_calls_refuse_bad_shapes_and_values():
    cache = witcert.Cache(1, 2, 1, 64, 8, kv="q4_0")
    with pytest.raises(ValueError, match=r"\(kv_heads, tokens, head_dim\)"):
        cache.write_rows(0, 0, np.zeros((2, 3, 64), np.float32), np.zeros((2, 3, 64), np.float32))
    with pytest.raises(IndexError, match="capacity"):
        cache.write_rows(0, 0, np.zeros((1, 9, 64), np.float32), np.zeros((1, 9, 64), np.float32))
    k = np.zeros((1, 3, 64), np.float32)
    k[0, 1, 5] = np.inf
    with pytest.raises(ValueError, match=r"k\[0\]\[1\]\[5\]"):
        cache.write_rows(0, 0, k, np.zeros((1, 3, 64), np.float32))
    # Nothing of a refused call was written: the same positions go in now.
    cache.write_rows(0, 0, np.zeros((1, 3, 64), np.float32), np.zeros((1, 3, 64), np.float32))
    with pytest.raises(ValueError, match=r"\(q_heads, tokens, head_dim\)"):
        cache.attend_rows(0, np.zeros((1, 1, 64), np.float32), 0)
    with pytest.raises(IndexError, match="written"):
        cache.attend_rows(0, np.zeros((2, 1, 64), np.float32), 3)


def rtn3(x):
    """A 3-bit round-to-nearest per token, in numpy: the reconstruction of (tokens, head_dim) keys."""
    scale = np.abs(x).max(axis=-1, keepdims=True) / 3 + 1e-12
    return (np.clip(np.round(x / scale), -4, 3) * scale).astype(np.float32)


@pytest.mark.parametrize("options", [{}, {"tau_k": 0.05, "tau_v": 0.02}, {"kv_v": "q4_0"}])
def test_a_registered_scheme_is_metered_and_gated(options):
    witcert.register_scheme("rtn3-numpy", rtn3)
    assert "rtn3-numpy" in witcert.schemes()
    rng = np.random.default_rng(12)
    d, n = 64, 30
    k = rng.normal(size=(1, n, d)).astype(np.float32)
    k[..., 3] *= 8
    v = rng.normal(size=(1, n, d)).astype(np.float32)
    q = rng.normal(size=(2, 1, d)).astype(np.float32)
    seen = []
    witcert.register_scheme("rtn3-numpy", lambda x: seen.append(type(x)) or rtn3(x))
    with witcert.Cache(1, 2, 1, d, 32, kv="rtn3-numpy", layout="neox", check_soundness=True, **options) as cache:
        cache.write_rows(0, 0, k[:, :n - 1], v[:, :n - 1])
        cache.write_rows(0, n - 1, k[:, n - 1:], v[:, n - 1:])
        out, cells = cache.attend_rows(0, q, n - 1)
        report = cache.report()
    assert seen and all(t is np.ndarray for t in seen)
    assert report["kv"] == "rtn3-numpy" and report["kv_v"] == options.get("kv_v", "rtn3-numpy")
    assert report["soundness_violations"] == 0 and report["soundness_checked"] == 2
    k16, v16 = k[0].astype(np.float16).astype(np.float64), v[0].astype(np.float16).astype(np.float64)
    for h in range(2):
        s = k16 @ q[h, 0].astype(np.float64) / 8.0
        w = np.exp(s - s.max())
        w /= w.sum()
        err = np.linalg.norm(w @ v16 - out[h, 0])
        assert err <= cells.output_bound[h, 0] * (1 + 1e-5) + 1e-5
        if "tau_k" in options:
            assert cells.meter[h, 0] <= 0.05
        else:
            assert 0 < cells.meter[h, 0] < 1  # a real, finite meter of a lossy scheme


def test_a_registered_scheme_is_checked():
    with pytest.raises(ValueError, match="new name"):
        witcert.register_scheme("q4_0", rtn3)
    with pytest.raises(TypeError, match="callable"):
        witcert.register_scheme("nothing", 3)
    witcert.register_scheme("wrong-shape", lambda x: x[:, :32])
    witcert.register_scheme("nan", lambda x: np.full_like(x, np.nan))
    k = np.ones((1, 2, 64), np.float32)
    with witcert.Cache(1, 2, 1, 64, 8, kv="wrong-shape") as cache:
        with pytest.raises(ValueError, match="returned shape"):
            cache.write_rows(0, 0, k, k)
        with pytest.raises(ValueError, match="write_rows"):
            cache.write(0, 0, 0, k[0, 0], k[0, 0])
    with witcert.Cache(1, 2, 1, 64, 8, kv="nan") as cache:
        with pytest.raises(ValueError, match=r"k_hat\[0\]\[0\]\[0\] is NaN"):
            cache.write_rows(0, 0, k, k)


def narrow_dtypes():
    cases = [("float32", lambda a: a.astype(np.float32)), ("float16", lambda a: a.astype(np.float16))]
    if torch is not None:
        cases.append(("bfloat16", lambda a: torch.from_numpy(a.astype(np.float32)).bfloat16()))
    return cases


@pytest.mark.parametrize("dtype,make", narrow_dtypes(), ids=[c[0] for c in narrow_dtypes()])
@pytest.mark.parametrize("arg", ["k_hat", "k", "q", "witnesses"])
@pytest.mark.parametrize("label", list(POISONS))
def test_no_batched_certificate_for_a_poisoned_key_or_query(dtype, make, arg, label):
    """NaN, ±inf or 1e5 in one entry of a batch's keys, reconstructions, queries or witnesses is refused
    with the entry named, or answered with no guarantee for its token, never a finite certificate."""
    rng = np.random.default_rng(3)
    b, hq, hk, n, d = 2, 4, 2, 5, 64
    k = rng.normal(size=(b, hk, n, d))
    k_hat = k + 0.01 * rng.normal(size=k.shape)
    q = rng.normal(size=(b, hq, d))
    where = (1, 1, 3, 7)  # row 1, KV head 1, token 3, channel 7
    with np.errstate(over="ignore", invalid="ignore"):
        if arg in ("k", "k_hat"):
            (k if arg == "k" else k_hat)[where] = POISONS[label]
        if arg == "q":
            q[1, 2, 7] = POISONS[label]  # query head 2 reads KV head 1
        k_t, kh_t, q_t = make(k), make(k_hat), make(q)
    try:
        w = witcert.witness(kh_t, k_t, layout="neox")
        if arg == "witnesses":
            w = w.copy()
            with np.errstate(over="ignore", invalid="ignore"):
                w[1, 1, 3, 2] = np.float16(POISONS[label])
        c = witcert.tier_a_bounds(q_t, w, layout="neox")
    except ValueError as e:
        name = {"k": "k[", "k_hat": "k_hat[", "q": "q[", "witnesses": "witnesses["}[arg]
        assert name in str(e), str(e)
        return
    if arg == "q":  # every token of query head 2 depends on the poisoned query
        assert np.all(np.isinf(c[1, 2])), c[1, 2]
    else:
        assert np.isinf(c[1, 2, 3]) and np.isinf(c[1, 3, 3]), (c[1, 2, 3], c[1, 3, 3])
    assert np.all(np.isfinite(c[0]))  # the clean row keeps its certificate


@pytest.mark.parametrize("options", [{"kv": "q4_0", "tau_k": 0.2, "check_soundness": True}, {"kv": "q4_0"},
                                     {"kv": "dither-int8", "tau_k": 0.5, "granularity": "head"}])
def test_a_report_from_drained_cells_is_the_caches_own_whole_or_by_heads(options):
    """Cells drained from a cache and counted elsewhere (by tensor-parallel rank: two halves of the
    heads, in either order) give the cache's own witcert object."""
    rng = np.random.default_rng(5)
    layers, q_heads, kv_heads, d, prompt, n = 2, 4, 2, 64, 6, 20
    cache = witcert.Cache(layers, q_heads, kv_heads, d, n, **options)
    cache.report_start(prompt)
    cache.keep_cells()
    for pos in range(n):
        for layer in range(layers):
            k = rng.standard_normal((kv_heads, 1, d)).astype(np.float32)
            k[:, :, 3] *= 9  # an outlier channel
            cache.write_rows(layer, pos, k, rng.standard_normal((kv_heads, 1, d)).astype(np.float32))
            cache.attend_rows(layer, rng.standard_normal((q_heads, 1, d)).astype(np.float32), pos)
    cells = cache.drain_cells()
    assert len(cells) == (n - prompt) * layers * q_heads and len(cache.drain_cells()) == 0
    own, stats = cache.report(), cache.stats()
    for parts in ([cells], [cells[cells["q_head"] >= 2], cells[cells["q_head"] < 2]]):
        r = witcert.Report(layers, q_heads, prompt, **options)
        for p in parts:
            r.record(p)
        r.add_page_ins(stats["page_ins"], stats["page_in_bytes"])
        assert r.object() == own
    bad = cells.copy()
    bad["meter"][7] = np.nan
    r = witcert.Report(layers, q_heads, prompt, **options)
    with pytest.raises(ValueError, match=r"cells\[7\]"):
        r.record(bad)
    assert r.object()["cells"] == 0
    bad = cells.copy()
    bad["q_head"][2] = q_heads
    with pytest.raises(ValueError, match=r"cells\[2\].*q_head"):
        r.record(bad)
