"""What every `hydra` command shares: the two consoles (stdout, stderr) and styled text, a
HydraError as its message and exit status 2 (friendly), the options several commands take, and
where the running hydra's control socket is."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.text import Text

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime import control_client, exits

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


def control_socket(state: StateDir) -> Path:
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
            sys.exit(exits.BAD_INPUT)

    return wrapper  # type: ignore[return-value]


profile_opt = click.option("--profile", "-p", default="demo", show_default=True,
                           help="profile name (see `hydra profiles`) or path to a .yaml")
node_opt = click.option("--node", "node_file", default=None,
                        help="node file (default: $HYDRA_NODE, ~/.config/hydra/node.yaml)")
dir_opt = click.option("--profiles-dir", default=None, help="extra directory of profiles")


def port_overrides(port: int | None, host: str | None) -> dict[str, Any]:
    out_: dict[str, Any] = {}
    if port is not None:
        out_["port"] = port
    if host is not None:
        out_["host"] = host
    return out_
