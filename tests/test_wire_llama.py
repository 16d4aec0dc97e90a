"""The wire server over REAL llama-servers (Gemma 3 270M, CPU build): a slot's KV moved with
STATE_GET from one head and STATE_PUT into a fresh head of the same model is served from cache
there (`timings.cache_n > 0`); PREFILL fills a slot and returns its state inline.

Gemma 3 is a sliding-window model: its slots restore with cache hits only when the server runs
with `--swa-full` (docs/protocol.md), so both heads get it, and `--slot-save-path` for the files.
`--no-repack`: with CPU weight repacking on, the greedy continuation after a restore differed
from the original one (seen: " The fox is a" vs " The quick brown fox"; repacked kernels serve
batches and single tokens by different code paths); without it the tokens match exactly.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from hydra_supervisor.testing.routerhelp import (
    HOST,
    free_port,
    gemma_path,
    llama_bins,
    llama_process,
    wait_health,
)
from hydra_supervisor.wire.server import WireServer
from tests import wire_client as wc

pytestmark = pytest.mark.slow

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 24) + "Tell me a story about a fox."


class LlamaControl:
    """A test EngineControl over one running llama-server: no switching, so T2/T3 CONFIGURE
    and SET_EXPERT_MODE are recorded (serve/engine_wire.py does the real thing)."""

    def __init__(self, port: int, slot_dir: Path, proc: subprocess.Popen[bytes]) -> None:
        self.port, self._slot_dir, self.proc = port, slot_dir, proc
        self.settings: dict[str, Any] = {"model": "gemma3-270m", "port": port}
        self.configured: list[dict[str, Any]] = []

    def info(self) -> dict[str, Any]:
        props = requests.get(f"http://{HOST}:{self.port}/props", timeout=5).json()
        return {"profile": "wire-test", "mode": "solo", "model": "gemma3-270m",
                "build": props.get("build_info"), "n_ctx":
                props.get("default_generation_settings", {}).get("n_ctx"),
                "processes": [{"name": "head", "pid": self.proc.pid, "state": "serving"}],
                "settings": dict(self.settings)}

    def configure(self, params: dict[str, Any]) -> dict[str, Any]:
        self.configured.append(params)
        self.settings.update(params)
        return {"restarted": []}

    def set_expert_mode(self, mode: str) -> dict[str, Any]:
        return {"mode": "solo"}

    def head_http(self) -> tuple[str, int] | None:
        return (HOST, self.port)

    def busy(self) -> bool:
        return False

    def slot_dir(self) -> Path:
        return self._slot_dir


@contextmanager
def gemma_head(tmp_path: Path, name: str, ctx: int = 2048) -> Iterator[LlamaControl]:
    bins, model = llama_bins(), gemma_path()
    slot_dir = tmp_path / f"slots-{name}"
    slot_dir.mkdir()
    port = free_port()
    argv = [
        str(bins / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
        "-c", str(ctx), "-t", "2", "-np", "1", "--swa-full", "--slot-save-path", str(slot_dir),
        "--chat-template", "gemma", "--no-repack",
    ]  # fmt: skip
    log = tmp_path / f"llama-{name}.log"
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        yield LlamaControl(port, slot_dir, proc)


def complete(port: int, prompt: str) -> dict[str, Any]:
    r = requests.post(f"http://{HOST}:{port}/completion", timeout=300, json={
        "prompt": prompt, "n_predict": 4, "temperature": 0, "id_slot": 0,
        "cache_prompt": True})
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture
def two_heads(tmp_path: Path) -> Iterator[tuple[LlamaControl, LlamaControl]]:
    with ExitStack() as stack:
        a = stack.enter_context(gemma_head(tmp_path, "a"))
        b = stack.enter_context(gemma_head(tmp_path, "b"))
        yield a, b


def serve(stack: ExitStack, control: LlamaControl) -> wc.WireClient:
    server = WireServer(control=control, port=0)
    server.start()
    stack.callback(server.stop)
    return stack.enter_context(wc.WireClient(HOST, server.port, timeout=300))


def test_state_moves_between_heads_with_cache_hits(
        two_heads: tuple[LlamaControl, LlamaControl]) -> None:
    a, b = two_heads
    with ExitStack() as stack:
        ca, cb = serve(stack, a), serve(stack, b)
        first = complete(a.port, PROMPT)
        n_prompt = first["timings"]["prompt_n"]
        assert n_prompt > 100

        assert ca.configure({"state_chunk_size": 65536}).meta["state_chunk_size_applied"] == 65536
        got = ca.request(wc.STATE_GET, "0")
        assert got.status == wc.OK, got.meta
        assert got.meta["n_past"] >= n_prompt and got.meta["state_size"] == len(got.payload) > 0

        put = cb.request(wc.STATE_PUT, "0", got.payload)
        assert put.status == wc.OK, put.meta
        assert put.meta["restored"] is True and put.meta["n_past"] == got.meta["n_past"]

        again = complete(b.port, PROMPT)
        assert again["timings"]["cache_n"] > 0, again["timings"]
        assert again["timings"]["cache_n"] >= n_prompt - 1
        assert again["content"] == first["content"]  # greedy, same state: same tokens

        meta = cb.request(wc.STATE_META, "0")
        assert meta.status == wc.OK and meta.meta["slot_id"] == 0
        assert cb.request(wc.STATE_META, "5").status == wc.NOT_FOUND
        assert cb.request(wc.STATE_GET, "5").status == wc.NOT_FOUND

        bad = cb.request(wc.STATE_PUT, "0", b"not a slot file" * 100)
        assert bad.status == wc.ERROR and "restore" in bad.meta["error"]
        assert requests.get(f"http://{HOST}:{b.port}/health", timeout=10).status_code == 200

        info = ca.info()
        assert info.status == wc.OK and info.meta["model"] == "gemma3-270m"
        assert info.meta["processes"][0]["pid"] == a.proc.pid

        # PREFILL on B (a chat body): generates nothing, returns the slot's state inline ...
        chat = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
        pre = cb.request(wc.PREFILL, "0", json.dumps(chat).encode())
        assert pre.status == wc.OK, pre.meta
        assert pre.meta["tokens_processed"] > 0 and len(pre.payload) == pre.meta["state_size"]
        # ... which restores on A and serves that chat from cache
        assert ca.request(wc.STATE_PUT, "0", pre.payload).status == wc.OK
        r = requests.post(f"http://{HOST}:{a.port}/v1/chat/completions", timeout=300,
                          json={**chat, "max_tokens": 2, "id_slot": 0, "cache_prompt": True})
        r.raise_for_status()
        assert r.json()["timings"]["cache_n"] > 0, r.json()["timings"]

    for d in (a.slot_dir(), b.slot_dir()):
        assert list(d.iterdir()) == []  # every state file was removed

    # keep_slots helpers: save every slot of A, restore into B (sharing the files), cache hits
    from hydra_supervisor.wire import slots

    complete(a.port, PROMPT)
    saved = slots.save_all((HOST, a.port), "keep", timeout=60)
    assert list(saved) == [0]
    for name in saved.values():
        (b.slot_dir() / name).write_bytes((a.slot_dir() / name).read_bytes())
    restored = slots.restore_all((HOST, b.port), saved, timeout=60)
    assert isinstance(restored[0], int) and restored[0] > 0, restored
    assert complete(b.port, PROMPT)["timings"]["cache_n"] > 0
