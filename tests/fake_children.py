"""Fake children for the supervisor's policy tests: a FakeWorld implements every Seam (spawn,
/health, HELLO, /slots, the completion probe, process state and CPU time, port ownership) over
in-memory FakeChild objects, on a scaled clock (1 policy second = 1/SCALE real seconds), so a
case that takes minutes of policy time runs in milliseconds — with the supervisor's real code.

A test scripts each engine's behaviour per spawn (load time, exit at load, crash later, ignore
signals) and then injects faults: kill, SIGSTOP, busy, hung, a remote peer going away.

`Run` drives one real Supervisor on a FakeWorld (its run() as a task, waits in policy time) and
`go` runs a test body on a fresh FakeWorld: shared by tests/test_policy.py, test_stall.py and
test_remote_silence.py.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from hydra_supervisor.config.profile import HealthPolicy, PeerLoss, RestartPolicy
from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.plan import (
    EngineSpec,
    ModelKind,
    Plan,
    PlanMode,
    PlanTransport,
    Role,
    RouterSpec,
)
from hydra_supervisor.proc import process
from hydra_supervisor.proc.health import Gated
from hydra_supervisor.proc.managed import ManagedProcess, State
from hydra_supervisor.proc.rpcproto import PROTO_MAJOR, PROTO_MINOR, Version
from hydra_supervisor.proc.seams import Moved, Seams
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.tools.buildid import BuildIdentity, PeerInfo

SCALE = 50.0

T = TypeVar("T")


@dataclass
class Behaviour:
    load: float = 1.0  # policy seconds from spawn to /health 200 (head) or HELLO (peer)
    exit_at_load: int | None = None  # exits with this code when the load ends
    ignore_term: bool = False
    unkillable: bool = False  # survives SIGKILL too (uninterruptible sleep)


class FakeChild:
    def __init__(self, world: FakeWorld, name: str, pid: int, port: int, argv: Sequence[str],
                 b: Behaviour) -> None:
        self.world, self.name, self.pid, self.port, self.argv, self.b = \
            world, name, pid, port, list(argv), b
        self.returncode: int | None = None
        self.exited_at: float | None = None  # policy time of the exit
        self.outlive_client = False  # spawned with SIGPIPE ignored (a ggml-rpc-server)
        self.ready = False
        self.frozen = False
        self.busy = False  # /health silent, CPU advancing (a burst)
        self.hung = False  # /health silent, no CPU (deadlock)
        self.processing = False  # /slots says a slot is processing
        self.working = False  # CPU advancing, /health answering (a long prefill)
        self.dsleep = False  # uninterruptible sleep (state D): no CPU, /health still answers
        self.signals: list[int] = []
        self._cpu = 0.0
        self._cpu_t = world.clock()
        self._exited = asyncio.Event()
        self._life = asyncio.ensure_future(self._lifecycle())

    async def _lifecycle(self) -> None:
        await self.world.sleep(self.b.load)
        while self.frozen:
            await self.world.sleep(0.1)
        if self.returncode is not None:
            return
        if self.b.exit_at_load is not None:
            self.exit(self.b.exit_at_load)
            return
        self.ready = True

    def cpu(self) -> float:
        now = self.world.clock()
        if (self.busy or self.working) and not self.frozen and not self.hung \
                and not self.dsleep:
            self._cpu += now - self._cpu_t
        self._cpu_t = now
        return self._cpu

    def charge(self, seconds: float) -> None:
        """CPU time used now, whatever the child is doing (a frozen head's HTTP thread)."""
        self.cpu()
        self._cpu += seconds

    def exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.exited_at = self.world.clock()
            self.ready = False
            self._exited.set()
            self._life.cancel()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def signal_group(self, sig: int) -> None:
        self.signals.append(sig)
        if self.returncode is not None:
            return
        if sig == signal.SIGKILL and not self.b.unkillable:
            self.exit(-signal.SIGKILL)
        elif sig == signal.SIGTERM and not self.frozen and not self.b.ignore_term \
                and not self.b.unkillable:
            self.exit(-signal.SIGTERM)
        elif sig == signal.SIGCONT:
            self.frozen = False
        elif sig == signal.SIGSTOP:
            self.frozen = True

    # faults a test injects
    def kill(self, code: int = -signal.SIGKILL) -> None:
        self.exit(code)

    def stop(self) -> None:
        self.frozen = True


@dataclass
class FakeWorld:
    scale: float = SCALE
    behaviours: dict[str, list[Behaviour]] = field(default_factory=dict)
    default: Behaviour = field(default_factory=Behaviour)
    children: list[FakeChild] = field(default_factory=list)
    squatters: dict[int, int] = field(default_factory=dict)  # port -> pid of someone else
    remote_up: dict[int, bool] = field(default_factory=dict)  # remote peers by port
    connect_fails: dict[int, str] = field(default_factory=dict)  # port -> "timeout"|"refused"
    # The router's requests in flight (None: no router to ask) and the policy time since which
    # the head has owed them a byte (its oldest request waiting for one: Gate.owed_for).
    inflight: int | None = None
    owed_since: float = 0.0
    connects: list[int] = field(default_factory=list)  # ports a connect probe went to
    hellos: list[int] = field(default_factory=list)  # remote ports a HELLO went to, in order
    # A remote peer host's answer to Hydra INFO, by port (absent: nothing answers INFO there),
    # and this host's build identity (None: unknown); `infos` counts the INFO asked per port.
    remote_info: dict[int, PeerInfo] = field(default_factory=dict)
    identity: BuildIdentity | None = None
    infos: dict[int, int] = field(default_factory=dict)
    on_spawn: Callable[[FakeChild], None] | None = None
    t0: float = field(default_factory=time.monotonic)
    _pid: int = 900000

    # -- the clock ------------------------------------------------------------------------
    def clock(self) -> float:
        return (time.monotonic() - self.t0) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0) / self.scale)

    # -- lookups --------------------------------------------------------------------------
    def live(self, name: str) -> FakeChild | None:
        return next((c for c in reversed(self.children)
                     if _named(c.name, name) and c.returncode is None), None)

    def spawned(self, name: str | None = None) -> list[str]:
        return [c.name for c in self.children if name is None or _named(c.name, name)]

    def _on_port(self, port: int) -> FakeChild | None:
        return next((c for c in reversed(self.children)
                     if c.port == port and c.returncode is None), None)

    async def wait_for(self, pred: Callable[[], T], timeout: float = 60.0) -> T:
        """Wait (in policy seconds) until pred() is true."""
        deadline = self.clock() + timeout
        while self.clock() < deadline:
            val = pred()
            if val:
                return val
            await self.sleep(0.05)
        raise AssertionError(f"timed out after {timeout} policy seconds")

    # -- seams ----------------------------------------------------------------------------
    async def spawn(self, argv: Sequence[str], env: Mapping[str, str], log: Path, *,
                    outlive_client: bool = False) -> process.Child:
        name = Path(log).stem
        args = list(argv)
        flag = "--port" if "--port" in args else "-p"
        port = int(args[args.index(flag) + 1])
        queue = self.behaviours.get(name)
        if queue is None:  # a lane names its processes PROFILE.ROLE; tests may say ROLE
            queue = self.behaviours.get(name.split(".", 1)[-1])
        b = queue.pop(0) if queue else self.default
        self._pid += 1
        child = FakeChild(self, name, self._pid, port, args, b)
        child.outlive_client = outlive_client
        self.children.append(child)
        if self.on_spawn is not None:
            self.on_spawn(child)
        return child

    async def http_status(self, host: str, port: int, path: str = "/health",
                          timeout: float = 2.0) -> int | None:
        if port in self.squatters:
            return 200
        c = self._on_port(port)
        if c is None:
            return None
        if c.frozen or c.busy or c.hung:
            await self.sleep(timeout)
            return None
        return 200 if c.ready else 503

    async def hello(self, host: str, port: int, timeout: float = 3.0,
                    tls: object = None) -> Version | None:
        if port in self.remote_up:
            self.hellos.append(port)
            if self.remote_up[port]:
                return Version(PROTO_MAJOR, PROTO_MINOR, 0)
            await self.sleep(timeout)
            return None
        c = self._on_port(port)
        if c is None or not c.ready or c.frozen:
            return None
        return Version(PROTO_MAJOR, PROTO_MINOR, 0)

    async def peer_info(self, host: str, port: int, timeout: float,
                        tls: object = None) -> PeerInfo | None:
        self.infos[port] = self.infos.get(port, 0) + 1
        return self.remote_info.get(port)

    async def local_identity(self, configured: Mapping[str, str] | None
                             ) -> BuildIdentity | None:
        return self.identity

    async def completion_probe(self, host: str, port: int, timeout: float) -> tuple[bool, str]:
        c = self._on_port(port)
        return (c is not None and c.ready, "HTTP 200")

    async def slots_busy(self, host: str, port: int, timeout: float) -> bool | None:
        c = self._on_port(port)
        if c is None or c.frozen or c.busy:
            return None
        return c.processing

    def proc_stat(self, pid: int) -> process.ProcStat | None:
        c = next((c for c in self.children if c.pid == pid), None)
        if c is None or c.returncode is not None:
            return None
        return process.ProcStat(stopped=c.frozen, cpu=c.cpu(), state="T" if c.frozen else
                                "disk-sleep" if c.dsleep else "S")

    def flights(self, traffic: Gated | None) -> tuple[int, float | None] | None:
        if self.inflight is None:
            return None
        return (self.inflight, self.clock() - self.owed_since if self.inflight else None)

    async def connect(self, host: str, port: int, timeout: float) -> str | None:
        self.connects.append(port)
        why = self.connect_fails.get(port)
        if why == "timeout":
            await self.sleep(timeout)
            return f"TCP connect timed out after {timeout:g}s"
        return None if why is None else f"TCP connect failed: {why}"

    def owns_port(self, pid: int, port: int) -> bool | None:
        if port in self.squatters:
            return False
        c = self._on_port(port)
        return None if c is None else c.pid == pid

    def port_free(self, host: str, port: int) -> bool:
        return port not in self.squatters and self._on_port(port) is None

    def seams(self) -> Seams:
        return Seams(spawn=self.spawn, http_status=self.http_status, hello=self.hello,
                     completion_probe=self.completion_probe, slots_busy=self.slots_busy,
                     proc_stat=self.proc_stat, owns_port=self.owns_port,
                     port_free=self.port_free, clock=self.clock, sleep=self.sleep, reap=False,
                     flights=self.flights, connect=self.connect, peer_info=self.peer_info,
                     local_identity=self.local_identity)


