"""Background OpenAI clients sending requests the whole time (tests/test_switch.py,
tests/test_standby.py, bench/switch.py): a request that had not started must never fail.

The openai package (the `dev` extra) is imported when a Load is made, so that importing this
module needs none (a test module skips without it: `pytest.importorskip("openai")`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types.chat import ChatCompletionMessageParam


class Load:
    """Background clients: one streaming, one not, each on a pooled keep-alive connection."""

    def __init__(self, port: int, model: str = "x") -> None:
        import openai

        self.client: OpenAI = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                            api_key="none", max_retries=0, timeout=300)
        self.ok = 0
        self.failures: list[str] = []  # requests that failed before any response byte
        self.cut: list[str] = []  # streams cut after their first chunk (allowed to fail)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(s,), daemon=True)
                        for s in (False, True)]

    def _one(self, stream: bool, started: list[bool]) -> None:
        msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hi"}]
        if stream:
            stream_ = self.client.chat.completions.create(
                model="x", messages=msgs, max_tokens=8, stream=True)
            started[0] = True  # the response began (status line and headers arrived)
            for _chunk in stream_:
                pass
        else:
            r = self.client.chat.completions.create(model="x", messages=msgs, max_tokens=8)
            assert r.choices
        self.ok += 1

    def _loop(self, stream: bool) -> None:
        while not self.stop.is_set():
            started = [False]
            try:
                self._one(stream, started)
            except Exception as exc:  # noqa: BLE001 - every failure is a finding
                what = f"{'stream' if stream else 'plain'}: {exc!r}"
                (self.cut if started[0] else self.failures).append(what)
            time.sleep(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
