"""What the wire server needs from the engine it fronts: the `EngineControl` protocol.

serve/engine_wire.py implements it for a port's default lane. Every method is called from a
wire-server thread (never from the supervisor's asyncio loop), so blocking is allowed, but
`info()`, `busy()`, `head_http()` and `slot_dir()` are called on every request and must answer
in milliseconds (no waiting on the switch lock). `configure` and `set_expert_mode` may take as
long as a switch takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable


class ConfigureRefused(Exception):
    """configure/set_expert_mode cannot do this (T4, a mode the profile lacks, …); str(e) is the
    message the client reads in the reply's meta `error`."""


@runtime_checkable
class EngineControl(Protocol):
    def info(self) -> Mapping[str, object]:
        """Truthful engine state for 0x41 INFO (profile, mode, model, peers, split, processes,
        llama.cpp build, …). Its `settings` entry (canonical CONFIGURE keys → current values,
        see tier_diff.current_settings) is what CONFIGURE diffs against."""
        ...

    def configure(self, params: dict[str, object]) -> Mapping[str, object]:
        """Apply changed settings: canonical keys (tiers.KEYS names) → normalised values, all
        T1..T3, never empty. Returns extra reply meta (e.g. {"restarted": ["head"]}); raises
        ConfigureRefused(msg) to refuse."""
        ...

    def set_expert_mode(self, mode: str) -> Mapping[str, object]:
        """`solo` | `combined`; returns meta with at least {"mode": <mode now in effect>}."""
        ...

    def head_http(self) -> tuple[str, int] | None:
        """The running head llama-server's (host, port), or None when none is serving."""
        ...

    def busy(self) -> bool:
        """True while a switch/restart holds the engine: requests get BUSY."""
        ...

    def slot_dir(self) -> Path:
        """The head's --slot-save-path (a directory this process can write)."""
        ...
