"""The Supervisor's seams: every OS and network touch of its policy, one field each, so that
each policy case runs in a fast test on fake children (tests/fake_children.py); and the two
waits its parts share (`race`, `sleep_or_stop`), built on the injected sleep."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.deployment import Deployment, on_spare
from hydra_supervisor.plan.ports import port_free
from hydra_supervisor.proc import health, process
from hydra_supervisor.proc.health import Gated as Traffic
from hydra_supervisor.proc.rpcproto import Version
from hydra_supervisor.tools import buildid

log = logging.getLogger("hydra")


class Moved(StrEnum):
    """Which upstream of a layout the supervisor moved to a free port (`on_upstream_moved`)."""

    HTTP = "http"  # the head's llama-server (the lane's route points at it)
    RPC = "rpc"  # a ggml-rpc-server (a lent device's: the port's ggml-RPC upstream)


async def ask_peer_info(host: str, port: int, timeout: float, tls: TlsFiles | None = None
                        ) -> buildid.PeerInfo | None:
    """Hydra INFO to a remote peer's router (its build identity), off the loop (over ``tls``
    when its router takes TLS only); None when nothing listens there or TLS failed (its HELLO
    says why)."""
    try:
        return await asyncio.to_thread(buildid.ask_info, host, port, timeout, None, tls)
    except OSError:
        return None


async def this_host_identity(configured: Mapping[str, str] | None) -> buildid.BuildIdentity | None:
    """This host's build identity (the binaries the node file names), off the loop; None when
    it cannot be told (the check then warns that only HELLO was checked)."""
    try:
        return await asyncio.to_thread(buildid.local_identity, configured)
    except HydraError as exc:
        log.debug("this host's build identity is unknown (%s)", exc.message)
        return None


async def replan_on_spare(dep: Deployment, device: str, endpoint: str, why: str) -> Deployment:
    """The deployment re-planned onto a spare endpoint of `device` (deployment.on_spare: the
    model's header read, the spare asked its free memory), off the loop."""
    return await asyncio.to_thread(on_spare, dep, device, endpoint, why)


# The supervisor's callback for a moved upstream: (which, old address, new port).
UpstreamMoved = Callable[[Moved, tuple[str, int], int], None]


@dataclass(frozen=True)
class Seams:
    """Everything the supervisor's policy touches outside itself; the defaults are the real ones.
    Tests pass fakes (tests/fake_children.py) and a fast clock with a matching sleep."""

    spawn: process.Spawn = process.spawn
    http_status: Callable[..., Awaitable[int | None]] = health.http_status
    hello: Callable[..., Awaitable[Version | None]] = health.hello
    completion_probe: Callable[[str, int, float], Awaitable[tuple[bool, str]]] = \
        health.completion_probe
    slots_busy: Callable[[str, int, float], Awaitable[bool | None]] = health.slots_busy
    # What hydra sees without asking a process: the router's requests in flight (how many,
    # seconds since a byte moved) and whether a remote peer's endpoint completes a connect.
    flights: Callable[[Traffic | None], tuple[int, float | None] | None] = health.flights
    connect: Callable[[str, int, float], Awaitable[str | None]] = health.tcp_connect
    # A remote peer's build identity (Hydra INFO through its router) and this host's, checked
    # before each head start (starting.py): a peer host back with another build is refused.
    peer_info: Callable[..., Awaitable[buildid.PeerInfo | None]] = ask_peer_info
    local_identity: Callable[[Mapping[str, str] | None],
                             Awaitable[buildid.BuildIdentity | None]] = this_host_identity
    # A lost remote peer moved onto one of its device's spares: the layout re-planned there.
    replan: Callable[[Deployment, str, str, str], Awaitable[Deployment]] = replan_on_spare
    proc_stat: Callable[[int], process.ProcStat | None] = process.group_stat
    owns_port: Callable[[int, int], bool | None] = process.owns_port
    port_free: Callable[[str, int], bool] = port_free
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    reap: bool = True  # subreaper + reaping adopted orphans (off for fake children)


async def race(*aws: Awaitable[object]) -> None:
    """Wait until the first of `aws` is done; cancel (and await) the others."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sleep_or_stop(seams: Seams, stopping: asyncio.Event, seconds: float) -> None:
    """Sleep on the seams' clock, cut short by a stop request."""
    await race(seams.sleep(seconds), stopping.wait())
