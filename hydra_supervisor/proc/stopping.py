"""Stopping one of a Supervisor's processes, bounded: TERM, a grace, then KILL of its whole
process group (process.stop), or KILL at once; a child that survives even that (state D: a
wedged driver) is reported as unkillable with its pid and state, and its pidfile is kept so
that the next hydra finds it. The Supervisor and its collaborators share one Stopper."""

from __future__ import annotations

import logging

from hydra_supervisor.proc import process
from hydra_supervisor.proc.lineup import Lineup
from hydra_supervisor.proc.managed import RUNNING, ManagedProcess, State
from hydra_supervisor.proc.seams import Seams
from hydra_supervisor.proc.state import StateDir

log = logging.getLogger("hydra")


class Stopper:
    """Stops one process (see the module's doc). `unkillable` is the Supervisor's own list:
    each child that could not be stopped is appended to it."""

    def __init__(self, lineup: Lineup, state: StateDir, seams: Seams,
                 unkillable: list[str]) -> None:
        self.lineup = lineup
        self.state = state
        self.seams = seams
        self.unkillable = unkillable

    async def kill(self, mp: ManagedProcess, *, now: bool = False) -> process.Stopped:
        """Stop `mp`'s child (TERM and a grace, or KILL at once with `now`), without a
        transition; what it exited with becomes its last exit."""
        res = process.Stopped(None)
        if mp.child is not None:
            if now:
                res = await process.kill_now(mp.child, sleep=self.seams.sleep)
            else:
                res = await process.stop(mp.child, self.lineup.timeouts.stop_grace,
                                         sleep=self.seams.sleep)
            if res.code is not None:
                mp.last_exit = res.code
        if res.stuck:
            self.unkillable.append(f"{mp.name}: {res.stuck}")
            log.error("%s: %s", mp.name, res.stuck)
        else:
            self.state.forget_child(mp.name)
        return res

    async def stop(self, mp: ManagedProcess, reason: str, *, now: bool = False,
                   show_exit: bool = True) -> None:
        """Stop `mp` through STOPPING to STOPPED (FATAL when it cannot be stopped)."""
        if mp.state in RUNNING:
            mp.to(State.STOPPING, reason)
        res = await self.kill(mp, now=now) if mp.spec.managed else process.Stopped(None)
        if res.stuck:
            if mp.state is not State.FATAL:
                mp.to(State.FATAL, f"{reason}; could not be stopped: {res.stuck}")
            return
        if mp.state is State.STOPPING:
            mp.to(State.STOPPED, reason if res.code is None or not show_exit
                  else f"{reason}; {process.describe_exit(res.code)}")
        elif mp.state is State.BACKOFF:
            mp.to(State.STOPPED, reason)

    async def stop_for_good(self, mp: ManagedProcess, reason: str) -> None:
        """The run ends: a FATAL process keeps its state (and its reason) but not its child."""
        if mp.state is State.FATAL:
            if mp.alive:
                await self.kill(mp)
            return
        await self.stop(mp, reason)
