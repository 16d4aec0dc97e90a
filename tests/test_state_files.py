"""Issue 20 items 3, 4 and 7 (part), issue 18 item 8: what hydra writes in its state dir is its
owner's alone (or a named group's), child logs are bounded by size without blocking the child,
`hydra logs -f` follows rotations and restarts, profiles and node files are bounded input, and
`hydra status` after a kill -9 of hydra says so instead of showing a dead run as live.

The `hydra up` cases run a stand-in llama-server (a few lines of Python: /health 200, and as
much output as asked) so they need no model and take seconds.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hydra_supervisor.config import yamlsrc
from hydra_supervisor.config.config import load_node
from hydra_supervisor.errors import ConfigError
from hydra_supervisor.proc import filemodes, logfiles, process
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router import defaults as request_defaults
from hydra_supervisor.testing.harness import (
    HYDRA,
    REPO,
    free_port,
    run_hydra,
    status_json,
    wait_dead,
    wait_until,
)

# -- a stand-in llama-server that talks a lot -------------------------------------------------

CHATTY = r'''
import os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
rate = int(os.environ.get("CHATTY_BYTES_PER_S", "0"))
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
def talk():
    n = 0
    while rate:
        for _ in range(max(1, rate // 20 // 100)):
            n += 1
            sys.stdout.write(f"line {n:09d} " + "x" * 80 + "\n")
        sys.stdout.flush()
        time.sleep(0.05)
print(f"chatty llama-server on {port} pid {os.getpid()}", flush=True)
threading.Thread(target=talk, daemon=True).start()
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _chatty_node(env: dict[str, str], tmp: Path, extra: str = "") -> Path:
    script = tmp / "chatty.py"
    script.write_text(CHATTY)
    fake = tmp / "llama-server"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    fake.chmod(0o755)
    node = Path(env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"binaries:\n  llama-server: {fake}\n" + extra)
    prof = tmp / "chatty.yaml"
    prof.write_text("model: synth-dense\nhead: cpu\nhealth: {interval: 0.3}\n")
    return prof


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


# -- 3. files only the owner can read ---------------------------------------------------------


@pytest.mark.slow
def test_start_leaves_only_owner_readable_files_and_tightens_old_ones(hydra_up, hydra_env,
                                                                      tmp_path):
    prof = _chatty_node(hydra_env, tmp_path)
    root = Path(hydra_env["HYDRA_STATE_DIR"])
    (root / "logs").mkdir(parents=True)
    root.chmod(0o755)
    (root / "logs").chmod(0o755)  # readable by others: tightened (writable: refused,
    # tests/test_state_private.py)
    old = root / "logs" / "chatty.head.log"
    old.write_text("a line of an earlier run\n")
    old.chmod(0o644)
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    for d in (root, root / "logs", root / "pids"):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    files = [root / "status.json", root / "supervisor.json", root / "hydra.lock",
             root / "control.sock", root / "pids" / "chatty.head.json",
             root / "logs" / "chatty.head.log", root / "logs" / "chatty.head.log.1",
             root / "logs" / "hydra.log"]
    for f in files:
        assert _mode(f) == 0o600, (f, oct(_mode(f)))
    every = [p for p in root.rglob("*")]
    loose = [(str(p), oct(_mode(p))) for p in every if _mode(p) & 0o077]
    assert not loose
    log = (root / "logs" / "hydra.log").read_text()
    assert log.count("tightened") == 1 and "chatty.head.log: 0644 -> 0600" in log
    # The child inherits the umask: what it creates is the owner's too.
    child = next(p for p in up.children if "chatty" in " ".join(p.cmdline()))
    with open(f"/proc/{child.pid}/status") as fh:
        umask = next(line for line in fh if line.startswith("Umask:"))
    assert umask.split()[1] == "0077"


@pytest.mark.slow
def test_state_group_makes_the_state_dir_group_readable(hydra_up, hydra_env, tmp_path):
    group = grp.getgrgid(os.getgid()).gr_name
    prof = _chatty_node(hydra_env, tmp_path, f"state_group: {group}\n")
    root = Path(hydra_env["HYDRA_STATE_DIR"])
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    for d in (root, root / "logs", root / "pids"):
        assert _mode(d) == 0o2750 and os.stat(d).st_gid == os.getgid(), (d, oct(_mode(d)))
    for f in (root / "status.json", root / "logs" / "chatty.head.log",
              root / "logs" / "hydra.log", root / "pids" / "chatty.head.json"):
        assert _mode(f) == 0o640, (f, oct(_mode(f)))
    assert _mode(root / "control.sock") == 0o600  # reading is one thing, driving another


def test_tighten_changes_only_what_is_looser_and_never_follows_links(tmp_path):
    root = tmp_path / "state"
    (root / "logs").mkdir(parents=True)
    loose = root / "logs" / "a.log"
    loose.write_text("x")
    loose.chmod(0o666)
    target = tmp_path / "elsewhere"
    target.write_text("y")
    target.chmod(0o644)
    (root / "link").symlink_to(target)
    changed = filemodes.tighten(root, filemodes.Policy())
    assert _mode(loose) == 0o600 and _mode(root) == 0o700 and _mode(root / "logs") == 0o700
    assert _mode(target) == 0o644
    assert any("a.log: 0666 -> 0600" in c for c in changed)
    assert filemodes.tighten(root, filemodes.Policy()) == []


def test_fallback_log_dir_another_user_made_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chmod(d, 0o777)
    filemodes.secure_dir(d)  # ours, too loose: tightened
    assert _mode(d) == 0o700
    if os.getuid() != 0:
        pytest.skip("needs root to make a directory another user owns")
    os.chown(d, 65534, -1)
    with pytest.raises(PermissionError):
        filemodes.secure_dir(d)


def test_node_file_keys_for_modes_and_logs_are_validated(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text("state_group: no-such-group-here\nlogs:\n  max_mib: 0\n  keep: 1000\n")
    with pytest.raises(ConfigError) as exc:
        load_node(node)
    msg = str(exc.value)
    assert f"{node}:1: state_group: no group 'no-such-group-here'" in msg
    assert f"{node}:3: logs.max_mib" in msg and f"{node}:4: logs.keep" in msg
    node.write_text(f"state_group: {grp.getgrgid(os.getgid()).gr_name}\n"
                    "logs: {max_mib: 2, keep: 5}\n")
    n = load_node(node)
    assert n.state_group and n.log_max_mib == 2.0 and n.log_keep == 5


# -- child logs bounded by size, without blocking the child ----------------------------------


TALKER = r'''
import sys, time
for i in range(int(sys.argv[1])):
    sys.stdout.write(f"line {i:09d} " + "y" * 80 + "\n")
    if i % 500 == 499:
        sys.stdout.flush()
        time.sleep(0.01)
print("done", flush=True)
'''


def _spawn_talker(log: Path, lines: int, policy: filemodes.Policy, *,
                  block_loop: float = 0.0) -> tuple[int, float]:
    async def go() -> tuple[int, float]:
        filemodes.configure(policy)
        child = await process.spawn([sys.executable, "-c", TALKER, str(lines)], {}, log)
        t0 = time.monotonic()
        if block_loop:
            time.sleep(block_loop)  # hydra's loop stuck: the child must not care
        code = await child.wait()
        took = time.monotonic() - t0
        assert isinstance(child, process.RealChild) and child.rotator is not None
        await child.rotator
        return code, took

    old = filemodes.current()
    try:
        return asyncio.run(go())
    finally:
        filemodes.configure(old)


def test_child_log_rotates_by_size_and_keeps_a_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(logfiles, "POLL", 0.05)
    log = tmp_path / "logs" / "head.log"
    pol = filemodes.Policy(log_max_bytes=200_000, log_keep=2)
    code, _ = _spawn_talker(log, 40_000, pol)  # about 3.6 MB at ~90 bytes a line
    assert code == 0
    files = sorted(p.name for p in log.parent.iterdir())
    assert files == ["head.log", "head.log.1", "head.log.2"], files
    for p in log.parent.iterdir():
        assert p.stat().st_size < 600_000, (p, p.stat().st_size)  # bound + a poll's output
        assert _mode(p) == 0o600
    # Oldest to newest, the kept lines are in order and end with the child's last line.
    text = "".join((log.parent / n).read_text() for n in ("head.log.2", "head.log.1",
                                                           "head.log"))
    nums = [int(line.split()[1]) for line in text.splitlines() if line.startswith("line ")]
    assert nums == sorted(nums) and nums[-1] == 39_999
    assert text.endswith("done\n")
    assert logfiles.tail(log, 3)[-1] == "done"


def test_a_new_run_shifts_the_last_runs_log_and_keep_prunes(tmp_path):
    log = tmp_path / "logs" / "peer.log"
    pol = filemodes.Policy(log_keep=2)
    for _ in range(4):
        _spawn_talker(log, 3, pol)
    assert sorted(p.name for p in log.parent.iterdir()) == ["peer.log", "peer.log.1",
                                                            "peer.log.2"]


def test_a_stuck_hydra_loop_never_blocks_the_child(tmp_path, monkeypatch):
    """No pipe: the child writes a file. With hydra's loop blocked for 3 s, a child writing
    ~9 MB finishes anyway (a pipe would fill in 64 KiB and stall it)."""
    monkeypatch.setattr(logfiles, "POLL", 0.05)
    log = tmp_path / "logs" / "head.log"
    t0 = time.monotonic()
    code, _ = _spawn_talker(log, 100_000, filemodes.Policy(log_max_bytes=1 << 20),
                            block_loop=3.0)
    assert code == 0
    # The child ran to its end while the loop was blocked: the file holds all of it at once
    # (rotation resumes after), and nothing waited on hydra.
    assert time.monotonic() - t0 < 20
    assert logfiles.tail(log, 1) == ["done"]


# -- hydra logs -f follows rotations and restarts ---------------------------------------------


def _write(fd: int, first: int, n: int) -> None:
    os.write(fd, "".join(f"n {i}\n" for i in range(first, first + n)).encode())


def test_follow_reads_across_a_size_rotation_and_a_restart(tmp_path):
    log = tmp_path / "head.log"
    fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    _write(fd, 0, 5)
    got: list[str] = []
    done = threading.Event()

    def reader() -> None:
        for line in logfiles.follow(log, poll=0.02, stop=done.is_set):
            got.append(line)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    _write(fd, 5, 5)
    time.sleep(0.1)
    _write(fd, 10, 5)  # written, not yet read when the rotation comes
    logfiles.copytruncate(fd, log, keep=3)
    _write(fd, 15, 5)
    time.sleep(0.2)
    os.close(fd)  # a restart: the file moves to .1, the new run writes a new file
    logfiles.shift(log, 3)
    fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    _write(fd, 20, 5)
    wait_until(lambda: len(got) >= 15, 5, "the followed lines")
    time.sleep(0.2)
    done.set()
    t.join(5)
    os.close(fd)
    assert got == [f"n {i}\n" for i in range(5, 25)], got


def test_hydra_logs_f_follows_rotation_restart_and_the_fallback_path(hydra_env, tmp_path):
    state = StateDir(Path(hydra_env["HYDRA_STATE_DIR"]))
    state.logs.mkdir(parents=True)
    log = state.log_path("demo.head")
    fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    _write(fd, 0, 3)
    out = (tmp_path / "logs.out").open("w+")
    errs = (tmp_path / "logs.err").open("w+")  # no hydra runs: a note says so there
    p = subprocess.Popen([*HYDRA, "logs", "demo.head", "-f", "-n", "2"], env=hydra_env, stdout=out,
                         stderr=errs, cwd=REPO)
    try:
        def seen(n: int) -> bool:
            return Path(out.name).read_text().count("\n") >= n
        wait_until(lambda: seen(2), 15, "the tail")
        _write(fd, 3, 3)
        logfiles.copytruncate(fd, log, keep=3)
        _write(fd, 6, 2)
        wait_until(lambda: seen(7), 10, "lines across a size rotation")
        os.close(fd)
        logfiles.shift(log, 3)  # a restart
        fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        _write(fd, 8, 2)
        wait_until(lambda: seen(9), 10, "lines of the restarted child")
    finally:
        p.terminate()
        p.wait(10)
        os.close(fd)
    assert Path(out.name).read_text().splitlines() == [f"n {i}" for i in range(1, 10)]
    assert "log of a stopped run" in Path(errs.name).read_text()
    # A child that logs to the fallback (logs/ not writable): `hydra logs` finds it there.
    fb = logfiles.fallback_path(state.root, "peer-x")
    fb.parent.mkdir(parents=True, exist_ok=True)
    fb.write_text("from the fallback\n")
    try:
        res = run_hydra(hydra_env, "logs", "peer-x")
        assert res.returncode == 0 and res.stdout == "from the fallback\n", res
    finally:
        fb.unlink()


# -- 4. bounded input --------------------------------------------------------------------------

BOMB = """profile: bomb
model: gemma3-270m
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_alias_bomb_is_refused_within_a_second_naming_file_and_line(tmp_path):
    prof = tmp_path / "bomb.yaml"
    prof.write_text(BOMB)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as exc:
        yamlsrc.load_file(prof)
    assert time.monotonic() - t0 < 1.0
    assert str(exc.value).startswith(f"{prof}:7: ") and "alias bomb" in str(exc.value)


