"""Every architecture × weight format WitCert runs, on small random-weight GGUFs written by
tools/synthetic_models.py: `witcert logits` against the independent numpy forward pass of
tools/reference_llama.py, and `witcert generate` with a certified cache and the soundness check.
Environment: WITCERT_BIN (the `witcert` binary); scripts/python-test.sh sets it."""
import concurrent.futures
import json
import os
import re
import pathlib
import subprocess
import sys

import numpy as np
import pytest

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))
import reference_llama  # noqa: E402
import synthetic_models  # noqa: E402

BIN = os.environ.get("WITCERT_BIN", "build/witcert")
PROMPTS = ["hello there, the bell", "a" * 3, "The history of the lighthouse begins with fires kept on hilltops " * 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(arch, qtype):
        if (arch, qtype) not in cache:
            path = root / f"{arch}-{qtype}.gguf"
            synthetic_models.write(arch, qtype, str(path))
            cache[(arch, qtype)] = path
        return cache[(arch, qtype)]

    return get


@pytest.mark.parametrize("qtype", synthetic_models.TYPES)
@pytest.mark.parametrize("arch", synthetic_models.ARCHS)
def test_logits_match_the_numpy_reference(models, arch, qtype):
    path = models(arch, qtype)
    for prompt in PROMPTS:
        out = subprocess.run([BIN, "logits", "--model", str(path), "--prompt", prompt, "--top", "20"],
                             capture_output=True, text=True, check=True).stdout
        got = json.loads(out)
        ref = reference_llama.reference_logits(str(path), got["prompt_tokens"])
        scale = float(np.abs(ref).max())
        worst = max(abs(c["logit"] - ref[c["id"]]) for c in got["top"])
        assert worst <= 1e-3 * scale, (prompt, worst, scale)
        assert got["top"][0]["id"] == int(np.argmax(ref)), prompt


def kv_formats():
    """Every certified --kv format `witcert schemes` lists (fp16, the exact cache, has no meter)."""
    out = subprocess.run([BIN, "schemes"], capture_output=True, text=True, check=True).stdout
    names = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) > 8 and fields[-1] in ("A", "B") and fields[0] != "fp16" and fields[0] not in names:
            names.append(fields[0])
    return names


def runs_for(kv_names):
    """The runs that put every --kv format, dither mode and gate granularity on an architecture: each
    format gated over the long prompt (past gemma3's window of 7) at page sizes 16 and 1, with the
    granularities in turn, and ungated over a short prompt at page size 1; each dithered width
    in each of its other modes, and with channel scales."""
    grans = ["block", "head", "request"]
    runs = []
    for i, kv in enumerate(kv_names):
        runs.append(["--kv", kv, "--prompt", PROMPTS[2], "--page-size", "16", "--tau-k", "0.2",
                     "--granularity", grans[i % 3]])
        runs.append(["--kv", kv, "--prompt", PROMPTS[2], "--page-size", "1", "--tau-k", "0.2",
                     "--granularity", grans[(i + 1) % 3]])
        runs.append(["--kv", kv, "--prompt", PROMPTS[0], "--page-size", "1"])
    dithered = [kv for kv in kv_names if kv.startswith("dither-int")]
    for j, (kv, mode) in enumerate((kv, m) for kv in dithered for m in ("per-slot", "shared-page", "none")):
        runs.append(["--kv", kv, "--dither", mode, "--prompt", PROMPTS[2], "--page-size", "16", "--tau-k", "0.2",
                     "--granularity", grans[j % 3]])
    for j, kv in enumerate(dithered):
        runs.append(["--kv", kv, "--key-scales", "channel", "--dither", ("per-slot", "shared-prompt")[j % 2],
                     "--prompt", PROMPTS[2], "--page-size", ("16", "1")[j % 2], "--tau-k", "0.2",
                     "--granularity", grans[j % 3]])
    return runs


def test_the_runs_cover_every_format_mode_and_granularity():
    names = kv_formats()
    assert len(names) >= 19 and {"q4_0", "kivi-2bit", "dither-int4", "dither-int8", "iq4_nl"} <= set(names)
    runs = runs_for(names)
    flat = [" ".join(r) for r in runs]
    for kv in names:
        assert any(f"--kv {kv} " in f and "--page-size 1 " in f for f in flat)
        assert any(f"--kv {kv} " in f and "--page-size 16 " in f for f in flat)
    for g in ("block", "head", "request"):
        assert any(f"--granularity {g}" in f for f in flat)
    for mode in ("per-slot", "shared-page", "none"):
        assert any(f"--dither {mode} " in f for f in flat)
    for kv in names:
        if kv.startswith("dither-int"):
            assert any(f"--kv {kv} --key-scales channel " in f for f in flat)


