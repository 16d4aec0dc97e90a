"""What `hydra status` shows, from the daemon's snapshot (serve/snapshot.py, read back from its
JSON with one typed parse): per port its lanes, the standby, every process, the router line and
why a port is down. Renderers only: no I/O but printing."""

from __future__ import annotations

import time
from collections.abc import Mapping

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from hydra_supervisor.cli.shared import out, styled
from hydra_supervisor.serve import states
from hydra_supervisor.serve.snapshot import (
    LaneStatus,
    PortStatus,
    ProcessStatus,
    RemoteLoad,
    RequestStatus,
    RouterCounters,
    Snapshot,
    SwitchStatus,
    parse,
)
from hydra_supervisor.serve.states import LaneState

PROCESS_COLUMNS = ("engine", "role", "device", "pid", "port", "state", "uptime", "restarts",
                   "memory", "reason")


def snapshot_of(reply: Mapping[str, object]) -> Snapshot:
    """The snapshot in a `GET /status` reply (its `daemon`)."""
    return Snapshot.from_json(reply.get("daemon"))


def serving_now(status: Mapping[str, object]) -> str | None:
    """What a running hydra serves now, in words, from its summary view (`status`: after a
    switch, the profile switched to, not the one it started with)."""
    profiles = status.get("profiles")
    if isinstance(profiles, Mapping):  # every profile: those loaded now
        names = [str(n) for n, st in profiles.items() if st not in states.NOT_LOADED]
        if not names:
            return "hydra (no profile was loaded)"
        return f"profile{'s' if len(names) > 1 else ''} {', '.join(names)}"
    name = status.get("profile")
    return f"profile {name}" if name else None


def ports_down(snap: Snapshot) -> list[str]:
    """Why each port that refuses every connection does (its router's acceptor is not
    running): `hydra status` then exits 1."""
    return snap.down()


def status_group(snap: Snapshot) -> Group:
    return Group(*daemon_renderables(snap))


def daemon_renderables(snap: Snapshot) -> list[RenderableType]:
    return [part for p in snap.ports for part in _port_renderables(p)]


def _port_renderables(p: PortStatus) -> list[RenderableType]:
    """A port: with one profile, that profile's view; with several, a row per profile, then
    every running process, then the port's router counters; then its standby."""
    active = p.active()
    url = p.url + (" (TLS only)" if p.tls else "")
    if len(active) == 1:
        parts = lane_renderables(active[0], url, router=p.router, down=p.down,
                                 lanes=p.lanes)
    elif not active:
        parts = [Text(f"no profile loaded at {p.url} ({p.word()}); "
                      "`hydra switch NAME` loads one")]
        parts += _router_line(p.router, p.lanes, p.url)
        if p.down:
            parts.append(Text(f"PORT DOWN: {p.down}; hydra is restarting it",
                              style="bold red"))
        parts += _last_switch(p.switches)
    else:
        parts = _several_renderables(p, active)
    for x in p.lanes:
        if x.role == "standby":
            parts.append(_standby_line(x))
            if x.processes:
                parts.append(_process_table(list(x.processes), warnings=True))
    return parts


def _several_renderables(p: PortStatus, active: tuple[LaneStatus, ...]
                         ) -> list[RenderableType]:
    parts: list[RenderableType] = [
        styled(("port ", ""), (p.url, "bold"),
               f" serves {len(active)} profiles, routed by the request's model "
               f"(default: {p.default})")]
    if p.down:
        parts.append(Text(f"PORT DOWN: {p.down}; hydra is restarting it", style="bold red"))
    parts.append(_lane_table(active))
    procs = _process_table([proc for x in active for proc in x.processes], warnings=False)
    if procs.row_count:
        parts.append(procs)
    r = p.router
    if r is not None:
        parts.append(Text(
            f"router: {r.open} open; {_request_split(r, p.lanes)}, "
            f"{r.refused.get('unknown_model', 0)} for unknown models, "
            f"{r.refused.get('queue_full', 0)} refused busy (429), {r.http.get('cut', 0)} cut, "
            f"{r.http.get('retried', 0)} retried" + _router_restarts(r)))
        parts += _holder_line(r)
    parts += _log_tails([proc for x in active for proc in x.processes])
    parts.append(Text("loads = loads/unloads; * = the default profile (requests without "
                      "a model)", style="dim"))
    return parts


