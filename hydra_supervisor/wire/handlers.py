"""What each opcode does, over an `EngineControl` and the head's slot API (no sockets here).

The transport (server.py) calls `Handlers.begin(head)` when a request header arrives and gets a
`Sink`; the payload is written into the sink as it arrives (a file for STATE_PUT, a bounded
buffer for JSON ops, nowhere for ops that are refused up front), and `finish()` returns the
`Reply`. A reply's payload is either bytes or an open file streamed in `state_chunk_size`
pieces. Decisions that need no payload (BUSY, NOT_IMPLEMENTED, a bad slot key) are made at the
header, and the payload is drained, so the connection stays in step and the client reads a
clean reply.

Streaming convention for STATE_GET and PREFILL (docs/protocol.md): ONE response frame, status
OK, whose header carries the whole state size; the bytes follow in state_chunk_size writes.
Hydra.Core's chunked readers take exactly this (they refuse any status but OK and read
payload_len bytes), so hydra never sends PARTIAL. A failure after the header is sent can only
be signalled by closing the connection (the client sees EOF inside the payload).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, cast

from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.wire import slots, tier_diff, tiers
from hydra_supervisor.wire.codec import Op, RequestHead, Status, op_name
from hydra_supervisor.wire.control import ConfigureRefused, EngineControl

log = logging.getLogger("hydra.wire")

ENGINE_OPS = (Op.INFO, Op.CONFIGURE, Op.SET_EXPERT_MODE)  # key "" = engine level
SLOT_OPS = (Op.STATE_GET, Op.STATE_PUT, Op.STATE_META, Op.PREFILL)
NOT_SERVED = (Op.DECODE, Op.SWAP_QUANT, Op.PIPELINE_ATTACH)
SERVED = (*SLOT_OPS, *ENGINE_OPS)
CAPABILITIES = ["state_transfer", "prefill", "configure", "expert_mode"]
FILE_PREFIX = "hydra-wire-"
BUSY_MESSAGE = "the engine is switching; retry shortly"


@dataclass
class Reply:
    status: int
    meta: dict[str, object] = field(default_factory=dict)  # sent as JSON
    payload: bytes = b""
    stream: IO[bytes] | None = None  # payload streamed from this open file (stream_len bytes)
    stream_len: int = 0
    chunk: int = tiers.STATE_CHUNK_DEFAULT

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


def error(status: int, message: str, **extra: object) -> Reply:
    return Reply(status, {"success": False, "error": message, **extra})


class Sink(Protocol):
    def write(self, data: bytes) -> None: ...

    def finish(self) -> Reply: ...

    def abort(self) -> None: ...


class Drain:
    """Discard the payload; answer a reply decided at the header."""

    def __init__(self, reply: Reply) -> None:
        self.reply = reply

    def write(self, data: bytes) -> None:
        pass

    def finish(self) -> Reply:
        return self.reply

    def abort(self) -> None:
        pass


class Buffered:
    """Collect a small payload (the codec capped its size at the header), then run `fn`."""

    def __init__(self, head: RequestHead, fn: Callable[[RequestHead, bytes], Reply]) -> None:
        self.head, self.fn = head, fn
        self.buf = bytearray()

    def write(self, data: bytes) -> None:
        self.buf += data

    def finish(self) -> Reply:
        return self.fn(self.head, bytes(self.buf))

    def abort(self) -> None:
        self.buf.clear()


class StatePut:
    """Write the payload straight into a file in the slot dir, then have llama-server restore
    the slot from it. The file is always removed."""

    def __init__(self, handlers: Handlers, slot: int, addr: slots.Addr, expected: int) -> None:
        self.h, self.slot, self.addr, self.expected = handlers, slot, addr, expected
        self.name = f"{FILE_PREFIX}put-{slot}-{uuid.uuid4().hex}.bin"
        self.path = handlers.control.slot_dir() / self.name
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.f: IO[bytes] | None = os.fdopen(fd, "wb", buffering=1 << 20)
        self.written = 0

    def write(self, data: bytes) -> None:
        if self.f is not None:
            self.f.write(data)
            self.written += len(data)

    def finish(self) -> Reply:
        try:
            if self.f is not None:
                self.f.close()
                self.f = None
            res = slots.restore(self.addr, self.slot, self.name, self.h.state_timeout)
            return Reply(Status.OK, {
                "restored": True, "success": True, "slot_id": self.slot,
                "bytes": int(res.get("n_read", self.written)),
                "n_past": int(res.get("n_restored", 0)),
                "restore_ms": res.get("timings", {}).get("restore_ms"),
            })
        except slots.SlotError as e:
            return error(e.status, str(e))
        finally:
            self.abort()

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        self.path.unlink(missing_ok=True)


def _slot_of(key: str) -> int | None:
    k = key.strip()
    return int(k) if k.isdigit() and len(k) < 6 else None


def _json_obj(payload: bytes, what: str) -> JSONObject:
    try:
        body: JSONValue = json.loads(payload) if payload.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _Refuse(Status.BAD_REQUEST, f"{what} payload is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise _Refuse(Status.BAD_REQUEST, f"{what} payload must be a JSON object")
    return body


class _Refuse(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Handlers:
    """The opcode table. Thread-safe: the only shared mutable state is state_chunk_size."""

    def __init__(self, control: EngineControl, *, state_timeout: float = 300.0,
                 prefill_timeout: float = 600.0, meta_timeout: float = 10.0) -> None:
        self.control = control
        self.state_timeout = state_timeout
        self.prefill_timeout = prefill_timeout
        self.meta_timeout = meta_timeout
        self._lock = threading.Lock()
        self._chunk = tiers.STATE_CHUNK_DEFAULT

    @property
    def chunk_size(self) -> int:
        with self._lock:
            return self._chunk

    def set_chunk_size(self, n: int) -> int:
        with self._lock:
            self._chunk = tiers.clamp_chunk(n)
            return self._chunk

    # ------------------------------------------------------------------ dispatch at the header

    def begin(self, head: RequestHead) -> Sink:
        op = head.op
        if op == Op.INFO:  # answered even while busy: it says what the engine is doing
            return Buffered(head, self.info)
        if op not in SERVED:
            what = "not served by hydra (stock llama.cpp)" if op in NOT_SERVED else "unknown"
            return Drain(error(Status.NOT_IMPLEMENTED, f"op {op_name(op)} is {what}"))
        if op == Op.CONFIGURE:  # busy is checked once the payload says what it changes
            return Buffered(head, self.configure)
        if self.control.busy():
            return Drain(error(Status.BUSY, BUSY_MESSAGE))
        if op == Op.SET_EXPERT_MODE:
            return Buffered(head, self.set_expert_mode)
        slot = _slot_of(head.key)
        if slot is None:
            return Drain(error(Status.ERROR, f"{op_name(op)} needs a slot id as the key "
                                             f"(decimal text), got {head.key!r}"))
        addr = self.control.head_http()
        if addr is None:
            return Drain(error(Status.ERROR, "no head llama-server is running"))
        if op == Op.STATE_META:
            return Buffered(head, lambda h, p: self.state_meta(slot, addr))
        # This llama-server build does not check the slot id of a save/restore (a save of
        # slot 5 on a one-slot server "succeeds"): check it against /slots first.
        try:
            ids = {int(sid) for s in slots.list_slots(addr, self.meta_timeout)
                   if isinstance(sid := s.get("id"), int)}
        except slots.SlotError as e:
            return Drain(error(e.status, str(e)))
        if slot not in ids:
            return Drain(error(Status.NOT_FOUND, f"no slot {slot} on the head (slots: "
                                                 f"{', '.join(map(str, sorted(ids)))})"))
        if op == Op.STATE_PUT:
            if head.payload_len == 0:
                return Drain(error(Status.ERROR, "STATE_PUT needs the state as its payload"))
            return StatePut(self, slot, addr, head.payload_len)
        if op == Op.STATE_GET:
            return Buffered(head, lambda h, p: self.state_get(slot, addr))
        return Buffered(head, lambda h, p: self.prefill(slot, addr, p))

    @staticmethod
    def finish(sink: Sink) -> Reply:
        try:
            return sink.finish()
        except _Refuse as e:
            return error(e.status, str(e))
        except slots.SlotError as e:
            return error(e.status, str(e))
        except ConfigureRefused as e:
            return error(Status.ERROR, str(e))

    # ------------------------------------------------------------------------- engine-level ops

    def info(self, head: RequestHead, payload: bytes) -> Reply:
        meta: dict[str, object] = {
            "engine": "hydra",
            "protocol": "hydra-wire/1",
            "capabilities": list(CAPABILITIES),
            "ops": {op_name(o): ("served" if o in SERVED else "not_implemented")
                    for o in Op},
            "state_chunk_size": self.chunk_size,
            "busy": self.control.busy(),
        }
        meta.update(self.control.info())
        return Reply(Status.OK, meta)

    def configure(self, head: RequestHead, payload: bytes) -> Reply:
        params = _json_obj(payload, "CONFIGURE")
        current = self.control.info().get("settings") or {}
        diff = tier_diff.classify(params, cast("Mapping[str, object]", current))
        meta: dict[str, object] = {"unknown_keys": list(diff.unknown)}
        if not diff.ok:  # a value out of range or of the wrong type is the client's error
            return error(Status.BAD_REQUEST if diff.invalid else Status.ERROR, diff.error(),
                         refused=diff.refused, invalid=diff.invalid, **meta)
        if diff.state_chunk_size_applied is not None:
            meta["state_chunk_size_applied"] = self.set_chunk_size(diff.state_chunk_size_applied)
        meta.update({
            "success": True, "applied": True,
            "tier": str(diff.tier) if diff.tier else None,
            "params_applied": diff.changed,
            "unchanged": list(diff.unchanged),
            "deferred_keys": [],
        })
        if diff.noop:  # answered even while busy: Hydra.Core's state_chunk_size greeting
            meta["noop"] = True
            return Reply(Status.OK, meta)
        if self.control.busy():
            return error(Status.BUSY, BUSY_MESSAGE)
        result = self.control.configure(dict(diff.changed))
        meta.update(result or {})
        return Reply(Status.OK, meta)

    def set_expert_mode(self, head: RequestHead, payload: bytes) -> Reply:
        try:
            text = payload.decode().strip()
        except UnicodeDecodeError:
            raise _Refuse(Status.BAD_REQUEST, "SET_EXPERT_MODE payload is not UTF-8") from None
        if text.startswith(("{", '"')):  # lenient: a JSON string or {"mode": …}
            body = _json_obj(text.encode(), "SET_EXPERT_MODE") if text.startswith("{") \
                else {"mode": json.loads(text)}
            text = str(body.get("mode", ""))
        mode = {"combine": "combined"}.get(text.lower(), text.lower())
        if mode not in ("solo", "combined"):
            raise _Refuse(Status.BAD_REQUEST,
                          f"SET_EXPERT_MODE takes 'solo' or 'combined', got {text!r}")
        result = dict(self.control.set_expert_mode(mode) or {})
        result.setdefault("mode", mode)
        return Reply(Status.OK, {"success": True, **result})

    # --------------------------------------------------------------------------- slot-level ops

    def _save(self, slot: int, addr: slots.Addr) -> tuple[slots.SaveReply, IO[bytes], int]:
        """Save the slot to a fresh file, open it and unlink it at once: the open file is the
        payload, and nothing is left in the slot dir even if the client goes away."""
        name = f"{FILE_PREFIX}get-{slot}-{uuid.uuid4().hex}.bin"
        res = slots.save(addr, slot, name, self.state_timeout)
        path: Path = self.control.slot_dir() / name
        try:
            f = open(path, "rb")  # noqa: SIM115 - the Reply owns and closes it
        except FileNotFoundError:
            raise _Refuse(Status.ERROR, f"llama-server saved slot {slot} but {path} is missing: "
                                        "is slot_dir() the head's --slot-save-path?") from None
        path.unlink(missing_ok=True)
        return res, f, os.fstat(f.fileno()).st_size

    def state_get(self, slot: int, addr: slots.Addr) -> Reply:
        res, f, size = self._save(slot, addr)
        return Reply(Status.OK, {
            "slot_id": slot, "n_past": int(res.get("n_saved", 0)), "state_size": size,
            "save_ms": res.get("timings", {}).get("save_ms"),
            "format": "llama.cpp slot file", "chunk_size": self.chunk_size,
            **self._identity(),
        }, stream=f, stream_len=size, chunk=self.chunk_size)

    def state_meta(self, slot: int, addr: slots.Addr) -> Reply:
        for s in slots.list_slots(addr, self.meta_timeout):
            if s.get("id") == slot:
                return Reply(Status.OK, {
                    "slot_id": slot,
                    "n_past": _n_past(s),
                    "n_ctx": s.get("n_ctx"),
                    "is_processing": bool(s.get("is_processing")),
                    "is_transferring": False,
                    "state_size": None,  # known only by saving; STATE_GET reports it
                    **self._identity(),
                })
        return error(Status.NOT_FOUND, f"no slot {slot} on the head")

    def prefill(self, slot: int, addr: slots.Addr, payload: bytes) -> Reply:
        body = _json_obj(payload, "PREFILL")
        want_model = body.get("model")
        res = slots.prefill(addr, slot, body, self.prefill_timeout)
        timings = cast("JSONObject", res.get("timings", {})) if isinstance(res, dict) else {}
        saved, f, size = self._save(slot, addr)
        ident = self._identity()
        served = ident.get("model")
        return Reply(Status.OK, {
            "slot_id": slot, "n_past": int(saved.get("n_saved", 0)), "state_size": size,
            "logits_size": 0,
            "tokens_processed": timings.get("prompt_n"),
            "cache_n": timings.get("cache_n"),
            "prefill_ms": timings.get("prompt_ms"),
            "model_load_ms": 0,
            "model_fallback": bool(want_model) and served is not None and want_model != served,
            "format": "llama.cpp slot file", "chunk_size": self.chunk_size,
            **ident,
        }, stream=f, stream_len=size, chunk=self.chunk_size)

    def _identity(self) -> dict[str, object]:
        info = self.control.info()
        return {k: info[k] for k in ("model", "model_path", "profile") if k in info}


def _n_past(s: JSONObject) -> int | None:
    """Tokens in the slot's cache. Stock /slots (this build) has no n_past: it reports the last
    prompt's length (`n_prompt_tokens`) and the tokens decoded after it (`next_token[0]
    .n_decoded`); their sum is the slot's n_past (STATE_GET's `n_past` is exact: it is what
    llama-server saved)."""
    if isinstance(n_past := s.get("n_past"), int):
        return int(n_past)
    prompt = s.get("n_prompt_tokens")
    if not isinstance(prompt, int):
        return None
    nxt = s.get("next_token")
    decoded = nxt[0].get("n_decoded", 0) if isinstance(nxt, list) and nxt and isinstance(
        nxt[0], dict) else 0
    return prompt + (decoded if isinstance(decoded, int) else 0)
