"""The wire server: the Hydra protocol on connections the router hands it, on its own threads.

It has no port of its own: the router's acceptor classifies a connection as "YH", checks its
source against the allow list, and hands the accepted socket over (`adopt`, Upstreams.hydra),
with the client's address, so the client can be authenticated (wire/trust.py: the peer's uid on
this host, or the owner's token). `listen()` opens a loopback listener for tests and the bench
only; hydra never calls it. One thread per connection with blocking sockets (requests on a
connection are strictly one at a time: the protocol has no pipelining). Nothing here runs on,
or waits for, the supervisor's asyncio loop: the `EngineControl` methods are called from these
threads.

Bounded everywhere: at most `max_conns` connections (the next one gets BUSY and is closed), an
idle connection is closed after `idle_timeout`, every send and every mid-frame read has
`io_timeout`, and the codec caps every length at the header. A frame the codec rejects gets
BAD_REQUEST and the connection is closed (it is out of step); a handler failure gets ERROR and
the connection goes on.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from hydra_supervisor.wire import codec, tiers
from hydra_supervisor.wire.codec import (
    FrameEnd,
    FrameError,
    Limits,
    Op,
    PayloadChunk,
    RequestHead,
    RequestParser,
    Status,
    op_name,
)
from hydra_supervisor.wire.control import EngineControl
from hydra_supervisor.wire.handlers import Buffered, Drain, Handlers, Reply, Sink, error
from hydra_supervisor.wire.trust import Identity, Trust

log = logging.getLogger("hydra.wire")

MAX_STATE_BYTES = 4 << 30  # Hydra.Core's own cap on a KV payload (RpcClient.MaxPayloadLen)
RECV_SIZE = 1 << 20

# Ops that change the engine or a slot: only an authenticated client (wire/trust.py).
CHANGES = (Op.CONFIGURE, Op.SET_EXPERT_MODE, Op.STATE_PUT, Op.PREFILL)
# Ops that only read: open to any source the router let in, unless the read policy says owner.
READS = (Op.INFO, Op.STATE_GET, Op.STATE_META)


def default_limits(max_state_bytes: int = MAX_STATE_BYTES) -> Limits:
    return Limits(
        key=256, trace=1024, payload=1 << 20,
        op_payload={
            Op.STATE_PUT: max_state_bytes,
            Op.DECODE: max_state_bytes,  # drained, then NOT_IMPLEMENTED
            Op.PREFILL: 64 << 20,  # an OpenAI chat body, images included
            Op.SET_EXPERT_MODE: 4 << 10,
        },
    )


class WireServer:
    """Hydra wire protocol on connections handed over by the router (`adopt`). With `port` set
    (tests, the bench) it also listens on `host:port` (0: any free port; `.port` after start);
    those connections are authenticated the same way."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        control: EngineControl | None = None,
        *,
        trust: Trust | None = None,
        reads: Callable[[], str] | None = None,
        limits: Limits | None = None,
        max_conns: int = 64,
        idle_timeout: float = 120.0,
        io_timeout: float = 60.0,
        handlers: Handlers | None = None,
    ) -> None:
        if control is None and handlers is None:
            raise TypeError("WireServer needs control=EngineControl")
        self.host, self._want_port = host, port
        self.handlers = handlers or Handlers(control)  # type: ignore[arg-type]
        self.limits = limits or default_limits()
        self.max_conns = max_conns
        self.idle_timeout = idle_timeout
        self.io_timeout = io_timeout
        self._sock: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._acceptor: threading.Thread | None = None
        self._stats: Counter[str] = Counter()
        self._started = False
        self.trust = trust or Trust()
        self._reads = reads  # the read policy in force now (a profile's wire_reads)

    # ----------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._stopping.clear()
        self._started = True
        if self._want_port is None:
            log.info("wire server ready: reached only through the router's port (no port of "
                     "its own); changes need an authenticated client")
            return
        self.listen(self.host, self._want_port)

    def listen(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """A loopback listener of its own, for tests and the bench (hydra never opens one)."""
        sock = socket.create_server((host, port), backlog=128)
        sock.settimeout(0.25)  # the acceptor checks _stopping this often
        self._sock = sock
        self._acceptor = threading.Thread(target=self._accept_loop, name="wire-accept",
                                          daemon=True)
        self._acceptor.start()
        log.info("wire server also listening on %s:%d (tests/bench)", host, self.port)
        return self.port

    @property
    def port(self) -> int:
        if self._sock is None:
            raise RuntimeError("WireServer.port: no listener (the router hands connections "
                               "over; listen() is for tests)")
        return int(self._sock.getsockname()[1])

    @property
    def state_chunk_size(self) -> int:
        return self.handlers.chunk_size

    def alive(self) -> bool:
        if self._acceptor is not None:
            return self._acceptor.is_alive()
        return self._started and not self._stopping.is_set()

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every connection; waits at most `timeout` in all (a handler
        blocked in a long llama-server call finishes on its own, on a daemon thread)."""
        deadline = time.monotonic() + timeout
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            conns = list(self._conns.items())
        for c, _ in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv/send
            except OSError:
                pass
        for _, t in conns:
            t.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = dict(self._stats)
            out["open"] = len(self._conns)
        for reason, n in self.trust.refused.items():
            out[f"auth_refused_{reason}"] = n
        return out

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    # ------------------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                continue  # EMFILE and friends: keep serving the connections we have
            self.adopt(conn, peer)

    def adopt(self, conn: socket.socket, peer: object = None, prefix: bytes = b"") -> None:
        """Serve a connection accepted elsewhere (the router's acceptor): `peer` is the client's
        address, `prefix` the bytes the router already read from it. Takes ownership of `conn`
        (closes it on every path); returns at once."""
        if self._stopping.is_set() or not self._started:
            self._reply_and_close(conn, error(Status.BUSY, "the wire server is not running"))
            return
        self._count("accepted")
        with self._lock:
            full = len(self._conns) >= self.max_conns
        if full:
            self._count("refused_full")
            self._reply_and_close(conn, error(Status.BUSY, "too many wire connections"))
            return
        try:
            local = conn.getsockname()
        except OSError:
            local = None
        ident = Identity(peer=peer, local=local, sock=conn)
        t = threading.Thread(target=self._serve, args=(conn, ident, prefix), name="wire-conn",
                             daemon=True)
        with self._lock:
            self._conns[conn] = t
        try:
            t.start()
        except RuntimeError:  # can't start new thread
            with self._lock:
                self._conns.pop(conn, None)
            self._reply_and_close(conn, error(Status.BUSY, "no thread for the connection"))

    def _reply_and_close(self, conn: socket.socket, reply: Reply) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(codec.encode_response(reply.status, reply.meta))
        except OSError:
            pass
        finally:
            conn.close()

    # ------------------------------------------------------------------------------- serving

    def _serve(self, conn: socket.socket, ident: Identity | None = None,
               prefix: bytes = b"") -> None:
        sink: Sink | None = None
        ident = ident or Identity(sock=conn)
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            parser = RequestParser(self.limits)
            while not self._stopping.is_set():
                if prefix:
                    data, prefix = prefix, b""
                else:
                    conn.settimeout(self.idle_timeout if parser.idle else self.io_timeout)
                    try:
                        data = conn.recv(RECV_SIZE)
                    except TimeoutError:
                        self._count("timeout_idle" if parser.idle else "timeout_midframe")
                        return
                events = parser.feed(data) if data else parser.eof()
                for ev in events:
                    if isinstance(ev, RequestHead):
                        self._count(f"op_{op_name(ev.op)}")
                        sink = self._gate(ev, ident) or self._begin(ev)
                    elif isinstance(ev, PayloadChunk):
                        assert sink is not None
                        sink = self._write(sink, ev.data)
                    elif isinstance(ev, FrameEnd):
                        assert sink is not None
                        reply = self._finish(sink)
                        sink = None
                        if not self._send(conn, reply):
                            return
                    elif isinstance(ev, FrameError):
                        self._count("bad_frame")
                        log.info("wire: closing a connection: %s", ev.message)
                        if data:  # the peer is still there to read why
                            self._send(conn, error(ev.status, ev.message))
                        return
                if not data:
                    return
        except OSError as e:
            self._count("io_error")
            log.debug("wire connection ended: %s", e)
        finally:
            if sink is not None:
                sink.abort()
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    # ------------------------------------------------------------------------- authentication

    def _gate(self, head: RequestHead, ident: Identity) -> Sink | None:
        """None when the client may send this op; else the sink that refuses it (the payload
        is drained, so the connection stays in step). Decided at the header."""
        t = self.trust
        try:
            t.present(ident, head.trace)
            op = head.op
            if op in CHANGES:
                gated = True
            elif op in READS:
                gated = t.reads_need_auth(self._reads() if self._reads is not None else None)
            else:
                gated = False  # NOT_IMPLEMENTED either way
            if not gated or t.authenticated(ident):
                return None
        except Exception:  # noqa: BLE001 - a failed check refuses; it never lets through
            log.exception("wire: authentication check failed")
            return Drain(error(Status.ERROR, "authentication check failed on the server"))
        why = t.why(ident, op_name(op))
        if op == Op.CONFIGURE:
            return Buffered(head, lambda h, p: self._configure_unauthenticated(p, ident, why))
        t.refuse("not_owner", f"{op_name(op)} from {ident.describe()}")
        return Drain(error(Status.ERROR, why, unauthenticated=True))

    def _configure_unauthenticated(self, payload: bytes, ident: Identity, why: str) -> Reply:
        """Hydra.Core greets every connection with CONFIGURE {"state_chunk_size": N}: from a
        client that may not change anything it is answered (the size in force is echoed, not
        changed), so a read-only coordinator still connects. Anything else is refused."""
        try:
            body = json.loads(payload) if payload.strip() else {}
        except (UnicodeDecodeError, ValueError):
            body = None
        if isinstance(body, dict) and set(body) == {tiers.STATE_CHUNK_KEY}:
            return Reply(Status.OK, {
                "success": True, "applied": False, "noop": True, "tier": None,
                "params_applied": {}, "unchanged": [], "unknown_keys": [],
                "deferred_keys": [], "state_chunk_size_applied": self.handlers.chunk_size,
                "not_applied": f"state_chunk_size kept at {self.handlers.chunk_size}: {why}",
            })
        self.trust.refuse("not_owner", f"CONFIGURE from {ident.describe()}")
        return error(Status.ERROR, why, unauthenticated=True)

    # The three calls below are the boundary between the transport and the handlers, which
    # call into the engine (the engine's code, llama-server over HTTP, the file system). Whatever
    # goes wrong in there is answered as ERROR on this request; the connection and the server
    # keep going. That is why they catch Exception: a bug in a handler must cost one request,
    # never the server.

    def _begin(self, head: RequestHead) -> Sink:
        try:
            return self.handlers.begin(head)
        except Exception as e:  # noqa: BLE001 - see above
            log.exception("wire %s: failed at the header", op_name(head.op))
            return Drain(error(Status.ERROR, f"{op_name(head.op)} failed: {e}"))

    def _write(self, sink: Sink, data: bytes) -> Sink:
        try:
            sink.write(data)
            return sink
        except Exception as e:  # noqa: BLE001 - see above
            log.exception("wire: writing a request payload failed")
            sink.abort()
            return Drain(error(Status.ERROR, f"storing the payload failed: {e}"))

    def _finish(self, sink: Sink) -> Reply:
        try:
            return self.handlers.finish(sink)
        except Exception as e:  # noqa: BLE001 - see above
            log.exception("wire: handler failed")
            sink.abort()
            return error(Status.ERROR, f"{type(e).__name__}: {e}")

    def _send(self, conn: socket.socket, reply: Reply) -> bool:
        """Write one reply; False when the connection is no longer usable."""
        self._count(f"status_{Status(reply.status).name if reply.status <= 6 else reply.status}")
        conn.settimeout(self.io_timeout)
        try:
            size = reply.stream_len if reply.stream is not None else len(reply.payload)
            try:
                head = codec.response_header(reply.status, reply.meta, size)
            except (TypeError, ValueError) as e:  # meta not JSON-able or too big
                log.error("wire: reply meta unusable: %s", e)
                reply.close()
                head = codec.response_header(Status.ERROR, {"error": f"reply meta: {e}"}, 0)
                conn.sendall(head)
                return True
            if reply.stream is None:
                conn.sendall(head + reply.payload)
                return True
            conn.sendall(head)
            offset = 0
            chunk = max(tiers.STATE_CHUNK_MIN, reply.chunk)
            while offset < size:
                n = conn.sendfile(reply.stream, offset, min(chunk, size - offset))
                if n == 0:  # the file shrank under us: the frame cannot be completed
                    log.error("wire: state file ended at %d of %d bytes", offset, size)
                    return False
                offset += n
            return True
        except OSError as e:
            log.info("wire: sending a reply failed: %s", e)
            return False
        finally:
            reply.close()
