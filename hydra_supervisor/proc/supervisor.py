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
                        for stall_timeout while its head serves), or stalled (a request in flight
                        gets no byte while neither the head nor its local peers make CPU
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

The Supervisor composes collaborators, one job each, that share one Lineup (lineup.py: the
processes and the specs in force): the Starter (starting.py: start sequencing, peers then head,
one process up with its backoff), the Watcher (watching.py: exits, freezes, the head's health,
the stall rule), the Restarter (restarts.py: the answer to a lost peer, an exited or hung head:
backoff, on_peer_loss, FATAL) and the Stopper (stopping.py: stopping one process, bounded).
managed.py is ManagedProcess and its state machine; seams.py the OS and network touches. This
module is the Supervisor itself: its loop and which event wins, planned restarts, a new head
adopted, stopping everything, and its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hydra_supervisor.errors import exhausted
from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.plan import Plan, Role
from hydra_supervisor.plan.ports import client_host, host_port
from hydra_supervisor.proc import process
from hydra_supervisor.proc.health import Gated as Traffic
from hydra_supervisor.proc.lineup import Lineup
from hydra_supervisor.proc.managed import (
    ChangeFailed,
    Fatal,
    IllegalTransition,
    ManagedProcess,
    PeerLost,
    StartFailed,
    State,
)
from hydra_supervisor.proc.restarts import Restarter
from hydra_supervisor.proc.seams import Seams, UpstreamMoved, race, sleep_or_stop
from hydra_supervisor.proc.starting import Starter
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.stopping import Stopper
from hydra_supervisor.proc.watching import Watcher
from hydra_supervisor.router.tunnel import TlsTunnel

log = logging.getLogger("hydra")

STARVED_MAX_S = 10.0  # out of descriptors/memory: the longest wait before watching again


class Supervisor:
    """Owns every ManagedProcess of one Deployment; it and its collaborators are the only code
    that changes their states (see the module's doc)."""

    def __init__(self, deployment: Deployment, state: StateDir, *,
                 seams: Seams | None = None) -> None:
        self.seams = seams or Seams()
        self.state = state
        self.model_label = deployment.model_label
        self.stopping = asyncio.Event()
        self.first_ready = asyncio.Event()
        self.fatal: str | None = None
        self.stop_reason: str | None = None  # why the run ended (stop asked, FATAL, bug)
        self.unkillable: list[str] = []
        # Called on every transition (the lane holds its route while the head is not READY).
        self.listeners: list[Callable[[ManagedProcess], None]] = []
        # When set, called instead of writing status.json (the daemon owns that file then).
        self.on_publish: Callable[[], None] | None = None
        self._requests: asyncio.Queue[tuple[str, asyncio.Future[None], bool]] = asyncio.Queue()
        self._shutdown: asyncio.Task[None] | None = None
        self.procs = [
            ManagedProcess(spec=spec, binary=deployment.binaries.get(spec.program, spec.program),
                           log_path=state.log_path(spec.name), policy=deployment.policy,
                           on_change=self._changed, clock=self.seams.clock)
            for spec in deployment.plan.in_start_order()
        ]
        lineup = self._lineup = Lineup(deployment, self.procs)
        self.head = lineup.head
        self.peers = lineup.peers
        self._stopper = Stopper(lineup, state, self.seams, self.unkillable)
        self._watcher = Watcher(lineup, self.seams)
        self._starter = Starter(lineup, watcher=self._watcher, stopper=self._stopper,
                                state=state, seams=self.seams, stopping=self.stopping,
                                pick_port=deployment.pick_port,
                                pick_internal_port=deployment.pick_internal_port)
        self._restarter = Restarter(lineup, watcher=self._watcher, starter=self._starter,
                                    stopper=self._stopper, seams=self.seams,
                                    stopping=self.stopping,
                                    on_peer_loss=deployment.on_peer_loss, publish=self.publish)

    # -- what the lane reads and sets (serve/runner.py): each kept where it is used ----------

    @property
    def deployment(self) -> Deployment:
        return self._lineup.deployment

    @property
    def plan(self) -> Plan:
        return self._lineup.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self._lineup.plan = plan

    @property
    def timeouts(self) -> Timeouts:
        return self._lineup.timeouts

    @timeouts.setter
    def timeouts(self, timeouts: Timeouts) -> None:
        self._lineup.timeouts = timeouts

    @property
    def degraded(self) -> str | None:
        """Why the head serves SOLO meanwhile (on_peer_loss: degrade), or None."""
        return self._lineup.degraded

    @degraded.setter
    def degraded(self, why: str | None) -> None:
        self._lineup.degraded = why

    @property
    def fail_fast(self) -> bool:
        """A planned change's start: the first failure ends it (ChangeFailed) instead of
        backing off (the caller rolls back). Cleared once everything is READY."""
        return self._starter.fail_fast

    @fail_fast.setter
    def fail_fast(self, on: bool) -> None:
        self._starter.fail_fast = on

    @property
    def traffic(self) -> Traffic | None:
        """The lane's traffic, read by the stall rule; None: no router in front."""
        return self._watcher.traffic

    @traffic.setter
    def traffic(self, traffic: Traffic | None) -> None:
        self._watcher.traffic = traffic

    @property
    def on_upstream_moved(self) -> UpstreamMoved | None:
        """Told when a process moves to another port because another process took its own."""
        return self._starter.on_upstream_moved

    @on_upstream_moved.setter
    def on_upstream_moved(self, callback: UpstreamMoved | None) -> None:
        self._starter.on_upstream_moved = callback

    @property
    def on_replanned(self) -> Callable[[Deployment], None] | None:
        """Told the deployment in force when a lost remote peer moved onto a spare (the layout
        re-planned there): the lane's plan follows (what a reload or CONFIGURE diffs against)."""
        return self._starter.on_replanned

    @on_replanned.setter
    def on_replanned(self, callback: Callable[[Deployment], None] | None) -> None:
        self._starter.on_replanned = callback

    @property
    def before_head_swap(self) -> Callable[[str], Awaitable[None]] | None:
        """Awaited before a head swap the supervisor decides itself (degraded SOLO → COMBINE)."""
        return self._restarter.before_head_swap

    @before_head_swap.setter
    def before_head_swap(self, callback: Callable[[str], Awaitable[None]] | None) -> None:
        self._restarter.before_head_swap = callback

    # -- status -----------------------------------------------------------------------------

    def _changed(self, mp: ManagedProcess, transition: bool) -> None:
        self.publish()
        if not transition:
            return
        for listener in list(self.listeners):
            try:
                listener(mp)
            except Exception:  # noqa: BLE001 - foreign code must not break the supervisor
                log.exception("listener %r failed on %s", listener, mp.name)

    def snapshot(self) -> dict[str, Any]:
        plan = self.plan
        return {
            "pid": os.getpid(), "profile": plan.profile, "source": plan.source,
            "mode": plan.mode, "model": self.model_label,
            "url": self._url(),
            "fatal": self.fatal, "degraded": self.degraded, "stopped": self.stop_reason,
            "unkillable": list(self.unkillable), "updated": time.time(),
            "engines": [p.row() for p in self.procs],
        }

    def _url(self) -> str:
        """Where this layout answers on its own (no Port in front: under a lane the daemon's
        status gives the Port's address): the head, or the device it lends (mode: peer)."""
        plan = self.plan
        if plan.router is not None and not plan.router.http and plan.router.rpc is not None:
            return f"ggml-rpc://{host_port(*plan.router.rpc)}"
        head = plan.head
        return f"http://{host_port(client_host(head.host), head.port)}"

    def publish(self) -> None:
        if self.on_publish is not None:  # under a lane, the daemon publishes its whole status
            self.on_publish()
            return
        try:
            self.state.write_status(self.snapshot())
        except OSError as exc:  # a full or read-only state dir must not stop the serving
            log.warning("cannot write status: %s", exc)

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
        except Exception as exc:  # anything else ends the run FATAL, with its real cause
            self.fatal = f"internal error ({type(exc).__name__}: {exc}); please report"
            self.stop_reason = f"FATAL: {self.fatal}"
            log.exception("BUG: %s: supervising stopped: %s", self.plan.profile, exc)
        finally:
            await self.shutdown(self.stop_reason or "hydra is stopping")
            if reaper is not None:
                reaper.cancel()
                await asyncio.gather(reaper, return_exceptions=True)
            self.publish()

    async def _reap_forever(self) -> None:
        while True:
            try:
                process.reap_adopted(self._starter.spawned)
            except Exception as exc:  # noqa: BLE001 - out of descriptors: try again next time
                if not exhausted(exc):
                    log.exception("reaping adopted children failed")
            await self.seams.sleep(1.0)

    async def _converge(self) -> None:
        await self._starter.converge()
        if not self.first_ready.is_set():
            self.first_ready.set()
        self.fail_fast = False  # serving: from now on failures back off as usual

    async def _loop(self) -> None:
        starved = 0  # failures in a row for want of descriptors, memory or threads
        while not self.stopping.is_set():
            try:
                await self._round()
                starved = 0
            except Exception as exc:
                if self.stopping.is_set() or not exhausted(exc):
                    raise
                starved += 1
                await self._starved(exc, starved)

    async def _round(self) -> None:
        """Converge, then answer the first event (a lost peer's recovery included)."""
        try:
            await self._converge()
            if self.stopping.is_set():
                return
            await self._serve_one_event()
        except PeerLost as lost:
            if self.stopping.is_set():
                return
            await self._restarter.peers_lost(lost.peers, lost.reason, lost.head_first)
        except StartFailed:
            if self.stopping.is_set():
                return
            raise

    async def _starved(self, exc: BaseException, times: int) -> None:
        """Watching (or a restart) failed for want of a resource (EMFILE, ENOMEM, no thread):
        the processes serve on; say so, wait (1 s doubling to STARVED_MAX_S) and watch again."""
        delay = min(STARVED_MAX_S, 2.0 ** (times - 1))
        if times == 1 or delay < STARVED_MAX_S or times % 10 == 0:
            log.warning("%s: watching failed (%s: %s); the processes serve on; watching again "
                        "in %.0fs (%d time(s) in a row)", self.plan.profile,
                        type(exc).__name__, exc, delay, times)
        await sleep_or_stop(self.seams, self.stopping, delay)

    async def _serve_one_event(self) -> None:
        """Everything is READY: wait for the first thing that needs an answer, and answer it."""
        waits: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(self.stopping.wait()): "stop",
            asyncio.ensure_future(self._requests.get()): "request",
        }
        head = self.head
        if head is not None and head.child is not None and head.alive:
            waits[asyncio.ensure_future(head.child.wait())] = "head-exit"
            waits[asyncio.ensure_future(self._watcher.watch_head(head))] = "hang"
        if not self.degraded:
            watch = [p for p in self.peers if p.spec.managed]
            if watch:
                waits[asyncio.ensure_future(self._watcher.watch_peers(watch))] = "peer"
        if self._restarter.recovery is not None:
            waits[self._restarter.recovery] = "peers-back"
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task is not self._restarter.recovery:  # peer recovery outlives a single event
                task.cancel()
        await asyncio.gather(*(t for t in pending if t is not self._restarter.recovery),
                             return_exceptions=True)
        # A stop wins; a peer's loss explains a head exit seen in the same instant.
        rank = {"stop": 0, "peer": 1, "head-exit": 2, "request": 3, "peers-back": 4, "hang": 5}
        first = sorted(done, key=lambda t: rank[waits[t]])[0]
        event = waits[first]
        for t in done:  # a planned restart that lost the race is not dropped
            if t is not first and waits[t] == "request":
                self._requests.put_nowait(t.result())
            elif t is not first and not t.cancelled():
                t.exception()  # (seen: the next round watches again)
        if event == "stop":
            return
        if event == "peer":
            raise PeerLost(*first.result())
        if event == "request":
            await self._planned_restart(*first.result())
        elif event == "peers-back":
            await self._restarter.peers_back(first)
        elif event == "head-exit":
            assert head is not None
            await self._restarter.head_exited(head)
        elif event == "hang":
            assert head is not None
            await self._restarter.head_hung(head, *first.result())

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
                await self._stopper.stop(head, f"planned restart of {name}")
                head.restarts += 1
            await self._stopper.stop(mp, "planned restart")
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
        self._lineup.adopt_head(deployment)

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
        await self._restarter.end_recovery()
        # In parallel: each process has its own bounded stop, and one stuck child (reported
        # with pid and state) must not hold up the others. Peers get their TERM once the head
        # is gone (bounded by 1 s), so that the head does not abort on a vanished peer.
        head_stop = asyncio.ensure_future(self._stopper.stop_for_good(self.head, reason)) \
            if self.head is not None else None

        async def peer_stop(mp: ManagedProcess) -> None:
            if head_stop is not None:
                await race(asyncio.shield(head_stop), self.seams.sleep(1.0))
            await self._stopper.stop_for_good(mp, reason)
        await asyncio.gather(*(peer_stop(mp) for mp in self.peers))
        if head_stop is not None:
            await head_stop
        tunnels = self._starter.take_tunnels()  # the head is gone: nothing uses them now
        if tunnels:
            await asyncio.to_thread(stop_tunnels, tunnels)
        if self.seams.reap:
            leftovers = process.adopted(self._starter.spawned)
            for p in leftovers:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, 9)
            await self.seams.sleep(0.05 if leftovers else 0)
            process.reap_adopted(self._starter.spawned)
        log.info("%s: stopped (%s)", self.plan.profile, self.stop_reason)
        self.publish()


def stop_tunnels(tunnels: list[TlsTunnel]) -> None:
    """Stop TLS tunnels (each blocks, bounded): in a thread, off the loop."""
    for t in tunnels:
        t.stop()
