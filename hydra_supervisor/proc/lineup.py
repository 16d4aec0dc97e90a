"""What one Supervisor runs, as it stands now: the Deployment in force (its plan and timeouts),
the ManagedProcesses (the head, its peers), the head's two specs (COMBINE with its peers; SOLO,
for on_peer_loss: degrade) and whether the head serves degraded meanwhile.

Every change of a spec goes through here — a process moved to a free port, degrading to SOLO
and back, a new head adopted — so the head's specs stay consistent whoever asked. The
Supervisor and its collaborators (starting.py, watching.py, restarts.py, stopping.py) share one
Lineup and read its fields; these methods change them, and the restart policy rewrites the
text of `degraded` as its recovery of the peers goes on."""

from __future__ import annotations

import dataclasses

from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.proc.backoff import Backoff
from hydra_supervisor.proc.managed import ManagedProcess


def with_http_port(spec: EngineSpec, port: int) -> EngineSpec:
    """A head moved to another internal port (its `--port` argument follows)."""
    args = list(spec.args)
    if "--port" in args:
        args[args.index("--port") + 1] = str(port)
    return dataclasses.replace(spec, port=port, args=tuple(args))


class Lineup:
    """The processes of one Deployment and the specs in force (see the module's doc)."""

    def __init__(self, deployment: Deployment, procs: list[ManagedProcess]) -> None:
        self.deployment = deployment
        self.plan = deployment.plan
        self.timeouts = deployment.timeouts
        self.solo_head = deployment.solo_head  # the head as SOLO, for on_peer_loss: degrade
        self.procs = procs
        # A peer-only engine (mode: peer) has no head: it serves its device to another host.
        self.head = next((p for p in procs if p.spec.role is Role.HEAD), None)
        self.combine_head = self.head.spec if self.head else None
        self.peers = [p for p in procs if p.spec.role is Role.PEER]
        # Set while the head serves SOLO because its peers were lost (on_peer_loss: degrade):
        # the text status shows.
        self.degraded: str | None = None

    def peer_moved(self, old_endpoint: str, new_endpoint: str) -> None:
        """A peer moved to another port: its head's --rpc/-ot follow (the head in force too,
        unless it serves SOLO meanwhile)."""
        if self.head is not None and self.combine_head is not None:
            self.combine_head = self.combine_head.repointed(old_endpoint, new_endpoint)
            if not self.degraded:
                self.head.spec = self.combine_head

    def head_moved(self, head: ManagedProcess, port: int) -> None:
        """The head moved to another internal port: each of its specs follows."""
        head.spec = with_http_port(head.spec, port)
        if self.combine_head is not None:
            self.combine_head = with_http_port(self.combine_head, port)
        if self.solo_head is not None:
            self.solo_head = with_http_port(self.solo_head, port)

    def degrade(self, why: str) -> None:
        """The head serves SOLO until its peers are back; `why` is what status shows."""
        assert self.head is not None and self.solo_head is not None
        self.degraded = why
        self.head.spec = self.solo_head

    def undegrade(self) -> None:
        """Back to COMBINE: the head's next start is with its peers."""
        assert self.head is not None and self.combine_head is not None
        self.head.spec = self.combine_head
        self.degraded = None

    def adopt_spare(self, deployment: Deployment) -> None:
        """Take `deployment`, the same layout re-planned with a remote peer on another of its
        device's endpoints (a spare: deployment.on_spare): the remote peers' specs (where
        hydra reaches them), the head's specs (its --rpc/-ot, SOLO fallback) and the plan
        follow; the processes stay, under their names (a lane's are PROFILE.ROLE; a re-plan's
        are not): the head is stopped and starts with them next."""
        names = {(p.spec.role, p.spec.device): p.name for p in self.procs}

        def named(e: EngineSpec) -> EngineSpec:
            return dataclasses.replace(e, name=names.get((e.role, e.device), e.name))

        plan = dataclasses.replace(deployment.plan,
                                   engines=tuple(named(e) for e in deployment.plan.engines))
        solo = named(deployment.solo_head) if deployment.solo_head is not None else None
        deployment = dataclasses.replace(deployment, plan=plan, solo_head=solo)
        self.deployment = deployment
        self.plan = plan
        self.timeouts = deployment.timeouts
        self.solo_head = solo
        by_name = {e.name: e for e in plan.engines}
        for p in self.peers:
            if not p.spec.managed and p.name in by_name:
                p.spec = by_name[p.name]
        if self.head is not None:
            self.combine_head = plan.head
            if not self.degraded:
                self.head.spec = plan.head

    def adopt_head(self, deployment: Deployment) -> None:
        """Take `deployment`, whose peers are those running now: the head's specs, its policy
        and the timeouts change; the head's next start uses them."""
        if self.head is None or deployment.plan.head.name != self.head.name:
            raise ValueError("adopt_head needs a deployment with the same head")
        self.deployment = deployment
        self.plan = deployment.plan
        self.timeouts = deployment.timeouts
        self.solo_head = deployment.solo_head
        self.combine_head = deployment.plan.head
        if not self.degraded:
            self.head.spec = deployment.plan.head
        self.head.policy = deployment.policy
        self.head.backoff = Backoff(deployment.policy)
