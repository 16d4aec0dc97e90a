"""plandiff: nothing / the head only / the whole layout / refused (golden, pure)."""

from __future__ import annotations

from dataclasses import replace

from hydra_supervisor.plan.plan import EngineSpec, Plan, Role, RouterSpec
from hydra_supervisor.plan.plandiff import Change, diff


def plan(head_args: tuple[str, ...] = ("-c", "4096"), peer_port: int = 30052,
         port: int = 8080, peers: int = 1) -> Plan:
    ps = tuple(EngineSpec(f"peer-{i}", Role.PEER, "ggml-rpc-server", ("-p", str(peer_port + i)),
                          (), "127.0.0.1", peer_port + i, "cpu", i) for i in range(peers))
    head = EngineSpec("head", Role.HEAD, "llama-server", head_args, (), "127.0.0.1", 30200,
                      "cpu", peers)
    return Plan("p", "p.yaml", "m", "dense", "combine", "rpc", "127.0.0.1", port, (*ps, head),
                router=RouterSpec("127.0.0.1", port, ("127.0.0.1", 30200), None, ()))


def test_same_plan_is_nothing() -> None:
    d = diff(plan(), plan())
    assert (d.change, d.restart) == (Change.NONE, ())


def test_head_flags_restart_the_head_only() -> None:
    d = diff(plan(), plan(head_args=("-c", "8192")))
    assert (d.change, d.restart) == (Change.HEAD, ("head",))


def test_a_peer_change_restarts_everything_peers_first() -> None:
    d = diff(plan(), plan(peer_port=30060))
    assert (d.change, d.restart) == (Change.ALL, ("peer-0", "head"))


def test_a_different_set_of_processes_restarts_everything() -> None:
    d = diff(plan(), plan(peers=2))
    assert d.change is Change.ALL and d.restart == ("peer-0", "peer-1", "head")


def test_router_change_restarts_everything() -> None:
    new = replace(plan(), router=RouterSpec("127.0.0.1", 8080, ("127.0.0.1", 30201), None, ()))
    assert diff(plan(), new).change is Change.ALL


def test_address_change_is_refused() -> None:
    d = diff(plan(), plan(port=9090))
    assert d.change is Change.REFUSED and "keeps its address" in d.reason
