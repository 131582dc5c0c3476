"""What vLLM's CPU attention stored: the keys and values of given slots, read back from its cache.

vLLM's CPU cache is ``[num_blocks, kv_heads, block_size, 2·head_dim]``, each (block, KV head) holding
``block_size·head_dim`` key elements and then as many value elements, in an order its attention
kernel chooses per instruction set (``layer.isa``) and does not export. One function per order:

- ``vec`` (AVX-512/AVX2 without AMX, and any model dtype other than bfloat16): keys channel-major
  ``[head_dim][block_size]``, values token-major ``[block_size][head_dim]``.
- ``amx`` (bfloat16 models where AMX tiles are usable): keys in tiles of 16 tokens with channel pairs
  interleaved, ``[block_size/16][head_dim/2][16][2]``; values in channel tiles of 16 with token pairs
  interleaved, ``[head_dim/16][block_size/2][16][2]``.

Elements are the model's dtype, or one byte of fp8 (e4m3 or e5m2) times the layer's scale. The
values returned are what vLLM's kernel reads: the witness is computed from them, because vLLM's fp8
rounding is not torch's. ``tests/test_vllm.py`` guards each order against vLLM's own attention, so
a vLLM release that changes one fails there rather than metering the wrong numbers.
"""
from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "read_slots", "element_dtype"]

LAYOUTS = ("vec", "amx")

_FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def element_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of one stored element under vLLM's ``kv_cache_dtype`` ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FP8:
        return _FP8[kv_cache_dtype]
    raise ValueError(f"witcert: vLLM's kv_cache_dtype {kv_cache_dtype!r} has no reader here "
                     f"(known: auto, {', '.join(_FP8)})")


def _inner(isa: str, bs: int, d: int) -> torch.Tensor:
    """Where element c of the token at offset `off` of a block sits within its (block, KV head):
    ``[block_size, 2, head_dim]``, keys then values (the values after the block's keys)."""
    off = torch.arange(bs).view(bs, 1)
    c = torch.arange(d).view(1, d)
    if isa == "vec":
        k = c * bs + off
        v = off * d + c
    else:
        if bs % 16 or d % 16:
            raise NotImplementedError(f"witcert: the amx layout needs block_size and head_dim multiples of 16, "
                                      f"got {bs} and {d}")
        k = (off // 16) * (16 * d) + (c // 2) * 32 + (off % 16) * 2 + c % 2
        v = (c // 16) * (bs * 16) + (off // 2) * 32 + (c % 16) * 2 + off % 2
    return torch.stack([k, v + bs * d], dim=1)


_INNER: dict = {}


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor, isa: str, elem: torch.dtype, k_scale: float,
               v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values (float32, ``[len(slots), kv_heads, head_dim]``) vLLM stored at ``slots``.

    ``kv_cache`` is one layer's cache tensor as vLLM allocated it, ``isa`` the layout vLLM's CPU
    attention chose for the layer, ``elem`` the element dtype (:func:`element_dtype`). One gather
    reads every element: its index is the (block, KV head)'s start plus the layout's place for it.
    """
    if isa not in LAYOUTS:
        raise NotImplementedError(f"witcert: vLLM's CPU cache layout {isa!r} has no reader here "
                                  f"(known: {', '.join(LAYOUTS)})")
    nb, kvh, bs, two_d = kv_cache.shape
    d = two_d // 2
    key = (isa, bs, d)
    inner = _INNER.get(key)
    if inner is None:
        inner = _INNER[key] = _inner(isa, bs, d)
    raw = kv_cache.view(elem) if kv_cache.dtype != elem else kv_cache
    slots = slots.to(torch.long)
    start = ((slots // bs).unsqueeze(1) * kvh + torch.arange(kvh).unsqueeze(0)) * (2 * bs * d)  # (n, kv_heads)
    index = start.view(-1, kvh, 1, 1) + inner[slots % bs].unsqueeze(1)  # (n, kv_heads, 2, d)
    kv = raw.reshape(-1)[index].to(torch.float32)
    k, v = kv[:, :, 0], kv[:, :, 1]
    if k_scale != 1.0:
        k = k * k_scale
    if v_scale != 1.0:
        v = v * v_scale
    return k.contiguous(), v.contiguous()
