"""Lifecycle events: one typed value per thing an operator watching `hydra up` wants to hear
about (a process died or came back, a profile loaded, unloaded, switched, failed, a standby is
ready, a reload is done).

The serving objects say what happened where it happens (Lane, Standby, the daemon's reload),
as an `Event` handed to their port's `emit`; the port passes it to its sinks (the daemon's),
all on the loop. What is done with them is the sink's business: `hydra up` prints one line
each (cli/up.py); hydra.log keeps its own, more detailed lines as before. A log record an
event line says again carries `SAID` (`extra=SAID`), so the terminal can leave it out while it
prints events.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from hydra_supervisor.serve.clock import wall


class Kind(StrEnum):
    DIED = "died"  # a process exited (or was stopped) while serving; its supervisor restarts it
    STOPPED = "stopped"  # its supervisor stopped it while serving (peer lost, hung, a swap)
    UNHEALTHY = "unhealthy"  # a serving head stopped answering (hung, stopped)
    RESTARTED = "restarted"  # READY again after DIED / STOPPED (or `hydra restart`)
    HEALTHY = "healthy again"  # READY again after UNHEALTHY, without a restart
    LOADED = "loaded"  # a profile serves after a load (on request, at a switch, ...)
    UNLOADED = "unloaded"  # a profile stopped (ttl, making room, a switch)
    SWITCHED = "switched"  # a change of a lane ended well (switch, flip, restart with new settings)
    STANDBY_READY = "standby ready"
    RELOADED = "reloaded"
    # errors: `hydra up -q` still prints them
    LOAD_FAILED = "load failed"
    SWITCH_FAILED = "switch failed"  # a change failed (rolled back, or nothing serves)
    STANDBY_FAILED = "standby failed"
    RELOAD_FAILED = "reload failed"
    FATAL = "fatal"  # a serving profile gave up (its restart budget is spent)


ERRORS = frozenset({Kind.LOAD_FAILED, Kind.SWITCH_FAILED, Kind.STANDBY_FAILED,
                    Kind.RELOAD_FAILED, Kind.FATAL})

# `log.error(..., extra=SAID)`: an event line says this record again (see the module doc)
SAID = {"said_by_event": True}


@dataclass(frozen=True)
class Event:
    kind: Kind
    subject: str  # the process (`demo.head`) or profile (`demo`) it is about
    detail: str = ""  # why, or what: "killed by SIGKILL; restart 1 in 1.0s", "on request"
    seconds: float | None = None  # how long it took (a load, a switch, a restart)
    frm: str | None = None  # a switch's profile before
    at: float = field(default_factory=wall)

    @property
    def error(self) -> bool:
        return self.kind in ERRORS


Sink = Callable[[Event], None]
