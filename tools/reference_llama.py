#!/usr/bin/env python3
"""An independent llama forward pass in numpy, to hold `witcert logits` against.

It reads the GGUF with the `gguf` package (its own reader and dequantizers), runs the
equations in float64 with keys and values rounded to fp16 (as WitCert's exact tier stores
them), and compares the next-token logits after the prompt's token ids with WitCert's.

    pip install gguf numpy
    build/witcert logits --prompt "The capital of France is" --top 10 > /tmp/w.json
    python3 tools/reference_llama.py models/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/w.json
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key):
    f = reader.fields[key]
    return f.parts[f.data[0]].tolist()[0] if len(f.data) == 1 else [f.parts[i].tolist()[0] for i in f.data]


def main(model_path, witcert_json):
    r = GGUFReader(model_path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    assert arch == "llama", arch
    L = field(r, "llama.block_count")
    d = field(r, "llama.embedding_length")
    H = field(r, "llama.attention.head_count")
    KV = field(r, "llama.attention.head_count_kv")
    theta = field(r, "llama.rope.freq_base")
    eps = field(r, "llama.attention.layer_norm_rms_epsilon")
    hd = d // H
    tensors = {t.name: t for t in r.tensors}

    def W(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape([int(x) for x in reversed(t.shape)])

    w = json.load(open(witcert_json))
    tokens = w["prompt_tokens"]
    embd = W("token_embd.weight")
    out_w = W("output.weight") if "output.weight" in tensors else embd
    x = embd[tokens]  # n × d
    n = len(tokens)
    pos = np.arange(n)
    inv = theta ** (-2.0 * np.arange(hd // 2) / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(v):  # v: n × heads × hd, adjacent pairs (GGML "normal")
        a, b = v[..., 0::2].copy(), v[..., 1::2].copy()
        v[..., 0::2] = a * cos[:, None, :] - b * sin[:, None, :]
        v[..., 1::2] = a * sin[:, None, :] + b * cos[:, None, :]
        return v

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = norm(x, W(p + "attn_norm.weight"))
        q = rope((h @ W(p + "attn_q.weight").T).reshape(n, H, hd))
        k = rope((h @ W(p + "attn_k.weight").T).reshape(n, KV, hd))
        v = (h @ W(p + "attn_v.weight").T).reshape(n, KV, hd)
        k = k.astype(np.float16).astype(np.float64)
        v = v.astype(np.float16).astype(np.float64)
        att = np.zeros((n, H, hd))
        for head in range(H):
            kv = head // (H // KV)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(n, d) @ W(p + "attn_output.weight").T
        h = norm(x, W(p + "ffn_norm.weight"))
        g = h @ W(p + "ffn_gate.weight").T
        u = h @ W(p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ W(p + "ffn_down.weight").T
    logits = norm(x[-1], W("output_norm.weight")) @ out_w.T

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
