"""A profile's `server_args` checked against the binaries' own `--help`, at plan time.

llama-server refuses an unknown flag at start (`error: invalid argument: --ctx-sise`), which
hydra would meet as a failed start (restarts, backoff, a rollback). Checked while planning
instead, a misspelt key is refused by `hydra plan`, `hydra up`, a switch and a reload, naming
the file:line of the key, the flag, and the closest flag the binary has. The peers'
ggml-rpc-server command lines (hydra's own flags) are checked against that binary's `--help`
too, which catches a binary of another llama.cpp version.

The flags come from tools/helpflags.py (run once per binary file, cached). When a binary is
missing or does not list its flags, the check is skipped and `FlagCheck` says why (`hydra plan`
prints it); nothing fails for that.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra_supervisor.config.profile import Node, Profile
from hydra_supervisor.config.yamlsrc import load_file
from hydra_supervisor.errors import ConfigError, HydraError
from hydra_supervisor.plan.argv import flag
from hydra_supervisor.plan.plan import Plan
from hydra_supervisor.tools import binaries, helpflags


class UnknownFlag(ConfigError):
    """A `server_args` key (or a flag hydra writes) that the binary's `--help` does not list."""


@dataclass(frozen=True)
class FlagCheck:
    """What the check did, per binary: checked against which file, or skipped and why."""

    checked: tuple[str, ...] = ()  # binaries whose --help the plan was checked against
    skipped: tuple[str, ...] = ()  # "llama-server: not found (...)" and the like

    def to_json(self) -> dict[str, list[str]]:
        return {"checked": list(self.checked), "skipped": list(self.skipped)}


@dataclass(frozen=True)
class Unknown:
    """One unknown `server_args` key: its flag and the closest key the binary has."""

    key: str
    flag: str
    suggestion: str | None  # a server_args key, spelled as the profile would write it
    short: str | None = None  # the one-dash flag the key names (`-ngl`), which argv cannot write

    def text(self) -> str:
        if self.short:
            return (f"llama-server has no flag {self.flag} ({self.short} is its short name, "
                    f"which server_args cannot write): use {self.suggestion}")
        hint = f"; did you mean {self.suggestion}?" if self.suggestion else ""
        return f"llama-server has no flag {self.flag}{hint}"


def key_of(spelling: str) -> str:
    return spelling.lstrip("-")


def unknown_args(args: Mapping[str, object], help_: helpflags.Help) -> list[Unknown]:
    """The keys of `args` whose flag (`flag(key)`, as argv.py writes it) `help_` does not
    list, each with a suggestion: the option's long spelling when the key is a one-dash
    short name such as `ngl` (server_args writes `--ngl`, which llama-server refuses), else
    the closest long flag (difflib)."""
    known = help_.flags
    longs = sorted(key_of(f) for f in known if f.startswith("--"))
    out: list[Unknown] = []
    for key in args:
        bare = key_of(key)
        written = flag(bare)
        if written in known:
            continue
        same = help_.spellings(f"-{bare}")  # `-ngl`: its long spellings, --n-gpu-layers
        longer = sorted((key_of(f) for f in same if f.startswith("--")), key=len)
        if longer:
            out.append(Unknown(key, written, longer[-1], short=f"-{bare}"))
            continue
        close = difflib.get_close_matches(bare, longs, n=1, cutoff=0.6)
        out.append(Unknown(key, written, close[0] if close else None))
    return out


def line_of(profile: Profile, node: Node, key: str) -> str:
    """file:line of `server_args.<key>`: in the profile's file, else the node file's
    `defaults:` (else just the profile's file: a CONFIGURE's value has no line)."""
    for source, path in ((profile.source, ("server_args", key)),
                         (node.source, ("defaults", "server_args", key))):
        try:
            src = load_file(Path(source))
        except (HydraError, OSError):
            continue
        if path in src.lines:
            return src.where(path)
    return profile.source


def check(profile: Profile, node: Node, plan: Plan) -> FlagCheck:
    """Refuse the plan (UnknownFlag, every unknown flag at once) when a `server_args` key is no
    flag of llama-server, or a peer's ggml-rpc-server does not know a flag hydra gives it."""
    checked: list[str] = []
    skipped: list[str] = []
    server = "llama-server"
    problems: list[str] = []
    programs = {e.program for e in plan.engines if e.managed}
    for program in sorted(programs):
        try:
            found = binaries.find(program, dict(node.binaries))
        except HydraError as exc:
            why = exc.message
            skipped.append(why if why.startswith(program) else f"{program}: {why}")
            continue
        help_ = helpflags.flags_of(found.path)
        if not help_.known:
            skipped.append(f"{program}: {help_.why}")
            continue
        checked.append(str(found.path))
        if program == "llama-server":
            server = str(found.path)
            problems += [f"{line_of(profile, node, u.key)}: server_args.{u.key}: {u.text()}"
                         for u in unknown_args(profile.server_args, help_)]
        else:
            problems += [f"{profile.source}: {e.name}: {program} ({found.path}) has no flag "
                         f"{f}, which hydra gives it: another llama.cpp version than hydra's?"
                         for e in plan.engines if e.managed and e.program == program
                         for f in _flags(e.args) if f not in help_.flags]
    if problems:
        raise UnknownFlag(
            "\n".join(problems),
            hint="server_args are llama-server's own flags without dashes "
                 f"(`{server} --help` lists them)")
    return FlagCheck(tuple(checked), tuple(skipped))


def _flags(args: Sequence[str]) -> list[str]:
    """The flags in a peer's argv (hydra writes it: its values are addresses and numbers)."""
    return [a for a in args if re.fullmatch(r"-{1,2}[A-Za-z][\w-]*", a)]

