"""Build the Fleets for `hydra up -p A -p B ...` (or a node file's `profiles:` list).

Every profile is read, resolved and checked first (a bad one stops `hydra up` before anything
starts, with its file and line); each gets ports no other profile of this hydra has planned.
Profiles that name the same external address share it, routed by model (one Fleet per
address); the node file's `default_profile` (else the first profile given for that address)
answers requests without a model. All Fleets share one Pool: the devices' capacity, measured
before anything loads, and every profile, so room is made node-wide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra_supervisor import deployment, fleetplan
from hydra_supervisor.config import find_node_file, load_node
from hydra_supervisor.deployment import Deployment
from hydra_supervisor.errors import HydraError
from hydra_supervisor.fleet import Fleet, Pool
from hydra_supervisor.state import StateDir


def build(state: StateDir, names: list[str], *, node_file: str | None,
          profiles_dir: str | None, overrides: dict[str, Any],
          slot_dir: Path | None) -> list[Fleet]:
    node = load_node(find_node_file(node_file))
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
    pool = Pool(fleetplan.capacity_of(first.devices) if first is not None else {})
    groups: dict[tuple[str, int], list[Deployment]] = {}
    for dep in deps:
        groups.setdefault((dep.plan.host, dep.plan.port), []).append(dep)
    served = [d.profile for d in deps]
    if node.default_profile and node.default_profile not in served:
        raise HydraError(f"{node.source}: default_profile {node.default_profile} is not among "
                         f"the profiles served ({', '.join(served)})")
    fleets = []
    for (host, port), items in groups.items():
        here = [d.profile for d in items]
        default = node.default_profile if node.default_profile in here else here[0]
        router = items[0].plan.router
        assert router is not None
        members = []
        for d in items:
            assert d.layout is not None  # prepare() always records the layout
            members.append((d.layout.profile, d))
        fleets.append(Fleet(state, host, port, members, default=default, pool=pool,
                            allow=tuple(router.allow)))
    return fleets