@pytest.mark.parametrize("arch", synthetic_models.ARCHS)
def test_every_kv_format_mode_and_granularity_is_sound_on_every_architecture(models, arch):
    path = models(arch, "Q8_0")

    def run(args):
        r = subprocess.run([BIN, "generate", "--model", str(path), "--n", "8", "--check-soundness", *args],
                           capture_output=True, encoding="utf-8", errors="replace")
        return args, r

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(run, runs_for(kv_formats())))
    for args, r in results:
        assert r.returncode == 0, (args, r.stderr)
        checked = re.search(r"soundness: (\d+) cells checked .*: 0 violations", r.stderr)
        assert checked and int(checked.group(1)) > 0, (args, r.stderr)


# Batch lines that do not depend on what ran beside the request: everything but the page-in
# counts, which a shared prefix charges to the sequence that paged in first.
def served(line):
    got = json.loads(line)
    got["meter"] = {k: v for k, v in got.get("meter", {}).items() if "page_in" not in k and k != "reason"}
    return got


@pytest.mark.parametrize("arch", synthetic_models.ARCHS)
def test_a_batch_serves_every_request_as_it_runs_alone(models, arch, tmp_path):
    """Batch invariance on every architecture: requests of different lengths (short, and past
    gemma3's window, two with a common prefix that the batch may share) run together give what
    each gives alone, for the plain cache and certified caches gated at each granularity, at page
    sizes 1 and 16."""
    path = models(arch, "Q4_K")
    long = PROMPTS[2]
    requests = [{"prompt": PROMPTS[0], "max_tokens": 9}, {"prompt": long, "max_tokens": 12},
                {"prompt": long + " and the keepers", "max_tokens": 10}, {"prompt": PROMPTS[1], "max_tokens": 7}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    configs = [[], ["--kv", "dither-int8", "--tau-k", "0.2"],
               ["--kv", "q4_0", "--tau-k", "0.2", "--granularity", "request", "--page-size", "1"],
               ["--kv", "kivi-2bit", "--tau-k", "0.2", "--granularity", "head"], ["--kv", "dither-int4", "--page-size", "1"]]
    for cfg in configs:
        outs = {}
        for seqs in (1, 4):
            out = tmp_path / f"out{seqs}.jsonl"
            r = subprocess.run([BIN, "batch", "--model", str(path), "--input", str(tmp_path / "in.jsonl"), "--output",
                                str(out), "--max-seqs", str(seqs), "--ignore-eos", *cfg], capture_output=True, text=True)
            assert r.returncode == 0, (cfg, r.stderr)
            outs[seqs] = [served(line) for line in out.read_text().splitlines()]
        assert len(outs[1]) == len(requests)
        for alone, together in zip(outs[1], outs[4]):
            assert together == alone, cfg
            assert alone["completion_tokens"] > 0


def malformed(arch):
    """(the key an error must name, the metadata written instead: None leaves a key out) for every
    architecture: missing keys, NaN and infinite floats, head counts that do not divide, head sizes
    the projections do not have, and the window of the layers that have one."""
    a = "llama" if arch == "llama3" else arch
    nan, inf = float("nan"), float("inf")
    cases = [(key, {key: value}) for key, value in [
        (f"{a}.attention.head_count", None), (f"{a}.embedding_length", None), (f"{a}.block_count", None),
        (f"{a}.attention.layer_norm_rms_epsilon", nan), (f"{a}.attention.layer_norm_rms_epsilon", inf),
        (f"{a}.rope.freq_base", nan), (f"{a}.rope.freq_base", -inf),
        (f"{a}.attention.head_count_kv", 3),  # does not divide the 4 query heads
        (f"{a}.attention.head_count", 3)]]  # 3 heads of 64 do not make the model's projections
    if arch == "gemma3":
        cases += [("gemma3.attention.sliding_window", {"gemma3.attention.sliding_window": 0}),
                  ("gemma3.attention.sliding_window_pattern", {"gemma3.attention.sliding_window_pattern": 0}),
                  # 4 heads of 32 do not make the q projection's 256 rows
                  ("blk.0.attn_q.weight", {"gemma3.attention.key_length": 32, "gemma3.attention.value_length": 32})]
    return cases


@pytest.mark.parametrize("arch", synthetic_models.ARCHS)
def test_malformed_metadata_of_every_architecture_is_refused_naming_its_key(tmp_path, arch):
    for i, (key, overrides) in enumerate(malformed(arch)):
        path = tmp_path / f"bad{i}.gguf"
        synthetic_models.write(arch, "Q8_0", str(path), overrides=overrides)
        r = subprocess.run([BIN, "generate", "--model", str(path), "--prompt", "hello", "--n", "2"],
                           capture_output=True, encoding="utf-8", errors="replace")
        assert r.returncode != 0, (overrides, "accepted")
        assert key in r.stderr and "error" in r.stderr, (overrides, r.stderr[-500:])
        assert "Aborted" not in r.stderr and "terminate" not in r.stderr
