"""Bad command-line input, run as an operator runs it (`python -m hydra_supervisor ...`): exit 2,
one `error:` line (and its `fix:`), never a traceback, and nothing started before the check
fails (issue 29: `--port 99999` was an OverflowError, `--metrics-port` equal to `--port` a
ValueError, a metrics port in use an OSError).

The commands that find the running hydra (`bench`, `configure`): their target from its
snapshot (cli/running.py) and, marked slow, against a real `hydra up` on a non-default port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.cli.bench_cmd import resolve
from hydra_supervisor.errors import HydraError
from hydra_supervisor.serve.snapshot import (
    DaemonInfo,
    LaneStatus,
    PortStatus,
    ProcessStatus,
    Snapshot,
)
from hydra_supervisor.testing.harness import HYDRA, REPO, free_port, run_hydra


@pytest.fixture(scope="module")
def held_port() -> Iterator[int]:
    """A port another process listens on (this test's socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def _profile_on(tmp: Path, port: int) -> str:
    """demo, as a file of its own, on `port`."""
    text = (REPO / "profiles" / "demo.yaml").read_text().replace("port: 8080", f"port: {port}")
    path = tmp / "on-port.yaml"
    path.write_text(text)
    return str(path)


def _fifo(tmp: Path, name: str = "fifo.yaml") -> str:
    path = tmp / name
    if not path.exists():
        os.mkfifo(path)
    return str(path)


def _dir(tmp: Path, name: str = "dir.yaml") -> str:
    (tmp / name).mkdir(exist_ok=True)
    return str(tmp / name)


def _with(tmp: Path, text: str, name: str = "p.yaml") -> str:
    """A profile file holding `text`."""
    path = tmp / name
    path.write_text(text)
    return str(path)


def _dangling(tmp: Path) -> str:
    link = tmp / "gone.yaml"
    if not link.is_symlink():
        link.symlink_to(tmp / "nothing-here.yaml")
    return str(link)


Args = Callable[[Path, int], list[str]]

# (id, arguments given a tmp dir and a held port, a word the error line must carry)
BAD: list[tuple[str, Args, str]] = [
    ("port-too-big", lambda t, h: ["up", "--port", "99999"], "--port"),
    ("port-negative", lambda t, h: ["up", "--port", "-5"], "--port"),
    ("port-not-a-number", lambda t, h: ["up", "--port", "abc"], "not a valid port"),
    ("metrics-port-too-big", lambda t, h: ["up", "--metrics-port", "70000"], "--metrics-port"),
    ("metrics-port-is-port", lambda t, h: ["up", "--port", "18555", "--metrics-port", "18555"],
     "metrics need a port of their own"),
    ("metrics-port-is-profile-port",
     lambda t, h: ["up", "-p", _profile_on(t, 18556), "--metrics-port", "18556"],
     "a profile's external port"),
    ("metrics-port-in-use", lambda t, h: ["up", "--port", "0", "--metrics-port", str(h)],
     "already in use"),
    ("host-does-not-resolve", lambda t, h: ["up", "--host", "nosuch.invalid"],
     "does not resolve"),
    ("host-not-here", lambda t, h: ["up", "--host", "192.0.2.1"], "cannot listen there"),
    ("unknown-profile", lambda t, h: ["up", "-p", "demo-combien"], "unknown profile"),
    ("unknown-option", lambda t, h: ["up", "--prot", "1"], "no such option"),
    ("unknown-command", lambda t, h: ["uo"], "no such command"),
    ("plan-port", lambda t, h: ["plan", "--port", "65536"], "--port"),
    ("bench-port", lambda t, h: ["bench", "--port", "0"], "--port"),
    ("bench-url", lambda t, h: ["bench", "--url", "http://127.0.0.1:99999"], "not a base URL"),
    ("bench-plot", lambda t, h: ["bench", "--plot", str(t / "no" / "such.html")],
     "does not exist"),
    ("configure-port", lambda t, h: ["configure", "-p", "-1", "temp=1"], "--port"),
    ("configure-host", lambda t, h: ["configure", "--host", "nosuch.invalid", "-p", "9",
                                     "temp=1"], "nosuch.invalid"),
    ("switch-no-profile", lambda t, h: ["switch"], "missing argument"),
    # issue 31: each kind of path with its own cause, never "does not exist" for what exists
    ("profile-is-a-device", lambda t, h: ["plan", "-p", "/dev/zero"], "is a device"),
    ("profile-is-a-fifo", lambda t, h: ["up", "-p", _fifo(t)], "is a FIFO"),
    ("profile-is-a-directory", lambda t, h: ["plan", "-p", _dir(t)], "is a directory"),
    ("profile-dangling-link", lambda t, h: ["plan", "-p", _dangling(t)],
     "symbolic link to"),
    ("profile-under-a-file", lambda t, h: ["plan", "-p", "/etc/hostname/x.yaml"],
     "a part of its path is a file"),
    ("profile-missing", lambda t, h: ["plan", "-p", str(t / "none.yaml")], "does not exist"),
    ("node-is-a-device", lambda t, h: ["plan", "--node", "/dev/zero", "-p", "demo"],
     "node file /dev/zero is a device"),
    ("model-is-a-device", lambda t, h: ["plan", "-p", _with(t, "model: /dev/zero\n")],
     "is a device"),
    ("model-is-a-fifo", lambda t, h: ["up", "-p", _with(t, f"model: {_fifo(t, 'm.gguf')}\n")],
     "is a FIFO"),
    ("model-is-a-directory", lambda t, h: ["plan", "-p",
                                           _with(t, f"model: {_dir(t, 'm')}\n")],
     "is a directory"),
    ("profile-host-does-not-resolve",
     lambda t, h: ["up", "-p", _with(t, "model: synth-dense\nhost: nosuch.invalid\nport: 0\n")],
     "host nosuch.invalid does not resolve"),
    ("profile-name-escapes", lambda t, h: ["up", "-p", _with(t, "profile: ../../escape\n"
                                                                "model: synth-dense\n")],
     "not a valid name"),
    ("token-file-is-a-device",
     lambda t, h: ["configure", "-p", "9", "--token-file", "/dev/zero", "temp=1"],
     "is a device"),
    ("token-file-is-a-fifo",
     lambda t, h: ["configure", "-p", "9", "--token-file", _fifo(t, "tok"), "temp=1"],
     "is a FIFO"),
    ("token-file-is-no-token",
     lambda t, h: ["configure", "-p", "9", "--token-file", "/etc/hostname", "temp=1"],
     "holds no hydra token"),
    ("bench-plot-fifo", lambda t, h: ["bench", "--plot", _fifo(t, "plot.html")], "is a FIFO"),
    ("synth-unwritable", lambda t, h: ["synth", "dense", "/proc/x.gguf"], "cannot write"),
    ("synth-over-a-device", lambda t, h: ["synth", "dense", "/dev/null"], "is a device"),
    ("synth-huge", lambda t, h: ["synth", "dense", str(t / "x.gguf"), "--layers", "100000000"],
     "at most 512 layers"),
]


@pytest.mark.parametrize("args,needle", [(a, n) for _, a, n in BAD], ids=[i for i, _, _ in BAD])
def test_bad_input_is_one_error_line(hydra_env: dict[str, str], tmp_path: Path, held_port: int,
                                     args: Args, needle: str) -> None:
    res = run_hydra(hydra_env, *args(tmp_path, held_port), timeout=60)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr
    assert "Usage:" not in res.stderr and "ready:" not in res.stdout
    # nothing started: no child log, no hydra record left behind
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    assert not list(state.glob("logs/*.head.log")) and not (state / "supervisor.json").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="root drops its capabilities with setpriv to meet a file it cannot "
                           "read")
