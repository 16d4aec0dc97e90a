"""What a lane's operations answer with: one report type for switch, apply, reload, restart.

Also the errors those operations raise, and the timeouts of a change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra_supervisor.errors import HydraError
from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.serve.clock import MONOTONIC, Clock


class Busy(HydraError):
    """A change (switch, reload, restart, load) is already running on this lane."""


class RestartFailed(HydraError):
    """`hydra restart NAME` did not bring the process back (the layout was started again)."""


class LayoutFailed(Exception):
    """A layout did not become ready; the message says which process and why."""

    def __init__(self, message: str, tail: list[str]) -> None:
        super().__init__(message)
        self.tail = tail


@dataclass(frozen=True)
class SwitchTimeouts:
    drain: float = 30.0  # in-flight requests may finish this long, then they are cut
    gpu_free: float = 30.0  # the old processes' GPU memory must be released within this
    gate_extra: float = 0.0  # added to the new layout's own load timeout


class Result(StrEnum):
    """How a change ended (a report's `result`; the API, metrics and the CLI use the words)."""

    RUNNING = "running"
    OK = "ok"
    ROLLED_BACK = "rolled_back"  # it failed; the layout before it serves again
    FAILED = "failed"  # it failed, and nothing serves
    NOOP = "noop"  # nothing to do (already serving, nothing changed)


@dataclass(frozen=True)
class Stopped:
    """A profile a change (switch, load, an on-demand load) stopped, and why: `why` is a
    clause ("it did not fit beside demo on host memory (demo needs 812 MiB, 300 MiB free)",
    "hydra unload")."""

    profile: str
    why: str
    cut: int = 0  # its requests cut after the drain

    def to_json(self) -> JSONObject:
        return {"profile": self.profile, "why": self.why, "cut": self.cut}


@dataclass
class SwitchReport:
    """What a change did, phase by phase; the API reply and hydra.log carry it."""

    to: str
    frm: str | None
    result: str = Result.RUNNING  # a Result (a str: `report.result == "ok"` holds)
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    failed_phase: str | None = None
    log_tail: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    cut: int = 0
    total_s: float = 0.0
    restarted: list[str] = field(default_factory=list)
    seq: int = 0  # 1, 2, … per lane, set when it is recorded (metrics count by it)
    reason: str | None = None  # a noop's why (already serving, nothing changed)
    # A switch between a profile and its standby layout (serve/standby.py): True when the
    # port was re-pointed to the loaded standby (nothing restarted); False with `not_instant`
    # (why: it did not fit, which device, how many MiB short) when it reloaded instead.
    instant: bool | None = None
    not_instant: str | None = None
    at: float | None = None  # wall time it was recorded (display only)
    stopped: list[Stopped] = field(default_factory=list)  # profiles stopped to make room

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "seq": self.seq, "to": self.to, "from": self.frm, "result": self.result,
            "phases": {k: round(v, 3) for k, v in self.phases.items()},
            "total_s": round(self.total_s, 3), "error": self.error,
            "failed_phase": self.failed_phase, "log_tail": self.log_tail,
            "notes": self.notes, "cut": self.cut, "restarted": self.restarted,
            "stopped": [x.to_json() for x in self.stopped]}
        if self.reason is not None:
            out["reason"] = self.reason
        if self.instant is not None:
            out["instant"] = self.instant
        if self.not_instant is not None:
            out["not_instant"] = self.not_instant
        if self.at is not None:
            out["at"] = self.at
        return out


@dataclass
class UnloadReport:
    """What `hydra unload` did: the profiles it stopped (each drained, then cut) and those
    that were not loaded (nothing to do)."""

    stopped: list[Stopped] = field(default_factory=list)
    not_loaded: dict[str, str] = field(default_factory=dict)  # profile -> its state, why
    notes: list[str] = field(default_factory=list)
    on_demand: dict[str, bool] = field(default_factory=dict)  # stopped profile -> loads on request
    total_s: float = 0.0

    def merge(self, other: UnloadReport) -> None:
        self.stopped += other.stopped
        self.not_loaded.update(other.not_loaded)
        self.notes += other.notes
        self.on_demand.update(other.on_demand)
        self.total_s = max(self.total_s, other.total_s)

    def to_json(self) -> JSONObject:
        unloaded: list[JSONValue] = [x.profile for x in self.stopped]
        stopped: list[JSONValue] = [x.to_json() for x in self.stopped]
        notes: list[JSONValue] = list(self.notes)
        return {"result": Result.OK.value if self.stopped else Result.NOOP.value,
                "unloaded": unloaded, "stopped": stopped,
                "not_loaded": dict[str, JSONValue](self.not_loaded),
                "on_demand": dict[str, JSONValue](self.on_demand),
                "cut": sum(x.cut for x in self.stopped), "notes": notes,
                "total_s": round(self.total_s, 3)}


class Phases:
    """Times each phase of a change into a report (a measurement for the operator, on the
    serving clock unless a test gives its own)."""

    def __init__(self, report: SwitchReport, clock: Clock = MONOTONIC) -> None:
        self.report = report
        self.clock = clock
        self.t0 = clock()
        self.current: str | None = None

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        start = self.clock()
        try:
            yield
        finally:
            self.report.phases[name] = self.report.phases.get(name, 0.0) + \
                self.clock() - start

    def done(self) -> None:
        self.report.total_s = self.clock() - self.t0
