"""Supervision cases beyond the fault table: the completion probe (with a stand-in server, the
one fault a real llama-server cannot show on demand), on_peer_loss: fail, and stale children of
an earlier hydra found through their pidfiles."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hydra_supervisor.install import BuildOptions, bin_dir
from hydra_supervisor.state import StateDir
from tests.harness import REPO, free_port, run_hydra, status_json, wait_dead, wait_until

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
    from hydra_supervisor.paths import repo_root

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


def test_stale_children_of_a_dead_hydra_are_stopped(hydra_env):
    """A child that outlived its hydra (say hydra ran without PDEATHSIG support) is found by
    its pidfile (pid + start time + cmdline) and stopped by the next hydra command."""
    rpc = bin_dir(BuildOptions()) / "ggml-rpc-server"
    port = free_port()
    proc = subprocess.Popen([str(rpc), "-H", "127.0.0.1", "-p", str(port)],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
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