def _lane_table(lanes: tuple[LaneStatus, ...]) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for col in ("profile", "state", "mode", "devices", "needs", "loaded", "idle",
                "requests", "queued", "in flight", "tok/s", "loads", "ttl", "note"):
        table.add_column(col)
    for x in lanes:
        needs = ", ".join(f"{k} {v:,} MiB" for k, v in x.needs_mib.items())
        loaded = _fmt_age(x.resident_s) if x.resident_s is not None else "-"
        held = (x.held_reason or "").removeprefix(f"loading profile {x.profile}: ")
        note = x.error or (x.why or "" if x.state == LaneState.STOPPED.value else
                           held if x.state == LaneState.LOADING.value else "")
        if x.running is not None:
            note = f"{x.running}/{x.concurrency} running, {x.waiting} queued" + (
                f"; {note}" if note else "")
        name = x.profile + (" *" if x.default else "") + \
            (f" ({', '.join(x.aliases)})" if x.aliases else "")
        table.add_row(name, x.state, str(x.mode), ", ".join(x.devices), needs, loaded,
                      _fmt_age(x.idle_s or 0.0), str(x.requests), str(x.queued),
                      str(x.inflight), f"{x.tokens_per_s:g}", f"{x.loads}/{x.unloads}",
                      f"{x.ttl:g}s" if x.ttl else "-", Text(note))
    return table


def _standby_line(x: LaneStatus) -> Text:
    """The other layout, kept loaded beside the active one (standby:)."""
    needs = ", ".join(f"{k} {v:,} MiB" for k, v in x.needs_mib.items())
    how = (f"`hydra switch {x.profile}` flips to it at once"
           if x.state == LaneState.SERVING.value else x.why or x.state)
    return Text.assemble(("standby ", ""), (x.profile, "bold"),
                         f" ({x.mode or '-'}) for {x.standby_of} — {x.state}; plan "
                         f"{needs or '-'}; {how}")


def _process_table(procs: list[ProcessStatus], warnings: bool) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for col in PROCESS_COLUMNS:
        table.add_column(col)
    now = time.time()
    for p in procs:
        uptime = _fmt_age(now - p.started) if p.started else "-"
        reason = p.reason + remote_load_text(p.remote_load) + \
            (f" [{p.warning}]" if warnings and p.warning else "")
        table.add_row(p.name, p.role, p.device or "-", str(p.pid or "-"), _port_of(p),
                      p.state, uptime, str(p.restarts), _fmt_mem(p), Text(reason))
    return table


def _port_of(p: ProcessStatus) -> str:
    """A process's port; a remote peer's host:port, "spare" when it is not its device's
    primary (the reason says which and why), "TLS" where its device has tls:."""
    if p.managed:
        return str(p.port)
    at = f"{p.host}:{p.port}"
    spare = bool(p.endpoints) and p.endpoints[0] != at
    return at + (" spare" if spare else "") + (" TLS" if p.tls else "")


def _log_tails(procs: list[ProcessStatus]) -> list[RenderableType]:
    parts: list[RenderableType] = []
    for p in procs:
        if p.log_tail:
            parts.append(Text(f"last lines of {p.name}'s log ({p.log}):"))
            parts.extend(Text(f"  {line}") for line in p.log_tail)
    return parts


def _router_restarts(r: RouterCounters) -> str:
    """The router line's tail: how often its acceptor restarted itself and how often hydra
    restarted the router (each only when it happened), and the CPUs its threads run on."""
    own = r.events.get("acceptor_restart", 0)
    return (f", acceptor restarted {own} times" if own else "") + \
        (f", router restarted by hydra {r.recoveries} times" if r.recoveries else "") + \
        (f"; its threads on CPU {r.cpus}" if r.cpus else "")


