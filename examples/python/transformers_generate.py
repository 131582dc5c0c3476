"""WitCert inside Hugging Face transformers: the three-line use, then a comparison in the manner of
kvpress: the same model and prompts under q4_0 raw, q4_0 gated and dither-int8, with each one's
coverage, page-ins and KL against the exact cache.

    .venv/bin/python examples/python/transformers_generate.py [model.gguf] [--tokens N]

The model is any GGUF transformers' loader reads (dequantized to float32); the default is the
SmolLM2 that scripts/fetch-model.sh fetches.
"""
import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import witcert.transformers as wt

PROMPTS = {
    "prose": "The history of the lighthouse begins with fires lit on hills to guide ships home. Over the centuries,",
    "code": "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "needle": ("Remember this: the vault code is 4817. The weather was mild and the market was busy, with "
               "traders calling out prices for fish, bread and cloth all morning. Question: what is the vault "
               "code? Answer: the vault code is"),
}
SETTINGS = {"q4_0 raw": dict(kv="q4_0"), "q4_0 gated": dict(kv="q4_0", tau_k=0.2, tau_v=0.05),
            "dither-int8": dict(kv="dither-int8")}


def teacher_forced(model, ids, prompt_len, cache):
    """Log-probabilities of the next token at every continuation position, one decode step at a time."""
    with torch.no_grad():
        logits = [model(ids[:, :prompt_len], cache=cache, use_cache=True).logits[:, -1]]
        for p in range(prompt_len, ids.shape[1] - 1):
            logits.append(model(ids[:, p:p + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.log_softmax(torch.cat(logits).double(), dim=-1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per prompt")
    args = parser.parse_args()
    directory, name = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)

    # The three lines.
    inputs = tok([PROMPTS["prose"]], return_tensors="pt")
    with wt.CertifiedCache(model, kv="q4_0", tau_k=0.2) as cache:
        out = model.generate(**inputs, cache=cache, max_new_tokens=args.tokens, do_sample=False)
        row = cache.report().rows[0]
    print(tok.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True))
    print(f"verdict: {row['verdict']} ({row['reason']})\n")

    # The comparison, teacher-forced on the exact cache's own continuation of each prompt.
    print("| prompt | cache | coverage (joint) | page-ins | KL vs exact (mean nats) |")
    print("|---|---|---|---|---|")
    for label, text in PROMPTS.items():
        prompt = tok([text], return_tensors="pt")
        n = prompt.input_ids.shape[1]
        with wt.CertifiedCache(model) as exact_cache:
            ids = model.generate(**prompt, cache=exact_cache, max_new_tokens=args.tokens, do_sample=False)
        with wt.CertifiedCache(model) as exact_cache:
            exact = teacher_forced(model, ids, n, exact_cache)
        for setting, options in SETTINGS.items():
            with wt.CertifiedCache(model, **options) as cache:
                lp = teacher_forced(model, ids, n, cache)
                row = cache.report().rows[0]
            kl = (exact.exp() * (exact - lp)).sum(dim=-1).mean().item()
            print(f"| {label} | {setting} | {row['coverage']['joint']:.3f} | {row['page_ins']} | {kl:.2e} |")


if __name__ == "__main__":
    main()
