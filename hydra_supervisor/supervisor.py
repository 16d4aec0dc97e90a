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
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra_supervisor import health, process
from hydra_supervisor.config import PeerLoss, RestartPolicy
from hydra_supervisor.plan import EngineSpec, Plan, Role
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
        delay = min(self.policy.backoff_initial * 2 ** (self.consecutive - 1),
                    self.policy.backoff_max)
        self.to(State.BACKOFF, f"{reason}; restart in {delay:.0f}s")
        return delay

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
            "managed": self.spec.managed, "log": str(self.log_path),
            "log_tail": self.log_tail() if self.state is State.FATAL else [],
        }


@dataclass(frozen=True)
class Timeouts:
    load: float  # head: spawn to /health 200
    peer: float = 30.0  # peer: spawn to HELLO
    stop_grace: float = 10.0
    health_interval: float = 2.0
    hang: float = 30.0  # head READY but /health silent this long → killed


def load_timeout_for(model_bytes: int, configured: float | None) -> float:
    """Loads scale with size: 60 s plus 15 s per GiB (a 20 GB model on a slow disk: ~6 min)."""
    if configured:
        return configured
    return 60.0 + 15.0 * model_bytes / (1 << 30)


class Supervisor:
    def __init__(self, plan: Plan, binaries: dict[str, str], state: StateDir,
                 policy: RestartPolicy, on_peer_loss: PeerLoss, timeouts: Timeouts,
                 model_label: str) -> None:
        self.plan = plan
        self.state = state
        self.timeouts = timeouts
        self.on_peer_loss = on_peer_loss
        self.model_label = model_label
        self.stopping = asyncio.Event()
        self.first_ready = asyncio.Event()
        self.fatal: str | None = None
        self.started_wall = time.time()
        self.procs = [
            ManagedProcess(spec=spec, binary=binaries.get(spec.program, spec.program),
                           log_path=state.log_path(spec.name), policy=policy,
                           on_change=lambda _p: self.publish())
            for spec in plan.in_start_order()
        ]
        self.head = next(p for p in self.procs if p.spec.role is Role.HEAD)
        self.peers = [p for p in self.procs if p.spec.role is Role.PEER]

    # -- status -----------------------------------------------------------------------------

    def publish(self) -> None:
        self.state.write_status({
            "profile": self.plan.profile, "source": self.plan.source, "mode": self.plan.mode,
            "model": self.model_label, "url": f"http://{self.plan.host}:{self.plan.port}",
            "fatal": self.fatal, "updated": time.time(),
            "engines": [p.row() for p in self.procs],
        })

    # -- one process ------------------------------------------------------------------------

    async def _spawn(self, mp: ManagedProcess) -> None:
        mp.to(State.STARTING, "spawning")
        argv = [mp.binary, *mp.spec.args]
        try:
            mp.proc = await process.spawn(argv, mp.spec.env_dict(), mp.log_path)
        except OSError as exc:
            raise StartFailed(f"cannot start {mp.binary}: {exc.strerror}") from exc
        mp.started_wall = time.time()
        self.state.record_child(mp.name, mp.proc.pid)
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
                code = await health.http_status(spec.host if spec.host not in ("0.0.0.0", "::")
                                                else "127.0.0.1", spec.port)
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

    async def _stop_one(self, mp: ManagedProcess, reason: str) -> None:
        if mp.proc is None or not mp.spec.managed:
            if mp.state in (State.STARTING, State.READY, State.UNHEALTHY):
                mp.to(State.STOPPING, reason)
                mp.to(State.STOPPED, reason)
            return
        if mp.state in (State.STARTING, State.READY, State.UNHEALTHY):
            mp.to(State.STOPPING, reason)
        code = await process.stop(mp.proc, self.timeouts.stop_grace)
        self.state.forget_child(mp.name)
        if mp.state is State.STOPPING:
            mp.to(State.STOPPED, f"{reason} ({process.describe_exit(code)})")

    async def _bring_up(self, mp: ManagedProcess) -> None:
        """Start until READY, backing off between failures; raises Fatal or StartFailed(stop)."""
        while not self.stopping.is_set():
            try:
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
                reason = str(exc)
                if mp.proc is not None:
                    await process.stop(mp.proc, self.timeouts.stop_grace)
                    self.state.forget_child(mp.name)
                if mp.state is State.STOPPED:
                    mp.to(State.STARTING, reason)
                delay = mp.record_failure(reason)
                await self._sleep(delay)
                if not self.stopping.is_set():
                    mp.restarts += 1
            except Fatal:
                if mp.proc is not None:
                    await process.stop(mp.proc, self.timeouts.stop_grace)
                    self.state.forget_child(mp.name)
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
        finally:
            await self.shutdown("hydra is stopping")
            self.publish()

    async def _converge(self) -> None:
        for peer in self.peers:
            if peer.state is not State.READY:
                await self._bring_up(peer)
        if self.head.state is not State.READY:
            await self._bring_up(self.head)
        self.first_ready.set()

    async def _loop(self) -> None:
        while not self.stopping.is_set():
            await self._converge()
            event, who = await self._next_event()
            if event == "stop":
                return
            if event == "exit" and who is self.head:
                code = self.head.proc.returncode if self.head.proc else None
                self.state.forget_child(self.head.name)
                delay = self.head.record_failure(f"head {process.describe_exit(code)}")
                await self._sleep(delay)
                self.head.restarts += 1
            elif event == "hang":
                await self._stop_one(self.head, "stopped answering /health")
                delay = self.head.record_failure(
                    f"/health silent for {self.timeouts.hang:.0f}s (hung), killed")
                await self._sleep(delay)
                self.head.restarts += 1
            elif event == "exit" and who is not None:
                await self._peer_lost(who)

    async def _peer_lost(self, peer: ManagedProcess) -> None:
        code = peer.proc.returncode if peer.proc else None
        self.state.forget_child(peer.name)
        reason = f"peer {peer.name} {process.describe_exit(code)}"
        # llama.cpp's head aborts at its next RPC call once its peer is gone; stop it cleanly.
        await self._stop_one(self.head, reason)
        if self.on_peer_loss is PeerLoss.FAIL:
            peer.to(State.FATAL, f"{reason}; on_peer_loss: fail")
            raise Fatal(f"{reason}; on_peer_loss is fail")
        delay = peer.record_failure(reason)
        await self._sleep(delay)
        peer.restarts += 1

    async def _next_event(self) -> tuple[str, ManagedProcess | None]:
        waits: dict[asyncio.Task[Any], tuple[str, ManagedProcess | None]] = {
            asyncio.create_task(self.stopping.wait()): ("stop", None),
            asyncio.create_task(self._watch_health()): ("hang", self.head),
        }
        for mp in self.procs:
            if mp.proc is not None and mp.spec.managed:
                waits[asyncio.create_task(mp.proc.wait())] = ("exit", mp)
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # A process exit wins over a hang verdict reached in the same instant.
        ranked = sorted(done, key=lambda t: {"stop": 0, "exit": 1, "hang": 2}[waits[t][0]])
        return waits[ranked[0]]

    async def _watch_health(self) -> None:
        """Returns only when the head has not answered /health for `hang` seconds."""
        spec = self.head.spec
        host = spec.host if spec.host not in ("0.0.0.0", "::") else "127.0.0.1"
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.timeouts.health_interval)
            code = await health.http_status(host, spec.port, timeout=self.timeouts.health_interval)
            now = time.monotonic()
            if code == 200:
                last_ok = now
                if self.head.state is State.UNHEALTHY:
                    self.head.to(State.READY, "answering /health again")
            elif now - last_ok >= self.timeouts.hang:
                return
            elif self.head.state is State.READY:
                self.head.to(State.UNHEALTHY, f"/health {'silent' if code is None else code}")

    async def shutdown(self, reason: str) -> None:
        self.stopping.set()
        # Head first (it holds the peers), then peers in reverse start order.
        for mp in reversed(self.procs):
            if mp.state is State.FATAL:
                if mp.proc is not None and mp.proc.returncode is None:
                    await process.stop(mp.proc, self.timeouts.stop_grace)
                self.state.forget_child(mp.name)
                continue
            if mp.state is State.BACKOFF:
                mp.to(State.STOPPED, reason)
                continue
            await self._stop_one(mp, reason)
