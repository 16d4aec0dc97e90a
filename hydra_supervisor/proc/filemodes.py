"""Who may read what hydra writes in its state dir, and how big child logs may grow.

Everything hydra writes under the state dir (logs, pidfiles, supervisor.json, status.json,
slots, the control socket) is its owner's alone: directories 0700, files 0600. A node file that
names `state_group: NAME` opens them to that group for reading: directories 2750 (setgid, so
new files take the group) and files 0640 (the control socket and the wire token stay 0600:
reading status and logs is one thing, driving hydra another).

The state dir is hydra's own (`foreign`, before anything is written): a state dir, a directory
above it or an entry in it that another user owns, or that others may write (group- or
world-writable; `state_group` only ever grants reading), is refused, not used: files another
user could plant there (a `hydra.lock` symlink to a root-only file) are opened by hydra as its
own. Once the check passes nobody else can add or swap an entry, and hydra opens its files
there with O_NOFOLLOW besides (`open_private`).

`hydra up` applies the policy once, before anything is written (StateDir.secure): it sets the
process umask (children inherit it, so what llama-server writes there follows too) and tightens
what an earlier run or another tool left looser, logging once what it changed.

The policy is one per process (a node file is one per host), so the log writer of process.py
reads it from here rather than through every caller.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
TOKEN_FILE = "wire.token"  # the wire protocol's owner token (wire/trust.py): never group-readable


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
    if stat.S_ISSOCK(st.st_mode) or path.name == TOKEN_FILE:
        want = 0o600  # these drive hydra: its owner's alone, whatever the group may read
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


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _unsafe(path: Path, st: os.stat_result, *, trusted: tuple[int, ...],
            sticky_ok: bool = False) -> str | None:
    """Why `path` (stat `st`) is not hydra's own, or None."""
    if st.st_uid not in trusted:
        return f"{path} is owned by {_who(st.st_uid)}, not by hydra's user ({_who(os.geteuid())})"
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not mode & 0o022:
        return None
    if sticky_ok and stat.S_ISDIR(st.st_mode) and mode & stat.S_ISVTX:
        return None  # /tmp above the state dir: nobody can rename or remove what is not theirs
    who = "its group and others" if mode & 0o022 == 0o022 else \
        "its group" if mode & 0o020 else "every user"
    return f"{path} is writable by {who} (mode {mode:04o})"


def foreign(root: Path, max_entries: int = 100_000) -> str | None:
    """Why the state dir `root` is not hydra's own, or None: it, a directory above it or an
    entry in it is owned by another user or writable by others (see the module's docstring).
    A directory above may also be root's, and one with the sticky bit (/tmp) may be
    world-writable."""
    me = os.geteuid()
    real = Path(os.path.realpath(root))
    for top in {root.absolute(), real}:
        for up in reversed(top.parents):
            try:
                link, st = os.lstat(up), os.stat(up)
            except OSError:
                break  # the rest is created by hydra, under a directory checked here
            why = _unsafe(up, link, trusted=(0, me)) if stat.S_ISLNK(link.st_mode) else None
            why = why or _unsafe(up, st, trusted=(0, me), sticky_ok=True)
            if why:
                return why
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{root} cannot be read: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root} is not a directory"
    why = _unsafe(real, st, trusted=(me,))
    if why:
        return why
    seen = 0
    for dirpath, dirnames, filenames in os.walk(real, followlinks=False):
        for name in (*dirnames, *filenames):
            path = Path(dirpath) / name
            seen += 1
            if seen > max_entries:
                return f"{root} holds more than {max_entries:,} entries: not a state dir"
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            why = _unsafe(path, st, trusted=(me,)) or (
                f"{path} is a symbolic link (to {os.readlink(path)}): hydra's state dir holds "
                "only its own files" if stat.S_ISLNK(st.st_mode) else None)
            if why:
                return why
    return None


_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_private(path: Path, flags: int, mode: int | None = None) -> int:
    """A descriptor for hydra's own file `path` in the state dir: never through a symlink
    (O_NOFOLLOW), never a FIFO or device (O_NONBLOCK, then fstat), never a file another user
    owns or one with a second name (a hard link to a file elsewhere). With O_CREAT: created
    exclusively when missing, with `mode` (the policy's file mode by default). OSError
    (ELOOP for a link, EPERM for the rest) naming the path."""
    mode = current().file_mode if mode is None else mode
    fd = -1
    if flags & os.O_CREAT:
        try:
            fd = os.open(path, (flags | os.O_EXCL | _NOFOLLOW) & ~os.O_TRUNC, mode)
        except FileExistsError:
            fd = -1
    if fd < 0:
        try:
            fd = os.open(path, (flags & ~(os.O_CREAT | os.O_TRUNC)) | _NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, "a symbolic link: hydra opens none of its state "
                              "files through a link", str(path)) from None
            raise
    try:
        st = os.fstat(fd)
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by {_who(st.st_uid)}" if st.st_uid != os.geteuid() else
               "a file with another name elsewhere (a hard link)" if st.st_nlink > 1 else None)
        if why:
            raise PermissionError(errno.EPERM, f"{why}, not hydra's own file", str(path))
        os.set_blocking(fd, True)
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
