#!/usr/bin/env python3
"""Resident memory of `witcert serve` over many requests: starts the server (the KV pool sized by
--kv-memory, format --kv), sends REQUESTS completions of MAX_TOKENS generated tokens each from
CONCURRENCY clients (a counting prompt that does not stop early, a different start per request),
and prints the server's RSS (VmRSS of /proc) after the first FIRST requests and after all of them,
and their ratio. Standard library only.

Usage: bench/serve_memory.py [--bin build/witcert] [--kv q8_0] [--requests 500] [--first 50]
                             [--max-tokens 256] [--concurrency 8] [--port 18091]
"""
import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def complete(port, start, max_tokens):
    prompt = ", ".join(str(i) for i in range(start, start + 30)) + ","
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"status {r.status}: {body}")
    return body["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/witcert")
    ap.add_argument("--kv", default="q8_0")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--first", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--port", type=int, default=18091)
    a = ap.parse_args()
    server = subprocess.Popen([a.bin, "serve", "--kv", a.kv, "--port", str(a.port), "--threads", "2",
                               "--max-seqs", str(a.concurrency), "--kv-memory", "1G"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection("127.0.0.1", a.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        lock = threading.Lock()
        state = {"next": 0, "done": 0, "tokens": 0, "rss_first": None}
        t0 = time.time()

        def client():
            while True:
                with lock:
                    i = state["next"]
                    if i >= a.requests:
                        return
                    state["next"] += 1
                n = complete(a.port, 1 + 37 * i, a.max_tokens)
                with lock:
                    state["done"] += 1
                    state["tokens"] += n
                    if state["done"] == a.first:
                        state["rss_first"] = rss_mb(server.pid)

        threads = [threading.Thread(target=client) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss_all = rss_mb(server.pid)
        print(f"{a.requests} requests x {a.max_tokens} tokens ({state['tokens']} generated, "
              f"{time.time() - t0:.0f} s, --kv {a.kv}, {a.concurrency} at once): RSS after {a.first} "
              f"{state['rss_first']:.1f} MB, after {a.requests} {rss_all:.1f} MB "
              f"({100.0 * (rss_all / state['rss_first'] - 1):+.1f} %)")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
