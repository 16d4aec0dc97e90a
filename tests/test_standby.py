"""Standby layouts on real llama.cpp processes: `hydra up -p demo-moe-combine` keeps its SOLO
(demo-moe) loaded beside it; `hydra switch` and the wire protocol's SET_EXPERT_MODE flip
between them under a steady streaming client with no failed request and no process
restarted (every pid unchanged); a standby whose head is killed is restarted by its own
supervisor while the active layout serves on untouched.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import requests

from hydra_supervisor.serve.snapshot import LaneStatus
from hydra_supervisor.testing.harness import (
    REPO,
    Up,
    lanes,
    make_env,
    run_hydra,
    snapshot,
    wait_until,
)
from hydra_supervisor.testing.load import Load
from tests.test_switch import _switch
from tests.wire_client import OK, WireClient

pytestmark = pytest.mark.slow


def _rows(env: dict[str, str]) -> list[LaneStatus]:
    return lanes(env)


def _standby_ready(env: dict[str, str]) -> list[LaneStatus] | None:
    rows = _rows(env)
    if len(rows) == 2 and rows[1].role == "standby" and rows[1].state == "serving" \
            and rows[1].warm_s is not None:
        return rows
    return None


def _ctl_switch(env: dict[str, str], profile: str) -> dict[str, Any]:
    """The control API in process (no CLI start-up between the stream and the switch)."""
    from hydra_supervisor.runtime import control_client

    sock = control_client.socket_path(Path(env["HYDRA_STATE_DIR"]))
    _, rep = control_client.call(sock, "POST", "/switch", {"profile": profile}, timeout=60)
    return dict(rep)


def _pids(rows: list[LaneStatus]) -> dict[str, int | None]:
    return {p.name: p.pid for r in rows for p in r.processes}


def _up(hydra_up: Any, env: dict[str, str]) -> tuple[int, list[LaneStatus]]:
    up = hydra_up("--profile", "demo-moe-combine", "--port", "0")
    up.wait_ready(180)
    rows = wait_until(lambda: _standby_ready(env), 180, "the standby loaded and warm")
    return snapshot(env).ports[0].port, rows


def test_switch_and_expert_mode_flip_without_restarts_or_failures(hydra_up, hydra_env):
    port, rows = _up(hydra_up, hydra_env)
    assert [(r.profile, r.role) for r in rows] == [("demo-moe-combine", "active"),
                                                   ("demo-moe", "standby")]
    assert rows[1].needs_mib["host"] > 0 and rows[0].needs_mib["host"] > 0
    pids = _pids(rows)
    assert set(pids) == {"demo-moe-combine.peer-cpu-peer", "demo-moe-combine.head",
                         "demo-moe.head"}
    models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["standby"]) for m in models] == [("demo-moe-combine", False),
                                                         ("demo-moe", True)]
    text = run_hydra(hydra_env, "status").stdout
    assert "standby demo-moe (solo) for demo-moe-combine — serving" in text, text
    with Load(port) as load, WireClient("127.0.0.1", port) as wire:
        wait_until(lambda: load.ok >= 2, 120, "first requests served")
        for how, target in (("switch", "demo-moe"), ("wire", "combined"),
                            ("wire", "solo"), ("switch", "demo-moe-combine")):
            before = load.ok
            if how == "switch":
                rep = _switch(hydra_env, target)
                assert rep["_rc"] == 0 and rep["result"] == "ok" and rep["instant"], rep
                assert rep["restarted"] == [] and set(rep["phases"]) == {"flip"}, rep
                want = target
            else:
                r = wire.expert_mode(target)
                assert r.status == OK and r.meta["instant"] and r.meta["mode"] == target, r.meta
                want = "demo-moe" if target == "solo" else "demo-moe-combine"
            rows = _rows(hydra_env)
            assert rows[0].profile == want and rows[0].role == "active" \
                and rows[1].role == "standby"
            wait_until(lambda b=before: load.ok > b + 1, 120, f"requests served by {want}")
        assert _pids(_rows(hydra_env)) == pids  # no process restarted
    assert load.failures == [] and load.cut == [], (load.failures, load.cut)
    # the flips are the port's switch history, numbered on
    assert [s.to for s in _rows(hydra_env)[0].switches] == [
        "demo-moe", "demo-moe-combine", "demo-moe", "demo-moe-combine"]


def test_a_dead_standby_is_restarted_and_the_active_layout_untouched(hydra_up, hydra_env):
    port, rows = _up(hydra_up, hydra_env)
    active = _pids(rows[:1])
    head = next(p for p in rows[1].processes if p.name == "demo-moe.head")
    assert head.pid is not None
    with Load(port) as load:
        wait_until(lambda: load.ok >= 2, 120, "first requests served")
        os.kill(head.pid, signal.SIGKILL)

        def back() -> bool:
            r = _rows(hydra_env)
            p = next(p for p in r[1].processes if p.name == "demo-moe.head")
            return r[1].state == "serving" and p.pid not in (None, head.pid)
        wait_until(back, 120, "the standby's head restarted by its supervisor")
        n = load.ok
        wait_until(lambda: load.ok > n + 1, 120, "requests served meanwhile")
        rows = _rows(hydra_env)
        assert _pids(rows[:1]) == active and rows[0].state == "serving"
        assert next(p for p in rows[1].processes).restarts == 1
        # and it takes over at once again
        rep = _switch(hydra_env, "demo-moe")
        assert rep["result"] == "ok" and rep["instant"], rep
        n = load.ok
        wait_until(lambda: load.ok > n + 1, 120, "requests served by the standby")
    assert load.failures == [] and load.cut == [], (load.failures, load.cut)


def test_plan_shows_both_layouts(hydra_env):
    res = run_hydra(hydra_env, "plan", "-p", "demo-moe-combine", "--json")
    assert res.returncode == 0, res.stderr
    both = json.loads(res.stdout)["standby"]
    assert both["active"]["profile"] == "demo-moe-combine" and both["same_model"]
    assert both["standby"]["profile"] == "demo-moe" and both["fits"]
    assert both["standby"]["needs_mib"]["host"] > 0 and both["active"]["needs_mib"]["host"] > 0
    text = run_hydra(hydra_env, "plan", "-p", "demo-moe-combine").stdout
    assert "standby demo-moe (solo): host" in text and "both fit" in text, text


def test_no_room_for_both_reloads_and_says_why(hydra_up, tmp_path):
    # host memory as the node file says it: 700 MiB, room for one layout, not both
    env = make_env(tmp_path, "devices:\n  cpu: {cpu: true, memory_mib: 700}\n"
                             "  cpu-peer: {cpu: true, memory_mib: 700}\n")
    up = Up(env, ["--profile", "demo-moe-combine", "--port", "0"], tmp_path)
    try:
        up.wait_ready(180)

        def said() -> list[LaneStatus] | None:
            rows = _rows(env)
            return rows if len(rows) == 2 and rows[1].why else None
        rows = wait_until(said, 60, "the standby's reason")
        why = rows[1].why or ""
        assert rows[1].role == "standby" and rows[1].state == "stopped", rows[1]
        assert "host:" in why and "MiB short" in why, why
        assert [p.name for r in rows for p in r.processes] == [
            "demo-moe-combine.peer-cpu-peer", "demo-moe-combine.head"]
        rep = _switch(env, "demo-moe")
        assert rep["result"] == "ok" and rep["instant"] is False, rep
        assert "MiB short" in rep["not_instant"] and "start" in rep["phases"], rep
        assert _rows(env)[0].profile == "demo-moe"
    finally:
        up.stop()
        up.kill_everything()


def test_a_stream_in_flight_finishes_on_the_old_layout(hydra_up, hydra_env):
    port, rows = _up(hydra_up, hydra_env)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Tell a long story"}],
            "max_tokens": 1500, "stream": True}  # seconds of tokens: in flight at the flip
    models: list[str] = []
    with requests.post(url, json=body, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:  # the first token, from the active layout
            if line.startswith(b"data: {"):
                models.append(json.loads(line[6:])["model"])
                break
        rep = _ctl_switch(hydra_env, "demo-moe")
        assert rep["result"] == "ok" and rep["instant"], rep
        assert "1 request(s) in flight" in rep["notes"][0], rep["notes"]
        # a new request meanwhile: the new layout answers it
        other = requests.post(url, json={**body, "stream": False, "max_tokens": 2}, timeout=120)
        assert other.status_code == 200 and other.json()["model"] == "demo-moe"
        models += [json.loads(line[6:])["model"] for line in lines
                   if line.startswith(b"data: {")]
    assert len(models) > 10 and set(models) == {"demo-moe-combine"}, models


def test_keep_slots_carries_the_prompt_cache_across_a_flip(hydra_up, hydra_env, tmp_path):
    pdir = tmp_path / "profiles"
    pdir.mkdir()
    for name in ("demo-moe-combine", "demo-moe"):
        text = (REPO / "profiles" / f"{name}.yaml").read_text()
        (pdir / f"{name}.yaml").write_text(text.replace("\nhost:", "\nkeep_slots: true\nhost:"))
    up = hydra_up("--profile", "demo-moe-combine", "--port", "0", "--profiles-dir", str(pdir))
    up.wait_ready(180)
    wait_until(lambda: _standby_ready(hydra_env), 180, "the standby loaded and warm")
    url = f"http://127.0.0.1:{snapshot(hydra_env).ports[0].port}/completion"
    prompt = " ".join(f"word{i}" for i in range(200))
    first = requests.post(url, json={"prompt": prompt, "n_predict": 2}, timeout=120).json()
    assert first["model"] == "demo-moe-combine" and first["timings"]["prompt_n"] > 100
    rep = _ctl_switch(hydra_env, "demo-moe")
    assert rep["instant"] and {"save_slots", "restore_slots", "flip"} <= set(rep["phases"])
    assert any(n.startswith("keep_slots: restored 1 of 1") for n in rep["notes"]), rep
    again = requests.post(url, json={"prompt": prompt, "n_predict": 2}, timeout=120).json()
    assert again["model"] == "demo-moe"
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1, again["timings"]


def test_restart_head_restarts_the_serving_layouts_head_before_and_after_a_flip(hydra_up,
                                                                               hydra_env):
    """Both layouts of a standby pair have a head: `hydra restart head` restarts the serving
    one's (never the standby's), before and after a flip, and the reply says which."""
    _up(hydra_up, hydra_env)
    for active, standby in (("demo-moe-combine", "demo-moe"), ("demo-moe", "demo-moe-combine")):
        if _rows(hydra_env)[0].profile != active:
            rep = _switch(hydra_env, active)
            assert rep["_rc"] == 0 and rep["instant"], rep
        wait_until(lambda: _standby_ready(hydra_env), 180, "the pair loaded")
        pids = _pids(_rows(hydra_env))
        res = run_hydra(hydra_env, "restart", "head", "--json", timeout=240)
        reply = json.loads(res.stdout)
        assert res.returncode == 0 and reply["engine"] == f"{active}.head", reply
        assert f"the serving layout's {active}.head" in reply["message"], reply["message"]
        assert f"the standby's {standby}.head was not touched" in reply["message"]
        now = _pids(_rows(hydra_env))
        assert now[f"{active}.head"] != pids[f"{active}.head"]  # restarted
        assert now[f"{standby}.head"] == pids[f"{standby}.head"]  # untouched
        assert _rows(hydra_env)[0].profile == active
