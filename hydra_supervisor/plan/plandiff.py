"""What a new plan changes in a running one: nothing, the head only, or the whole layout.

Pure (two Plans in, a verdict out), golden-tested. Used by reload and by CONFIGURE: the same
payload twice is a no-op; a change to the head's flags alone (context size, KV types, batch,
sampling defaults baked into argv) restarts only the head and leaves its peers running; any
change to a peer, or to the set of processes, restarts the whole layout, peers before head (a
head must reconnect to a restarted peer anyway). The external address is the Port's, in no
plan, except where a `router: false` head binds it: a plan whose head would bind another one is
refused (a running hydra keeps its address).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from hydra_supervisor.plan.plan import EngineSpec, Plan


class Change(Enum):
    NONE = "none"
    HEAD = "head"
    ALL = "all"
    REFUSED = "refused"


@dataclass(frozen=True)
class PlanDiff:
    change: Change
    reason: str
    restart: tuple[str, ...] = ()  # process names that restart, in start order


def _key(e: EngineSpec) -> tuple[object, ...]:
    return (e.name, e.role, e.program, e.args, e.env, e.host, e.port, e.managed)


def diff(old: Plan, new: Plan) -> PlanDiff:
    was, now = old.binds_external, new.binds_external
    if was is not None and now is not None and was != now:
        return PlanDiff(Change.REFUSED, f"the external address would change from "
                        f"{was.host}:{was.port} to {now.host}:{now.port}; a running hydra keeps "
                        "its address (restart hydra to move it)")
    o = {e.name: e for e in old.engines}
    n = {e.name: e for e in new.engines}
    order = tuple(e.name for e in new.in_start_order())
    if o.keys() != n.keys():
        return PlanDiff(Change.ALL, "the set of processes changes", order)
    changed = [name for name in order if _key(o[name]) != _key(n[name])]
    router_same = old.router == new.router
    if not changed and router_same:
        return PlanDiff(Change.NONE, "nothing changes")
    heads = [name for name in changed if n[name].role.value == "head"]
    if changed and changed == heads and router_same:
        return PlanDiff(Change.HEAD, f"only {', '.join(heads)} changes", tuple(heads))
    return PlanDiff(Change.ALL, f"{', '.join(changed) or 'the router'} change", order)
