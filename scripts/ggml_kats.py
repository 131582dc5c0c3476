#!/usr/bin/env python3
"""Prints the expected bytes and values embedded in src/formats/ggml/ggml_types_test.cc.

Independent of the C++ code under test: quantization and dequantization come from the PyPI
package `gguf` (gguf.quants, numpy ports of llama.cpp's reference code; F16 is numpy's
round-to-nearest-even cast), except the IQ4_NL quantizer, which gguf lacks: it is written out
below from llama.cpp's quantize_row_iq4_nl_ref with float32 arithmetic at every step.

    pip install gguf numpy && python3 scripts/ggml_kats.py
"""
import struct

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

F32 = np.float32


def lcg(state, n):
    """The test's generator: 32-bit LCG (Numerical Recipes constants)."""
    out = []
    for _ in range(n):
        state = (state * 1664525 + 1013904223) & 0xFFFFFFFF
        out.append(state)
    return state, out


def kat_row():
    """160 floats, five blocks of 32: random in [-2, 2); small random with a +3 outlier; zeros;
    a constant; the integers -16..15 (exact ties in several quantizers)."""
    _, words = lcg(1, 64)
    x = [((w >> 8) - (1 << 23)) * 2.0**-22 for w in words]
    b0 = x[:32]
    b1 = [v * 2.0**-12 for v in x[32:]]
    b1[5] = 3.0
    return np.array(b0 + b1 + [0.0] * 32 + [0.75] * 32 + [float(j - 16) for j in range(32)], dtype=F32)


def special_row():
    """Rounding edge cases of the 16-bit float formats."""
    v = [1 + 2.0**-11, 1 + 3 * 2.0**-11, 65504.0, 65519.0, 65520.0, 1e-8, 2.0**-24, 3 * 2.0**-26,
         2.0**-25, -0.0, np.inf, -np.inf, 1e10, -1.5, 1 + 2.0**-8, 1 + 3 * 2.0**-8]
    return np.array(v, dtype=F32)


KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]


def nearest_iq4nl(x):
    x2 = F32(x + x)
    idx = 0
    for step in (8, 4, 2, 1):
        j = idx + step
        if x2 >= F32(KVALUES[j - 1] + KVALUES[j]):
            idx = j
    return idx


def iq4_nl_block(xb):
    amax, mx = F32(0), F32(0)
    for v in xb:
        if abs(v) > amax:
            amax, mx = abs(v), v
    L = [0] * 32
    d = F32(0)
    if amax >= F32(1e-15):
        idx = F32(1) / F32(mx / F32(KVALUES[0]))
        sumqx, sumq2 = F32(0), F32(0)
        for j, v in enumerate(xb):
            L[j] = nearest_iq4nl(F32(idx * v))
            q = F32(KVALUES[L[j]])
            w = F32(v * v)
            sumqx = F32(sumqx + F32(F32(w * q) * v))
            sumq2 = F32(sumq2 + F32(F32(w * q) * q))
        d = F32(sumqx / sumq2) if sumq2 > 0 else F32(0)
    qs = bytes(L[j] | (L[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + qs


def hexs(b):
    return bytes(b).hex()


def f32_hex(v):
    return "0x%08x" % struct.unpack("<I", struct.pack("<f", v))[0]


def fnv1a64(floats):
    h = 0xCBF29CE484222325
    for byte in np.asarray(floats, dtype="<f4").tobytes():
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def random_blocks(qtype, nblocks, seed):
    """Random block bytes with every fp16 scale field set to a finite value."""
    block, size = quants.GGML_QUANT_SIZES[qtype]
    _, words = lcg(seed, nblocks * size)
    raw = np.array([(w >> 24) for w in words], dtype=np.uint8).reshape(nblocks, size)
    scale_fields = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
                    T.IQ4_NL: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
    for k, off in enumerate(scale_fields.get(qtype, [])):
        for i in range(nblocks):
            # |scale| in [2^-7, 2^-3), either sign, random mantissa
            r = int(raw[i, off]) | (int(raw[i, off + 1]) << 8)
            h = (r & 0x8000) | (0x2000 + (r & 0x0FFF))
            raw[i, off], raw[i, off + 1] = h & 0xFF, h >> 8
    if qtype == T.F16:  # no NaN or infinity: exponent field below 31
        h = raw.view(np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF
    if qtype == T.BF16:
        h = raw.view(np.uint16)
        h[(h & 0x7F80) == 0x7F80] &= 0xBFFF
    return raw


def cxx_hex(b, indent):
    h = bytes(b).hex()
    return ("\n" + " " * indent).join(f'"{h[i:i + 96]}"' for i in range(0, len(h), 96))


def main():
    x = kat_row()
    print("// quantize_row(t, kat_row()): gguf.quants.quantize, IQ4_NL from iq4_nl_block() here.")
    print("const QuantKat kQuantKats[] = {")
    for qt in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        print(f"    {{GgmlType::{qt.name},\n     {cxx_hex(quants.quantize(x.reshape(1, -1), qt), 5)}}},")
    iq4 = b"".join(iq4_nl_block(x[i:i + 32]) for i in range(0, 160, 32))
    print(f"    {{GgmlType::IQ4_NL,\n     {cxx_hex(iq4, 5)}}},")
    with np.errstate(over="ignore"):  # 65520 and 1e10 round to infinity, as intended
        f16 = x.astype(np.float16).tobytes(), special_row().astype(np.float16).tobytes()
    print(f"    {{GgmlType::F16,\n     {cxx_hex(f16[0], 5)}}},")
    print(f"    {{GgmlType::BF16,\n     {cxx_hex(quants.quantize(x.reshape(1, -1), T.BF16), 5)}}},")
    print("};")
    print("// special_row(): numpy's float16 cast and gguf.quants.quantize(BF16).")
    print(f"const char kF16Special[] = {cxx_hex(f16[1], 4)};")
    print(f"const char kBF16Special[] = {cxx_hex(quants.quantize(special_row().reshape(1, -1), T.BF16), 4)};")

    print("// dequantize_row(random_blocks(t, seed)): gguf.quants.dequantize; FNV-1a 64 of the floats' bytes.")
    print("const DequantKat kDequantKats[] = {")
    for qt, nb, seed in ((T.F16, 64, 11), (T.BF16, 64, 12), (T.Q4_0, 4, 13), (T.Q4_1, 4, 14),
                         (T.Q5_0, 4, 15), (T.Q5_1, 4, 16), (T.Q8_0, 4, 17), (T.IQ4_NL, 4, 18),
                         (T.Q4_K, 2, 19), (T.Q5_K, 2, 21), (T.Q6_K, 2, 20)):
        y = np.asarray(quants.dequantize(random_blocks(qt, nb, seed).reshape(-1), qt), dtype=F32).reshape(-1)
        n = y.size
        picks = sorted({0, 1, 15, 16, 31, 33, n // 2, n - 1})
        samples = [f"{{{i}, {f32_hex(y[i])}}}" for i in picks]
        print(f"    {{GgmlType::{qt.name}, {nb}, {seed}, 0x{fnv1a64(y):016x}ull,")
        print(f"     {{{', '.join(samples[:4])},")
        print(f"      {', '.join(samples[4:])}}}}},")
    print("};")


if __name__ == "__main__":
    main()
