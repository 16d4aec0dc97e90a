"""User-facing errors: one exception type whose message is what the operator reads.

Every problem that bad input can cause ends as a HydraError with a message that names the file,
port, binary or model involved and, where there is one, the fix. The CLI prints it and exits 2
(exits.BAD_INPUT). No click here: the command-line side lives in cli.py and clickutil.py.
"""

from __future__ import annotations


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
