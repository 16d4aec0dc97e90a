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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from hydra_supervisor.config.config import PeerLoss, RestartPolicy
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.plan.ports import client_host, port_free, port_holder
from hydra_supervisor.proc import health, llamaerr, logfiles, process
from hydra_supervisor.proc.backoff import Backoff
from hydra_supervisor.proc.health import Gated as Traffic
from hydra_supervisor.proc.rpcproto import PROTO_MAJOR, PROTO_MINOR, HelloError, Version
from hydra_supervisor.proc.state import StateDir

log = logging.getLogger("hydra")
T = TypeVar("T")

CONNECT_TIMEOUT = 3.0  # a remote peer's TCP connect (the stall rule): a black hole ends here
_NO_PROGRESS = ("disk-sleep", "D")  # uninterruptible sleep: a wedged driver, a frozen cgroup


def _progressed(st: process.ProcStat, cpu_before: float, window: float) -> bool:
    """CPU time grew by 1% of the window, and the process is not in uninterruptible sleep (its
    other threads — llama-server's HTTP one answering /health — may still tick)."""
    return st.state not in _NO_PROGRESS and st.cpu - cpu_before >= 0.01 * max(window, 1e-3)


class State(Enum):
    STOPPED = "STOPPED"
    STARTING = "STARTING"
    READY = "READY"
    UNHEALTHY = "UNHEALTHY"
    STOPPING = "STOPPING"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"


TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING, State.FATAL}),
    State.STARTING: frozenset({State.READY, State.STOPPING, State.BACKOFF, State.FATAL}),
    State.READY: frozenset({State.UNHEALTHY, State.STOPPING, State.BACKOFF, State.FATAL}),
    State.UNHEALTHY: frozenset({State.READY, State.STOPPING, State.BACKOFF, State.FATAL}),
    State.STOPPING: frozenset({State.STOPPED, State.BACKOFF, State.FATAL}),
    State.BACKOFF: frozenset({State.STARTING, State.STOPPED, State.FATAL}),
    State.FATAL: frozenset({State.STOPPED}),
}

RUNNING = (State.STARTING, State.READY, State.UNHEALTHY)


class IllegalTransition(RuntimeError):
    pass


class StartFailed(Exception):
    """One start attempt failed; the message is the reason shown in status."""


class Fatal(Exception):
    """A process gave up (FATAL); the supervisor stops and reports it."""


class ChangeFailed(Fatal):
    """A start in fail-fast mode (a planned change: switch, reload, restart) failed once: no
    backoff, no retry; the caller rolls back. The message names the process, the reason and
    llama.cpp's own error line."""


class PeerLost(Exception):
    """A peer was lost (exited, frozen, stalled, unreachable) while something else ran."""

    def __init__(self, peers: list[ManagedProcess], reason: str) -> None:
        super().__init__(reason)
        self.peers = peers
        self.reason = reason


# -- seams ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seams:
    """Everything the supervisor's policy touches outside itself; the defaults are the real ones.
    Tests pass fakes (tests/fake_children.py) and a fast clock with a matching sleep."""

    spawn: Callable[[Sequence[str], Mapping[str, str], Path], Awaitable[process.Child]] = \
        process.spawn
    http_status: Callable[..., Awaitable[int | None]] = health.http_status
    hello: Callable[..., Awaitable[Version | None]] = health.hello
    completion_probe: Callable[[str, int, float], Awaitable[tuple[bool, str]]] = \
        health.completion_probe
    slots_busy: Callable[[str, int, float], Awaitable[bool | None]] = health.slots_busy
    # What hydra sees without asking a process: the router's requests in flight (how many,
    # seconds since a byte moved) and whether a remote peer's endpoint completes a connect.
    flights: Callable[[Traffic | None], tuple[int, float | None] | None] = health.flights
    connect: Callable[[str, int, float], Awaitable[str | None]] = health.tcp_connect
    proc_stat: Callable[[int], process.ProcStat | None] = process.group_stat
    owns_port: Callable[[int, int], bool | None] = process.owns_port
    port_free: Callable[[str, int], bool] = port_free
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    reap: bool = True  # subreaper + reaping adopted orphans (off for fake children)


