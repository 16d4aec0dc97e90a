"""A live dashboard of a running hydra, served beside `/metrics` on the loopback metrics port
(docs/dashboard.md): ports and profiles, devices, processes, activity charts, switches, logs,
and the control API's switch/restart/reload behind a same-origin check and a per-start token."""

from hydra_supervisor.dashboard.app import Dashboard
from hydra_supervisor.dashboard.feed import Publisher

__all__ = ["Dashboard", "Publisher"]
