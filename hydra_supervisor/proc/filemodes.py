"""Who may read what hydra writes in its state dir, and how big child logs may grow.

Everything hydra writes under the state dir (logs, pidfiles, supervisor.json, status.json,
slots, the control socket) is its owner's alone: directories 0700, files 0600. A node file that
names `state_group: NAME` opens them to that group for reading: directories 2750 (setgid, so
new files take the group) and files 0640 (the control socket stays 0600: reading status and
logs is one thing, driving hydra another).

`hydra up` applies the policy once, before anything is written (StateDir.secure): it sets the
process umask (children inherit it, so what llama-server writes there follows too) and tightens
what an earlier run or another tool left looser, logging once what it changed.

The policy is one per process (a node file is one per host), so the log writer of process.py
reads it from here rather than through every caller.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class Policy:
    group: int | None = None  # gid of the node file's state_group (None: owner only)
    group_name: str | None = None
    log_max_bytes: int = 10 * MIB  # a child log is rotated once it passes this
    log_keep: int = 3  # rotated files kept beside the live one (NAME.log.1 .. NAME.log.N)

    @property
    def file_mode(self) -> int:
        return 0o640 if self.group is not None else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o2750 if self.group is not None else 0o700

    @property
    def umask(self) -> int:
        return 0o027 if self.group is not None else 0o077


_policy = Policy()


def current() -> Policy:
    return _policy


def of_dir(root: Path) -> Policy:
    """The policy a state dir shows (for a process that has no node file: the orphan guard):
    group-readable if `hydra up` made it so."""
    try:
        st = os.stat(root)
    except OSError:
        return Policy()
    return Policy(group=st.st_gid) if st.st_mode & 0o040 else Policy()


def configure(policy: Policy) -> None:
    global _policy
    _policy = policy


def tighten(root: Path, pol: Policy | None = None) -> list[str]:
    pol = pol or current()
    changed: list[str] = []
    if not root.is_dir():
        return changed
    if os.stat(root).st_mode & stat.S_ISVTX:  # /tmp itself, or another shared directory
        return [f"{root}: a shared directory (sticky bit), left as it is: give hydra a state "
                "dir of its own (HYDRA_STATE_DIR)"]
    _fix(root, pol, changed, is_dir=True)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames:
            _fix(Path(dirpath) / name, pol, changed, is_dir=True)
        for name in filenames:
            _fix(Path(dirpath) / name, pol, changed, is_dir=False)
    return changed


def _fix(path: Path, pol: Policy, changed: list[str], *, is_dir: bool) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        return  # never follow a link; never touch what another user owns
    want = pol.dir_mode if is_dir else pol.file_mode
    if stat.S_ISSOCK(st.st_mode):
        want = 0o600
    mode = stat.S_IMODE(st.st_mode)
    if not is_dir:
        want |= mode & 0o100  # an executable (a wrapper script someone put here) stays one
    if pol.group is not None and st.st_gid != pol.group:
        with contextlib.suppress(OSError):
            os.chown(path, -1, pol.group)
            changed.append(f"{path}: group {st.st_gid} -> {pol.group}")
    if mode != want:
        # Looser bits go; with a group, the group's read bits are added back.
        try:
            os.chmod(path, want)
        except OSError:
            return
        changed.append(f"{path}: {mode:04o} -> {want:04o}")


def secure_dir(path: Path) -> None:
    """Create `path` (and parents) for hydra's own files; refuse one another user owns (a
    directory in /tmp someone else made first) and tighten one that is looser than the
    policy. OSError on failure."""
    pol = current()
    path.mkdir(parents=True, exist_ok=True, mode=pol.dir_mode & 0o777)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise OSError(20, "not a directory hydra made (a link?)", str(path))
    if st.st_uid != os.getuid():
        raise PermissionError(1, f"owned by uid {st.st_uid}, not hydra's", str(path))
    if stat.S_IMODE(st.st_mode) != pol.dir_mode:
        os.chmod(path, pol.dir_mode)
