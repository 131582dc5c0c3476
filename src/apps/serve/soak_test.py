#!/usr/bin/env python3
"""Soak: thousands of random valid and invalid requests against one `witcert serve`, eight clients
at a time. Every valid request must be answered exactly as it was when it ran alone (text, finish
reason, usage and the witcert meter, byte for byte); every invalid one must get a 4xx with an
OpenAI-style error; the server must not crash. Prints RSS over time.

Usage: soak_test.py WITCERT_BINARY MODEL_GGUF [REQUESTS]
"""
import concurrent.futures
import http.client
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time

PROMPTS = ["The capital of France is", "Water boils at", "Once upon a time", "List three colors:",
           "def fib(n):", "The largest planet is", "Translate 'cat' to French:", "2 + 2 ="]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))


def valid_specs() -> list:
    """Requests whose answers do not depend on timing: greedy, or sampled with a seed."""
    specs = []
    for i, p in enumerate(PROMPTS):
        for stream in (False, True):
            body = {"max_tokens": 1 + i % 4, "stream": stream}
            if i % 3 == 1:
                body.update(temperature=0.8, top_p=0.9, seed=1000 + i)
            if i % 2:
                specs.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": p}]}))
            else:
                specs.append(("/v1/completions", {**body, "prompt": p}))
            if i % 4 == 3:
                specs.append(("/v1/completions", {**body, "prompt": p, "witcert": {"tau_k": 0.2, "detail": True}}))
    return specs


def invalid_body(rng: random.Random) -> bytes:
    kind = rng.randrange(12)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if kind == 1:
        return json.dumps({"prompt": "x"}).encode()[: rng.randrange(1, 14)]
    if kind == 2:
        return json.dumps({"prompt": "x", "max_tokens": rng.choice([0, -1, 10 ** 7, 2.5, "3", [1]])}).encode()
    if kind == 3:
        return json.dumps({"prompt": "x", "temperature": rng.choice([-1, 2.5, "hot", 1e309])}).encode().replace(
            b"Infinity", b"1e999")
    if kind == 4:
        return json.dumps({"prompt": "x", "top_p": rng.choice([0, 1.5, -0.1])}).encode()
    if kind == 5:
        return json.dumps({"prompt": "x", rng.choice(["tools", "logit_bias", "best_of"]): 1}).encode()
    if kind == 6:
        return json.dumps({"prompt": "x", "witcert": {"tau_k": rng.choice([-1, 0, "x"]), "bogus": 1}}).encode()
    if kind == 7:
        depth = rng.randrange(65, 5000)
        return b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 8:
        return json.dumps({"prompt": 42}).encode()
    if kind == 9:
        return json.dumps({"prompt": "x", "seed": 2 ** 64}).encode()
    if kind == 10:
        return json.dumps({"prompt": "x" * 40000, "max_tokens": 8000}).encode()
    return json.dumps({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode()


def send(host: str, port: int, path: str, body: bytes):
    c = http.client.HTTPConnection(host, port, timeout=300)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def answer(status: int, raw: bytes, stream: bool):
    """What must not depend on the batch: text, finish reason, usage and the meter."""
    assert status == 200, (status, raw[:300])
    if not stream:
        j = json.loads(raw)
        c = j["choices"][0]
        return (c.get("text", c.get("message", {}).get("content")), c["finish_reason"], j["usage"], j["witcert"])
    text, finish, usage, meter = "", None, None, None
    events = raw.decode().split("\n\n")
    assert events[-2] == "data: [DONE]", events[-3:]
    for e in events[:-2]:
        j = json.loads(e[len("data: "):])
        for c in j["choices"]:
            text += c.get("text") or c.get("delta", {}).get("content") or ""
            finish = c["finish_reason"] or finish
        usage = j.get("usage") or usage
        meter = j.get("witcert") or meter
    return text, finish, usage, meter


def main() -> int:
    binary, model = sys.argv[1], sys.argv[2]
    total = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", "0", "--kv", "dither-int8", "--kv-memory", "64M",
         "--max-seqs", "8", "--max-waiting", "256"], stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"listening on http://([0-9.]+):([0-9]+)", server.stderr.readline())
        assert m
        host, port = m.group(1), int(m.group(2))
        assert "ready" in server.stderr.readline()
        threading.Thread(target=server.stderr.read, daemon=True).start()

        specs = valid_specs()
        solo = [answer(*send(host, port, path, json.dumps(b).encode()), b["stream"]) for path, b in specs]
        rng = random.Random(20261205)
        paths = ["/v1/completions", "/v1/chat/completions"]
        plan = [(rng.random() < 0.6, rng.randrange(len(specs)), rng.randrange(2 ** 31), rng.choice(paths))
                for _ in range(total)]
        counts = {"valid": 0, "invalid": 0}
        rss = [(0, rss_kib(server.pid))]
        lock = threading.Lock()
        start = time.monotonic()

        def one(i: int) -> None:
            ok, k, seed, bad_path = plan[i]
            if ok:
                path, body = specs[k]
                got = answer(*send(host, port, path, json.dumps(body).encode()), body["stream"])
                assert got == solo[k], (i, body, got, solo[k])
            else:
                body = invalid_body(random.Random(seed))
                status, raw = send(host, port, bad_path, body)
                assert 400 <= status < 500, (i, status, body[:100], raw[:300])
                assert json.loads(raw)["error"]["message"], raw[:300]
            with lock:
                counts["valid" if ok else "invalid"] += 1
                done = counts["valid"] + counts["invalid"]
                if done % 200 == 0:
                    rss.append((done, rss_kib(server.pid)))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(one, i) for i in range(total)]:
                f.result()
        took = time.monotonic() - start
        assert server.poll() is None, "the server died"
        print(f"soak: {total} requests ({counts['valid']} valid, each equal to its solo run; {counts['invalid']} "
              f"invalid, each a 4xx) in {took:.0f} s")
        print("RSS KiB after N requests: " + ", ".join(f"{n}: {r}" for n, r in rss))
        print(f"{total} passed, 0 failed")
        return 0
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
