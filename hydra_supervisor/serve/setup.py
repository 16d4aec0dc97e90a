"""Build the ports and the node for `hydra up`: one way for no profile, one, or several.

Every profile named (`hydra up -p A -p B ...`, or a node file's `profiles:` list) is read,
resolved and checked first — its `standby:` too — so a bad one stops `hydra up` before
anything starts, with its file and line; each gets ports no other profile of this hydra has
planned. A profile's external address is its host and port (or `hydra up --host/--port`): it
becomes its Port's, in no plan. Profiles that name the same external address share it (one Port
per address, a Lane per profile, routed by the request's `model`); the node file's
`default_profile` (else the first profile given for that address) answers requests without a
model. No profile: one port
on the given address with no lane (`hydra switch NAME` loads one). Every port shares one Node:
the devices' capacity, measured before anything loads, and every lane, so room is made
node-wide. A hydra that serves exactly one profile ends when it goes FATAL (`exit_on_fatal`);
a port with at most one lane keeps its lane's `standby:` layout loaded beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra_supervisor.config.config import find_node_file, load_node
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import deployment, fleetplan
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Address
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router import affinity
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import DEFAULT_ALLOW, Port
from hydra_supervisor.serve.standby import Standby


def build(state: StateDir, names: list[str], *, node_file: str | None,
          profiles_dir: str | None, overrides: dict[str, Any], host: str, port: int,
          profiles: Callable[[], list[str]] | None = None) -> tuple[list[Port], Node]:
    """The ports (one per external address) and the node of a hydra serving `names`."""
    slot_dir = state.slots()
    planned = _prepare_all(names, node_file=node_file, profiles_dir=profiles_dir,
                           overrides=overrides, slot_dir=slot_dir)
    deps = [d for _, d in planned]
    first = deps[0].layout if deps else None
    node = Node(fleetplan.capacity_of(first.devices) if first is not None else {})
    node_cfg = load_node(find_node_file(node_file))
    # Where every port's router threads run: one choice for the process (one GIL).
    cpus = affinity.for_process(node_cfg.router_cpus)
    if not deps:  # --no-profile: one port, no lane yet
        p = Port(state, host, port, node=node, profiles=profiles, exit_on_fatal=True)
        p.router_kwargs["cpus"] = cpus
        p.standby = _standby(p, node_file, profiles_dir, overrides, slot_dir)
        return [p], node
    groups: dict[Address, list[Deployment]] = {}
    for addr, dep in planned:
        groups.setdefault(addr, []).append(dep)
    served = [d.profile for d in deps]
    if node_cfg.default_profile and node_cfg.default_profile not in served:
        raise HydraError(f"{node_cfg.source}: default_profile {node_cfg.default_profile} is "
                         f"not among the profiles served ({', '.join(served)})")
    ports = []
    for addr, items in groups.items():
        if len(items) > 1:
            _check_shared(items)
        here = [d.profile for d in items]
        router = items[0].plan.router
        p = Port(state, addr.host, addr.port, node=node, profiles=profiles,
                 allow=tuple(router.allow) if router is not None else DEFAULT_ALLOW,
                 tls_files=router.tls if router is not None else None,
                 use_router=router is not None, exit_on_fatal=len(deps) == 1)
        p.router_kwargs["cpus"] = cpus
        p.default = node_cfg.default_profile if node_cfg.default_profile in here else here[0]
        for d in items:
            p.plan_lane(d.layout.profile if d.layout is not None else None, d)
        if len(items) == 1:
            p.standby = _standby(p, node_file, profiles_dir, overrides, slot_dir)
        ports.append(p)
    return ports, node


def _prepare_all(names: list[str], *, node_file: str | None, profiles_dir: str | None,
                 overrides: dict[str, Any], slot_dir: Path) -> list[tuple[Address, Deployment]]:
    """Each profile planned on its own address (no Port is bound yet), with that address."""
    out: list[tuple[Address, Deployment]] = []
    deps: list[Deployment] = []
    reserved: set[int] = set()
    for name in names:
        dep = deployment.prepare(name, node_file=node_file, profiles_dir=profiles_dir,
                                 overrides=overrides, slot_dir=slot_dir,
                                 reserved=frozenset(reserved))
        plan, lay = dep.plan, dep.layout
        assert lay is not None  # prepare() always says what it planned from
        if lay.external.port == 0 and plan.router is None:
            raise HydraError(f"{plan.source}: port 0 (any free port) needs hydra's router, "
                             "and this profile has router: false",
                             hint="give a port number: hydra up --port N")
        same = next((d for d in deps if d.profile == dep.profile), None)
        if same is not None:
            where = "is given twice" if same.plan.source == plan.source else \
                f"names two files ({same.plan.source} and {plan.source})"
            raise HydraError(f"profile {dep.profile} {where}: each profile is served once, "
                             "under its own name")
        reserved |= {e.port for e in plan.engines if e.managed}
        _check_standby(dep, node_file=node_file, profiles_dir=profiles_dir,
                       overrides=overrides, slot_dir=slot_dir,
                       reserved=frozenset(reserved))
        deps.append(dep)
        out.append((lay.external, dep))
    return out


def _check_shared(items: list[Deployment]) -> None:
    """Profiles that share one address: each must answer HTTP through hydra's router."""
    for dep in items:
        plan = dep.plan
        if plan.mode == "peer":
            raise HydraError(f"{plan.source}: a mode: peer profile lends a device over ggml-RPC "
                             "and serves no HTTP model: run it with a hydra of its own (or "
                             "on a port of its own)")
        if plan.router is None:
            raise HydraError(f"{plan.source}: router: false (llama-server binds the port "
                             "itself) cannot serve beside other profiles: remove it")


def _check_standby(dep: Deployment, *, node_file: str | None, profiles_dir: str | None,
                   overrides: dict[str, Any], slot_dir: Path, reserved: frozenset[int]) -> None:
    """A profile's `standby:` is planned now, so a misspelt or broken one fails `hydra up`
    (naming the profile file that declares it), not later as a note."""
    lay = dep.layout
    name = lay.profile.standby if lay is not None else None
    if not name:
        return
    try:
        deployment.prepare(name, node_file=node_file, profiles_dir=profiles_dir,
                           overrides={k: v for k, v in overrides.items() if k != "profile"},
                           slot_dir=slot_dir, reserved=reserved)
    except HydraError as exc:
        raise HydraError(f"{dep.plan.source}: standby: {name}: {exc}",
                         hint=exc.hint) from exc


def _standby(p: Port, node_file: str | None, profiles_dir: str | None,
             overrides: dict[str, Any], slot_dir: Path) -> Standby:
    return Standby(p, node_file=node_file, profiles_dir=profiles_dir, overrides=overrides,
                   slot_dir=slot_dir)
