"""The dashboard in a real browser: Debian's Chromium driven by Playwright, against real
`hydra up` runs with a metrics port (docs/dashboard.md), looked at the way a user does: at
idle, under a few streams, during a drain, after a kill, with a standby pair, after hydra
stopped.

`hydra up -p demo -p demo-moe-combine` (profiles as shipped: no llama-server --metrics): the page
shows both profiles and their states and hydra's own log; while streams decode the profile's row
shows them in flight with a non-zero tokens/s (hydra's own count) and the request table marks
them running, then records each with its TTFT and tokens; cross-site POSTs (wrong Origin, no
token, a rebound Host, a form post from another site's page) are refused; Unload with streams
in flight shows "draining" in the header until they finish; "Switch to" loads the other
profile, lists the switch once and says its reply in a sentence; Unload all and Load do what
they say; killing the head shows "recovering", the restart, and the log following the new
process. `hydra up -p demo-moe-combine`: the standby pair is one port block with an active and
a standby row; once hydra stops the page says "hydra stopped" and every button is disabled.
Every wait has a deadline.

Screenshots go to the test's tmp dir; HYDRA_DASHBOARD_SHOTS=DIR also copies them there (the
docs' docs/dashboard*.png come from `HYDRA_DASHBOARD_SHOTS=docs`).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
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
    free_port,
    lanes,
    run_hydra,
    snapshot,
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


def _shot(page: Any, tmp: Path, name: str) -> None:
    path = tmp / name
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("HYDRA_DASHBOARD_SHOTS")
    if keep:
        shutil.copy(path, Path(keep) / name)


def _stream(port: int, model: str, max_tokens: int) -> threading.Thread:
    """A streaming chat request read to its end, in a thread (its tokens are what the page
    counts)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story about the sea."}]}

    def run() -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=180) as r:
            while r.readline():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# Records every word and line the header shows (a state as short as a restart's ~1 s is seen
# even between the test's own looks).
WATCH_HEADER = """() => { window.hydraWords = []; const box = document.querySelector('#summary');
  new MutationObserver(() => { const w = document.querySelector('#state-word');
    const d = document.querySelector('#state-detail');
    const t = w ? `${w.textContent}:${d ? d.textContent : ''}` : null;
    if (t && window.hydraWords[window.hydraWords.length - 1] !== t) window.hydraWords.push(t);
  }).observe(box, {childList: true, subtree: true, characterData: true}); }"""


def _words(page: Any) -> list[str]:
    return [w.split(":", 1)[0] for w in page.evaluate("window.hydraWords")]


def _open(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A page on the dashboard, and the list its script errors, CSP violations and failed
    requests go to."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(DEADLINE_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
            if r.status >= 400 else None)
    page.goto(url)
    page.evaluate(WATCH_HEADER)
    return page, errors


