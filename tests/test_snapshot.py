"""The published status (serve/snapshot.py): typed, frozen, and the JSON shape unchanged."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hydra_supervisor.dashboard.feed import Publisher
from hydra_supervisor.serve.snapshot import LaneStatus, Snapshot

ROW: dict[str, Any] = {
    "name": "port-8080/demo", "profile": "demo", "source": "demo.yaml", "mode": "solo",
    "model": "gemma3-270m", "host": "127.0.0.1", "port": 8080,
    "url": "http://127.0.0.1:8080", "state": "serving", "down": None, "switching": None,
    "fatal": None, "degraded": None, "requests_last_min": 3,
    "processes": [{"name": "demo.head", "role": "head", "pid": 42, "host": "127.0.0.1",
                   "port": 30200, "device": "cpu", "state": "READY", "reason": "ok",
                   "restarts": 0, "started": 1.0, "last_exit": None, "managed": True,
                   "log": "/x/head.log", "warning": None, "first_failure_log": None,
                   "log_tail": [], "rss_bytes": 10, "gpu_bytes": None}],
    "router": {"open": 1, "http": {"requests": 5}, "refused": {}},
    "switches": [{"seq": 1, "to": "demo", "from": None, "result": "ok", "phases": {"start": 1.0}}],
    "fleet": {"port": 8080, "default": True, "phase": "serving", "aliases": ["d"]},
    "standby": False,  # a key the row carries beyond the typed fields survives
}


def test_the_json_shape_is_the_row_it_was_built_from() -> None:
    snap = Snapshot.build(pid=1, started=2.0, state_dir="/s", rows=[ROW],
                          ports=[{"port": 8080, "url": "http://127.0.0.1:8080",
                                  "default": "demo", "profiles": ["demo"], "alive": True,
                                  "down": None}],
                          switches=[{"to": "demo", "result": "ok"}])
    out = snap.to_json()
    assert out["engines"] == [ROW]
    assert out["fleets"][0]["profiles"] == ["demo"] and out["switches"] == [
        {"to": "demo", "result": "ok"}]
    assert isinstance(snap.rows[0], LaneStatus) and snap.rows[0].processes[0].pid == 42


def test_one_shape_whatever_the_number_of_profiles() -> None:
    """A port with one profile is described like one with several: `ports`, `fleets` and
    `switches` are always there."""
    out = Snapshot.build(pid=1, started=2.0, state_dir="/s", rows=[ROW]).to_json()
    assert out["ports"] == [] and out["fleets"] == [] and out["switches"] == []
    assert out["engines"][0]["fleet"]["default"] is True


def test_it_is_frozen_and_every_reader_gets_its_own_copy() -> None:
    snap = Snapshot.build(pid=1, started=2.0, state_dir="/s", rows=[ROW])
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.rows[0].state = "failed"  # type: ignore[misc]
    with pytest.raises(TypeError):
        snap.rows[0].router["open"] = 9  # type: ignore[index]
    pub = Publisher(lambda: snap, view=lambda s: s.to_json())
    pub.put(snap)
    a, _ = pub.get(max_age=60)
    a["engines"][0]["state"] = "scribbled"
    a["engines"][0]["router"]["open"] = 99
    b, _ = pub.get(max_age=60)
    assert b["engines"][0]["state"] == "serving" and b["engines"][0]["router"]["open"] == 1


def test_every_port_with_its_router_counters_under_ports() -> None:
    """The router's counters are the port's (`ports`, every port; metrics read them there); the
    `fleets` entries keep their shape."""
    port = {"port": 8080, "url": "http://127.0.0.1:8080", "default": "demo",
            "profiles": ["demo"], "alive": True, "down": None}
    snap = Snapshot.build(pid=1, started=2.0, state_dir="/s", rows=[ROW],
                          ports=[{**port, "name": "port-8080", "router": {"open": 1}}])
    out = snap.to_json()
    assert out["ports"] == [{"name": "port-8080", **port, "router": {"open": 1}}]
    assert out["fleets"] == [port]
