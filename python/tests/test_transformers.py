"""witcert.transformers on SmolLM2 loaded through transformers' GGUF loader: the plain cache generates
what transformers' own attention generates; every format is sound in every decode cell; the cells
are the C++ cache's own on the same keys and queries; the gate moves the logits toward the exact
cache's; and what the integration does not run is refused, never silently wrong.

scripts/python-test.sh installs torch and transformers (scripts/install-transformers.sh) and sets
WITCERT_REQUIRE_TRANSFORMERS=1, so that there a missing install fails instead of skipping."""
import os

import numpy as np
import pytest

if os.environ.get("WITCERT_REQUIRE_TRANSFORMERS") == "1":
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

import witcert
import witcert.transformers as wt
from witcert import _witcert
from transformers.integrations.sdpa_attention import sdpa_attention_forward

MODEL = os.environ.get("WITCERT_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea, there lived"]
# Every built-in --kv format (`witcert schemes`).
FORMATS = ["fp8-e4m3", "fp8-e4m3-scaled", "rtn-int8", "rtn-int4", "rtn-2bit", "sign-1bit", "rot-4bit", "kivi-2bit",
           "kvquant-4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "dither-int4", "dither-int5", "dither-int6",
           "dither-int8"]


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    directory, name = os.path.split(os.path.abspath(MODEL))
    m = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok.padding_side = "left"
    return m, tok