def test_an_unreadable_profile_says_so(hydra_env: dict[str, str], tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    prof = tmp_path / "theirs.yaml"
    prof.write_text("model: synth-dense\n")
    prof.chmod(0o600)
    os.chown(prof, 65534, 65534)
    res = subprocess.run(["setpriv", "--bounding-set=-all", "--inh-caps=-all",
                          "--securebits=+noroot,+noroot_locked", *HYDRA, "plan", "-p",
                          str(prof)], env=hydra_env, capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res
    assert res.stderr.startswith(f"error: profile file {prof} cannot be read: permission "
                                 "denied"), res.stderr


def test_a_bad_environment_port_is_one_error_line(hydra_env: dict[str, str]) -> None:
    res = run_hydra({**hydra_env, "HYDRA_METRICS_PORT": "abc"}, "up")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.startswith("error: invalid value for '--metrics-port'"), res.stderr


# -- the target from the running hydra's snapshot (pure) ---------------------------------------

def _snap(*ports: PortStatus) -> Snapshot:
    return Snapshot(DaemonInfo(pid=1, started=0.0, state_dir="/s"), ports=ports)


def _port(port: int, *lanes: LaneStatus, default: str | None = None) -> PortStatus:
    return PortStatus(name=f"port-{port}", host="127.0.0.1", port=port,
                      url=f"http://127.0.0.1:{port}", default=default, lanes=lanes)


def _lane(profile: str, state: str = "serving", head_port: int = 0) -> LaneStatus:
    procs = (ProcessStatus(name=f"{profile}.head", role="head", state="READY", host="127.0.0.1",
                           port=head_port),) if head_port else ()
    return LaneStatus(name=f"l/{profile}", profile=profile, state=state, mode="solo",
                      source=f"/p/{profile}.yaml", aliases=(f"{profile}-alias",),
                      processes=procs)


def test_the_target_is_the_port_that_serves_the_profile() -> None:
    snap = _snap(_port(18123, _lane("demo", head_port=30001), _lane("demo-moe", "stopped"),
                       default="demo"))
    t = resolve(snap, "demo-moe", None, None)
    assert (t.profile, t.url, t.source, t.state) == (
        "demo-moe", "http://127.0.0.1:18123", "/p/demo-moe.yaml", "stopped")
    assert t.direct is None  # no ready head: no direct leg
    t = resolve(snap, None, None, None)  # no -p: the port's default profile
    assert (t.profile, t.url, t.direct) == ("demo", "http://127.0.0.1:18123",
                                            "http://127.0.0.1:30001")
    t = resolve(snap, "demo-alias", None, None)  # an alias: the profile's name is sent
    assert t.profile == "demo"
    # --url on a several-profile port: the profile name as the model, the head for a sweep
    t = resolve(snap, "demo", None, "http://127.0.0.1:18123/")
    assert t.profile == "demo" and t.direct == "http://127.0.0.1:30001"
    t = resolve(snap, "demo", None, "http://10.0.0.5:8080")  # elsewhere: no direct leg
    assert t.url == "http://10.0.0.5:8080" and t.direct is None


def test_a_profile_it_does_not_serve_is_named_with_what_it_serves() -> None:
    snap = _snap(_port(18123, _lane("demo"), default="demo"))
    with pytest.raises(HydraError, match="does not serve profile demo-moe") as exc:
        resolve(snap, "demo-moe", None, None)
    assert "http://127.0.0.1:18123 (demo)" in str(exc.value)
    assert "hydra switch demo-moe" in str(exc.value)
    # --port of another server (not this hydra's): taken at its word
    assert resolve(snap, "demo-moe", 9999, None).url == "http://127.0.0.1:9999"
    with pytest.raises(HydraError, match="no default profile"):
        resolve(_snap(_port(18123)), None, None, None)


def test_without_a_hydra_the_profile_port_is_the_fallback() -> None:
    t = resolve(None, None, None, None)
    assert (t.profile, t.url) == ("demo", None)  # the profile's own port
    assert resolve(None, "demo", 9000, None).url == "http://127.0.0.1:9000"


# -- a real hydra on a non-default port, two profiles ------------------------------------------

def _sigint_as_in_a_terminal() -> None:
    """Ctrl-C's SIGINT handled as in a terminal's foreground job: a suite started in the
    background by a non-interactive shell (`./scripts/test &`) has SIGINT ignored, and its
    children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_client_commands_find_the_running_hydra(hydra_up: Any,
                                                hydra_env: dict[str, str]) -> None:
    port = free_port()
    up = hydra_up("-p", "demo", "-p", "demo-moe", "--port", str(port))
    up.wait_ready(timeout=300)
    url = f"http://127.0.0.1:{port}"
    small = ("-n", "2", "--max-tokens", "4", "--prompt-words", "10", "--json")

    # the case: no --url, no --port; the profile name is the model (demo-moe on a
    # port of two profiles: the GGUF's name would be a 404)
    for args in (("-p", "demo"), ("-p", "demo-moe"), ("-p", "demo-moe", "--url", url), ()):
        res = run_hydra(hydra_env, "bench", *args, *small, timeout=180)
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        rep = json.loads(res.stdout)
        assert rep["url"] == url and rep["ok"] == 2, (args, rep)
        assert rep["profile"] == (args[1] if args else "demo")
        assert "start it" not in res.stderr
        assert f"bench {rep['profile']} at {url}: 2 requests" in res.stderr  # progress
    # a sweep says what each step runs
    res = run_hydra(hydra_env, "bench", "-p", "demo", "-c", "1,2", "-n", "1", "--max-tokens",
                    "2", "--prompt-words", "5", timeout=180)
    assert res.returncode == 0, res.stderr
    assert "[1/4] router c=1: 1 requests" in res.stderr and "[4/4] direct c=2" in res.stderr

    res = run_hydra(hydra_env, "configure", "temperature=0.3")  # no -p: hydra's port
    assert res.returncode == 0 and "applied" in res.stdout, res.stdout + res.stderr

    # a second `hydra up` names what runs now (demo-moe loaded on request above)
    res = run_hydra(hydra_env, "up", "-p", "demo")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"serving profiles demo, demo-moe at {url}" in res.stderr, res.stderr

    # Ctrl-C ends `status --watch` quietly, exit 0
    watch = subprocess.Popen([*HYDRA, "status", "--watch"], env=hydra_env, cwd=REPO,
                             preexec_fn=_sigint_as_in_a_terminal,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert "Aborted" not in err and "Traceback" not in err and "demo" in out


def test_ctrl_c_ends_a_command_with_130_and_no_aborted(hydra_env: dict[str, str]) -> None:
    """Ctrl-C while `hydra bench` waits on a server that never answers: exit 130, quietly."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)
        port = srv.getsockname()[1]
        bench = subprocess.Popen([*HYDRA, "bench", "--url", f"http://127.0.0.1:{port}"],
                                 preexec_fn=_sigint_as_in_a_terminal,
                                 env=hydra_env, cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = srv.accept()  # it asks /health (and waits): past its imports
            with conn:  # held open, unanswered, until bench has ended
                bench.send_signal(signal.SIGINT)
                _, err = bench.communicate(timeout=30)
        finally:
            if bench.poll() is None:
                bench.kill()
    assert bench.returncode == 130, err
    assert "Aborted" not in err and "Traceback" not in err