def test_alias_bomb_refused_by_hydra_up_and_in_a_node_file(hydra_env, tmp_path):
    prof = tmp_path / "bomb.yaml"
    prof.write_text(BOMB)
    t0 = time.monotonic()
    res = run_hydra(hydra_env, "up", "--profile", str(prof), "--port", str(free_port()))
    assert res.returncode == 2 and f"{prof}:7:" in res.stderr, res.stderr
    assert time.monotonic() - t0 < 10  # a CLI start included
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + BOMB.split("\n", 2)[2].replace("a:", "x_a:", 1))
    with pytest.raises(ConfigError, match="alias bomb"):
        load_node(node)


def test_aliases_within_the_bound_still_work_and_recursion_is_refused(tmp_path):
    ok = yamlsrc.load_text("base: &b {ctx-size: 2048}\none: *b\ntwo: *b\n", "p.yaml")
    assert ok.data["two"] == {"ctx-size": 2048}
    with pytest.raises(ConfigError, match=r"^r\.yaml:1: a recursive YAML alias"):
        yamlsrc.load_text("a: &a [1, *a]\n", "r.yaml")
    with pytest.raises(ConfigError, match="nested too deeply"):
        yamlsrc.load_text("[" * 5000 + "]" * 5000, "deep.yaml")


