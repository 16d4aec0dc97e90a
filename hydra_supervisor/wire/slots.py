"""llama-server's slot API, as the wire handlers use it: save, restore, list, and a prefill.

Stock llama-server has no state endpoints; it saves a slot's KV (plus its tokens) to a file in
its `--slot-save-path` directory and restores from one (`POST /slots/{id}?action=save|restore`,
body `{"filename": name}`, a bare file name). The wire server turns those files into STATE_GET /
STATE_PUT payloads. Every call has a timeout; failures become `SlotError` with the wire status
the client should read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict, cast

import requests

from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.wire.codec import Status

Addr = tuple[str, int]


class SaveReply(TypedDict, total=False):
    """llama-server's answer to a slot save."""

    id_slot: int
    filename: str
    n_saved: int  # tokens
    n_written: int  # bytes
    timings: dict[str, float]  # save_ms


class RestoreReply(TypedDict, total=False):
    """llama-server's answer to a slot restore."""

    id_slot: int
    filename: str
    n_restored: int  # tokens
    n_read: int  # bytes
    timings: dict[str, float]  # restore_ms


class SlotError(Exception):
    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def _url(addr: Addr, path: str) -> str:
    host, port = addr
    return f"http://{host}:{port}{path}"


def _error_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err or body)[:300]


def _call(method: str, addr: Addr, path: str, timeout: float,
          json: Mapping[str, object] | None = None) -> JSONValue:
    try:
        resp = requests.request(method, _url(addr, path), timeout=timeout, json=json)
    except requests.Timeout:
        raise SlotError(Status.ERROR, f"llama-server {path}: no answer within {timeout:.0f}s") \
            from None
    except requests.RequestException as e:
        raise SlotError(Status.ERROR, f"llama-server {path}: {e}") from None
    if resp.status_code >= 400:
        msg = _error_message(resp)
        low = msg.lower()
        if resp.status_code == 503:
            status = Status.BUSY
        elif "invalid slot id" in low:  # not "invalid slot save file" (a bad STATE_PUT)
            status = Status.NOT_FOUND
        else:
            status = Status.ERROR
        raise SlotError(status, f"llama-server {path}: HTTP {resp.status_code}: {msg}")
    try:
        body: JSONValue = resp.json()
        return body
    except ValueError:
        raise SlotError(Status.ERROR, f"llama-server {path}: reply is not JSON") from None


def save(addr: Addr, slot: int, filename: str, timeout: float) -> SaveReply:
    """{"id_slot", "filename", "n_saved" (tokens), "n_written" (bytes), "timings": {"save_ms"}}"""
    return cast(SaveReply, _call("POST", addr, f"/slots/{slot}?action=save", timeout,
                                 json={"filename": filename}))


def restore(addr: Addr, slot: int, filename: str, timeout: float) -> RestoreReply:
    """{"id_slot", "filename", "n_restored" (tokens), "n_read" (bytes), "timings"}"""
    return cast(RestoreReply, _call("POST", addr, f"/slots/{slot}?action=restore", timeout,
                                    json={"filename": filename}))


def list_slots(addr: Addr, timeout: float) -> list[JSONObject]:
    body = _call("GET", addr, "/slots", timeout)
    if isinstance(body, dict):  # some builds wrap the list
        body = body.get("slots", [])
    if not isinstance(body, list):
        raise SlotError(Status.ERROR, "llama-server /slots: unexpected reply")
    return [s for s in body if isinstance(s, dict)]


def prefill(addr: Addr, slot: int, body: Mapping[str, object], timeout: float) -> JSONValue:
    """Run the prompt into `slot` and generate nothing: the chat endpoint for a `messages` body,
    /completion for a `prompt` body. The slot keeps the prompt's KV (cache_prompt)."""
    req = {k: v for k, v in body.items() if k not in ("stream", "hydra_config")}
    req.update({"id_slot": slot, "n_predict": 0, "cache_prompt": True, "stream": False})
    if "messages" in req:
        req.pop("max_tokens", None)
        req.pop("max_completion_tokens", None)
        path = "/v1/chat/completions"
    elif "prompt" in req:
        path = "/completion"
    else:
        raise SlotError(Status.BAD_REQUEST, "PREFILL needs a JSON body with 'messages' or "
                                            "'prompt'")
    return _call("POST", addr, path, timeout, json=req)


# ------------------------------------------------------------------ keep_slots across restarts


def save_all(addr: Addr, prefix: str, timeout: float) -> dict[int, str]:
    """Save every slot that holds tokens to `<prefix>-<id>.bin` in the head's slot dir (before
    a planned stop of the head). Returns slot id -> file name, for `restore_all`."""
    saved: dict[int, str] = {}
    for s in list_slots(addr, timeout):
        sid = s.get("id")
        if not isinstance(sid, int) or not s.get("n_prompt_tokens", 1):
            continue
        name = f"{prefix}-{sid}.bin"
        res = save(addr, sid, name, timeout)
        if int(res.get("n_saved", 0)) > 0:
            saved[sid] = name
    return saved


def restore_all(addr: Addr, saved: dict[int, str], timeout: float) -> dict[int, int | str]:
    """Restore the slots `save_all` saved into a new head of the same model (same slot dir).
    Per slot: tokens restored, or the error (a slot the new head lacks, another model …); the
    files are left for the caller to remove."""
    have = {s.get("id") for s in list_slots(addr, timeout)}
    out: dict[int, int | str] = {}
    for sid, name in saved.items():
        if sid not in have:
            out[sid] = f"no slot {sid} on the new head"
            continue
        try:
            out[sid] = int(restore(addr, sid, name, timeout).get("n_restored", 0))
        except SlotError as e:
            out[sid] = str(e)
    return out
