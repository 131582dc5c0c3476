#!/usr/bin/env python3
"""The `openai` Python client against `witcert serve`: chat and completions, streaming and not,
models.list(), and an API error; curl checks the SSE framing byte for byte. Starts the server on a
free port and stops it with SIGTERM (it must exit 0).

Usage: openai_client_test.py WITCERT_BINARY MODEL_GGUF
"""
import concurrent.futures
import json
import re
import signal
import subprocess
import sys
import time

import openai


def main() -> int:
    binary, model = sys.argv[1], sys.argv[2]
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", "0", "--kv", "dither-int8", "--kv-memory", "64M",
         "--max-tokens", "16", "--api-key", "test-key"],
        stderr=subprocess.PIPE, text=True)
    try:
        line = server.stderr.readline()
        match = re.search(r"listening on (http://[0-9.]+:[0-9]+)", line)
        assert match, f"no listening line: {line!r}"
        base = match.group(1)
        ready = server.stderr.readline()
        assert "ready" in ready, ready
        client = openai.OpenAI(base_url=base + "/v1", api_key="test-key")

        models = client.models.list()
        names = [m.id for m in models.data]
        assert names == ["SmolLM2-135M-Instruct.Q4_1"], names

        chat = client.chat.completions.create(
            model=names[0], messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0)
        text = chat.choices[0].message.content
        assert text, chat
        assert chat.usage.completion_tokens >= 1
        meter = chat.model_extra["witcert"]
        assert meter["kv"] == "dither-int8" and meter["cells"] > 0, meter

        streamed, last_meter, usage = "", None, None
        for chunk in client.chat.completions.create(
                model=names[0], messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            for choice in chunk.choices:
                streamed += choice.delta.content or ""
            if chunk.model_extra and "witcert" in chunk.model_extra:
                last_meter = chunk.model_extra["witcert"]
            if chunk.usage:
                usage = chunk.usage
        assert streamed == text, (streamed, text)
        assert last_meter == meter, (last_meter, meter)
        assert usage.completion_tokens == chat.usage.completion_tokens

        completion = client.completions.create(model=names[0], prompt="The capital of France is", max_tokens=6,
                                               temperature=0, logprobs=2)
        assert completion.choices[0].text, completion
        assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens
        parts = [c.choices[0].text for c in client.completions.create(
            model=names[0], prompt="The capital of France is", max_tokens=6, temperature=0, stream=True) if c.choices]
        assert "".join(parts) == completion.choices[0].text, (parts, completion.choices[0].text)

        try:
            client.chat.completions.create(model=names[0], messages=[{"role": "user", "content": "Hi"}], n=2)
            raise AssertionError("n=2 was accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "n", e.body
        try:
            openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
            raise AssertionError("a wrong key was accepted")
        except openai.AuthenticationError:
            pass

        # curl: the raw SSE framing, every event one `data:` line and a blank line, ending [DONE].
        raw = subprocess.run(
            ["curl", "-sN", base + "/v1/completions", "-H", "Authorization: Bearer test-key",
             "-H", "Content-Type: application/json",
             "-d", json.dumps({"prompt": "Water boils at", "max_tokens": 5, "stream": True})],
            check=True, capture_output=True, text=True).stdout
        events = raw.split("\n\n")
        assert events[-1] == "", repr(raw[-40:])
        assert events[-2] == "data: [DONE]", events[-2]
        for e in events[:-2]:
            assert e.startswith("data: ") and "\n" not in e, repr(e)
            json.loads(e[len("data: "):])
        print(f"openai client: chat {text!r}, completion {completion.choices[0].text!r}, {len(events) - 2} SSE events")

        # SIGTERM under load: the running requests complete, then the server exits 0.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(client.completions.create, model=names[0], prompt=f"Story {i}:", max_tokens=24,
                                   temperature=0) for i in range(4)]
            time.sleep(0.5)
            server.send_signal(signal.SIGTERM)
            answers = [f.result() for f in futures]
        assert all(a.usage.completion_tokens == 24 or a.choices[0].finish_reason == "stop" for a in answers), answers
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    assert code == 0, f"witcert serve exited {code} on SIGTERM"
    return 0


if __name__ == "__main__":
    sys.exit(main())