def test_dashboard_in_a_real_browser(hydra_up, hydra_env, tmp_path):
    t0 = time.monotonic()
    mport = free_port()
    up = hydra_up("-p", "demo", "-p", "demo-moe-combine", "--port", "0", "--metrics-port",
                  str(mport))
    up.wait_ready()
    port = snapshot(hydra_env).ports[0].port
    base = f"http://127.0.0.1:{mport}"
    timings = {"hydra up": time.monotonic() - t0}

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page, errors = _open(browser, base + "/")
            expect = sync_api.expect
            expect.set_options(timeout=DEADLINE_MS)

            # Idle: both profiles, one port block, their states; hydra's own log to read.
            expect(page.locator("#ports .port")).to_have_count(1)
            demo = page.locator('#ports tr[data-profile="demo"]')
            moe = page.locator('#ports tr[data-profile="demo-moe-combine"]')
            expect(demo.locator("[data-state]")).to_have_text("serving")
            expect(moe.locator("[data-state]")).to_have_text("stopped")
            expect(demo.locator("[data-lane-role]")).to_have_text("active")
            expect(page.locator("#state-word")).to_have_text("serving")
            expect(page.locator("#state-detail")).to_contain_text("no request in flight")
            expect(page.locator('#processes tr[data-process="demo.head"] [data-state]')
                   ).to_have_text("READY")
            expect(page.locator("#log-select")).to_have_value("hydra")
            expect(page.locator("#log")).to_contain_text("profile demo serving")
            _shot(page, tmp_path, "dashboard-idle.png")

            # Streams: while they decode, the row counts them in flight with a non-zero
            # tokens/s (hydra's own count: no --metrics on the head), the header says so, and
            # the request table marks them running.
            streams = [_stream(port, "demo", 160) for _ in range(3)]
            expect(demo.locator("[data-inflight]")).to_have_text("3")
            tps = demo.locator("[data-tps]")
            wait_until(lambda: float(tps.get_attribute("data-tps") or 0) > 0, 30,
                       "a non-zero tokens/s on the page while streams decode")
            expect(page.locator("#state-detail")).to_contain_text("3 in flight")
            expect(page.locator("#requests tr.running")).to_have_count(3)
            time.sleep(2.5)  # a few chart points
            timings["streams"] = time.monotonic() - t0
            _shot(page, tmp_path, "dashboard.png")
            for t in streams:
                t.join(120)
            # ... and afterwards each is on record: ok, its TTFT and generated tokens.
            expect(page.locator("#requests tr.running")).to_have_count(0)
            done = page.locator('#requests tr[data-ended="ok"]')
            expect(done).to_have_count(3)
            assert float(done.first.locator("[data-ttft]").get_attribute("data-ttft") or 0) > 0
            assert int(done.first.locator("[data-generated]").get_attribute("data-generated")
                       or 0) > 0
            expect(demo.locator("[data-requests]")).to_have_text("3")
            assert int(demo.locator("[data-generated]").get_attribute("data-generated")) > 0
            expect(page.locator("#chart-tokens .u-series").nth(1)).to_contain_text("demo")

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
                code, reply = _post(base + "/api/unload", {"all": True}, headers)
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

            # Unload demo with streams in flight: the header says draining while demo
            # finishes them, then demo stops; the reply is a sentence.
            streams = [_stream(port, "demo", 200) for _ in range(2)]
            expect(demo.locator("[data-inflight]")).to_have_text("2")
            demo.locator('button[data-action="unload"]').click()
            expect(page.locator("#state-word")).to_have_text("draining")
            expect(page.locator("#state-detail")).to_contain_text("demo finishes 2 requests")
            expect(page.locator("#reload")).to_be_disabled()  # one action at a time
            _shot(page, tmp_path, "dashboard-drain.png")
            expect(demo.locator("[data-state]")).to_have_text("stopped", timeout=120_000)
            for t in streams:
                t.join(120)
            said = page.locator('#actions li[data-result="ok"]').first
            expect(said).to_contain_text("unload demo")
            assert "{" not in said.locator(".said").inner_text()  # a sentence, not JSON
            assert "draining" in _words(page), _words(page)
            assert not page.locator('#requests tr[data-ended="cut"]').count()  # it waited
            timings["drain"] = time.monotonic() - t0

            # Click "Switch to": the other profile loads and the page shows it, the switch
            # once, and its reply as a sentence.
            moe.locator('button[data-action="switch"]').click()
            expect(moe.locator("[data-state]")).to_have_text("serving", timeout=120_000)
            switched = page.locator('#actions li[data-result="ok"]').first
            expect(switched).to_contain_text("switch to demo-moe-combine")
            said = switched.locator(".said").inner_text()
            assert "demo-moe-combine" in said and "{" not in said, said
            expect(page.locator("#switches .sw", has_text="→ demo-moe-combine")).to_have_count(1)
            keys = page.locator("#switches .sw").evaluate_all(
                "xs => xs.map(x => x.dataset.switch)")
            assert len(keys) == len(set(keys)), keys  # every change once
            timings["switch"] = time.monotonic() - t0

            # Unload all, then Load demo: the buttons do what they say, and say it.
            page.locator("#unload-all").click()
            expect(moe.locator("[data-state]")).to_have_text("stopped", timeout=60_000)
            expect(page.locator('#actions li[data-result="ok"]').first).to_contain_text(
                "unload all")
            expect(page.locator("#state-word")).to_have_text("idle")
            demo.locator('button[data-action="load"]').click()
            expect(demo.locator("[data-state]")).to_have_text("serving", timeout=120_000)
            expect(page.locator('#actions li[data-result="ok"]').first).to_contain_text(
                "load demo")
            timings["unload all, load"] = time.monotonic() - t0

            # Kill the head: the header says recovering, the page shows the restart and the
            # log follows the new process.
            row = page.locator('#processes tr[data-process="demo.head"]')
            row.locator('button[data-action="log"]').click()
            info = page.locator("#log-info")
            old_pid = up.engine("demo.head")["pid"]
            expect(info).to_have_attribute("data-pid", str(old_pid))
            os.kill(old_pid, signal.SIGKILL)
            expect(row.locator("[data-restarts]")).to_have_text("1", timeout=60_000)
            expect(row.locator("[data-state]")).to_have_text("READY", timeout=60_000)
            new_pid = up.engine("demo.head")["pid"]
            assert new_pid != old_pid
            expect(info).to_have_attribute("data-pid", str(new_pid))
            log = page.locator("#log")
            expect(log).to_contain_text(str(new_pid))  # a line that marks the new run

            def new_run_listens() -> bool:  # the lines after the last new-run mark
                text = log.inner_text()
                at = max(text.rfind("demo.head: a new run"), text.rfind("demo.head restarted"))
                return at >= 0 and "listening on" in text[at:]

            wait_until(new_run_listens, 60, "the log to show the new run's start")
            assert "recovering" in _words(page), _words(page)
            expect(page.locator("#state-word")).to_have_text("serving")
            timings["restart"] = time.monotonic() - t0
            _shot(page, tmp_path, "dashboard-restart.png")
            assert not errors, sorted(set(errors))  # no script error, CSP violation, 4xx
        finally:
            browser.close()

    # hydra bench draws: a sweep through the router and straight to the head, as a .png
    # (the chart page rendered by the same headless Chromium).
    plot = tmp_path / "bench.png"
    res = run_hydra(hydra_env, "bench", "-p", "demo", "--concurrency", "1,2", "--requests",
                    "2", "--max-tokens", "8", "--prompt-words", "10", "--plot", str(plot),
                    "--json", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert {(p["leg"], p["concurrency"]) for p in rep["points"]} == {
        ("router", 1), ("direct", 1), ("router", 2), ("direct", 2)}
    assert all(p["ok"] == p["requests"] and p["throughput_tps"] > 0 for p in rep["points"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timings["bench"] = time.monotonic() - t0
    print("timings (s since start):", {k: round(v, 1) for k, v in timings.items()})


def test_a_standby_pair_is_one_port_and_a_stopped_hydra_says_so(hydra_up, hydra_env,
                                                                  tmp_path):
    mport = free_port()
    up = hydra_up("-p", "demo-moe-combine", "--port", "0", "--metrics-port", str(mport))
    up.wait_ready()
    wait_until(lambda: any(x.role == "standby" and x.state == "serving"
                           for x in lanes(hydra_env)), 120, "the standby to be loaded")
    base = f"http://127.0.0.1:{mport}"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page, errors = _open(browser, base + "/")
            expect = sync_api.expect
            expect.set_options(timeout=DEADLINE_MS)

            # One block for the port, its active lane and its standby, each labelled; one
            # default; the standby is warm, not "serving".
            expect(page.locator("#ports .port")).to_have_count(1)
            active = page.locator('#ports tr[data-role="active"]')
            standby = page.locator('#ports tr[data-role="standby"]')
            expect(active).to_have_count(1)
            expect(standby).to_have_count(1)
            expect(active).to_have_attribute("data-profile", "demo-moe-combine")
            expect(standby).to_have_attribute("data-profile", "demo-moe")
            expect(standby.locator("[data-lane-role]")).to_have_text(
                "standby of demo-moe-combine")
            expect(standby.locator("[data-state]")).to_have_text("warm")
            expect(active.locator("[data-state]")).to_have_text("serving")
            expect(page.locator("#ports")).to_contain_text("(default)")
            assert page.locator("#ports").inner_text().count("(default)") == 1
            _shot(page, tmp_path, "dashboard-standby.png")

            # Switch to the standby: instant, said in a sentence, listed once.
            standby.locator('button[data-action="switch"]').click()
            done = page.locator('#actions li[data-result="ok"]')
            expect(done).to_contain_text("switch to demo-moe")
            assert "{" not in done.locator(".said").inner_text()
            expect(page.locator('#ports tr[data-role="active"]')).to_have_attribute(
                "data-profile", "demo-moe")
            expect(page.locator("#switches .sw")).to_have_count(1)
            assert not errors, sorted(set(errors))

            # hydra stops: the page says so, greys its data and disables every button.
            assert up.stop() == 0
            expect(page.locator("#state-word")).to_have_text("hydra stopped")
            expect(page.locator("#freshness")).to_contain_text("not live")
            expect(page.locator("body")).to_have_class("dead")
            buttons = page.locator("#ports button, #processes button[data-action=restart], "
                                   "header button")
            assert buttons.count() >= 4
            for i in range(buttons.count()):
                expect(buttons.nth(i)).to_be_disabled()
            _shot(page, tmp_path, "dashboard-stopped.png")
        finally:
            browser.close()


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


PEER_COMBINE = ("model: gemma3-270m\nmode: combine\nhead: cpu\nsplit: [9, 9]\npeers: [far]\n"
                "server_args: {ctx-size: 512, parallel: 1, threads: 1, chat-template: gemma,"
                " no-jinja: true, n-predict: 8}\n")


def test_the_peer_host_names_its_holder_and_the_head_its_spare(tmp_path):
    """Two hydras on loopback standing in for two hosts (issue 32): a `demo-peer` hydra lends
    its CPU rpc-server; a head hydra whose device `far` names a primary that is down at
    `hydra up` and the peer as its spare serves on the spare. The peer host's page says who
    holds its device (address, build, since when, MiB each way), that another head's HELLO
    was refused, and no HTTP request count on its ggml-RPC port; the head's page says its
    remote peer serves on the spare and which is the primary, on the port line, in the
    process table and in "Devices and memory" (and not as one of this host's CPU devices);
    `hydra status` on the head says "spare" by its address."""
    from hydra_supervisor.proc import rpcproto
    from hydra_supervisor.testing.harness import Up, make_env
    from hydra_supervisor.testing.routerhelp import llama_bins
    from hydra_supervisor.tools import buildid

    llama_bins()
    ident = buildid.local_identity()
    for d in ("peer", "head"):
        (tmp_path / d).mkdir()
    peer_port, head_port, dead = free_port(), free_port(), free_port()
    peer_m, head_m = free_port(), free_port()
    ups: list[Up] = []
    try:
        peer_env = make_env(tmp_path / "peer")
        peer = Up(peer_env, ["--profile", "demo-peer", "--port", str(peer_port),
                             "--metrics-port", str(peer_m)], tmp_path / "peer")
        ups.append(peer)
        peer.wait_ready(120)
        head_env = make_env(tmp_path / "head", (
            f"devices:\n  far: {{endpoint: '127.0.0.1:{dead}', "
            f"spares: ['127.0.0.1:{peer_port}']}}\n"))
        prof = tmp_path / "head" / "far.yaml"
        prof.write_text(f"profile: far\n{PEER_COMBINE}port: {head_port}\n")
        head = Up(head_env, ["--profile", str(prof), "--metrics-port", str(head_m)],
                  tmp_path / "head")
        ups.append(head)
        head.wait_ready(300)
        for _ in range(3):
            req = urllib.request.Request(
                f"http://127.0.0.1:{head_port}/completion", headers={
                    "Content-Type": "application/json"},
                data=json.dumps({"prompt": "Once upon a time", "n_predict": 8}).encode())
            with urllib.request.urlopen(req, timeout=120) as r:
                assert r.status == 200
        # a second head's bare HELLO: the peer's router closes it (one head at a time)
        with pytest.raises(rpcproto.HelloError, match="after 0 bytes"):
            rpcproto.probe("127.0.0.1", peer_port, timeout=10)

        shown = run_hydra(head_env, "status", timeout=60).stdout
        assert f"127.0.0.1:{peer_port} spare" in shown, shown
        spare = f"far on spare 127.0.0.1:{peer_port} (primary 127.0.0.1:{dead})"
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                expect = sync_api.expect
                expect.set_options(timeout=DEADLINE_MS)
                page, errors = _open(browser, f"http://127.0.0.1:{peer_m}/")
                line = page.locator("#ports .port-head .muted")
                expect(line).to_contain_text("lent to 127.0.0.1:")
                expect(line).to_contain_text(f"(build {ident.fingerprint}) since ")
                text = line.inner_text()
                assert re.search(r"since \d\d:\d\d:\d\d \([\d.]+ (s|min)", text), text
                assert re.search(r"[1-9][\d.]* MiB sent to its rpc-server, [\d.]+ MiB back",
                                 text), text
                assert text.endswith("MiB back · 1 other head's connection refused "
                                     "(one head at a time)"), text
                assert "request" not in text, text  # a ggml-RPC port serves no HTTP
                _shot(page, tmp_path, "dashboard-peer-lent.png")
                assert not errors, sorted(set(errors))

                page, errors = _open(browser, f"http://127.0.0.1:{head_m}/")
                expect(page.locator("#ports .port-head .muted")).to_contain_text(
                    f"remote peer {spare}: READY")
                expect(page.locator('#processes tr[data-process="far.peer-far"]')
                       ).to_contain_text(spare)
                expect(page.locator("#devices")).to_contain_text(f"remote peer {spare}")
                expect(page.locator("#devices")).to_contain_text("(CPU devices: cpu)")
                _shot(page, tmp_path, "dashboard-peer-head.png")
                assert not errors, sorted(set(errors))
            finally:
                browser.close()
    finally:
        for up in reversed(ups):
            if up.proc.poll() is None:
                up.stop()
            up.kill_everything()
