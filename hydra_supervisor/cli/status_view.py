"""What `hydra status` shows, from the daemon's snapshot: a table per profile (one) or per port
(several), the router line, the last switch, why a port is down. Renderers only: no I/O but
printing."""

from __future__ import annotations

import time
from typing import Any

from rich.table import Table
from rich.text import Text

from hydra_supervisor.cli.shared import out, styled
from hydra_supervisor.serve import states
from hydra_supervisor.serve.states import LaneState


def serving_now(status: dict[str, Any]) -> str | None:
    """What a running hydra serves now, in words, from its status view (after a switch, the
    profile switched to, not the one it started with)."""
    profiles = status.get("profiles")
    if isinstance(profiles, dict):  # several profiles: those loaded now
        names = [n for n, st in profiles.items() if st not in states.NOT_LOADED]
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


def legacy_to_engine(data: dict[str, Any]) -> dict[str, Any]:
    return {"profile": data.get("profile"), "mode": data.get("mode"), "url": data.get("url"),
            "model": data.get("model"), "state": data.get("state", "stopped"),
            "fatal": data.get("fatal"), "degraded": data.get("degraded"),
            "processes": data.get("engines", []), "router": None, "switches": []}


def status_group(snap: dict[str, Any]) -> Any:
    from rich.console import Group

    return Group(*daemon_renderables(snap))


def daemon_renderables(snap: dict[str, Any]) -> list[Any]:
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
                                   held if e["state"] == LaneState.LOADING.value else "")
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
                              str(p["restarts"]), _fmt_mem(p),
                              Text(p.get("reason", "") + _remote_load(p)))
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


def print_engine(eng: dict[str, Any]) -> None:
    for part in _engine_renderables(eng):
        out.print(part)


def _engine_renderables(eng: dict[str, Any]) -> list[Any]:
    from rich.text import Text

    parts: list[Any] = []
    needs = ", ".join(f"{k} {v:,} MiB" for k, v in (eng.get("needs_mib") or {}).items())
    if eng.get("standby"):  # the other layout, kept loaded beside the active one (standby:)
        how = ("`hydra switch " + str(eng["profile"]) + "` flips to it at once"
               if eng["state"] == LaneState.SERVING.value else eng.get("why") or eng["state"])
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
        reason = e.get("reason", "") + _remote_load(e) + \
            (f" [{e['warning']}]" if e.get("warning") else "")
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


def _remote_load(proc: dict[str, Any]) -> str:
    """A head loading onto remote peers: how much of their weights it has sent
    (serve/progress.py)."""
    rl = proc.get("remote_load")
    if not isinstance(rl, dict) or not rl.get("remote_bytes"):
        return ""
    sent, total = int(rl["sent_bytes"]), int(rl["remote_bytes"])
    return (f"; sent {sent / 2**20:,.0f} of {total / 2**20:,.0f} MiB to remote peers "
            f"({sent / total:.0%}; a warm peer cache sends less)")

