"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against a real
`hydra up -p demo -p demo-moe-combine --metrics-port P` (docs/dashboard.md).

One hydra serves the whole story (a 2-core box starts llama.cpp slowly): the page shows both
profiles and their states; a request through the API moves the counters; clicking "Switch to"
loads the other profile and the page shows it running; killing the head shows the restart and
the log follows the new process; cross-site POSTs (wrong Origin, no token, a rebound Host, a
form post from another site's page) are refused. Every wait has a deadline.

Screenshots go to the test's tmp dir; HYDRA_DASHBOARD_SHOTS=DIR also copies them there (the
docs' docs/dashboard*.png come from `HYDRA_DASHBOARD_SHOTS=docs`).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.testing.harness import (
    REPO,
    free_port,
    run_hydra,
    snapshot,
    status_json,
    wait_until,
)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync"]

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no system Chromium at {CHROMIUM} (Debian: apt-get install chromium; "
                "scripts/test installs it when run as root)", allow_module_level=True)

pytestmark = pytest.mark.slow

DEADLINE_MS = 30_000


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _profiles_with_metrics(tmp: Path) -> Path:
    """demo and demo-moe-combine as shipped, their heads with llama-server's --metrics (the
    tokens/s chart reads them); both files end in their server_args block."""
    out = tmp / "profiles"
    out.mkdir()
    for name in ("demo", "demo-moe-combine"):
        text = (REPO / "profiles" / f"{name}.yaml").read_text()
        (out / f"{name}.yaml").write_text(text.rstrip("\n") + "\n  metrics: true\n")
    return out


def _shot(page: Any, tmp: Path, name: str) -> None:
    path = tmp / name
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("HYDRA_DASHBOARD_SHOTS")
    if keep:
        shutil.copy(path, Path(keep) / name)


