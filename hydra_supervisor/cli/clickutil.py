"""What the command modules share on click's side: HydraError -> message and exit 2, click's
usage errors as the same `error:`/`fix:` lines, the port option types."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
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


# Every port option: a TCP port, 1..65535; where 0 has a meaning (off, pick one), 0..65535. Out
# of range or not a number is click's usage error, which cli.py prints as `error:`/`fix:` lines.
class PortRange(click.IntRange):
    """A TCP port option: `'abc' is not a valid port`, `99999 is not in the range
    1<=x<=65535`, and the fix says what a port is."""

    name = "port"

    def __init__(self, zero: str | None = None) -> None:
        """`zero`: what 0 means for this option (None: 0 is refused)."""
        super().__init__(1 if zero is None else 0, 65535)
        self.fix = "a port is a whole number from 1 to 65535" + (f" (0: {zero})" if zero else "")


PORT = PortRange()  # a port to reach: bench, configure
PORT_OR_PICK = PortRange("the kernel picks a free one")  # up/plan --port
PORT_OR_OFF = PortRange("off")  # --metrics-port


class InputError(click.UsageError):
    """A usage error shown as hydra shows every bad input: one `error:` line and a `fix:` line
    (click's own shows the usage and `Error: ...`); exit status 2."""

    def __init__(self, message: str, fix: str, ctx: click.Context | None = None) -> None:
        super().__init__(message, ctx)
        self.fix = fix

    def show(self, file: object = None) -> None:
        click.echo(f"error: {self.format_message()}\n  fix: {self.fix}", err=True)


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """click's usage errors raised inside as InputError (cli.py's group wraps every command)."""
    try:
        yield
    except InputError:
        raise
    except click.UsageError as exc:
        ctx = exc.ctx
        path = ctx.command_path if ctx is not None else "hydra"
        param = exc.param if isinstance(exc, click.BadParameter) else None
        fix = param.type.fix if param is not None and isinstance(param.type, PortRange) else \
            f"`{path} --help` lists the options and what they take"
        raise InputError(_lower_first(exc.format_message()), fix, ctx) from None


def _lower_first(text: str) -> str:
    """click's "Invalid value for '--port': ..." as hydra writes messages."""
    return text[:1].lower() + text[1:] if text[:2].isalpha() and not text[:2].isupper() else text
