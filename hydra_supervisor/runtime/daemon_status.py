"""What a running hydra says about itself, from the snapshot just taken: the summary view
(`status` in `hydra status --json`, and status.json, the crash record) and systemd's STATUS=
line with the last change that failed. Plain functions of plain values (the Daemon calls
them on the loop with what it holds).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

from hydra_supervisor.runtime import notify
from hydra_supervisor.serve import states
from hydra_supervisor.serve.reports import Result, SwitchReport
from hydra_supervisor.serve.states import LaneState


def summary(snap: dict[str, Any], *, ended: str | None,
            unkillable: list[str]) -> dict[str, Any]:
    """The summary view of every profile: `profile` and `state` name them all, `engines`
    lists every process; with one lane its mode, model, url and reasons are the lane's."""
    rows = [r for r in snap["engines"] if r.get("profile") is not None and not r.get("standby")]
    words = {r["profile"]: r["state"] for r in rows}
    down = [d for f in snap["ports"] if (d := f["down"])]
    one = rows[0] if len(rows) == 1 else None
    if one is not None:
        state = one["state"]
    elif not rows:
        state = snap["engines"][0]["state"] if snap["engines"] else states.IDLE
    else:
        serving = [n for n, st in words.items() if st in states.UP]
        state = states.PORT_DOWN if down else LaneState.SERVING.value if serving \
            else states.IDLE
    return {"pid": os.getpid(), "profile": ",".join(words) or None,
            "source": one["source"] if one else None,
            "mode": one["mode"] if one else ("profiles" if rows else None),
            "model": one["model"] if one else None,
            "url": ", ".join(p["url"] for p in snap["ports"]),
            "state": state, "down": "; ".join(down) or None,
            "fatal": one["fatal"] if one else None,
            "degraded": one["degraded"] if one else None,
            "updated": time.time(), "stopped": ended, "profiles": words,
            "unkillable": list(unkillable),
            "engines": [p for r in rows for p in r["processes"]]}


def status_line(snap: dict[str, Any], last_change_error: str | None,
                records: Iterable[Sequence[SwitchReport]]) -> str:
    """systemd's STATUS=: the snapshot, and the last change that failed (until one works)."""
    text = notify.status_text(snap)
    why = last_change_error or change_failed(records)
    if why:
        text = f"{text}; last change failed: {why}"
    return text


def change_failed(records: Iterable[Sequence[SwitchReport]]) -> str | None:
    """The error of a lane's last change (switch, reload, CONFIGURE, restart) when it
    failed; a later change that works clears it. `records`: each lane's reports (and each
    port's without a lane), oldest first."""
    for done in records:
        rep = done[-1] if done else None
        if rep is not None and rep.result in (Result.ROLLED_BACK, Result.FAILED):
            return f"{rep.to}: {rep.error}"
    return None
