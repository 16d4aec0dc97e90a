"""Metrics, part 2: the per-request records the router hands its `on_request` callback (its
threads), counted in prometheus_client's own Counter and Histogram (`RequestMetrics`): HTTP
requests by status, outcome and duration, with bounded labels. The server is metrics.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram


def num(value: object) -> float | None:
    """A JSON number as a float (None: not a number; a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


REQUEST_OUTCOMES = ("ok", "cut", "held_timeout", "error")
# Request durations: a health check (ms) to a long generation (minutes).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                    600)
# llama-server's endpoints, so a path label cannot grow without bound (ids, query strings).
KNOWN_PATHS = frozenset({
    "/", "/health", "/v1/health", "/metrics", "/props", "/slots", "/models", "/v1/models",
    "/completion", "/completions", "/v1/completions", "/chat/completions",
    "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/infill",
    "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
    "/v1/reranking", "/tokenize", "/detokenize", "/apply-template", "/lora-adapters",
    "/v1/responses", "/api/tags", "/api/show", "/api/chat",
})
_SLOT_PATH = re.compile(r"^/slots/\d+$")


def endpoint_label(path: str) -> str:
    """The request path as a bounded label: known endpoints as they are, `/slots/{id}`, or
    `other`."""
    path = path.split("?", 1)[0] or "/"
    if path in KNOWN_PATHS:
        return path
    if _SLOT_PATH.match(path):
        return "/slots/{id}"
    return "other"


def status_class(status: Any) -> str:
    try:
        code = int(status)
    except (TypeError, ValueError):
        return "none"
    return f"{code // 100}xx" if 100 <= code <= 599 else "none"



# ---------------------------------------------------------------------------------------------
# Per-request records


class RequestMetrics:
    """Fed by the router's on_request callback (its threads): prometheus_client's Counter and
    Histogram are thread-safe and cost a lock and an add each."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hydra_http_requests", "HTTP requests through the router, by status and outcome",
            ["engine", "profile", "method", "endpoint", "status", "outcome", "model"],
            registry=registry)
        self.duration = Histogram(
            "hydra_http_request_duration_seconds",
            "HTTP request duration through the router, first byte in to last byte out",
            ["engine", "profile", "endpoint", "outcome"], buckets=DURATION_BUCKETS,
            registry=registry)
        self.bytes = Counter(
            "hydra_http_request_bytes", "HTTP bytes through the router (in: request body, "
            "out: response)", ["engine", "direction"], registry=registry)

    def observe(self, record: Mapping[str, Any], engine: str | None = None,
                profile: str | None = None) -> None:
        """``engine``: the label every other series of that port uses (``port-N``, or
        ``port-N/PROFILE`` with several profiles); ``profile``: the one that served it (the
        router's route), or ''."""
        eng = str(engine if engine is not None else record.get("engine") or "")
        prof = str(profile if profile is not None else record.get("route") or "")
        endpoint = endpoint_label(str(record.get("path") or ""))
        outcome = str(record.get("outcome") or "ok")
        status = record.get("status")
        self.requests.labels(eng, prof, str(record.get("method") or ""), endpoint,
                             str(status) if status is not None else "none", outcome,
                             str(record.get("model") or "")[:80]).inc()
        d = num(record.get("duration_s"))
        if d is not None:
            self.duration.labels(eng, prof, endpoint, outcome).observe(d)
        for direction in ("in", "out"):
            n = num(record.get(f"bytes_{direction}"))
            if n:
                self.bytes.labels(eng, direction).inc(n)

