"""Metrics, part 3: every READY head's own llama-server `/metrics` (it must run with `--metrics`),
scraped at scrape time, in parallel and bounded, and relabelled with `engine` and `profile`
(`HeadCollector`, `relabel`). The server is metrics.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.serve.snapshot import Snapshot

log = logging.getLogger("hydra.metrics")


# ---------------------------------------------------------------------------------------------
# Heads' own llama-server /metrics


@dataclass(frozen=True)
class Head:
    """One llama-server to scrape: where, and the labels its series get."""

    engine: str
    profile: str
    url: str  # base URL, e.g. http://127.0.0.1:30200 (its internal port, not the router's)
    api_key: str | None = None  # llama-server's /metrics is behind --api-key when one is set


HeadsFn = Callable[[], Iterable[Head]]


def heads_from_snapshot(snap: Snapshot) -> list[Head]:
    """Every READY head process in the snapshot, at its own (internal) host:port."""
    out = []
    for _, lane, p in snap.processes():
        if p.role == "head" and p.state == "READY" and p.port:
            host = client_host(p.host or "127.0.0.1")
            host = f"[{host}]" if ":" in host else host
            out.append(Head(lane.name, lane.profile, f"http://{host}:{p.port}"))
    return out


class HeadCollector(Collector):
    """Scrapes each head's /metrics at scrape time (in parallel, each bounded by `timeout`)
    and re-emits the series with `engine` and `profile` labels. A head that does not answer
    (loading, busy past the timeout, no --metrics) shows as hydra_head_scrape_up 0."""

    def __init__(self, heads: HeadsFn, timeout: float = 3.0) -> None:
        self._heads = heads
        self._timeout = timeout

    def _fetch(self, head: Head) -> tuple[str | None, float, str]:
        t0 = time.monotonic()
        headers = {"Authorization": f"Bearer {head.api_key}"} if head.api_key else {}
        try:
            r = requests.get(f"{head.url}/metrics", timeout=self._timeout, headers=headers)
        except requests.RequestException as exc:
            return None, time.monotonic() - t0, type(exc).__name__
        if r.status_code != 200:
            return None, time.monotonic() - t0, f"HTTP {r.status_code}"
        return r.text, time.monotonic() - t0, ""

    def collect(self) -> Iterator[Metric]:
        heads = list(self._heads())
        up = GaugeMetricFamily("hydra_head_scrape_up",
                               "1 when the head's llama-server /metrics answered this scrape "
                               "(it needs --metrics)", labels=["engine", "profile"])
        took = GaugeMetricFamily("hydra_head_scrape_duration_seconds",
                                 "How long the head's /metrics took", labels=["engine", "profile"])
        merged: dict[str, Metric] = {}
        if heads:
            with ThreadPoolExecutor(max_workers=min(8, len(heads)),
                                    thread_name_prefix="hydra-metrics") as pool:
                results = list(pool.map(self._fetch, heads))
        else:
            results = []
        for head, (text, secs, why) in zip(heads, results, strict=True):
            ok = text is not None
            if ok:
                try:
                    relabel(text or "", {"engine": head.engine, "profile": head.profile},
                            merged)
                except ValueError as exc:  # the parser's error for malformed exposition
                    ok, why = False, f"unparsable: {exc}"
            if not ok:
                log.debug("scrape of %s/metrics failed: %s", head.url, why)
            up.add_metric([head.engine, head.profile], 1.0 if ok else 0.0)
            took.add_metric([head.engine, head.profile], secs)
        yield up
        yield took
        yield from merged.values()


_COUNTER_WITHOUT_TOTAL = re.compile(r"^(# TYPE (?![^ ]*_total )[^ ]+ )counter$", re.MULTILINE)


def relabel(text: str, extra: Mapping[str, str], into: dict[str, Metric]) -> None:
    """Parse one exposition and add its samples, with `extra` labels, to `into` (families
    merged by name across heads). A label the source already has is kept as exported_<name>,
    as Prometheus does. A 'counter' whose sample lacks the _total suffix (llama-server's
    n_tokens_max, a high-water mark) is re-typed as a gauge, so the output stays valid."""
    # The parser would rename such a counter's samples to NAME_total; as a gauge the series
    # keeps llama-server's own name.
    text = _COUNTER_WITHOUT_TOTAL.sub(r"\1gauge", text)
    for fam in text_string_to_metric_families(text):
        typ = fam.type
        out = into.get(fam.name)
        if out is None:
            out = into[fam.name] = Metric(fam.name, fam.documentation, typ)
        elif out.type != typ:  # heads of different llama.cpp builds disagree: keep the first
            log.debug("metric %s is a %s here and a %s elsewhere; skipped", fam.name, typ,
                      out.type)
            continue
        for s in fam.samples:
            labels = {(f"exported_{k}" if k in extra else k): v for k, v in s.labels.items()}
            labels.update(extra)
            out.add_sample(s.name, labels, s.value, s.timestamp)

