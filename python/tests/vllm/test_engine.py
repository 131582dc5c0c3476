"""witcert.vllm inside vLLM's offline engine (LLM), on SmolLM2 converted from the project's GGUF.

The engine runs in this process (one worker, no engine process), so a test can watch every layer's
attention: each decode cell's meter is checked against the true TV computed here in float64 from the
exact keys the model produced and the keys vLLM stored, and against WitCert's own meter computed
from those keys with the tensor API.
"""
import contextlib
import gc
import math
import os

import numpy as np
import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, set before vLLM loads
from vllm_env import MODEL, needs_fp8  # noqa: E402
import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402

import witcert  # noqa: E402
import witcert.vllm as wv  # noqa: E402
import witcert.vllm.backend as backend  # noqa: E402
from witcert.vllm.layouts import element_dtype, read_slots  # noqa: E402

pytestmark = needs_fp8
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
PROMPTS = ["The capital of France is",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           # A prompt over several blocks of 32 (the tests' block size).
           " ".join(f"Item {i}: the {w} box holds {i * 7 % 13} marbles." for i, w in
                    enumerate(["red", "blue", "green", "tall", "small", "old", "new", "wide"] * 2)) +
           " Which box holds the most marbles?"]


def make_llm(kv_cache_dtype="fp8", dtype="float32", witcert=None, **kw):
    if not MODEL.is_dir():
        pytest.fail(f"{MODEL} is missing: scripts/vllm-test.sh writes it (tools/gguf_to_hf.py)")
    extra = {} if witcert is None else {"kv_transfer_config": wv.kv_transfer_config(**witcert)}
    return LLM(model=str(MODEL), dtype=dtype, kv_cache_dtype=kv_cache_dtype, enforce_eager=True, max_model_len=512,
               enable_prefix_caching=False, kv_cache_memory_bytes=64 << 20, block_size=32,
               distributed_executor_backend="uni", max_logprobs=-1, seed=0, **extra, **kw)


@contextlib.contextmanager
def engine(**kw):
    """An LLM (make_llm's arguments), shut down on leaving, whatever happened: vLLM freezes its
    objects out of the collector, so a dropped LLM would tear down the distributed state later,
    under the next one."""
    llm = make_llm(**kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


class Watch:
    """Every decode cell vLLM's steps meter, with the exact and stored keys of its request up to it."""

    def __init__(self, monkeypatch):
        self.cells = []  # (meter, raw, q (h, d), keys (pos+1, kvh, d), stored keys (pos+1, kvh, d))
        self.seqs = {}  # (first block, layer) -> {pos: (k, k_hat)}
        real_certify, real_decode = backend.WitCertCPUImpl._certify, backend._witcert.vllm_decode
        watch = self
        last = {}

        def vllm_decode(*args):
            out = real_decode(*args)
            last["cells"] = out[1]
            return out

        def certify(impl, state, layer, query, key, value, kv_cache, meta, output):
            real_certify(impl, state, layer, query, key, value, kv_cache, meta, output)
            watch.record(impl, layer, query, key, kv_cache, meta, last.get("cells"))
            last.clear()

        monkeypatch.setattr(backend.WitCertCPUImpl, "_certify", certify)
        monkeypatch.setattr(backend._witcert, "vllm_decode", vllm_decode)

    def record(self, impl, layer, query, key, kv_cache, meta, cells):
        index = int(layer.layer_name.split(".")[2])
        n = meta.num_actual_tokens
        elem = element_dtype(impl.kv_cache_dtype, query.dtype)
        k_hat, _ = read_slots(kv_cache, meta.slot_mapping[:n], layer.isa, elem, layer._k_scale_float,
                              layer._v_scale_float)
        k = key[:n].reshape(n, KV_HEADS, HEAD_DIM).float()
        starts, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        decode = 0
        for r in range(len(lens)):
            t0, t1 = starts[r], starts[r + 1]
            seq = self.seqs.setdefault((int(meta.block_table[r, 0]), index), {})
            for i, t in enumerate(range(t0, t1)):
                seq[lens[r] - (t1 - t0) + i] = (k[t].clone(), k_hat[t].clone())
            if t1 - t0 == 1:
                pos = lens[r] - 1
                keys = torch.stack([seq[p][0] for p in range(pos + 1)])
                stored = torch.stack([seq[p][1] for p in range(pos + 1)])
                q = query[t0].reshape(Q_HEADS, HEAD_DIM).float().clone()
                self.cells.append((cells["meter"][decode, :, 0].copy(), cells["raw"][decode, :, 0].copy(), q, keys,
                                   stored))
                decode += 1


def softmax64(z):
    z = z - z.max(dim=-1, keepdim=True).values
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)


