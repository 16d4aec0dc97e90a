"""Issue 31 item 3: the state dir is hydra's own. A state dir (or a directory above it, or an
entry in it) owned by another user or writable by others is refused before hydra writes
anything; state files are never opened through a link, a FIFO or a hard link; the wire token is
written once, 0600 whatever `state_group` opens, and the same across restarts; a full state
dir is one error line, not a logging traceback.

`hydra up --no-profile --port 0` is enough for each (ready in about a second, no llama.cpp).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_supervisor.proc import filemodes
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.testing.harness import HYDRA, REPO, run_hydra, status_json, wait_until

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make another "
                               "user's files or mount a small tmpfs")


def _refused(env: dict[str, str], needle: str) -> None:
    res = run_hydra(env, "up", "--no-profile", "--port", "0", timeout=60)
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr
    assert "ready:" not in res.stdout


def _tree(root: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p), os.lstat(p).st_mode, os.lstat(p).st_mtime_ns)
                  for p in [root, *root.rglob("*")])


@root_only
def test_a_state_dir_another_user_owns_is_refused_and_left_alone(hydra_env, tmp_path):
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    state.mkdir()
    os.chown(state, NOBODY, -1)
    before = _tree(state)
    _refused(hydra_env, "owned by uid 65534")
    assert _tree(state) == before  # nothing made, nothing tightened


@root_only
@pytest.mark.parametrize("owner", ["hydra's user", "another user"])
def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(hydra_env, tmp_path,
                                                                    owner):
    """The finding: run as root, hydra followed a planted hydra.lock and truncated a root-only
    file. Now the link is refused (whoever made it) before anything is opened."""
    target = tmp_path / "root-only"
    target.write_text("a root-only secret\n")
    target.chmod(0o600)
    before = os.stat(target)
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    state.mkdir(mode=0o700)
    (state / "hydra.lock").symlink_to(target)
    if owner == "another user":
        os.lchown(state / "hydra.lock", NOBODY, NOBODY)
    _refused(hydra_env, "hydra.lock")
    after = os.stat(target)
    assert target.read_text() == "a root-only secret\n"
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    assert sorted(p.name for p in state.iterdir()) == ["hydra.lock"]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o720])
def test_a_state_dir_others_may_write_is_refused(hydra_env, mode):
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    state.mkdir()
    os.chmod(state, mode)
    _refused(hydra_env, "is writable by")
    assert list(state.iterdir()) == [] and stat.S_IMODE(os.stat(state).st_mode) == mode


def test_a_writable_directory_above_it_is_refused(hydra_env, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    hydra_env["HYDRA_STATE_DIR"] = str(shared / "state")
    _refused(hydra_env, f"{shared} is writable by")
    assert not (shared / "state").exists()


def test_a_sticky_directory_above_it_is_fine(tmp_path):
    """/tmp (1777) above the state dir: nobody can rename or remove what is not theirs."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert filemodes.foreign(shared / "state") is None
    assert "writable by" in (filemodes.foreign(shared) or "")  # as the state dir itself: no


@pytest.mark.parametrize("what", ["group-writable file", "symlink", "another user's file"])
def test_an_entry_in_it_that_is_not_hydras_is_refused(hydra_env, tmp_path, what):
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    (state / "pids").mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    entry = state / "pids" / "demo.head.json"
    if what == "symlink":
        entry.symlink_to(tmp_path / "elsewhere")
        needle = "symbolic link"
    else:
        entry.write_text("{}")
        entry.chmod(0o620)
        needle = "is writable by its group"
        if what == "another user's file":
            if os.geteuid() != 0:
                pytest.skip("needs root to make another user's file")
            entry.chmod(0o600)
            os.chown(entry, NOBODY, -1)
            needle = "owned by uid 65534"
    _refused(hydra_env, needle)


def test_open_private_refuses_links_fifos_hard_links(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep me\n")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError) as exc:
        filemodes.open_private(link, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    assert exc.value.errno == errno.ELOOP
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PermissionError, match="not a regular file"):  # and no hang
        filemodes.open_private(fifo, os.O_RDWR | os.O_CREAT)
    hard = tmp_path / "hard"
    os.link(target, hard)
    with pytest.raises(PermissionError, match="hard link"):
        filemodes.open_private(hard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert target.read_text() == "keep me\n"
    fd = filemodes.open_private(tmp_path / "new", os.O_WRONLY | os.O_CREAT, 0o600)
    os.close(fd)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o600


def test_the_lock_is_never_taken_through_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep me\n")
    state = StateDir(tmp_path / "state")
    state.root.mkdir()
    (state.root / "hydra.lock").symlink_to(target)
    with pytest.raises(Exception, match="symbolic link"), state.lock():
        pass
    assert target.read_text() == "keep me\n"


# -- the wire token under state_group ----------------------------------------------------------


@contextlib.contextmanager
def _up_idle(env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([*HYDRA, "up", "--no-profile", "--port", "0"], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: status_json(env).get("running") or proc.poll() is not None,
                   60, "hydra up --no-profile answers on its control socket")
        assert proc.poll() is None, proc.communicate()[0]
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_the_wire_token_is_private_and_the_same_across_restarts_with_state_group(hydra_env):
    """The finding: with state_group every start made wire.token group-readable (tightening
    it to the group's 0640), the next start took that for a leaked token and wrote a new one,
    so the token changed on every restart."""
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"state_group: {grp.getgrgid(os.getgid()).gr_name}\n")
    token = Path(hydra_env["HYDRA_STATE_DIR"]) / "wire.token"
    seen = []
    for _ in range(2):
        with _up_idle(hydra_env):
            seen.append((token.read_text(), stat.S_IMODE(os.lstat(token).st_mode),
                         os.lstat(token).st_ino))
    assert seen[0] == seen[1], seen  # same token, same file: not even rewritten
    assert seen[0][1] == 0o600
    root = token.parent
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o2750  # the group still reads the rest
    assert stat.S_IMODE(os.stat(root / "logs" / "hydra.log").st_mode) == 0o640


# -- a full state dir -------------------------------------------------------------------------


@root_only
def test_a_full_state_dir_is_one_error_line_and_no_logging_traceback(hydra_env):
    base = Path(tempfile.mkdtemp(prefix="hydra-full-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs",
                              str(base)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        shutil.rmtree(base)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        state = base / "state"
        for d in (state, state / "logs", state / "pids"):
            d.mkdir(mode=0o700)
        fd = os.open(state / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"x" * 4096)
        os.close(fd)
        state.chmod(0o755)  # looser: hydra logs that it tightened it, to a full disk
        hydra_env["HYDRA_STATE_DIR"] = str(state)
        res = run_hydra(hydra_env, "up", "--no-profile", "--port", "0", timeout=60)
        assert res.returncode == 2, res
        assert "Traceback" not in res.stderr and "Logging error" not in res.stderr, res.stderr
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "No space left" in errors[0], res.stderr
    finally:
        subprocess.run(["umount", str(base)], check=False)
        shutil.rmtree(base, ignore_errors=True)