def test_oversized_profile_and_node_file_are_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (yamlsrc.MAX_BYTES // 10 + 1))
    with pytest.raises(ConfigError, match=r"larger than 1048576 bytes"):
        yamlsrc.load_file(big)
    with pytest.raises(ConfigError, match=r"big\.yaml: larger than"):
        load_node(big)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="larger than"):
        yamlsrc.load_file(Path("/dev/zero"))  # endless: only MAX_BYTES + 1 are read
    assert time.monotonic() - t0 < 1.0
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"model: caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        yamlsrc.load_file(bad)


def test_router_reads_model_from_json_bodies_up_to_its_cap_only():
    """router/defaults.py: bodies over MAX_INSPECT (8 MiB) are passed on unread; a body
    nested past the recursion limit is unreadable (not a crash); both are quick."""
    assert request_defaults.MAX_INSPECT == 8 << 20
    big = b'{"model":"a","prompt":"' + b"x" * (8 << 20) + b'"}'
    t0 = time.monotonic()
    assert request_defaults.model_in(big) == (None, True)
    assert request_defaults.merge("/v1/completions", big, {"max_tokens": 5}) == (None, None)
    deep = b'{"model":"a","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert request_defaults.model_in(deep) == (None, False)
    assert time.monotonic() - t0 < 1.0
    assert request_defaults.model_in(b'{"model":"a"}') == ("a", True)


