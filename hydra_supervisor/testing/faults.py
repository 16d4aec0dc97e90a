"""Fault-injection scenarios on real processes, shared by tests/test_faults.py (which asserts
the targets) and bench/faults.py (which prints the table).

Each scenario starts a real `hydra up` on a CPU profile, measures its load time, injects one
fault, and reports: when hydra noticed (status leaves READY, or says FATAL), when it served
again (all READY and a real completion answered), how many client requests failed meanwhile (a
background client sends one every 0.25 s; the request in flight at the fault counts too), and
whether any process outlived the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import psutil
import requests

from hydra_supervisor.config.paths import repo_root
from hydra_supervisor.testing.harness import (
    EngineRow,
    StatusFile,
    Up,
    free_port,
    free_port_range,
    make_env,
    run_hydra,
    status_json,
    wait_dead,
    wait_until,
)

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


class Steady:
    """Steady traffic (issue 31): a short completion every `every` seconds, each on a thread of
    its own whatever became of the earlier ones (a frozen pair holds them all), each with a
    client `timeout`. `spawn` starts fn on a daemon thread (default: here; Hosts.thread for
    another host's namespace). `outcomes` says, in order of ending: "ok", "HTTP <code>", or
    the client's exception."""

    def __init__(self, url: str, every: float = 2.0, timeout: float = 30.0,
                 spawn: Callable[[Callable[[], None]], threading.Thread] | None = None) -> None:
        self.url, self.every, self.timeout = url, every, timeout
        self.spawn = spawn or self._thread
        self.sent = 0
        self.sent_at: list[float] = []  # time.monotonic() of each request's start
        self.outcomes: list[str] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @staticmethod
    def _thread(fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        return t

    def _one(self) -> None:
        try:
            r = requests.post(self.url, json={"prompt": "Hello", "n_predict": 4},
                              timeout=self.timeout)
            out = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            out = type(exc).__name__
        with self._lock:
            self.outcomes.append(out)

    def _tick(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self.sent += 1
                self.sent_at.append(time.monotonic())
                self._threads.append(self.spawn(self._one))
            self._stop.wait(self.every)

    def start(self) -> Steady:
        self._ticker = self._thread(self._tick)
        return self

    def first_after(self, t0: float) -> float | None:
        """Seconds from `t0` to the first request sent after it (None: none yet)."""
        with self._lock:
            return next((t - t0 for t in self.sent_at if t >= t0), None)

    def ok(self) -> int:
        with self._lock:
            return self.outcomes.count("ok")

    def stop(self, timeout: float) -> list[str]:
        """Stop sending; the outcomes once every request sent has ended (within `timeout`)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._ticker is not None:
            self._ticker.join(max(0.0, deadline - time.monotonic()))
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self._threads), "a request never ended"
        with self._lock:
            return list(self.outcomes)


def _profile(tmp: Path, base: str, extra: str = "") -> Path:
    """A copy of a shipped profile with fast restart/health policies (and extra keys)."""
    text = (repo_root() / "profiles" / f"{base}.yaml").read_text()
    path = tmp / f"{base}-fault.yaml"
    path.write_text(text + FAST_POLICY + extra)
    return path


def engine_rows(env: dict[str, str]) -> list[EngineRow]:
    """The engines' rows from status.json, read directly (a `hydra status` call is a Python
    start: on a busy machine it would blur detection times by a second or more)."""
    st = _status_file(env)
    return list(st.get("engines") or [])


def _pid(row: EngineRow) -> int:
    """A running engine's pid (every row of a READY layout has one)."""
    pid = row["pid"]
    assert pid is not None, f"engine {row['name']} runs no process"
    return pid


def serving(port: int) -> bool:
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
        engines = engine_rows(env)
        now = time.monotonic() - t0
        if detected is None and engines and any(e["state"] != "READY" for e in engines):
            detected = now
        if engines and all(e["state"] == "READY" for e in engines) and \
                not old_pids & {e["pid"] for e in engines} and serving(port):
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
    peer, head = engine_rows(env)
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
        os.kill(_pid(peer), signal.SIGKILL)
        detected, recovered = _watch(env, port, t0, {_pid(peer), _pid(head)}, 60 + load)
        t.join(30)
        stream_lost = 1 if broken.is_set() else 0
    return FaultResult("kill -9 peer mid-stream", load, detected, recovered,
                       client.failed + stream_lost, client.sent + 1, _finish(up, seen))


def _signal_head(tmp: Path, sig: int, fault: str, notes: str = "") -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo"))
    seen = {p.pid for p in up.children}
    (head,) = engine_rows(env)
    with Client(port) as client:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(_pid(head), sig)
        detected, recovered = _watch(env, port, t0, {_pid(head)}, 60 + load)
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
    recovered = time.monotonic() - t1 if serving(port) else None
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
    status = status_json(env)["status"]
    assert status is not None, "no status.json after the crash loop"
    text = run_hydra(env, "status").stdout
    ok = rc == 1 and bool(status["fatal"]) and "FATAL" in text and "last lines" in text
    orphans = _finish(up, set())
    return FaultResult("model crashes the head at load", 0.0, fatal_after if ok else None,
                       None, 0, 0, orphans, notes=f"FATAL: {status['fatal']}")


def peer_port_taken(tmp: Path) -> FaultResult:
    up, env, port, load = _start(tmp, _profile(tmp, "demo-combine"))
    seen = {p.pid for p in up.children}
    peer, head = engine_rows(env)
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(_pid(peer), signal.SIGKILL)
        wait_until(lambda: _try_bind(squatter, peer["port"]), 5, "the peer's port to free up")
        squatter.listen(1)
        detected, recovered = _watch(env, port, t0, {_pid(peer), _pid(head)}, 60 + load)
    squatter.close()
    new_port = engine_rows(env)[0]["port"] if recovered else None
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
    (head,) = engine_rows(env)
    logs = Path(env["HYDRA_STATE_DIR"]) / "logs"
    for f in logs.iterdir():
        f.unlink()
    logs.rmdir()
    logs.write_text("not a directory\n")  # every open() under it now fails, even for root
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(_pid(head), signal.SIGKILL)
        detected, recovered = _watch(env, port, t0, {_pid(head)}, 60 + load)
    reason = (engine_rows(env)[0]["warning"] or "") if recovered else ""
    return FaultResult("log directory not writable", load, detected, recovered, client.failed,
                       client.sent, _finish(up, seen), notes=reason)


def _status_file(env: dict[str, str]) -> StatusFile:
    """status.json read directly: polling `hydra status` (a Python start each time) is too
    slow on a busy machine to catch a window of a few seconds."""
    try:
        data: StatusFile = json.loads((Path(env["HYDRA_STATE_DIR"]) / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return StatusFile(**data)


def degrade_to_solo(tmp: Path) -> FaultResult:
    """The SOLO head must serve (stable_after 10 s here) before the return to COMBINE."""
    prof = _profile(tmp, "demo-combine", "on_peer_loss: degrade\n")
    prof.write_text(prof.read_text().replace("stable_after: 3", "stable_after: 10"))
    up, env, port, load = _start(tmp, prof)
    seen = {p.pid for p in up.children}
    peer, head = engine_rows(env)
    with Client(port) as client:
        t0 = time.monotonic()
        os.kill(_pid(peer), signal.SIGKILL)

        def degraded() -> bool:
            st = _status_file(env)
            return bool(st.get("degraded")) and st["engines"][1]["state"] == "READY" and \
                st["engines"][1]["pid"] != _pid(head) and serving(port)
        wait_until(degraded, 60 + 2 * load, "SOLO head serving")
        detected = time.monotonic() - t0
        solo_pid = _status_file(env)["engines"][1]["pid"]

        def combine_again() -> bool:
            st = _status_file(env)
            return not st.get("degraded") and all(e["state"] == "READY" for e in st["engines"]) \
                and st["engines"][1]["pid"] != solo_pid and serving(port)
        wait_until(combine_again, 60 + 2 * load, "back to COMBINE")
        recovered = time.monotonic() - t0
    return FaultResult("peer lost, on_peer_loss: degrade", load, detected,
                       recovered, client.failed, client.sent,
                       _finish(up, seen), notes="detected = SOLO serving; recovered = COMBINE "
                       "(after SOLO served 10 s)")


# -- peers in every state of the head (issue 8, item 1) ------------------------------------


def _by_name(env: dict[str, str]) -> dict[str, EngineRow]:
    """The processes by their role part (`head`, `peer-cpu-peer`): hydra names them
    PROFILE.ROLE."""
    return {e["name"].split(".", 1)[-1]: e for e in engine_rows(env)}


def kill_peer_during_load(tmp: Path) -> FaultResult:
    """kill -9 of the peer while the head loads (a GPU peer out of memory while receiving
    weights): seen at once, the pair restarts peer first — not five head restarts to FATAL."""
    env = make_env(tmp)
    port = free_port()
    t_up = time.monotonic()
    up = _up(env, ["--profile", str(_profile(tmp, "demo-combine")), "--port", str(port)], tmp)

    def loading() -> dict[str, EngineRow] | None:
        eng = _by_name(env)
        head = eng.get("head")
        # (STARTING before its spawn has no pid yet: not loading until it has one)
        return eng if head and head["state"] == "STARTING" and head["pid"] is not None and \
            eng["peer-cpu-peer"]["state"] == "READY" else None
    eng = wait_until(loading, 120, "the head loading")
    seen = {e["pid"] for e in eng.values() if e["pid"]}
    old_peer, old_head = _pid(eng["peer-cpu-peer"]), _pid(eng["head"])
    time.sleep(1.0)  # well into the head's load (weights going to the peer)
    t0 = time.monotonic()
    os.kill(old_peer, signal.SIGKILL)
    detected = None
    recovered = None
    while time.monotonic() - t0 < 180:
        eng = _by_name(env)
        seen |= {e["pid"] for e in eng.values() if e["pid"]}
        if detected is None and eng and (eng["head"]["pid"] != old_head or
                                         eng["peer-cpu-peer"]["state"] != "READY"):
            detected = time.monotonic() - t0
        if eng and all(e["state"] == "READY" for e in eng.values()) and \
                eng["head"]["pid"] != old_head and serving(port):
            recovered = time.monotonic() - t0
            break
        if _fatal(env):
            break
        time.sleep(0.05)
    head = _by_name(env).get("head", {})
    notes = (f"head restarts {head.get('restarts')}, fatal: {_fatal(env)}; load before kill "
             f"{t0 - t_up:.1f}s")
    return FaultResult("kill -9 peer while the head loads", 0.0, detected, recovered, 0, 0,
                       _finish(up, seen), notes=notes)


def _fatal(env: dict[str, str]) -> str | None:
    st = status_json(env).get("status") or {}
    return st.get("fatal")


def sigstop_peer(tmp: Path) -> FaultResult:
    """A frozen peer (SIGSTOP): /health stays 200 and every completion would hang. Caught by
    the peer's process state; the pair restarts, peer first."""
    up, env, port, load = _start(tmp, _profile(tmp, "demo-combine"))
    seen = {p.pid for p in up.children}
    peer, head = engine_rows(env)
    with Client(port) as client:
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(_pid(peer), signal.SIGSTOP)
        detected, recovered = _watch(env, port, t0, {_pid(peer), _pid(head)}, 90 + load)
    with contextlib.suppress(ProcessLookupError):
        os.kill(_pid(peer), signal.SIGCONT)
    reason = next((e["reason"] for e in engine_rows(env) if e["name"].endswith(".head")), "")
    return FaultResult("SIGSTOP peer (frozen)", load, detected, recovered, client.failed,
                       client.sent, _finish(up, seen), notes=f"head restarts: "
                       f"{_by_name(env).get('head', {}).get('restarts')}; {reason[:60]}")


TWO_PEERS = """model: gemma3-270m
mode: combine
head: cpu
peers: [cpu-peer, cpu-peer2]
split: [6, 6, 6]
server_args: {ctx-size: 4096, parallel: 2}
"""


def kill_two_peers(tmp: Path) -> FaultResult:
    env = make_env(tmp, "devices:\n  cpu-peer2: {cpu: true}\n")
    prof = tmp / "two-peers.yaml"
    prof.write_text(TWO_PEERS + FAST_POLICY)
    up, env, port, load = _start(tmp, prof, env)
    seen = {p.pid for p in up.children}
    engines = engine_rows(env)
    peers = [e for e in engines if e["role"] == "peer"]
    with Client(port) as client:
        time.sleep(0.5)
        t0 = time.monotonic()
        for p in peers:
            os.kill(_pid(p), signal.SIGKILL)
        detected, recovered = _watch(env, port, t0, {_pid(e) for e in engines}, 120 + load)
    eng = _by_name(env)
    notes = ", ".join(f"{n} restarts {e['restarts']}" for n, e in eng.items())
    return FaultResult("kill -9 two peers at once", load, detected, recovered, client.failed,
                       client.sent, _finish(up, seen), notes=notes)


def remote_peer_restarted(tmp: Path) -> FaultResult:
    """A remote peer (`endpoint:`) killed and started again 3 s later: not a crash loop to
    FATAL: the head is stopped once, the peer re-probed on a timer, the head back after it."""
    from hydra_supervisor.tools import binaries

    rpc_port = free_port_range(1)[0]
    env = make_env(tmp, f"devices:\n  far: {{endpoint: '127.0.0.1:{rpc_port}'}}\n")
    rpc_bin = str(binaries.find("ggml-rpc-server").path)

    def start_peer() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([rpc_bin, "-H", "127.0.0.1", "-p", str(rpc_port), "-c"],
                                start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env)
        wait_until(lambda: not _port_free(rpc_port), 30, "the remote peer to listen")
        return proc

    prof = tmp / "remote.yaml"
    prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                    "split: [9, 9]\nserver_args: {ctx-size: 4096, parallel: 2}\n" +
                    FAST_POLICY)
    peer = start_peer()
    peers = [peer]
    try:
        up, env, port, load = _start(tmp, prof, env)
        seen = {p.pid for p in up.children}
        (_, head) = engine_rows(env)
        with Client(port) as client:
            time.sleep(0.5)
            t0 = time.monotonic()
            peer.kill()
            peer.wait(10)
            time.sleep(3.0)
            peers.append(start_peer())
            detected, recovered = _watch(env, port, t0, {_pid(head)}, 120 + load)
        eng = _by_name(env)
        notes = (f"peer away 3 s; head restarts {eng.get('head', {}).get('restarts')}, "
                 f"fatal: {_fatal(env)}")
        return FaultResult("remote peer killed, back after 3 s", load, detected, recovered,
                           client.failed, client.sent, _finish(up, seen), notes=notes)
    finally:
        for p in peers:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# -- busy is not hung (item 2) ---------------------------------------------------------------


def burst_internal_port(tmp: Path, n: int = 200) -> FaultResult:
    """200 requests at once straight to llama-server's internal port (no router): /health
    waits behind them for longer than hang_timeout (3 s). The head is busy, not hung: it must
    not be killed, and no request may be lost."""
    up, env, port, load = _start(tmp, _profile(tmp, "demo"))
    seen = {p.pid for p in up.children}
    (head,) = engine_rows(env)
    internal = head["port"]
    lost = 0
    lock = threading.Lock()

    def one() -> None:
        nonlocal lost
        try:
            r = requests.post(f"http://127.0.0.1:{internal}/completion",
                              json={"prompt": "Hi", "n_predict": 2}, timeout=600)
            ok = r.status_code == 200
        except requests.RequestException:
            ok = False
        if not ok:
            with lock:
                lost += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    took = time.monotonic() - t0
    after = _by_name(env).get("head", {})
    killed = after.get("pid") != _pid(head) or after.get("restarts", 0) > 0
    log = (Path(env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
    busy_seen = "busy: /health" in log
    return FaultResult(f"burst of {n} requests on the internal port", load, None, None, lost,
                       n, _finish(up, seen),
                       notes=f"{'KILLED' if killed else 'not killed'}; burst took {took:.0f}s;"
                       f" busy seen in log: {busy_seen}")


def broken_model(path: Path) -> Path:
    """A synthetic llama GGUF without llama.attention.layer_norm_rms_epsilon: it inspects
    fine, and llama-server exits at load ("key not found in model")."""
    import gguf

    from hydra_supervisor.tools import synth

    with mock.patch.object(gguf.GGUFWriter, "add_layer_norm_rms_eps",
                           lambda self, value: None):
        synth.write_dense(path, n_layers=2, n_embd=64, n_ff=128, n_head=2, n_head_kv=2)
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
    "kill_peer_during_load": kill_peer_during_load,
    "sigstop_peer": sigstop_peer,
    "kill_two_peers": kill_two_peers,
    "remote_peer_restarted": remote_peer_restarted,
    "burst_internal_port": burst_internal_port,
}
SCENARIOS = {name: guarded(fn) for name, fn in _SCENARIOS.items()}
