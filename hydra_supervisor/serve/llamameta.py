"""llama-server's own description of the model it serves (`meta` in its /v1/models): the
vocabulary, the context it was trained with, the parameter count, the file size. hydra's
/v1/models carries it for every loaded layout, the same on every port."""

from __future__ import annotations

import json
import urllib.request

TIMEOUT_S = 5.0


def fetch(addr: tuple[str, int], timeout: float = TIMEOUT_S) -> dict[str, object] | None:
    """The `meta` of the first model a llama-server at `addr` lists (None: it has none)."""
    host = f"[{addr[0]}]" if ":" in addr[0] else addr[0]
    with urllib.request.urlopen(f"http://{host}:{addr[1]}/v1/models",  # noqa: S310
                                timeout=timeout) as r:
        body = json.loads(r.read())
    data = body.get("data") if isinstance(body, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    meta = first.get("meta") if isinstance(first, dict) else None
    return dict(meta) if isinstance(meta, dict) else None