def test_a_model_that_is_not_a_string_counts_as_no_model():
    """Issue 31: `"model": 42` or `null` goes where a body without `model` goes (the port's
    default profile), as llama-server reads the field: its json_value() takes null, and a value
    of the wrong type (with a warning), as the default, so a single-model llama-server answers
    200 to each (checked on the pinned build: curl -d '{"model":42,"messages":[...]}' and
    null, [1], {} all 200) and its router mode gives each the answer of a missing model."""
    for raw in (b'{"model":42}', b'{"model":null}', b'{"model":[1]}', b'{"model":{}}',
                b'{"model":true}', b'{"messages":[]}'):
        assert request_defaults.model_in(raw) == (None, True), raw


# -- 7. status after a kill -9 of hydra --------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_dead_runs_switching_reads_as_an_abnormal_end(tmp_path):
    state = StateDir(tmp_path / "state")
    state.ensure_writable()
    pid = _dead_pid()
    (state.root / "supervisor.json").write_text(json.dumps(
        {"pid": pid, "create_time": 1.0, "profile": "demo", "started": time.time() - 60}))
    state.write_status({"pid": pid, "state": "switching", "updated": time.time() - 5,
                        "stopped": None, "engines": [{"name": "head", "pid": 4242,
                                                      "state": "READY"}]})
    ab = state.abnormal_end()
    assert ab and ab["pid"] == pid and ab["last_state"] == "switching" and ab["died"] is None
    fixed = state.read_status_checked()
    assert fixed and fixed["state"] == "stopped" and "ended abnormally after" in fixed["stopped"]
    assert fixed["engines"][0]["state"] == "STOPPED" and fixed["engines"][0]["pid"] is None
    assert fixed["engines"][0]["last_pid"] == 4242
    assert state.read_status()["state"] == "switching"  # reading changes nothing
    assert state.clear_abnormal_end() == ab  # `hydra up`
    assert state.abnormal_end() is None and state.read_status()["state"] == "stopped"
    assert not (state.root / "supervisor.json").exists()


