"""Stand-ins for the wire server's tests: an EngineControl stub and a fake slot API.

The fake implements just the part of llama-server's HTTP API the wire handlers call (slot
save/restore into a directory, /slots, and a prefill that fills a slot), so opcode and fuzz
tests run in milliseconds; tests/test_wire_llama.py proves the same calls on a real binary.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.wire.control import ConfigureRefused, EngineControl


class StubControl:
    """EngineControl with settable state; records what the wire server asked for."""

    def __init__(self, slot_dir: Path, head: tuple[str, int] | None = None) -> None:
        self._slot_dir = slot_dir
        self.head = head
        self.is_busy = False
        self.settings: dict[str, object] = {"port": 8080, "model": "gemma3-270m"}
        self.configured: list[dict[str, object]] = []
        self.modes: list[str] = []
        self.refuse: str | None = None
        self.explode = False

    def info(self) -> dict[str, object]:
        if self.explode:
            raise RuntimeError("engine state unavailable")
        return {"profile": "demo", "mode": "solo", "model": "gemma3-270m",
                "settings": dict(self.settings)}

    def configure(self, params: dict[str, object]) -> dict[str, list[str]]:
        if self.refuse:
            raise ConfigureRefused(self.refuse)
        self.configured.append(params)
        self.settings.update(params)
        return {"restarted": [] if all(k in ("temperature", "top_k") for k in params)
                else ["head"]}

    def set_expert_mode(self, mode: str) -> dict[str, str]:
        if self.refuse:
            raise ConfigureRefused(self.refuse)
        self.modes.append(mode)
        return {"mode": mode}

    def head_http(self) -> tuple[str, int] | None:
        return self.head

    def busy(self) -> bool:
        return self.is_busy

    def slot_dir(self) -> Path:
        return self._slot_dir


# The stub is an EngineControl (what the wire server fronts): mypy checks it here.
_AS_CONTROL: Callable[[Path], EngineControl] = StubControl


class FakeSlots:
    """A fake llama-server slot API on 127.0.0.1 over `slot_dir`; slot states are bytes."""

    def __init__(self, slot_dir: Path, n_slots: int = 2) -> None:
        self.slot_dir = slot_dir
        self.states: dict[int, bytes] = {i: b"" for i in range(n_slots)}
        self.requests: list[tuple[str, str, JSONObject]] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def _send(self, code: int, body: JSONValue) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, [{"id": i, "n_ctx": 4096, "is_processing": False,
                                  "n_past": len(s) // 16} for i, s in fake.states.items()])

            def do_POST(self) -> None:  # noqa: N802
                body: JSONObject = json.loads(
                    self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                url = urlparse(self.path)
                fake.requests.append(("POST", url.path, body))
                if url.path.startswith("/slots/"):
                    slot = int(url.path.split("/")[2])
                    action = parse_qs(url.query)["action"][0]
                    if slot not in fake.states:
                        return self._send(400, {"error": {"code": 400,
                                                          "message": "Invalid slot ID"}})
                    name = body["filename"]
                    assert isinstance(name, str), name  # a bare file name (wire/slots.py)
                    path = fake.slot_dir / name
                    if action == "save":
                        path.write_bytes(fake.states[slot])
                        return self._send(200, {"id_slot": slot, "n_saved":
                                                len(fake.states[slot]) // 16,
                                                "n_written": len(fake.states[slot]),
                                                "timings": {"save_ms": 1.0}})
                    data = path.read_bytes()
                    fake.states[slot] = data
                    return self._send(200, {"id_slot": slot, "n_restored": len(data) // 16,
                                            "n_read": len(data), "timings": {"restore_ms": 1}})
                prefill_slot = body["id_slot"]
                assert isinstance(prefill_slot, int), prefill_slot  # a prefill names its slot
                text = json.dumps(body.get("messages") or body.get("prompt")).encode()
                fake.states[prefill_slot] = hashlib.sha256(text).digest() * 4096  # 128 KiB
                return self._send(200, {"content": "", "timings": {
                    "prompt_n": 42, "prompt_ms": 3.5, "cache_n": 0}})

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    @property
    def addr(self) -> tuple[str, int]:
        return ("127.0.0.1", int(self._httpd.server_address[1]))

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
