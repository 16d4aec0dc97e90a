"""Metrics: a scrape of MetricsServer parses with prometheus_client's own text parser and has
hydra's series with the values of the snapshot (also after a restart and a switch), the
router's per-request records, and a head's llama-server metrics relabelled -- from a stand-in
head, and from a real llama-server started with --metrics."""

from __future__ import annotations

import copy
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from hydra_supervisor import __version__
from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.runtime.metrics import (
    Head,
    MetricsServer,
    endpoint_label,
    heads_from_snapshot,
    relabel,
)
from hydra_supervisor.serve.snapshot import Snapshot

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]

# What llama-server's /metrics looks like (tools/server/server-task.cpp, to_metrics): note the
# counter n_tokens_max without a _total suffix.
LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 42
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 17
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 59
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 31.5
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0",engine="inner"} 5
"""


def scrape(url: str) -> Series:
    r = requests.get(url, timeout=30)
    assert r.status_code == 200, r.text
    out: Series = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def value(series: Series, name: str, **labels: str) -> float:
    want = set(labels.items())
    hits = [v for (n, lv), v in series.items() if n == name and want <= lv]
    assert len(hits) == 1, f"{name}{labels}: {len(hits)} series match"
    return hits[0]


class FakeHead:
    """A stand-in llama-server answering /metrics (optionally behind an api key)."""

    def __init__(self, text: str = LLAMA_METRICS, api_key: str | None = None) -> None:
        body = text.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                ok = api_key is None or self.headers.get("Authorization") == f"Bearer {api_key}"
                code = 200 if self.path == "/metrics" and ok else 401 if not ok else 404
                self.send_response(code)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body) if code == 200 else 0))
                self.end_headers()
                if code == 200:
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_head() -> Iterator[FakeHead]:
    head = FakeHead()
    yield head
    head.close()


def snapshot(*ports: dict[str, Any], pid: int = 999,
             started: float = 1_700_000_000.0) -> dict[str, Any]:
    """The snapshot's JSON (docs/control.md): the daemon and its ports."""
    return {"version": 1, "daemon": {"pid": pid, "started": started, "state_dir": "/tmp/state"},
            "ports": list(ports)}


def port(*lanes: dict[str, Any], router: dict[str, Any] | None = None,
         name: str = "port-8080") -> dict[str, Any]:
    return {"name": name, "host": "127.0.0.1", "port": 8080, "url": "http://127.0.0.1:8080",
            "router": router, "lanes": list(lanes)}


def typed(data: dict[str, Any]) -> Snapshot:
    return Snapshot.from_json(data)


def make_snapshot(head_port: int) -> dict[str, Any]:
    proc = {"pid": 1234, "host": "127.0.0.1", "reason": "", "log": "/x.log",
            "started": 1_700_000_100.0}
    router = {  # Router.stats() as the router branch returns it
        "accepted": 12, "refused": {"first_byte_timeout": 3, "unrecognised": 2},
        "events": {"emfile_waited": 1}, "bytes_up": 1000, "bytes_down": 5000,
        "bytes": 6000, "open": 2, "open_peak": 5, "pending": 0, "held": 4,
        "inflight": 1, "pooled": 1, "alive": True,
        "by_kind": {"http": 7, "rpc": 2, "hydra": 0},
        "http": {"requests": 6, "1xx": 0, "2xx": 5, "3xx": 0, "4xx": 0, "5xx": 1,
                 "cut": 1, "retried": 2},
        "fds": {"nofile": 65536, "budget": 60000, "relays": 4},
    }
    # the port: its router's counters, which metrics read, and its lane
    return snapshot(port({
            "name": "main", "profile": "demo", "mode": "solo", "model": "gemma3-270m",
            "state": "serving", "fatal": None, "degraded": None,
            "processes": [
                {**proc, "name": "head", "role": "head", "port": head_port, "device": "cpu",
                 "state": "READY", "restarts": 2, "last_exit": 134},
                {**proc, "name": "peer-gpu1", "role": "peer", "port": 30052,
                 "device": "gpu1", "state": "BACKOFF", "restarts": 1, "last_exit": -9,
                 "started": None},
                {**proc, "name": "peer-gpu2", "role": "peer", "port": 30053,
                 "device": "gpu2", "state": "STARTING", "restarts": 0, "last_exit": None},
            ],
            "switches": [
                {"seq": 1, "to": "demo", "result": "ok", "phases": {"hold": 0.25, "drain": 0.5,
                                                          "start": 3.0}, "total_s": 3.75,
                 "error": None},
                {"seq": 2, "to": "moe", "result": "rolled_back",
                 "phases": {"hold": 0.25, "start": 9.0},
                 "total_s": 12.0, "error": "head exited 1"},
            ],
        }, router=router))