# -- a hydra that is not running: its last status.json -------------------------------------------

def print_summary(data: Mapping[str, object]) -> None:
    """The last run's summary view (status.json): its profile, state, reasons and processes."""
    lane = parse(LaneStatus, {**data, "name": "", "profile": str(data.get("profile") or "-"),
                              "processes": data.get("engines") or []})
    url = str(data.get("url") or "")
    for part in lane_renderables(lane, url):
        out.print(part)


def lane_renderables(lane: LaneStatus, url: str, router: RouterCounters | None = None,
                     down: str | None = None, lanes: tuple[LaneStatus, ...] | None = None
                     ) -> list[RenderableType]:
    """One profile on its port: what it runs, its processes, its load, the router line, why
    the port is down or the layout degraded or FATAL, its last switch, and a FATAL process's
    log lines. `lanes`: every lane of the port (its standby too), whose requests the router
    line adds up."""
    head = f" ({lane.mode}) at {url} — {lane.state}"
    if lane.standby:
        needs = ", ".join(f"{k} {v:,} MiB" for k, v in lane.needs_mib.items())
        head += f", active (plan {needs}; standby {lane.standby})"
    parts: list[RenderableType] = [Text.assemble(("profile ", ""), (lane.profile, "bold"),
                                                 head)]
    note = lane.error or (lane.why if lane.state == LaneState.STOPPED.value else None)
    if note:
        parts.append(Text(f"  {note}"))
    if lane.processes:
        parts.append(_process_table(list(lane.processes), warnings=True))
    parts += _load_line(lane)
    parts += _router_line(router, lanes if lanes is not None else (lane,), url)
    if down:
        parts.append(Text(f"PORT DOWN: {down}; hydra is restarting it", style="bold red"))
    if lane.degraded:
        parts.append(Text(lane.degraded, style="bold yellow"))
    if lane.fatal:
        parts.append(Text(f"FATAL: {lane.fatal}", style="bold red"))
    parts += _last_switch(lane.switches)
    parts += _log_tails(list(lane.processes))
    return parts


def _load_line(lane: LaneStatus) -> list[RenderableType]:
    """What the lane serves now, as hydra's router counts it (router/traffic.py)."""
    if not (lane.requests or lane.inflight or lane.queued):
        return []
    return [Text(f"load: {lane.inflight} in flight, {lane.queued} queued, "
                 f"{lane.tokens_per_s:g} tokens/s (last 5 s); {lane.generated_tokens:,} "
                 f"tokens generated, {lane.prompt_tokens:,} prompt tokens since start"
                 + (f", {lane.cut} cut" if lane.cut else ""))]


def _request_split(r: RouterCounters, lanes: tuple[LaneStatus, ...]) -> str:
    """The router's finished HTTP requests: those its profiles answered (each lane's
    `requests`, counted at the same moment) and those the router answered itself
    (/v1/models, unknown models, refusals before a profile was chosen, bad requests)."""
    total = r.http.get("requests", 0)
    routed = sum(x.requests for x in lanes)
    own = max(0, total - routed)
    return f"{total} HTTP requests ({routed} to profiles, {own} answered by the router)"


def _router_line(r: RouterCounters | None, lanes: tuple[LaneStatus, ...], url: str = ""
                 ) -> list[RenderableType]:
    """The port's router: its connections, and its finished HTTP requests split as in
    `_request_split` (with one lane, how many of them came in the last minute). A port that
    lends a device (`url` ggml-rpc://) serves no HTTP: its connections only."""
    if r is None:
        return []
    if url.startswith("ggml-rpc"):
        return [Text(f"router: {r.open} open, {r.accepted} accepted (ggml-RPC and Hydra "
                     f"frames: a port that lends serves no HTTP)" + _router_restarts(r))
                ] + _holder_line(r)
    last = lanes[0].requests_last_min if len(lanes) == 1 else None
    return [Text(f"router: {r.open} open, {r.held} held, {r.inflight} in flight; "
                 f"{r.accepted} accepted, {_request_split(r, lanes)}"
                 + (f", {last} to profiles in the last minute" if last is not None else "")
                 + f", {r.http.get('cut', 0)} cut, {r.http.get('retried', 0)} retried"
                 + _router_restarts(r))] + _holder_line(r)


