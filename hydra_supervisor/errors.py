"""User-facing errors: one exception type whose message is what the operator reads.

Every problem that bad input can cause ends as a HydraError with a message that names the file,
port, binary or model involved and, where there is one, the fix. The CLI prints it and exits 2.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


class HydraError(Exception):
    """An error the operator can fix; str(err) is the complete message."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  fix: {self.hint}"
        return self.message


class ConfigError(HydraError):
    """A profile or node file is malformed; the message carries file:line and the YAML path."""


def exits_2(fn: F) -> F:
    """A command whose HydraError is its message on stderr and exit status 2, never a
    traceback (cli.friendly does the same with rich styling; the command modules that cli.py
    imports use this one)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HydraError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]
