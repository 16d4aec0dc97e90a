"""T1 request defaults merged into completion bodies (sans-IO: bytes in, bytes out).

A T1 setting (temperature, n_predict, …) needs no restart: the router adds it to each completion
request that does not set it. Only JSON object bodies of ``POST`` to the completion endpoints are
touched; anything else passes through byte for byte.

The reply-length keys are aliases in llama-server, and ``n_predict`` wins over ``max_tokens``
when both are present, so a default ``n_predict`` added to an OpenAI request that set
``max_tokens`` would silently override the client. So the three length keys count as one: a
body with any of them gets no length default, and on the OpenAI endpoints the default is written
as ``max_tokens`` (the OpenAI name, which every OpenAI client also reads back).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from hydra_supervisor.router.replies import JSONValue

NATIVE_PATHS = frozenset({"/completion", "/completions"})
OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/chat/completions"})
LENGTH_KEYS = ("n_predict", "max_tokens", "max_completion_tokens")
# Bodies above this are passed through without a look (a prompt of megabytes still parses in
# milliseconds, but nothing in a T1 default is worth parsing more).
MAX_INSPECT = 8 << 20


_BOM = b"\xef\xbb\xbf"


def _json_object(body: bytes) -> bytes | None:
    """The body without a UTF-8 BOM (llama-server's JSON parser skips one) when it looks like
    a JSON object, else None (not ours to read)."""
    if body.startswith(_BOM):
        body = body[len(_BOM):]
    if not body or len(body) > MAX_INSPECT or body.lstrip()[:1] != b"{":
        return None
    return body


def looks_like_object(head: bytes) -> bool:
    """Whether a body that starts with ``head`` is a JSON object as far as its first bytes
    tell (a UTF-8 BOM and whitespace skipped)."""
    if head.startswith(_BOM):
        head = head[len(_BOM):]
    return head.lstrip()[:1] == b"{"


def takes_defaults(path: str) -> bool:
    """Whether POST bodies to ``path`` get T1 defaults (the completion endpoints)."""
    return path in NATIVE_PATHS or path in OPENAI_PATHS


def path_of(target: bytes) -> str:
    return target.split(b"?", 1)[0].decode("latin-1")


def merge(path: str, body: bytes, defaults: Mapping[str, JSONValue]
          ) -> tuple[bytes | None, str | None]:
    """(new body or None if unchanged, the request's ``model`` or None).

    ``path`` is the request path without its query; the caller checks the method is POST."""
    if path not in NATIVE_PATHS and path not in OPENAI_PATHS:
        return None, None
    text = _json_object(body)
    if text is None:
        return None, None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None, None  # llama-server gives the client its own error for this body
    if not isinstance(obj, dict):
        return None, None
    model = obj.get("model")
    model = model if isinstance(model, str) else None
    if not defaults:
        return None, model
    openai = path in OPENAI_PATHS
    added = False
    has_length = any(k in obj for k in LENGTH_KEYS)
    for key, value in defaults.items():
        if key in LENGTH_KEYS:
            if has_length:
                continue
            key = "max_tokens" if openai else "n_predict"
            has_length = True
        if key in obj:
            continue
        obj[key] = value
        added = True
    if not added:
        return None, model
    return json.dumps(obj, separators=(",", ":")).encode(), model


def model_of(body: bytes) -> str | None:
    """The ``model`` of any JSON object body (embeddings, rerank, infill...), or None."""
    return model_in(body)[0]


def model_in(body: bytes) -> tuple[str | None, bool]:
    """(the ``model`` of a JSON object body or None, whether the body could be read): a body
    that looks like a JSON object but does not parse here (nested past Python's recursion
    limit, or malformed) is unreadable, and the router must not guess where it goes. A
    ``model`` that is null or not a string is None, as if absent: llama-server's json_value()
    reads it so (docs/routing.md)."""
    text = _json_object(body)
    if text is None:
        return None, True
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None, False
    model = obj.get("model") if isinstance(obj, dict) else None
    return (model if isinstance(model, str) else None), True