def _holder_line(r: RouterCounters) -> list[RenderableType]:
    """On a host that lends its device: the head holding the rpc-server behind the router
    (address, its build when its hydra said it, for how long and since when on this host's
    clock, bytes each way), and how many other heads' connections the router refused."""
    h = r.rpc_holder
    if h is None:
        return []
    build = f" (build {h.build})" if h.build else " (build unknown: not announced)"
    since = time.strftime("%H:%M:%S", time.localtime(time.time() - h.held_s))
    kept = r.refused.get("rpc_held", 0)
    return [Text(f"lent to {h.addr}{build} for {_dur(h.held_s)} (since {since}); "
                 f"{_mib(h.bytes_up)} sent to the rpc-server, {_mib(h.bytes_down)} back"
                 + (f"; {kept} other head{'s' if kept != 1 else ''}' connection"
                    f"{'s' if kept != 1 else ''} refused since start (one head at a time)"
                    if kept else ""))]


def _dur(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else \
        f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# -- the last requests (`hydra status --requests`) -------------------------------------------

REQUEST_COLUMNS = ("time", "port", "profile", "client", "status", "TTFT",
                   "prompt/cached/gen", "prefill/decode t/s", "duration", "ended")


def requests_table(reqs: tuple[RequestStatus, ...]) -> Table:
    """The last requests through hydra's routers, oldest first, the running ones last."""
    table = Table(show_edge=False, pad_edge=False)
    for col in REQUEST_COLUMNS:
        table.add_column(col)
    for r in reqs:
        toks = "/".join("-" if n is None else str(n)
                        for n in (r.prompt_tokens, r.cached_tokens, r.generated_tokens))
        speed = "/".join("-" if v is None else f"{v:,.1f}" for v in (r.prefill_tps,
                                                                     r.decode_tps))
        table.add_row(time.strftime("%H:%M:%S", time.localtime(r.at)), str(r.port),
                      r.profile or "-", r.client, str(r.status or "-"),
                      f"{r.ttft_s:.3f}s" if r.ttft_s is not None else "-",
                      "-" if toks == "-/-/-" else toks, "-" if speed == "-/-" else speed,
                      f"{r.duration_s:.2f}s", r.ended)
    return table


def _last_switch(switches: tuple[SwitchStatus, ...]) -> list[RenderableType]:
    if not switches:
        return []
    last = switches[-1]
    return [Text(f"last switch: {last.frm} -> {last.to} {last.result} in {last.total_s:.2f}s"
                 + (f" ({last.error})" if last.error else ""))]


def _fmt_mem(p: ProcessStatus) -> str:
    """Host resident memory, plus GPU memory where NVML reports the process."""
    parts = []
    if p.rss_bytes:
        parts.append(f"{p.rss_bytes / 2**20:,.0f} MiB")
    if p.gpu_bytes:
        parts.append(f"GPU {p.gpu_bytes / 2**20:,.0f} MiB")
    return " + ".join(parts) or "-"


def _fmt_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def remote_load_text(rl: RemoteLoad | None) -> str:
    """A head loading onto remote peers: how much of their weights it has sent, as the peer
    hosts' routers count it (proc/sentwatch.py, serve/progress.py); unknown said as such."""
    if rl is None or not rl.remote_bytes:
        return ""
    sent, total = rl.sent_bytes, rl.remote_bytes
    if sent is None:
        return (f"; sent ? of {total / 2**20:,.0f} MiB to remote peers (progress unknown: "
                "no count from a peer host's router)")
    return (f"; sent {sent / 2**20:,.0f} of {total / 2**20:,.0f} MiB to remote peers "
            f"({sent / total:.0%}; a warm peer cache sends less)")
