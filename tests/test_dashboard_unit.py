"""The dashboard without a browser or a hydra: its request checks (WSGI environs), the log
reader's cursor across a restart and a truncation, the snapshot publisher, and the bench plot
page (self-contained: nothing fetched from the network)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.cli import benchplot
from hydra_supervisor.dashboard import Dashboard, Publisher
from hydra_supervisor.dashboard import app as dash_app
from hydra_supervisor.dashboard.feed import read_log
from hydra_supervisor.errors import HydraError
from hydra_supervisor.serve.snapshot import DaemonInfo, Snapshot

PORT = "9123"


@pytest.fixture(autouse=True)
def _peer_is_me(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's answer for who owns the client's socket: this test's user."""
    monkeypatch.setattr(dash_app, "peer_uid", lambda peer, local: os.getuid())


def _snap(n: int = 0) -> Snapshot:
    return Snapshot(daemon=DaemonInfo(pid=n, started=0.0, state_dir="/s"), taken=0.0)


def _dash() -> Dashboard:
    return Dashboard(Publisher(_snap))


def _environ(method: str = "POST", path: str = "/api/reload", **headers: str) -> dict[str, Any]:
    env: dict[str, Any] = {"REQUEST_METHOD": method, "PATH_INFO": path, "SERVER_PORT": PORT,
                           "HTTP_HOST": f"127.0.0.1:{PORT}", "wsgi.input": io.BytesIO(b"{}"),
                           "CONTENT_LENGTH": "2", "CONTENT_TYPE": "application/json",
                           "hydra.peer": ("127.0.0.1", 40000),
                           "hydra.local": ("127.0.0.1", int(PORT))}
    for k, v in headers.items():
        key = k.upper()
        env[key if key in ("CONTENT_TYPE",) else f"HTTP_{key}"] = v
    return env


def test_a_same_origin_post_with_the_token_passes_and_every_cross_site_form_is_refused():
    d = _dash()
    origin = f"http://127.0.0.1:{PORT}"
    good = _environ(ORIGIN=origin, X_HYDRA_TOKEN=d.token)
    assert d.check_post(good) is None
    assert d.check_post({**good, "HTTP_ORIGIN": None, "HTTP_REFERER": origin + "/"}) is None
    bad = {
        "another origin": {**good, "HTTP_ORIGIN": "http://evil.example"},
        "another loopback port": {**good, "HTTP_ORIGIN": "http://127.0.0.1:1"},
        "no origin nor referer": {k: v for k, v in good.items() if k != "HTTP_ORIGIN"},
        "a referer elsewhere": {**{k: v for k, v in good.items() if k != "HTTP_ORIGIN"},
                                "HTTP_REFERER": "http://evil.example/"},
        "cross-site fetch metadata": {**good, "HTTP_SEC_FETCH_SITE": "cross-site"},
        "no token": {k: v for k, v in good.items() if k != "HTTP_X_HYDRA_TOKEN"},
        "an older hydra's token": {**good, "HTTP_X_HYDRA_TOKEN": _dash().token},
        "a form's content type": {**good, "CONTENT_TYPE": "application/x-www-form-urlencoded"},
        "a rebound host name": {**good, "HTTP_HOST": f"evil.example:{PORT}",
                                "HTTP_ORIGIN": f"http://evil.example:{PORT}"},
    }
    for what, env in bad.items():
        assert d.check_post(env) is not None, what


