"""The client commands of a running hydra: status, switch, load, unload, restart, reload, down
(its control API) and logs (its state dir). None imports the daemon: they must start fast.
An action's reply says what happened in its `message` (runtime/messages.py builds it in the
daemon); the commands print it, then the details (phases, notes, log tails)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hydra_supervisor.cli.shared import control_socket, dir_opt, err, friendly, out
from hydra_supervisor.cli.status_view import (
    daemon_renderables,
    ports_down,
    print_summary,
    requests_table,
    serving_now,
    snapshot_of,
    status_group,
)
from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime import control_client, exits


def _control(route: str, body: dict[str, Any] | None = None, method: str = "POST",
             timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
    """One call to the running hydra's control API; exit 3 when none runs here."""
    state = StateDir.default()
    try:
        return control_client.call(control_socket(state), method, route, body, timeout=timeout)
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
@click.command()
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
    _act("/switch", body, as_json, _print_report)


def _act(path: str, body: dict[str, Any], as_json: bool,
         show: Callable[[dict[str, Any]], None]) -> None:
    """One action through the control API: its reply as JSON, or shown (`show`) after a
    refusal is said; exits with the reply's status (docs/control.md)."""
    code, reply = _control(path, body)
    if as_json:
        click.echo(json.dumps(reply, indent=2))
        sys.exit(exits.of_reply(code, reply.get("result")))
    _fail_reply(code, reply)
    show(reply)
    sys.exit(exits.of_reply(code, reply.get("result")))


def _print_message(rep: dict[str, Any]) -> None:
    out.print(str(rep.get("message", "")), markup=False)


def _print_report(rep: dict[str, Any]) -> None:
    """A switch's or load's reply: its message (what happened, what was stopped and why),
    then its phases, notes and the failing run's log tail."""
    phases = "  ".join(f"{k} {v:.2f}s" for k, v in rep.get("phases", {}).items())
    result = rep.get("result")
    (out if result in ("ok", "noop") else err).print(str(rep.get("message", "")),
                                                     markup=False)
    if result == "noop":
        for key in rep.get("not_applied") or []:
            err.print(f"  not applied: {key}", markup=False)
        return
    for line in rep.get("log_tail") or []:
        err.print(f"  {line}", markup=False)
    out.print(f"  phases: {phases}", markup=False)
    for note in rep.get("notes") or []:
        out.print(f"  note: {note}", markup=False)


@click.command()
@click.argument("profile")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def load(profile: str, as_json: bool) -> None:
    """Load PROFILE beside what serves (one of this hydra's profiles).

    Only what does not fit beside it stops: the least recently used first, drained (as a
    load on request does); the reply says what stopped and why. Serving already: nothing to
    do. A load that fails exits 1."""
    _act("/load", {"profile": profile}, as_json, _print_report)


@click.command()
@click.argument("profile", required=False)
@click.option("--all", "every", is_flag=True, help="unload every loaded profile")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def unload(profile: str | None, every: bool, as_json: bool) -> None:
    """Unload PROFILE (or --all): hold, drain (bounded, as a switch), cut what is left, stop.

    It stays routable: the next request for it loads it again (`on_demand: false`: only
    `hydra load` or `hydra switch` does). Not loaded: nothing to do."""
    if every == bool(profile):
        raise HydraError("hydra unload takes a profile name or --all (not both)",
                         hint="hydra unload demo, or hydra unload --all")
    _act("/unload", {"all": True} if every else {"profile": profile}, as_json, _print_message)


@click.command()
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
    out.print(str(reply.get("message", "")), markup=False)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def reload(as_json: bool) -> None:
    """Re-read every running profile and apply what changed (unchanged: nothing).

    A serving profile restarts what changed (its head alone, or everything); a change that
    fails rolls back and says why; a stopped profile takes the new settings at its next
    load."""
    code, reply = _control("/reload")
    if as_json:
        click.echo(json.dumps(reply, indent=2))
        sys.exit(exits.of_reply(code, reply.get("result")))
    _fail_reply(code, reply)
    (out if reply.get("result") in ("ok", "noop") else err).print(
        str(reply.get("message", "")), markup=False)
    for line in reply.get("log_tail") or []:
        err.print(f"  {line}", markup=False)
    phases = "  ".join(f"{k} {v:.2f}s" for k, v in (reply.get("phases") or {}).items())
    if phases:
        out.print(f"  phases: {phases}", markup=False)
    sys.exit(exits.of_reply(code, reply.get("result")))


# --------------------------------------------------------------------------------------------
@click.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", "-w", is_flag=True, help="refresh every second until Ctrl-C")
@click.option("--requests", "show_requests", is_flag=True,
              help="the last requests through hydra's routers (with --json: as JSON)")
