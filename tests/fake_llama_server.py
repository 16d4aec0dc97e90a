#!/usr/bin/env python3
"""A stand-in llama-server for one fault a real binary cannot show on demand: /health answers
200 but every completion fails with 500 (a wedged model). It accepts llama-server's argv and
uses only --host and --port."""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._send(200, b'{"status":"ok"}')

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self._send(500, b'{"error":{"code":500,"message":"wedged"}}')

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    argv = sys.argv[1:]
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    port = int(argv[argv.index("--port") + 1])
    print(f"fake llama-server on {host}:{port}", flush=True)
    ThreadingHTTPServer((host, port), Handler).serve_forever()


if __name__ == "__main__":
    main()
