"""What the command modules share on click's side: HydraError -> message and exit 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hydra_supervisor.errors import HydraError
from hydra_supervisor.runtime import exits

F = TypeVar("F", bound=Callable[..., Any])


def exits_2(fn: F) -> F:
    """A command whose HydraError is its message on stderr and exit status 2, never a
    traceback (shared.friendly does the same with rich styling; the command modules that cli.py
    imports when run use this one)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HydraError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exits.BAD_INPUT)

    return wrapper  # type: ignore[return-value]
