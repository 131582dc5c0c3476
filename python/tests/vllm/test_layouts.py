"""The guard on each vLLM CPU cache layout witcert.vllm reads: keys and values written by vLLM's own
op are read back where they were written, and the attention recomputed from what was read equals
vLLM's own attention over its cache, for every layout × element type × block size × head size. A
vLLM release that changes a layout fails here instead of metering the wrong numbers."""
import itertools

import pytest
from vllm_env import FP8

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402

from witcert import _witcert  # noqa: E402
from witcert.vllm.layouts import element_dtype, read_slots  # noqa: E402

# (isa, model dtype, kv_cache_dtype): vec runs any model dtype; amx is bfloat16's where AMX is usable.
CASES = [("vec", torch.float32, "auto"), ("vec", torch.float16, "auto"), ("vec", torch.bfloat16, "auto"),
         ("vec", torch.float32, "fp8"), ("vec", torch.bfloat16, "fp8_e5m2"), ("amx", torch.bfloat16, "auto"),
         ("amx", torch.bfloat16, "fp8")]


def _amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _skip_unsupported(isa, kv_dtype):
    if isa == "amx" and not _amx():
        pytest.skip("no usable AMX tiles on this CPU")
    if kv_dtype != "auto" and not FP8:
        pytest.skip("vLLM's fp8 KV cache on the CPU needs AVX-512 or AMX")


def _write(isa, dtype, kv_dtype, block_size, head_dim, kv_heads=2, blocks=5, tokens=97, seed=0, prefix=False):
    """Random keys (channel 3 an outlier) and values written by vLLM's op into `tokens` slots of a
    fresh cache, in random order: any slots, or (prefix) the first `tokens`."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.uint8 if kv_dtype != "auto" else dtype
    cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_dim, dtype=elem)
    view = cache.view(blocks, kv_heads, 2 * block_size, head_dim)
    key_cache, value_cache = view.chunk(2, dim=2)
    slots = torch.randperm(tokens if prefix else blocks * block_size, generator=g)[:tokens].to(torch.long)
    k = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 2).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    k[:, :, 3] *= 20  # an outlier channel, as real keys have
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype=kv_dtype)
    return cache, key_cache, value_cache, slots, k, v


@pytest.mark.parametrize("isa,dtype,kv_dtype", CASES)
@pytest.mark.parametrize("block_size,head_dim", list(itertools.product([32, 64, 128], [64, 128])))
def test_every_slot_reads_back_what_vllm_stored(isa, dtype, kv_dtype, block_size, head_dim):
    _skip_unsupported(isa, kv_dtype)
    cache, _, _, slots, k, v = _write(isa, dtype, kv_dtype, block_size, head_dim)
    kr, vr = read_slots(cache, slots, isa, element_dtype(kv_dtype, dtype), 1.0, 1.0)
    if kv_dtype == "auto":
        assert torch.equal(kr, k.float()) and torch.equal(vr, v.float())
    else:
        # fp8 by vLLM's own rounding, which is not torch's (it can miss the nearest by a step): an fp8
        # number within one step of the exact value.
        fp8 = element_dtype(kv_dtype, dtype)
        mantissa = 3 if fp8 == torch.float8_e4m3fn else 2
        for got, want in ((kr, k.float()), (vr, v.float())):
            assert torch.equal(got.to(fp8).float(), got)
            step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=2.0 ** -6))) - mantissa)
            assert bool(((got - want).abs() <= step * (1 + 1e-6)).all())


@pytest.mark.parametrize("isa,dtype,kv_dtype", CASES)
@pytest.mark.parametrize("block_size,head_dim", [(32, 64), (128, 128)])
def test_attention_over_what_was_read_is_vllms_attention(isa, dtype, kv_dtype, block_size, head_dim):
    _skip_unsupported(isa, kv_dtype)
    kv_heads, q_heads, blocks = 2, 6, 5
    tokens = blocks * block_size - 3
    cache, key_cache, value_cache, slots, _, _ = _write(isa, dtype, kv_dtype, block_size, head_dim, kv_heads, blocks,
                                                        tokens, seed=1, prefix=True)
    # One decode query over the request whose blocks hold the slots in order.
    q = torch.randn(1, q_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    seq_lens = torch.tensor([tokens], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    scale = head_dim ** -0.5
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=q_heads, num_kv_heads=kv_heads,
                                               head_dim=head_dim, seq_lens=seq_lens, dtype=dtype,
                                               query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
                                               enable_kv_split=False, kv_cache_dtype=kv_dtype)
    out = torch.zeros(1, q_heads, head_dim, dtype=dtype)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=qsl, seq_lens=seq_lens, scale=scale, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None, k_scale=1.0, v_scale=1.0,
                                    kv_cache_dtype=kv_dtype)
    kr, vr = read_slots(cache, torch.arange(tokens), isa, element_dtype(kv_dtype, dtype), 1.0, 1.0)
    group = q_heads // kv_heads
    kk = kr.double().repeat_interleave(group, dim=1)  # (tokens, q_heads, d)
    vv = vr.double().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,thd->ht", q[0].double(), kk) * scale, dim=-1)
    ref = torch.einsum("ht,thd->hd", w, vv)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 6e-2}[dtype]  # the kernel works in dtype
    assert float((out[0].double() - ref).abs().max()) <= tol * float(ref.abs().max())
    # A reader with the other layout does not pass: the check can fail.
    other = "amx" if isa == "vec" else "vec"
    kw, vw = read_slots(cache, torch.arange(tokens), other, element_dtype(kv_dtype, dtype), 1.0, 1.0)
    w2 = torch.softmax(torch.einsum("hd,thd->ht", q[0].double(), kw.double().repeat_interleave(group, 1)) * scale, -1)
    wrong = torch.einsum("ht,thd->hd", w2, vw.double().repeat_interleave(group, 1))
    assert float((out[0].double() - wrong).abs().max()) > tol * float(ref.abs().max())


def test_unknown_layouts_and_cache_types_are_refused():
    cache = torch.zeros(2, 1, 32, 128)
    with pytest.raises(NotImplementedError, match="vec16"):
        read_slots(cache, torch.tensor([0]), "vec16", torch.float32, 1.0, 1.0)
    with pytest.raises(ValueError, match="int8"):
        element_dtype("int8", torch.float32)


@pytest.mark.parametrize("isa,dtype,kv_dtype", CASES)
@pytest.mark.parametrize("block_size,head_dim", list(itertools.product([32, 64, 128], [64, 128])))
def test_the_cpp_reader_is_the_reference_element_for_element(isa, dtype, kv_dtype, block_size, head_dim):
    """witcert.vllm's decode path reads with the C++ reader; layouts.read_slots is its reference."""
    _skip_unsupported(isa, kv_dtype)
    cache, _, _, slots, _, _ = _write(isa, dtype, kv_dtype, block_size, head_dim, seed=3)
    elem = element_dtype(kv_dtype, dtype)
    for scales in ((1.0, 1.0), (0.37, 2.5)):
        kr, vr = read_slots(cache, slots, isa, elem, *scales)
        kc, vc = _witcert.read_stored(cache.view(torch.uint8).reshape(-1).numpy(), [*cache.shape[:3], head_dim],
                                      str(elem).removeprefix("torch."), isa, slots.numpy(), *scales)
        assert torch.equal(torch.from_numpy(kc), kr) and torch.equal(torch.from_numpy(vc), vr)


