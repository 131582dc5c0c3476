#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention in fp16 on the GPU check's decode shapes (scripts/gpu-check.sh).

One decode step: q [B, 32, 1, d], k and v [B, 32/g, S, d] (GQA g:1, g = 4; --full also 8), timed with CUDA events; the bytes
are the cache's, as the CUDA check counts them. Writes a JSON list of runs.
"""
import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="the issue's whole matrix (as witcert_cuda_check --full)")
    args = parser.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"sdpa: PyTorch is not importable ({e})", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("sdpa: no CUDA device visible to PyTorch", file=sys.stderr)
        return 1
    q_heads = 32
    memory = torch.cuda.get_device_properties(0).total_memory
    lengths = (4096,) if args.quick else (4096, 32768, 131072) if args.full else (4096, 32768)
    shapes = [(b, S, d, g) for b in ((1, 8, 64) if args.full else (1, 64)) for S in lengths for d in (64, 128)
              for g in ((4, 8) if args.full else (4,)) if 2 * b * S * (q_heads // g) * d * 2 <= 0.4 * memory]
    runs = []
    for batch, S, d, group in shapes:
        kv_heads = q_heads // group
        q = torch.randn(batch, q_heads, 1, d, device="cuda", dtype=torch.float16)
        k = torch.randn(batch, kv_heads, S, d, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        try:  # PyTorch ≥ 2.5 reads the KV heads once for the group
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            step = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            gqa = "enable_gqa"
        except TypeError:  # older: the KV heads repeated for the group beforehand, outside the timing
            ke, ve = k.repeat_interleave(q_heads // kv_heads, 1), v.repeat_interleave(q_heads // kv_heads, 1)
            step = lambda: F.scaled_dot_product_attention(q, ke, ve)  # noqa: E731
            gqa = "repeated"
        for _ in range(3):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        reps = max(3, min(200, int(500.0 / max(start.elapsed_time(end), 1e-3))))
        start.record()
        for _ in range(reps):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / reps
        nbytes = 2 * batch * kv_heads * S * d * 2
        runs.append({"format": "sdpa-fp16", "batch": batch, "S": S, "d": d, "q_heads": q_heads,
                     "kv_heads": kv_heads, "ms": ms, "bytes": nbytes, "gbps": nbytes / (ms * 1e6), "gqa": gqa})
        print(f"sdpa fp16 B={batch:<3} S={S:<6} d={d:<4} GQA {group}:1 {ms:9.3f} ms {nbytes / (ms * 1e6):7.0f} GB/s ({gqa})")
        del q, k, v, step
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