@pytest.mark.slow
def test_status_after_kill_9_says_the_run_ended_abnormally(hydra_up, hydra_env, tmp_path):
    prof = _chatty_node(hydra_env, tmp_path)
    root = Path(hydra_env["HYDRA_STATE_DIR"])
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    pid = up.proc.pid
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    up.proc.wait(10)
    # The orphan guard stamps when hydra died and marks status.json stopped.
    wait_until(lambda: json.loads((root / "status.json").read_text())["state"] == "stopped",
               10, "the guard to mark status.json")
    res = run_hydra(hydra_env, "status")
    assert res.returncode == 3, res
    assert f"ended abnormally at {time.strftime('%Y-%m-%d', time.localtime(t_kill))}" \
        in res.stdout and f"hydra pid {pid}" in res.stdout and "serving" in res.stdout
    js = status_json(hydra_env)
    assert js["running"] is False and js["status"]["state"] == "stopped"
    assert [e["state"] for e in js["status"]["engines"]] == ["STOPPED"]
    assert js["abnormal_end"]["pid"] == pid and abs(js["abnormal_end"]["died"] - t_kill) < 5
    # The next `hydra up` clears it (and says so once in hydra.log).
    up2 = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up2.wait_ready(60)
    log = (root / "logs" / "hydra.log").read_text()
    assert "the last run ended abnormally at" in log and f"hydra pid {pid}" in log
    assert status_json(hydra_env)["status"]["state"] == "serving"


@pytest.mark.slow
def test_status_after_kill_9_of_hydra_and_its_guard(hydra_up, hydra_env, tmp_path):
    """Without the guard (killed too), `hydra status` still tells: from the record left."""
    prof = _chatty_node(hydra_env, tmp_path)
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    pid = up.proc.pid
    guard = next(p for p in psutil.process_iter(["cmdline"])
                 if "hydra_supervisor.proc.guard" in " ".join(p.info["cmdline"] or [])
                 and str(pid) in (p.info["cmdline"] or []))
    guard.kill()
    assert not wait_dead([guard], 5)  # a zombie until hydra reaps it: dead enough
    os.kill(pid, signal.SIGKILL)
    up.proc.wait(10)
    res = run_hydra(hydra_env, "status")
    assert res.returncode == 3 and "ended abnormally after" in res.stdout, res
    assert "last recorded state was serving (stale" in res.stdout
    js: dict[str, Any] = status_json(hydra_env)
    assert js["status"]["state"] == "stopped" and js["abnormal_end"]["last_state"] == "serving"
    up.kill_everything()


@pytest.mark.slow
def test_a_chatty_llama_server_log_stays_bounded_under_hydra_up(hydra_up, hydra_env, tmp_path):
    hydra_env["CHATTY_BYTES_PER_S"] = "600000"
    prof = _chatty_node(hydra_env, tmp_path, "logs: {max_mib: 0.0625, keep: 2}\n")
    logs = Path(hydra_env["HYDRA_STATE_DIR"]) / "logs"
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    wait_until(lambda: (logs / f"{prof.stem}.head.log.2").exists(), 20, "two size rotations")
    time.sleep(3)  # ~1.8 MB more written: still three files of about the bound each
    heads = sorted(p.name.removeprefix(f"{prof.stem}.") for p in logs.glob("*.head.log*"))
    assert heads == ["head.log", "head.log.1", "head.log.2"], heads
    for p in logs.glob("*.head.log*"):
        assert p.stat().st_size < (64 << 10) + 2 * 600_000, (p, p.stat().st_size)
    res = run_hydra(hydra_env, "logs", "head", "-n", "3")
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 3
    assert all(line.startswith("line ") for line in res.stdout.splitlines())
    assert up.engine("head")["state"] == "READY"