def _call(d: Dashboard, env: dict[str, Any]) -> tuple[str, dict[str, str], bytes]:
    seen: dict[str, Any] = {}

    def start(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    def metrics_app(e: dict[str, Any], s: Any) -> list[bytes]:
        s("200 OK", [])
        return [b"metrics"]

    body = b"".join(d.wrap(metrics_app)(env, start))
    return seen["status"], seen["headers"], body


def test_routes_refuse_a_foreign_host_and_send_a_strict_policy():
    d = _dash()
    status, headers, body = _call(d, _environ("GET", "/", HOST=f"evil.example:{PORT}"))
    assert status.startswith("403")
    status, headers, body = _call(d, _environ("GET", "/"))
    assert status.startswith("200") and d.token.encode() in body
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    # /metrics is the metrics server's, untouched; static files cannot escape their dir
    assert _call(d, _environ("GET", "/metrics"))[2] == b"metrics"
    assert _call(d, _environ("GET", "/static/../app.py"))[0].startswith("404")
    assert _call(d, _environ("GET", "/static/vendor/uPlot.iife.min.js"))[0].startswith("200")
    # an action refused by the checks never reaches a handler
    status, _, body = _call(d, _environ(ORIGIN="http://evil.example", X_HYDRA_TOKEN=d.token))
    assert status.startswith("403") and b"cross-site" in body and d.refused == 2


def test_an_allowed_action_runs_the_control_handler_on_the_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    calls: list[tuple[dict[str, Any], bool]] = []

    async def reload(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        calls.append((body, asyncio.get_running_loop() is loop))
        return 409, {"error": "a switch is already running"}

    try:
        d = _dash()
        d.bind(loop, {("POST", "/reload"): reload})
        status, _, body = _call(d, _environ(ORIGIN=f"http://127.0.0.1:{PORT}",
                                            X_HYDRA_TOKEN=d.token))
        assert status.startswith("409") and json.loads(body)["error"]
        assert calls == [({}, True)]
        assert d.actions[-1]["result"] == "failed" and d.actions[-1]["code"] == 409
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_load_and_unload_reach_the_control_handlers_with_their_bodies():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    calls: list[tuple[str, dict[str, Any]]] = []

    def handler(what: str) -> Any:
        async def run(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            calls.append((what, body))
            return 200, {"result": "ok", "message": f"{what} done."}
        return run

    try:
        d = _dash()
        d.bind(loop, {("POST", "/load"): handler("load"), ("POST", "/unload"): handler("unload")})
        for path, body in (("/api/load", {"profile": "demo"}), ("/api/unload", {"all": True})):
            env = _environ("POST", path, ORIGIN=f"http://127.0.0.1:{PORT}",
                           X_HYDRA_TOKEN=d.token)
            raw = json.dumps(body).encode()
            env.update({"wsgi.input": io.BytesIO(raw), "CONTENT_LENGTH": str(len(raw))})
            status, _, reply = _call(d, env)
            assert status.startswith("200"), reply
        assert calls == [("load", {"profile": "demo"}), ("unload", {"all": True})]
        assert [(a["action"], a["arg"], a["message"]) for a in d.actions] == [
            ("load", "demo", "load done."), ("unload", "all", "unload done.")]
        # the same checks as every action: no token, no action
        env = _environ("POST", "/api/unload", ORIGIN=f"http://127.0.0.1:{PORT}")
        assert _call(d, env)[0].startswith("403") and len(calls) == 2
        # a hydra without the route says so (not "not ready")
        d.bind(loop, {})
        env = _environ("POST", "/api/load", ORIGIN=f"http://127.0.0.1:{PORT}",
                       X_HYDRA_TOKEN=d.token)
        status, _, reply = _call(d, env)
        assert status.startswith("404") and b"no load action" in reply
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_hydras_own_log_is_in_the_picker_and_readable(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "hydra.log").write_text("2026-01-01 00:00:00 INFO ready\n")
    snap = Snapshot(daemon=DaemonInfo(pid=4321, started=0.0, state_dir=str(tmp_path)),
                    taken=0.0)
    d = Dashboard(Publisher(lambda: snap))
    d.publisher.put(snap)
    status, _, body = _call(d, _environ("GET", "/api/log") | {"QUERY_STRING": "name=hydra"})
    reply = json.loads(body)
    assert status.startswith("200") and not reply.get("gone"), reply
    assert reply["pid"] == 4321 and "INFO ready" in reply["text"]
    status, _, body = _call(d, _environ("GET", "/api/log") | {"QUERY_STRING": "name=nope"})
    assert json.loads(body)["gone"] and json.loads(body)["known"] == ["hydra"]


def test_the_publisher_takes_a_fresh_snapshot_on_the_loop_and_serves_it():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    on_loop: list[bool] = []

    def take() -> Snapshot:
        on_loop.append(threading.current_thread() is thread)
        return _snap(len(on_loop))

    try:
        pub = Publisher(take)
        assert pub.get()[0] is None  # not bound, nothing published: nothing to show
        pub.put(_snap(0))
        assert pub.get(max_age=60)[0] == _snap(0)
        pub.bind(loop)
        snap, age = pub.get(max_age=0)
        assert snap == _snap(1) and age < 1 and on_loop == [True]

        async def on_the_loop() -> Any:  # asked on the loop's own thread: taken there
            return pub.get(max_age=0)

        snap, _ = asyncio.run_coroutine_threadsafe(on_the_loop(), loop).result(5)
        assert snap == _snap(2) and on_loop == [True, True]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_the_log_reader_follows_a_new_file_and_a_truncation(tmp_path: Path):
    log = tmp_path / "x.log"
    log.write_text("partial\nline one\n")
    first = read_log(log, None, limit=10)  # the tail, from a line start
    assert first["text"] == "line one\n"
    log.write_text(log.read_text() + "line two\n")
    more = read_log(log, first["cursor"])
    assert more["text"] == "line two\n" and not more["restarted"]
    os.replace(tmp_path / "x.log", tmp_path / "x.log.1")  # a restart: a new file
    log.write_text("new run\n")
    again = read_log(log, more["cursor"])
    assert again["restarted"] and again["text"] == "new run\n"
    log.write_text("")  # truncated in place (a size rotation)
    with log.open("a") as f:
        f.write("after\n")
    cut = read_log(log, again["cursor"])
    assert cut["restarted"] and cut["text"] == "after\n"
    assert read_log(tmp_path / "gone.log", None)["missing"]


def test_bench_plot_levels_and_a_self_contained_page(tmp_path: Path):
    assert benchplot.parse_levels("1, 4,16,4") == [1, 4, 16]
    for bad in ("", "0", "1,x", "300"):
        with pytest.raises(HydraError):
            benchplot.parse_levels(bad)
    points = [{"leg": leg, "concurrency": c, "url": "u", "ok": 2, "requests": 2,
               "throughput_tps": 10.0 * c, "ttft_p50_ms": 100.0 * c, "ttft_p95_ms": None,
               "decode_p50_tps": 9.0} for leg in ("router", "direct") for c in (1, 4)]
    out = tmp_path / "b.html"
    benchplot.write(out, points, "t </script>")
    html = out.read_text()
    assert "uPlot" in html and '"leg": "direct"' in html
    assert "src=" not in html and "href=" not in html and "t </script>" not in html
    with pytest.raises(HydraError):
        benchplot.write(tmp_path / "b.svg", points, "t")
    if benchplot.chromium() is None:
        pytest.skip("no chromium: the .png path is not tried")
    png = tmp_path / "b.png"
    benchplot.write(png, points, "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_another_local_user_is_refused_and_named_users_pass(monkeypatch: pytest.MonkeyPatch):
    other = os.getuid() + 4242
    monkeypatch.setattr(dash_app, "peer_uid", lambda peer, local: other)
    d = _dash()
    status, _, body = _call(d, _environ("GET", "/"))
    assert status.startswith("403") and f"uid {other}".encode() in body
    assert d.token.encode() not in body
    monkeypatch.setattr(dash_app, "peer_uid", lambda peer, local: None)  # cannot be told
    assert _call(d, _environ("GET", "/api/state"))[0].startswith("403")
    monkeypatch.setenv("HYDRA_DASHBOARD_USERS", f"root, {other}, no-such-user-here")
    monkeypatch.setattr(dash_app, "peer_uid", lambda peer, local: other)
    assert _call(_dash(), _environ("GET", "/"))[0].startswith("200")
