"""keep_slots: a lane's KV-cache slots saved before its head stops, restored after a change.

A profile with `keep_slots` keeps its conversations' context across a change of the running
head: every slot of the READY head is saved (llama.cpp's slot save, wire/slots.py) before it
stops, and restored into the new head when it runs the same model. A switch, a head-only
restart, `hydra restart` (serve/change.py) and a standby's flip (serve/standby.py) use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve.reports import SwitchReport
from hydra_supervisor.wire import slots

Addr = tuple[str, int]

log = logging.getLogger("hydra")

SLOT_TIMEOUT = 120.0  # one slot's save or restore (a long context on a slow disk)


async def save(head: Callable[[], Addr | None], dep: Deployment | None) -> dict[int, str]:
    """keep_slots: save every slot of the running head (`head()`: where it answers while
    READY) before it stops."""
    if dep is None or not dep.keep_slots:
        return {}
    addr = head()
    if addr is None:
        return {}
    try:
        return await asyncio.to_thread(slots.save_all, addr, f"keep-{dep.profile}",
                                       SLOT_TIMEOUT)
    except (slots.SlotError, OSError) as exc:
        log.warning("keep_slots: could not save the slots of %s: %s", dep.profile, exc)
        return {}


async def restore(head: Callable[[], Addr | None], state: StateDir, old: Deployment | None,
                  new: Deployment, saved: dict[int, str], report: SwitchReport) -> None:
    """keep_slots: restore the saved slots into the new head (`head()`) when it runs the
    same model; the saved files (in `state`'s slot dir) go either way."""
    if not saved:
        return
    try:
        addr = head()
        if old is None or addr is None or old.plan.model_path != new.plan.model_path \
                or not new.keep_slots:
            report.notes.append("saved slots not restored: the new layout runs another "
                                "model or does not keep slots")
            return
        res = await asyncio.to_thread(slots.restore_all, addr, saved, SLOT_TIMEOUT)
        ok = {k: v for k, v in res.items() if isinstance(v, int)}
        report.notes.append(f"keep_slots: restored {len(ok)} of {len(saved)} slots "
                            f"({sum(ok.values())} tokens)")
    except (slots.SlotError, OSError) as exc:
        report.notes.append(f"keep_slots: restore failed: {exc}")
    finally:
        for name in saved.values():
            with contextlib.suppress(OSError):
                (state.root / "slots" / name).unlink()
