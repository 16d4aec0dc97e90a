"""The real-process test harness: isolated hydra environments, free ports, a `hydra up` driver.

Shared by the pytest fixtures (tests/conftest.py), the fault scenarios (faults.py) and the
bench scripts. Every wait has a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict, TypeVar, cast

import psutil

from hydra_supervisor.config.paths import repo_root
from hydra_supervisor.jsontypes import JSONObject
from hydra_supervisor.plan.ports import free_port as free_port  # re-exported for the tests
from hydra_supervisor.proc.state import SupervisorRecord
from hydra_supervisor.serve.snapshot import LaneStatus, Snapshot

REPO = repo_root()
HYDRA = [sys.executable, "-m", "hydra_supervisor"]
T = TypeVar("T")


class EngineRow(TypedDict, total=False):
    """One engine's row in status.json (`engines`): the fields the harness reads (a row has
    more; the tests read those by key)."""

    name: str
    role: str
    state: str
    pid: int | None
    port: int
    restarts: int
    reason: str
    warning: str | None


class StatusFile(TypedDict, total=False):
    """status.json as the supervisor writes it: the fields the harness reads."""

    pid: int
    profile: str
    engines: list[EngineRow]
    fatal: str | None
    degraded: str | None


class Status(TypedDict, total=False):
    """What `hydra status --json` prints (a live daemon's GET /status, else the state dir read
    directly): the fields the harness reads."""

    running: bool
    supervisor: SupervisorRecord | None
    status: StatusFile | None
    abnormal_end: JSONObject | None
    daemon: JSONObject  # the snapshot's JSON (docs/control.md): `snapshot()` reads it typed


def free_port_range(n: int = 8) -> tuple[int, int]:
    """A run of n consecutive free ports below the ephemeral range (see hydra's ports.py: no
    TCP self-connects there), picked at random (best effort: checked, not reserved)."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base, base + n - 1
    raise RuntimeError("no free port range")


def wait_until(pred: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1
               ) -> T:
    """pred()'s first true value, polled every `interval`; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        val = pred()
        if val:
            return val
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def make_env(tmp_path: Path, node_extra: str = "") -> dict[str, str]:
    """Environment for hydra CLI calls with its own state dir and a private node file."""
    lo, hi = free_port_range(16)
    node = tmp_path / "node.yaml"
    node.write_text(f"rpc_ports: [{lo}, {lo + 7}]\ninternal_ports: [{lo + 8}, {hi}]\n"
                    + node_extra)
    env = dict(os.environ)
    env.update({
        "HYDRA_STATE_DIR": str(tmp_path / "state"),
        "HYDRA_NODE": str(node),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def run_hydra(env: dict[str, str], *args: str, timeout: float = 60.0
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HYDRA, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


def status_json(env: dict[str, str]) -> Status:
    """What `hydra status --json` prints, read in process: a poll costs a socket round trip,
    not an interpreter start that takes CPU from the llama-server the test waits for."""
    from hydra_supervisor.proc.state import StateDir
    from hydra_supervisor.runtime import control_client

    state = StateDir(Path(env["HYDRA_STATE_DIR"]))
    try:
        _, live = control_client.call(control_client.socket_path(state.root), "GET", "/status",
                                      timeout=10)
        return cast(Status, dict(live))
    except (control_client.NotRunning, OSError):
        return Status(running=False, supervisor=state.running_supervisor(),
                      status=cast(StatusFile | None, state.read_status_checked()),
                      abnormal_end=state.abnormal_end())


def snapshot(env: dict[str, str]) -> Snapshot:
    """The running hydra's status, typed (`daemon` in `hydra status --json`)."""
    return Snapshot.from_json(status_json(env).get("daemon"))


def lanes(env: dict[str, str]) -> list[LaneStatus]:
    """Every lane of every port of the running hydra (standby lanes included), in order."""
    return [lane for _, lane in snapshot(env).lanes()]


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


class Up:
    """A running `hydra up` (a real subprocess) and what it started."""

    def __init__(self, env: dict[str, str], args: list[str], tmp: Path, *,
                 launcher: Sequence[str] = (), append: bool = False) -> None:
        """`launcher`: the command `hydra up` runs under (`ip netns exec NS`, which execs: the
        pid is still hydra's); `append`: keep what earlier runs wrote to tmp/up.{out,err}."""
        if append:
            tmp.mkdir(parents=True, exist_ok=True)
        self.env = env
        mode = "a+" if append else "w+"
        self.out = (tmp / "up.out").open(mode)
        self.err = (tmp / "up.err").open(mode)
        self.proc = subprocess.Popen([*launcher, *HYDRA, "up", *args], env=env, stdout=self.out,
                                     stderr=self.err, cwd=REPO)
        self.children: list[psutil.Process] = []

    def output(self) -> str:
        self.out.flush()
        self.err.flush()
        return Path(self.out.name).read_text() + Path(self.err.name).read_text()

    def wait_ready(self, timeout: float = 120.0) -> Status:
        def ready() -> Status | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"hydra up exited {self.proc.returncode}:\n{self.output()}")
            st = status_json(self.env)
            status = st["status"]
            if st["running"] and status and status["pid"] == self.proc.pid and all(
                    e["state"] == "READY" for e in status["engines"]) and \
                    "ready:" in Path(self.out.name).read_text():
                return st
            return None

        st = wait_until(ready, timeout, "all engines READY")
        self.children = descendants(self.proc.pid)
        return st

    def engine(self, name: str) -> EngineRow:
        """A process's status row by its name (`demo.head`) or its role part (`head`), as
        `hydra restart` and `hydra logs` accept it."""
        status = status_json(self.env)["status"]
        assert status is not None, "no status.json"
        return next(e for e in status["engines"] if named(e["name"], name))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.out.close()
            self.err.close()

    def kill_everything(self) -> None:
        for p in [*descendants(self.proc.pid), *self.children]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def wait_dead(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited; returns those still running. A zombie counts as
    dead: it runs nothing and holds no port; reaping it is its new parent's (init's) job."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(0.02)
    return alive


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def named(full: str, name: str) -> bool:
    """A process name as a test gives it: in full (`demo.head`) or its role part (`head`);
    hydra names a lane's processes PROFILE.ROLE."""
    return full == name or full.split(".", 1)[-1] == name
