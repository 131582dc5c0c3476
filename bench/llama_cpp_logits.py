#!/usr/bin/env python3
"""WitCert's next-token distribution against llama.cpp's on the synthetic models of every
architecture (tools/synthetic_models.py) in several weight formats: for each prompt, the top-1
token of each and KL(llama.cpp ‖ WitCert) over the whole vocabulary, from the same token ids, and
both against the float64 numpy forward pass (tools/reference_llama.py): where llama.cpp parts
from WitCert, the reference says which of the two it is (llama.cpp multiplies int8 activations).

    bench/llama_cpp_logits.py [TYPES...]    (default: F32 Q8_0 Q4_0 Q5_0 Q4_K Q6_K)

WitCert's logits come from `build/witcert logits --top <vocab>`; llama.cpp's from llama-server
(built by bench/llama_cpp_peer.sh) as /completion's log-probabilities of every token (n_probs =
vocabulary size, temperature 0), so both see the prompt as the same ids; the server holds back a
token that ends inside a UTF-8 character, so it generates 8 tokens and the first one's distribution
is read. Prints a markdown table and exits 1 if WitCert's top-1 differs from the reference's or
KL(reference ‖ WitCert) reaches 1e-2.
"""
import json
import math
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import reference_llama  # noqa: E402
BIN = ROOT / "build" / "witcert"
SERVER = ROOT / "build-peer" / "llama-server"
ARCHS = ("llama", "llama3", "qwen2", "qwen3", "gemma3")
# Short, and longer than the synthetic gemma3's window of 7 positions.
PROMPTS = ("hello the world", "the tell hello the the hell", "hello hello the world, the shell held the hell of the hall")


def witcert(model, prompt):
    out = subprocess.run([str(BIN), "logits", "--model", str(model), "--prompt", prompt, "--top", "100000"],
                         check=True, capture_output=True, text=True).stdout
    got = json.loads(out)
    return got["prompt_tokens"], {t["id"]: t["logit"] for t in got["top"]}


def llama_cpp(port, ids, vocab):
    body = json.dumps({"prompt": ids, "n_predict": 8, "n_probs": vocab, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
    got = json.load(urllib.request.urlopen(req, timeout=60))
    if "completion_probabilities" not in got:
        raise RuntimeError(f"llama-server gave no probabilities for {ids}: {json.dumps(got)[:400]}")
    return {t["id"]: t["logprob"] for t in got["completion_probabilities"][0]["top_logprobs"]}


def kl(p_log, q_log):
    """KL(p ‖ q) of two log-distributions over the same ids."""
    return sum(math.exp(lp) * (lp - q_log[i]) for i, lp in p_log.items())


def log_softmax(logits):
    m = max(logits.values())
    lse = m + math.log(sum(math.exp(v - m) for v in logits.values()))
    return {i: v - lse for i, v in logits.items()}


def compare(model, port):
    rows = []
    server = subprocess.Popen([str(SERVER), "-m", str(model), "--port", str(port), "-t", "1", "-c", "512"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        for prompt in PROMPTS:
            ids, logits = witcert(model, prompt)
            ours = log_softmax(logits)
            theirs = llama_cpp(port, ids, len(logits))
            ref = log_softmax(dict(enumerate(np.asarray(reference_llama.reference_logits(str(model), ids)).tolist())))
            top = lambda d: max(d, key=d.get)  # noqa: E731
            rows.append((len(ids), top(ref), top(ours), top(theirs), kl(theirs, ours), kl(ref, ours), kl(ref, theirs)))
    finally:
        server.terminate()
        server.wait()
    return rows


def main():
    types = sys.argv[1:] or ["F32", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"]
    print("| architecture | weights | prompt tokens | top-1 reference | WitCert | llama.cpp "
          "| KL(llama.cpp ‖ WitCert) | KL(reference ‖ WitCert) | KL(reference ‖ llama.cpp) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        port = 18300
        for arch in ARCHS:
            for qtype in types:
                model = pathlib.Path(tmp) / f"{arch}-{qtype}.gguf"
                subprocess.run([sys.executable, str(ROOT / "tools" / "synthetic_models.py"), arch, qtype, str(model)],
                               check=True)
                port += 1
                for n, r, a, b, kl_ab, kl_ra, kl_rb in compare(model, port):
                    bad += r != a or not kl_ra < 1e-2
                    print(f"| {arch} | {qtype} | {n} | {r} | {a} | {b} | {kl_ab:.2e} | {kl_ra:.2e} | {kl_rb:.2e} |")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
