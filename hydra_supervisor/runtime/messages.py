"""The `message` of every action reply (switch, restart, reload, load, unload): one or more plain
English sentences saying what happened, built here and only here from the reply itself (its
documented keys, docs/control.md), so the CLI and the dashboard say the same thing.

    demo is serving (loaded in 3.2 s). Stopped demo-moe: it did not fit beside demo (demo
    needs 812 MiB of host memory, 300 MiB free).

Plain functions of plain values; golden-tested (tests/test_load_unload_policy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Literal, TypeVar

Action = Literal["switch", "restart", "reload", "load", "unload"]
Reply = Mapping[str, object]  # only read: narrowed where it is used
R = TypeVar("R", bound=MutableMapping[str, object])


def _items(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else []


def _map(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def with_message(action: Action, reply: R) -> R:
    """`reply` with its `message` (set in place, and returned)."""
    reply["message"] = message(action, reply)
    return reply


def message_of(exc: Exception) -> str:
    """An action refused or failed before it replied (busy, bad input): its error, said."""
    return _sentence(getattr(exc, "message", None) or str(exc))


def message(action: Action, reply: Reply) -> str:
    """The sentences for one action's reply (an error reply: its error)."""
    if reply.get("error") and "result" not in reply:
        return _sentence(str(reply["error"]))
    say: dict[Action, Callable[[Reply], list[str]]] = {
        "switch": _switch, "load": _load, "unload": _unload, "restart": _restart,
        "reload": _reload}
    return " ".join(_sentence(s) for s in say[action](reply) if s)


def _sentence(text: str) -> str:
    text = text.strip()
    if not text:
        return text
    return text if text.endswith((".", "!", "?")) else f"{text}."


def secs(s: object) -> str:
    """Seconds as a reader says them: 0.31 s, 3.2 s, 42 s."""
    x = float(s) if isinstance(s, (int, float)) else 0.0
    return f"{x:.2f} s" if x < 1 else f"{x:.1f} s" if x < 20 else f"{x:.0f} s"


def _cut(n: object) -> str:
    k = int(n) if isinstance(n, int) else 0
    if not k:
        return ""
    return f"{k} request{'s were' if k != 1 else ' was'} cut after the drain"


def _stopped(reply: Reply) -> list[str]:
    out = []
    for x in _items(reply.get("stopped")):
        if not isinstance(x, Mapping):
            continue
        cut = _cut(x.get("cut"))
        out.append(f"Stopped {x.get('profile')}: {x.get('why')}" + (f" ({cut})" if cut else ""))
    return out


def _failed(what: str, reply: Reply) -> list[str]:
    phase = reply.get("failed_phase")
    out = [f"{what} failed" + (f" in phase {phase}" if phase else "")
           + f": {reply.get('error') or 'see hydra.log'}"]
    if reply.get("result") == "rolled_back":
        out.append(f"Rolled back: {reply.get('from') or 'the layout before it'} serves again")
    return out


def _notes(reply: Reply) -> list[str]:
    return [str(n) for n in _items(reply.get("notes"))
            if not str(n).startswith(("not instant: ", "not applied: "))]


def _switch(reply: Reply) -> list[str]:
    result, to, frm = reply.get("result"), reply.get("to"), reply.get("from")
    if result == "noop":
        return [f"Nothing to do: {reply.get('reason') or f'{to} is already serving'}"]
    if result != "ok":
        return [*_failed(f"The switch to {to}", reply), *_stopped(reply)]
    took = secs(reply.get("total_s"))
    if reply.get("instant"):
        out = [f"{to} is serving: the port flipped from {frm} to its loaded standby layout in "
               f"{took}; nothing restarted, {frm} stands by"]
    elif reply.get("stopped"):
        out = [f"{to} is serving (loaded in {took})", *_stopped(reply)]
    elif frm and frm != to:
        out = [f"Switched {frm} -> {to} in {took}: {to} is serving"]
    elif frm is None:
        out = [f"{to} is serving (loaded in {took}); it fits beside what serves: nothing "
               "else was stopped"]
    else:
        out = [f"{to} is serving again after {took}"]
    if not reply.get("stopped"):
        out.append(_cut(reply.get("cut")))
    if reply.get("not_instant"):
        out.append(f"Not instant: {reply['not_instant']}")
    return [*out, *_notes(reply)]


def _load(reply: Reply) -> list[str]:
    result, to = reply.get("result"), reply.get("to")
    if result == "noop":
        return [f"Nothing to do: {reply.get('reason') or f'{to} is already serving'}"]
    if result != "ok":
        return [f"{to} failed to load: {reply.get('error') or 'see hydra.log'}",
                *_stopped(reply)]
    took = secs(reply.get("total_s"))
    if not reply.get("stopped"):
        return [f"{to} is serving (loaded in {took}); it fits beside what serves: nothing "
                "else was stopped", *_notes(reply)]
    return [f"{to} is serving (loaded in {took})", *_stopped(reply), *_notes(reply)]


def _unload(reply: Reply) -> list[str]:
    out = []
    on_demand = _map(reply.get("on_demand"))
    stopped = _items(reply.get("stopped"))
    for x in stopped:
        if not isinstance(x, Mapping):
            continue
        name, why, cut = str(x.get("profile")), str(x.get("why") or ""), _cut(x.get("cut"))
        head = f"Unloaded {name}" + (f" ({why})" if why != "hydra unload" else "")
        if x is stopped[0]:
            head += f" in {secs(reply.get('total_s'))}"
        if cut:
            head += f"; {cut}"
        if on_demand.get(name) is True:
            head += "; the next request for it loads it again"
        elif on_demand.get(name) is False:
            head += (f"; it stays stopped until `hydra load {name}` or `hydra switch {name}` "
                     "(on_demand: false)")
        out.append(head)
    for name, state in _map(reply.get("not_loaded")).items():
        out.append(f"Nothing to do for {name}: it is not loaded ({state})")
    if not out:
        out.append("Nothing to do: no profile is loaded")
    return [*out, *_notes(reply)]


def _restart(reply: Reply) -> list[str]:
    if reply.get("result") not in ("ok", None):
        return _failed(f"The restart of {reply.get('engine')}", reply)
    done = [str(n) for n in _items(reply.get("restarted")) or [reply.get("engine")]]
    took = secs(reply.get("seconds", reply.get("total_s")))
    profile = reply.get("profile") or reply.get("to")
    if len(done) > 1:
        what = (f"Restarted {done[0]} and its head {', '.join(done[1:])} (a peer serves one "
                "head: the head restarts with it)")
    else:
        what = f"Restarted {done[0]}"
    return [f"{what} of {profile}; it serves again after {took}", *_notes(reply)]


def _reload(reply: Reply) -> list[str]:
    if reply.get("result") == "noop":
        out = [f"Nothing to do: {reply.get('reason') or 'profiles unchanged'}"]
    else:
        out = []
        for name, did in _map(reply.get("reloaded")).items():
            did = str(did)
            if did.startswith(("rolled back", "failed")):
                out.append(f"Reload of {name} {did}")
            else:
                out.append(f"Reloaded {name}: {did}")
        out.append(_cut(reply.get("cut")))
    out += [f"Not applied: {k}" for k in _items(reply.get("not_applied"))]
    return [*out, *_notes(reply)]
