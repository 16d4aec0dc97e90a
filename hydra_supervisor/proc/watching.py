"""The Supervisor's watching rules: is a peer still there (exited, frozen: stopped past a grace
or in D state without CPU progress), is the head alive (progress, not one endpoint's latency),
and the stall rule (a request owed a byte by the head while nothing makes CPU progress). Each
rule returns or raises what it saw (PeerLost, "hung", "stall"); the Supervisor's loop and its
restart policy (restarts.py) decide what to do about it. The Watcher changes no state of a
process but the head's READY/UNHEALTHY and the reasons it notes."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import TypeVar

from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.proc import process
from hydra_supervisor.proc.health import Gated as Traffic
from hydra_supervisor.proc.lineup import Lineup
from hydra_supervisor.proc.managed import ManagedProcess, PeerLost, State
from hydra_supervisor.proc.rpcproto import HelloError, TlsFailed
from hydra_supervisor.proc.seams import Seams, race

log = logging.getLogger("hydra")
T = TypeVar("T")

CONNECT_TIMEOUT = 3.0  # a remote peer's TCP connect (the stall rule): a black hole ends here
_NO_PROGRESS = ("disk-sleep", "D")  # uninterruptible sleep: a wedged driver, a frozen cgroup
# The stall rule's CPU progress is judged over at least this trailing window: /proc counts CPU
# time in 10 ms steps, and a frozen head's HTTP threads taking requests and /health add one
# now and then — over one 0.5 s sample that is 2 %, "progress"; over 2 s it stays under 1 %.
PROGRESS_WINDOW = 2.0


def _progressed(st: process.ProcStat, cpu_before: float, window: float) -> bool:
    """CPU time grew by 1% of the window, and the process is not in uninterruptible sleep (its
    other threads — llama-server's HTTP one answering /health — may still tick)."""
    return st.state not in _NO_PROGRESS and st.cpu - cpu_before >= 0.01 * max(window, 1e-3)


def _work(st: process.ProcStat, cpu_before: float) -> float:
    """CPU seconds that count as work since the last sample (none while in state D)."""
    return 0.0 if st.state in _NO_PROGRESS else max(0.0, st.cpu - cpu_before)


class Watcher:
    """The rules that watch the peers and the head of a Lineup (see the module's doc)."""

    def __init__(self, lineup: Lineup, seams: Seams) -> None:
        self.lineup = lineup
        self.seams = seams
        # The lane's traffic, read by the stall rule (its gate's flights; health.flights);
        # None: no router in front (router: false).
        self.traffic: Traffic | None = None
        self._connect_probed: dict[str, int] = {}  # remote peer -> head pid it was probed under
        self._in_d: dict[str, tuple[int, float, float]] = {}  # peer -> (pid, since, CPU) in D
        # remote peer -> (why, when): the failed probe (HELLO, TCP connect) that found it lost
        self._failed: dict[str, tuple[str, float]] = {}

    # -- peers: are they still there? ------------------------------------------------------

    def probe_failed(self, name: str, fresh: float) -> str | None:
        """Why the probe that found remote peer `name` lost failed (no HELLO answer, no TCP
        connect), when that was less than `fresh` seconds ago; forgotten once asked. A peer
        lost without a probe of its own (a stall judged on CPU) has none."""
        why, at = self._failed.pop(name, ("", float("-inf")))
        return why if why and self.seams.clock() - at < fresh else None

    def _freeze_grace(self) -> float:
        """How long a process may sit stopped (state T) before it counts as frozen: a debugger
        or a brief SIGSTOP/SIGCONT is not a loss."""
        h = self.lineup.timeouts.health
        return min(h.hang_timeout, max(2 * h.interval, 1.0))

    def peer_problem(self, peer: ManagedProcess, frozen_since: dict[str, float]) -> str | None:
        """Why a managed peer is lost (exited, frozen), or None; `frozen_since` is the caller's
        memory of when each peer was first seen stopped."""
        if not peer.spec.managed or peer.child is None:
            return None
        if peer.child.returncode is not None:
            peer.last_exit = peer.child.returncode
            return process.describe_exit(peer.child.returncode)
        st = self.seams.proc_stat(peer.child.pid)
        if st is None:
            return None  # exiting: the exit status comes next
        now = self.seams.clock()
        if st.stopped:
            since = frozen_since.setdefault(peer.name, now)
            if now - since >= self._freeze_grace():
                return f"frozen (process stopped, state {st.state or 'T'}, {now - since:.0f}s)"
        else:
            frozen_since.pop(peer.name, None)
        return self._stuck_in_d(peer.name, peer.child.pid, st, now)

    def _stuck_in_d(self, name: str, pid: int, st: process.ProcStat, now: float) -> str | None:
        """A local peer in uninterruptible sleep (state D: a wedged driver) with no CPU progress
        for stall_timeout while its head serves is frozen, requests in flight or not: an idle
        ggml-rpc-server waits in S. Not while the head loads (a peer may read its tensor cache
        from a slow disk then, in D most of the time)."""
        if st.state not in _NO_PROGRESS or self.lineup.head is None or \
                self.lineup.head.state is not State.READY:
            self._in_d.pop(name, None)
            return None
        seen = self._in_d.get(name)
        if seen is None or seen[0] != pid or st.cpu - seen[2] >= 0.01 * max(now - seen[1], 1e-3):
            self._in_d[name] = (pid, now, st.cpu)
            return None
        h = self.lineup.timeouts.health
        if now - seen[1] >= (h.stall_timeout or h.hang_timeout):
            return f"frozen (state D, no CPU progress for {now - seen[1]:.0f}s)"
        return None

    async def watch_peers(self, peers: list[ManagedProcess]) -> tuple[list[ManagedProcess], str]:
        """Returns the lost peers and why, as soon as a watched peer exits or freezes."""
        frozen: dict[str, float] = {}
        poll = min(0.5, self.lineup.timeouts.health.interval)
        while True:
            lost = [(p, why) for p in peers if (why := self.peer_problem(p, frozen))]
            if lost:
                await self._gather_more_losses(lost, frozen)
                return [p for p, _ in lost], "; ".join(f"peer {p.name} {w}" for p, w in lost)
            exits = [p.child.wait() for p in peers if p.spec.managed and p.alive and p.child]
            await race(self.seams.sleep(poll), *exits)

    async def _gather_more_losses(self, lost: list[tuple[ManagedProcess, str]],
                                  frozen: dict[str, float]) -> None:
        """Two peers killed together are one incident: give the others a moment to be seen."""
        await race(self.seams.sleep(0.3), *[
            p.child.wait() for p in self.lineup.peers
            if p.spec.managed and p.alive and p.child and p not in [q for q, _ in lost]])
        for p in self.lineup.peers:
            if p not in [q for q, _ in lost] and (why := self.peer_problem(p, frozen)):
                lost.append((p, why))

    async def check_peers(self, context: str) -> None:
        """After the head died or failed to start: a dead/frozen managed peer, or a remote one
        that no longer answers HELLO (the head let go of it, so probing is safe), is a peer
        loss (PeerLost) rather than the head's failure."""
        lost = await self.lost_peers()
        if lost:
            raise PeerLost([p for p, _ in lost],
                           "; ".join(f"peer {p.name} {w}" for p, w in lost) + f" ({context})")

    async def lost_peers(self) -> list[tuple[ManagedProcess, str]]:
        """The peers lost now, each with why (check_peers)."""
        frozen: dict[str, float] = {}
        lost = [(p, why) for p in self.lineup.peers if (why := self.peer_problem(p, frozen))]
        if lost:  # peers killed together are one incident, also when the head saw it first
            await self._gather_more_losses(lost, frozen)
        else:
            # a peer killed together with the head may not be reaped yet: wait a little
            alive = [p.child.wait() for p in self.lineup.peers
                     if p.spec.managed and p.alive and p.child]
            if alive:
                await race(self.seams.sleep(0.3), *alive)
            lost = [(p, why) for p in self.lineup.peers if (why := self.peer_problem(p, frozen))]
        for p in self.lineup.peers:
            if p.spec.managed or p in [q for q, _ in lost]:
                continue
            try:
                version = await self.seams.hello(p.spec.host, p.spec.port, timeout=2.0,
                                                  tls=p.spec.tls)
            except TlsFailed as exc:  # what TLS refused, and the fix
                lost.append((p, f"(remote {p.spec.endpoint}) {exc}"))
                continue
            except HelloError:
                version = None
            if version is None:
                lost.append((p, f"(remote {p.spec.endpoint}) does not answer HELLO"))
                self._failed[p.name] = ("no HELLO answer when found lost", self.seams.clock())
        return lost

    async def guarded(self, coro: Coroutine[object, object, T], watch: list[ManagedProcess]) -> T:
        """Run `coro` (a start) while watching `watch` (peers already up): a peer lost meanwhile
        cancels the start and raises PeerLost — a peer is watched whatever its head does."""
        watch = [p for p in watch if p.spec.managed]
        if not watch:
            return await coro
        task = asyncio.ensure_future(coro)
        watcher = asyncio.ensure_future(self.watch_peers(watch))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        if watcher.done() and not watcher.cancelled() and watcher.exception() is None and (
                not task.done() or task.cancelled() or task.exception() is not None):
            raise PeerLost(*watcher.result())
        return task.result()

    # -- the head: alive is progress -------------------------------------------------------

    async def watch_head(self, head: ManagedProcess
                          ) -> tuple[str, str, list[ManagedProcess]]:
        """Returns ("hung"|"stall", reason, the lost peers) only when the head is judged hung,
        or its requests are stuck on a peer. Progress counts, not one endpoint's latency:
        /health waits in llama-server's HTTP worker pool behind user requests, so a silent
        /health with CPU time advancing is a busy head (left alone, READY). Hung = process
        stopped (state T) past a short grace, or /health silent with no CPU progress for
        hang_timeout. Stalled = the stall rule (_stalled), judged before /health is asked."""
        spec = head.spec
        policy = self.lineup.timeouts.health
        stall_after = policy.stall_timeout or policy.hang_timeout
        host = client_host(spec.host)
        assert head.child is not None
        pid = head.child.pid
        now = self.seams.clock()
        last_alive = now
        next_probe = now + policy.probe_interval
        stopped_since: float | None = None
        idle_since: float | None = None  # since when neither the head nor a peer progressed
        # the same, judged per sample (one 10 ms CPU step is progress): only for the cheap
        # remote-peer connect probe, which should come soon after a freeze (_stalled)
        quiet_since: float | None = None
        slots_since: float | None = None
        st0 = self.seams.proc_stat(pid)
        last_cpu, last_t = (st0.cpu if st0 else 0.0), now
        peer_st = self._peer_stats()
        # (time, CPU work of the head and its local peers so far): the trailing window the
        # stall rule's "no CPU progress" is judged over (PROGRESS_WINDOW, or one interval)
        window = max(PROGRESS_WINDOW, policy.interval)
        work, history = 0.0, deque([(now, 0.0)])
        while True:
            await self.seams.sleep(policy.interval)
            now = self.seams.clock()
            st = self.seams.proc_stat(pid)
            if st is None:
                continue  # exiting: the exit is the event
            if st.stopped:
                stopped_since = stopped_since if stopped_since is not None else now
                if head.state is State.READY:
                    head.to(State.UNHEALTHY, f"process stopped (state {st.state or 'T'})")
                if now - stopped_since >= self._freeze_grace():
                    return "hung", (f"process stopped (state {st.state or 'T'}) for "
                                    f"{now - stopped_since:.0f}s (hung)"), []
                continue
            stopped_since = None
            progressed = _progressed(st, last_cpu, now - last_t)
            pst = self._peer_stats()
            if progressed or any(_progressed(s, peer_st[k].cpu, now - last_t)
                                 for k, s in pst.items() if k in peer_st):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = last_t
            work += _work(st, last_cpu) + sum(_work(s, peer_st[k].cpu)
                                              for k, s in pst.items() if k in peer_st)
            peer_st = pst
            history.append((now, work))
            while len(history) > 2 and history[1][0] <= now - window:
                history.popleft()
            since, before = history[0]  # the window: at least `window` long once it can be
            if work - before >= 0.01 * max(now - since, 1e-3):
                idle_since = None
            elif idle_since is None:
                idle_since = since  # the window just sampled showed no progress
            last_cpu, last_t = st.cpu, now
            idle = None if idle_since is None else now - idle_since
            quiet = max(idle or 0.0, 0.0 if quiet_since is None else now - quiet_since)
            if quiet and (stalled := await self._stalled(pid, quiet, idle, stall_after)):
                return stalled
            code = await self.seams.http_status(host, spec.port, timeout=policy.interval)
            now = self.seams.clock()
            if code == 200:
                last_alive = now
                if head.state is State.UNHEALTHY:
                    head.to(State.READY, "answering /health again")
                elif head.reason.startswith("busy"):
                    head.note("serving")
                # No router flights to judge by (router: false, or a request sent to the
                # head's own port): /slots says whether one is in flight — a head blocked on
                # its peer may not answer it, and then this fallback judges nothing.
                seen = self.seams.flights(self.traffic)
                if self.lineup.peers and not self.lineup.degraded and idle_since is not None and \
                        (seen is None or not seen[0]) and await self.seams.slots_busy(
                            host, spec.port, policy.interval):
                    slots_since = slots_since if slots_since is not None else now
                    if now - slots_since >= stall_after:
                        return "stall", (f"the head's request made no progress for "
                                         f"{now - slots_since:.0f}s while it waited on its "
                                         "peer (frozen peer)"), list(self.lineup.peers)
                else:
                    slots_since = None
            elif progressed:
                last_alive = now  # busy: /health queued behind requests; not hung
                if head.state is State.READY:
                    head.note(f"busy: /health {'silent' if code is None else code}, "
                              "CPU time advancing")
            elif now - last_alive >= policy.hang_timeout:
                return "hung", (f"/health silent and no CPU progress for "
                                f"{now - last_alive:.0f}s (hung)"), []
            elif head.state is State.READY:
                head.to(State.UNHEALTHY, f"/health {'silent' if code is None else code}, "
                        "no CPU progress")
            if policy.probe and code == 200 and now >= next_probe:
                next_probe = now + policy.probe_interval
                ok, why = await self.seams.completion_probe(host, spec.port,
                                                            policy.probe_timeout)
                if not ok:
                    return "hung", f"completion probe failed ({why})", []

    async def _stalled(self, head_pid: int, quiet: float, idle: float | None, stall_after: float
                       ) -> tuple[str, str, list[ManagedProcess]] | None:
        """The stall rule, judged from what hydra sees without asking the head or its peers
        anything (a frozen process answers nothing, and /slots hangs behind it): the head has
        owed a request through the router a byte for `stall_after` seconds (its oldest request
        still waiting for one — new requests going up meanwhile change nothing; health.flights)
        while neither the head nor its local peers made CPU progress as long (a process in D
        state counts as none; a long prefill burns CPU) → the peers are lost (which one froze
        cannot be told apart: all of them), or, with no peer in use, the head is hung. A remote
        peer, whose CPU hydra cannot see, is also checked once a request has been owed for the
        freeze grace: an endpoint that no longer completes a TCP connect is lost at once. One
        such connect per remote peer per head run: it waits in the rpc-server's backlog (two
        places) until the head lets go. `idle`: seconds without CPU progress over the trailing
        window (None: progress); `quiet`: the same or, for the probe, judged per sample."""
        seen = self.seams.flights(self.traffic)
        if seen is None:
            return None
        n, owed = seen
        if not n or owed is None:
            return None
        waited = min(owed, quiet)
        peers = [] if self.lineup.degraded else self.lineup.peers
        for p in peers:
            if p.spec.managed or waited < self._freeze_grace() or \
                    self._connect_probed.get(p.name) == head_pid:
                continue
            self._connect_probed[p.name] = head_pid
            why = await self.seams.connect(p.spec.host, p.spec.port, CONNECT_TIMEOUT)
            if why is not None:
                self._failed[p.name] = (why, self.seams.clock())
                return "stall", (f"remote peer {p.spec.endpoint} is gone ({why}) while a "
                                 f"request waited {waited:.0f}s without a byte ({n} in "
                                 "flight)"), [p]
        if idle is None or (silent := min(owed, idle)) < stall_after:
            return None
        what = (f"a request in flight without a byte from the head for {silent:.0f}s ({n} in "
                "flight) and no CPU progress in the head")
        if peers:
            return "stall", f"{what} or its local peers (a frozen peer)", list(peers)
        return "hung", f"{what} (hung)", []

    def _peer_stats(self) -> dict[str, process.ProcStat]:
        out = {}
        for p in self.lineup.peers:
            if p.spec.managed and p.child is not None and p.alive:
                st = self.seams.proc_stat(p.child.pid)
                if st is not None:
                    out[p.name] = st
        return out
