"""The router in front of real stock llama.cpp processes (Gemma 3 270M on the CPU build):
the official openai client streaming through it, --api-key passing through, hold/release, a
llama-server killed mid-stream and before answering, and a real COMBINE whose ggml-RPC link runs
through the router to a ggml-rpc-server."""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.testing.routerhelp import (
    HOST,
    free_port,
    gemma_path,
    llama_bins,
    llama_extra_args,
    llama_process,
    one_route,
    wait_health,
    wait_tcp,
    wait_until,
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
        "-c", "2048", "-t", "2", "-np", "1", "--api-key", API_KEY, *llama_extra_args(),
    ]  # fmt: skip
    log = tmp_path / "llama-server.log"
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        router = Router(HOST, 0, Upstreams(), name="solo")
        one_route(router, (HOST, port))
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

        wait_until(lambda: router.stats()["http"]["requests"] == 3, what="3 requests counted")
        st = router.stats()
        assert st["by_kind"]["http"] >= 1 and st["refused"] == {}
        assert st["http"]["4xx"] == 1 and st["http"]["2xx"] == 2


def test_combine_rpc_through_router(tmp_path: Path, router_factory: list[Router]) -> None:
    bins, model = llama_bins(), gemma_path()
    rpc_port, head_port = free_port(), free_port()
    rpc_log, head_log = tmp_path / "rpc-server.log", tmp_path / "head.log"
    # No -c: the weights themselves cross the router, not just tensor hashes.
    rpc_argv = [str(bins / "ggml-rpc-server"), "-H", HOST, "-p", str(rpc_port)]
    with llama_process(rpc_argv, rpc_log) as rpc_proc:
        wait_tcp(rpc_port, rpc_proc, rpc_log)
        router = Router(HOST, 0, Upstreams(rpc=(HOST, rpc_port)), name="combine")
        one_route(router, (HOST, head_port))
        router.start()
        router_factory.append(router)
        head_argv = [
            str(bins / "llama-server"), "-m", model,
            "--rpc", f"{HOST}:{router.port}",  # the peer, reached through the router
            "-ngl", "99", "-c", "2048", "-t", "2", "-np", "1",
            "--host", HOST, "--port", str(head_port), *llama_extra_args(),
        ]  # fmt: skip
        with llama_process(head_argv, head_log) as head:
            # /health through the router too: one external port for HTTP and ggml-RPC.
            # (Until the head listens, the router answers 503: counted as upstream errors.)
            wait_health(router.port, head, head_log)
            errors_when_ready = router.stats()["refused"].get("upstream_down", 0)
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
            assert "denied" not in st["refused"]
            assert st["refused"].get("upstream_down", 0) == errors_when_ready
            assert head.poll() is None and rpc_proc.poll() is None


def _server_argv(bins: Path, model: str, port: int) -> list[str]:
    return [
        str(bins / "llama-server"), "-m", model, "--host", HOST, "--port", str(port),
        "-c", "2048", "-t", "2", "-np", "1", "--chat-template", "gemma", "-n", "48",
        *llama_extra_args(),
    ]  # fmt: skip


@pytest.mark.timeout(900)
def test_hold_release_kill_and_retry_with_llama_server(
    tmp_path: Path, router_factory: list[Router]
) -> None:
    bins, model = llama_bins(), gemma_path()
    port = free_port()
    records: list[dict[str, object]] = []
    router = Router(HOST, 0, Upstreams(), name="solo", retry_wait=0.5,
                    on_request=records.append)
    lane = one_route(router, (HOST, port))
    router.start()
    router_factory.append(router)
    client = openai.OpenAI(base_url=f"http://{HOST}:{router.port}/v1", api_key="x",
                           timeout=300, max_retries=0)

    def ask(max_tokens: int = 4) -> str:
        reply = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=max_tokens, temperature=0)
        return reply.choices[0].message.content or ""

    log = tmp_path / "llama-server.log"
    with llama_process(_server_argv(bins, model, port), log) as proc:
        wait_health(port, proc, log)
        assert ask()

        # hold -> parked (llama-server sees nothing) -> release -> served.
        lane.hold("head restarting")
        answers: list[str] = []
        threads = [threading.Thread(target=lambda: answers.append(ask())) for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: router.stats()["held"] == 2, timeout=30, what="2 parked")
        assert lane.gate.inflight() == 0
        lane.release()
        for t in threads:
            t.join(300)
        assert len(answers) == 2 and all(answers)

        # Killed mid-stream: the openai client raises on the router's SSE error event.
        stream = client.chat.completions.create(
            model="gemma", messages=[{"role": "user", "content": "Count to one hundred."}],
            max_tokens=48, temperature=0, stream=True)
        with pytest.raises(openai.APIError, match="hydra router"):
            for i, _chunk in enumerate(stream):
                if i == 2:
                    proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert router.stats()["http"]["cut"] == 1

    # Dead before answering: the request is retried after the next release, and succeeds.
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(ask()))
    t.start()
    wait_until(lambda: router.stats()["http"]["retried"] == 1, timeout=30, what="refused once")
    lane.hold("head restarting after a crash")
    wait_until(lambda: router.stats()["held"] == 1, timeout=10, what="parked for its retry")
    log2 = tmp_path / "llama-server-2.log"
    with llama_process(_server_argv(bins, model, port), log2) as proc2:
        wait_health(port, proc2, log2)
        lane.release()
        t.join(300)
        assert result and result[0]
        assert isinstance(proc2, subprocess.Popen) and proc2.poll() is None
    assert lane.wait_idle(10) == 0
    assert {r["outcome"] for r in records} >= {"ok", "cut"}
