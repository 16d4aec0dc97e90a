"""The Supervisor's restart policy: its answer to each failure the watching saw. A head that
exited (its peers checked first: their loss explains it, and the status names whichever of them
ended first) or hung restarts alone, after its backoff, and reuses its running peers (a
ggml-rpc-server outlives its head: process.py); a spent budget is FATAL. A lost peer takes
its head down, then on_peer_loss says: restart the pair (peers first, after their backoff),
degrade the head to SOLO meanwhile (the peers come back in the background; back to COMBINE once
SOLO and the peers have been stable as long), or fail (FATAL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from hydra_supervisor.config.profile import PeerLoss
from hydra_supervisor.proc import process
from hydra_supervisor.proc.lineup import Lineup
from hydra_supervisor.proc.managed import Fatal, ManagedProcess, PeerLost, State
from hydra_supervisor.proc.seams import Seams, race, sleep_or_stop
from hydra_supervisor.proc.starting import Starter
from hydra_supervisor.proc.stopping import Stopper
from hydra_supervisor.proc.watching import Watcher

log = logging.getLogger("hydra")


class Restarter:
    """Answers a lost peer, an exited or a hung head (see the module's doc). `on_peer_loss` is
    the Deployment's the Supervisor started with; `publish` publishes the Supervisor's status
    (a degraded head's reason changed)."""

    def __init__(self, lineup: Lineup, *, watcher: Watcher, starter: Starter, stopper: Stopper,
                 seams: Seams, stopping: asyncio.Event, on_peer_loss: PeerLoss,
                 publish: Callable[[], None]) -> None:
        self.lineup = lineup
        self.watcher = watcher
        self.starter = starter
        self.stopper = stopper
        self.seams = seams
        self.stopping = stopping
        self.on_peer_loss = on_peer_loss
        self.publish = publish
        # Degraded: bringing the peers back, True once COMBINE may return (_recover_peers).
        # It outlives the Supervisor's single events.
        self.recovery: asyncio.Future[bool] | None = None
        # Awaited before a head swap the supervisor decides itself (degraded SOLO → COMBINE):
        # the lane makes it a planned switch (hold, drain; Lane._before_head_swap). Arg: "combine".
        self.before_head_swap: Callable[[str], Awaitable[None]] | None = None

    async def _sleep(self, seconds: float) -> None:
        await sleep_or_stop(self.seams, self.stopping, seconds)

    async def head_hung(self, head: ManagedProcess, kind: str, reason: str,
                        lost: list[ManagedProcess]) -> None:
        """The watching judged the head hung, or its requests stalled on its peers."""
        if kind == "stall":  # the peers named (a stall names all: which froze is unknown)
            raise PeerLost(lost or list(self.lineup.peers), reason)
        # A hung process will not act on SIGTERM (a SIGSTOPped one cannot): KILL it.
        await self.stopper.kill(head, now=True)
        await self._fail_and_wait(head, f"{reason}; killed")

    async def peers_back(self, recovery: asyncio.Future[bool]) -> None:
        """The recovery ended (`recovery`, done): back to COMBINE when the peers came back
        stable; the head stays SOLO when one spent its budget."""
        self.recovery = None
        if recovery.result():
            await self._undegrade()

    async def end_recovery(self) -> None:
        """The run ends: stop bringing the peers back."""
        if self.recovery is not None:
            self.recovery.cancel()
            await asyncio.gather(self.recovery, return_exceptions=True)
            self.recovery = None

    async def head_exited(self, head: ManagedProcess) -> None:
        """The head exited: a lost peer explains it (PeerLost); else it restarts alone."""
        code = head.child.returncode if head.child else None
        head.last_exit = code
        await self.stopper.kill(head)  # what it forked (a wrapper script's llama-server) goes too
        what = f"head {process.describe_exit(code)}"
        if self.lineup.peers and not self.lineup.degraded:
            lost = await self.watcher.lost_peers()
            if lost:  # the pair restarts (PeerLost); the status names what died first
                named = "; ".join(f"peer {p.name} {w}" for p, w in lost)
                if _died_first(head, [p for p, _ in lost]):
                    raise PeerLost([p for p, _ in lost], f"{named} after its head died "
                                   f"({what})", head_first=what)
                raise PeerLost([p for p, _ in lost], f"{named} ({what})")
        await self._fail_and_wait(head, what)

    async def peers_lost(self, peers: list[ManagedProcess], reason: str,
                         head_first: str | None = None) -> None:
        """The head cannot serve without its peers: stop it, then restart the pair (peers
        first), degrade to SOLO, or fail — as on_peer_loss says. `head_first`: the head died
        before them (PeerLost.head_first): its end, not their loss, is said as the cause."""
        log.warning("peer loss: %s", reason)
        head = self.lineup.head
        for p in peers:
            p.note(f"lost: {reason}")
        if head is not None and head.state not in (State.STOPPED, State.FATAL):
            if head.child is not None and head.child.returncode is not None:
                code = process.describe_exit(head.child.returncode)
                why = (f"{code} (it died first; its peer was lost after it)" if head_first
                       else f"{code} after its peer was lost ({reason})")
                await self.stopper.stop(head, why, show_exit=False)
            else:
                # Nothing to save: it cannot serve without its peer, and one blocked on a
                # frozen peer would sit out SIGTERM's grace. KILL it.
                await self.stopper.stop(head, f"stopped: {reason}", now=True)
        # A frozen or stalled peer still runs: KILL it (a stopped process ignores TERM).
        managed = [p for p in peers if p.spec.managed]
        stops = await asyncio.gather(*(self.stopper.kill(p, now=True) for p in managed))
        for p, res in zip(managed, stops, strict=True):
            if res.stuck:  # D state (a wedged driver): reported unkillable; the restart does
                p.child = None  # not wait for it again, and a new peer moves off its port
        for p in peers:
            if p.child is not None and p.child.returncode is not None:
                p.last_exit = p.child.returncode
        if self.on_peer_loss is PeerLoss.FAIL:
            for p in peers:
                p.to(State.FATAL, f"{reason}; on_peer_loss: fail")
            raise Fatal(f"{reason}; on_peer_loss is fail")
        if head is not None:
            head.restarts += 1  # the head restarts with its peers (or as SOLO)
        solo = self.lineup.solo_head
        if self.on_peer_loss is PeerLoss.DEGRADE and solo is not None and head is not None:
            for p in peers:
                why = f"{reason}; head degraded to SOLO meanwhile"
                if p.spec.managed:
                    with contextlib.suppress(Fatal):  # FATAL peer: the head stays SOLO
                        p.record_failure(why)
                else:
                    p.to(State.BACKOFF, why)
            self.lineup.degrade(f"DEGRADED: {reason}; serving SOLO on {solo.device} "
                                "until the peers are back")
            log.warning("%s", self.lineup.degraded)
            self.recovery = asyncio.ensure_future(self._recover_peers())
            self.publish()
            return
        delays = []
        for p in peers:
            if p.spec.managed:
                delays.append(p.record_failure(reason))
            else:
                p.to(State.BACKOFF, f"{reason}; waiting for it to answer HELLO again")
        await self._sleep(max(delays, default=0.0))
        for p in peers:
            p.restarts += 1

    async def _fail_and_wait(self, mp: ManagedProcess, reason: str) -> None:
        """Count a failure (FATAL when the budget is spent), wait out its backoff."""
        delay = mp.record_failure(reason)
        await self._sleep(delay)
        mp.restarts += 1

    async def _recover_peers(self) -> bool:
        """Degraded: bring the peers back (with backoff) while the SOLO head serves. Return to
        COMBINE (True) only when the SOLO head has served restart.stable_after seconds AND
        every peer has stayed up as long — each switch costs a head reload, so neither a
        flapping peer nor a fresh SOLO head may make the head flap. A peer that spends its
        restart budget leaves the head SOLO for good (False): serving beats failing."""
        assert self.lineup.head is not None
        head = self.lineup.head
        hold = head.policy.stable_after
        frozen: dict[str, float] = {}
        while True:
            try:
                for peer in self.lineup.peers:
                    if peer.state is State.FATAL:
                        raise Fatal(f"{peer.name}: {peer.reason}")
                    if peer.state is State.READY and peer.spec.managed and \
                            (why := self.watcher.peer_problem(peer, frozen)):
                        if peer.alive:
                            await self.stopper.kill(peer, now=True)
                        peer.record_failure(f"peer {peer.name} {why}")
                    if peer.state is State.BACKOFF:
                        await self._sleep(peer.backoff.delay())
                        peer.restarts += 1
                    if peer.state is not State.READY:
                        await self.starter.bring_up(peer)
            except Fatal as exc:
                self.lineup.degraded = (f"DEGRADED for good: {exc}; serving SOLO on "
                                        f"{head.spec.device} (restart the peer by hand)")
                log.error("%s", self.lineup.degraded)
                self.publish()
                return False
            now = self.seams.clock()
            waits = [hold - (now - p.ready_since) for p in self.lineup.peers
                     if p.ready_since is not None]
            waits.append(hold - (now - head.ready_since) if head.ready_since is not None
                         else hold)
            left = max(waits)
            if left <= 0 and head.state is State.READY and all(
                    p.state is State.READY and (p.alive or not p.spec.managed)
                    for p in self.lineup.peers):
                if self.before_head_swap is not None:
                    await self.before_head_swap("combine")
                return True
            self.lineup.degraded = (self.lineup.degraded or "").split(";")[0] + \
                f"; peers back, returning to COMBINE once SOLO and peers are {hold:.0f}s stable"
            self.publish()
            watch = [p.child.wait() for p in self.lineup.peers
                     if p.spec.managed and p.alive and p.child]
            await race(self._sleep(min(max(left, 0.05), 1.0)), *watch)

    async def _undegrade(self) -> None:
        lineup = self.lineup
        log.warning("peers are back and stable: returning %s to COMBINE", lineup.plan.profile)
        assert lineup.head is not None and lineup.combine_head is not None
        await self.stopper.stop(lineup.head, "peers are back: switching to COMBINE")
        lineup.undegrade()
        lineup.head.restarts += 1


def _died_first(head: ManagedProcess, peers: list[ManagedProcess]) -> bool:
    """Whether the head exited before every lost peer did (a peer that did not exit, frozen or
    remote, was lost after it). A peer that exited first is what killed the head (a head whose
    peer vanishes aborts at its next request)."""
    at = head.child.exited_at if head.child is not None else None
    if at is None:
        return False
    for p in peers:
        if p.child is not None and p.spec.managed and p.child.returncode is not None:
            pat = p.child.exited_at
            if pat is None or pat <= at:
                return False
    return True
