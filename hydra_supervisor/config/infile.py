"""A file the operator names (a profile, a node file, a model, a token file): a regular file
hydra can read, or one HydraError with the right cause.

`Path.is_file()` is False for a missing file, a directory, a FIFO, a device, a dangling link
and a file behind a directory hydra cannot enter alike, and "does not exist" was the answer to
all of them (`/dev/zero` given as a model). `kind_problem` tells them apart; `check` raises.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from hydra_supervisor.errors import HydraError


def kind_of(st: os.stat_result) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def kind_problem(path: Path) -> str | None:
    """Why `path` cannot be read as a file (a phrase to follow its name), or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    except NotADirectoryError:
        return "cannot exist: a part of its path is a file, not a directory"
    except PermissionError:
        return "cannot be reached: permission denied on a directory above it"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a loop of symbolic links"
        return f"cannot be read: {exc.strerror or exc}"
    kind = kind_of(st)
    if kind is not None:
        return f"is {kind}, not a file"
    if not os.access(path, os.R_OK):
        return f"cannot be read: permission denied (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check(path: Path, what: str, *, hint: str | None = None) -> Path:
    """`path` if it is a readable regular file; else HydraError "WHAT PATH <why>"."""
    why = kind_problem(path)
    if why is not None:
        raise HydraError(f"{what} {path} {why}", hint=hint)
    return path
