"""The router's threads on one CPU (router/affinity.py, the node's ``router_cpus``): the choice
(golden /proc/stat), the node file's check, a real router's threads pinned and the rest of the
process not, and `hydra up`'s llama-server keeping every CPU while its router's threads do not."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import requests

from hydra_supervisor.config.config import load_node
from hydra_supervisor.errors import ConfigError
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router import Router, Upstreams, affinity
from hydra_supervisor.router.routes import one_route_table
from hydra_supervisor.testing.harness import descendants, free_port, run_hydra, snapshot
from hydra_supervisor.testing.sse_upstream import StandIn

ALLOWED = frozenset(os.sched_getaffinity(0))

STAT = """\
cpu  300 0 100 1600 0 0 0 0 0 0
cpu0 150 0 50 300 0 0 0 0 0 0
cpu1 50 0 20 430 0 0 0 0 0 0
cpu2 50 0 20 420 10 0 0 0 0 0
cpu3 50 0 10 440 0 0 0 0 0 0
intr 1 2 3
ctxt 42
"""


def test_busy_since_boot_reads_each_cpu_line():
    busy = affinity.busy_since_boot(STAT)
    assert busy == {0: 200 / 500, 1: 70 / 500, 2: 70 / 500, 3: 60 / 500}


def test_auto_picks_the_least_busy_cpu_and_cpu_0_loses_ties():
    assert affinity.choose("auto", frozenset({0, 1, 2, 3}), STAT) == {3}
    assert affinity.choose("auto", frozenset({0, 1, 2}), STAT) == {2}  # 1 and 2 tie: higher
    assert affinity.pick({0, 1}, {}) == 1  # not in /proc/stat: idle; CPU 0 last
    assert affinity.choose("auto", frozenset({5}), STAT) is None  # one CPU: nothing to pin


def test_all_and_lists_and_what_is_refused():
    assert affinity.choose("all", frozenset({0, 1}), STAT) is None
    assert affinity.choose([1], frozenset({0, 1}), STAT) == {1}
    with pytest.raises(ValueError, match=r"CPU 4, which this process may not run on "
                                         r"\(it may use 0-2\)"):
        affinity.choose([0, 4], frozenset({0, 1, 2}), STAT)
    with pytest.raises(ValueError, match="use auto, all or a list"):
        affinity.choose("some", frozenset({0, 1}), STAT)


def test_span_writes_cpu_lists_as_the_kernel_does():
    assert affinity.span([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert affinity.span([5]) == "5"
    assert affinity.span([]) == ""


def test_pinned_threads_pin_themselves_first_and_survive_a_cpu_taken_away():
    seen: list[tuple[str, frozenset[int]]] = []
    ran = threading.Event()

    def pin(cpus: frozenset[int]) -> None:
        seen.append(("pin", cpus))
        raise OSError(22, "Invalid argument")  # the CPU is no longer ours: run anyway

    factory = affinity.pinned(threading.Thread, frozenset({1}), pin=pin)
    t = factory(target=lambda x: (seen.append(("ran", x)), ran.set()), args=(frozenset(),),
                name="t", daemon=True)
    t.start()
    assert ran.wait(10)
    t.join(10)
    assert seen == [("pin", frozenset({1})), ("ran", frozenset())]
    assert affinity.pinned(threading.Thread, None) is threading.Thread


def _node(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "node.yaml"
    f.write_text(text)
    return f


def test_the_node_file_checks_router_cpus_with_its_line_and_choices(tmp_path):
    assert load_node(_node(tmp_path, "profiles: []\n")).router_cpus == "auto"
    assert load_node(_node(tmp_path, "router_cpus: all\n")).router_cpus == "all"
    first = min(ALLOWED)
    assert load_node(_node(tmp_path, f"router_cpus: [{first}, {first}]\n")).router_cpus \
        == (first,)
    for bad in ("many", "[]", f"[{max(ALLOWED) + 1}]", "[true]", "1.5", str(first)):
        with pytest.raises(ConfigError) as e:
            load_node(_node(tmp_path, f"models: {{}}\nrouter_cpus: {bad}\n"))
        msg = str(e.value)
        assert "node.yaml:2" in msg and "router_cpus" in msg, msg
        assert f"auto, all or a list of CPU numbers from those this process may run on " \
               f"({affinity.span(ALLOWED)})" in msg, msg


def _cpus_of(tid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(tid))


@pytest.mark.skipif(len(ALLOWED) < 2, reason="one CPU: nothing to pin away from")
def test_a_routers_threads_run_on_its_cpu_and_nothing_else_of_the_process_does():
    cpu = max(ALLOWED)
    up = StandIn()
    try:
        router = Router("127.0.0.1", 0, Upstreams(), name="pin", cpus=frozenset({cpu}))
        route = router.new_route("pin")
        route.http = ("127.0.0.1", up.port)
        router.table = one_route_table(route)
        router.start()
        try:
            # ... and again once stopped and started (hydra restarts a router whose acceptor
            # died): its new threads pin themselves too
            for started in (False, True):
                if started:
                    router.stop()
                    router.start()
                s = requests.Session()
                for _ in range(3):  # a streamed body moves on the pump's thread
                    r = s.post(f"http://127.0.0.1:{router.port}/v1/chat/completions",
                               json={"messages": [], "stream": True, "max_tokens": 3},
                               timeout=30)
                    assert r.status_code == 200 and r.text.count("data: ") >= 3
                mine = [t for t in threading.enumerate()
                        if t.name.startswith("router-pin") and t.is_alive()]
                names = {t.name.rsplit("-", 1)[-1] for t in mine}
                assert {"accept", "pump", "pin"} <= names, names
                for t in mine:
                    assert t.native_id is not None
                    assert _cpus_of(t.native_id) == {cpu}, t.name
                assert _cpus_of(threading.main_thread().native_id or 0) == ALLOWED
                assert router.cpus == {cpu}
        finally:
            router.stop()
    finally:
        up.close()


@pytest.mark.slow
@pytest.mark.skipif(len(ALLOWED) < 2, reason="one CPU: nothing to pin away from")
def test_hydra_up_pins_its_router_and_not_llama_server(hydra_up, hydra_env):
    """`router_cpus: [N]`: some of hydra's threads (the router's) run on N only, its main
    thread and the llama-server it started keep every CPU hydra had."""
    cpu = max(ALLOWED)
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"router_cpus: [{cpu}]\n")
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
    pid = up.proc.pid
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    masks = {t: _cpus_of(t) for t in tids}
    assert masks[pid] == ALLOWED  # the main thread: the event loop
    assert any(m == {cpu} for m in masks.values()), masks
    children = [c for c in descendants(pid) if "llama-server" in c.name()]
    assert children, descendants(pid)
    for c in children:
        assert frozenset(c.cpu_affinity()) == ALLOWED, c
    log = StateDir(Path(hydra_env["HYDRA_STATE_DIR"])).log_path("hydra").read_text()
    assert f"threads on CPU {cpu})" in log, log
    # and `hydra status` says it, on the router's line (--json: the router's "cpus")
    router = snapshot(hydra_env).ports[0].router
    assert router is not None and router.cpus == str(cpu)
    shown = run_hydra(hydra_env, "status")
    assert f"; its threads on CPU {cpu}" in shown.stdout, shown.stdout
