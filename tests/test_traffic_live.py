"""Live load counted by hydra itself, on the real llama-server (issue 29, "Done when"): while one
stream decodes through `hydra up -p demo --metrics-port M`, the status shows its lane with a
request in flight and tokens/s above 0; afterwards the request table holds it with its TTFT and
exactly llama-server's own count of generated tokens; /api/history and /metrics answer."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
import requests

from hydra_supervisor.testing.harness import free_port, run_hydra, snapshot, wait_until

pytestmark = pytest.mark.slow


def test_a_decoding_stream_shows_as_live_load_then_on_record(hydra_up, hydra_env):
    port, mport = free_port(), free_port()
    up = hydra_up("-p", "demo", "--port", str(port), "--metrics-port", str(mport))
    up.wait_ready()
    events: list[bytes] = []
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            with requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", stream=True,
                               timeout=300, json={
                                   "model": "demo", "stream": True, "max_tokens": 400,
                                   "messages": [{"role": "user", "content": "Tell a story"}]}
                               ) as r:
                r.raise_for_status()
                events.extend(line for line in r.iter_lines() if line.startswith(b"data:"))
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            failed.append(e)

    client = threading.Thread(target=stream, daemon=True)
    client.start()

    def decoding():
        lane = next((x for _, x in snapshot(hydra_env).lanes()), None)
        return lane if lane is not None and lane.inflight >= 1 and lane.tokens_per_s > 0 \
            else None

    lane = wait_until(decoding, 120, "the lane in flight with tokens/s > 0", interval=0.2)
    assert lane.name == f"port-{port}/demo" and lane.generated_tokens > 0
    # the CLI's JSON says the same (its lanes come from the same snapshot)
    cli = json.loads(run_hydra(hydra_env, "status", "--json").stdout)
    (cli_lane,) = cli["daemon"]["ports"][0]["lanes"]
    assert {"queued", "tokens_per_s", "generated_tokens", "prompt_tokens", "cut"} <= \
        cli_lane.keys()
    assert "requests" not in cli["status"]  # the summary (status.json) stays small
    running = [r for r in snapshot(hydra_env).requests if r.ended == "running"]
    assert running and running[-1].profile == "demo" and running[-1].stream

    client.join(300)
    assert not client.is_alive() and not failed, failed
    timings = json.loads(next(e for e in reversed(events) if b'"timings"' in e)[5:])
    predicted = timings["timings"]["predicted_n"]

    def on_record():
        done = [r for r in snapshot(hydra_env).requests
                if r.path == "/v1/chat/completions" and r.ended != "running"]
        return done[-1] if done else None

    rec = wait_until(on_record, 10, "the request on record")
    assert rec.ended == "ok" and rec.status == 200 and rec.stream and rec.profile == "demo"
    assert rec.model == "demo" and rec.client.startswith("127.0.0.1:")
    assert rec.ttft_s is not None and 0 < rec.ttft_s < rec.duration_s
    assert rec.generated_tokens == predicted > 0
    assert rec.prompt_tokens == timings["timings"]["prompt_n"] + timings["timings"]["cache_n"]
    assert rec.decode_tps is not None and rec.decode_tps > 0
    lane = next(x for _, x in snapshot(hydra_env).lanes())
    assert lane.generated_tokens == predicted and lane.inflight == 0

    table = run_hydra(hydra_env, "status", "--requests")
    assert table.returncode == 0
    assert f"{rec.prompt_tokens}/{rec.cached_tokens}/{predicted}" in table.stdout, table.stdout
    listed = json.loads(run_hydra(hydra_env, "status", "--requests", "--json").stdout)
    assert listed[-1]["generated_tokens"] == predicted and listed[-1]["ended"] == "ok"

    def history():
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/api/history",
                                    timeout=30) as r:
            hist = json.load(r)
        series = hist["series"][f"port-{port}/demo"]
        # whole seconds only: the stream's last second shows once it is over
        return hist if abs(sum(series["tokens_per_s"]) - predicted) < 0.5 else None

    hist = wait_until(history, 10, "every generated token in the history")
    series = hist["series"][f"port-{port}/demo"]
    assert hist["step_s"] == 1.0 and max(series["inflight"]) == 1
    assert len(series["tokens_per_s"]) == len(series["requests"]) == len(series["queued"])
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30) as r:
        text = r.read().decode()
    assert f'hydra_generated_tokens_total{{engine="port-{port}/demo",profile="demo"}} ' \
        f"{float(predicted)}" in text