def test_dashboard_in_a_real_browser(hydra_up, hydra_env, tmp_path):
    t0 = time.monotonic()
    mport = free_port()
    up = hydra_up("-p", "demo", "-p", "demo-moe-combine", "--port", "0", "--metrics-port",
                  str(mport), "--profiles-dir", str(_profiles_with_metrics(tmp_path)))
    up.wait_ready()
    port = snapshot(hydra_env).ports[0].port
    base = f"http://127.0.0.1:{mport}"
    timings = {"hydra up": time.monotonic() - t0}

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(DEADLINE_MS)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
                    if r.status >= 400 else None)
            page.goto(base + "/")
            expect = sync_api.expect
            expect.set_options(timeout=DEADLINE_MS)

            # Both profiles and their states.
            demo = page.locator('#ports tr[data-profile="demo"]')
            moe = page.locator('#ports tr[data-profile="demo-moe-combine"]')
            expect(demo.locator("[data-state]")).to_have_text("serving")
            expect(moe.locator("[data-state]")).to_have_text("stopped")
            expect(page.locator('#processes tr[data-process="demo.head"] [data-state]')
                   ).to_have_text("READY")

            # A request through the API moves the counters (router and the head's tokens).
            body = {"model": "demo", "max_tokens": 8,
                    "messages": [{"role": "user", "content": "Hello"}]}
            for _ in range(2):
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    assert r.status == 200
                time.sleep(1.2)  # two samples apart: the charts draw a rate
            expect(demo.locator("[data-requests]")).to_have_text("2")
            state = _state(base)
            assert state["heads"]["demo"]["metrics"] is True
            assert state["heads"]["demo"]["predicted"] >= 1, state["heads"]
            expect(page.locator("#chart-requests .u-series").nth(1)).to_contain_text("demo")
            timings["counters"] = time.monotonic() - t0
            _shot(page, tmp_path, "dashboard.png")

            # Cross-site POSTs are refused, and nothing switches.
            token = page.locator('meta[name="hydra-token"]').get_attribute("content")
            assert token
            url = base + "/api/switch"
            good = {"Content-Type": "application/json", "Origin": base, "X-Hydra-Token": token}
            refusals = {
                "wrong Origin": {**good, "Origin": "http://evil.example"},
                "no token": {k: v for k, v in good.items() if k != "X-Hydra-Token"},
                "wrong token": {**good, "X-Hydra-Token": "x" * 43},
                "no Origin, no Referer": {k: v for k, v in good.items() if k != "Origin"},
                "a rebound Host": {**good, "Host": f"evil.example:{mport}"},
                "a form's content type": {**good, "Content-Type": "text/plain"},
            }
            for what, headers in refusals.items():
                code, reply = _post(url, {"profile": "demo-moe-combine"}, headers)
                assert code == 403, (what, code, reply)
            # ... and from another site's page in the browser: a no-cors fetch (the simple
            # request a form sends, no preflight). The other site is another loopback port
            # (Chromium itself blocks a public site's requests to loopback before they leave).
            refused = _state(base)["refused"]
            with _other_site() as other:
                evil = browser.new_page()
                evil.goto(other)
                evil.evaluate("""url => fetch(url, {method: 'POST', mode: 'no-cors',
                    headers: {'Content-Type': 'text/plain'},
                    body: JSON.stringify({profile: 'demo-moe-combine'})}).catch(() => null)""",
                              url)
                evil.close()
            wait_until(lambda: _state(base)["refused"] > refused, 10,
                       "hydra to refuse the other site's POST")
            assert "cross-site request refused (Origin 'http://127.0.0.1:" in up.output()
            assert _states(base)["demo-moe-combine"] == "stopped"

            # Click "Switch to": the other profile loads and the page shows it.
            moe.locator('button[data-action="switch"]').click()
            expect(moe.locator("[data-state]")).to_have_text("serving", timeout=120_000)
            expect(page.locator('#actions li[data-result="ok"]')).to_contain_text(
                "switch to demo-moe-combine")
            timings["switch"] = time.monotonic() - t0

            # demo shares the CPU with it: the switch stopped demo (and the page says so).
            expect(demo.locator("[data-state]")).to_have_text("stopped")
            expect(page.locator('#switches')).to_contain_text("demo → demo-moe-combine")

            # Kill the head: the page shows the restart and the log follows the new process.
            head = next(e["name"] for e in status_json(hydra_env)["status"]["engines"]
                        if e["role"] == "head")
            row = page.locator(f'#processes tr[data-process="{head}"]')
            row.locator('button[data-action="log"]').click()
            info = page.locator("#log-info")
            old_pid = up.engine(head)["pid"]
            expect(info).to_have_attribute("data-pid", str(old_pid))
            os.kill(old_pid, signal.SIGKILL)
            expect(row.locator("[data-restarts]")).to_have_text("1", timeout=60_000)
            expect(row.locator("[data-state]")).to_have_text("READY", timeout=60_000)
            new_pid = up.engine(head)["pid"]
            assert new_pid != old_pid
            expect(info).to_have_attribute("data-pid", str(new_pid))
            log = page.locator("#log")
            expect(log).to_contain_text(str(new_pid))  # a line that marks the new run

            def new_run_listens() -> bool:  # the lines after the last new-run mark
                text = log.inner_text()
                at = max(text.rfind(f"{head}: a new run"), text.rfind(f"{head} restarted"))
                return at >= 0 and "listening on" in text[at:]

            wait_until(new_run_listens, 60, "the log to show the new run's start")
            timings["restart"] = time.monotonic() - t0
            _shot(page, tmp_path, "dashboard-restart.png")
            assert not errors, sorted(set(errors))  # no script error, CSP violation, 4xx
        finally:
            browser.close()

    # hydra bench draws: a sweep through the router and straight to the head, as a .png
    # (the chart page rendered by the same headless Chromium).
    plot = tmp_path / "bench.png"
    res = run_hydra(hydra_env, "bench", "-p", "demo-moe-combine", "--profiles-dir",
                    str(tmp_path / "profiles"), "--concurrency", "1,2", "--requests", "2",
                    "--max-tokens", "8", "--prompt-words", "10", "--plot", str(plot), "--json",
                    timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert {(p["leg"], p["concurrency"]) for p in rep["points"]} == {
        ("router", 1), ("direct", 1), ("router", 2), ("direct", 2)}
    assert all(p["ok"] == p["requests"] and p["throughput_tps"] > 0 for p in rep["points"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timings["bench"] = time.monotonic() - t0
    print("timings (s since start):", {k: round(v, 1) for k, v in timings.items()})


@contextlib.contextmanager
def _other_site() -> Iterator[str]:
    """Another origin on loopback (a page Chromium will let reach loopback): its URL."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - stdlib's name
            data = b"<!doctype html><p>another site</p>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/"
    finally:
        srv.shutdown()
        srv.server_close()


def _state(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/api/state", timeout=30) as r:
        return dict(json.load(r))


def _states(base: str) -> dict[str, str]:
    return {lane["profile"]: lane["state"] for p in _state(base)["snapshot"]["ports"]
            for lane in p["lanes"]}
