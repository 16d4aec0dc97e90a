"""The first-byte router: one external port per engine carrying ggml-RPC, Hydra control and HTTP.

``classify`` owns the sans-IO decision on a connection's first bytes; ``relay`` owns the sockets:
the listener, admission (allow list, bounded queue, timeouts) and the byte relay to the engine's
internal llama-server, its local ggml-rpc-server, or hydra's control handler. docs/router.md says
why the relay is built the way it is, with the measurements.
"""

from hydra_supervisor.router.classify import MAX_PREFIX, Kind, classify
from hydra_supervisor.router.relay import Router, Upstreams

__all__ = ["MAX_PREFIX", "Kind", "Router", "Upstreams", "classify"]