def test_a_shared_sticky_directory_is_never_tightened(tmp_path):
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (shared / "someone.txt").write_text("x")
    os.chmod(shared / "someone.txt", 0o644)
    msgs = filemodes.tighten(shared, filemodes.Policy())
    assert _mode(shared) == 0o1777 and _mode(shared / "someone.txt") == 0o644
    assert len(msgs) == 1 and "shared directory" in msgs[0]


def test_the_guard_keeps_a_group_readable_state_dir_group_readable(tmp_path):
    root = tmp_path / "state"
    root.mkdir()
    os.chmod(root, 0o2750)
    assert filemodes.of_dir(root).file_mode == 0o640
    os.chmod(root, 0o700)
    assert filemodes.of_dir(root).file_mode == 0o600


@pytest.mark.slow
def test_a_second_local_user_can_read_nothing_of_the_state_dir(hydra_up, hydra_env, tmp_path):
    """As another user (nobody), with every directory above the state dir open to it: the
    logs, status.json and pidfiles cannot be read, nor the state dir listed."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a command as a second user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="hydra-2nd-user-"))
    try:
        base.chmod(0o755)  # /tmp is 1777: only the state dir's own modes keep nobody out
        hydra_env["HYDRA_STATE_DIR"] = str(base / "state")
        prof = _chatty_node(hydra_env, tmp_path)
        (base / "control-file").write_text("readable\n")
        (base / "control-file").chmod(0o644)

        def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(list(argv), user=65534, group=65534, extra_groups=[],
                                  capture_output=True, text=True, timeout=10, check=False)

        assert as_nobody("cat", str(base / "control-file")).returncode == 0  # the check works
        up = hydra_up("--profile", str(prof), "--port", str(free_port()))
        up.wait_ready(60)
        root = base / "state"
        for f in (root / "status.json", root / "logs" / "head.log", root / "logs" / "hydra.log",
                  root / "pids" / "head.json", root / "supervisor.json"):
            res = as_nobody("cat", str(f))
            assert res.returncode != 0 and "Permission denied" in res.stderr, (f, res)
        assert as_nobody("ls", str(root)).returncode != 0
        up.stop()
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_a_reload_to_an_alias_bomb_is_refused_and_hydra_serves_on(hydra_up, hydra_env,
                                                                   tmp_path):
    """Issue 20 item 5: the bomb grew inside the daemon on a reload and hydra could not stop."""
    prof = _chatty_node(hydra_env, tmp_path)
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)
    pid = up.engine("head")["pid"]
    good = prof.read_text()
    prof.write_text(good + BOMB.split("\n", 2)[2])
    t0 = time.monotonic()
    res = run_hydra(hydra_env, "reload")
    assert time.monotonic() - t0 < 10
    assert res.returncode != 0 and f"{prof}:" in res.stderr + res.stdout \
        and "alias bomb" in res.stderr + res.stdout, res
    head = up.engine("head")
    assert head["state"] == "READY" and head["pid"] == pid
    assert psutil.Process(up.proc.pid).memory_info().rss < 500 << 20
    res = run_hydra(hydra_env, "down", timeout=40)
    assert res.returncode == 0, res
    assert up.proc.wait(30) == 0


def test_the_tail_status_json_shows_spans_a_size_rotation(tmp_path):
    log = tmp_path / "head.log"
    fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        _write(fd, 0, 10)
        logfiles.copytruncate(fd, log, keep=3)
        _write(fd, 10, 2)
    finally:
        os.close(fd)
    assert logfiles.tail(log, 5) == [f"n {i}" for i in range(7, 12)]
    assert logfiles.tail(log, 2) == ["n 10", "n 11"]
    assert logfiles.tail(tmp_path / "none.log", 3) == []


def test_follow_goes_on_where_the_tail_stopped(tmp_path):
    """`hydra logs -f`: a line written between the tail and the follow is neither lost nor
    shown twice."""
    log = tmp_path / "head.log"
    fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    _write(fd, 0, 3)
    shown, mark = logfiles.tail_at(log, 2)
    assert shown == ["n 1", "n 2"] and mark is not None
    _write(fd, 3, 2)  # after the tail, before the follow opens the file
    done = threading.Event()
    got: list[str] = []

    def reader() -> None:
        got.extend(logfiles.follow(log, poll=0.02, stop=done.is_set, start=mark))

    t = threading.Thread(target=reader)
    t.start()
    _write(fd, 5, 1)
    wait_until(lambda: len(got) >= 3, 5, "the followed lines")
    done.set()
    t.join(5)
    os.close(fd)
    assert got == ["n 3\n", "n 4\n", "n 5\n"]
