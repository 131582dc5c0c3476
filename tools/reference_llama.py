#!/usr/bin/env python3
"""An independent forward pass in numpy, to hold `witcert logits` against, for every architecture
WitCert runs: llama (Llama 2/3, Mistral, SmolLM), qwen2 (QKV bias), qwen3 (q/k norm) and gemma3
(GeGLU, q/k norm, post-norms, √d embedding scale, sliding-window layers with their own RoPE base).

It reads the GGUF with the `gguf` package (its own reader and dequantizers), runs the equations in
float64 with keys and values rounded to fp16 (as WitCert's exact tier stores them), and compares
the next-token logits after the prompt's token ids with WitCert's.

    pip install gguf numpy
    build/witcert logits --prompt "The capital of France is" --top 10 > /tmp/w.json
    python3 tools/reference_llama.py models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/w.json
"""
import json
import math
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key, default=None):
    if key not in reader.fields:
        return default
    f = reader.fields[key]
    if f.types and f.types[0].name == "STRING":
        return bytes(f.parts[-1]).decode()
    return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else [f.parts[i].tolist()[0] for i in f.data]


def reference_logits(model_path, tokens):
    """The next-token logits after `tokens`, in float64."""
    r = GGUFReader(model_path)
    arch = field(r, "general.architecture")
    assert arch in ("llama", "qwen2", "qwen3", "gemma3"), arch
    a = arch + "."
    L = field(r, a + "block_count")
    d = field(r, a + "embedding_length")
    H = field(r, a + "attention.head_count")
    KV = field(r, a + "attention.head_count_kv", H)
    theta = field(r, a + "rope.freq_base", 10000.0)
    eps = field(r, a + "attention.layer_norm_rms_epsilon", 1e-5)
    hd = field(r, a + "attention.key_length", d // H)
    softcap = field(r, a + "final_logit_softcapping", 0.0)
    gemma = arch == "gemma3"
    period = field(r, a + "attention.sliding_window_pattern", 6) if gemma else 0
    window = field(r, a + "attention.sliding_window", 0) if gemma else 0
    tensors = {t.name: t for t in r.tensors}

    def W(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(x) for x in reversed(t.shape)])

    def has(name):
        return name in tensors

    embd = W("token_embd.weight")
    out_w = W("output.weight") if has("output.weight") else embd
    x = embd[tokens]  # n × d
    if gemma:
        x = x * np.float64(np.float32(math.sqrt(d)))
    n = len(tokens)
    pos = np.arange(n)
    factors = W("rope_freqs.weight") if has("rope_freqs.weight") else np.ones(hd // 2)

    def rope_tables(base):
        inv = base ** (-2.0 * np.arange(hd // 2) / hd) / factors
        ang = pos[:, None] * inv[None, :]
        return np.cos(ang), np.sin(ang)

    def rope(v, tables):  # v: n × heads × hd
        cos, sin = tables
        if arch == "llama":  # adjacent pairs (GGML "normal")
            lo, hi = np.s_[..., 0::2], np.s_[..., 1::2]
        else:  # NeoX halves
            lo, hi = np.s_[..., : hd // 2], np.s_[..., hd // 2:]
        a_, b_ = v[lo].copy(), v[hi].copy()
        v[lo] = a_ * cos[:, None, :] - b_ * sin[:, None, :]
        v[hi] = a_ * sin[:, None, :] + b_ * cos[:, None, :]
        return v

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    global_rope, local_rope = rope_tables(theta), rope_tables(10000.0)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    # A sliding-window layer's query i sees key j while i - j < window.
    local_mask = np.where(pos[:, None] - pos[None, :] >= window, -np.inf, mask) if window else mask
    for l in range(L):
        p = f"blk.{l}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = h @ W(p + "attn_q.weight").T
        k = h @ W(p + "attn_k.weight").T
        v = h @ W(p + "attn_v.weight").T
        if arch == "qwen2":
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        q, k, v = q.reshape(n, H, hd), k.reshape(n, KV, hd), v.reshape(n, KV, hd)
        if arch in ("qwen3", "gemma3"):
            q, k = norm(q, W(p + "attn_q_norm.weight")), norm(k, W(p + "attn_k_norm.weight"))
        local = gemma and l % period != period - 1
        tables = local_rope if local else global_rope
        q, k = rope(q, tables), rope(k, tables)
        k = k.astype(np.float16).astype(np.float64)
        v = v.astype(np.float16).astype(np.float64)
        att = np.zeros((n, H, hd))
        for head in range(H):
            kv = head // (H // KV)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + (local_mask if local else mask)
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        o = att.reshape(n, H * hd) @ W(p + "attn_output.weight").T
        if gemma:
            o = norm(o, W(p + "post_attention_norm.weight"))
        x = x + o
        h = norm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        u = h @ W(p + "ffn_up.weight").T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        else:
            act = g / (1 + np.exp(-g))
        f = (act * u) @ W(p + "ffn_down.weight").T
        if gemma:
            f = norm(f, W(p + "post_ffw_norm.weight"))
        x = x + f
    logits = norm(x[-1], W("output_norm.weight")) @ out_w.T
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    return logits


def main(model_path, witcert_json):
    w = json.load(open(witcert_json))
    logits = reference_logits(model_path, w["prompt_tokens"])
    worst = 0.0
    for c in w["top"]:
        diff = abs(c["logit"] - logits[c["id"]])
        worst = max(worst, diff)
        print(f'{c["id"]:6d} {c["piece"]!r:14} witcert {c["logit"]:10.5f}  reference {logits[c["id"]]:10.5f}  |diff| {diff:.2e}')
    ref_top = list(np.argsort(-logits)[: len(w["top"])])
    same = ref_top == [c["id"] for c in w["top"]]
    print(f"top-{len(w['top'])} order identical: {same}; max |logit diff| {worst:.3e}; logit scale {np.abs(logits).max():.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
