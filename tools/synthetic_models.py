#!/usr/bin/env python3
"""Writes small random-weight GGUFs of every architecture WitCert runs, in any weight format, for
the tests: the same metadata and tensor names a converted model of that family has, a byte-level
BPE vocabulary of the 256 bytes plus a few merges, and weights drawn from a fixed seed.

    pip install gguf numpy
    tools/synthetic_models.py ARCH TYPE OUT.gguf      (ARCH: llama, llama3, qwen2, qwen3, gemma3;
                                                       TYPE: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
                                                       Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K)

llama3 is the llama architecture with Llama 3.1's per-frequency RoPE factors (rope_freqs.weight);
gemma3 has key_length 64 beside a width of 256 over 4 heads, and a sliding window of 7 positions in every
other layer.
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import GGML_QUANT_SIZES, quantize

ARCHS = ("llama", "llama3", "qwen2", "qwen3", "gemma3")
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the fp16 scale fields of a block, for the types written as random bytes.
SCALE_FIELDS = {T.IQ4_NL: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}

D, FF, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 3


def gpt2_vocab():
    """The 256 byte symbols of GPT-2's alphabet, then the merged tokens and an end token."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    shifted = iter(range(256, 256 + 68))
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    merges = ["h e", "l l", "Ġ t", "Ġt he"]
    return symbols + ["he", "ll", "Ġt", "Ġthe", "<|endoftext|>"], merges


def weights(rng, name, shape, qtype):
    """A (rows × cols) matrix as the GGUF stores it: quantized rows, or random blocks with small
    finite scales for the types gguf cannot quantize."""
    rows, cols = shape
    if qtype in SCALE_FIELDS:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
        for off in SCALE_FIELDS[qtype]:
            scale = (rng.uniform(0.5, 1.0, size=raw.shape[0]) * (2e-3 if qtype != T.IQ4_NL else 4e-4)).astype(np.float16)
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return raw.reshape(rows, cols // block * size)
    w = (rng.standard_normal((rows, cols)) * (1.0 / np.sqrt(cols))).astype(np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    return quantize(w, qtype)


class _Overridden(GGUFWriter):
    """A writer whose metadata keys in `overrides` take the given value instead (None: left out),
    for files with malformed metadata."""

    def __init__(self, path, arch, overrides):
        self.overrides = dict(overrides)  # before the base writes its first key
        super().__init__(path, arch)

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key in self.overrides:
            val = self.overrides[key]
            if val is None:
                return
        super().add_key_value(key, val, vtype, sub_type)


def write(arch, type_name, path, seed=7, overrides=None):
    """A small random model of `arch` with weights of `type_name` at `path`; `overrides` maps
    metadata keys to the values to write instead (None: the key is left out)."""
    qtype = T[type_name]
    rng = np.random.default_rng(seed)
    gguf_arch = "llama" if arch == "llama3" else arch
    hd = 64
    w = _Overridden(path, gguf_arch, overrides or {})
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    w.add_rope_freq_base(1e6 if arch in ("qwen2", "qwen3", "gemma3") else 10000.0)
    if arch == "gemma3":
        hd = 64
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_sliding_window(7)  # shorter than the tests' prompts, so that the window masks
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    tokens, merges = gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_eos_token_id(len(tokens) - 1)
    vocab = len(tokens)

    def vec(name, n, around=1.0, spread=0.1):
        w.add_tensor(name, (around + spread * rng.standard_normal(n)).astype(np.float32))

    def mat(name, rows, cols, dtype=qtype):
        data = weights(rng, name, (rows, cols), dtype)
        w.add_tensor(name, data, raw_shape=None if dtype in (T.F32, T.F16) else data.shape, raw_dtype=None
                     if dtype in (T.F32, T.F16) else dtype)

    # The embedding table stays Q8_0 (as Gemma's does) unless the type is a float one.
    mat("token_embd.weight", vocab, D, qtype if qtype in (T.F32, T.F16, T.BF16) else T.Q8_0)
    vec("output_norm.weight", D)
    if arch == "llama3":
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
    if arch != "gemma3":
        mat("output.weight", vocab, D)
    for l in range(LAYERS):
        p = f"blk.{l}."
        vec(p + "attn_norm.weight", D)
        vec(p + "ffn_norm.weight", D)
        mat(p + "attn_q.weight", HEADS * hd, D)
        mat(p + "attn_k.weight", KV_HEADS * hd, D)
        mat(p + "attn_v.weight", KV_HEADS * hd, D)
        mat(p + "attn_output.weight", D, HEADS * hd)
        mat(p + "ffn_gate.weight", FF, D)
        mat(p + "ffn_up.weight", FF, D)
        mat(p + "ffn_down.weight", D, FF)
        if arch == "qwen2":
            for s, n in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
                vec(p + f"attn_{s}.bias", n, 0.0, 0.2)
        if arch in ("qwen3", "gemma3"):
            vec(p + "attn_q_norm.weight", hd)
            vec(p + "attn_k_norm.weight", hd)
        if arch == "gemma3":
            vec(p + "post_attention_norm.weight", D)
            vec(p + "post_ffw_norm.weight", D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ARCHS or sys.argv[2] not in TYPES:
        sys.exit(__doc__)
    write(*sys.argv[1:])
