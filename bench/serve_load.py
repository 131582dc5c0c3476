#!/usr/bin/env python3
"""Load generator for an OpenAI-compatible server (`witcert serve`, llama-server): C concurrent
clients, each streaming R completions of distinct prompts, at each concurrency C. Prints one
markdown row per C: aggregate completion tokens/s, time to first token and inter-token latency
(p50 and p99, ms). Standard library only.

Usage: bench/serve_load.py URL [--concurrency 1,2,4,8,16,32] [--requests 2] [--max-tokens 64]
                              [--prompt-words 200] [--label NAME]
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

PARAGRAPH = ("The river town kept its records in a long stone hall by the water, and every spring the clerks "
             "counted the boats, the nets, the bales of wool and the barrels of salted fish that came down from "
             "the hills. ")


def quantile(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def one_request(url, prompt, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{resp.status}: {resp.read()[:200]!r}")
    first, last, stamps, tokens, chunks, buf = None, None, [], 0, 0, b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ")
            if data == "[DONE]":
                continue
            j = json.loads(data)
            if j.get("usage"):
                tokens = j["usage"]["completion_tokens"]
            if j.get("choices") and j["choices"][0].get("text"):
                chunks += 1
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    stamps.append(now - last)
                last = now
    conn.close()
    tokens = tokens or chunks  # a server that reports no usage in its stream sends a token a chunk
    return {"ttft": (first - t0) if first else float("nan"), "itl": stamps, "tokens": tokens, "end": time.perf_counter()}


def run_level(url, c, requests, max_tokens, prompt_words):
    results, errors = [], []
    lock = threading.Lock()

    def client(k):
        for r in range(requests):
            words = (f"Request {k}-{r}. " + PARAGRAPH * (prompt_words // 30 + 1)).split()[:prompt_words]
            try:
                res = one_request(url, " ".join(words), max_tokens)
                with lock:
                    results.append(res)
            except Exception as e:  # a failed request is counted, not hidden
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    return {"c": c, "tok_s": tokens / wall, "ttft50": 1e3 * quantile(ttft, 0.5), "ttft99": 1e3 * quantile(ttft, 0.99),
            "itl50": 1e3 * quantile(itl, 0.5), "itl99": 1e3 * quantile(itl, 0.99), "errors": len(errors),
            "requests": len(results)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--label", default="server")
    a = ap.parse_args()
    print(f"| {a.label} | C | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests | errors |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in [int(x) for x in a.concurrency.split(",")]:
        r = run_level(a.url, c, a.requests, a.max_tokens, a.prompt_words)
        print(f"| {a.label} | {c} | {r['tok_s']:.1f} | {r['ttft50']:.0f} | {r['ttft99']:.0f} | {r['itl50']:.1f} | "
              f"{r['itl99']:.1f} | {r['requests']} | {r['errors']} |", flush=True)


if __name__ == "__main__":
    main()
