"""Build the ports and the node for `hydra up`: one profile, none, or several.

One profile (or `--no-profile`): one port, with one lane (or none), on the profile's address.
Several (`hydra up -p A -p B ...`, or a node file's `profiles:` list):

Every profile is read, resolved and checked first (a bad one stops `hydra up` before anything
starts, with its file and line); each gets ports no other profile of this hydra has planned.
Profiles that name the same external address share it, routed by model (one Port per
address); the node file's `default_profile` (else the first profile given for that address)
answers requests without a model. Every port shares one Node: the devices' capacity, measured
before anything loads, and every lane, so room is made node-wide.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra_supervisor.config.config import find_node_file, load_node
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment, fleetplan
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import DEFAULT_ALLOW, Port


def single(state: StateDir, dep: Deployment | None, *, host: str, port: int,
           profiles: Callable[[], list[str]]) -> tuple[list[Port], Node]:
    """One profile (`dep`), or none: a port with one lane, or none, on its address."""
    plan = dep.plan if dep is not None else None
    lay = dep.layout if dep is not None else None
    node = Node(fleetplan.capacity_of(lay.devices) if lay is not None else {})
    p = Port(state, plan.host if plan else host, plan.port if plan else port, node=node,
             allow=tuple(plan.router.allow) if plan and plan.router else DEFAULT_ALLOW,
             use_router=plan is None or plan.router is not None, profiles=profiles)
    if dep is not None:
        p.plan_lane(lay.profile if lay is not None else None, dep)
    return [p], node


def build(state: StateDir, names: list[str], *, node_file: str | None,
          profiles_dir: str | None, overrides: dict[str, Any],
          slot_dir: Path | None) -> tuple[list[Port], Node]:
    """Several profiles: a port per address, a lane per profile, routed by model."""
    node_cfg = load_node(find_node_file(node_file))
    deps: list[Deployment] = []
    reserved: set[int] = set()
    for name in names:
        dep = deployment.prepare(name, node_file=node_file, profiles_dir=profiles_dir,
                                 overrides=overrides, slot_dir=slot_dir,
                                 reserved=frozenset(reserved))
        plan = dep.plan
        if plan.mode == "peer":
            raise HydraError(f"{plan.source}: a mode: peer profile lends a device over ggml-RPC "
                             "and serves no HTTP model: run it with a hydra of its own")
        if plan.router is None:
            raise HydraError(f"{plan.source}: router: false (llama-server binds the port "
                             "itself) cannot serve beside other profiles: remove it")
        same = next((d for d in deps if d.profile == dep.profile), None)
        if same is not None:
            where = "is given twice" if same.plan.source == plan.source else \
                f"names two files ({same.plan.source} and {plan.source})"
            raise HydraError(f"profile {dep.profile} {where}: each profile is served once, "
                             "under its own name")
        reserved |= {e.port for e in plan.engines if e.managed}
        deps.append(dep)
    first = deps[0].layout
    node = Node(fleetplan.capacity_of(first.devices) if first is not None else {})
    groups: dict[tuple[str, int], list[Deployment]] = {}
    for dep in deps:
        groups.setdefault((dep.plan.host, dep.plan.port), []).append(dep)
    served = [d.profile for d in deps]
    if node_cfg.default_profile and node_cfg.default_profile not in served:
        raise HydraError(f"{node_cfg.source}: default_profile {node_cfg.default_profile} is "
                         f"not among the profiles served ({', '.join(served)})")
    ports = []
    for (host, port), items in groups.items():
        here = [d.profile for d in items]
        default = node_cfg.default_profile if node_cfg.default_profile in here else here[0]
        router = items[0].plan.router
        assert router is not None
        p = Port(state, host, port, node=node, by_model=True, allow=tuple(router.allow))
        p.default = default
        for d in items:
            assert d.layout is not None  # prepare() always records the layout
            p.plan_lane(d.layout.profile, d)
        ports.append(p)
    return ports, node
