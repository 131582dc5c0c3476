"""Benchmarks of the Python integration (docs/BENCHMARKS.md, "Python and transformers"):

1. the tensor API's meters and Tier-A bounds of a [batch, heads, tokens] batch against the one-cell
   calls over the same rows;
2. `model.generate` tokens per second with witcert.transformers.CertifiedCache (plain, q4_0 raw and
   gated, dither-int8) against transformers' DynamicCache and, where optimum-quanto is installed,
   its QuantizedCache.

    .venv/bin/python bench/python_transformers.py [--model models/SmolLM2-135M-Instruct.Q4_1.gguf]

Medians of --repeats runs, side by side in one process.
"""
import argparse
import os
import statistics
import time

import numpy as np


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tensor_api(repeats, threads):
    import witcert
    rng = np.random.default_rng(0)
    b, h, hk, n, d = 32, 9, 3, 4096, 64
    z = rng.normal(0, 3, (b, h, n))
    c = rng.exponential(0.02, (b, h, n))
    one = median_seconds(lambda: [witcert.meter(z[i, j], c[i, j]) for i in range(b) for j in range(h)], repeats)
    many = median_seconds(lambda: witcert.meters(z, c, threads=threads), repeats)
    print(f"meter, {b}x{h} rows of {n} tokens: one-cell calls {one * 1e3:.1f} ms, meters() {many * 1e3:.1f} ms "
          f"({one / many:.1f}x; {b * h / many:.0f} meters/s)")
    k = rng.normal(size=(b, hk, n, d)).astype(np.float32)
    w = witcert.witness((k + 0.01 * rng.normal(size=k.shape)).astype(np.float32), k, layout="neox")
    q = rng.normal(size=(b, h, d)).astype(np.float32)
    one = median_seconds(lambda: [witcert.tier_a_bounds(q[i, j], w[i, j // (h // hk)], layout="neox")
                                  for i in range(b) for j in range(h)], repeats)
    many = median_seconds(lambda: witcert.tier_a_bounds(q, w, layout="neox", threads=threads), repeats)
    print(f"tier_a_bounds, same rows: one-cell calls {one * 1e3:.1f} ms, batched {many * 1e3:.1f} ms "
          f"({one / many:.1f}x)")


def generate(model_path, repeats, new_tokens, batch, prompt_repeat=1):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
    import witcert.transformers as wt
    directory, name = os.path.split(os.path.abspath(model_path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tok.padding_side = "left"
    prompt = "The history of the lighthouse begins with fires lit on hills to guide ships home. Over the centuries,"
    inputs = tok([" ".join([prompt] * prompt_repeat)] * batch, return_tensors="pt", padding=True)
    caches = {"DynamicCache (sdpa)": lambda: DynamicCache(config=model.config)}
    try:
        import optimum.quanto  # noqa: F401
        from transformers import QuantizedCache
        caches["QuantizedCache (quanto int4)"] = lambda: QuantizedCache(backend="quanto", config=model.config, nbits=4)
    except ImportError:
        print("QuantizedCache: optimum-quanto is not installed (pip install optimum-quanto==0.2.7)")
    import witcert

    def rtn4(x):  # a 4-bit round-to-nearest per token in torch, against the built-in rtn-int4's cost
        scale = x.abs().amax(dim=-1, keepdim=True) / 7 + 1e-12
        return torch.clamp(torch.round(x / scale), -8, 7) * scale

    witcert.register_scheme("rtn4-torch", rtn4)
    for label, options in {"CertifiedCache fp16": {}, "CertifiedCache q4_0": {"kv": "q4_0"},
                           "CertifiedCache rtn-int4": {"kv": "rtn-int4"},
                           "CertifiedCache rtn4-torch (registered)": {"kv": "rtn4-torch"},
                           "CertifiedCache q4_0 gated": {"kv": "q4_0", "tau_k": 0.2},
                           "CertifiedCache dither-int8": {"kv": "dither-int8"}}.items():
        caches[label] = (lambda o: lambda: wt.CertifiedCache(model, **o))(options)
    results = {}
    for label, make in caches.items():
        def run():
            cache = make()
            with torch.no_grad():
                out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     do_sample=False)
            if isinstance(cache, wt.CertifiedCache):
                cache.close()
            return out
        run()  # warm-up
        results[label] = median_seconds(run, repeats)
    base = results["DynamicCache (sdpa)"]
    print(f"generate, batch {batch}, {inputs.input_ids.shape[1]} prompt + {new_tokens} new tokens:")
    for label, seconds in results.items():
        print(f"  {label:40s} {seconds:6.2f} s  {batch * new_tokens / seconds:7.1f} tokens/s  {seconds / base:5.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--prompt-repeat", type=int, default=1, help="the prompt repeated this many times")
    parser.add_argument("--skip-tensor-api", action="store_true")
    args = parser.parse_args()
    if not args.skip_tensor_api:
        tensor_api(args.repeats, args.threads)
    for batch in [int(b) for b in args.batches.split(",")]:
        generate(args.model, max(3, args.repeats // 2), args.new_tokens, batch, args.prompt_repeat)


if __name__ == "__main__":
    main()