def test_scrape_has_the_snapshot_series(fake_head: FakeHead) -> None:
    snap = make_snapshot(fake_head.port)
    live = {"snap": snap}
    with MetricsServer("127.0.0.1", 0, snapshot=lambda: typed(live["snap"])) as ms:
        assert ms.url.startswith("http://127.0.0.1:")
        s = scrape(ms.url)
        e = {"engine": "main", "profile": "demo"}
        assert value(s, "hydra_info", version=__version__, pid="999") == 1
        assert value(s, "hydra_start_time_seconds") == 1_700_000_000.0
        assert value(s, "hydra_engine_state", **e, state="serving") == 1
        assert value(s, "hydra_engine_state", **e, state="failed") == 0
        assert value(s, "hydra_engine_info", **e, mode="solo", model="gemma3-270m") == 1
        head = {**e, "process": "head", "role": "head", "device": "cpu"}
        peer = {**e, "process": "peer-gpu1", "role": "peer", "device": "gpu1"}
        assert value(s, "hydra_process_state", **head, state="READY") == 1
        assert value(s, "hydra_process_state", **head, state="BACKOFF") == 0
        assert value(s, "hydra_process_state", **peer, state="BACKOFF") == 1
        assert value(s, "hydra_process_up", **head) == 1
        assert value(s, "hydra_process_up", **peer) == 0
        assert value(s, "hydra_process_restarts_total", **head) == 2
        assert value(s, "hydra_process_last_exit_code", **head) == 134
        assert value(s, "hydra_process_last_exit_code", **peer) == -9
        assert not [k for k in s if k[0] == "hydra_process_last_exit_code"
                    and ("process", "peer-gpu2") in k[1]]  # never exited: no series
        assert value(s, "hydra_process_start_time_seconds", **head) == 1_700_000_100.0
        # router: labelled by the port alone (was engine+profile, which moved the port's
        # counters to another profile on a switch); one series per port
        r = {"engine": "port-8080"}
        assert not [k for k in s if k[0].startswith("hydra_router_")
                    and dict(k[1]).keys() - {"engine", "protocol", "outcome", "reason",
                                             "direction", "status_class", "event", "kind"}]
        assert value(s, "hydra_router_connections_accepted_total", **r) == 12
        assert value(s, "hydra_router_connections_total", **r, protocol="http",
                     outcome="relayed") == 7
        assert value(s, "hydra_router_connections_total", **r, protocol="rpc") == 2
        assert value(s, "hydra_router_connections_refused_total", **r,
                     reason="first_byte_timeout") == 3
        assert value(s, "hydra_router_connections_refused_total", **r,
                     reason="unrecognised") == 2
        assert value(s, "hydra_router_open", **r) == 2
        assert value(s, "hydra_router_held", **r) == 4
        assert value(s, "hydra_router_inflight", **r) == 1
        assert value(s, "hydra_router_bytes_total", **r, direction="down") == 5000
        assert value(s, "hydra_router_http_responses_total", **r, status_class="5xx") == 1
        assert value(s, "hydra_router_http_requests_total", **r) == 6
        assert value(s, "hydra_router_events_total", **r, event="emfile_waited") == 1
        assert value(s, "hydra_router_alive", **r) == 1
        assert value(s, "hydra_router_fds", **r, kind="relays") == 4
        assert value(s, "hydra_router_open_peak", **r) == 5
        assert value(s, "hydra_router_http_cut_total", **r) == 1
        assert value(s, "hydra_router_http_retried_total", **r) == 2
        # switches
        assert value(s, "hydra_switches_total", engine="main", result="ok") == 1
        assert value(s, "hydra_switches_total", engine="main", result="rolled_back") == 1
        assert value(s, "hydra_switches_total", engine="main", result="failed") == 0
        assert value(s, "hydra_switch_phase_seconds_count", engine="main", phase="hold") == 2
        assert value(s, "hydra_switch_phase_seconds_sum", engine="main", phase="start") == 12.0
        assert value(s, "hydra_switch_phase_seconds_sum", engine="main", phase="total") == 15.75
        assert value(s, "hydra_switch_last_phase_seconds", engine="main", phase="start") == 9.0
        # the head's own metrics, relabelled
        assert value(s, "hydra_head_scrape_up", **e) == 1
        assert value(s, "llamacpp:tokens_predicted_total", **e) == 17
        assert value(s, "llamacpp:n_tokens_max", **e) == 59
        assert value(s, "llamacpp:predicted_tokens_seconds", **e) == 31.5
        assert value(s, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total", **e,
                     position="0", exported_engine="inner") == 5

        # A restart and a switch later, the same scrape shows them.
        after = copy.deepcopy(snap)
        eng = after["ports"][0]["lanes"][0]
        eng["processes"][0].update(restarts=3, last_exit=-6, state="STARTING")
        eng["switches"].append({"seq": 3, "to": "demo", "result": "ok",
                                "phases": {"start": 2.0},
                                "total_s": 2.5, "error": None})
        eng["state"] = "loading"
        live["snap"] = after
        s = scrape(ms.url)
        assert value(s, "hydra_process_restarts_total", **head) == 3
        assert value(s, "hydra_process_last_exit_code", **head) == -6
        assert value(s, "hydra_process_state", **head, state="STARTING") == 1
        assert value(s, "hydra_process_state", **head, state="READY") == 0
        assert value(s, "hydra_engine_state", **e, state="loading") == 1
        assert value(s, "hydra_switches_total", engine="main", result="ok") == 2
        assert value(s, "hydra_switch_last_phase_seconds", engine="main", phase="total") == 2.5
        # the head is no longer READY: not scraped
        assert not [k for k in s if k[0] == "hydra_head_scrape_up"]


