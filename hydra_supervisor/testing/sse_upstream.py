"""A cheap stand-in for llama-server's HTTP API: keep-alive HTTP/1.1, OpenAI chat completions
streamed as SSE in chunked encoding (one chunk per token, like llama-server), and fault modes.

Each request's body steers it (extra keys llama-server would ignore):
  ``max_tokens`` tokens (default 8), ``x_delay`` seconds between tokens (default 0),
  ``x_die_after`` k: send k token events and then close the connection mid-stream,
  ``x_hang``: never answer (until the connection is closed).
Server-wide: ``drop_next`` requests are answered by closing the connection without a byte
(an upstream that died before answering). ``bodies`` keeps every parsed request body.

Run in-process (``StandIn()``), or as a child process for load tests (``python -m
hydra_supervisor.testing.sse_upstream``: prints its port, serves until stdin closes).
"""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time

HOST = "127.0.0.1"


def chunk_event(i: int, content: str | None, finish: str | None = None) -> bytes:
    obj = {
        "id": "chatcmpl-standin",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "standin",
        "choices": [{"index": 0, "delta": {} if content is None else {"content": content},
                     "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _number(value: object) -> int | float | str | None:
    """A request body's numeric knob as sent (a number, or a string int() and float() read),
    else None."""
    return value if isinstance(value, int | float | str) else None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes: no 40 ms stalls
    server: _Server

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        pass

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drop(self) -> bool:
        with self.server.lock:
            if self.server.drop_next <= 0:
                return False
            self.server.drop_next -= 1
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)
        return True

    def do_GET(self) -> None:  # noqa: N802 - stdlib's name
        with self.server.lock:
            self.server.requests += 1
        if self._drop():
            return
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "standin", "object": "model",
                                                         "created": 0, "owned_by": "x"}]})
        else:
            self._json(404, {"error": {"code": 404, "message": "not found"}})

    def do_POST(self) -> None:  # noqa: N802 - stdlib's name
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n)
        with self.server.lock:
            self.server.requests += 1
        try:
            body: dict[str, object] = json.loads(raw) if raw else {}
        except ValueError:
            body = {"_raw": raw.decode("latin-1")}
        with self.server.lock:
            self.server.bodies.append(body)
        if self._drop():
            return
        if body.get("x_hang"):
            while self.connection.recv(1, socket.MSG_PEEK):  # until the router gives up
                time.sleep(0.05)
            self.close_connection = True
            return
        tokens = int(_number(body.get("max_tokens")) or _number(body.get("n_predict")) or 8)
        delay = float(_number(body.get("x_delay")) or 0)
        die_after = _number(body.get("x_die_after"))
        if not body.get("stream"):
            time.sleep(delay * tokens)
            text = " ".join(f"t{i}" for i in range(tokens))
            self._json(200, {
                "id": "chatcmpl-standin", "object": "chat.completion", "created": 0,
                "model": "standin",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                          "total_tokens": tokens + 1},
            })
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        w = self.wfile
        for i in range(tokens):
            if die_after is not None and i >= int(die_after):
                w.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            ev = chunk_event(i, f"t{i} ")
            w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            w.flush()
            if delay:
                time.sleep(delay)
        for ev in (chunk_event(tokens, None, "stop"), b"data: [DONE]\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        w.write(b"0\r\n\r\n")
        w.flush()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048

    def __init__(self, port: int = 0) -> None:
        super().__init__((HOST, port), _Handler)
        self.lock = threading.Lock()
        self.requests = 0
        self.drop_next = 0
        self.bodies: list[dict[str, object]] = []

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client (the router) that went away mid-response is a tested case, not noise


class StandIn:
    def __init__(self, port: int = 0) -> None:
        self.server = _Server(port)
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()

    @property
    def addr(self) -> tuple[str, int]:
        return (HOST, int(self.server.server_address[1]))

    @property
    def port(self) -> int:
        return self.addr[1]

    @property
    def requests(self) -> int:
        return self.server.requests

    @property
    def bodies(self) -> list[dict[str, object]]:
        return self.server.bodies

    def drop(self, n: int) -> None:
        with self.server.lock:
            self.server.drop_next = n

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


def main() -> None:
    s = StandIn()
    print(s.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or dies)
    s.close()


if __name__ == "__main__":
    main()
