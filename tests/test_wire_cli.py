"""`hydra configure KEY=VALUE…` (the click command cli.py registers) against a WireServer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from hydra_supervisor.cli.configure_cmd import configure_command, parse_settings
from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.runtime import exits
from hydra_supervisor.wire.server import WireServer
from tests.wire_fakes import StubControl


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[WireServer, StubControl]]:
    control = StubControl(tmp_path)
    s = WireServer(control=control, port=0)
    s.start()
    yield s, control
    s.stop()


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(configure_command, list(args))
    return r.exit_code, r.output


def test_values_are_json_when_they_parse() -> None:
    assert parse_settings(("temperature=0.2", "ts=21/44", "jinja=true", "ot=[\"a=CPU\"]",
                           "ctk=q8_0")) == {"temperature": 0.2, "ts": "21/44", "jinja": True,
                                            "ot": ["a=CPU"], "ctk": "q8_0"}


def test_configure_cli(served: tuple[WireServer, StubControl]) -> None:
    server, control = served
    port = str(server.port)
    code, out = run("temperature=0.2", "n_predict=64", "-p", port)
    assert code == 0 and "applied (T1)" in out and "temperature=0.2" in out
    assert control.configured == [{"temperature": 0.2, "n_predict": 64}]
    code, out = run("temperature=0.2", "-p", port)
    assert code == 0 and "nothing to change" in out and "already set: temperature" in out
    code, out = run("n_ctx=4096", "-p", port)
    assert code == 0 and "applied (T2)" in out and "restarted: head" in out
    code, out = run("port=1234", "-p", port)
    assert code == 1 and "refused (ERROR)" in out and "restart hydra" in out
    code, out = run("tempurature=1", "-p", port)
    assert code == 1 and "unknown keys (ignored): tempurature" in out
    code, out = run("state_chunk_size=1", "--json", "-p", port)
    assert code == 0 and json.loads(out)["state_chunk_size_applied"] == 65536


def test_usage_errors() -> None:
    code, out = run("temperature", "-p", "1")
    assert code == 2 and "KEY=VALUE" in out
    code, out = run("-p", "1")
    assert code == 2
    code, out = run("--keys")
    assert code == 0 and "ctx_size" in out and "T2" in out


def test_nothing_listening_is_not_running() -> None:
    """A port where nothing listens: exit 3 (not running), like the other client commands."""
    code, out = run("top_k=3", "-p", str(free_port()), "--timeout", "2")
    assert code == exits.NOT_RUNNING and "cannot connect" in out, out


def test_a_bad_token_file_is_bad_input(tmp_path: Path) -> None:
    code, out = run("top_k=3", "-p", "1", "--token-file", str(tmp_path / "missing"))
    assert code == exits.BAD_INPUT and "missing does not exist" in out, out
