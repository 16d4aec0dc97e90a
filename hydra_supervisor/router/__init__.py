"""The first-byte router: one external port carrying ggml-RPC, Hydra control and HTTP.

``classify`` owns the sans-IO decision on a connection's first bytes; ``conn`` one connection's
state and where it goes; ``core`` is the ``Router`` (its public API), which composes
``ledger`` (the state its threads share: admitted connections, descriptors, stopping, counters),
``acceptor`` (the listener and admission: allow list, bounded queues, timeouts) and ``relay``
(the worker pool and the byte relay to the engine's local ggml-rpc-server or hydra's control
handler); ``http`` is the request-aware HTTP leg to the internal llama-server (h11): its
session (reading requests, forwarding, retries, cuts), with ``upstream`` (the upstream pool,
the request as it goes upstream, ``SessionHost``/``SessionCounts``: what a session needs of its
router, so that nothing below ``core`` imports it) and ``replies`` (what the router writes
itself, the request record, the ``JSONValue`` alias);
``routes`` the route table's Routes (each HTTP request goes to the one its table picks:
the router has no gate of its own) and their limiters; ``gate`` decides when a route's request
may go upstream (hold/release, unavailable, in flight); ``defaults`` merges T1 defaults into
bodies; ``limits`` owns the process limits (open files, thread stacks, pipes) and the bounds the
acceptor and the relay share (descriptors per relay, the linger after a refusal).
docs/router.md says why the relay is built the way it is, with the measurements.
"""

from typing import TYPE_CHECKING

from hydra_supervisor.router.classify import MAX_PREFIX, Kind, classify
from hydra_supervisor.router.conn import Upstreams
from hydra_supervisor.router.limits import raise_nofile

if TYPE_CHECKING:
    from hydra_supervisor.router.core import Router

__all__ = ["MAX_PREFIX", "Kind", "Router", "Upstreams", "classify", "raise_nofile"]


def __getattr__(name: str) -> object:
    # `Router` is imported when first asked for: a reader of one light module (the status
    # schema reads router/traffic.py's RequestStatus) does not pull the whole router in
    # (`hydra status` starts fast: tests/test_cli_imports.py).
    if name == "Router":
        from hydra_supervisor.router.core import Router

        return Router
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