def test_older_flat_router_counters() -> None:
    """Router.stats() before the request-aware router: flat refusal counters (read into
    today's counters by the schema's parse)."""
    snap = typed(snapshot(port({"name": "m", "profile": "p"}, router={
        "total": 9, "refused": 1, "rejected": 2, "denied": 3, "timeouts": 4,
        "upstream_errors": 5, "by_kind": {"http": 9}})))
    with MetricsServer(snapshot=lambda: snap, heads=lambda: []) as ms:
        s = scrape(ms.url)
    assert value(s, "hydra_router_connections_accepted_total") == 9
    for reason, n in (("queue_full", 1), ("unrecognised", 2), ("not_allowed", 3),
                      ("timeout", 4), ("upstream_error", 5)):
        assert value(s, "hydra_router_connections_refused_total", reason=reason) == n


def test_switch_counts_survive_a_bounded_report_list() -> None:
    """A lane keeps its last 20 reports; the counters must not drop when old ones go."""
    def report(i: int) -> dict[str, Any]:
        return {"seq": i + 1, "to": f"p{i % 2}", "from": None,
                "result": "ok" if i % 3 else "rolled_back",
                "phases": {"start": 1.0}, "total_s": 1.0 + i / 1000, "error": None}

    reports: list[dict[str, Any]] = []
    snap = snapshot(port({"name": "main", "profile": "main", "switches": reports}))
    with MetricsServer(snapshot=lambda: typed(snap), heads=lambda: []) as ms:
        for i in range(20):
            reports.append(report(i))
        first = scrape(ms.url)
        for i in range(20, 27):  # 7 more; the list keeps the last 20
            reports.append(report(i))
            del reports[0]
        second = scrape(ms.url)
        third = scrape(ms.url)  # nothing new: nothing added
    total = sum(value(first, "hydra_switches_total", engine="main", result=r)
                for r in ("ok", "rolled_back"))
    assert total == 20
    assert value(first, "hydra_switches_total", engine="main", result="rolled_back") == 7
    for s in (second, third):
        assert value(s, "hydra_switches_total", engine="main", result="rolled_back") == 9
        assert value(s, "hydra_switches_total", engine="main", result="ok") == 18
        assert value(s, "hydra_switch_phase_seconds_count", engine="main", phase="start") == 27
        assert value(s, "hydra_switch_last_phase_seconds", engine="main",
                     phase="total") == 1.026


