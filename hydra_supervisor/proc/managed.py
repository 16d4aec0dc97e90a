"""One managed process and its state machine: the State, the transition table (TRANSITIONS),
the errors a start or a run ends with (IllegalTransition, StartFailed, Fatal, ChangeFailed,
PeerLost), and ManagedProcess — one child's state, reason, restarts, backoff and status row.
Only the Supervisor (supervisor.py) moves a ManagedProcess from one state to another."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra_supervisor.config.profile import RestartPolicy
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.proc import logfiles, process
from hydra_supervisor.proc.backoff import Backoff

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

    def __init__(self, peers: list[ManagedProcess], reason: str, *,
                 head_first: str | None = None) -> None:
        """`head_first`: how the head ended, when it died before its peers were lost (the
        head's end is then the cause, not their loss)."""
        super().__init__(reason)
        self.peers = peers
        self.reason = reason
        self.head_first = head_first


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
    # A head loading onto remote peers: bytes sent to each remote device so far, as its peer
    # host's router counts them (proc/sentwatch.py); None: unknown (a bare ggml-rpc-server).
    remote_sent: Mapping[str, int | None] = field(default_factory=dict)
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

    def sent_to_peers(self, sent: Mapping[str, int | None]) -> None:
        """The bytes sent to each remote device so far (published when they change)."""
        if dict(sent) != dict(self.remote_sent):
            self.remote_sent = dict(sent)
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
