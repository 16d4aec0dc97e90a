"""What a running hydra says about itself, from the snapshot just taken (the Daemon's `take()`):
the one-row view (`status` in `hydra status --json`, and status.json, the crash record) and
systemd's STATUS= line with the last change that failed. The Daemon's `legacy_status` and
`_status_line` call these.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from hydra_supervisor.runtime import notify
from hydra_supervisor.serve import states
from hydra_supervisor.serve.reports import Result
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.runtime.daemon import Daemon


def legacy_status(daemon: Daemon, snap: dict[str, Any]) -> dict[str, Any]:
    """The one-row view (`status` in `hydra status --json`, and status.json), from the
    snapshot just taken."""
    if daemon.by_model:
        return fleet_status(daemon, snap)
    e = snap["engines"][0]
    return {"pid": os.getpid(), "profile": e["profile"], "source": e["source"],
            "mode": e["mode"], "model": e["model"], "url": e["url"], "state": e["state"],
            "down": e["down"],
            "fatal": e["fatal"], "degraded": e["degraded"], "updated": time.time(),
            "stopped": daemon.ended,
            "unkillable": list(daemon.unkillable), "engines": e["processes"]}


def fleet_status(daemon: Daemon, snap: dict[str, Any]) -> dict[str, Any]:
    """status.json of a node serving several profiles: every profile's processes."""
    rows = snap["engines"]
    words = {r["profile"]: r["state"] for r in rows}
    serving = [n for n, st in words.items() if st in states.UP]
    down = [d for f in snap["fleets"] if (d := f["down"])]
    return {"pid": os.getpid(), "profile": ",".join(words), "source": "-",
            "mode": "profiles", "model": None,
            "url": ", ".join(p.url for p in daemon.by_model),
            "state": states.PORT_DOWN if down else LaneState.SERVING.value if serving
            else states.IDLE,
            "down": "; ".join(down) or None, "fatal": None, "degraded": None,
            "updated": time.time(), "stopped": daemon.ended, "profiles": words,
            "unkillable": list(daemon.unkillable),
            "engines": [p for r in rows for p in r["processes"]]}


def status_line(daemon: Daemon, snap: dict[str, Any]) -> str:
    """systemd's STATUS=: the snapshot, and the last change that failed (until one works)."""
    text = notify.status_text(snap)
    why = daemon.last_change_error or change_failed(daemon)
    if why:
        text = f"{text}; last change failed: {why}"
    return text


def change_failed(daemon: Daemon) -> str | None:
    """The error of a lane's last change (switch, reload, CONFIGURE, restart) when it
    failed; a later change that works clears it."""
    records = [*(lane.switches for lane in daemon.lanes()),
               *(p.reports for p in daemon.ports if not p.lanes)]
    for done in records:
        rep = done[-1] if done else None
        if rep is not None and rep.result in (Result.ROLLED_BACK, Result.FAILED):
            return f"{rep.to}: {rep.error}"
    return None