def test_every_decode_cell_is_sound_and_is_witcerts_own_meter(monkeypatch):
    watch = Watch(monkeypatch)
    with engine(witcert={"check_soundness": True}) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for o in outs:
        r = wv.report(o)
        assert r["cells"] == 5 * LAYERS * Q_HEADS
        assert r["soundness_checked"] == r["cells"] and r["soundness_violations"] == 0
        assert r["kv"] == "vllm-fp8" and r["gate"] is None and r["verdict"] in ("at-risk", "certified")
    assert len(watch.cells) == len(PROMPTS) * 5 * LAYERS
    group, sm = Q_HEADS // KV_HEADS, 1 / math.sqrt(HEAD_DIM)
    worst, checked = 0.0, 0
    for meter, raw, q, keys, stored in watch.cells:
        kk = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)   # (h, t, d)
        kh = stored.double().repeat_interleave(group, dim=1).transpose(0, 1)
        qd = q.double().unsqueeze(2)
        p = softmax64((kk @ qd).squeeze(2) * sm)
        p_tilde = softmax64((kh @ qd).squeeze(2) * sm)
        tv = 0.5 * (p - p_tilde).abs().sum(dim=1).numpy()
        assert (tv <= meter * (1 + 1e-9) + 1e-12).all(), (tv, meter)
        worst = max(worst, float((tv / np.maximum(meter, 1e-300)).max()))
        checked += len(tv)
        # WitCert's own meter from the same keys through the tensor API: the witness of what vLLM
        # stored against the exact keys as the store keeps them (fp16), at the cell's queries. The
        # fused kernel's meter is the minimum of the one-pass forms (all but the retention form).
        w = witcert.witness(stored.transpose(0, 1).contiguous(), keys.half().float().transpose(0, 1).contiguous(),
                            layout="neox")
        c = witcert.tier_a_bounds(q.unsqueeze(0), np.ascontiguousarray(w[None]), sm, layout="neox")[0]
        z = (kh @ q.double().unsqueeze(2)).squeeze(2) * sm
        own = witcert.meters(z.numpy(), c)
        np.testing.assert_allclose(raw, own.eform, rtol=1e-9)
        one_pass = np.minimum.reduce([own.eform, own.two_sided, own.tanh, own.tanh_half, np.ones_like(meter)])
        np.testing.assert_allclose(meter, one_pass, rtol=1e-9)
        assert (own.meter <= meter * (1 + 1e-12)).all()
    assert checked == len(PROMPTS) * 5 * LAYERS * Q_HEADS
    assert 0 < worst <= 1


def test_the_gate_moves_the_logits_toward_the_exact_cache():
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=-1, ignore_eos=True)
    runs = {}
    for name, kv, opts in (("exact", "auto", None), ("raw", "fp8", None),
                           ("gated", "fp8", {"tau_k": 0.2, "check_soundness": True})):
        with engine(kv_cache_dtype=kv, witcert=opts) as llm:
            runs[name] = llm.generate(PROMPTS, params)
    kl = {"raw": [], "gated": []}
    for i in range(len(PROMPTS)):
        exact = runs["exact"][i].outputs[0]
        for name in kl:
            out = runs[name][i].outputs[0]
            # Decode steps (the first token comes from the prompt's pass) while the tokens still agree.
            for step in range(1, len(exact.token_ids)):
                if out.token_ids[:step] != exact.token_ids[:step]:
                    break
                lp = np.array([exact.logprobs[step][t].logprob for t in range(len(exact.logprobs[step]))])
                lq = np.array([out.logprobs[step][t].logprob for t in range(len(out.logprobs[step]))])
                kl[name].append(float(np.sum(np.exp(lp) * (lp - lq))))
        g = wv.report(runs["gated"][i])
        assert g["coverage"]["k"] == 1.0 and g["soundness_violations"] == 0 and g["page_ins"] > 0
        assert g["verdict"] == "repaired"
    assert len(kl["gated"]) >= 10 and len(kl["raw"]) >= 10
    assert np.mean(kl["gated"]) <= np.mean(kl["raw"]), kl
    assert np.mean(kl["raw"]) > 1e-6  # fp8 moves the logits at all


