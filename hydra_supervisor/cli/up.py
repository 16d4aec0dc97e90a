"""`hydra up`: start one profile, several or none under one Daemon (state dir locked, orphan
guard up, hydra's own log), and what it prints in its terminal: progress while starting, how
to use it once ready, then one line per lifecycle event (`EventPrinter`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click
from rich.text import Text

from hydra_supervisor.cli import running
from hydra_supervisor.cli.clickutil import PORT_OR_OFF, PORT_OR_PICK
from hydra_supervisor.cli.shared import dir_opt, err, friendly, node_opt, out, port_overrides
from hydra_supervisor.runtime import exits

if TYPE_CHECKING:
    import asyncio

    from hydra_supervisor.config import config
    from hydra_supervisor.plan import deployment
    from hydra_supervisor.proc import guard
    from hydra_supervisor.runtime import daemon
    from hydra_supervisor.serve import setup as serve_setup
    from hydra_supervisor.serve.lane import Lane
    from hydra_supervisor.serve.port import Port
else:
    # Imported on first use: a client command (`hydra --version`, `hydra status`) must not pay
    # for the daemon's imports (prometheus, gguf/numpy, requests): ~0.7 s on a small machine.
    from hydra_supervisor.cli.lazy import lazy_module

    asyncio = lazy_module("asyncio")
    config = lazy_module("hydra_supervisor.config.config")
    daemon = lazy_module("hydra_supervisor.runtime.daemon")
    deployment = lazy_module("hydra_supervisor.plan.deployment")
    guard = lazy_module("hydra_supervisor.proc.guard")
    serve_setup = lazy_module("hydra_supervisor.serve.setup")
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import client_host, host_port, port_free, port_holder
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve import states
from hydra_supervisor.serve.events import SAID, Event, Kind
from hydra_supervisor.serve.states import LaneState


@click.command()
@click.option("--profile", "-p", "profiles", multiple=True,
              help="profile name (see `hydra profiles`) or path to a .yaml [default: demo, or "
                   "the node file's profiles:]; give several to serve them together, routed "
                   "by the request's model")
@click.option("--no-profile", "idle", is_flag=True,
              help="start with no layout loaded (ready at once; `hydra switch NAME` loads one)")
@node_opt
@dir_opt
@click.option("--port", type=PORT_OR_PICK, default=None,
              help="external port (overrides the profile; 0: the kernel picks one)")
@click.option("--host", default=None, help="bind address (overrides the profile)")
@click.option("-v", "--verbose", is_flag=True, help="log every state change to stderr")
@click.option("-q", "--quiet", is_flag=True,
              help="after `ready:`, print only errors (no line per process restart, load, "
                   "unload, switch)")
@click.option("--metrics-port", type=PORT_OR_OFF, default=None, envvar="HYDRA_METRICS_PORT",
              help="serve Prometheus metrics and the dashboard on 127.0.0.1:PORT "
                   "(default, or 0: off)")
@friendly
def up(profiles: tuple[str, ...], idle: bool, node_file: str | None, profiles_dir: str | None,
       port: int | None, host: str | None, verbose: bool, quiet: bool,
       metrics_port: int | None) -> None:
    """Start a profile's processes and keep them serving until Ctrl-C / SIGTERM.

    With several profiles (-p A -p B, or the node file's profiles:) one port serves them all,
    routed by the request's model and loaded on demand (docs/routing.md).

    Once ready it prints one line per lifecycle event (a process died or restarted, a profile
    loaded, unloaded or switched, the standby ready, a reload done, a failure); -q keeps only
    the failures.

    Exit status (docs/control.md): 0 stopped on request (and only then), 1 FATAL (one
    profile; among several, a failed profile is marked failed and the others keep serving) or
    any other end nobody asked for, 2 bad input or another hydra holds the state dir, 4
    stopped but a child could not be killed, 130 interrupted before serving or by a second
    Ctrl-C.
    """
    if idle and profiles:
        raise HydraError("--no-profile and --profile exclude each other")
    if host is not None:
        _check_host(host)
    if metrics_port and metrics_port == port:
        raise HydraError(f"--metrics-port {metrics_port} is also --port: metrics need a port "
                         "of their own", hint="pick another port: --metrics-port N")
    node = config.load_node(config.find_node_file(node_file))
    if not profiles and not idle:
        profiles = node.profiles
    state = StateDir.default()
    tightened = state.secure(_file_policy(node))
    printer = EventPrinter(quiet=quiet)
    _setup_logging(state, verbose, printer)
    if tightened:
        logging.getLogger("hydra").warning(
            "state dir %s: tightened %d path(s) that were looser than hydra's policy "
            "(docs/operations.md): %s%s", state.root, len(tightened), "; ".join(tightened[:5]),
            " ..." if len(tightened) > 5 else "")
    _refuse_if_running(state)  # before the lock: its own message names only the start-up
    try:
        with state.lock():
            code = _up_locked(state, [] if idle else list(profiles or ("demo",)), node_file,
                              profiles_dir, port, host, metrics_port, printer)
    except KeyboardInterrupt:
        logging.getLogger("hydra").warning("stopped: interrupted (Ctrl-C) before serving")
        err.print("interrupted before serving; nothing left running", markup=False)
        code = exits.INTERRUPTED
    sys.exit(code)


def _preflight(state: StateDir) -> None:
    """One hydra per state dir; children a killed hydra left behind are stopped first."""
    _refuse_if_running(state)
    dead = state.clear_abnormal_end()
    if dead:
        logging.getLogger("hydra").warning("the last run %s; its last state was %s",
                                           state.abnormal_text(dead), dead.get("last_state"))
    stale = state.kill_stale()
    if stale:
        err.print(f"stopped stale children of an earlier hydra: {', '.join(stale)}",
                  markup=False)


def _refuse_if_running(state: StateDir) -> None:
    """Another hydra runs on this state dir: say what it serves now (after a switch, not the
    profile it started with: its snapshot) and where; one still starting has no control
    socket yet: what it starts."""
    sup = state.running_supervisor()
    if sup:
        snap = running.snapshot(state, timeout=5)
        what = (f"serving {running.serving_words(snap)} at "
                f"{', '.join(p.url for p in snap.ports) or 'no port'}" if snap is not None
                else f"starting profile '{sup['profile']}'")
        raise HydraError(f"hydra is already running here (pid {sup['pid']}, {what}; state dir "
                         f"{state.root})",
                         hint="`hydra down` first, `hydra switch PROFILE` to change its layout, "
                              "or set HYDRA_STATE_DIR for a second hydra")


def _check_host(host: str) -> None:
    """--host is an address of this host: a name that does not resolve, or an address no
    interface has, is refused before anything starts (not reported as a port in use)."""
    import socket

    if host in ("", "*"):
        return
    fix = "an address of this host: 127.0.0.1, 0.0.0.0 (every interface), or one `ip addr` lists"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise HydraError(f"--host {host}: the name does not resolve "
                         f"({getattr(exc, 'strerror', None) or exc})", hint=fix) from None
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr[0], 0))
        except OSError as exc:
            raise HydraError(f"--host {host}: hydra cannot listen there "
                             f"({exc.strerror or exc})", hint=fix) from None


def _check_metrics_free(port: int) -> None:
    """The metrics port is free before anything starts, with the main port's message."""
    if not port_free("127.0.0.1", port):
        raise HydraError(f"port {port} on 127.0.0.1 (--metrics-port) is already in use by "
                         f"{port_holder(port)}",
                         hint="stop that process, or pick another port: --metrics-port N")


def _guarded(state: StateDir, name: str, source: str, run: Callable[[], int]) -> int:
    """Run the daemon with its supervisor record written and the orphan guard up: the guard
    stops every recorded child group the moment this process dies, kill -9 included."""
    state.write_supervisor(name, source)
    keeper = guard.start(state.root)
    try:
        return run()
    finally:
        state.clear_supervisor()
        if keeper.stdin is not None:
            keeper.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            keeper.wait(5)


def _up_locked(state: StateDir, names: list[str], node_file: str | None,
               profiles_dir: str | None, port: int | None, host: str | None,
               metrics_port: int | None, printer: EventPrinter) -> int:
    """One profile, none (`names` empty) or several: the ports and the node serve_setup
    builds, run by one Daemon."""
    _preflight(state)
    if metrics_port:
        _check_metrics_free(metrics_port)
    overrides = port_overrides(port, host)
    opts = daemon.Options(profile=names[0] if len(names) == 1 else None, node_file=node_file,
                          profiles_dir=profiles_dir, overrides=overrides,
                          host=host or "127.0.0.1", port=8080 if port is None else port,
                          metrics_port=metrics_port, profiles=names if len(names) > 1 else [])
    ports, node = serve_setup.build(
        state, names, node_file=node_file, profiles_dir=profiles_dir, overrides=overrides,
        host=opts.host, port=opts.port,
        profiles=lambda: list(config.known_profiles(profiles_dir)))
    if metrics_port and metrics_port in {p.port for p in ports}:
        raise HydraError(f"--metrics-port {metrics_port} is a profile's external port: metrics "
                         "need a port of their own", hint="pick another port: --metrics-port N")
    sources = [d.plan.source for p in ports for d in p.planned()]
    source = sources[0] if len(sources) == 1 else "-"
    return _guarded(state, ",".join(names) or "-", source,
                    lambda: asyncio.run(_run_daemon(state, opts, ports, node, printer)))


async def _run_daemon(state: StateDir, opts: daemon.Options, ports: Any, node: Any,
                      printer: EventPrinter) -> int:
    d = daemon.Daemon(state, opts, ports, node)
    d.sinks.append(printer)

    async def present(d: daemon.Daemon) -> None:
        await _present(d)
        printer.live = True  # (no await since the last line: no event falls in between)

    code = await d.run(on_start=present)
    if d.unkillable:
        err.print(f"stopped, but could not kill: {'; '.join(d.unkillable)}", markup=False)
        return exits.UNKILLABLE
    if code == exits.FAILED:
        err.print(f"FATAL: {d.stop_reason.removeprefix('FATAL: ')}", markup=False)
        for _, _, proc in d.take().processes():
            if proc.log_tail:
                err.print(f"last lines of {proc.log}:", markup=False)
                for line in proc.log_tail:
                    err.print(f"  {line}", markup=False)
    return code


async def _present(d: daemon.Daemon) -> None:
    """What `hydra up` shows in its terminal: per port, progress while its default profile
    loads, then how to use it."""
    for p in d.ports:
        await _present_port(p)
    _present_dashboard(d)


def _present_dashboard(d: daemon.Daemon) -> None:
    """The dashboard's address, when --metrics-port serves it (docs/dashboard.md)."""
    if d.metrics is not None and d.dashboard is not None:
        out.print(f"  dashboard: http://127.0.0.1:{d.metrics.port}/ (this host only)",
                  markup=False)


async def _present_port(p: Port) -> None:
    lane = p.default_lane()
    if lane is None:
        out.print(f"ready: hydra at {p.url} with no profile loaded; load one with "
                  f"`hydra switch NAME` (profiles: {', '.join(p.profiles())})", markup=False)
        return
    await _spinner(lane)
    while not p.ready():
        await asyncio.sleep(0.2)
    if p.only() is lane:
        _present_one(p, lane)
        return
    rows = [f"{x.name}{'*' if x.name == p.default else ''} ({p.state_of(x)})"
            for x in p.lanes.values()]
    out.print(f"ready: {p.url} serves {', '.join(rows)}; the request's model picks the "
              "profile (* = the default)", markup=False)
    for x in p.lanes.values():
        if x.error:
            err.print(f"  {x.name} failed to load: {x.error} (`hydra logs "
                      f"{x.name}.head`; the next request for it tries again)", markup=False)
    m = next((x for x in p.lanes.values() if not x.error), lane)
    out.print(f"  curl {p.url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\":\"{m.name}\",\"messages\":[{{\"role\":\"user\","
              "\"content\":\"Hello\"}]}'", markup=False)
    out.print(f"  curl {p.url}/v1/models", markup=False)


async def _spinner(lane: Lane) -> None:
    """Progress while `lane` loads (its processes one by one, the model's bar)."""
    lay = lane.dep.layout
    model_bytes = lay.model.file_size if lay is not None and lay.model is not None else 0
    plan = lane.dep.plan
    what = ", ".join(f"{e.name} on {e.device}" for e in plan.in_start_order())
    # A status string is always read as markup; a reason such as "RPC0[127.0.0.1:30052]" is not.
    with err.status(Text(f"starting {plan.profile}: {what}"), spinner="dots") as spin:
        while lane.state_now() in (LaneState.STOPPED, LaneState.LOADING) \
                and lane.error is None:
            sup = lane.sup
            cur = next((x for x in sup.procs if x.state.value != "READY"), None) \
                if sup is not None else None
            if cur is not None:
                bar = _load_bar(cur.pid, model_bytes) if cur.spec.role.value == "head" else ""
                spin.update(Text(f"{plan.profile}: {cur.name} {cur.state.value} — "
                                 f"{cur.reason or 'starting'} {bar}"
                                 f"({time.monotonic() - cur.since:.0f}s)"))
            await asyncio.sleep(0.2)


def _present_one(p: Port, lane: Lane) -> None:
    """A port with one profile: how to use it."""
    if p.state_of(lane) not in states.ANSWERING:
        return
    plan = lane.dep.plan
    if plan.router and not plan.router.http:
        r = plan.router
        tls = ", TLS only" if r.tls is not None else ""
        out.print(f"ready: {plan.profile} serves {plan.engines[0].device} over ggml-RPC at "
                  f"{host_port(p.host, p.port)} (from {', '.join(r.allow)}{tls})")
        if r.tls is not None:
            out.print(f"  on the head's host, a node file device: {{endpoint: HOST:{p.port}, "
                      "tls: {ca: CA, cert: HEAD-CERT, key: HEAD-KEY}}")
            return
        out.print(f"  on the head's host: llama-server -m MODEL --rpc "
                  f"{host_port(client_host(p.host), p.port)} ...   "
                  f"(or a node file device: {{endpoint: HOST:{p.port}}})")
        return
    url = p.url
    out.print(f"ready: {plan.profile} serving {lane.dep.model_label} at {url}", markup=False)
    out.print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'", markup=False)
    out.print("  (Ctrl-C stops it; `hydra status`, `hydra switch PROFILE`, `hydra down` from "
              "another terminal)", markup=False)
    sb = p.standby.wanted() if p.standby is not None else None
    if p.standby is not None and sb:
        if p.standby.ready():
            out.print(f"  standby {sb}: ready beside it (`hydra switch {sb}` is instant, no "
                      "restart)", markup=False)
        elif p.standby.why:
            out.print(f"  standby {sb}: {p.standby.why}", markup=False)
        else:  # an event line says when it is ready, or why not
            out.print(f"  standby {sb}: loading beside it when both fit (`hydra switch {sb}` "
                      "is then instant, no restart)", markup=False)


def _load_bar(pid: int | None, model_bytes: int, width: int = 20) -> str:
    """How much of the model file the loading head has mapped in (its resident memory against
    the file's size; llama.cpp mmaps the GGUF, so pages it read count there), as a text bar."""
    if not pid or model_bytes <= 0:
        return ""
    import psutil

    try:
        rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:  # a process that just exited shows no bar
        return ""
    frac = min(rss / model_bytes, 1.0)
    done = int(frac * width)
    return (f"[{'#' * done}{'.' * (width - done)}] {frac:4.0%} of "
            f"{model_bytes / 2**20:,.0f} MiB ")


def _file_policy(node: Any) -> Any:
    """Modes and child-log bounds from the node file (filemodes.py, logfiles.py)."""
    import grp

    from hydra_supervisor.proc import filemodes

    gid = grp.getgrnam(node.state_group).gr_gid if node.state_group else None
    return filemodes.Policy(group=gid, group_name=node.state_group,
                            log_max_bytes=int(node.log_max_mib * filemodes.MIB),
                            log_keep=node.log_keep)


def _setup_logging(state: StateDir, verbose: bool, printer: EventPrinter) -> None:
    """hydra's own log: every state change once, with its reason, in logs/hydra.log; on
    stderr its warnings (-v: everything), less what an event line already says."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    root = logging.getLogger("hydra")
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    console.setFormatter(fmt)
    if not verbose:
        console.addFilter(printer.unsaid)
    root.addHandler(console)
    from hydra_supervisor.proc.logfiles import OwnLog

    try:
        handler = OwnLog(state.log_path("hydra"))
    except OSError as exc:
        err.print(f"warning: cannot write {state.log_path('hydra')}: {exc.strerror}",
                  markup=False)
        return
    handler.setFormatter(fmt)
    root.addHandler(handler)



# -- after `ready:`: one line per lifecycle event --------------------------------------------


def event_line(ev: Event) -> str:
    """One short line for a lifecycle event (serve/events.py), with its local time."""
    at = dt.datetime.fromtimestamp(ev.at).strftime("%H:%M:%S")
    what = " ".join(ev.detail.split())  # one line, whatever llama.cpp's error held
    took = f"{ev.seconds:.1f}s" if ev.seconds is not None else ""
    k, who = ev.kind, ev.subject
    if k is Kind.DIED:
        text = f"{who} died: {what}"
    elif k in (Kind.STOPPED, Kind.UNHEALTHY):
        text = f"{who} {k.value}: {what}"
    elif k is Kind.RESTARTED:
        text = f"{who} restarted{f' ({what})' if what else ''}, ready again after {took}"
    elif k is Kind.HEALTHY:
        text = f"{who} healthy again after {took}"
    elif k is Kind.LOADED:
        how = "on demand" if what == "on request" else f"({what})"
        text = f"{who} loaded {how} in {took}"
    elif k is Kind.LOAD_FAILED:
        text = f"{who} failed to load: {what}"
    elif k is Kind.UNLOADED:
        text = f"{who} unloaded: {what}"
    elif k is Kind.SWITCHED:
        text = (f"{who} changed in {took}" if ev.frm == who else
                f"switched {ev.frm or 'nothing'} -> {who} in {took}") + (
                    f" ({what})" if what else "")
    elif k is Kind.SWITCH_FAILED:
        text = (f"change of {who}" if ev.frm == who else
                f"switch {ev.frm or 'nothing'} -> {who}") + f" failed after {took}: {what}"
    elif k is Kind.STANDBY_READY:
        text = f"standby {who} ready {what}"
    elif k is Kind.STANDBY_FAILED:
        text = f"standby {who} {what}"
    elif k is Kind.RELOADED:
        text = f"reload done: {what}"
    elif k is Kind.RELOAD_FAILED:
        text = f"reload failed: {what}"
    else:  # Kind.FATAL
        text = f"{who} FATAL: {what}"
    return f"{at} {text}"


def _print_out(line: str) -> None:
    out.print(line, markup=False)


def _print_err(line: str) -> None:
    err.print(line, markup=False)


@dataclass
class EventPrinter:
    """`hydra up`'s terminal after `ready:`: one line per lifecycle event, on stdout (errors
    on stderr). Before `live` (the start-up: its spinner and `ready:` say it) nothing;
    `quiet` (-q): errors only. A log record an event line says again (events.SAID) is left
    off the terminal while it prints them (`unsaid`, the console handler's filter)."""

    quiet: bool = False
    live: bool = False
    write_out: Callable[[str], None] = field(default=_print_out)
    write_err: Callable[[str], None] = field(default=_print_err)

    def __call__(self, ev: Event) -> None:
        if not self.live or (self.quiet and not ev.error):
            return
        (self.write_err if ev.error else self.write_out)(event_line(ev))

    def unsaid(self, record: logging.LogRecord) -> bool:
        return not (self.live and getattr(record, next(iter(SAID)), False))
