"""Supervision cases beyond the fault table, on real processes: the completion probe (with a
stand-in server, the one fault a real llama-server cannot show on demand), on_peer_loss: fail,
stale children of an earlier hydra found through their pidfiles, two `hydra up` at once in one
state dir, and a wrapper script's llama-server when hydra is killed -9."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.testing.harness import (
    REPO,
    Up,
    descendants,
    free_port,
    free_port_range,
    run_hydra,
    status_json,
    wait_dead,
    wait_until,
)
from hydra_supervisor.tools import binaries

pytestmark = pytest.mark.slow


def test_completion_probe_restarts_a_head_that_cannot_generate(hydra_up, hydra_env, tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'fake_llama_server.py'}"
                    ' "$@"\n')
    fake.chmod(0o755)
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"binaries:\n  llama-server: {fake}\n")
    prof = tmp_path / "probe.yaml"
    prof.write_text("model: synth-dense\nhead: cpu\n"
                    "health: {interval: 0.3, probe: true, probe_interval: 1, probe_timeout: 5}\n"
                    "restart: {backoff_initial: 0.2, max_failures: 50}\n")
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready(60)

    def restarted() -> bool:
        head = status_json(hydra_env)["status"]["engines"][0]
        return head["restarts"] >= 2
    wait_until(restarted, 30, "the probe to restart the head twice")
    log = (Path(hydra_env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
    assert "completion probe failed (HTTP 500)" in log


def test_on_peer_loss_fail_stops_everything(hydra_up, hydra_env, tmp_path):
    from hydra_supervisor.config.paths import repo_root

    prof = tmp_path / "fail.yaml"
    prof.write_text((repo_root() / "profiles" / "demo-combine.yaml").read_text()
                    + "on_peer_loss: fail\n")
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    st = up.wait_ready()
    children = list(up.children)
    os.kill(st["status"]["engines"][0]["pid"], signal.SIGKILL)
    assert up.proc.wait(30) == 1
    assert "on_peer_loss is fail" in up.output()
    assert not wait_dead(children, 5)
    res = run_hydra(hydra_env, "status")
    assert res.returncode == 3 and "FATAL" in res.stdout


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_stale_children_of_a_dead_hydra_are_stopped(hydra_env):
    """A child that outlived its hydra (say hydra ran without PDEATHSIG support) is found by
    its pidfile (pid + start time + cmdline) and stopped by the next hydra command."""
    rpc = binaries.find("ggml-rpc-server").path
    # A port below the ephemeral range (free_port() is in it: another connect may take it),
    # and wait until the server listens: it must be running when `hydra down` looks.
    port = free_port_range(1)[0]
    proc = subprocess.Popen([str(rpc), "-H", "127.0.0.1", "-p", str(port)],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _listening(port) or proc.poll() is not None, 30, "rpc-server up")
        assert proc.poll() is None, "the stand-in child did not start"
        state = StateDir(Path(hydra_env["HYDRA_STATE_DIR"]))
        state.ensure_writable()
        state.record_child("peer-cpu-peer", proc.pid)
        # A pidfile whose pid now belongs to another program must not be acted on.
        state.record_child("head", os.getpid())
        head_file = state.root / "pids" / "head.json"
        head_file.write_text(head_file.read_text().replace('"cmdline": [', '"cmdline": ["x", '))
        res = run_hydra(hydra_env, "down")
        assert res.returncode == 0
        assert f"peer-cpu-peer (pid {proc.pid})" in res.stdout
        assert proc.wait(10) is not None
        assert psutil.pid_exists(os.getpid())
        assert not list((state.root / "pids").glob("*.json"))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_hydra_up_at_once_one_wins_the_other_names_it(hydra_env, tmp_path):
    """Both started in the same instant in one state dir: the lock decides; the loser exits 2
    naming the winner's pid, and never prints a false "ready:"."""
    port = free_port()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Up(hydra_env, ["--profile", "demo", "--port", str(port)], tmp_path / "a")
    b = Up(hydra_env, ["--profile", "demo", "--port", str(port)], tmp_path / "b")
    try:
        loser = wait_until(lambda: next((u for u in (a, b) if u.proc.poll() is not None),
                                        None), 60, "one of the two to give up")
        winner = b if loser is a else a
        assert loser.proc.returncode == 2, loser.output()
        text = loser.output()
        assert f"pid {winner.proc.pid}" in text and "holds the state dir" in text, text
        assert "ready:" not in text
        winner.wait_ready(120)
        st = status_json(hydra_env)
        assert st["supervisor"]["pid"] == winner.proc.pid
        res = run_hydra(hydra_env, "down")
        assert res.returncode == 0 and str(winner.proc.pid) in res.stdout
        assert winner.proc.wait(30) == 0
    finally:
        for u in (a, b):
            u.kill_everything()


