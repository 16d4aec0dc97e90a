"""The router in front of real stock llama.cpp processes (Gemma 3 270M on the CPU build):
the official openai client streaming through it, --api-key passing through, and a real COMBINE
whose ggml-RPC link runs through the router to a ggml-rpc-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hydra_supervisor.router import Router, Upstreams
from tests.helpers_router import (
    HOST,
    free_port,
    gemma_path,
    llama_bins,
    llama_process,
    wait_health,
    wait_tcp,
)

pytestmark = pytest.mark.slow

API_KEY = "sk-hydra-test"


@pytest.fixture
def router_factory() -> Iterator[list[Router]]:
    routers: list[Router] = []
    yield routers
    for r in routers:
        r.stop()


def _stream_text(client: openai.OpenAI) -> tuple[str, int]:
    stream = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        extra_body={"cache_prompt": False},  # same computation both times, so same tokens
    )
    parts = []
    chunks = 0
    for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts), chunks


def test_openai_client_streams_through_router(tmp_path: Path, router_factory: list[Router]) -> None:
    bins, model = llama_bins(), gemma_path()
    port = free_port()
    argv = [
        str(bins / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
        "-c", "2048", "-t", "2", "-np", "1", "--api-key", API_KEY,
    ]  # fmt: skip
    log = tmp_path / "llama-server.log"
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        router = Router(HOST, 0, Upstreams(http=(HOST, port)), name="solo")
        router.start()
        router_factory.append(router)

        direct = openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key=API_KEY, timeout=60)
        routed = openai.OpenAI(
            base_url=f"http://{HOST}:{router.port}/v1", api_key=API_KEY, timeout=60
        )
        want, want_chunks = _stream_text(direct)
        got, got_chunks = _stream_text(routed)
        assert want and got == want and got_chunks == want_chunks

        # --api-key is llama-server's, and the router passes it through untouched.
        wrong = openai.OpenAI(base_url=f"http://{HOST}:{router.port}/v1", api_key="nope")
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert routed.models.list().data

        st = router.stats()
        assert st["by_kind"]["http"] >= 3 and st["upstream_errors"] == 0


def test_combine_rpc_through_router(tmp_path: Path, router_factory: list[Router]) -> None:
    bins, model = llama_bins(), gemma_path()
    rpc_port, head_port = free_port(), free_port()
    rpc_log, head_log = tmp_path / "rpc-server.log", tmp_path / "head.log"
    # No -c: the weights themselves cross the router, not just tensor hashes.
    rpc_argv = [str(bins / "ggml-rpc-server"), "-H", HOST, "-p", str(rpc_port)]
    with llama_process(rpc_argv, rpc_log) as rpc_proc:
        wait_tcp(rpc_port, rpc_proc, rpc_log)
        router = Router(
            HOST,
            0,
            Upstreams(http=(HOST, head_port), rpc=(HOST, rpc_port)),
            name="combine",
        )
        router.start()
        router_factory.append(router)
        head_argv = [
            str(bins / "llama-server"), "-m", model,
            "--rpc", f"{HOST}:{router.port}",  # the peer, reached through the router
            "-ngl", "99", "-c", "2048", "-t", "2", "-np", "1",
            "--host", HOST, "--port", str(head_port),
        ]  # fmt: skip
        with llama_process(head_argv, head_log) as head:
            # /health through the router too: one external port for HTTP and ggml-RPC.
            # (Until the head listens, the router answers 503: counted as upstream errors.)
            wait_health(router.port, head, head_log)
            errors_when_ready = router.stats()["upstream_errors"]
            client = openai.OpenAI(base_url=f"http://{HOST}:{router.port}/v1", api_key="x")
            reply = client.chat.completions.create(
                model="gemma",
                messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=8,
                temperature=0,
            )
            assert reply.choices[0].message.content
            assert reply.usage is not None and reply.usage.completion_tokens > 0
            st = router.stats()
            assert st["by_kind"]["rpc"] >= 1 and st["open"] >= 1  # the head holds its link
            assert st["bytes_up"] > 100_000_000  # the model's weights went through the router
            assert st["denied"] == 0 and st["upstream_errors"] == errors_when_ready
            assert head.poll() is None and rpc_proc.poll() is None