def test_request_records(fake_head: FakeHead) -> None:
    ms = MetricsServer(snapshot=lambda: typed(make_snapshot(fake_head.port)))
    ms.start()
    try:
        observe = ms.request_observer("main")
        base = {"method": "POST", "path": "/v1/chat/completions", "model": "demo",
                "bytes_in": 100, "bytes_out": 900}
        observe({**base, "status": 200, "duration_s": 0.3, "outcome": "ok"})
        observe({**base, "status": 200, "duration_s": 2.0, "outcome": "ok"})
        observe({**base, "status": 200, "duration_s": 7.0, "outcome": "cut"})
        observe({**base, "status": 503, "duration_s": 120.0, "outcome": "held_timeout",
                 "path": "/completion?x=1"})
        ms.observe_request({"method": "GET", "path": "/slots/3", "status": 200,
                            "duration_s": 0.001, "bytes_in": 0, "bytes_out": 10,
                            "model": None, "outcome": "ok"}, engine="main")
        s = scrape(ms.url)
    finally:
        ms.stop()
    chat = {"engine": "main", "endpoint": "/v1/chat/completions"}
    assert value(s, "hydra_http_requests_total", **chat, status="200", outcome="ok",
                 method="POST", model="demo") == 2
    assert value(s, "hydra_http_requests_total", **chat, outcome="cut") == 1
    assert value(s, "hydra_http_requests_total", endpoint="/completion", status="503",
                 outcome="held_timeout") == 1
    assert value(s, "hydra_http_requests_total", endpoint="/slots/{id}") == 1
    assert value(s, "hydra_http_request_duration_seconds_count", **chat, outcome="ok") == 2
    assert value(s, "hydra_http_request_duration_seconds_sum", **chat, outcome="ok") == 2.3
    assert value(s, "hydra_http_request_duration_seconds_bucket", **chat, outcome="ok",
                 le="0.5") == 1
    assert value(s, "hydra_http_request_duration_seconds_bucket", **chat, outcome="ok",
                 le="2.5") == 2
    assert value(s, "hydra_http_request_bytes_total", engine="main", direction="out") == 3610


def test_loopback_only_and_never_an_external_port() -> None:
    snap = typed(make_snapshot(1))
    with pytest.raises(ValueError, match="loopback"):
        MetricsServer("0.0.0.0", 0, snapshot=lambda: snap)
    with pytest.raises(ValueError, match="external port"):
        MetricsServer("127.0.0.1", 8080, snapshot=lambda: snap).start()
    ms = MetricsServer("::1", 0, snapshot=lambda: typed(snapshot()))
    try:
        ms.start()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        assert ms.url.startswith("http://[::1]:")
        assert value(scrape(ms.url), "hydra_info") == 1
    finally:
        ms.stop()


def test_unreachable_and_keyed_heads() -> None:
    keyed = FakeHead(api_key="sk-1")
    try:
        dead = free_port()
        heads = [Head("a", "p", f"http://127.0.0.1:{dead}"),
                 Head("b", "p", f"http://127.0.0.1:{keyed.port}"),
                 Head("c", "p", f"http://127.0.0.1:{keyed.port}", api_key="sk-1")]
        with MetricsServer(snapshot=lambda: typed(snapshot()), heads=lambda: heads,
                           scrape_timeout=2) as ms:
            s = scrape(ms.url)
    finally:
        keyed.close()
    assert value(s, "hydra_head_scrape_up", engine="a") == 0
    assert value(s, "hydra_head_scrape_up", engine="b") == 0  # 401 without the key
    assert value(s, "hydra_head_scrape_up", engine="c") == 1
    assert value(s, "llamacpp:prompt_tokens_total", engine="c") == 42


def test_heads_from_snapshot_and_relabel_merge() -> None:
    snap = typed(make_snapshot(31000))
    assert heads_from_snapshot(snap) == [Head("main", "demo", "http://127.0.0.1:31000")]
    merged: dict[str, Any] = {}
    relabel(LLAMA_METRICS, {"engine": "a", "profile": "x"}, merged)
    relabel(LLAMA_METRICS, {"engine": "b", "profile": "y"}, merged)
    fam = merged["llamacpp:prompt_tokens"]
    assert fam.type == "counter" and len(fam.samples) == 2
    assert merged["llamacpp:n_tokens_max"].type == "gauge"
    assert endpoint_label("/v1/chat/completions?stream=1") == "/v1/chat/completions"
    assert endpoint_label("/secret/../x") == "other"


# ----------------------------------------------------------------------- real llama-server


