"""User-facing errors: one exception type whose message is what the operator reads.

Every problem that bad input can cause ends as a HydraError with a message that names the file,
port, binary or model involved and, where there is one, the fix. The CLI prints it and exits 2
(exits.BAD_INPUT). No click here: the command-line side lives in cli.py and clickutil.py.
"""

from __future__ import annotations

import errno


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


# errno values of a host (or a process) out of descriptors, memory or buffers
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def exhausted(exc: BaseException) -> bool:
    """Is `exc` a resource running out (descriptors, memory, buffers, threads) rather than a
    bug or a refusal? Such a failure is waited out and said, never a reason to stop serving
    (docs/supervision.md, "How hydra ends")."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno in _EXHAUSTED:
        return True
    # threading.Thread.start(): "can't start new thread" (EAGAIN from pthread_create)
    return isinstance(exc, RuntimeError) and "can't start new thread" in str(exc)