def fp16_reference(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa over keys and values rounded to fp16, what the plain cache stores."""
    return sdpa_attention_forward(module, query, key.half().float(), value.half().float(), attention_mask, **kwargs)


def fp64_reference(module, query, key, value, attention_mask, **kwargs):
    """The same attention in float64: the truth both float32 attentions approximate."""
    out, _ = sdpa_attention_forward(module, query.double(), key.half().double(), value.half().double(),
                                    attention_mask, **kwargs)
    return out.float(), None


def generate(m, inputs, cache=None, **kw):
    with torch.no_grad():
        return m.generate(**inputs, max_new_tokens=kw.pop("new", 10), do_sample=False, cache=cache,
                          output_logits=True, return_dict_in_generate=True, **kw)


def test_the_plain_cache_generates_what_transformers_generates(model):
    m, tok = model
    assert m.config._attn_implementation == "sdpa"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)  # left-padded rows
    ref = generate(m, batch)
    with wt.CertifiedCache(m) as cache:
        assert m.config._attn_implementation == "witcert"
        got = generate(m, batch, cache)
        report = cache.report()
    assert m.config._attn_implementation == "sdpa"  # close() gave it back
    assert torch.equal(ref.sequences, got.sequences)
    assert [r["verdict"] for r in report.rows] == ["unmetered"] * 3
    # Logits, against attention over the same fp16 keys and values computed in float64. This model
    # amplifies float32 rounding in attention (a few ulps) to some 3e-3 in its logits, sdpa's as
    # much as ours, so the bound is sdpa's own distance from float64, doubled, plus 1e-4.
    for name, fn in (("fp16_reference", fp16_reference), ("fp64_reference", fp64_reference)):
        transformers.AttentionInterface.register(name, fn)
        transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS.register(name, transformers.masking_utils.sdpa_mask)
    try:
        for prompt in PROMPTS:
            one = tok([prompt], return_tensors="pt")
            m.set_attn_implementation("fp64_reference")
            truth = generate(m, one)
            m.set_attn_implementation("fp16_reference")
            sdpa = generate(m, one)
            with wt.CertifiedCache(m) as cache:
                mine = generate(m, one, cache)
            assert torch.equal(truth.sequences, mine.sequences)
            floor = max((a - b).abs().max().item() for a, b in zip(truth.logits, sdpa.logits))
            worst = max((a - b).abs().max().item() for a, b in zip(truth.logits, mine.logits))
            assert worst <= 2 * floor + 1e-4, f"{prompt!r}: {worst} from float64, sdpa {floor}"
    finally:
        m.set_attn_implementation("sdpa")


@pytest.mark.parametrize("kv", FORMATS)
def test_every_format_is_sound_in_every_decode_cell(model, kv):
    m, tok = model
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    new = 6
    options = {"kv_v": kv} if kv.startswith("dither") else {}
    with wt.CertifiedCache(m, kv=kv, check_soundness=True, **options) as cache:
        generate(m, batch, cache, new=new)
        report = cache.report()
    cells = (new - 1) * m.config.num_hidden_layers * m.config.num_attention_heads
    for row in report.rows:
        assert row["kv"] == kv and row["cells"] == cells
        assert row["soundness_checked"] == cells
        assert row["soundness_violations"] == 0, row["reason"]
    assert report.cells.sum() == 3 * cells and report.cells.shape == (30, 9)
    assert np.all(report.meter_mean[report.cells > 0] <= 1.0)


def test_the_cells_are_the_cpp_caches_own(model, monkeypatch):
    """The batch's cells, replayed row by row into plain witcert.Cache objects: the same bits."""
    m, tok = model
    calls = []
    write, attend = _witcert.write_batch, _witcert.attend_batch

    def record_write(caches, layer, pos0, k, v):
        calls.append(("write", layer, pos0, k.copy(), v.copy()))
        return write(caches, layer, pos0, k, v)

    def record_attend(caches, layer, q, pos0, begins, window):
        out, cells = attend(caches, layer, q, pos0, begins, window)
        calls.append(("attend", layer, pos0, q.copy(), list(begins), window, out, cells))
        return out, cells

    monkeypatch.setattr(_witcert, "write_batch", record_write)
    monkeypatch.setattr(_witcert, "attend_batch", record_attend)
    batch = tok(PROMPTS[:2], return_tensors="pt", padding=True)  # the first row is left-padded
    options = dict(kv="dither-int8", kv_v="q4_0", tau_k=0.1)
    with wt.CertifiedCache(m, **options) as cache:
        generate(m, batch, cache, new=4)
        capacity = cache.capacity
    monkeypatch.undo()
    assert len(calls) == 2 * 30 * 4
    for b in range(2):
        replay = witcert.Cache(30, 9, 3, 64, capacity, layout="neox", **options)
        for c in calls:
            if c[0] == "write":
                replay.write_rows(c[1], c[2], c[3][b], c[4][b])
                continue
            out, cells = replay.attend_rows(c[1], c[3][b], c[2], c[4][b], c[5])
            assert np.array_equal(out.transpose(1, 0, 2), c[6][b])
            for f in ("raw", "meter", "v_meter", "output_bound", "repaired"):
                assert np.array_equal(getattr(cells, f), c[7][f][b]), f
    assert any(c[4][0] > 0 for c in calls if c[0] == "attend")  # the padding was passed as begin


def teacher_forced_logits(m, ids, prompt_len, cache):
    """The next-token logits of every continuation position, fed one token at a time."""
    with torch.no_grad():
        out = m(ids[:, :prompt_len], cache=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for p in range(prompt_len, ids.shape[1] - 1):
            logits.append(m(ids[:, p:p + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.log_softmax(torch.cat(logits).double(), dim=-1)


def test_the_gate_moves_the_logits_toward_the_exact_caches(model):
    m, tok = model
    text = ("The lighthouse keeper wrote the code 7391 in his notebook before the storm. Many hours later, "
            "when the ship's captain asked for it, he read out the code:")
    prompt = tok([text], return_tensors="pt").input_ids
    with wt.CertifiedCache(m) as exact_cache:
        cont = generate(m, {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}, exact_cache, new=16)
    ids = cont.sequences
    with wt.CertifiedCache(m) as c:
        exact = teacher_forced_logits(m, ids, prompt.shape[1], c)
    compared = 0
    for kv in FORMATS:
        kls = {}
        for tau in (None, 0.2):
            with wt.CertifiedCache(m, kv=kv, kv_v=kv, tau_k=tau, tau_v=0.05 if tau else None) as c:
                lp = teacher_forced_logits(m, ids, prompt.shape[1], c)
            kls[tau] = (exact.exp() * (exact - lp)).sum(dim=-1).mean().item()
        if kls[None] > 1e-3:
            compared += 1
            assert kls[0.2] <= kls[None], f"{kv}: gated KL {kls[0.2]} above raw {kls[None]}"
    assert compared >= 5  # the damaging formats do damage here, so the check compares something


def test_what_it_does_not_run_is_refused(model):
    m, tok = model
    right = tok(PROMPTS, return_tensors="pt", padding=True)
    right["attention_mask"] = right["attention_mask"].flip(1)  # right padding
    right["input_ids"] = right["input_ids"].flip(1)
    with wt.CertifiedCache(m, kv="q4_0") as cache:
        with pytest.raises(ValueError, match="left padding"):
            generate(m, right, cache)
    with wt.CertifiedCache(m, kv="q4_0") as cache:
        with pytest.raises(NotImplementedError, match="rows"):
            generate(m, tok(PROMPTS[:1], return_tensors="pt"), cache, num_beams=2)
    one = tok(PROMPTS[:1], return_tensors="pt")
    with wt.CertifiedCache(m, capacity=8) as cache:
        with pytest.raises(IndexError, match="capacity 8"):
            generate(m, one, cache, new=20)
    # The witcert attention without its cache.
    m.set_attn_implementation("witcert")
    try:
        with pytest.raises(RuntimeError, match="CertifiedCache"):
            generate(m, one)
    finally:
        m.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="kv"):
        wt.CertifiedCache(m, kv="q3_9")
    with pytest.raises(ValueError, match="tau_k"):
        wt.CertifiedCache(m, kv="q4_0", tau_k=-1)
    assert m.config._attn_implementation == "sdpa"


def tiny(kind, window):
    """A small random model of a family with sliding-window layers, windows of `window` positions."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, sliding_window=window)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**common)).eval()
    config = Gemma3TextConfig(**common, head_dim=64, query_pre_attn_scalar=48,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"])
    return Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_sliding_window_layers_attend_within_their_window(kind):
    m = tiny(kind, window=5)
    ids = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second row is left-padded
    inputs = {"input_ids": ids, "attention_mask": mask}
    ref = generate(m, inputs, new=12)
    with wt.CertifiedCache(m, capacity=64) as cache:
        mine = generate(m, inputs, cache, new=12)
    assert torch.equal(ref.sequences, mine.sequences)
    worst = max((a - b).abs().max().item() for a, b in zip(ref.logits, mine.logits))
    assert worst < 1e-3, worst  # fp16 keys and values against float32 ones, on a small random model
    with wt.CertifiedCache(m, kv="q4_0", tau_k=0.2, check_soundness=True, capacity=64) as cache:
        generate(m, inputs, cache, new=6)
        rows = cache.report().rows
    assert all(r["soundness_violations"] == 0 and r["cells"] == 5 * 4 * 4 for r in rows)
    if kind == "gemma3":  # a window the mask and the layer disagree on is refused
        for layer in m.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 7
        with wt.CertifiedCache(m, capacity=64) as cache, pytest.raises(ValueError, match="window"):
            generate(m, inputs, cache, new=2)


def test_gemma3_generates_what_transformers_generates():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = os.environ.get("WITCERT_GEMMA", os.path.join(os.path.dirname(os.path.abspath(MODEL)),
                                                        "gemma-3-270m-q4_k_m.gguf"))
    directory, name = os.path.split(path)
    m = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    one = tok(["The capital of France is"], return_tensors="pt")
    ref = generate(m, one, new=8)
    with wt.CertifiedCache(m) as cache:
        mine = generate(m, one, cache, new=8)
    assert torch.equal(ref.sequences, mine.sequences)
    with wt.CertifiedCache(m, kv="q4_0", kv_v="q8_0", check_soundness=True) as cache:
        generate(m, one, cache, new=5)
        row = cache.report().rows[0]
    assert row["cells"] == 4 * m.config.num_hidden_layers * m.config.num_attention_heads
    assert row["soundness_violations"] == 0 and row["soundness_checked"] == row["cells"]


def test_a_bfloat16_model_is_metered_soundly(model):
    m, tok = model
    m16 = m.to(torch.bfloat16)
    try:
        with wt.CertifiedCache(m16, kv="q4_0", tau_k=0.2, check_soundness=True) as cache:
            out = generate(m16, tok(PROMPTS[:1], return_tensors="pt"), cache, new=5)
            row = cache.report().rows[0]
        assert out.sequences.shape[1] > 5
        assert row["cells"] == 4 * 30 * 9 and row["soundness_violations"] == 0
    finally:
        m.to(torch.float32)


def rtn3_torch(x):
    """A 3-bit round-to-nearest per token, written in torch."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 3 + 1e-12
    return torch.clamp(torch.round(x / scale), -4, 3) * scale


def test_a_scheme_written_in_torch_is_metered_and_gated(model):
    m, tok = model
    given = set()
    witcert.register_scheme("rtn3-torch", lambda x: given.add(type(x)) or rtn3_torch(x))
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    new = 6
    cells = (new - 1) * 30 * 9
    reports = {}
    for tau in (None, 0.2):
        with wt.CertifiedCache(m, kv="rtn3-torch", tau_k=tau, check_soundness=True) as cache:
            generate(m, batch, cache, new=new)
            reports[tau] = cache.report()
    assert given == {torch.Tensor}  # the function is given torch tensors, as the model's keys are
    for tau, report in reports.items():
        for row in report.rows:
            assert row["kv"] == row["kv_v"] == "rtn3-torch"
            assert row["cells"] == row["soundness_checked"] == cells
            assert row["soundness_violations"] == 0, row["reason"]
    # Three bits damage the cache: the meter says so, and the gate repairs it to within τ_K.
    assert all(r["raw_max"] != 0 and r["coverage"]["k"] < 1 for r in reports[None].rows)
    for row in reports[0.2].rows:
        assert row["coverage"]["k"] == 1.0 and row["page_ins"] > 0


def test_the_transformers_example_runs():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "examples/python/transformers_generate.py", MODEL, "--tokens", "4"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    assert "verdict: " in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "KL" not in line]
    assert len(rows) == 9  # three prompts under three caches
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert 0.0 <= float(cells[2]) <= 1.0 and int(cells[3]) >= 0 and float(cells[4]) >= 0.0
