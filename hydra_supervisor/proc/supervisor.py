"""Run one Deployment: start peers then head, health-gate them, restart what dies or hangs,
stop everything — with every OS and network touch behind `Seams`, so each policy case runs in a
fast test on fake children.

Each managed process is a ManagedProcess with an explicit State and a transition table; an
illegal transition raises (a bug) and ends the run FATAL with that reason. The Supervisor is the
single owner of all of them and runs one loop: converge (peers up and HELLO-checked, then the
head up and /health 200 from hydra's own child), then wait for the first event and react:

  head exits            its peers are checked first (a dead, frozen or unreachable peer makes it
                        a peer loss); otherwise restart the head only
  peer lost             exited, frozen (process stopped; or in state D without CPU progress
                        for stall_timeout while its head serves), or stalled (requests in flight
                        get no byte while neither the head nor its local peers make CPU
                        progress, D state included; a remote peer that no longer completes a
                        TCP connect then) — noticed in every state of the head
                        (loading, backing off, serving): on_peer_loss restart: stop the head,
                        restart the peer(s), HELLO, head; degrade: SOLO head meanwhile, back to
                        COMBINE once SOLO served stable_after and the peers were stable as long;
                        fail: FATAL. A remote peer is re-probed when its head dies and on a timer
                        while it is away, for at most restart.window seconds.
  head hung             judged by progress, not one endpoint's latency: a stopped process (state
                        T) after a short grace; /health silent AND no CPU progress for
                        hang_timeout. A busy head (CPU advancing) whose /health waits behind a
                        burst is left alone.
Restarts back off (backoff.py); a spent budget is FATAL. Liveness of children is their exit seen
through asyncio (never os.waitpid(-1)); orphans re-parented to hydra (a child subreaper) are
reaped by pid.

The parts, one job each: managed.py (ManagedProcess and its state machine), seams.py (the OS
and network touches), supervisor_base.py (state, status, stopping one process), watching.py
(the watching rules), starting.py (starting one process); this module is the loop, its
answers to each event, planned restarts and stopping everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from hydra_supervisor.config.profile import PeerLoss
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import Role
from hydra_supervisor.proc import process
from hydra_supervisor.proc.backoff import Backoff
from hydra_supervisor.proc.managed import (
    ChangeFailed,
    Fatal,
    IllegalTransition,
    ManagedProcess,
    PeerLost,
    StartFailed,
    State,
)
from hydra_supervisor.proc.starting import SupervisorStarting

log = logging.getLogger("hydra")


class Supervisor(SupervisorStarting):
    """Owns every ManagedProcess of one Deployment; the only code that changes their states."""

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        reaper = asyncio.ensure_future(self._reap_forever()) if self.seams.reap else None
        try:
            if self.seams.reap:
                process.become_subreaper()
            await self._loop()
        except Fatal as exc:
            self.fatal = str(exc)
            self.stop_reason = f"FATAL: {exc}"
            log.error("FATAL: %s", exc)
        except IllegalTransition as exc:  # a bug: say so loudly, then stop cleanly
            self.fatal = f"internal error (illegal state transition {exc}); please report"
            self.stop_reason = f"FATAL: {self.fatal}"
            log.exception("BUG: %s", exc)
            for mp in self.procs:
                if mp.state is not State.FATAL and mp.name in str(exc):
                    mp.state, mp.reason = State.FATAL, self.fatal  # the table itself is broken
        finally:
            await self.shutdown(self.stop_reason or "hydra is stopping")
            if reaper is not None:
                reaper.cancel()
                await asyncio.gather(reaper, return_exceptions=True)
            self.publish()

    async def _reap_forever(self) -> None:
        while True:
            process.reap_adopted(self._managed_pids())
            await self.seams.sleep(1.0)

    async def _converge(self) -> None:
        if not self.degraded:
            for peer in self.peers:
                if peer.state is not State.READY:
                    up = [p for p in self.peers if p.state is State.READY]
                    await self._guarded(self._bring_up(peer), up)
        if self.head is not None and self.head.state is not State.READY:
            watch = [] if self.degraded else self.peers
            await self._guarded(self._bring_up(self.head), watch)
        if not self.first_ready.is_set():
            self.first_ready.set()
        self.fail_fast = False  # serving: from now on failures back off as usual

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            try:
                await self._converge()
                if self.stopping.is_set():
                    return
                await self._serve_one_event()
            except PeerLost as lost:
                if self.stopping.is_set():
                    return
                await self._peers_lost(lost.peers, lost.reason)
            except StartFailed:
                if self.stopping.is_set():
                    return
                raise

    async def _serve_one_event(self) -> None:
        """Everything is READY: wait for the first thing that needs an answer, and answer it."""
        waits: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(self.stopping.wait()): "stop",
            asyncio.ensure_future(self._requests.get()): "request",
        }
        head = self.head
        if head is not None and head.child is not None and head.alive:
            waits[asyncio.ensure_future(head.child.wait())] = "head-exit"
            waits[asyncio.ensure_future(self._watch_head(head))] = "hang"
        if not self.degraded:
            watch = [p for p in self.peers if p.spec.managed]
            if watch:
                waits[asyncio.ensure_future(self._watch_peers(watch))] = "peer"
        if self.recovery is not None:
            waits[self.recovery] = "peers-back"
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task is not self.recovery:  # peer recovery outlives a single event
                task.cancel()
        await asyncio.gather(*(t for t in pending if t is not self.recovery),
                             return_exceptions=True)
        # A stop wins; a peer's loss explains a head exit seen in the same instant.
        rank = {"stop": 0, "peer": 1, "head-exit": 2, "request": 3, "peers-back": 4, "hang": 5}
        first = sorted(done, key=lambda t: rank[waits[t]])[0]
        event = waits[first]
        for t in done:  # a planned restart that lost the race is not dropped
            if t is not first and waits[t] == "request":
                self._requests.put_nowait(t.result())
        if event == "stop":
            return
        if event == "peer":
            raise PeerLost(*first.result())
        if event == "request":
            await self._planned_restart(*first.result())
        elif event == "peers-back":
            self.recovery = None
            if first.result():
                await self._undegrade()
        elif event == "head-exit":
            assert head is not None
            await self._head_exited(head)
        elif event == "hang":
            assert head is not None
            kind, reason, lost = first.result()
            if kind == "stall":  # the peers named (a stall names all: which froze is unknown)
                raise PeerLost(lost or list(self.peers), reason)
            # A hung process will not act on SIGTERM (a SIGSTOPped one cannot): KILL it.
            await self._kill(head, now=True)
            await self._fail_and_wait(head, f"{reason}; killed")

    async def _head_exited(self, head: ManagedProcess) -> None:
        code = head.child.returncode if head.child else None
        head.last_exit = code
        await self._kill(head)  # what it forked (a wrapper script's llama-server) goes too
        what = f"head {process.describe_exit(code)}"
        if self.peers and not self.degraded:
            await self._check_peers(what)  # raises PeerLost: the peer's loss, not the head's
        await self._fail_and_wait(head, what)

    async def _peers_lost(self, peers: list[ManagedProcess], reason: str) -> None:
        """The head cannot serve without its peers: stop it, then restart the pair (peers
        first), degrade to SOLO, or fail — as on_peer_loss says."""
        log.warning("peer loss: %s", reason)
        head = self.head
        for p in peers:
            p.note(f"lost: {reason}")
        if head is not None and head.state not in (State.STOPPED, State.FATAL):
            if head.child is not None and head.child.returncode is not None:
                why = (f"{process.describe_exit(head.child.returncode)} after its peer was "
                       f"lost ({reason})")
                await self._stop_one(head, why, show_exit=False)
            else:
                # Nothing to save: it cannot serve without its peer, and one blocked on a
                # frozen peer would sit out SIGTERM's grace. KILL it.
                await self._stop_one(head, f"stopped: {reason}", now=True)
        # A frozen or stalled peer still runs: KILL it (a stopped process ignores TERM).
        managed = [p for p in peers if p.spec.managed]
        stops = await asyncio.gather(*(self._kill(p, now=True) for p in managed))
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
        if self.on_peer_loss is PeerLoss.DEGRADE and self.solo_head is not None \
                and head is not None:
            for p in peers:
                why = f"{reason}; head degraded to SOLO meanwhile"
                if p.spec.managed:
                    with contextlib.suppress(Fatal):  # FATAL peer: the head stays SOLO
                        p.record_failure(why)
                else:
                    p.to(State.BACKOFF, why)
            self.degraded = (f"DEGRADED: {reason}; serving SOLO on {self.solo_head.device} "
                             "until the peers are back")
            log.warning("%s", self.degraded)
            head.spec = self.solo_head
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
        assert self.head is not None
        head = self.head
        hold = head.policy.stable_after
        frozen: dict[str, float] = {}
        while True:
            try:
                for peer in self.peers:
                    if peer.state is State.FATAL:
                        raise Fatal(f"{peer.name}: {peer.reason}")
                    if peer.state is State.READY and peer.spec.managed and \
                            (why := self._peer_problem(peer, frozen)):
                        if peer.alive:
                            await self._kill(peer, now=True)
                        peer.record_failure(f"peer {peer.name} {why}")
                    if peer.state is State.BACKOFF:
                        await self._sleep(peer.backoff.delay())
                        peer.restarts += 1
                    if peer.state is not State.READY:
                        await self._bring_up(peer)
            except Fatal as exc:
                self.degraded = (f"DEGRADED for good: {exc}; serving SOLO on "
                                 f"{head.spec.device} (restart the peer by hand)")
                log.error("%s", self.degraded)
                self.publish()
                return False
            now = self._now()
            waits = [hold - (now - p.ready_since) for p in self.peers
                     if p.ready_since is not None]
            waits.append(hold - (now - head.ready_since) if head.ready_since is not None
                         else hold)
            left = max(waits)
            if left <= 0 and head.state is State.READY and all(
                    p.state is State.READY and (p.alive or not p.spec.managed)
                    for p in self.peers):
                if self.before_head_swap is not None:
                    await self.before_head_swap("combine")
                return True
            self.degraded = (self.degraded or "").split(";")[0] + \
                f"; peers back, returning to COMBINE once SOLO and peers are {hold:.0f}s stable"
            self.publish()
            watch = [p.child.wait() for p in self.peers
                     if p.spec.managed and p.alive and p.child]
            await self._race(self._sleep(min(max(left, 0.05), 1.0)), *watch)

    async def _undegrade(self) -> None:
        log.warning("peers are back and stable: returning %s to COMBINE", self.plan.profile)
        assert self.head is not None and self.combine_head is not None
        await self._stop_one(self.head, "peers are back: switching to COMBINE")
        self.head.spec = self.combine_head
        self.degraded = None
        self.head.restarts += 1

    # -- planned restarts and stopping -----------------------------------------------------

    async def restart(self, name: str, fail_fast: bool = False) -> None:
        """A planned restart of one process (not counted as a failure); a peer restarts its
        pair, peer first. Runs on the supervisor's loop between events; returns when done.
        `fail_fast` (a change: new settings): the first failed start raises ChangeFailed at
        once, the failed process is left FATAL and the supervisor waits for the caller's next
        restart (its rollback) instead of backing off."""
        if not any(p.name == name for p in self.procs):
            raise KeyError(f"no process named {name!r}: {', '.join(p.name for p in self.procs)}")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._requests.put((name, fut, fail_fast))
        waiter: asyncio.Future[Any] = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if fut.done():
            fut.result()

    async def _planned_restart(self, name: str, fut: asyncio.Future[None],
                               fail_fast: bool = False) -> None:
        mp = next(p for p in self.procs if p.name == name)
        try:
            self.fail_fast = fail_fast
            head = self.head
            if mp.spec.role is Role.PEER and head is not None:
                await self._stop_one(head, f"planned restart of {name}")
                head.restarts += 1
            await self._stop_one(mp, "planned restart")
            mp.restarts += 1
            mp.backoff.reset()
            await self._converge()
        except ChangeFailed as exc:
            self.fail_fast = False
            if not fut.done():
                fut.set_exception(exc)
            await self._next_change()
        finally:
            self.fail_fast = False
            if not fut.done():
                fut.set_result(None)

    async def _next_change(self) -> None:
        """A planned change failed fast: nothing is restarted on its own; the caller's next
        planned restart (its rollback) runs next, or a stop."""
        get = asyncio.ensure_future(self._requests.get())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([get, stop], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not get.done():
                get.cancel()
        if get.done() and not get.cancelled():
            req = get.result()
            if self.stopping.is_set():
                if not req[1].done():
                    req[1].set_result(None)
                return
            await self._planned_restart(*req)

    def adopt_head(self, deployment: Deployment) -> None:
        """Take `deployment`, whose peers are those running now (plandiff says HEAD): the head's
        spec, the policies and the timeouts change; the next head start (a planned restart)
        uses them. Peers keep running untouched."""
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

    def request_stop(self, reason: str) -> None:
        """From a signal handler: remember why, and let the loop do the stopping."""
        if self.stop_reason is None:
            self.stop_reason = reason
        log.info("%s: stopping (%s)", self.plan.profile, reason)
        self.stopping.set()

    def kill_all_now(self) -> None:
        """A second Ctrl-C: SIGKILL every child's group at once (the stop path then sees the
        exits and finishes without waiting out its grace)."""
        for mp in self.procs:
            if mp.child is not None and mp.child.returncode is None:
                mp.child.signal_group(9)

    async def shutdown(self, reason: str) -> None:
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._do_shutdown(reason))
        await asyncio.shield(self._shutdown)

    async def _do_shutdown(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stopping.set()
        if self.recovery is not None:
            self.recovery.cancel()
            await asyncio.gather(self.recovery, return_exceptions=True)
            self.recovery = None
        # In parallel: each process has its own bounded stop, and one stuck child (reported
        # with pid and state) must not hold up the others. Peers get their TERM once the head
        # is gone (bounded by 1 s), so that the head does not abort on a vanished peer.
        head_stop = asyncio.ensure_future(self._stop_for_good(self.head, reason)) \
            if self.head is not None else None

        async def peer_stop(mp: ManagedProcess) -> None:
            if head_stop is not None:
                await self._race(asyncio.shield(head_stop), self.seams.sleep(1.0))
            await self._stop_for_good(mp, reason)
        await asyncio.gather(*(peer_stop(mp) for mp in self.peers))
        if head_stop is not None:
            await head_stop
        if self.seams.reap:
            leftovers = process.adopted(self._managed_pids())
            for p in leftovers:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, 9)
            await self.seams.sleep(0.05 if leftovers else 0)
            process.reap_adopted(self._managed_pids())
        log.info("%s: stopped (%s)", self.plan.profile, self.stop_reason)
        self.publish()

    async def _stop_for_good(self, mp: ManagedProcess, reason: str) -> None:
        if mp.state is State.FATAL:
            if mp.alive:
                await self._kill(mp)
            return
        await self._stop_one(mp, reason)
