"""plandiff: nothing / the head only / the whole layout / refused (golden, pure).

A plan carries no external address (the Port's), except where a `router: false` head binds it:
that is what a refused address change compares."""

from __future__ import annotations

from dataclasses import replace

from hydra_supervisor.plan.plan import (
    EngineSpec,
    ModelKind,
    Plan,
    PlanMode,
    PlanTransport,
    Role,
    RouterSpec,
)
from hydra_supervisor.plan.plandiff import Change, diff


def plan(head_args: tuple[str, ...] = ("-c", "4096"), peer_port: int = 30052,
         port: int | None = None, peers: int = 1) -> Plan:
    """`port`: a `router: false` plan, whose head binds that external port itself."""
    ps = tuple(EngineSpec(f"peer-{i}", Role.PEER, "ggml-rpc-server", ("-p", str(peer_port + i)),
                          (), "127.0.0.1", peer_port + i, "cpu", i) for i in range(peers))
    head = EngineSpec("head", Role.HEAD, "llama-server", head_args, (), "127.0.0.1",
                      30200 if port is None else port, "cpu", peers)
    return Plan("p", "p.yaml", "m", ModelKind.DENSE, PlanMode.COMBINE, PlanTransport.RPC,
                (*ps, head),
                router=RouterSpec(("127.0.0.1", 30200), None, ()) if port is None else None)


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
    new = replace(plan(), router=RouterSpec(("127.0.0.1", 30201), None, ()))
    assert diff(plan(), new).change is Change.ALL


def test_address_change_is_refused() -> None:
    d = diff(plan(port=8080), plan(port=9090))
    assert d.change is Change.REFUSED and "keeps its address" in d.reason


def test_same_address_without_a_router_is_nothing() -> None:
    assert diff(plan(port=8080), plan(port=8080)).change is Change.NONE