# -- one process ------------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    spec: EngineSpec
    binary: str
    log_path: Path
    policy: RestartPolicy
    on_change: Callable[[ManagedProcess, bool], None]  # (process, is a transition)
    clock: Callable[[], float] = time.monotonic
    state: State = State.STOPPED
    reason: str = ""
    child: process.Child | None = None
    since: float = 0.0
    started_wall: float | None = None
    ready_since: float | None = None
    restarts: int = 0
    last_exit: int | None = None
    warning: str = ""  # a lasting condition worth showing beside the state (log fallback)
    first_failure_log: str | None = None
    backoff: Backoff = field(init=False)

    def __post_init__(self) -> None:
        self.backoff = Backoff(self.policy)
        self.since = self.clock()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_head(self) -> bool:
        return self.spec.role is Role.HEAD

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child and self.child.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.child is not None and self.child.returncode is None

    def to(self, new: State, reason: str = "") -> None:
        if new is self.state:
            self.note(reason)
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value}")
        log.info("%s: %s -> %s%s", self.name, self.state.value, new.value,
                 f" ({reason})" if reason else "")
        self.state = new
        self.reason = reason
        self.since = self.clock()
        if new is State.READY:
            self.ready_since = self.since
            self.backoff.ready(self.since)
        elif new not in (State.UNHEALTHY,):
            self.ready_since = None
        self.on_change(self, True)

    def note(self, reason: str) -> None:
        """A new reason within the same state (published, logged once, no transition)."""
        if reason and reason != self.reason:
            log.info("%s: %s (%s)", self.name, self.state.value, reason)
            self.reason = reason
            self.on_change(self, False)

    def record_failure(self, reason: str) -> float:
        """Count a failure; return the backoff delay, or raise Fatal when the budget is spent."""
        verdict = self.backoff.failure(self.clock())
        if verdict.consecutive == 1:
            self._keep_first_failure_log()
        if verdict.fatal:
            msg = f"{reason}; {verdict.fatal}"
            self.to(State.FATAL, msg)
            raise Fatal(f"{self.name}: {msg}")
        self.to(State.BACKOFF, f"{reason}; restart {verdict.consecutive} in "
                f"{verdict.delay:.1f}s")
        return verdict.delay

    def _keep_first_failure_log(self) -> None:
        """Rotation keeps 3 runs: a crash loop would rotate away the one run that shows how it
        started. Keep that run's log beside the others as NAME.log.first-failure."""
        if not self.spec.managed or not self.log_path.exists():
            return
        dst = self.log_path.with_name(f"{self.log_path.name}.first-failure")
        try:
            shutil.copyfile(self.log_path, dst)
        except OSError:
            return
        self.first_failure_log = str(dst)

    def log_tail(self, n: int = 12) -> list[str]:
        return logfiles.tail(self.log_path, n)  # across a size rotation (logfiles.py)

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.spec.role.value, "pid": self.pid,
            "host": self.spec.host, "port": self.spec.port, "device": self.spec.device,
            "state": self.state.value, "reason": self.reason, "restarts": self.restarts,
            "started": self.started_wall if self.alive else None,
            "last_exit": self.last_exit,
            "managed": self.spec.managed, "log": str(self.log_path), "warning": self.warning,
            "first_failure_log": self.first_failure_log,
            "log_tail": self.log_tail() if self.state is State.FATAL else [],
        }


def _with_http_port(spec: EngineSpec, port: int) -> EngineSpec:
    """A head moved to another internal port (its `--port` argument follows)."""
    args = list(spec.args)
    if "--port" in args:
        args[args.index("--port") + 1] = str(port)
    return dataclasses.replace(spec, port=port, args=tuple(args))


# -- the supervisor ---------------------------------------------------------------------------


