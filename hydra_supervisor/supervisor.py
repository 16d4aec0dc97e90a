"""Run a Plan: start peers then head, health-gate them, restart what dies, stop everything.

Each managed process is a ManagedProcess with an explicit State and a transition table; an
illegal transition raises (it is a bug). The Supervisor is the single owner of all of them and
runs one loop: converge (peers up and HELLO-checked, then the head up and /health 200), then wait
for the first event (a child exits, the head stops answering /health, or a stop is asked for)
and react:
  head exits            restart the head only (healthy peers are not touched)
  peer exits            on_peer_loss restart: stop the head, restart the peer, HELLO, head;
                        fail: stop everything, FATAL
  head wedged           /health silent past hang_timeout: kill it, restart it
Restarts back off exponentially (initial → max); too many failures in the window → FATAL.
Liveness is the child's exit seen through asyncio (never os.waitpid(-1)); readiness is separate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra_supervisor import health, process
from hydra_supervisor.config import PeerLoss, RestartPolicy
from hydra_supervisor.deployment import Deployment
from hydra_supervisor.plan import EngineSpec, Role
from hydra_supervisor.ports import client_host, port_free
from hydra_supervisor.rpcproto import PROTO_MAJOR, PROTO_MINOR, HelloError
from hydra_supervisor.state import StateDir

log = logging.getLogger("hydra")


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


class IllegalTransition(RuntimeError):
    pass


class StartFailed(Exception):
    """One start attempt failed; the message is the reason shown in status."""


class Fatal(Exception):
    """A process gave up (FATAL); the supervisor stops and reports it."""


@dataclass
class ManagedProcess:
    spec: EngineSpec
    binary: str
    log_path: Path
    policy: RestartPolicy
    on_change: Callable[[ManagedProcess], None]
    state: State = State.STOPPED
    reason: str = ""
    proc: asyncio.subprocess.Process | None = None
    since: float = field(default_factory=time.monotonic)
    started_wall: float | None = None
    ready_at: float | None = None
    restarts: int = 0
    failures: collections.deque[float] = field(default_factory=collections.deque)
    consecutive: int = 0
    warning: str = ""  # a lasting condition worth showing beside the state (log fallback)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def to(self, new: State, reason: str = "") -> None:
        if new is self.state:
            return
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.name}: {self.state.value} -> {new.value}")
        log.info("%s: %s -> %s%s", self.name, self.state.value, new.value,
                 f" ({reason})" if reason else "")
        self.state = new
        self.reason = reason
        self.since = time.monotonic()
        self.on_change(self)

    def record_failure(self, reason: str) -> float:
        """Count a failure; return the backoff delay, or raise Fatal when the budget is spent."""
        now = time.monotonic()
        if self.ready_at is not None and now - self.ready_at >= self.policy.stable_after:
            self.consecutive = 0  # it ran long enough: this is a fresh incident
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.window:
            self.failures.popleft()
        self.consecutive += 1
        if len(self.failures) >= self.policy.max_failures:
            msg = (f"{reason}; {len(self.failures)} failures within "
                   f"{self.policy.window:.0f}s, giving up")
            self.to(State.FATAL, msg)
            raise Fatal(f"{self.name}: {msg}")
        delay = self.backoff_delay()
        self.to(State.BACKOFF, f"{reason}; restart in {delay:.0f}s")
        return delay

    def backoff_delay(self) -> float:
        """Capped exponential: backoff_initial doubled per consecutive failure."""
        return min(self.policy.backoff_initial * 2 ** max(self.consecutive - 1, 0),
                   self.policy.backoff_max)

    def log_tail(self, n: int = 12) -> list[str]:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return lines[-n:]

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.spec.role.value, "pid": self.pid,
            "host": self.spec.host, "port": self.spec.port, "device": self.spec.device,
            "state": self.state.value, "reason": self.reason, "restarts": self.restarts,
            "started": self.started_wall if self.alive else None,
            "managed": self.spec.managed, "log": str(self.log_path), "warning": self.warning,
            "log_tail": self.log_tail() if self.state is State.FATAL else [],
        }


class Supervisor:
    """Owns every ManagedProcess of one Plan; the only code that changes their states."""

    def __init__(self, deployment: Deployment, state: StateDir) -> None:
        self.deployment = deployment
        plan = self.plan = deployment.plan
        binaries = deployment.binaries
        policy = deployment.policy
        self.state = state
        self.timeouts = deployment.timeouts
        self.on_peer_loss = deployment.on_peer_loss
        self.model_label = deployment.model_label
        self.solo_head = deployment.solo_head  # the head as SOLO, for on_peer_loss: degrade
        self.pick_port = deployment.pick_port
        self.stopping = asyncio.Event()
        self.first_ready = asyncio.Event()
        self.fatal: str | None = None
        self.degraded: str | None = None
        self.recovery: asyncio.Task[None] | None = None
        self.router: Any = None  # the profile's Router, whose upstreams follow a moved peer
        self.procs = [
            ManagedProcess(spec=spec, binary=binaries.get(spec.program, spec.program),
                           log_path=state.log_path(spec.name), policy=policy,
                           on_change=lambda _p: self.publish())
            for spec in plan.in_start_order()
        ]
        # A peer-only engine (mode: peer) has no head: it serves its device to another host.
        self.head = next((p for p in self.procs if p.spec.role is Role.HEAD), None)
        self.combine_head = self.head.spec if self.head else None
        self.peers = [p for p in self.procs if p.spec.role is Role.PEER]

    # -- status -----------------------------------------------------------------------------

    def publish(self) -> None:
        try:
            self.state.write_status({
                "pid": os.getpid(), "profile": self.plan.profile, "source": self.plan.source,
                "mode": self.plan.mode, "model": self.model_label,
                "url": (f"ggml-rpc://{self.plan.host}:{self.plan.port}"
                        if self.plan.router and not self.plan.router.http
                        else f"http://{client_host(self.plan.host)}:{self.plan.port}"),
                "fatal": self.fatal, "degraded": self.degraded, "updated": time.time(),
                "engines": [p.row() for p in self.procs],
            })
        except OSError as exc:  # a full or read-only state dir must not stop the serving
            log.warning("cannot write status: %s", exc)

    # -- one process ------------------------------------------------------------------------

    def _free_peer_port(self, mp: ManagedProcess) -> None:
        """A managed peer whose port another process took moves to a free one (head follows)."""
        spec = mp.spec
        if spec.role is not Role.PEER or port_free(spec.host, spec.port) or not self.pick_port:
            return
        taken = {p.spec.port for p in self.peers} | {self.plan.port}
        new = self.pick_port(taken)
        if new is None:
            raise StartFailed(f"port {spec.port} is taken and no free port is left in the "
                              "node's rpc_ports range")
        old_ep = spec.endpoint
        mp.spec = spec.with_port(new)
        if self.head is not None and self.combine_head is not None:
            self.combine_head = self.combine_head.repointed(old_ep, mp.spec.endpoint)
            if not self.degraded:
                self.head.spec = self.combine_head
        log.warning("%s: port %d is taken by another process; moved to %d", mp.name,
                    spec.port, new)
        if self.router is not None and self.router.upstreams.rpc == (spec.host, spec.port):
            up = self.router.upstreams
            self.router.set_upstreams(type(up)(http=up.http, rpc=(spec.host, new),
                                               hydra=up.hydra))

    async def _spawn(self, mp: ManagedProcess) -> None:
        self._free_peer_port(mp)
        mp.to(State.STARTING, "spawning")
        argv = [mp.binary, *mp.spec.args]
        try:
            mp.proc = await process.spawn(argv, mp.spec.env_dict(), mp.log_path)
        except process.LogUnavailable as exc:
            tag = hashlib.sha1(str(self.state.root).encode()).hexdigest()[:8]
            fallback = Path(tempfile.gettempdir()) / f"hydra-{os.getuid()}-{tag}-logs" / \
                mp.log_path.name
            log.error("%s: cannot write log %s (%s); logging to %s", mp.name, mp.log_path,
                      exc, fallback)
            mp.log_path = fallback
            mp.warning = f"log dir not writable ({exc.strerror}); logging to {fallback}"
            mp.proc = await process.spawn(argv, mp.spec.env_dict(), mp.log_path)
        except OSError as exc:
            raise StartFailed(f"cannot start {mp.binary}: {exc.strerror}") from exc
        mp.started_wall = time.time()
        try:
            self.state.record_child(mp.name, mp.proc.pid)
        except OSError as exc:
            log.warning("cannot write pidfile for %s: %s", mp.name, exc)
        self.publish()

    async def _wait_ready(self, mp: ManagedProcess) -> None:
        spec = mp.spec
        budget = self.timeouts.load if spec.role is Role.HEAD else self.timeouts.peer
        deadline = time.monotonic() + budget
        while time.monotonic() < deadline:
            if mp.proc is not None and mp.proc.returncode is not None:
                raise StartFailed(f"{spec.program} exited during start-up "
                                  f"({process.describe_exit(mp.proc.returncode)})")
            if self.stopping.is_set():
                raise StartFailed("stop requested")
            if spec.role is Role.HEAD:
                code = await health.http_status(client_host(spec.host), spec.port)
                if code == 200:
                    return
                mp.reason = "loading model" if code == 503 else "waiting for /health"
            else:
                try:
                    version = await health.hello(spec.host, spec.port, timeout=2.0)
                except HelloError as exc:
                    raise StartFailed(f"peer {spec.endpoint} is not a ggml-rpc-server: {exc}"
                                      ) from exc
                if version is not None:
                    if not version.compatible():
                        raise Fatal(f"{mp.name}: ggml-RPC protocol mismatch: peer "
                                    f"{spec.endpoint} speaks {version}, this llama-server "
                                    f"speaks {PROTO_MAJOR}.{PROTO_MINOR}.x")
                    return
                mp.reason = f"waiting for ggml-RPC HELLO on {spec.endpoint}"
            await self._sleep(0.25)
        what = "/health 200" if spec.role is Role.HEAD else "HELLO"
        raise StartFailed(f"no {what} within {budget:.0f}s (load timeout)")

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _kill(self, mp: ManagedProcess) -> int | None:
        code = None
        if mp.proc is not None:
            code = await process.stop(mp.proc, self.timeouts.stop_grace)
        self.state.forget_child(mp.name)
        return code

    async def _stop_one(self, mp: ManagedProcess, reason: str) -> None:
        if mp.state in (State.STARTING, State.READY, State.UNHEALTHY):
            mp.to(State.STOPPING, reason)
        code = await self._kill(mp) if mp.spec.managed else None
        if mp.state is State.STOPPING:
            mp.to(State.STOPPED, reason if code is None
                  else f"{reason} ({process.describe_exit(code)})")
        elif mp.state is State.BACKOFF:
            mp.to(State.STOPPED, reason)

    async def _bring_up(self, mp: ManagedProcess) -> None:
        """Start until READY, backing off between failures; raises Fatal or StartFailed(stop)."""
        while not self.stopping.is_set():
            try:
                if mp.alive:  # a cancelled earlier attempt left one running
                    await self._kill(mp)
                if mp.spec.managed:
                    await self._spawn(mp)
                else:
                    mp.to(State.STARTING, f"probing remote peer {mp.spec.endpoint}")
                await self._wait_ready(mp)
                mp.to(State.READY, "health check passed" if mp.spec.role is Role.HEAD
                      else "HELLO answered")
                mp.ready_at = time.monotonic()
                return
            except StartFailed as exc:
                if self.stopping.is_set():
                    break
                await self._kill(mp)
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

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._loop()
        except Fatal as exc:
            self.fatal = str(exc)
            log.error("FATAL: %s", exc)
        except StartFailed:
            pass
        except IllegalTransition as exc:  # a bug: say so loudly, then stop cleanly
            self.fatal = f"internal error (illegal state transition {exc}); please report"
            log.exception("BUG: %s", exc)
        finally:
            await self.shutdown("hydra is stopping")
            self.publish()

    async def _converge(self) -> None:
        if not self.degraded:
            for peer in self.peers:
                if peer.state is not State.READY:
                    await self._bring_up(peer)
        if self.head is not None and self.head.state is not State.READY:
            await self._bring_up(self.head)
        self.first_ready.set()

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            await self._converge()
            event, who = await self._next_event()
            if event == "stop":
                return
            if event == "peers-back":
                await self._undegrade()
            elif event == "exit" and self.head is not None and who is self.head:
                code = self.head.proc.returncode if self.head.proc else None
                self.state.forget_child(self.head.name)
                if self.peers and not self.degraded:
                    await asyncio.sleep(0.3)  # let a peer's exit, if any, be reaped too
                dead = [p for p in self.peers if p.spec.managed and p.proc is not None
                        and not p.alive and not self.degraded]
                if dead:
                    # The head died because its peer did (abort at the next RPC call): treat
                    # it as the peer's loss, which restarts the pair in order.
                    await self._stop_one(self.head, f"head {process.describe_exit(code)} "
                                         f"after its peer {dead[0].name} died")
                    await self._peer_lost(dead[0])
                    continue
                await self._fail_and_wait(self.head, f"head {process.describe_exit(code)}")
            elif event.startswith("hang") and self.head is not None:
                reason = event.partition(":")[2]
                # A hung process will not act on SIGTERM (a SIGSTOPped one cannot): KILL it.
                if self.head.proc is not None:
                    await process.kill_now(self.head.proc)
                self.state.forget_child(self.head.name)
                await self._fail_and_wait(self.head, f"{reason}; killed")
            elif event == "exit" and who is not None:
                await self._peer_lost(who)

    async def _peer_lost(self, peer: ManagedProcess) -> None:
        code = peer.proc.returncode if peer.proc else None
        self.state.forget_child(peer.name)
        reason = f"peer {peer.name} {process.describe_exit(code)}"
        # llama.cpp's head aborts at its next RPC call once its peer is gone; stop it cleanly.
        if self.head is not None and self.head.state is not State.STOPPED:
            await self._stop_one(self.head, reason)
        if self.on_peer_loss is PeerLoss.FAIL:
            peer.to(State.FATAL, f"{reason}; on_peer_loss: fail")
            raise Fatal(f"{reason}; on_peer_loss is fail")
        if self.on_peer_loss is PeerLoss.DEGRADE and self.solo_head is not None \
                and self.head is not None:
            peer.to(State.BACKOFF, f"{reason}; head degraded to SOLO meanwhile")
            self.degraded = (f"DEGRADED: {reason}; serving SOLO on {self.solo_head.device} "
                             "until the peer is back")
            log.warning("%s", self.degraded)
            self.head.spec = self.solo_head
            self.recovery = asyncio.create_task(self._recover_peers())
            return
        await self._fail_and_wait(peer, reason)

    async def _fail_and_wait(self, mp: ManagedProcess, reason: str) -> None:
        """Count a failure (FATAL when the budget is spent), wait out its backoff."""
        delay = mp.record_failure(reason)
        await self._sleep(delay)
        mp.restarts += 1

    async def _recover_peers(self) -> None:
        """Degraded mode: bring the peers back (with backoff) while the SOLO head serves, and
        return only once they have stayed up for restart.stable_after seconds: each switch
        costs a head restart, so a flapping peer must not make the head flap too."""
        assert self.head is not None
        hold = self.head.policy.stable_after
        while True:
            for peer in self.peers:
                if peer.state is not State.READY or not peer.alive:
                    if peer.state is State.READY:
                        code = peer.proc.returncode if peer.proc else None
                        peer.record_failure(f"peer {peer.name} {process.describe_exit(code)}")
                    await self._sleep(peer.backoff_delay())
                    peer.restarts += 1
                    await self._bring_up(peer)
            self.degraded = (self.degraded or "").split(";")[0] + \
                f"; peers back, returning to COMBINE after {hold:.0f}s stable"
            self.publish()
            await self._sleep(hold)
            if all(p.alive for p in self.peers if p.spec.managed):
                return

    async def _undegrade(self) -> None:
        log.warning("peers are back: returning %s to COMBINE", self.plan.profile)
        self.recovery = None
        assert self.head is not None and self.combine_head is not None
        await self._stop_one(self.head, "peer is back: switching to COMBINE")
        self.head.spec = self.combine_head
        self.degraded = None
        self.head.restarts += 1

    async def _next_event(self) -> tuple[str, ManagedProcess | None]:
        waits: dict[asyncio.Future[Any], tuple[str, ManagedProcess | None]] = {
            asyncio.ensure_future(self.stopping.wait()): ("stop", None),
        }
        if self.head is not None:
            waits[asyncio.ensure_future(self._watch_head(self.head))] = ("hang", self.head)
        for mp in self.procs:
            if mp.proc is not None and mp.spec.managed and mp.alive and not (
                    self.degraded and mp.spec.role is Role.PEER):
                waits[asyncio.ensure_future(mp.proc.wait())] = ("exit", mp)
        if self.recovery is not None:
            waits[self.recovery] = ("peers-back", None)
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task is not self.recovery:  # peer recovery outlives a single event
                task.cancel()
        await asyncio.gather(*(t for t in pending if t is not self.recovery),
                             return_exceptions=True)
        # A process exit wins over a hang verdict reached in the same instant.
        rank = {"stop": 0, "exit": 1, "peers-back": 2, "hang": 3}
        first = sorted(done, key=lambda t: rank[waits[t][0]])[0]
        event, who = waits[first]
        if event == "peers-back":
            first.result()  # re-raises Fatal from the peer's recovery
        if event == "hang":
            event = f"hang:{first.result()}"
        return event, who

    async def _watch_head(self, head: ManagedProcess) -> str:
        """Returns (with the reason) only when the head is judged hung or broken."""
        spec = head.spec
        policy = self.timeouts.health
        host = client_host(spec.host)
        last_ok = time.monotonic()
        next_probe = time.monotonic() + policy.probe_interval
        while True:
            await asyncio.sleep(policy.interval)
            code = await health.http_status(host, spec.port, timeout=policy.interval)
            now = time.monotonic()
            if code == 200:
                last_ok = now
                if head.state is State.UNHEALTHY:
                    head.to(State.READY, "answering /health again")
            elif now - last_ok >= policy.hang_timeout:
                return f"/health silent for {policy.hang_timeout:.0f}s (hung)"
            elif head.state is State.READY:
                head.to(State.UNHEALTHY, f"/health {'silent' if code is None else code}")
            if policy.probe and code == 200 and now >= next_probe:
                next_probe = now + policy.probe_interval
                ok, why = await health.completion_probe(host, spec.port, policy.probe_timeout)
                if not ok:
                    return f"completion probe failed ({why})"

    async def shutdown(self, reason: str) -> None:
        self.stopping.set()
        if self.recovery is not None:
            self.recovery.cancel()
            await asyncio.gather(self.recovery, return_exceptions=True)
        # Head first (it holds the peers), then peers in reverse start order.
        for mp in reversed(self.procs):
            if mp.state is State.FATAL:
                await self._kill(mp)
                continue
            await self._stop_one(mp, reason)
