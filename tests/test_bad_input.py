"""Bad input: each mistake gets a clear message (what, where, the fix) and a non-zero exit."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from hydra_supervisor.testing.harness import free_port, run_hydra


def _profile(tmp_path: Path, text: str, name: str = "p") -> Path:
    d = tmp_path / "profiles"
    d.mkdir(exist_ok=True)
    path = d / f"{name}.yaml"
    path.write_text(text)
    return path


def test_unknown_profile_lists_known_ones(hydra_env):
    res = run_hydra(hydra_env, "up", "--profile", "demo-combien")
    assert res.returncode == 2
    assert "unknown profile 'demo-combien'" in res.stderr
    assert "Did you mean 'demo-combine'" in res.stderr
    assert "demo," in res.stderr and "demo-combine" in res.stderr
    assert "Traceback" not in res.stderr


def test_yaml_syntax_error_names_file_and_line(hydra_env, tmp_path):
    path = _profile(tmp_path, "model: gemma3-270m\nmode: solo\nserver_args:\n  ctx-size: [1, 2\n")
    res = run_hydra(hydra_env, "up", "--profile", str(path))
    assert res.returncode == 2
    assert f"{path}:" in res.stderr and "YAML syntax error" in res.stderr
    line = res.stderr.split(f"{path}:")[1].split(":")[0]
    assert line.isdigit() and int(line) >= 4


def test_unknown_key_names_line_and_valid_keys(hydra_env, tmp_path):
    path = _profile(tmp_path, "model: gemma3-270m\nmode: solo\nprot: 8080\n")
    res = run_hydra(hydra_env, "up", "--profile", str(path))
    assert res.returncode == 2
    assert f"{path}:3:" in res.stderr
    assert "unknown key 'prot'" in res.stderr and "did you mean 'port'" in res.stderr
    assert "valid keys:" in res.stderr and "server_args" in res.stderr


def test_every_problem_is_reported_at_once(hydra_env, tmp_path):
    path = _profile(tmp_path, "model: gemma3-270m\nmode: duo\nport: 99999\nsplit: [a]\n")
    res = run_hydra(hydra_env, "plan", "--profile", str(path))
    assert res.returncode == 2
    assert "3 problem(s)" in res.stderr
    assert f"{path}:2: mode: must be one of solo, combine" in res.stderr
    assert f"{path}:3: port" in res.stderr and f"{path}:4: split" in res.stderr


def test_missing_model_file(hydra_env, tmp_path):
    path = _profile(tmp_path, "model: /nowhere/missing.gguf\n")
    res = run_hydra(hydra_env, "up", "--profile", str(path))
    assert res.returncode == 2
    assert "model file not found" in res.stderr and "/nowhere/missing.gguf" in res.stderr
    assert "gemma3-270m" in res.stderr  # the aliases it could have used


def test_missing_binary_says_how_to_install(hydra_env, tmp_path):
    env = dict(hydra_env)
    env["HYDRA_CACHE_DIR"] = str(tmp_path / "empty-cache")
    for var in ("HYDRA_LLAMA_SERVER", "HYDRA_RPC_SERVER", "HYDRA_LLAMA_BENCH"):
        env.pop(var, None)  # (conftest's stand-ins: this test wants no binary anywhere)
    env["PATH"] = os.path.dirname(env.get("PYTHON", "/usr/bin/python3")) + ":/usr/bin:/bin"
    res = run_hydra(env, "up", "--profile", "demo", "--port", str(free_port()))
    assert res.returncode == 2
    assert "llama-server not found" in res.stderr
    assert "hydra install-llama" in res.stderr


def test_port_in_use_names_port_and_holder(hydra_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        res = run_hydra(hydra_env, "up", "--profile", "demo", "--port", str(port))
    assert res.returncode == 2
    assert f"port {port} on 127.0.0.1" in res.stderr and "already in use" in res.stderr
    assert f"pid {os.getpid()}" in res.stderr


def test_unwritable_state_dir(hydra_env, tmp_path):
    if os.geteuid() == 0:
        ro = Path("/proc/hydra-cannot-write")  # not creatable even for root
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
    env = dict(hydra_env, HYDRA_STATE_DIR=str(ro))
    res = run_hydra(env, "up", "--profile", "demo", "--port", str(free_port()))
    assert res.returncode == 2
    assert "state dir" in res.stderr and "HYDRA_STATE_DIR" in res.stderr


def test_full_state_dir_names_the_file_and_the_fix(hydra_env, tmp_path):
    """A state dir on a full filesystem (a 16 KiB tmpfs, filled, in a private mount
    namespace): `hydra up` says which file it could not write, not a traceback."""
    import shutil
    import subprocess
    import sys
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare (util-linux) for a private tmpfs")
    mnt = tmp_path / "full"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=16k tmpfs {mnt} && "
              f"(dd if=/dev/zero of={mnt}/fill bs=1k count=64 2>/dev/null; true) && "
              f'exec "$0" -m hydra_supervisor up --profile demo --port {free_port()}')
    env = dict(hydra_env, HYDRA_STATE_DIR=str(mnt / "state"))
    try:
        res = subprocess.run([unshare, "-rm", "sh", "-c", script, sys.executable], env=env,
                             capture_output=True, text=True, timeout=60,
                             cwd=Path(__file__).resolve().parent.parent, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("hydra up on a full state dir did not end within 60 s")
    if "mount" in res.stderr and res.returncode != 2:
        pytest.skip(f"no private tmpfs here: {res.stderr.strip()[:200]}")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert f"state dir {mnt / 'state'}: cannot write" in res.stderr
    assert "No space left on device" in res.stderr and "HYDRA_STATE_DIR" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["logs", "nosuch"], "no log for engine 'nosuch'"),
])
def test_other_commands_explain(hydra_env, args, needle):
    res = run_hydra(hydra_env, *args)
    assert res.returncode == 2 and needle in res.stderr
