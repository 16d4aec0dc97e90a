"""The state dir: what a running `hydra up` tells other `hydra` commands, through files.

  supervisor.json   pid, start time and profile of the running `hydra up`
  status.json       one row per engine (state, pid, port, reason...), rewritten atomically on
                    every state change
  pids/NAME.json    pid, process start time and cmdline of each child, to find stale children of
                    a crashed hydra (pid reuse is ruled out by start time and cmdline)
  logs/NAME.log     each child's output (previous runs: NAME.log.1, .2, .3)
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from hydra_supervisor.errors import HydraError
from hydra_supervisor.paths import state_dir


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class StateDir:
    root: Path

    @classmethod
    def default(cls) -> StateDir:
        return cls(state_dir())

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_path(self, engine: str) -> Path:
        return self.logs / f"{engine}.log"

    def ensure_writable(self) -> None:
        for d in (self.root, self.logs, self.root / "pids"):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise HydraError(f"state dir {d} cannot be created: {exc.strerror}",
                                 hint="set HYDRA_STATE_DIR to a writable directory") from exc
            if not os.access(d, os.W_OK):
                raise HydraError(f"state dir {d} is not writable",
                                 hint="set HYDRA_STATE_DIR to a writable directory")

    # -- the supervisor ---------------------------------------------------------------------

    def write_supervisor(self, profile: str, source: str) -> None:
        me = psutil.Process()
        _write_json(self.root / "supervisor.json", {
            "pid": me.pid, "create_time": me.create_time(), "profile": profile,
            "source": source, "started": time.time()})

    def running_supervisor(self) -> dict[str, Any] | None:
        """The live `hydra up` of this state dir, or None (a stale file is ignored)."""
        data = _read_json(self.root / "supervisor.json")
        if not data:
            return None
        try:
            proc = psutil.Process(int(data["pid"]))
            if abs(proc.create_time() - float(data["create_time"])) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (psutil.Error, KeyError, ValueError):
            return None
        return dict(data)

    def clear_supervisor(self) -> None:
        data = _read_json(self.root / "supervisor.json")
        if data and data.get("pid") == os.getpid():
            (self.root / "supervisor.json").unlink(missing_ok=True)

    # -- status -----------------------------------------------------------------------------

    def write_status(self, status: dict[str, Any]) -> None:
        _write_json(self.root / "status.json", status)

    def read_status(self) -> dict[str, Any] | None:
        data = _read_json(self.root / "status.json")
        return data if isinstance(data, dict) else None

    # -- children ---------------------------------------------------------------------------

    def record_child(self, engine: str, pid: int) -> None:
        try:
            proc = psutil.Process(pid)
            info = {"pid": pid, "create_time": proc.create_time(), "cmdline": proc.cmdline()}
        except psutil.Error:
            return
        _write_json(self.root / "pids" / f"{engine}.json", info)

    def forget_child(self, engine: str) -> None:
        (self.root / "pids" / f"{engine}.json").unlink(missing_ok=True)

    def stale_children(self) -> list[tuple[str, psutil.Process]]:
        """Children recorded by an earlier hydra that still run (same pid, start time, cmdline)."""
        out = []
        for f in sorted((self.root / "pids").glob("*.json")):
            data = _read_json(f)
            try:
                proc = psutil.Process(int(data["pid"]))
                same = (abs(proc.create_time() - float(data["create_time"])) < 1.0
                        and proc.cmdline() == data["cmdline"])
            except (psutil.Error, TypeError, KeyError, ValueError):
                same = False
            if same:
                out.append((f.stem, proc))
            else:
                f.unlink(missing_ok=True)
        return out

    def kill_stale(self, grace: float = 5.0) -> list[str]:
        """Stop stale children (TERM their group, then KILL); return what was stopped."""
        stale = self.stale_children()
        for _, proc in stale:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                proc.terminate()
        procs = [p for _, p in stale]
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for proc in alive:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        for name, _ in stale:
            self.forget_child(name)
        return [f"{name} (pid {p.pid})" for name, p in stale]
