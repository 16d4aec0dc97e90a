"""A lane's loading and unloading: several profiles share a node's devices.

  load(lane, why)     make room on the node (it unloads others), start, wait until it serves;
                      a failed load answers 503 for its cooldown, then a request loads it again
  unload(lane, why)   hold, drain (bounded), stop; with `cut`, what is still in flight is cut
  went_fatal(lane)    a serving lane whose layout went FATAL is failed

The Node (node.py) and the Port (port.py) call them through the Lane (`Lane.load`,
`Lane.unload`, `Lane.went_fatal`); the lane owns the gate, the phase and the counters they set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import TYPE_CHECKING

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc import llamaerr
from hydra_supervisor.serve.reports import LayoutFailed
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.serve.lane import Lane

log = logging.getLogger("hydra")


async def load(lane: Lane, why: str, force: bool = False) -> bool:
    """Make room, start the layout, wait until it serves. False: it failed (its held
    requests got the reason; the others keep serving). `force` (hydra switch): it may stop
    others even after a failed load."""
    try:
        lane._to(LaneState.LOADING)
        lane.error = None
        lane.route.set_unavailable(None)
        lane.route.hold(f"loading profile {lane.name} ({why})")
        lane._changed()
        t0 = lane.clock()
        try:
            if lane.node is not None:
                await lane.node.room_for(lane, force)
            lane.loads += 1
            log.info("loading profile %s (%s)", lane.name, why)
            lane.route.set_unavailable(None)
            lane.route.hold(f"loading model for profile {lane.name}")
            lane._launch(lane.dep)
            lane.sync_gate()
            await lane.wait_ready(lane.dep.timeouts.load + lane.dep.timeouts.peer)
        except (LayoutFailed, HydraError, OSError) as exc:
            await _fail(lane, str(exc), getattr(exc, "tail", []))
            return False
        lane._to(LaneState.SERVING)
        lane.fails = 0
        lane.loaded_at = lane.clock()
        lane.last_good = lane.dep
        lane.route.touch()  # a fresh load counts as a use (LRU)
        log.info("profile %s serving after %.2fs (%s)", lane.name, lane.clock() - t0, why)
        lane.sync_gate()
        if lane.node is not None:
            lane.node.room_changed.set()  # a loader waiting on this one may decide now
        return True
    finally:
        lane.job = None
        lane._changed()


async def _fail(lane: Lane, error: str, tail: list[str]) -> None:
    # The supervisor's reason says what it would do next ("; restart 1 in 1.0s"); a lane
    # does not retry on its own, so that part goes. llama.cpp's own error line says why.
    error = re.sub(r"; restart \d+ in [0-9.]+s$", "", error)
    why = llamaerr.error_line(tail) or next(
        (line.strip() for line in reversed(tail) if line.strip()), None)
    error = llamaerr.with_line(error, why)
    log.error("profile %s failed to load: %s", lane.name, error)
    with contextlib.suppress(LayoutFailed, HydraError, OSError):
        await lane.stop_layout(f"load of {lane.name} failed")
    lane.failed_at = lane.clock()  # before the phase: whoever reads FAILED reads its time
    lane.error = error
    lane._to(LaneState.FAILED)
    lane.fails += 1
    lane.route.set_unavailable(f"profile {lane.name} failed to load: {error}",
                               retry_after=int(lane.cooldown))
    lane.route.release()
    if lane.node is not None:
        lane.node.room_changed.set()


def went_fatal(lane: Lane) -> bool:
    """A serving lane whose layout went FATAL is failed (its route already answers 503
    with the reason; on demand, the next request after the cooldown loads it again)."""
    sup = lane.sup
    if lane.phase is not LaneState.SERVING or sup is None or not sup.fatal \
            or lane.lock.locked():  # a change that failed fast: its rollback runs
        return False
    lane.failed_at = lane.clock()
    lane.error = sup.fatal
    lane._to(LaneState.FAILED)
    lane.unkillable.extend(u for u in sup.unkillable if u not in lane.unkillable)
    log.error("profile %s failed: %s", lane.name, sup.fatal)
    if lane.node is not None:
        lane.node.room_changed.set()
    return True


async def unload(lane: Lane, why: str, cut: bool = False) -> int | None:
    """Drain (bounded) and stop a serving lane; how many requests were cut, or None when it
    was not stopped. Without `cut`, requests still in flight after the drain keep it
    serving (None); with it, they are cut."""
    if lane.phase is not LaneState.SERVING or lane.lock.locked():
        return None  # a reload or `hydra restart` is restarting its processes
    lane._to(LaneState.UNLOADING)
    lane._changed()
    lane.route.hold(f"profile {lane.name} is stopping ({why})")
    drain = lane.switch_timeouts.drain
    left = await asyncio.to_thread(lane.route.wait_idle, drain)
    if left and not cut:
        lane.drains_given_up += 1
        log.warning("profile %s not stopped (%s): %d requests still running after %.0fs",
                    lane.name, why, left, drain)
        lane._to(LaneState.SERVING)
        lane.sync_gate()
        lane._changed()
        return None
    cut_n = 0
    if left:
        cut_n = lane.route.cut_inflight(f"cut: profile {lane.name} stopped ({why}) after "
                                        f"{drain:.0f}s of draining")
    await lane.stop_layout(why)
    lane._to(LaneState.STOPPED)
    lane.loaded_at = None
    lane.unloads += 1
    lane.why = why
    lane.stopped_gate()
    log.info("profile %s stopped (%s)", lane.name, why)
    if lane.node is not None:
        lane.node.room_changed.set()
    lane._changed()
    return cut_n
