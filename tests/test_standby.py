"""Standby layouts on real llama.cpp processes: `hydra up -p demo-moe-combine` keeps its SOLO
(demo-moe) loaded beside it; `hydra switch` and the wire protocol's SET_EXPERT_MODE flip
between them under a steady streaming client with no failed request and no process
restarted (every pid unchanged); a standby whose head is killed is restarted by its own
supervisor while the active layout serves on untouched.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import requests

from tests.harness import run_hydra, status_json, wait_until
from tests.test_switch import Load, _switch
from tests.wire_client import OK, WireClient

pytestmark = pytest.mark.slow


def _rows(env: dict[str, str]) -> list[dict[str, Any]]:
    return list(status_json(env)["daemon"]["engines"])


def _standby_ready(env: dict[str, str]) -> list[dict[str, Any]] | None:
    rows = _rows(env)
    if len(rows) == 2 and rows[1].get("standby") and rows[1]["state"] == "serving" \
            and rows[1].get("warm_s") is not None:
        return rows
    return None


def _pids(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {p["name"]: p["pid"] for r in rows for p in r["processes"]}


def _up(hydra_up: Any, env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    up = hydra_up("--profile", "demo-moe-combine", "--port", "0")
    up.wait_ready(180)
    rows = wait_until(lambda: _standby_ready(env), 180, "the standby loaded and warm")
    return int(rows[0]["port"]), rows


def test_switch_and_expert_mode_flip_without_restarts_or_failures(hydra_up, hydra_env):
    port, rows = _up(hydra_up, hydra_env)
    assert [(r["profile"], r["standby"]) for r in rows] == [("demo-moe-combine", False),
                                                              ("demo-moe", True)]
    assert rows[1]["needs_mib"]["host"] > 0 and rows[0]["needs_mib"]["host"] > 0
    pids = _pids(rows)
    assert set(pids) == {"peer-cpu-peer", "head", "demo-moe.head"}
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
            assert rows[0]["profile"] == want and not rows[0]["standby"] and rows[1]["standby"]
            wait_until(lambda b=before: load.ok > b + 1, 120, f"requests served by {want}")
        assert _pids(_rows(hydra_env)) == pids  # no process restarted
    assert load.failures == [] and load.cut == [], (load.failures, load.cut)
    # the flips are the port's switch history, numbered on
    st = status_json(hydra_env)
    assert [s["to"] for s in st["daemon"]["engines"][0]["switches"]] == [
        "demo-moe", "demo-moe-combine", "demo-moe", "demo-moe-combine"]


def test_a_dead_standby_is_restarted_and_the_active_layout_untouched(hydra_up, hydra_env):
    port, rows = _up(hydra_up, hydra_env)
    active = _pids(rows[:1])
    head = next(p for p in rows[1]["processes"] if p["name"] == "demo-moe.head")
    with Load(port) as load:
        wait_until(lambda: load.ok >= 2, 120, "first requests served")
        os.kill(head["pid"], signal.SIGKILL)

        def back() -> bool:
            r = _rows(hydra_env)
            p = next(p for p in r[1]["processes"] if p["name"] == "demo-moe.head")
            return r[1]["state"] == "serving" and p["pid"] not in (None, head["pid"])
        wait_until(back, 120, "the standby's head restarted by its supervisor")
        n = load.ok
        wait_until(lambda: load.ok > n + 1, 120, "requests served meanwhile")
        rows = _rows(hydra_env)
        assert _pids(rows[:1]) == active and rows[0]["state"] == "serving"
        assert next(p for p in rows[1]["processes"])["restarts"] == 1
        # and it takes over at once again
        rep = _switch(hydra_env, "demo-moe")
        assert rep["result"] == "ok" and rep["instant"], rep
        n = load.ok
        wait_until(lambda: load.ok > n + 1, 120, "requests served by the standby")
    assert load.failures == [] and load.cut == [], (load.failures, load.cut)