# -- deployments -------------------------------------------------------------------------------

FAST_RESTART = RestartPolicy(backoff_initial=1, backoff_max=8, max_failures=4, window=100,
                             stable_after=10)
FAST_HEALTH = HealthPolicy(interval=0.5, hang_timeout=5)


def peer_spec(i: int = 0, port: int = 50100, remote: bool = False) -> EngineSpec:
    return EngineSpec(name=f"peer-{i}", role=Role.PEER, program="ggml-rpc-server",
                      args=("-H", "127.0.0.1", "-p", str(port)), env=(), host="127.0.0.1",
                      port=port, device=f"gpu{i + 1}", start_order=i, managed=not remote)


def head_spec(peers: Sequence[EngineSpec], port: int = 40100, solo: bool = False) -> EngineSpec:
    rpc = ",".join(p.endpoint for p in peers)
    args = ["-m", "m.gguf", "--host", "127.0.0.1", "--port", str(port)]
    if rpc and not solo:
        args += ["--rpc", rpc]
    return EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=tuple(args),
                      env=(), host="127.0.0.1", port=port, device="gpu0",
                      start_order=len(peers))


def deployment(n_peers: int = 1, *, remote: bool = False, on_peer_loss: PeerLoss =
               PeerLoss.RESTART, policy: RestartPolicy = FAST_RESTART,
               health: HealthPolicy = FAST_HEALTH, load: float = 30.0, stop_grace: float = 3.0,
               router: bool = True, internal_ports: Sequence[int] = (40101, 40102, 40103)
               ) -> Deployment:
    peers = [peer_spec(i, 50100 + i, remote=remote) for i in range(n_peers)]
    head = head_spec(peers)
    plan = Plan(profile="t", source="t.yaml", model_path="m.gguf", model_kind=ModelKind.DENSE,
                mode=PlanMode.COMBINE if peers else PlanMode.SOLO,
                transport=PlanTransport.RPC, engines=(*peers, head),
                router=RouterSpec(("127.0.0.1", head.port), None, ())
                if router else None)
    spare = list(internal_ports)

    def pick_internal(taken: set[int]) -> int | None:
        return next((p for p in spare if p not in taken), None)

    def pick_rpc(taken: set[int]) -> int | None:
        return next((p for p in range(50200, 50210) if p not in taken), None)

    return Deployment(plan=plan, binaries={}, policy=policy, on_peer_loss=on_peer_loss,
                      timeouts=Timeouts(load=load, peer=10, stop_grace=stop_grace,
                                        health=health),
                      solo_head=head_spec([], solo=True) if on_peer_loss is PeerLoss.DEGRADE
                      else None,
                      pick_port=pick_rpc, pick_internal_port=pick_internal)