@pytest.mark.slow
def test_real_llama_server_metrics_relabelled(tmp_path: Path) -> None:
    from hydra_supervisor.testing.routerhelp import (
        gemma_path,
        llama_bins,
        llama_process,
        wait_health,
    )

    bins, model = llama_bins(), gemma_path()
    port = free_port()
    argv = [str(bins / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-c", "1024", "-t", "2", "-np", "1", "--metrics", "--api-key", "sk-m",
            "--chat-template", "gemma"]
    log = tmp_path / "llama-server.log"
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log)
        reply = requests.post(f"http://127.0.0.1:{port}/completion",
                              headers={"Authorization": "Bearer sk-m"},
                              json={"prompt": "The capital of France is", "n_predict": 8,
                                    "temperature": 0, "cache_prompt": False},
                              timeout=120).json()
        timings = reply["timings"]
        snap = typed(make_snapshot(port))
        key = {"engine": "main", "profile": "demo"}

        def heads() -> list[Head]:
            return [Head(h.engine, h.profile, h.url, api_key="sk-m")
                    for h in heads_from_snapshot(snap)]

        with MetricsServer(snapshot=lambda: snap, heads=heads, scrape_timeout=30) as ms:
            s = scrape(ms.url)
        assert value(s, "hydra_head_scrape_up", **key) == 1
        assert value(s, "llamacpp:tokens_predicted_total", **key) == timings["predicted_n"]
        assert value(s, "llamacpp:prompt_tokens_total", **key) == timings["prompt_n"]
        assert value(s, "llamacpp:n_decode_total", **key) >= timings["predicted_n"]
        assert value(s, "llamacpp:requests_processing", **key) == 0
        # hydra's own series are in the same scrape
        assert value(s, "hydra_process_up", **key, process="head") == 1
        # and without the key, llama-server refuses: the scrape says so instead of failing
        with MetricsServer(snapshot=lambda: snap, scrape_timeout=30) as ms:
            assert value(scrape(ms.url), "hydra_head_scrape_up", **key) == 0


def test_identical_switch_reports_counted_once_each_by_their_seq() -> None:
    """Two switches with the same content (two identical rollbacks) are two switches; a
    scrape between them and after them counts 2, not what a content match guesses (one switch
    moved hydra_switches_total by 21 when reports were matched by their content)."""
    same = {"to": "b", "from": "a", "result": "rolled_back", "phases": {"start": 0.5},
            "total_s": 0.5, "error": "boom"}
    reports: list[dict[str, Any]] = []
    snap = snapshot(port({"name": "main", "profile": "main", "switches": reports}))
    with MetricsServer(snapshot=lambda: typed(snap), heads=lambda: []) as ms:
        reports.append({**same, "seq": 1})
        first = scrape(ms.url)
        reports.append({**same, "seq": 2})
        second = scrape(ms.url)
        for seq in range(3, 43):  # 40 more, the list keeps the last 20
            reports.append({**same, "seq": seq})
            del reports[:-20]
        third = scrape(ms.url)
    assert value(first, "hydra_switches_total", engine="main", result="rolled_back") == 1
    assert value(second, "hydra_switches_total", engine="main", result="rolled_back") == 2
    # 40 after the last scrape, 20 of them still listed: the 20 others were never seen
    assert value(third, "hydra_switches_total", engine="main", result="rolled_back") == 22


def test_lanes_sharing_a_port_count_their_own_switches() -> None:
    """Each lane numbers its switch reports (seq) on its own: two lanes on one port must not
    share a tally. Switches a1, b1, a2, b2 with a scrape after each: a and b end at 2 each (one
    tally per port read 1, 1, 2, 2 for both: b's seq 1 was skipped after a's, and so on)."""
    def rep(seq: int) -> dict[str, Any]:
        return {"seq": seq, "to": "x", "from": None, "result": "ok",
                "phases": {"start": 1.0}, "total_s": 1.0, "error": None}

    a: list[dict[str, Any]] = []
    b: list[dict[str, Any]] = []
    snap = snapshot(port({"name": "port-8080/a", "profile": "a", "switches": a},
                         {"name": "port-8080/b", "profile": "b", "switches": b}))
    seen: list[tuple[float, float]] = []
    with MetricsServer(snapshot=lambda: typed(snap), heads=lambda: []) as ms:
        for reports, seq in ((a, 1), (b, 1), (a, 2), (b, 2)):
            reports.append(rep(seq))
            s = scrape(ms.url)
            seen.append((value(s, "hydra_switches_total", engine="port-8080/a", result="ok"),
                         value(s, "hydra_switches_total", engine="port-8080/b", result="ok")))
    assert seen == [(1, 0), (1, 1), (2, 1), (2, 2)]
    assert value(s, "hydra_switch_phase_seconds_count", engine="port-8080/a",
                 phase="start") == 2
    assert value(s, "hydra_switch_phase_seconds_count", engine="port-8080/b",
                 phase="start") == 2


