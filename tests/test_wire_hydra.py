"""The Hydra wire protocol on a running hydra's external port (real processes).

INFO is truthful; CONFIGURE by tier: T1 restarts nothing, T2 restarts the head only (its peer
keeps its pid), T4 is refused, the same payload twice is a no-op; SET_EXPERT_MODE switches a
COMBINE profile to SOLO and back; fuzzed frames leave hydra serving HTTP; STATE_GET then
STATE_PUT through hydra.
"""

from __future__ import annotations

import os
import random
import socket
import struct

import pytest
import requests

from hydra_supervisor.testing.harness import snapshot, status_json, wait_until
from tests.wire_client import (
    BAD_REQUEST,
    DECODE,
    NOT_IMPLEMENTED,
    OK,
    STATE_GET,
    STATE_PUT,
    WireClient,
)

pytestmark = pytest.mark.slow


def _port(env: dict[str, str]) -> int:
    return snapshot(env).ports[0].port


def _pids(env: dict[str, str]) -> dict[str, int]:
    return {e["name"]: e["pid"] for e in status_json(env)["status"]["engines"]}


def _chat(port: int) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                         json={"messages": [{"role": "user", "content": "Hi"}],
                               "max_tokens": 4})


def test_info_configure_tiers_and_expert_mode(hydra_up, hydra_env):
    up = hydra_up("--profile", "demo-combine", "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    before = _pids(hydra_env)
    with WireClient("127.0.0.1", port) as c:
        info = c.info()
        assert info.status == OK
        m = info.meta
        assert m["profile"] == "demo-combine" and m["mode"] == "combine"
        assert [p["name"] for p in m["peers"]] == ["peer-cpu-peer"] or m["peers"]
        assert {p["name"] for p in m["processes"]} == set(before)
        assert m["build"].get("version")
        # capabilities: the list of words docs/protocol.md names (the fork's clients parse a
        # list); per op, served or not; the expert modes this layout offers
        assert m["capabilities"] == ["state_transfer", "prefill", "configure", "expert_mode"]
        assert m["ops"]["STATE_GET"] == "served" and m["ops"]["DECODE"] == "not_implemented"
        assert m["expert_modes"] and set(m["expert_modes"]) <= {"solo", "combined"}
        # T1: no process restarts
        r = c.configure({"temperature": 0.3, "n_predict": 16})
        assert r.status == OK, r.meta
        assert _pids(hydra_env) == before
        # the same payload twice: a no-op
        r = c.configure({"temperature": 0.3, "n_predict": 16})
        assert r.status == OK and not r.meta.get("restarted")
        # T4: refused with a clear error, nothing restarts
        r = c.configure({"port": 1234})
        assert r.status != OK and "port" in str(r.meta).lower()
        # T2: the head restarts, its peer keeps running
        r = c.configure({"ctx_size": 2048})
        assert r.status == OK, r.meta
        after = _pids(hydra_env)
        head = next(n for n in after if n.endswith(".head"))
        peer = next(n for n in after if not n.endswith(".head"))
        assert after[head] != before[head] and after[peer] == before[peer]
        assert r.meta.get("restarted") == [head]
        assert _chat(port).status_code == 200
        # SET_EXPERT_MODE solo: the layout becomes SOLO; combined brings the peer back
        r = c.expert_mode("solo")
        assert r.status == OK and r.meta["mode"] == "solo", r.meta
        assert status_json(hydra_env)["status"]["mode"] == "solo"
        assert _chat(port).status_code == 200
        r = c.expert_mode("combined")
        assert r.status == OK and r.meta["mode"] == "combined", r.meta
        assert status_json(hydra_env)["status"]["mode"] == "combine"
        # unserved ops
        assert c.request(DECODE, "0").status == NOT_IMPLEMENTED
    assert _chat(port).status_code == 200


def test_state_get_put_and_fuzz_through_hydra(hydra_up, hydra_env, tmp_path):
    # Gemma 3 slides its attention window: a restored slot is served from cache only with
    # --swa-full (docs/protocol.md); plain llama models need nothing.
    prof = tmp_path / "demo-swa.yaml"
    prof.write_text("profile: demo-swa\nmodel: gemma3-270m\nmode: solo\nhead: cpu\n"
                    "server_args:\n  ctx-size: 2048\n  swa-full: true\n")
    up = hydra_up("--profile", str(prof), "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True}
    r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120)
    assert r.status_code == 200, r.text
    with WireClient("127.0.0.1", port) as c:
        got = c.request(STATE_GET, "0")
        assert got.status == OK and len(got.payload) > 1000, got.meta
        # wipe the slot, then put the state back: the prompt is served from cache
        requests.post(f"http://127.0.0.1:{port}/slots/0?action=erase", timeout=30)
        put = c.request(STATE_PUT, "0", got.payload)
        assert put.status == OK, put.meta
    r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120)
    assert r.json()["timings"]["cache_n"] > 0
    # fuzz: random and truncated frames, then HTTP still answers
    rng = random.Random(7)
    for _ in range(60):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            head = struct.pack("<HBBHQH", 0x4859, rng.randrange(256), rng.randrange(256),
                               rng.randrange(1 << 16), rng.choice([0, 5, 1 << 40, (1 << 64) - 1]),
                               rng.randrange(1 << 16))
            s.sendall(head[: rng.randrange(1, len(head) + 1)] + os.urandom(rng.randrange(64)))
            s.shutdown(socket.SHUT_WR)
            try:
                s.recv(4096)
            except OSError:
                pass
    with WireClient("127.0.0.1", port) as c:
        bad = c.request(0x41, "x" * 300)
        assert bad.status in (OK, BAD_REQUEST)
    wait_until(lambda: _chat(port).status_code == 200, 60, "HTTP after fuzzing")


def test_keep_slots_across_restart_and_switch(hydra_up, hydra_env, tmp_path):
    base = ("model: gemma3-270m\nmode: solo\nhead: cpu\nkeep_slots: true\n"
            "server_args:\n  ctx-size: 2048\n  threads: 1\n")
    a, b = tmp_path / "slots-a.yaml", tmp_path / "slots-b.yaml"
    a.write_text("profile: slots-a\n" + base)
    b.write_text("profile: slots-b\n" + base + "  n-predict: 32\n")
    up = hydra_up("--profile", str(a), "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    prompt = "Once upon a time in a small village by the sea there lived an old fisherman. " * 4
    body = {"prompt": prompt, "n_predict": 1, "id_slot": 0, "cache_prompt": True}

    def cached() -> int:
        r = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["timings"]["cache_n"])

    assert cached() == 0
    from hydra_supervisor.testing.harness import run_hydra

    res = run_hydra(hydra_env, "restart", "head", "--json", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert cached() > 0  # served from the slot saved before the restart
    import json as _json

    rep = _json.loads(run_hydra(hydra_env, "switch", str(b), "--json", timeout=180).stdout)
    assert rep["result"] == "ok" and "restore_slots" in rep["phases"], rep
    assert any("restored 1 of" in n for n in rep["notes"]), rep
    assert cached() > 0
    rep = _json.loads(run_hydra(hydra_env, "switch", str(a), "--json", timeout=180).stdout)
    assert rep["result"] == "ok", rep
    assert cached() > 0
