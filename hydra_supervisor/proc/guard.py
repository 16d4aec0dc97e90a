"""The orphan guard: stops hydra's children's process groups the moment hydra dies, however it
dies (kill -9 included).

Why: PR_SET_PDEATHSIG reaches only hydra's direct children, and a child subreaper cannot act
once it is dead itself. A wrapper script that runs llama-server without `exec` dies with hydra,
and its llama-server (same process group, no death signal) would live on, holding the port and
the GPU's memory. The guard is a tiny separate process holding the read end of a pipe whose
write end only hydra has: EOF means hydra is gone. It then stops every process group recorded
in the state dir's pidfiles by *that* hydra (pid checked), and exits. On a clean stop hydra has
already stopped its children and forgotten their pidfiles, so the guard finds nothing to do.
When hydra died without that clean stop (its supervisor.json still names it), the guard stamps
the time in it and marks status.json stopped, so `hydra status` says how the run ended instead
of showing a dead hydra's last `switching` as if live.

    python -m hydra_supervisor.proc.guard STATE_DIR HYDRA_PID   (stdin: the pipe)
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path


def start(state_root: Path) -> subprocess.Popen[bytes]:
    """Start the guard for this process; keep the returned Popen (its stdin is the pipe) alive
    as long as hydra runs. Its own session: a terminal's Ctrl-C does not reach it."""
    return subprocess.Popen(
        [sys.executable, "-m", "hydra_supervisor.proc.guard", str(state_root), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def main(argv: list[str]) -> int:
    from hydra_supervisor.proc import filemodes  # imported now: act fast at the EOF
    from hydra_supervisor.proc.state import StateDir

    state, hydra_pid = StateDir(Path(argv[0])), int(argv[1])
    while sys.stdin.buffer.read(4096):  # hydra never writes: this returns at EOF only
        pass
    with contextlib.suppress(OSError):  # a dead hydra's status.json must not read as live
        filemodes.configure(filemodes.of_dir(state.root))
        state.mark_died(hydra_pid)
    state.kill_stale(grace=2.0, hydra_pid=hydra_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
