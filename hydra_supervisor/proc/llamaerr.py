"""llama.cpp's own error line, out of a child's log: what a failed start or change reports.

llama-server prints why it refuses to start in one line, but not always last: a bad argument
prints `error while handling argument "--cache-type-k": Unsupported cache type: bogus` and
then the whole usage text, so the log's last lines say nothing. `error_line` picks the line
that says why, most specific first; `from_log` reads the end of a log file (bounded).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

READ_BYTES = 256 * 1024  # the end of the log: one failed start, usage text included

# llama.cpp's own log lines carry a level: "0.02.740.058 E llama_init_from_model: ...".
_LEVEL_E = re.compile(r"^\d+\.\d+\.\d+\.\d+ E\s+(.*)$")
_ARGUMENT = re.compile(r"^error while handling argument")
_ANY_ERROR = re.compile(r"(^|\b)(error|fatal|failed)\b", re.I)


def error_line(lines: Sequence[str]) -> str | None:
    """The line of `lines` that says why llama.cpp stopped, or None. Most specific first: an
    argument llama-server refused; the first error-level line of its log (the cause: "quantized
    V cache requires flash_attn to be enabled", before the "failed to create context" and
    "exiting due to model loading error" that follow it); else the last line that says error
    (never the usage text, which is indented or starts with "-")."""
    clean = [ln.strip() for ln in lines if ln.strip() and not ln[:1].isspace()
             and not ln.lstrip().startswith("-")]
    hit = next((ln for ln in clean if _ARGUMENT.search(ln)), None)
    if hit is None:
        hit = next((m.group(1).strip() for ln in clean if (m := _LEVEL_E.match(ln))), None)
    if hit is None:
        hit = next((ln for ln in reversed(clean) if _ANY_ERROR.search(ln)), None)
    return hit[:400] if hit else None


def from_log(path: Path | str | None) -> str | None:
    """llama.cpp's error line from the end of the log at `path` (None if none or unreadable)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - READ_BYTES))
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    return error_line(text.splitlines())


def with_line(message: str, line: str | None) -> str:
    """`message`, followed by llama.cpp's line when it says something new."""
    if not line or line in message:
        return message
    return f"{message}: {line}"