def test_every_request_gets_its_own_report_in_a_batch():
    lengths = [2, 5, 9, 3]
    prompts = PROMPTS + ["Once upon a time"]
    with engine(witcert={"tau_k": 0.3, "granularity": "head"}) as llm:
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
    for n, o in zip(lengths, outs):
        r = wv.report(o)
        assert r["cells"] == (n - 1) * LAYERS * Q_HEADS
        assert r["gate"]["tau_k"] == 0.3 and r["gate"]["granularity"] == "head"
        assert r["coverage"]["k"] == 1.0


def test_an_exact_cache_is_certified_and_a_plain_engine_has_no_report():
    with engine(kv_cache_dtype="auto", witcert={}) as llm:
        r = wv.report(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0])
    # The store keeps exact keys in fp16, so vLLM's float32 keys read a small meter, not 0.
    assert r["kv"] == "vllm-auto" and r["cells"] == 3 * LAYERS * Q_HEADS
    assert 0 <= r["raw_max"] < 0.05 and r["certified"] is True and r["verdict"] == "certified"
    with engine() as llm:
        assert wv.report(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0]) is None


@pytest.mark.parametrize("options,message", [({"tau": 0.2}, "unknown option"), ({"tau_k": -1}, "tau_k"),
                                             ({"granularity": "page"}, "granularity")])
def test_impossible_options_are_refused_naming_them(options, message):
    with pytest.raises(Exception, match=message):
        make_llm(witcert=options)
    cleanup_dist_env_and_memory()


def test_prefix_caching_is_refused():
    with pytest.raises(Exception, match="prefix caching"):
        LLM(model=str(MODEL), dtype="float32", kv_cache_dtype="fp8", enforce_eager=True, max_model_len=256,
            kv_cache_memory_bytes=32 << 20, distributed_executor_backend="uni", enable_prefix_caching=True,
            kv_transfer_config=wv.kv_transfer_config())
    cleanup_dist_env_and_memory()


def test_preempted_requests_are_recomputed_into_fresh_mirrors_and_keep_one_report():
    """A cache too small for four requests at once: vLLM preempts some and recomputes them later.
    Each recompute starts a fresh mirror (its prompt pass writes, unmetered) and the request keeps
    its one report: sound, within τ, one decode step fewer per preemption."""
    llm = LLM(model=str(MODEL), dtype="float32", kv_cache_dtype="fp8", enforce_eager=True, max_model_len=128,
              enable_prefix_caching=False, kv_cache_memory_bytes=2 << 20, block_size=32,
              distributed_executor_backend="uni", seed=0,
              kv_transfer_config=wv.kv_transfer_config(tau_k=0.2, check_soundness=True))
    try:
        prompts = ["Tell me a long story about a dragon and a knight.", "List the planets of the solar system.",
                   "Write a poem about the sea and the wind.", "Explain how a bicycle works in detail."]
        outs = llm.generate(prompts, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()
    steps = []
    for o in outs:
        r = wv.report(o)
        assert len(o.outputs[0].token_ids) == 80
        assert r["cells"] % (LAYERS * Q_HEADS) == 0 and r["soundness_violations"] == 0
        assert r["coverage"]["k"] == 1.0 and r["soundness_checked"] == r["cells"]
        steps.append(r["cells"] // (LAYERS * Q_HEADS))
    assert all(70 <= s <= 79 for s in steps), steps
    assert min(steps) < 79, steps  # some request was preempted and recomputed
