"""Fault-injection scenarios on real processes, shared by tests/test_faults.py (which asserts
the targets) and bench/faults.py (which prints the table).

Each scenario starts a real `hydra up` on a CPU profile, measures its load time, injects one
fault, and reports: when hydra noticed (status leaves READY, or says FATAL), when it served
again (all READY and a real completion answered), how many client requests failed meanwhile (a
background client sends one every 0.25 s; the request in flight at the fault counts too), and
whether any process outlived the run.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from tests.harness import Up, free_port, make_env, run_hydra, status_json, wait_dead, wait_until

FAST_POLICY = """
restart: {backoff_initial: 0.5, backoff_max: 4, max_failures: 4, window: 60, stable_after: 3}
health: {interval: 0.5, hang_timeout: 3}
"""


@dataclass
class FaultResult:
    fault: str
    load_s: float
    detected_s: float | None
    recovered_s: float | None
    requests_lost: int
    requests_sent: int
    orphans: list[str] = field(default_factory=list)
    notes: str = ""


class Client:
    """Sends a short completion every `period` seconds; counts failures."""

    def __init__(self, port: int, period: float = 0.25) -> None:
        self.port = port
        self.period = period
        self.sent = 0
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sent += 1
            try:
                r = requests.post(f"http://127.0.0.1:{self.port}/completion",
                                  json={"prompt": "Hi", "n_predict": 2}, timeout=10)
                if r.status_code != 200:
                    self.failed += 1
            except requests.RequestException:
                self.failed += 1
            self._stop.wait(self.period)

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def _profile(tmp: Path, base: str, extra: str = "") -> Path:
    """A copy of a shipped profile with fast restart/health policies (and extra keys)."""
    from hydra_supervisor.paths import repo_root

    text = (repo_root() / "profiles" / f"{base}.yaml").read_text()
    path = tmp / f"{base}-fault.yaml"
    path.write_text(text + FAST_POLICY + extra)
    return path


def _engines(env: dict[str, str]) -> list[dict[str, Any]]:
    st = status_json(env)
    return list(st["status"]["engines"]) if st.get("status") else []


def _serving(port: int) -> bool:
    try:
        r = requests.post(f"http://127.0.0.1:{port}/completion",
                          json={"prompt": "Hi", "n_predict": 2}, timeout=10)
        return r.status_code == 200
    except requests.RequestException:
        return False


def _watch(env: dict[str, str], port: int, t0: float, old_pids: set[int], timeout: float
           ) -> tuple[float | None, float | None]:
    """Seconds from t0 until status shows the fault, and until all READY again and serving."""
    detected = recovered = None
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        engines = _engines(env)
        now = time.monotonic() - t0
        if detected is None and engines and any(e["state"] != "READY" for e in engines):
            detected = now
        if engines and all(e["state"] == "READY" for e in engines) and \
                not old_pids & {e["pid"] for e in engines} and _serving(port):
            recovered = time.monotonic() - t0
            detected = detected if detected is not None else recovered
            break
        time.sleep(0.05)
    return detected, recovered


def _finish(up: Up, seen: set[int]) -> list[str]:
    """Stop hydra; report every process of the run still alive 5 s later."""
    seen |= {p.pid for p in up.children}
    up.stop()
    up.kill_everything()
    procs = []
    for pid in seen:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    return [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]


_STARTED: list[Up] = []


def _up(env: dict[str, str], args: list[str], tmp: Path) -> Up:
    up = Up(env, args, tmp)
    _STARTED.append(up)
    return up


def _start(tmp: Path, profile: Path | str, env: dict[str, str] | None = None
           ) -> tuple[Up, dict[str, str], int, float]:
    env = env or make_env(tmp)
    port = free_port()
    t0 = time.monotonic()
    up = _up(env, ["--profile", str(profile), "--port", str(port)], tmp)
    up.wait_ready(180)
    return up, env, port, time.monotonic() - t0


# ------------------------------------------------------------------------------------------


def kill_peer_mid_stream(tmp: Path) -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo-combine"))
    seen = {p.pid for p in up.children}
    peer, head = _engines(env)
    stream_lost = 0
    with Client(port) as client:
        got_first = threading.Event()
        broken = threading.Event()

        def stream() -> None:
            try:
                with requests.post(f"http://127.0.0.1:{port}/completion", stream=True,
                                   json={"prompt": "Once", "n_predict": 400, "stream": True},
                                   timeout=30) as r:
                    n = 0
                    for _ in r.iter_lines():
                        n += 1
                        got_first.set()
                    if n < 400:
                        broken.set()
            except requests.RequestException:
                broken.set()
            got_first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        got_first.wait(30)
        t0 = time.monotonic()
        os.kill(peer["pid"], signal.SIGKILL)
        detected, recovered = _watch(env, port, t0, {peer["pid"], head["pid"]}, 60 + load)
        t.join(30)
        stream_lost = 1 if broken.is_set() else 0
    return FaultResult("kill -9 peer mid-stream", load, detected, recovered,
                       client.failed + stream_lost, client.sent + 1, _finish(up, seen))


def _signal_head(tmp: Path, sig: int, fault: str, notes: str = "") -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo"))
    seen = {p.pid for p in up.children}
    (head,) = _engines(env)
    with Client(port) as client:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(head["pid"], sig)
        detected, recovered = _watch(env, port, t0, {head["pid"]}, 60 + load)
    return FaultResult(fault, load, detected, recovered, client.failed, client.sent,
                       _finish(up, seen), notes=notes)


def kill_head(tmp: Path) -> FaultResult:
    return _signal_head(tmp, signal.SIGKILL, "kill -9 head")


def sigstop_head(tmp: Path) -> FaultResult:
    return _signal_head(tmp, signal.SIGSTOP, "SIGSTOP head (hang)", "hang_timeout 3 s")


def sigkill_hydra(tmp: Path) -> FaultResult:
    env = make_env(tmp)
    up, env, port, load = _start(tmp, "demo", env)
    children = list(up.children)
    t0 = time.monotonic()
    up.proc.kill()
    up.proc.wait(5)
    alive = wait_dead(children, timeout=2.0)
    detected = time.monotonic() - t0 if not alive else None
    orphans = [f"{p.pid} {p.name()}" for p in alive]
    up.kill_everything()
    t1 = time.monotonic()
    up2 = _up(env, ["--profile", "demo", "--port", str(port)], tmp)
    up2.wait_ready(180)
    recovered = time.monotonic() - t1 if _serving(port) else None
    orphans += _finish(up2, {p.pid for p in children})
    return FaultResult("SIGKILL hydra, then hydra up", load, detected, recovered, 0, 0, orphans,
                       notes="detected = children gone")


def crash_at_load(tmp: Path) -> FaultResult:
    """A GGUF that inspects fine but makes llama-server exit while loading: the crash loop
    must end FATAL, with the reason and the log tail in `hydra status`."""
    model = broken_model(tmp / "broken.gguf")
    prof = tmp / "crash.yaml"
    prof.write_text(f"model: {model}\nhead: cpu\n" + FAST_POLICY)
    env = make_env(tmp)
    port = free_port()
    t0 = time.monotonic()
    up = _up(env, ["--profile", str(prof), "--port", str(port)], tmp)
    rc = up.proc.wait(90)
    fatal_after = time.monotonic() - t0
    st = status_json(env)
    text = run_hydra(env, "status").stdout
    ok = rc == 1 and bool(st["status"]["fatal"]) and "FATAL" in text and "last lines" in text
    orphans = _finish(up, set())
    return FaultResult("model crashes the head at load", 0.0, fatal_after if ok else None,
                       None, 0, 0, orphans, notes=f"FATAL: {st['status']['fatal']}")


def peer_port_taken(tmp: Path) -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo-combine"))
    seen = {p.pid for p in up.children}
    peer, head = _engines(env)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(peer["pid"], signal.SIGKILL)
        wait_until(lambda: _try_bind(squatter, peer["port"]), 5, "the peer's port to free up")
        squatter.listen(1)
        detected, recovered = _watch(env, port, t0, {peer["pid"], head["pid"]}, 60 + load)
    squatter.close()
    new_port = _engines(env)[0]["port"] if recovered else None
    return FaultResult("peer's port taken by another process", load, detected, recovered,
                       client.failed, client.sent, _finish(up, seen),
                       notes=f"peer moved {peer['port']} -> {new_port}")


def _try_bind(sock: socket.socket, port: int) -> bool:
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def log_dir_unwritable(tmp: Path) -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo"))
    seen = {p.pid for p in up.children}
    (head,) = _engines(env)
    logs = Path(env["HYDRA_STATE_DIR"]) / "logs"
    for f in logs.iterdir():
        f.unlink()
    logs.rmdir()
    logs.write_text("not a directory\n")  # every open() under it now fails, even for root
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(head["pid"], signal.SIGKILL)
        detected, recovered = _watch(env, port, t0, {head["pid"]}, 60 + load)
    reason = _engines(env)[0]["warning"] if recovered else ""
    return FaultResult("log directory not writable", load, detected, recovered, client.failed,
                       client.sent, _finish(up, seen), notes=reason)


def degrade_to_solo(tmp: Path) -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo-combine", "on_peer_loss: degrade\n"))
    seen = {p.pid for p in up.children}
    peer, head = _engines(env)
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(peer["pid"], signal.SIGKILL)

        def degraded() -> bool:
            st = status_json(env)["status"]
            return bool(st.get("degraded")) and st["engines"][1]["state"] == "READY" and \
                _serving(port)
        wait_until(degraded, 30 + load, "SOLO head serving")
        detected = time.monotonic() - t0
        solo_pid = status_json(env)["status"]["engines"][1]["pid"]

        def combine_again() -> bool:
            st = status_json(env)["status"]
            return not st.get("degraded") and all(e["state"] == "READY" for e in st["engines"]) \
                and st["engines"][1]["pid"] != solo_pid and _serving(port)
        wait_until(combine_again, 60 + load, "back to COMBINE")
        recovered = time.monotonic() - t0
    return FaultResult("peer lost, on_peer_loss: degrade", load, detected,
                       recovered, client.failed, client.sent,
                       _finish(up, seen), notes="detected = SOLO serving; recovered = COMBINE")


def broken_model(path: Path) -> Path:
    """A synthetic llama GGUF without llama.attention.layer_norm_rms_epsilon: it inspects
    fine, and llama-server exits at load ("key not found in model")."""
    import gguf

    from hydra_supervisor import synth

    original = gguf.GGUFWriter.add_layer_norm_rms_eps
    gguf.GGUFWriter.add_layer_norm_rms_eps = lambda self, value: None  # type: ignore
    try:
        synth.write_dense(path, n_layers=2, n_embd=64, n_ff=128, n_head=2, n_head_kv=2)
    finally:
        gguf.GGUFWriter.add_layer_norm_rms_eps = original  # type: ignore
    return path


def guarded(fn: Callable[[Path], FaultResult]) -> Callable[[Path], FaultResult]:
    """Whatever happens in the scenario, every hydra it started is stopped afterwards."""
    def run(tmp: Path) -> FaultResult:
        try:
            return fn(tmp)
        finally:
            while _STARTED:
                _STARTED.pop().kill_everything()

    return run


_SCENARIOS: dict[str, Callable[[Path], FaultResult]] = {
    "kill_peer_mid_stream": kill_peer_mid_stream,
    "kill_head": kill_head,
    "sigstop_head": sigstop_head,
    "sigkill_hydra": sigkill_hydra,
    "crash_at_load": crash_at_load,
    "peer_port_taken": peer_port_taken,
    "log_dir_unwritable": log_dir_unwritable,
    "degrade_to_solo": degrade_to_solo,
}
SCENARIOS = {name: guarded(fn) for name, fn in _SCENARIOS.items()}
