"""A lane's state: one enum with a transition table (as a process's `State` has).

The lane stores a *phase* (what its own operations set, checked against TRANSITIONS) and
publishes a *state*: a running phase refined by its processes (loading until the first READY,
degraded, recovering while a process restarts, failed once the layout is FATAL). Every reader —
`hydra status`, /v1/models, metrics, systemd's STATUS=, wire INFO, the dashboard — uses these
words; "port down" and "idle" (a port with no lane) are the port's, not a lane's.
"""

from __future__ import annotations

from enum import Enum


class LaneState(Enum):
    STOPPED = "stopped"  # nothing runs (not loaded yet, unloaded, or stopped by a switch)
    LOADING = "loading"  # its layout is starting; requests are held
    SERVING = "serving"  # every process READY
    DEGRADED = "degraded"  # serving on the head alone after a peer loss (on_peer_loss: degrade)
    RECOVERING = "recovering"  # was serving; a process restarts (requests are held)
    SWITCHING = "switching"  # a change runs: switch, reload, CONFIGURE, restart
    UNLOADING = "unloading"  # draining, then stopping
    FAILED = "failed"  # its load failed or its layout went FATAL; 503 with the reason


# The phases a lane's operations set, and where each may go.
TRANSITIONS: dict[LaneState, frozenset[LaneState]] = {
    LaneState.STOPPED: frozenset({LaneState.LOADING, LaneState.SWITCHING,
                                  LaneState.SERVING}),  # SERVING: a followed start
    LaneState.LOADING: frozenset({LaneState.SERVING, LaneState.FAILED, LaneState.STOPPED}),
    LaneState.SERVING: frozenset({LaneState.SWITCHING, LaneState.UNLOADING, LaneState.FAILED,
                                  LaneState.STOPPED}),
    LaneState.SWITCHING: frozenset({LaneState.SERVING, LaneState.FAILED, LaneState.STOPPED}),
    LaneState.UNLOADING: frozenset({LaneState.STOPPED, LaneState.SERVING}),
    LaneState.FAILED: frozenset({LaneState.LOADING, LaneState.SWITCHING, LaneState.STOPPED}),
}

# llama-server's router-mode words, in /v1/models' "status": {"value": ...} (clients that manage
# models read these; "state" says more).
MODEL_STATUS = {
    LaneState.STOPPED: "unloaded", LaneState.LOADING: "loading", LaneState.SERVING: "loaded",
    LaneState.DEGRADED: "loaded", LaneState.RECOVERING: "loaded", LaneState.SWITCHING: "loading",
    LaneState.UNLOADING: "unloading", LaneState.FAILED: "failed",
}

# Groups of those words, for readers that hold a published row (a plain string), not a lane.
ANSWERING = frozenset({LaneState.SERVING.value, LaneState.DEGRADED.value})  # requests answered
UP = ANSWERING | {LaneState.RECOVERING.value}  # loaded and (soon again) answering
NOT_LOADED = frozenset({LaneState.STOPPED.value, LaneState.FAILED.value})

PORT_DOWN = "port down"  # the port's word: its router accepts no connections
IDLE = "idle"  # the port's word: no lane (hydra up --no-profile)
# Every word a status row's "state" may carry (metrics export one gauge per word).
WORDS = (*(s.value for s in LaneState), PORT_DOWN, IDLE)


class IllegalPhase(RuntimeError):
    pass


def check(frm: LaneState, to: LaneState) -> None:
    if to is not frm and to not in TRANSITIONS[frm]:
        raise IllegalPhase(f"lane phase {frm.value} -> {to.value} is not allowed")
