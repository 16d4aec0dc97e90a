"""Standby layouts (serve/standby.py) with fake supervisors and a fake router (fast, no
processes): the flip re-points the port in one step and restarts nothing; requests in flight
on the old layout finish there; a standby that does not fit is not loaded and the switch
reloads, saying which device and how many MiB short; a standby whose process dies does not
touch the active layout; a switch out of the pair, and the node's eviction, take the standby
first; SET_EXPERT_MODE flips to a standby of the wanted mode.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hydra_supervisor.config.profile import Mode, Profile
from hydra_supervisor.plan import fleetplan
from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.plan import EngineSpec, Placement, Plan, Role, RouterSpec
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve.engine_wire import EngineWire
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import SwitchTimeouts
from hydra_supervisor.serve.snapshot import Snapshot
from hydra_supervisor.serve.standby import Standby
from hydra_supervisor.serve.states import LaneState
from tests.lane_fakes import STARTED, FakeRouter, FakeSupervisor

MIB = 1 << 20


def sdep(name: str, *, mode: Mode = Mode.SOLO, port: int = 30200, mib: int = 300,
         standby: str | None = None, model: str = "moe.gguf") -> Deployment:
    peers = (EngineSpec(name="peer-cpu-peer", role=Role.PEER, program="ggml-rpc-server",
                        args=(), env=(), host="127.0.0.1", port=port - 100, device="cpu-peer",
                        start_order=0),) if mode is Mode.COMBINE else ()
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=("-m", model),
                      env=(), host="127.0.0.1", port=port, device="cpu",
                      start_order=len(peers))
    plan = Plan(profile=name, source=f"{name}.yaml", model_path=model, model_kind="moe",
                mode=mode.value, transport="rpc", engines=(*peers, head),
                placements=(Placement("cpu", 8, mib * MIB, 0, 0, 0),),
                router=RouterSpec(("127.0.0.1", port), None, ()))
    prof = Profile(name=name, source=f"{name}.yaml", model="moe", mode=mode,
                   peers=("cpu-peer",) if mode is Mode.COMBINE else (), standby=standby)
    return Deployment(plan=plan, binaries={}, timeouts=Timeouts(load=5.0, peer=1.0),
                      layout=SimpleNamespace(devices={}, profile=prof))


COMBINE = sdep("moe-c", mode=Mode.COMBINE, port=30200, mib=600, standby="moe-s")
SOLO = sdep("moe-s", port=30210, mib=300, standby="moe-c")
OTHER = sdep("dense", port=30220, mib=300, model="dense.gguf")


async def until(cond: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
    return got


def make(tmp_path: Path, capacity_mib: int = 0,
         deps: dict[str, Deployment] | None = None) -> Port:
    STARTED.clear()
    node = Node({"host": capacity_mib * MIB} if capacity_mib else {})
    port = Port(StateDir(tmp_path), "127.0.0.1", 8080, node=node,
                make_supervisor=FakeSupervisor,
                make_router=FakeRouter,  # type: ignore[arg-type]
                switch_timeouts=SwitchTimeouts(drain=0.1, gpu_free=0.1), exit_on_fatal=True)
    known = deps or {"moe-c": COMBINE, "moe-s": SOLO, "dense": OTHER}

    async def warm(lane: Lane) -> float:
        return 0.001

    port.standby = Standby(port, prepare=lambda name, _addr, _ports: known[name], warm=warm)
    port.plan_lane(None, COMBINE)
    port.open()
    return port


def run(port: Port, body: Callable[[], Any]) -> None:
    async def go() -> None:
        await port.start()
        try:
            await body()
        finally:
            await port.shutdown("test")
            port.close()

    asyncio.run(go())


def sb(port: Port) -> Standby:
    assert port.standby is not None
    return port.standby


def active(port: Port) -> Lane:
    lane = port.only()
    assert lane is not None
    return lane


def test_flip_repoints_the_port_in_one_step_and_restarts_nothing(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        old, new = active(port), sb(port).lane
        assert new is not None and new.name == "moe-s" and new.standby
        assert [e.name for e in new.dep.plan.engines] == ["moe-s.head"]  # its own names
        assert port.select(None, "POST", "/v1/chat/completions") is old.route
        started = len(STARTED)
        rep = await port.switch_in(SOLO)
        assert rep.result == "ok" and rep.instant is True and rep.restarted == []
        assert set(rep.phases) == {"flip"} and rep.phases["flip"] < 0.05
        # new requests go to the standby's route at once; nothing was started or stopped
        assert port.select(None, "POST", "/v1/chat/completions") is new.route
        assert active(port) is new and sb(port).lane is old and old.standby
        assert len(STARTED) == started
        assert not old.sup.stopping.is_set() and not new.sup.stopping.is_set()  # type: ignore
        # the old layout stands by: a switch back is a flip too
        back = await port.switch_in(COMBINE)
        assert back.instant is True and active(port) is old and len(STARTED) == started
        # one switch history per port, numbered on
        assert [s.seq for s in old.switches] == [1, 2]
        rows = port.status({}).lanes
        assert [(r.profile, r.role) for r in rows] == [("moe-c", "active"),
                                                       ("moe-s", "standby")]
        assert rows[1].needs_mib == {"host": 300} and rows[0].needs_mib == {"host": 600}
        assert rows[1].name == "port-8080/standby" and rows[1].switches == ()
        assert rows[0].standby == "moe-s" and rows[1].standby_of == "moe-c"
        models = port.select(None, "GET", "/v1/models")
        assert [(m["id"], m["standby"]) for m in models.body["data"]] == [  # type: ignore
            ("moe-c", False), ("moe-s", True)]

    run(port, body)


def test_requests_in_flight_finish_on_the_old_layout(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        old = active(port)
        flights = [old.route.gate.begin() for _ in range(3)]  # streams in progress
        rep = await port.switch_in(SOLO)
        assert rep.instant is True and rep.cut == 0
        assert "3 request(s) in flight" in rep.notes[0]
        assert old.route.gate.inflight() == 3 and old.route.gate.held_reason is None
        assert old.state_now() is LaneState.SERVING  # its processes serve them to the end
        new_route = port.select(None, "POST", "/v1/completions")
        assert new_route is not old.route
        for f in flights:
            old.route.gate.end(f)
        assert old.route.gate.inflight() == 0

    run(port, body)


def test_no_room_for_both_reloads_and_says_why(tmp_path: Path) -> None:
    port = make(tmp_path, capacity_mib=800)  # 600 + 300 MiB do not fit in 800

    async def body() -> None:
        await until(lambda: sb(port).why)
        why = sb(port).why
        assert why is not None and "host: 100 MiB short" in why, why
        assert sb(port).lane is None and len(STARTED) == 1
        rows = port.status({}).lanes
        assert rows[1].role == "standby" and rows[1].state == "stopped" and \
            rows[1].needs_mib == {"host": 300} and "MiB short" in (rows[1].why or "")
        rep = await port.switch_in(SOLO)
        assert rep.result == "ok" and rep.instant is False
        assert rep.not_instant is not None and "host: 100 MiB short" in rep.not_instant
        assert "start" in rep.phases and len(STARTED) == 2  # a reload
        assert active(port).name == "moe-s"
        # the pair stays: the old layout is wanted as the standby (it does not fit either)
        await until(lambda: sb(port).name == "moe-c" and sb(port).why)

    run(port, body)


def test_a_standby_that_dies_does_not_touch_the_active_layout(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        act, stand = active(port), sb(port).lane
        assert stand is not None and stand.sup is not None
        calls = len(act.route.calls)  # type: ignore[attr-defined]
        head = stand.sup.head
        head.to(State.BACKOFF, "exit -9; restart 1 in 1.0s")  # its supervisor restarts it
        assert stand.state_now() is LaneState.RECOVERING
        assert not sb(port).ready() and "recovering" in (sb(port).not_instant() or "")
        assert port.select(None, "POST", "/v1/completions") is act.route
        assert act.route.gate.held_reason is None and act.state_now() is LaneState.SERVING
        assert len(act.route.calls) == calls  # type: ignore[attr-defined]
        # while it restarts, a switch to it reloads (and says why)
        head.to(State.READY, "health check passed")
        assert sb(port).ready()
        stand.sup.fatal = "gave up after 5 restarts"  # its supervisor gave up
        assert stand.state_now() is LaneState.FAILED and not sb(port).ready()
        assert port.status({}).lanes[1].state == "failed"
        assert act.state_now() is LaneState.SERVING
        assert act.exit_on_fatal and not stand.exit_on_fatal  # a standby never ends hydra

    run(port, body)


def test_a_switch_out_of_the_pair_stops_the_standby_first(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        stand = sb(port).lane
        assert stand is not None and stand.sup is not None
        its = stand.sup
        rep = await port.switch_in(OTHER)
        assert rep.result == "ok" and rep.instant is None
        assert its.stopping.is_set() and stand.phase is LaneState.STOPPED
        assert "moe-s" not in port.node.lanes and sb(port).lane is None
        assert active(port).name == "dense" and sb(port).wanted() is None
        assert [(r.role, r.standby) for r in port.status({}).lanes] == [("active", None)]

    run(port, body)


def test_the_node_evicts_a_standby_first() -> None:
    cap = {"host": 1000 * MIB}
    now = 100.0
    # the standby was used last and is inside min_resident: still the first to go
    occ = [fleetplan.Occupant("a", {"host": 400 * MIB}, 1.0, 0.0),
           fleetplan.Occupant("a-solo", {"host": 400 * MIB}, 99.0, 200.0, standby=True)]
    room = fleetplan.make_room(cap, occ, {"host": 300 * MIB}, now, "b")
    assert room.verdict is fleetplan.Verdict.EVICT and room.victims == ("a-solo",)
    short = fleetplan.shortfall(cap, occ, {"host": 300 * MIB})
    assert short == {"host": 100 * MIB}


def test_set_expert_mode_flips_to_the_standby(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        wire = EngineWire(port, asyncio.get_running_loop(), None)
        assert wire._expert_modes() == ["solo", "combined"]
        started = len(STARTED)
        res = await asyncio.to_thread(wire.set_expert_mode, "solo")
        assert res["instant"] is True and res["changed"] and res["profile"] == "moe-s"
        assert active(port).name == "moe-s" and len(STARTED) == started
        assert wire.info()["expert_mode"] == "solo"
        res = await asyncio.to_thread(wire.set_expert_mode, "combined")
        assert res["instant"] is True and active(port).name == "moe-c"
        assert (await asyncio.to_thread(wire.set_expert_mode, "combined"))["changed"] is False

    run(port, body)


def test_a_flip_is_refused_while_the_standby_loads(tmp_path: Path) -> None:
    port = make(tmp_path)

    async def body() -> None:
        assert not sb(port).ready_for("moe-s")
        assert sb(port).not_instant("moe-s") is not None
        await until(lambda: sb(port).ready())
        assert sb(port).ready_for("moe-s") and sb(port).ready_for("moe-s.yaml")
        assert not sb(port).ready_for("dense")
        assert sb(port).not_instant("dense") is None

    run(port, body)


@pytest.mark.parametrize("ref", ["moe-s", "moe-s.yaml"])
def test_names(tmp_path: Path, ref: str) -> None:
    port = make(tmp_path)
    lane = port.make_lane(None, SOLO, standby=True)
    assert lane.answers_to(ref) and not lane.answers_to("moe-c")
    port.close()


def test_the_standby_key_is_checked_with_file_and_line(tmp_path: Path) -> None:
    from hydra_supervisor.config.config import ConfigError, default_node, load_profile

    me = tmp_path / "a.yaml"
    me.write_text("profile: a\nmodel: synth-moe\nstandby: a\n")
    with pytest.raises(ConfigError, match=r"a.yaml:3.*standby: names this profile itself"):
        load_profile(me, default_node())
    peer = tmp_path / "p.yaml"
    peer.write_text("profile: p\nmode: peer\nhead: cpu\nstandby: b\n")
    with pytest.raises(ConfigError, match=r"p.yaml:4.*standby: not with mode: peer"):
        load_profile(peer, default_node())
    bad = tmp_path / "b.yaml"
    bad.write_text("profile: b\nmodel: synth-moe\nstandby: [x]\n")
    with pytest.raises(ConfigError, match=r"b.yaml:3.*standby: expected a profile name"):
        load_profile(bad, default_node())
    ok = tmp_path / "c.yaml"
    ok.write_text("profile: c\nmodel: synth-moe\nstandby: d\n")
    assert load_profile(ok, default_node()).standby == "d"


def test_status_line_names_the_standby() -> None:
    from hydra_supervisor.runtime.notify import status_text

    snap = Snapshot.from_json({"daemon": {"pid": 1, "started": 0.0, "state_dir": "/s"},
                               "ports": [{"name": "port-8080", "host": "127.0.0.1",
                                          "port": 8080, "url": "http://127.0.0.1:8080",
                                          "lanes": [
        {"name": "port-8080/moe-c", "profile": "moe-c", "state": "serving"},
        {"name": "port-8080/standby", "profile": "moe-s", "state": "stopped",
         "role": "standby", "why": "does not fit beside moe-c: host: 100 MiB short"}]}]})
    assert status_text(snap) == ("moe-c: serving at http://127.0.0.1:8080; standby moe-s: "
                                 "stopped (does not fit beside moe-c: host: 100 MiB short)")


def test_metrics_say_which_layout_stands_by() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from hydra_supervisor.runtime.metrics import SnapshotCollector

    lanes = [{"name": "port-8080", "profile": "moe-c", "mode": "combine", "state": "serving"},
             {"name": "port-8080/standby", "profile": "moe-s", "mode": "solo",
              "state": "serving", "role": "standby"}]
    snap = Snapshot.from_json({"daemon": {"pid": 1, "started": 0.0, "state_dir": "/s"},
                               "ports": [{"name": "port-8080", "host": "127.0.0.1",
                                          "port": 8080, "url": "http://127.0.0.1:8080",
                                          "lanes": lanes}]})
    reg = CollectorRegistry()
    reg.register(SnapshotCollector(lambda: snap))
    text = generate_latest(reg).decode()
    assert 'engine="port-8080",mode="combine"' in text and 'role="active"' in text
    line = next(x for x in text.splitlines() if x.startswith("hydra_engine_info")
                and 'profile="moe-s"' in x)
    assert 'engine="port-8080/standby"' in line and 'role="standby"' in line, line


def test_restart_head_of_a_standby_pair_addresses_the_serving_layout(tmp_path: Path) -> None:
    """`hydra restart head` with a standby pair loaded (both layouts have a head): the
    serving layout's head, before and after a flip, and the reply says which."""
    from hydra_supervisor.runtime.daemon_actions import Actions, Planning

    port = make(tmp_path)
    acts = Actions([port], port.node, Planning(None, None, (), tmp_path), lambda: None)

    async def body() -> None:
        await until(lambda: sb(port).ready())
        for want in ("moe-c.head", "moe-s.head", "moe-c.head"):
            if active(port).name != want.split(".")[0]:
                await port.switch_in(SOLO if want.startswith("moe-s") else COMBINE)
                await until(lambda: sb(port).ready())
            serving, standing = active(port), sb(port).lane
            assert serving.sup is not None and standing is not None and \
                standing.sup is not None
            reply = await acts.restart("head")
            assert reply["engine"] == want, reply
            assert serving.sup.restarted[-1:] == [want]  # type: ignore[attr-defined]
            assert want not in standing.sup.restarted  # type: ignore[attr-defined]
            assert f"the serving layout's {want}" in reply["message"], reply["message"]
            assert f"the standby's {standing.name}.head was not touched" in reply["message"]
        # the standby's own, named in full
        stand = sb(port).lane
        assert stand is not None
        reply = await acts.restart(f"{stand.name}.head")
        assert reply["engine"] == f"{stand.name}.head" and "serving layout" not in \
            reply["message"]

    run(port, body)
