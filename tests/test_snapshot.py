"""The published status (serve/snapshot.py): one typed schema, frozen, with a versioned JSON
shape (docs/control.md) that reads back into the same types."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from hydra_supervisor.dashboard.feed import Publisher
from hydra_supervisor.serve.snapshot import (
    DaemonInfo,
    FdStatus,
    LaneStatus,
    PortStatus,
    ProcessStatus,
    RemoteLoad,
    RouterCounters,
    Snapshot,
    SwitchStatus,
    frozen_map,
)

HEAD = ProcessStatus(name="demo.head", role="head", state="READY", pid=42, host="127.0.0.1",
                     port=30200, device="cpu", reason="ok", started=1.0, log="/x/head.log",
                     rss_bytes=10, remote_load=RemoteLoad(sent_bytes=1, remote_bytes=2))
SWITCH = SwitchStatus(to="demo", result="ok", seq=1, frm=None,
                      phases=frozen_map({"start": 1.0}), total_s=1.0, at=5.0)
LANE = LaneStatus(name="port-8080/demo", profile="demo", state="serving", phase="serving",
                  mode="solo", model="gemma3-270m", source="demo.yaml", default=True,
                  aliases=("d",), devices=("cpu",), needs_mib=frozen_map({"host": 300}),
                  requests=5, requests_last_min=3, standby="demo-moe",
                  processes=(HEAD,), switches=(SWITCH,))
STANDBY = LaneStatus(name="port-8080/standby", profile="demo-moe", role="standby",
                     standby_of="demo", why="does not fit")
PORT = PortStatus(name="port-8080", host="127.0.0.1", port=8080, url="http://127.0.0.1:8080",
                  default="demo", lanes=(LANE, STANDBY),
                  router=RouterCounters(open=1, http=frozen_map({"requests": 5}),
                                        fds=FdStatus(nofile=1024, budget=900, relays=2)))
SNAP = Snapshot(daemon=DaemonInfo(pid=1, started=2.0, state_dir="/s"), ports=(PORT,),
                switches=(SWITCH,), taken=3.0)


def test_the_json_shape_is_versioned_and_reads_back_into_the_same_types() -> None:
    out: Any = SNAP.to_json()  # (plain JSON: read by key below)
    assert next(iter(out)) == "version" and out["version"] == 1
    assert out["daemon"] == {"pid": 1, "started": 2.0, "state_dir": "/s", "stopped": None,
                             "unkillable": []}
    port = out["ports"][0]
    assert port["name"] == "port-8080" and port["router"]["open"] == 1
    lane = port["lanes"][0]
    assert lane["role"] == "active" and lane["processes"][0]["pid"] == 42
    assert lane["switches"][0]["from"] is None
    assert port["lanes"][1]["role"] == "standby"
    back = Snapshot.from_json(json.loads(json.dumps(out)))
    assert back == SNAP
    assert isinstance(back.ports[0].lanes[0].processes[0], ProcessStatus)


def test_keys_a_reader_does_not_know_are_ignored_and_missing_ones_take_defaults() -> None:
    snap = Snapshot.from_json({"version": 1, "daemon": {"pid": 1, "started": 0, "state_dir": ""},
                               "ports": [{"name": "port-1", "host": "h", "port": 1, "url": "u",
                                          "lanes": [{"name": "port-1/a", "profile": "a",
                                                     "future": True}]}]})
    lane = snap.ports[0].lanes[0]
    assert lane.state == "stopped" and lane.processes == () and snap.ports[0].router is None


def test_an_older_routers_flat_counters_read_as_todays() -> None:
    r = Snapshot.from_json({"daemon": {"pid": 1, "started": 0, "state_dir": ""}, "ports": [
        {"name": "p", "host": "h", "port": 1, "url": "u",
         "router": {"total": 9, "refused": 1, "rejected": 2}}]}).ports[0].router
    assert r is not None and r.accepted == 9
    assert dict(r.refused) == {"queue_full": 1, "unrecognised": 2}


def test_it_is_frozen_and_every_reader_gets_its_own_copy() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SNAP.ports[0].lanes[0].state = "failed"  # type: ignore[misc]
    router = SNAP.ports[0].router
    assert router is not None
    with pytest.raises(TypeError):
        router.http["requests"] = 9  # type: ignore[index]
    pub = Publisher(lambda: SNAP)
    pub.put(SNAP)
    got, _ = pub.get(max_age=60)
    assert got is SNAP  # immutable: shared
    a: Any = SNAP.to_json()
    a["ports"][0]["lanes"][0]["state"] = "scribbled"
    b: Any = SNAP.to_json()
    assert b["ports"][0]["lanes"][0]["state"] == "serving"


def test_the_summary_view_keeps_status_json_keys() -> None:
    """status.json (the crash record) keeps its keys: external tools read them."""
    s = SNAP.summary()
    assert s["profile"] == "demo" and s["state"] == "serving" and s["mode"] == "solo"
    assert s["profiles"] == {"demo": "serving"}  # the standby is not an active lane
    assert s["url"] == "http://127.0.0.1:8080" and s["updated"] == 3.0
    assert [e["name"] for e in s["engines"]] == ["demo.head"]
    idle = Snapshot(daemon=SNAP.daemon, ports=(dataclasses.replace(PORT, lanes=()),))
    assert idle.summary()["state"] == "idle" and idle.summary()["profile"] is None
    down = Snapshot(daemon=SNAP.daemon, ports=(dataclasses.replace(PORT, down="gone"),))
    assert down.down() == ["gone"] and down.summary()["down"] == "gone"
