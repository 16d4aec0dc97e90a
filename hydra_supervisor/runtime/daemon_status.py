"""What a running hydra says about itself on systemd's STATUS= line, from the snapshot just
taken, with the last change that failed. Plain functions of plain values (the Daemon calls
them on the loop with what it holds). The summary view (status.json) is `Snapshot.summary`.
"""

from __future__ import annotations

from hydra_supervisor.runtime import notify
from hydra_supervisor.serve.reports import Result
from hydra_supervisor.serve.snapshot import Snapshot


def status_line(snap: Snapshot, last_change_error: str | None) -> str:
    """systemd's STATUS=: the snapshot, and the last change that failed (until one works)."""
    text = notify.status_text(snap)
    why = last_change_error or change_failed(snap)
    if why:
        text = f"{text}; last change failed: {why}"
    return text


def change_failed(snap: Snapshot) -> str | None:
    """The error of a lane's last change (switch, reload, CONFIGURE, restart) when it
    failed; a later change that works clears it. Each lane's last report, and each port's
    without a lane (its first switch failed)."""
    for p in snap.ports:
        for done in [*(x.switches for x in p.lanes), *([] if p.lanes else [p.switches])]:
            rep = done[-1] if done else None
            if rep is not None and rep.result in (Result.ROLLED_BACK, Result.FAILED):
                return f"{rep.to}: {rep.error}"
    return None
