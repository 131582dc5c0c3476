"""Every architecture × weight format WitCert runs, on small random-weight GGUFs written by
tools/synthetic_models.py: `witcert logits` against the independent numpy forward pass of
tools/reference_llama.py, and `witcert generate` with a certified cache and the soundness check.
Environment: WITCERT_BIN (the `witcert` binary); scripts/python-test.sh sets it."""
import json
import os
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


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "dither-int8", "kivi-2bit", "fp8-e4m3"])
@pytest.mark.parametrize("arch", synthetic_models.ARCHS)
def test_certified_cache_is_sound_on_every_architecture(models, arch, kv):
    path = models(arch, "Q8_0")
    for page in ("1", "16"):
        run = subprocess.run([BIN, "generate", "--model", str(path), "--prompt", PROMPTS[2], "--n", "8", "--kv", kv,
                              "--page-size", page, "--tau-k", "0.2", "--check-soundness"],
                             capture_output=True, encoding="utf-8", errors="replace")
        assert run.returncode == 0, run.stderr
        assert " 0 violations" in run.stderr, run.stderr