def test_the_cpp_reader_refuses_what_it_cannot_read():
    cache = torch.zeros(2, 1, 32, 128)
    raw = cache.view(torch.uint8).reshape(-1).numpy()
    slots = np.array([0, 63], dtype=np.int64)
    with pytest.raises(ValueError, match="vec16"):
        _witcert.read_stored(raw, [2, 1, 32, 64], "float32", "vec16", slots, 1.0, 1.0)
    with pytest.raises(ValueError, match="int8"):
        _witcert.read_stored(raw, [2, 1, 32, 64], "int8", "vec", slots, 1.0, 1.0)
    with pytest.raises(ValueError, match="bytes"):
        _witcert.read_stored(raw, [2, 1, 32, 64], "float16", "vec", slots, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"slots\[1\]"):
        _witcert.read_stored(raw, [2, 1, 32, 64], "float32", "vec", np.array([0, 64], dtype=np.int64), 1.0, 1.0)
    with pytest.raises(ValueError, match="amx"):
        _witcert.read_stored(torch.zeros(2, 1, 24, 128).view(torch.uint8).reshape(-1).numpy(), [2, 1, 24, 64],
                             "float32", "amx", slots[:1], 1.0, 1.0)
    # fp8's special bytes decode as the formats say: e4m3 has no infinity (0x7F is NaN), e5m2 does.
    b = torch.tensor([0x7F, 0x7C, 0x01, 0xFE], dtype=torch.uint8)
    k4, _ = _witcert.read_stored(np.tile(b.numpy(), 2 * 16)[:128].copy(), [1, 1, 1, 64], "float8_e4m3fn", "vec",
                                 np.array([0], dtype=np.int64), 1.0, 1.0)
    want = b.view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(k4[0, 0, :4], want)
    k5, _ = _witcert.read_stored(np.tile(b.numpy(), 2 * 16)[:128].copy(), [1, 1, 1, 64], "float8_e5m2", "vec",
                                 np.array([0], dtype=np.int64), 1.0, 1.0)
    np.testing.assert_array_equal(k5[0, 0, :4], b.view(torch.float8_e5m2).float().numpy())