class Supervisor:
    """Owns every ManagedProcess of one Deployment; the only code that changes their states."""

    def __init__(self, deployment: Deployment, state: StateDir, *,
                 seams: Seams | None = None) -> None:
        self.deployment = deployment
        plan = self.plan = deployment.plan
        self.seams = seams or Seams()
        self.state = state
        self.timeouts = deployment.timeouts
        self.on_peer_loss = deployment.on_peer_loss
        self.model_label = deployment.model_label
        self.solo_head = deployment.solo_head  # the head as SOLO, for on_peer_loss: degrade
        self.pick_port = deployment.pick_port
        self.pick_internal_port = deployment.pick_internal_port
        self.stopping = asyncio.Event()
        self.first_ready = asyncio.Event()
        self.fatal: str | None = None
        self.degraded: str | None = None
        self.stop_reason: str | None = None  # why the run ended (stop asked, FATAL, bug)
        self.unkillable: list[str] = []
        self.recovery: asyncio.Future[bool] | None = None
        # The lane's traffic, read by the stall rule (its gate's flights; health.flights);
        # None: no router in front (router: false).
        self.traffic: Traffic | None = None
        # Told when a process moves to another port because another process took its own:
        # (kind "http" | "rpc", the old address, the new port). The lane re-points its route.
        self.on_upstream_moved: Callable[[str, tuple[str, int], int], None] | None = None
        # Called on every transition (the lane holds its route while the head is not READY).
        self.listeners: list[Callable[[ManagedProcess], None]] = []
        # When set, called instead of writing status.json (the daemon owns that file then).
        self.on_publish: Callable[[], None] | None = None
        # Awaited before a head swap the supervisor decides itself (degraded SOLO → COMBINE):
        # the Engine makes it a planned switch (hold, drain) once it exists. Arg: "combine".
        self.before_head_swap: Callable[[str], Awaitable[None]] | None = None
        self._requests: asyncio.Queue[tuple[str, asyncio.Future[None], bool]] = asyncio.Queue()
        # A planned change's start: the first failure ends it (ChangeFailed) instead of backing
        # off (the caller rolls back). Cleared once everything is READY.
        self.fail_fast = False
        self._shutdown: asyncio.Task[None] | None = None
        self._spawned: set[int] = set()
        self._connect_probed: dict[str, int] = {}  # remote peer -> head pid it was probed under
        self._in_d: dict[str, tuple[int, float, float]] = {}  # peer -> (pid, since, CPU) in D
        self.procs = [
            ManagedProcess(spec=spec, binary=deployment.binaries.get(spec.program, spec.program),
                           log_path=state.log_path(spec.name), policy=deployment.policy,
                           on_change=self._changed, clock=self.seams.clock)
            for spec in plan.in_start_order()
        ]
        # A peer-only engine (mode: peer) has no head: it serves its device to another host.
        self.head = next((p for p in self.procs if p.spec.role is Role.HEAD), None)
        self.combine_head = self.head.spec if self.head else None
        self.peers = [p for p in self.procs if p.spec.role is Role.PEER]

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
            "url": (f"ggml-rpc://{plan.host}:{plan.port}"
                    if plan.router and not plan.router.http
                    else f"http://{client_host(plan.host)}:{plan.port}"),
            "fatal": self.fatal, "degraded": self.degraded, "stopped": self.stop_reason,
            "unkillable": list(self.unkillable), "updated": time.time(),
            "engines": [p.row() for p in self.procs],
        }

    def publish(self) -> None:
        if self.on_publish is not None:  # an Engine publishes the whole daemon's status
            self.on_publish()
            return
        try:
            self.state.write_status(self.snapshot())
        except OSError as exc:  # a full or read-only state dir must not stop the serving
            log.warning("cannot write status: %s", exc)

    # -- small helpers ----------------------------------------------------------------------

    def _now(self) -> float:
        return self.seams.clock()

    async def _sleep(self, seconds: float) -> None:
        """Sleep, cut short by a stop request."""
        await self._race(self.seams.sleep(seconds), self.stopping.wait())

    @staticmethod
    async def _race(*aws: Awaitable[Any]) -> None:
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _managed_pids(self) -> set[int]:
        """Every child this supervisor started (each leads its own process group)."""
        return self._spawned

    # -- ports ------------------------------------------------------------------------------

    def _free_port(self, mp: ManagedProcess) -> None:
        """A managed process whose port another process took moves to a free one: a peer
        within rpc_ports (its head's --rpc/-ot follow), a head behind the router within
        internal_ports (the router's HTTP upstream follows). A head that binds the external
        port itself (router: false) cannot move: that is a start failure naming the holder."""
        spec = mp.spec
        if self.seams.port_free(spec.host, spec.port):
            return
        taken = {p.spec.port for p in self.procs} | {self.plan.port}
        if spec.role is Role.PEER:
            new = self.pick_port(taken) if self.pick_port else None
            if new is None:
                raise StartFailed(f"port {spec.port} is taken by {port_holder(spec.port)} and "
                                  "no free port is left in the node's rpc_ports range")
            old_ep = spec.endpoint
            mp.spec = spec.with_port(new)
            if self.head is not None and self.combine_head is not None:
                self.combine_head = self.combine_head.repointed(old_ep, mp.spec.endpoint)
                if not self.degraded:
                    self.head.spec = self.combine_head
            self._move_upstream("rpc", spec, new)
        else:
            behind_router = self.plan.router is not None and self.plan.router.http is not None
            new = self.pick_internal_port(taken) if behind_router and \
                self.pick_internal_port else None
            if new is None:
                raise StartFailed(f"port {spec.port} is taken by {port_holder(spec.port)}" + (
                    "" if behind_router else " (router: false: the head binds the profile's "
                    "port itself and cannot move)"))
            mp.spec = _with_http_port(spec, new)
            if self.combine_head is not None:
                self.combine_head = _with_http_port(self.combine_head, new)
            if self.solo_head is not None:
                self.solo_head = _with_http_port(self.solo_head, new)
            self._move_upstream("http", spec, new)
        log.warning("%s: port %d is taken by another process; moved to %d", mp.name,
                    spec.port, new)

    def _move_upstream(self, kind: str, old: EngineSpec, new_port: int) -> None:
        if self.on_upstream_moved is not None:
            self.on_upstream_moved(kind, (old.host, old.port), new_port)

    # -- one process ------------------------------------------------------------------------

    async def _spawn(self, mp: ManagedProcess) -> None:
        if mp.spec.program == "ggml-rpc-server" and self.plan.meta.get("prefill"):
            await self._prefill_rpc_cache(mp)  # a peer profile's `prefill:` (rpccache.py)
        self._free_port(mp)
        mp.to(State.STARTING, "spawning")
        argv = [mp.binary, *mp.spec.args]
        env = mp.spec.env_dict()
        try:
            mp.child = await self._spawn_safely(argv, env, mp.log_path)
        except process.LogUnavailable as exc:
            fallback = logfiles.fallback_path(self.state.root, mp.name)
            log.error("%s: cannot write log %s (%s); logging to %s", mp.name, mp.log_path,
                      exc, fallback)
            mp.log_path = fallback
            mp.warning = f"log dir not writable ({exc.strerror}); logging to {fallback}"
            try:
                mp.child = await self._spawn_safely(argv, env, mp.log_path)
            except OSError as exc2:
                raise StartFailed(f"cannot write its log ({exc.strerror}) nor the fallback "
                                  f"{fallback} ({exc2.strerror})") from exc2
        except OSError as exc:
            raise StartFailed(f"cannot start {mp.binary}: {exc.strerror}") from exc
        mp.started_wall = time.time()
        self._spawned.add(mp.child.pid)
        try:
            self.state.record_child(mp.name, mp.child.pid)
        except OSError as exc:
            log.warning("cannot write pidfile for %s: %s", mp.name, exc)
        mp.note(f"spawned pid {mp.child.pid}")

    async def _prefill_rpc_cache(self, mp: ManagedProcess) -> None:
        """Before a peer host's ggml-rpc-server starts: write the weights of the local GGUFs its
        profile names in `prefill:` into the cache dir that process will use (-c: LLAMA_CACHE
        or ~/.cache/llama.cpp/rpc, from its own env), so a head with the same GGUF sends only
        hashes. In a thread (hashing a big model takes seconds to minutes); cheap once done
        (hashes memoised, files present kept). A model that fails is logged and skipped: the
        rpc-server serves without its cache, the head then sends those weights."""
        import threading

        from hydra_supervisor.tools import rpccache

        if "-c" not in mp.spec.args:
            return
        cdir = rpccache.default_cache_dir({**os.environ, **mp.spec.env_dict()})
        mp.to(State.STARTING, f"filling its tensor cache {cdir}")
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def note(text: str) -> None:  # from the thread: progress in status, as a reason
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(mp.note, text)

        try:
            await asyncio.to_thread(rpccache.prefill_all, self.plan.meta["prefill"], cdir,
                                    note=note, stop=stop)
        finally:
            stop.set()  # cancelled (a stop): the thread ends at its next chunk

    async def _spawn_safely(self, argv: list[str], env: dict[str, str], log_path: Path
                            ) -> process.Child:
        """A cancelled start (its peer was lost meanwhile) must not leave an unowned child."""
        task = asyncio.ensure_future(self.seams.spawn(argv, env, log_path))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                child = await task
                child.signal_group(9)
                await process.within(child.wait(), 5.0, self.seams.sleep)
            raise

    async def _wait_ready(self, mp: ManagedProcess) -> None:
        spec = mp.spec
        budget = self.timeouts.load if spec.role is Role.HEAD else self.timeouts.peer
        started = self._now()
        deadline = started + budget
        while self._now() < deadline:
            if mp.child is not None and mp.child.returncode is not None:
                mp.last_exit = mp.child.returncode
                raise StartFailed(f"{spec.program} exited during start-up "
                                  f"({process.describe_exit(mp.child.returncode)})")
            if self.stopping.is_set():
                raise StartFailed("stop requested")
            if spec.role is Role.HEAD:
                code = await self.seams.http_status(client_host(spec.host), spec.port)
                if code == 200:
                    self._check_owner(mp)
                    return
                mp.note("loading model" if code == 503 else "waiting for /health")
            else:
                try:
                    version = await self.seams.hello(spec.host, spec.port, timeout=2.0)
                except HelloError as exc:
                    raise StartFailed(f"peer {spec.endpoint} is not a ggml-rpc-server: {exc}"
                                      ) from exc
                if version is not None:
                    if not version.compatible():
                        raise Fatal(f"{mp.name}: ggml-RPC protocol mismatch: peer "
                                    f"{spec.endpoint} speaks {version}, this llama-server "
                                    f"speaks {PROTO_MAJOR}.{PROTO_MINOR}.x")
                    return
                mp.note(f"waiting for ggml-RPC HELLO on {spec.endpoint}")
            # Probe often while a fast load may finish any moment (a switch waits on this),
            # then settle down: a loopback /health or HELLO costs microseconds either way.
            await self._sleep(0.05 if self._now() - started < 5.0 else 0.25)
        what = "/health 200" if spec.role is Role.HEAD else "HELLO"
        raise StartFailed(f"no {what} within {budget:.0f}s (load timeout)")

    def _check_owner(self, mp: ManagedProcess) -> None:
        """Ready means hydra's own child answered, not someone else on that port."""
        if mp.child is None:
            return
        owner = self.seams.owns_port(mp.child.pid, mp.spec.port)
        if owner is False:
            raise StartFailed(f"port {mp.spec.port} is answered by {port_holder(mp.spec.port)},"
                              f" not by hydra's {mp.spec.program} (pid {mp.child.pid})")

    async def _kill(self, mp: ManagedProcess, *, now: bool = False) -> process.Stopped:
        res = process.Stopped(None)
        if mp.child is not None:
            if now:
                res = await process.kill_now(mp.child, sleep=self.seams.sleep)
            else:
                res = await process.stop(mp.child, self.timeouts.stop_grace,
                                         sleep=self.seams.sleep)
            if res.code is not None:
                mp.last_exit = res.code
        if res.stuck:
            self.unkillable.append(f"{mp.name}: {res.stuck}")
            log.error("%s: %s", mp.name, res.stuck)
        else:
            self.state.forget_child(mp.name)
        return res

    async def _stop_one(self, mp: ManagedProcess, reason: str, *, now: bool = False,
                        show_exit: bool = True) -> None:
        if mp.state in RUNNING:
            mp.to(State.STOPPING, reason)
        res = await self._kill(mp, now=now) if mp.spec.managed else process.Stopped(None)
        if res.stuck:
            if mp.state is not State.FATAL:
                mp.to(State.FATAL, f"{reason}; could not be stopped: {res.stuck}")
            return
        if mp.state is State.STOPPING:
            mp.to(State.STOPPED, reason if res.code is None or not show_exit
                  else f"{reason}; {process.describe_exit(res.code)}")
        elif mp.state is State.BACKOFF:
            mp.to(State.STOPPED, reason)

    async def _bring_up(self, mp: ManagedProcess) -> None:
        """Start until READY, backing off between failures; raises Fatal or StartFailed(stop).
        A head that fails makes its peers suspect: they are checked (PeerLost) before a retry."""
        if not mp.spec.managed:
            await self._await_remote(mp)
            return
        while not self.stopping.is_set():
            try:
                if mp.alive:  # a cancelled earlier attempt left one running
                    await self._kill(mp)
                if mp.state is State.FATAL:
                    mp.to(State.STOPPED, "restarting")
                await self._spawn(mp)
                await self._wait_ready(mp)
                mp.to(State.READY, "health check passed" if mp.spec.role is Role.HEAD
                      else "HELLO answered")
                return
            except StartFailed as exc:
                if self.stopping.is_set():
                    break
                await self._kill(mp)
                if mp.is_head and not self.degraded:
                    await self._check_peers(f"head failed to start ({exc})")
                if self.fail_fast:
                    why = llamaerr.with_line(str(exc), llamaerr.from_log(mp.log_path))
                    if mp.child is not None and mp.child.returncode is not None:
                        mp.last_exit = mp.child.returncode
                    mp.to(State.FATAL, f"{why} (a planned change: not retried)")
                    raise ChangeFailed(f"{mp.name}: {why}") from exc
                if mp.state is State.STOPPED:
                    mp.to(State.STARTING, str(exc))
                delay = mp.record_failure(str(exc))
                await self._sleep(delay)
                if not self.stopping.is_set():
                    mp.restarts += 1
            except Fatal:
                await self._kill(mp)
                if mp.state is not State.FATAL:
                    mp.to(State.FATAL, "protocol mismatch")
                raise
        raise StartFailed("stop requested")

    async def _await_remote(self, mp: ManagedProcess) -> None:
        """A remote peer (endpoint:) is not hydra's to restart: HELLO it on a timer (backoff
        delays) until it answers, for at most restart.window seconds, then FATAL."""
        budget = mp.policy.window
        t0 = self._now()
        tries = 0
        while not self.stopping.is_set():
            if mp.state in (State.STOPPED, State.FATAL):
                if mp.state is State.FATAL:
                    mp.to(State.STOPPED, "re-probing")
                mp.to(State.STARTING, f"probing remote peer {mp.spec.endpoint}")
            elif mp.state is State.BACKOFF:
                mp.to(State.STARTING, f"probing remote peer {mp.spec.endpoint} again")
            asked = self._now()
            try:
                version = await self.seams.hello(mp.spec.host, mp.spec.port, timeout=2.0)
            except HelloError as exc:
                version = None
                why = f"not a ggml-rpc-server: {exc}"
            else:
                why = "no HELLO answer" if version is not None else \
                    self._why_no_hello(self._now() - asked, 2.0)
            if version is not None:
                if not version.compatible():
                    mp.to(State.FATAL, f"protocol mismatch: speaks {version}")
                    raise Fatal(f"{mp.name}: ggml-RPC protocol mismatch: remote peer "
                                f"{mp.spec.endpoint} speaks {version}")
                mp.to(State.READY, "HELLO answered")
                return
            away = self._now() - t0
            if away >= budget:
                msg = (f"remote peer {mp.spec.endpoint} unreachable for {away:.0f}s "
                       f"(restart.window {budget:.0f}s), giving up")
                mp.to(State.FATAL, msg)
                raise Fatal(f"{mp.name}: {msg}")
            tries += 1
            delay = min(mp.policy.backoff_initial * 2 ** (tries - 1), mp.policy.backoff_max,
                        budget - away)
            mp.to(State.BACKOFF, f"{why} from {mp.spec.endpoint}; away {away:.0f}s, "
                  f"probing again in {delay:.1f}s")
            await self._sleep(delay)
        raise StartFailed("stop requested")

    @staticmethod
    def _why_no_hello(took: float, timeout: float) -> str:
        """Why a HELLO got no answer, from how long it took: at once (refused, or closed: a
        peer host's router whose rpc-server is down), or silence for the whole timeout — the
        host gone (a black hole), or the connection accepted and the peer serving another
        client: an rpc-server serves one head at a time and queues the next (another head, or
        the session of one that vanished without a word), or frozen. Said as such, so a head
        never waits in a peer's queue without saying so. (Nothing else is sent to tell those
        apart: a second connection would take the queue's other place.)"""
        if took < 0.75 * timeout:
            return "no HELLO answer (refused or closed at once: no rpc-server behind it)"
        return (f"no HELLO answer in {timeout:g}s (its host gone, or busy with another head: one "
                "at a time, this one waits in its queue; or frozen)")

    # -- peers: are they still there? ------------------------------------------------------

    def _freeze_grace(self) -> float:
        """How long a process may sit stopped (state T) before it counts as frozen: a debugger
        or a brief SIGSTOP/SIGCONT is not a loss."""
        h = self.timeouts.health
        return min(h.hang_timeout, max(2 * h.interval, 1.0))

    def _peer_problem(self, peer: ManagedProcess, frozen_since: dict[str, float]) -> str | None:
        if not peer.spec.managed or peer.child is None:
            return None
        if peer.child.returncode is not None:
            peer.last_exit = peer.child.returncode
            return process.describe_exit(peer.child.returncode)
        st = self.seams.proc_stat(peer.child.pid)
        if st is None:
            return None  # exiting: the exit status comes next
        now = self._now()
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
        if st.state not in _NO_PROGRESS or self.head is None or \
                self.head.state is not State.READY:
            self._in_d.pop(name, None)
            return None
        seen = self._in_d.get(name)
        if seen is None or seen[0] != pid or st.cpu - seen[2] >= 0.01 * max(now - seen[1], 1e-3):
            self._in_d[name] = (pid, now, st.cpu)
            return None
        h = self.timeouts.health
        if now - seen[1] >= (h.stall_timeout or h.hang_timeout):
            return f"frozen (state D, no CPU progress for {now - seen[1]:.0f}s)"
        return None

    async def _watch_peers(self, peers: list[ManagedProcess]) -> tuple[list[ManagedProcess], str]:
        """Returns the lost peers and why, as soon as a watched peer exits or freezes."""
        frozen: dict[str, float] = {}
        poll = min(0.5, self.timeouts.health.interval)
        while True:
            lost = [(p, why) for p in peers if (why := self._peer_problem(p, frozen))]
            if lost:
                await self._gather_more_losses(lost, frozen)
                return [p for p, _ in lost], "; ".join(f"peer {p.name} {w}" for p, w in lost)
            exits = [p.child.wait() for p in peers if p.spec.managed and p.alive and p.child]
            await self._race(self.seams.sleep(poll), *exits)

    async def _gather_more_losses(self, lost: list[tuple[ManagedProcess, str]],
                                  frozen: dict[str, float]) -> None:
        """Two peers killed together are one incident: give the others a moment to be seen."""
        await self._race(self.seams.sleep(0.3), *[
            p.child.wait() for p in self.peers
            if p.spec.managed and p.alive and p.child and p not in [q for q, _ in lost]])
        for p in self.peers:
            if p not in [q for q, _ in lost] and (why := self._peer_problem(p, frozen)):
                lost.append((p, why))

    async def _check_peers(self, context: str) -> None:
        """After the head died or failed to start: a dead/frozen managed peer, or a remote one
        that no longer answers HELLO (the head let go of it, so probing is safe), is a peer
        loss (PeerLost) rather than the head's failure."""
        frozen: dict[str, float] = {}
        lost = [(p, why) for p in self.peers if (why := self._peer_problem(p, frozen))]
        if lost:  # peers killed together are one incident, also when the head saw it first
            await self._gather_more_losses(lost, frozen)
        else:
            # a peer killed together with the head may not be reaped yet: wait a little
            alive = [p.child.wait() for p in self.peers if p.spec.managed and p.alive and p.child]
            if alive:
                await self._race(self.seams.sleep(0.3), *alive)
            lost = [(p, why) for p in self.peers if (why := self._peer_problem(p, frozen))]
        for p in self.peers:
            if p.spec.managed or p in [q for q, _ in lost]:
                continue
            try:
                version = await self.seams.hello(p.spec.host, p.spec.port, timeout=2.0)
            except HelloError:
                version = None
            if version is None:
                lost.append((p, f"(remote {p.spec.endpoint}) does not answer HELLO"))
        if lost:
            raise PeerLost([p for p, _ in lost],
                           "; ".join(f"peer {p.name} {w}" for p, w in lost) + f" ({context})")

    async def _guarded(self, coro: Coroutine[Any, Any, T], watch: list[ManagedProcess]) -> T:
        """Run `coro` (a start) while watching `watch` (peers already up): a peer lost meanwhile
        cancels the start and raises PeerLost — a peer is watched whatever its head does."""
        watch = [p for p in watch if p.spec.managed]
        if not watch:
            return await coro
        task = asyncio.ensure_future(coro)
        watcher = asyncio.ensure_future(self._watch_peers(watch))
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

    # -- the head: alive is progress -------------------------------------------------------

    async def _watch_head(self, head: ManagedProcess
                          ) -> tuple[str, str, list[ManagedProcess]]:
        """Returns ("hung"|"stall", reason, the lost peers) only when the head is judged hung,
        or its requests are stuck on a peer. Progress counts, not one endpoint's latency:
        /health waits in llama-server's HTTP worker pool behind user requests, so a silent
        /health with CPU time advancing is a busy head (left alone, READY). Hung = process
        stopped (state T) past a short grace, or /health silent with no CPU progress for
        hang_timeout. Stalled = the stall rule (_stalled), judged before /health is asked."""
        spec = head.spec
        policy = self.timeouts.health
        stall_after = policy.stall_timeout or policy.hang_timeout
        host = client_host(spec.host)
        assert head.child is not None
        pid = head.child.pid
        now = self._now()
        last_alive = now
        next_probe = now + policy.probe_interval
        stopped_since: float | None = None
        idle_since: float | None = None  # since when neither the head nor a peer progressed
        slots_since: float | None = None
        st0 = self.seams.proc_stat(pid)
        last_cpu, last_t = (st0.cpu if st0 else 0.0), now
        peer_st = self._peer_stats()
        while True:
            await self.seams.sleep(policy.interval)
            now = self._now()
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
            peers_progressed = any(_progressed(s, peer_st[k].cpu, now - last_t)
                                   for k, s in pst.items() if k in peer_st)
            peer_st = pst
            if progressed or peers_progressed:
                idle_since = None
            elif idle_since is None:
                idle_since = last_t  # the window just sampled showed no progress
            last_cpu, last_t = st.cpu, now
            if idle_since is not None and \
                    (stalled := await self._stalled(pid, now - idle_since, stall_after)):
                return stalled
            code = await self.seams.http_status(host, spec.port, timeout=policy.interval)
            now = self._now()
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
                if self.peers and not self.degraded and idle_since is not None and \
                        (seen is None or not seen[0]) and await self.seams.slots_busy(
                            host, spec.port, policy.interval):
                    slots_since = slots_since if slots_since is not None else now
                    if now - slots_since >= stall_after:
                        return "stall", (f"the head's request made no progress for "
                                         f"{now - slots_since:.0f}s while it waited on its "
                                         "peer (frozen peer)"), list(self.peers)
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

    async def _stalled(self, head_pid: int, idle: float, stall_after: float
                       ) -> tuple[str, str, list[ManagedProcess]] | None:
        """The stall rule, judged from what hydra sees without asking the head or its peers
        anything (a frozen process answers nothing, and /slots hangs behind it): HTTP requests
        in flight through the router with no byte either way for `stall_after` seconds while
        neither the head nor its local peers made CPU progress as long (a process in D state
        counts as none) → the peers are lost (which one froze cannot be told apart: all of
        them), or, with no peer in use, the head is hung. A remote peer, whose CPU hydra cannot
        see, is also checked once the requests have been silent for the freeze grace: an
        endpoint that no longer completes a TCP connect is lost at once. One such connect per
        remote peer per head run: it waits in the rpc-server's backlog (two places) until the
        head lets go."""
        seen = self.seams.flights(self.traffic)
        if seen is None:
            return None
        n, quiet = seen
        if not n or quiet is None:
            return None
        silent = min(quiet, idle)
        peers = [] if self.degraded else self.peers
        for p in peers:
            if p.spec.managed or silent < self._freeze_grace() or \
                    self._connect_probed.get(p.name) == head_pid:
                continue
            self._connect_probed[p.name] = head_pid
            why = await self.seams.connect(p.spec.host, p.spec.port, CONNECT_TIMEOUT)
            if why is not None:
                return "stall", (f"remote peer {p.spec.endpoint} is gone ({why}) while {n} "
                                 f"request(s) waited {silent:.0f}s without a byte"), [p]
        if silent < stall_after:
            return None
        what = (f"{n} request(s) in flight without a byte for {silent:.0f}s and no CPU "
                "progress in the head")
        if peers:
            return "stall", f"{what} or its local peers (a frozen peer)", list(peers)
        return "hung", f"{what} (hung)", []

    def _peer_stats(self) -> dict[str, process.ProcStat]:
        out = {}
        for p in self.peers:
            if p.spec.managed and p.child is not None and p.alive:
                st = self.seams.proc_stat(p.child.pid)
                if st is not None:
                    out[p.name] = st
        return out

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

