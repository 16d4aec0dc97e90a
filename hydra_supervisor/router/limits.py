"""Process limits the router lives within: file descriptors, thread stacks, pipe buffers.

- ``RLIMIT_NOFILE``: most systems start processes with a soft limit of 1024 and a much higher
  hard limit. Every relayed connection needs two descriptors (client and upstream) and a spliced
  one four more (two pipes), so 1024 is about 400 connections. Raising the soft limit to the hard
  one is what every server does; ``raise_nofile`` does it (``hydra doctor`` reports it too), and
  the router sizes admission from the limit it really has (``fd_budget``), so it queues
  connections instead of failing with EMFILE inside an admitted relay.
- Thread stacks: a relay thread runs a few shallow frames, but Linux gives each thread the main
  stack's size (8 MiB of address space by default). ``RELAY_STACK`` is applied to the router's own
  threads only. 256 KiB already parses 990-deep JSON in a worker; 512 KiB leaves room.
- Pipes (the splice pump): an unprivileged user has ``/proc/sys/fs/pipe-user-pages-soft`` pages
  of pipe buffers in all (64 MiB by default); beyond it, enlarging a pipe fails with EPERM and
  new pipes may get a single page. ``pipe_capacity`` asks for what it wants and reports what it
  got; the relay then uses the copy pump if the pipe is too small to be worth it.
"""

from __future__ import annotations

import fcntl
import os
import resource
import threading
from collections.abc import Callable

RELAY_STACK = 512 * 1024
# Descriptors the router leaves to the rest of the process (supervisor, logs, probes, children's
# pipes) when it sizes admission.
FD_RESERVE = 64
# A splice pipe smaller than this moves bulk transfers in too many syscalls; use the copy pump.
MIN_PIPE = 64 * 1024
# Descriptors per admitted relay: client + upstream; a spliced relay adds two pipes (4 fds).
FDS_HTTP = 2
FDS_SPLICE = 6
# After a 503 the router half-closes and reads what the client still sends (for this long, at
# most this much), so that closing with unread data does not turn into a RST that destroys the
# 503 before the client reads it (the acceptor's refusals and the relay's "upstream down").
LINGER_DRAIN_S = 1.0
LINGER_DRAIN_BYTES = 1 << 20

_stack_lock = threading.Lock()


def raise_nofile() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (soft, hard) now in force.

    An unlimited hard limit is capped at the kernel's ``fs.nr_open`` (setrlimit refuses more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # keep what we have; fd_budget sizes admission from it
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_fds() -> int:
    """Descriptors this process has open now (0 where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def fd_budget(reserved: int) -> int:
    """Descriptors the router may use for relays: the soft limit, less what is open now, less
    ``reserved`` (its own queues and pool) and FD_RESERVE for the rest of the process."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(0, int(soft) - open_fds() - reserved - FD_RESERVE)


def start_thread(
    factory: Callable[..., threading.Thread], stack: int = RELAY_STACK, **kw: object
) -> threading.Thread:
    """Create and start a thread with a small stack.

    ``threading.stack_size`` is process-wide, so it is set just around ``start()`` under a lock
    and put back; a thread started elsewhere in that window (microseconds) would get the small
    stack too, which is still ample for Python code (3.11 runs Python calls without C
    recursion). Raises what ``Thread.start`` raises (RuntimeError: out of threads/memory)."""
    t = factory(**kw)
    with _stack_lock:
        try:
            old = threading.stack_size(stack)
        except (ValueError, RuntimeError):
            old = None  # platform refuses custom sizes: default stacks
        try:
            t.start()
        finally:
            if old is not None:
                threading.stack_size(old)
    return t


def pipe_capacity(wfd: int, want: int) -> int:
    """Grow a pipe towards ``want`` bytes; return the capacity it has (maybe one page)."""
    try:
        fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, want)
    except OSError:
        pass  # EPERM past pipe-user-pages-soft or pipe-max-size: keep the default
    try:
        return int(fcntl.fcntl(wfd, fcntl.F_GETPIPE_SZ))
    except OSError:
        return 4096
