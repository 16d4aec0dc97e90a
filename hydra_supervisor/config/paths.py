"""Where hydra keeps things: the state dir (pidfiles, status, logs) and the cache dir (builds).

State: $HYDRA_STATE_DIR, else $XDG_RUNTIME_DIR/hydra, else ~/.local/state/hydra.
Cache: $HYDRA_CACHE_DIR, else $XDG_CACHE_HOME/hydra, else ~/.cache/hydra.
"""

from __future__ import annotations

import os
from pathlib import Path


def state_dir() -> Path:
    env = os.environ.get("HYDRA_STATE_DIR")
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "hydra"
    return Path.home() / ".local" / "state" / "hydra"


def cache_dir() -> Path:
    env = os.environ.get("HYDRA_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hydra"


def repo_root() -> Path:
    """The checkout hydra runs from (profiles/ lives there)."""
    return Path(__file__).resolve().parents[2]
