"""`hydra plan` and `hydra profiles`: what a profile resolves to (processes, bytes per device,
its standby), without starting anything."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any, cast

import click

from hydra_supervisor.cli.shared import (
    dir_opt,
    friendly,
    node_opt,
    out,
    port_overrides,
    profile_opt,
    styled,
)

if TYPE_CHECKING:
    from hydra_supervisor.plan import catalog, deployment, layout
    from hydra_supervisor.plan.devices import Device
    from hydra_supervisor.plan.plan import Plan
else:
    # Imported on first use (cli.py: client commands stay fast).
    from hydra_supervisor.cli.lazy import lazy_module

    catalog = lazy_module("hydra_supervisor.plan.catalog")
    deployment = lazy_module("hydra_supervisor.plan.deployment")
    layout = lazy_module("hydra_supervisor.plan.layout")
from hydra_supervisor.cli.clickutil import PORT_OR_PICK
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import host_port


@click.command()
@profile_opt
@node_opt
@dir_opt
@click.option("--port", type=PORT_OR_PICK, default=None,
              help="external port (overrides the profile)")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@friendly
def plan(profile: str, node_file: str | None, profiles_dir: str | None, port: int | None,
         as_json: bool) -> None:
    """Print the processes a profile resolves to, without starting anything: each one's
    command line exactly as `hydra up` would run it (its binary, hydra's state dir)."""
    lay = layout.build(profile, node_file=node_file, profiles_dir=profiles_dir,
                       overrides=port_overrides(port, None), check_ports=False)
    p = runs(lay)
    bins = _binaries(lay)
    ext = lay.external  # the profile's host and port (--port overrides it); not in the plan
    both = _standby_plan(lay, node_file, profiles_dir, port)
    if as_json:
        click.echo(json.dumps({**plan_json(lay, p, bins),
                               **({"standby": both} if both else {})}, indent=2))
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
        transport = f", transport {p.transport}" if p.mode == "combine" else ""
        out.print(f"  mode {p.mode} ({p.model_kind}){transport}, "
                  f"ctx {p.meta.get('ctx')}, devices from {lay.inventory.source}")
    for pl in p.placements:
        free = _free_text(pl.free_bytes, lay.devices.get(pl.device))
        out.print(f"  {pl.device}: {pl.what}, weights {pl.weight_bytes / 2**20:,.0f}"
                  f" MiB + KV {pl.kv_bytes / 2**20:,.0f} + buffers "
                  f"{pl.overhead_bytes / 2**20:,.0f} = {pl.need_bytes / 2**20:,.0f} MiB ({free})")
    for dev, eps in _with_spares(lay):
        out.print(f"  {dev}: planned on its endpoint {eps[0]}; spares "
                  f"{', '.join(eps[1:])} (not probed here: `hydra up` plans on the first "
                  "of them that answers HELLO, runs this build and fits; `hydra doctor --peers`"
                  " checks each)", markup=False)
    for e in p.in_start_order():
        where = "remote, not started by hydra" if not e.managed else f"on {e.device}"
        if e.tls is not None:
            where += "; over TLS (the head's --rpc goes through a local tunnel)"
        out.print(styled((f"{e.start_order}. {e.name}", "bold"),
                         f" ({e.role.value}, {where}) listens {e.endpoint}"))
        if e.managed:
            env = " ".join(f"{k}={v}" for k, v in e.env)
            argv = " ".join(shlex.quote(a) for a in e.argv(bins.get(e.program, e.program)))
            out.print(f"   {env} {argv}", soft_wrap=True)
            if e.program not in bins:
                out.print(f"   ({e.program} is not found on this host: hydra up would stop "
                          "here)", markup=False)
    if p.router:
        r = p.router
        tls = ", TLS only" if r.tls is not None else ""
        rpc = (f", ggml-RPC -> {host_port(*r.rpc)} (from {', '.join(r.allow)}{tls})"
               if r.rpc else "")
        http = f"HTTP -> {host_port(*r.http)}" if r.http else "HTTP -> 503 (no head)"
        out.print(styled(("router", "bold"),
                         f" listens {host_port(ext.host, ext.port)}: {http}{rpc}"))
    for note in p.notes:
        out.print(f"  note: {note}")
    for path in lay.flags.checked:
        out.print(f"  flags checked against `{path} --help`", markup=False)
    for why in lay.flags.skipped:
        out.print(f"  flags not checked: {why}", markup=False)
    if both:
        _print_standby_plan(both)


def runs(lay: layout.Layout) -> Plan:
    """The plan as `hydra up` would run it: with the state dir's slot dir (not made here)."""
    from hydra_supervisor.proc.state import StateDir

    return deployment.final_plan(lay, StateDir.default().slots(make=False))


def _binaries(lay: layout.Layout) -> dict[str, str]:
    """The path each program of the plan runs from (hydra up's lookup); a missing one is
    left out (and said)."""
    from hydra_supervisor.tools import binaries

    found: dict[str, str] = {}
    for e in lay.plan.engines:
        if e.managed and e.program not in found:
            try:
                found[e.program] = str(binaries.find(e.program, dict(lay.node.binaries)).path)
            except HydraError:
                pass
    return found


def _free_text(usable: int, dev: Device | None) -> str:
    """What `hydra plan` says of a device's room: usable MiB, and for a remote device where
    the number comes from (its peer host's INFO, else the node file's memory_mib)."""
    remote = dev is not None and dev.endpoint is not None
    if not usable:
        return ("free unknown: its peer host does not report it (not a hydra host, or not "
                "reachable now); set memory_mib in the node file") if remote else "free unknown"
    text = f"{usable / 2**20:,.0f} MiB usable"
    if dev is not None and remote and dev.reported:
        return (f"{text}: its peer host reports {dev.free / 2**20:,.0f} MiB free of "
                f"{dev.total / 2**20:,.0f}")
    return f"{text}: the node file's memory_mib" if remote else text


def plan_json(lay: layout.Layout, plan: Plan | None = None,
              bins: dict[str, str] | None = None) -> dict[str, object]:
    """`hydra plan --json`: the plan (`plan`, default the layout's), with the external address
    it was planned for (the profile's host and port, or --port) as `host`/`port` and in
    `router` beside what the router relays to; a plan carries no external address of its own.
    Each managed engine's `argv` is its command line as it runs (`bins`: the binaries' paths;
    `binary` null and the program's name first where it is not found); `flag_check` says
    which binaries' --help the command lines were checked against, or why not. Each placement's
    `free_reported`: its free memory is what a remote peer's host reported (Hydra INFO).
    `spares`: the remote devices with spares, planned on their own endpoint (spares_json)."""
    ext = lay.external
    plan = plan or lay.plan
    bins = bins or {}
    out: dict[str, object] = {}
    for key, value in plan.to_json().items():
        if key == "engines":  # (where the plan's JSON said them before the engines)
            out.update(host=ext.host, port=ext.port)
            value = [{**eng, "binary": bins.get(e.program) if e.managed else None,
                      "argv": e.argv(bins.get(e.program, e.program)) if e.managed else None}
                     for eng, e in zip(cast("list[dict[str, object]]", value), plan.engines,
                                       strict=True)]
        if key == "placements" and isinstance(value, list):
            # where a remote device's free memory came from: its peer host's INFO, or not
            value = [{**pl, "free_reported": bool(
                (dev := lay.devices.get(str(pl.get("device")))) and dev.reported)}
                for pl in cast("list[dict[str, object]]", value)]
        if key == "router" and isinstance(value, dict):
            value = {"host": ext.host, "port": ext.port, **value}
        out[key] = value
    out["flag_check"] = lay.flags.to_json()
    out["spares"] = spares_json(lay)
    return out


def _with_spares(lay: layout.Layout) -> list[tuple[str, tuple[str, ...]]]:
    """Each remote device of the plan that names spares, with its endpoints (its own first).
    The plan is made on its own: `hydra plan` probes no HELLO (it would wait in the queue of an
    rpc-server a running head holds); `hydra up` tries the spares in order when that one fails
    its checks (plan/spares.py)."""
    from hydra_supervisor.plan import spares

    used = {e.device for e in lay.plan.peers if not e.managed}
    return [(d, eps) for d, eps in spares.alternates(lay.node).items() if d in used]


def spares_json(lay: layout.Layout) -> list[dict[str, object]]:
    """`hydra plan --json`'s `spares`: each device with spares, the endpoint planned on (its
    own) and its spares in order (_with_spares)."""
    return [{"device": d, "planned_on": eps[0], "spares": list(eps[1:])}
            for d, eps in _with_spares(lay)]


def _standby_plan(lay: Any, node_file: str | None, profiles_dir: str | None,
                  port: int | None) -> dict[str, Any] | None:
    """The profile's `standby:` layout planned too: both layouts' bytes per device."""
    name = getattr(lay.profile, "standby", None)
    if not name:
        return None
    from hydra_supervisor.serve.standby import plan_both

    try:
        other = layout.build(name, node_file=node_file, profiles_dir=profiles_dir,
                             overrides=port_overrides(port, None), check_ports=False)
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
@click.command("profiles")
@dir_opt
@node_opt
@click.option("--json", "as_json", is_flag=True,
              help="machine-readable: a list of objects (docs/profiles.md)")
@friendly
def profiles_cmd(profiles_dir: str | None, node_file: str | None, as_json: bool) -> None:
    """List the profiles hydra can find: description, mode, model, devices, and whether each
    can run on this node (read and planned as `hydra plan` does; nothing is started)."""
    rows = catalog.survey(profiles_dir, node_file)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        out.print("no profiles found (looked in --profiles-dir, $HYDRA_PROFILE_PATH, "
                  "~/.config/hydra/profiles and this checkout's profiles/)", markup=False)
        return
    width = max(len(r["name"]) for r in rows)
    out.print(styled((f"{'NAME':{width}}  {'MODE':7}  {'MODEL':20}  {'DEVICES':16}  "
                      f"{'CHECK':13}  DESCRIPTION", "dim")))
    for r in rows:
        check = "usable" if r["usable"] else (r["problem"] or "unusable")
        devs = ",".join(r["devices"]) or "-"
        model = r["model"] or "-"
        out.print(styled((f"{r['name']:{width}}", "bold"),
                         f"  {r['mode'] or '-':7}  {model:20}  {devs:16}  ",
                         (f"{check:13}", "green" if r["usable"] else "red"),
                         f"  {r['description']}"))
        if not r["usable"]:
            reason = (r["reason"] or "").splitlines()
            out.print("    " + "\n    ".join(reason[:6]), markup=False)
