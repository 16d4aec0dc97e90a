"""hydra's exit statuses: one table for every command (docs/control.md, "Exit status").

| code | meaning |
|---|---|
| 0 | ok |
| 1 | failed: a start, switch, reload or restart failed; `hydra status`: a port is down |
| 2 | bad input: a profile, node file, flag or argument hydra refuses (the message says which) |
| 3 | not running: a client command found no hydra answering in this state dir |
| 4 | a child could not be killed (it survived SIGKILL: a process in D state) |
| 130 | interrupted (Ctrl-C) |
"""

from __future__ import annotations

OK = 0
FAILED = 1
BAD_INPUT = 2
NOT_RUNNING = 3
UNKILLABLE = 4
INTERRUPTED = 130
PORT_DOWN = FAILED  # `hydra status`: a port's router is not accepting connections


def of_reply(status: int, result: object = None) -> int:
    """The exit status of a command answered by the control API: one map for every command,
    with or without --json. 200 with a result other than ok/noop (a rolled-back switch, a
    failed reload) is a failure; 400/404/422 name bad input; anything else (409 busy, 5xx) is
    a failure."""
    if status == 200:
        return OK if result in (None, "ok", "noop") else FAILED
    if status in (400, 404, 422):
        return BAD_INPUT
    return FAILED
