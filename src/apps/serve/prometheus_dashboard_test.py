#!/usr/bin/env python3
"""A real Prometheus scrapes `witcert serve` once a second during a load run; the series read back
through Prometheus's query API equal the sums of the responses' `usage` and `witcert` objects,
`promtool check metrics` accepts the exposition, and Prometheus runs the shipped configuration and
answers every query of the shipped Grafana dashboard (examples/monitoring/). Headless Chromium loads the dashboard after the
load: its banner, heatmap and coverage plot are drawn from the server's live samples. Then an
ungated q4_0 server, a gated q4_0 one and a dither-int8 one: their dashboards read at-risk,
repaired and healthy. Screenshots of all four are saved.

Usage: prometheus_dashboard_test.py WITCERT_BINARY MODEL_GGUF OUT_DIR
"""
import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return r.read()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def query(prom: str, expr: str) -> float:
    out = json.loads(get(prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    result = out["data"]["result"]
    return float(result[0]["value"][1]) if result else float("nan")


MONITORING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "monitoring")
CHROMIUM = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900",
            "--virtual-time-budget=5000"]


def dashboard(base: str, shot: str) -> dict:
    """The dashboard as headless Chromium draws it: the banner's verdict, the heatmap's drawn and
    above-τ cells, the coverage plot's points and the subtitle; a screenshot saved to `shot`."""
    dom = subprocess.run(CHROMIUM + ["--dump-dom", base + "/"], capture_output=True, text=True, timeout=120).stdout
    heat = re.search(r'id="heatmap"[^>]*data-cells="(\d+)" data-above="(\d+)"', dom)
    points = re.search(r'id="coverage"[^>]*data-points="(\d+)"', dom)
    verdict = re.search(r'id="verdict"[^>]*data-verdict="([a-z-]+)"', dom)
    sub = re.search(r'id="sub">([^<]*)<', dom)
    assert heat and points and verdict and sub, dom[:3000]
    subprocess.run(CHROMIUM + ["--screenshot=" + shot, base + "/"], capture_output=True, timeout=120)
    assert os.path.getsize(shot) > 10000, "no screenshot"
    return {"verdict": verdict.group(1), "cells": int(heat.group(1)), "above": int(heat.group(2)),
            "points": int(points.group(1)), "sub": sub.group(1), "shot": shot}


def start(binary: str, model: str, *flags: str):
    server = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--kv-memory", "64M",
                               "--max-tokens", "12", *flags], stderr=subprocess.PIPE, text=True)
    base = re.search(r"listening on (http://[0-9.]+:[0-9]+)", server.stderr.readline()).group(1)
    assert "ready" in server.stderr.readline()
    return server, base


def stop(server) -> None:
    server.send_signal(signal.SIGTERM)
    code = server.wait(timeout=60)
    assert code == 0, f"witcert serve exited {code}"


def healthy_or_not(binary: str, model: str, out_dir: str) -> None:
    """An ungated q4_0 server, a gated q4_0 one and a dither-int8 one under the same small load:
    the first banner reads at-risk with red heatmap cells, the second repaired and the third
    healthy, with none."""
    prompts = [f"The keeper's log, night {i}: the lamp was lit at dusk, the sea was calm, and" for i in range(4)]
    for name, flags, want in (("q4_0", ["--kv", "q4_0"], "at-risk"),
                              ("q4_0-gated", ["--kv", "q4_0", "--tau-k", "0.2"], "repaired"),
                              ("dither-int8", ["--kv", "dither-int8"], "certified")):
        server, base = start(binary, model, *flags)
        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                done = list(pool.map(lambda p: post(base + "/v1/completions", {"prompt": p, "max_tokens": 8}), prompts))
            get(base + "/state")
            assert {r["witcert"]["verdict"] for r in done} == {want}, [r["witcert"]["reason"] for r in done]
            d = dashboard(base, os.path.join(out_dir, f"dashboard-{name}.png"))
            assert d["verdict"] == want and ("no gate" in d["sub"]) == ("--tau-k" not in flags), d
            assert (d["above"] > 0) == (want == "at-risk") and d["points"] >= 1, d
            print(f"dashboard {name}: {d}")
        finally:
            stop(server)


