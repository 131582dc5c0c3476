"""The cost of witcert.vllm in vLLM's decode: the same batch generated with the plugin off (no
connector), metering only, and gated, in rounds, on SmolLM2 with vLLM's fp8 cache (CPU).

    .venv-vllm/bin/python bench/vllm_overhead.py [--rounds 3] [--batch 4] [--tokens 64]

Prints each configuration's decode tok/s (median over rounds; each round loads each configuration
in turn), its ratio to the plugin off, and where the plugin's time goes (the share of decode time
inside the backend's whole per-layer step, its one C++ call that reads vLLM's cache, writes the
mirror, attends and meters, and the step's cell drain), from timers around those calls.
"""
import argparse
import gc
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402

import witcert.vllm as wv  # noqa: E402
import witcert.vllm.backend as backend  # noqa: E402
import witcert.vllm.connector as connector  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct-hf"
PROMPTS = ["The capital of France is", "def quicksort(xs):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "import numpy as np\n", "My favourite recipe for bread"]
TIMES = defaultdict(float)


def timed(owner, name, key):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def run(config, batch, tokens):
    extra = {} if config == "off" else {
        "kv_transfer_config": wv.kv_transfer_config(**({"tau_k": 0.2} if config == "gated" else {}))}
    llm = LLM(model=str(MODEL), dtype="float32", kv_cache_dtype="fp8", enforce_eager=True, max_model_len=1024,
              enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20, distributed_executor_backend="uni",
              seed=0, **extra)
    prompts = (PROMPTS * batch)[:batch]
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)  # warm
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    prefill = time.perf_counter() - t
    TIMES.clear()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    total = time.perf_counter() - t
    parts = dict(TIMES)
    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()
    gc.collect()
    return batch * (tokens - 1) / (total - prefill), total - prefill, parts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    timed(backend.WitCertCPUImpl, "_certify", "plugin, all")
    timed(backend._witcert, "vllm_decode", "read, write, attend, meter (C++)")

    timed(connector.WorkerState, "end_step", "cell drain")
    rates, parts = defaultdict(list), defaultdict(lambda: defaultdict(list))
    for _ in range(a.rounds):
        for config in ("off", "metered", "gated"):
            rate, seconds, p = run(config, a.batch, a.tokens)
            rates[config].append(rate)
            for k, v in p.items():
                parts[config][k].append(v / seconds)
    off = statistics.median(rates["off"])
    print(f"decode, batch {a.batch} x {a.tokens} tokens, {a.rounds} rounds (median tok/s):")
    for config in ("off", "metered", "gated"):
        m = statistics.median(rates[config])
        print(f"  {config:8s} {m:8.1f} tok/s  {m / off:5.3f}x of off   runs: " +
              " ".join(f"{r:.1f}" for r in rates[config]))
        for k, v in sorted(parts[config].items()):
            print(f"      {k:28s} {100 * statistics.median(v):5.1f} % of decode time")


if __name__ == "__main__":
    main()