def test_router_series_stay_with_the_port_across_a_switch() -> None:
    """The router is the port's: after `hydra switch` from profile a to b on a one-profile
    port, its series keep their labels (engine="port-8080", no profile) and their counts carry
    on; none appears under the new profile, none is left under the old one."""
    def router(accepted: int, requests: int, held: int) -> dict[str, Any]:
        return {"accepted": accepted, "open": 1, "held": held, "inflight": 0, "alive": True,
                "by_kind": {"http": accepted}, "http": {"requests": requests, "2xx": requests}}

    def snap(profile: str, st: dict[str, Any]) -> dict[str, Any]:
        # (the lane's own gate holds none: metrics read the port's router)
        return snapshot(port({"name": "port-8080", "profile": profile, "state": "serving",
                              "held": 0}, router=st), pid=1)

    live = {"snap": snap("a", router(5, 4, 2))}
    with MetricsServer(snapshot=lambda: typed(live["snap"]), heads=lambda: []) as ms:
        before = scrape(ms.url)
        live["snap"] = snap("b", router(9, 7, 3))  # switched: the router counted on
        after = scrape(ms.url)

    def router_keys(s: Series) -> set[tuple[str, frozenset[tuple[str, str]]]]:
        return {k for k in s if k[0].startswith("hydra_router_")}

    assert router_keys(before) == router_keys(after)  # the same series, the same labels
    assert all(dict(lv).get("engine") == "port-8080" and "profile" not in dict(lv)
               for _, lv in router_keys(after))
    for s, accepted, n_requests, held in ((before, 5, 4, 2), (after, 9, 7, 3)):
        assert value(s, "hydra_router_connections_accepted_total",
                     engine="port-8080") == accepted
        assert value(s, "hydra_router_http_requests_total", engine="port-8080") == n_requests
        assert value(s, "hydra_router_held", engine="port-8080") == held  # the port's
    # the lane's own series do follow the profile
    assert value(after, "hydra_engine_state", engine="port-8080", profile="b",
                 state="serving") == 1


def test_router_counted_once_per_port_with_several_lanes() -> None:
    """The counters are the port's (one `router` per port in the schema): a port with two
    lanes has its router's series once, labelled by the port."""
    st = {"accepted": 3, "alive": True}
    snap = typed(snapshot(port({"name": "port-8080/a", "profile": "a"},
                               {"name": "port-8080/b", "profile": "b"}, router=st)))
    with MetricsServer(snapshot=lambda: snap, heads=lambda: []) as ms:
        s = scrape(ms.url)
    assert value(s, "hydra_router_connections_accepted_total", engine="port-8080") == 3


def test_lane_traffic_series_from_the_snapshot() -> None:
    """The lane's live load, as hydra's router counted it (router/traffic.py)."""
    lane = {"name": "port-8080/demo", "profile": "demo", "state": "serving", "inflight": 2,
            "queued": 3, "tokens_per_s": 12.5, "generated_tokens": 640, "prompt_tokens": 90}
    with MetricsServer("127.0.0.1", 0, snapshot=lambda: typed(snapshot(port(lane)))) as ms:
        s = scrape(ms.url)
        e = {"engine": "port-8080/demo", "profile": "demo"}
        assert value(s, "hydra_lane_inflight", **e) == 2
        assert value(s, "hydra_lane_queued", **e) == 3
        assert value(s, "hydra_lane_tokens_per_second", **e) == 12.5
        assert value(s, "hydra_generated_tokens_total", **e) == 640
        assert value(s, "hydra_prompt_tokens_total", **e) == 90


def test_the_metrics_port_counts_its_own_connections() -> None:
    """The side port's counts (runtime/sideport.py) are series: open connections, and what
    became of the others (here: served; a huge body refused unread)."""
    snap = typed(snapshot(port({"name": "m", "profile": "p"})))
    with MetricsServer(snapshot=lambda: snap, heads=lambda: []) as ms:
        scrape(ms.url)
        with socket.create_connection(("127.0.0.1", ms.port), timeout=30) as c:
            c.sendall(b"POST /api/reload HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 1000000000000\r\n\r\n{")
            assert c.recv(100).startswith(b"HTTP/1.0 413 ")
        s = scrape(ms.url)
    assert value(s, "hydra_metrics_port_open") == 1  # this scrape
    assert value(s, "hydra_metrics_port_connections_total", outcome="served") == 1
    assert value(s, "hydra_metrics_port_connections_total", outcome="too_large") == 1
    assert value(s, "hydra_metrics_port_accept_failures_total") == 0
