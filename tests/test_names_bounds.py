"""Issue 31 item 7: every name and size bounded. A profile's or device's name goes into file
names in the state dir (`../../escape` wrote a log outside it, `a/b` made subdirectories, `""`
was taken, 5,000 characters failed late): refused at load with file:line. `hydra synth` plans
its bytes before it writes one (`--layers 100000000` grew to 22 GB until the OOM killer came).
The dashboard's and the control API's request bodies are bounded (a huge Content-Length
logged a MemoryError)."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.config.config import load_node, load_profile
from hydra_supervisor.config.profile import name_problem
from hydra_supervisor.dashboard import Dashboard, Publisher
from hydra_supervisor.dashboard import app as dash_app
from hydra_supervisor.errors import ConfigError, HydraError
from hydra_supervisor.runtime import control
from hydra_supervisor.serve.snapshot import DaemonInfo, Snapshot
from hydra_supervisor.testing.harness import run_hydra
from hydra_supervisor.tools import synth

BAD_NAMES = ["../../escape", "a/b", "", "..", ".", ".hidden", "-p", "a" * 65, "a" * 5000,
             "sp ace", "tab\t", "é"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_profile_name_is_refused_at_load_naming_file_and_line(tmp_path, name):
    prof = tmp_path / "p.yaml"
    prof.write_text(f"description: x\nprofile: {json.dumps(name)}\nmodel: gemma3-270m\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(prof, load_node(None))
    assert f"{prof}:2: profile:" in str(exc.value) and "not a valid name" in str(exc.value)
    assert len(str(exc.value)) < 400  # 5,000 characters are not repeated back


@pytest.mark.parametrize("name", ["demo", "dense27b-combine", "a.b_c-9", "_x", "a" * 64])
def test_good_names_pass(name):
    assert name_problem(name) is None


def test_a_file_name_that_is_no_name_needs_a_profile_key(tmp_path):
    prof = tmp_path / ".hidden.yaml"
    prof.write_text("model: gemma3-270m\n")
    with pytest.raises(ConfigError, match=r"'\.hidden' is not a valid name"):
        load_profile(prof, load_node(None))
    prof.write_text("profile: hidden\nmodel: gemma3-270m\n")
    assert load_profile(prof, load_node(None)).name == "hidden"


def test_a_bad_device_name_is_refused_in_the_node_file(tmp_path):
    node = tmp_path / "node.yaml"
    node.write_text('devices:\n  "../x": {cpu: true}\n')
    with pytest.raises(ConfigError, match=rf"{node}:2: devices\.\.\./x: device '\.\./x' is not"):
        load_node(node)


def test_hydra_up_refuses_a_profile_named_to_escape(hydra_env, tmp_path):
    prof = tmp_path / "escape.yaml"
    prof.write_text("description: x\nprofile: ../../escape\nmodel: gemma3-270m\n")
    res = run_hydra(hydra_env, "up", "-p", str(prof), "--port", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{prof}:2: profile: '../../escape'" in errors[0], res.stderr
    state = Path(hydra_env["HYDRA_STATE_DIR"])
    assert not list(tmp_path.glob("**/escape*.log")) and not (state / "supervisor.json").exists()


# -- synth plans its bytes first ---------------------------------------------------------------


def test_synth_refuses_a_hundred_million_layers_at_once_with_the_bytes(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(HydraError) as exc:
        synth.write_dense(tmp_path / "x.gguf", n_layers=100_000_000)
    assert time.monotonic() - t0 < 10  # (the tokenizer's parse is most of it)
    msg = str(exc.value)
    assert "100,000,000 layers" in msg and "bytes of tensors" in msg and "at most 512" in msg
    assert list(tmp_path.iterdir()) == []


def test_synth_plans_the_bytes_it_writes(tmp_path):
    out = synth.write_dense(tmp_path / "x.gguf", n_layers=2, n_embd=64, n_ff=128)
    import gguf

    n_vocab = len(gguf.GGUFReader(out).fields["tokenizer.ggml.tokens"].data)
    size = synth.plan_bytes(n_layers=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=n_vocab,
                            qtype=synth.FTYPES["f16"][0], n_ff=128, n_expert=0)
    assert 0 < out.stat().st_size - size.data < 4 << 20  # the header and tokenizer: the rest


def test_synth_refuses_a_row_wider_than_memory_and_more_than_the_disk(tmp_path, monkeypatch):
    with pytest.raises(HydraError, match="bytes of memory"):
        synth.write_dense(tmp_path / "x.gguf", n_embd=4_000_000_000, n_head=4, n_head_kv=2)
    monkeypatch.setattr(synth.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000}))
    with pytest.raises(HydraError, match="has 1,000 bytes free"):
        synth.write_dense(tmp_path / "x.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "device", "directory-name"])
def test_synth_never_renames_its_file_over_a_fifo_or_device(tmp_path, kind):
    import os

    if kind == "fifo":
        target = tmp_path / "f"
        os.mkfifo(target)
        needle = "FIFO"
    elif kind == "device":
        target, needle = Path("/dev/null"), "a device"
    else:
        target, needle = tmp_path, "a directory"
    with pytest.raises(HydraError, match=needle):
        synth.write_dense(target)


# -- bounded request bodies --------------------------------------------------------------------

PORT = "18999"


def _dash_post(d: Dashboard, length: str, raw: bytes = b"{}") -> tuple[str, bytes]:
    env: dict[str, Any] = {"REQUEST_METHOD": "POST", "PATH_INFO": "/api/reload",
                           "SERVER_PORT": PORT, "HTTP_HOST": f"127.0.0.1:{PORT}",
                           "HTTP_ORIGIN": f"http://127.0.0.1:{PORT}",
                           "HTTP_X_HYDRA_TOKEN": d.token, "wsgi.input": io.BytesIO(raw),
                           "CONTENT_LENGTH": length, "CONTENT_TYPE": "application/json",
                           "hydra.peer": ("127.0.0.1", 40000),
                           "hydra.local": ("127.0.0.1", int(PORT))}
    seen: dict[str, str] = {}

    def start(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"] = status

    body = b"".join(d.wrap(lambda e, s: [b""])(env, start))
    return seen["status"], body


@pytest.mark.parametrize("length,code", [("99999999999999", "413"), ("-1", "413"),
                                         ("abc", "400")])
def test_a_dashboard_post_with_a_huge_or_bad_length_reads_nothing(monkeypatch, length, code):
    import os

    monkeypatch.setattr(dash_app, "peer_uid", lambda peer, local: os.getuid())
    d = Dashboard(Publisher(lambda: Snapshot(daemon=DaemonInfo(pid=0, started=0.0,
                                                               state_dir="/s"), taken=0.0)))
    status, body = _dash_post(d, length)
    assert status.startswith(code), (status, body)


def test_the_control_api_bounds_its_bodies(tmp_path):
    import asyncio

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def reload(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return 200, {"got": body}

    path = tmp_path / "c.sock"
    srv = control.ControlServer(path, loop, {("POST", "/reload"): reload})
    srv.start()

    def raw(head: str, body: bytes = b"") -> bytes:
        """One request (it closes the connection), the whole reply."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(path))
            s.sendall(head.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n").encode()
                      + body)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
            return got

    try:
        assert b" 413 " in raw("POST /reload HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n")
        assert b" 413 " in raw("POST /reload HTTP/1.1\r\nContent-Length: -5\r\n\r\n")
        assert b" 400 " in raw("POST /reload HTTP/1.1\r\nContent-Length: x\r\n\r\n")
        assert b" 400 " in raw("POST /reload HTTP/1.1\r\nContent-Length: 2\r\n\r\n", b"42")
        ok = raw("POST /reload HTTP/1.1\r\nContent-Length: 8\r\n\r\n", b'{"a": 1}')
        assert b" 200 " in ok and b'"got": {"a": 1}' in ok
    finally:
        srv.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
