"""The `hydra` command line: the click group `main` (the entry point) and where each command
lives. Client commands import only what they use: `hydra --version` and `hydra status` must not
pay for the daemon's imports (tests/test_cli_imports.py).

    up.py           `hydra up` and what it prints while starting
    client_cmds.py  status, switch, load, unload, restart, reload, down, logs: a running
                    hydra's client
    status_view.py  what `hydra status` shows (renderers of the daemon's snapshot)
    plan_cmd.py     plan, profiles: what a profile resolves to, nothing started
    setup_cmds.py   install-llama, doctor, synth: getting binaries and models ready
    shared.py       consoles, styled text, HydraError -> exit 2, shared options
    clickutil.py    port option types; click's usage errors as `error:`/`fix:` lines
    running.py      the running hydra as client commands find it (its snapshot)
    bench, systemd, cache, configure: their own modules (bench_cmd.py, systemd_cmd.py,
                    cache_cmd.py, configure_cmd.py), imported when run (_LazyGroup)

Every HydraError ends the command with its message on stderr and exit status 2; nothing else
prints a traceback for bad input. click's own usage errors (a port out of range, an unknown
option, a missing argument) end the same way: `error:` and `fix:` lines, exit 2. Ctrl-C ends
a command with exit 130 and no "Aborted!".
"""

from __future__ import annotations

import sys

import click

from hydra_supervisor import __version__
from hydra_supervisor.cli import client_cmds, plan_cmd, setup_cmds, up
from hydra_supervisor.cli.clickutil import usage_errors
from hydra_supervisor.runtime import exits


class _LazyGroup(click.Group):
    """Commands that live in modules of their own are imported when they are run (or listed
    in --help), not when `hydra` starts: `hydra --version` and `hydra status` stay fast."""

    lazy = {"bench": "hydra_supervisor.cli.bench_cmd:bench",
            "systemd": "hydra_supervisor.cli.systemd_cmd:systemd",
            "cache": "hydra_supervisor.cli.cache_cmd:cache",
            "configure": "hydra_supervisor.cli.configure_cmd:configure_command"}

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: object) -> click.Context:
        with usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: click.Context) -> object:
        try:
            with usage_errors():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            # Ctrl-C ends a command quietly, exit 130 (click would print "Aborted!", exit 1);
            # `hydra status --watch` ends with 0: Ctrl-C is how a watch is meant to end.
            click.echo(err=True)
            sys.exit(exits.INTERRUPTED)

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


for _cmd in (up.up, client_cmds.status, client_cmds.switch, client_cmds.load,
             client_cmds.unload, client_cmds.restart,
             client_cmds.reload, client_cmds.down, client_cmds.logs, plan_cmd.plan,
             plan_cmd.profiles_cmd, setup_cmds.install_llama, setup_cmds.doctor,
             setup_cmds.synth):
    main.add_command(_cmd)