class UpstreamMoves:
    """The supervisor's typed seam for a moved process (`on_upstream_moved`), recorded: what
    the lane re-points its route by (serve/lane.py)."""

    def __init__(self, http: tuple[str, int] | None) -> None:
        self.http = http
        self.moves: list[tuple[Moved, tuple[str, int], int]] = []

    def __call__(self, kind: Moved, old: tuple[str, int], new_port: int) -> None:
        self.moves.append((kind, old, new_port))
        if kind is Moved.HTTP and self.http == old:
            self.http = (old[0], new_port)


# -- one real Supervisor driven on a FakeWorld (the policy tests' rig) -----------------------------


class Run:
    """One Supervisor on a FakeWorld, its run() as a task, and helpers to wait in policy time."""

    def __init__(self, world: FakeWorld, dep: Deployment, tmp: Path) -> None:
        self.world = world
        self.sup = Supervisor(dep, StateDir(tmp / "state"), seams=world.seams())
        self.transitions: list[tuple[str, str, str]] = []
        self.sup.listeners.append(
            lambda mp: self.transitions.append((mp.name, mp.state.value, mp.reason)))
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Run:
        self.task = asyncio.ensure_future(self.sup.run())
        return self

    def mp(self, name: str) -> ManagedProcess:
        return next(p for p in self.sup.procs if p.name == name)

    async def until(self, pred: Callable[[], T], timeout: float = 120.0) -> T:
        def check() -> T:
            if self.task is not None and self.task.done() and not pred():
                self.task.result()
                raise AssertionError(f"supervisor ended: fatal={self.sup.fatal}")
            return pred()
        return await self.world.wait_for(check, timeout)

    async def all_ready(self, timeout: float = 120.0) -> None:
        await self.until(lambda: all(p.state is State.READY for p in self.sup.procs)
                         and self.sup.first_ready.is_set(), timeout)

    async def stop(self) -> None:
        await self.sup.shutdown("test done")
        assert self.task is not None
        await asyncio.wait_for(self.task, 10)


def go(tmp: Path, body: Callable[[FakeWorld, Path], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(FakeWorld(), tmp), 50))


def _named(full: str, name: str) -> bool:
    """A process name as a test gives it: in full (`t.head`) or its role part (`head`), as a
    lane names its processes PROFILE.ROLE."""
    return full == name or full.split(".", 1)[-1] == name