@friendly
def status(as_json: bool, watch: bool, show_requests: bool) -> None:
    """Show what the running hydra serves (live, from its control API).

    `--requests`: the last requests (256 finished, then those running): when, port,
    profile, client, status, time to first token, prompt/cached/generated tokens, prefill and
    decode speed, duration, how each ended. Nothing of a prompt or reply is kept.

    Exit status (docs/control.md): 0; 1 a port is down (its router accepts no connections);
    3 no hydra runs here."""
    state = StateDir.default()
    try:
        code, live = control_client.call(control_socket(state), "GET", "/status", timeout=10)
    except (control_client.NotRunning, OSError):
        live = None
    if show_requests and live is not None and not watch:
        snap = snapshot_of(live)
        reqs = snap.requests
        if as_json:  # the snapshot's `requests` (docs/control.md)
            click.echo(json.dumps(snap.to_json()["requests"], indent=2))
        elif reqs:
            out.print(requests_table(reqs))
        else:
            out.print("no request has come through hydra's routers yet", markup=False)
        return
    if as_json:
        if live is None:
            click.echo(json.dumps({"running": False, "supervisor": state.running_supervisor(),
                                   "status": state.read_status_checked(),
                                   "abnormal_end": state.abnormal_end()}, indent=2))
            sys.exit(exits.NOT_RUNNING)
        click.echo(json.dumps(live, indent=2))
        sys.exit(exits.PORT_DOWN if ports_down(snapshot_of(live)) else 0)
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
            print_summary(data)
        sys.exit(exits.NOT_RUNNING)
    if not watch:
        snap = snapshot_of(live)
        for part in daemon_renderables(snap):
            out.print(part)
        sys.exit(exits.PORT_DOWN if ports_down(snap) else 0)
    from rich.live import Live

    try:
        with Live(console=out, refresh_per_second=2) as view:
            while True:
                try:
                    _, live = control_client.call(control_socket(state), "GET", "/status",
                                                  timeout=10)
                except (control_client.NotRunning, OSError):
                    view.update(f"hydra is not running here (state dir {state.root})")
                    sys.exit(exits.NOT_RUNNING)
                snap = snapshot_of(live)
                view.update(requests_table(snap.requests) if show_requests
                            else status_group(snap))
                time.sleep(1.0)
    except KeyboardInterrupt:
        sys.exit(exits.OK)  # Ctrl-C is how a watch ends: the last view stays, no "Aborted!"


# --------------------------------------------------------------------------------------------
@click.command()
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
        _, live = control_client.call(control_socket(state), "GET", "/status", timeout=5)
        what = serving_now(live.get("status") or {}) or what
        control_client.call(control_socket(state), "POST", "/down", timeout=5)
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
@click.command()
@click.argument("engine")
@click.option("-n", "lines", default=50, show_default=True, help="lines to show")
@click.option("-f", "follow", is_flag=True, help="keep printing new lines")
@click.option("--raw", is_flag=True,
              help="the lines as written (llama.cpp's times then count from each run's start)")
@friendly
def logs(engine: str, lines: int, follow: bool, raw: bool) -> None:
    """Show a log of the running hydra: a process's (demo.head, or head when one profile has
    one, peer-NAME) or hydra's own (`hydra`), llama.cpp's times as wall-clock times. Each run
    of a process opens with hydra's `--- hydra: NAME started TIME pid N ---` line; -f follows
    the log across size rotations and restarts (as tail -F does), a new run showing as that
    line. With no hydra running, the last run's logs, said to be of a stopped run."""
    from hydra_supervisor.proc import logfiles

    state = StateDir.default()
    sup = state.running_supervisor()
    last = (state.read_status() or {}).get("pid")
    # no hydra runs: the logs of the last one (status.json names it), else every log there is
    pid = int(sup["pid"]) if sup else last if isinstance(last, int) else None
    found = logfiles.current_logs(state.logs, pid, _named_logs(state, pid),
                                  fallback=logfiles.fallback_dir(state.root))
    where = (f"of the running hydra (pid {pid})" if sup else
             f"of the last hydra here (pid {pid}, stopped)" if pid else f"in {state.logs}")
    name, path = logfiles.pick(engine, found, where)
    if not path.exists():
        raise HydraError(f"{name} has written no log yet ({path})")
    if sup is None:
        run = logfiles.run_of(path)
        err.print(f"note: hydra is not running here (state dir {state.root}): this is {name}'s "
                  "log of a stopped run" + (
                      f" (its last run started {run.at.astimezone():%Y-%m-%d %H:%M:%S})"
                      if run else ""), markup=False)
    shown, mark = logfiles.tail_at(path, lines)
    # the lines shown before a run's marker are of the run before it (in NAME.log.1)
    marked = any(logfiles.RunMark.parse(line) for line in shown)
    stamper = logfiles.Stamper(logfiles.run_of(path, start=1 if marked else 0))
    fix = (lambda line: line) if raw else stamper.line
    sys.stdout.writelines(fix(line) + "\n" for line in shown)
    sys.stdout.flush()
    if follow:
        for line in logfiles.follow(path, start=mark):
            sys.stdout.write(fix(line))
            sys.stdout.flush()


def _named_logs(state: StateDir, pid: int | None) -> dict[str, Path]:
    """The log each process status.json names writes (the fallback in the temp dir when
    logs/ was not writable), when status.json is the hydra `pid`'s."""
    st = state.read_status() or {}
    if st.get("pid") != pid:
        return {}
    rows = st.get("engines")
    return {str(r["name"]): Path(str(r["log"])) for r in (rows if isinstance(rows, list) else [])
            if isinstance(r, dict) and r.get("name") and r.get("log")}