def test_wrapper_script_grandchild_dies_with_hydra(hydra_env, tmp_path):
    """A node `binaries:` entry that is a shell script running llama-server WITHOUT exec:
    kill -9 of hydra must leave nothing (the guard stops the recorded process group)."""
    real = binaries.find("llama-server").path
    wrapper = tmp_path / "llama-server-wrapper.sh"
    wrapper.write_text(f'#!/bin/sh\n# no exec: llama-server is a grandchild of hydra\n'
                       f'"{real}" "$@"\necho "wrapper: llama-server exited $?"\n')
    wrapper.chmod(0o755)
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"binaries:\n  llama-server: {wrapper}\n")
    port = free_port()
    up = Up(hydra_env, ["--profile", "demo", "--port", str(port)], tmp_path)
    try:
        st = up.wait_ready(120)
        head = st["status"]["engines"][0]
        tree = descendants(up.proc.pid)
        servers = [p for p in tree if p.name() == "llama-server"]
        assert servers and all(p.ppid() != up.proc.pid for p in servers), \
            [(p.pid, p.ppid(), p.name()) for p in tree]  # really a grandchild
        up.proc.kill()
        up.proc.wait(10)
        t0 = time.monotonic()
        alive = wait_dead(tree, 15)
        assert not alive, [(p.pid, p.name()) for p in alive]
        wait_until(lambda: not _listening(head["port"]), 10, "the head's port to be free")
        took = time.monotonic() - t0
        assert took < 15
        # and the next hydra finds nothing to clean up
        res = run_hydra(hydra_env, "down")
        assert "hydra is not running" in res.stdout, res.stdout
    finally:
        up.kill_everything()


def test_wrapper_script_orphan_is_adopted_and_stopped(hydra_env, tmp_path):
    """The wrapper itself dies and its llama-server lives on, re-parented to hydra (a child
    subreaper): hydra stops the whole group with the exited child, reaps the orphan (no
    zombie left), restarts the head on its own port, and a clean stop leaves nothing."""
    real = binaries.find("llama-server").path
    wrapper = tmp_path / "llama-server-wrapper.sh"
    wrapper.write_text(f'#!/bin/sh\n"{real}" "$@"\n')
    wrapper.chmod(0o755)
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"binaries:\n  llama-server: {wrapper}\n")
    up = Up(hydra_env, ["--profile", "demo", "--port", str(free_port())], tmp_path)
    try:
        st = up.wait_ready(120)
        head = st["status"]["engines"][0]
        server = next(p for p in descendants(up.proc.pid) if p.name() == "llama-server")
        os.kill(head["pid"], signal.SIGKILL)  # the wrapper dies; llama-server is orphaned
        wait_until(lambda: not psutil.pid_exists(server.pid), 20,
                   "the orphan to be stopped and reaped (not left a zombie)")

        def back() -> bool:
            e = up.engine("head")
            return e["state"] == "READY" and e["pid"] != head["pid"]
        wait_until(back, 120, "the head back")
        assert up.engine("head")["port"] == head["port"]  # its port was freed, not moved
        children = descendants(up.proc.pid)
        assert up.stop() == 0
        assert not wait_dead(children, 15)
    finally:
        up.kill_everything()


def test_sighup_reloads_and_a_second_ctrl_c_kills_at_once(hydra_up, hydra_env):
    up = hydra_up("--profile", "demo", "--port", str(free_port()))
    st = up.wait_ready(120)
    head_pid = st["status"]["engines"][0]["pid"]
    hydra_log = Path(hydra_env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log"
    up.proc.send_signal(signal.SIGHUP)  # reload: the profile is unchanged, so nothing restarts
    wait_until(lambda: "reload: " in hydra_log.read_text(), 30, "the reload to be logged")
    assert "is unchanged; nothing to do" in hydra_log.read_text()
    assert up.proc.poll() is None and up.engine("head")["pid"] == head_pid
    # Two signals sent back to back can reach the process as one (standard signals do not
    # queue), and a demo stops in tens of milliseconds: send the second once the first is
    # being handled, and only while hydra still runs.
    up.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "stopping: SIGINT" in hydra_log.read_text() or up.proc.poll() is not None,
               10, "the first SIGINT handled")
    second = up.proc.poll() is None
    if second:
        up.proc.send_signal(signal.SIGINT)
    code = up.proc.wait(30)
    assert not wait_dead(up.children, 10)
    log = hydra_log.read_text()
    assert "stopped: SIGINT" in log
    if second and "second SIGINT" in log:
        assert code == 130
    else:
        assert code == 0  # the stop was over before the second signal was handled
    res = run_hydra(hydra_env, "status")
    assert "its last run ended: SIGINT" in res.stdout, res.stdout


def test_two_state_dirs_racing_for_one_internal_port_both_serve_their_own(hydra_env,
                                                                          tmp_path):
    """Two profiles in two state dirs, one node file: both plan the same first free internal
    port. The loser must not take the winner's /health for its own: it moves to a free port
    and each router reaches its own llama-server."""
    env_b = dict(hydra_env, HYDRA_STATE_DIR=str(tmp_path / "state-b"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ports = (free_port(), free_port())
    a = Up(hydra_env, ["--profile", "demo", "--port", str(ports[0])], tmp_path / "a")
    b = Up(env_b, ["--profile", "demo", "--port", str(ports[1])], tmp_path / "b")
    try:
        sa, sb = a.wait_ready(180), b.wait_ready(180)
        ha, hb = sa["status"]["engines"][0], sb["status"]["engines"][0]
        assert ha["port"] != hb["port"]
        for head in (ha, hb):
            owner = next(c.pid for c in psutil.net_connections("tcp")
                         if c.laddr and c.laddr.port == head["port"]
                         and c.status == psutil.CONN_LISTEN)
            assert owner == head["pid"]
        assert a.stop() == 0 and b.stop() == 0
    finally:
        a.kill_everything()
        b.kill_everything()