def main() -> int:
    binary, model, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp()
    server = subprocess.Popen([binary, "serve", "--model", model, "--port", "0", "--kv", "q8_0", "--kv-v", "rtn-int4",
                               "--gate", "0.2", "--kv-memory", "64M", "--max-tokens", "12"],
                              stderr=subprocess.PIPE, text=True)
    prom = None
    try:
        base = re.search(r"listening on (http://[0-9.]+:[0-9]+)", server.stderr.readline()).group(1)
        assert "ready" in server.stderr.readline()
        exposition = get(base + "/metrics")
        check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr

        # The shipped configuration, pointed at this server's port.
        port = free_port()
        shipped = open(os.path.join(MONITORING, "prometheus.yml")).read()
        assert "'127.0.0.1:8080'" in shipped
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            f.write(shipped.replace("127.0.0.1:8080", base[len("http://"):]))
        prom = subprocess.Popen(["prometheus", "--config.file=" + os.path.join(tmp, "prometheus.yml"),
                                 "--storage.tsdb.path=" + os.path.join(tmp, "data"),
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        prom_url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if json.loads(get(prom_url + "/api/v1/targets"))["data"]["activeTargets"][0]["health"] == "up":
                    break
            except Exception:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("prometheus never scraped the server")

        # The load: 12 requests, 6 at once, while the test samples /state (the dashboard's history).
        prompts = [f"Question {i}: name {i + 2} animals that live in the sea." for i in range(12)]
        done = []
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(post, base + "/v1/completions", {"prompt": p, "max_tokens": 12}) for p in prompts]
            while not all(f.done() for f in futures):
                get(base + "/state")
                time.sleep(0.3)
            done = [f.result() for f in futures]
        get(base + "/state")
        completion = sum(r["usage"]["completion_tokens"] for r in done)
        prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in done)
        cells = sum(r["witcert"]["cells"] for r in done)
        page_ins = sum(r["witcert"]["page_ins"] for r in done)

        # Prometheus's view, once a scrape after the load has landed.
        deadline = time.time() + 60
        while query(prom_url, "witcert_generation_tokens_total") != completion and time.time() < deadline:
            time.sleep(0.5)
        assert query(prom_url, "witcert_generation_tokens_total") == completion
        assert query(prom_url, "witcert_prompt_tokens_total") == prompt_tokens
        assert query(prom_url, 'witcert_meter_cells_total{side="K",scheme="q8_0"}') == cells
        assert query(prom_url, 'witcert_meter_cells_total{side="V",scheme="rtn-int4"}') == cells
        assert query(prom_url, "witcert_page_ins_total") == page_ins
        assert query(prom_url, "sum(witcert_requests_total)") == len(done)
        assert query(prom_url, "witcert_meter_raw_score_count") == cells
        assert query(prom_url, "witcert_requests_running") == 0
        assert query(prom_url, "witcert_kv_pool_capacity_bytes") > 0
        check = subprocess.run(["promtool", "check", "metrics"], input=get(base + "/metrics"), capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
        # Every query of the shipped Grafana dashboard is valid PromQL over series the server exports:
        # each returns data once the load has been scraped.
        grafana = json.load(open(os.path.join(MONITORING, "grafana-dashboard.json")))
        exprs = [t["expr"] for panel in grafana["panels"] for t in panel["targets"]]
        assert len(exprs) >= 8, exprs
        # A rate() needs two samples of its series, and a series born during the load may have only
        # one so far: each query gets until a deadline, over further scrapes, to return data.
        deadline = time.time() + 60
        for expr in exprs:
            while True:
                out = json.loads(get(prom_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
                if out["status"] != "success" or out["data"]["result"] or time.time() > deadline:
                    break
                time.sleep(0.5)
            assert out["status"] == "success" and out["data"]["result"], (expr, out)

        # The dashboard in headless Chromium: drawn from the server's samples and heatmap; the gate
        # made every cell meet τ, so the banner says healthy and no heatmap cell is above τ.
        verdicts = {r["witcert"]["verdict"] for r in done}
        assert verdicts <= {"certified", "repaired"}, verdicts
        assert query(prom_url, "sum(witcert_requests_verdict_total)") == len(done)
        d = dashboard(base, os.path.join(out_dir, "dashboard.png"))
        assert d["verdict"] == ("repaired" if "repaired" in verdicts else "certified"), d
        assert d["cells"] == 30 * 9 and d["above"] == 0 and d["points"] >= 1, d
        assert "gate τ_K 0.2" in d["sub"], d
        print(f"prometheus: {len(done)} requests, {completion} tokens, {cells} cells agree; dashboard {d}")
    finally:
        if prom:
            prom.terminate()
            prom.wait(timeout=30)
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
    assert code == 0, f"witcert serve exited {code}"
    healthy_or_not(binary, model, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
