"""`hydra bench -p PROFILE`: streaming OpenAI chat requests against a serving profile, with the
numbers llama-server itself measured, and the profile's `expect:` block as a pass/fail gate.

Why llama-server's numbers: the final SSE event of every stream carries `timings` (prompt_n,
prompt_per_second, predicted_n, predicted_per_second), measured inside the engine; only time
to first token is hydra's own (client clock, monotonic), since it includes the router and the
queue. `expect:` is checked against the medians (p50) of the per-request values: decode_tps
and prefill_tps at least, ttft_ms at most. Run with --concurrency 1 (the default) for
single-stream goals: per-request decode speed drops when slots share a GPU.

Exit status: 0 pass, 1 a threshold missed or a request failed, 2 bad input / nothing serving.
cli.py's _LazyGroup imports this module when `hydra bench` is run.
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import requests

from hydra_supervisor.cli import benchplot, running
from hydra_supervisor.cli.clickutil import PORT, exits_2
from hydra_supervisor.config.config import find_node_file, find_profile, load_node, load_profile
from hydra_supervisor.config.profile import Mode
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.runtime import exits
from hydra_supervisor.serve import states
from hydra_supervisor.serve.snapshot import Snapshot

EXPECT_KEYS = ("decode_tps", "prefill_tps", "ttft_ms")
AT_MOST = frozenset({"ttft_ms"})  # the others are "at least"

# A prompt made of plain English words (tokenizes to ~1.3 tokens a word on most vocabularies).
_WORDS = ("the operator keeps a few mixed graphics cards in one box and wants to serve a large "
          "language model that fits no single card so the layers are split across the cards "
          "and every token crosses the link between them while the router in front keeps one "
          "port for clients and the supervisor restarts what crashes").split()


def make_prompt(index: int, words: int) -> str:
    """A distinct prompt per request (its index first), so no request is served from another's
    prompt cache; `words` long."""
    body = [_WORDS[i % len(_WORDS)] for i in range(max(words, 1))]
    return f"Request {index}. " + " ".join(body) + "\nContinue the story:"


@dataclass
class Sample:
    """One streamed request as measured."""

    index: int
    ok: bool = False
    error: str = ""
    ttft_ms: float | None = None  # request sent -> first content token, client clock
    latency_s: float | None = None  # request sent -> stream finished
    prompt_n: int | None = None
    predicted_n: int | None = None
    prefill_tps: float | None = None  # llama-server's timings.prompt_per_second
    decode_tps: float | None = None  # llama-server's timings.predicted_per_second


def sse_events(lines: Iterator[bytes]) -> Iterator[dict[str, Any] | str]:
    """`data:` payloads of an SSE stream: decoded JSON objects, or '[DONE]'."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield "[DONE]"
            return
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield obj


def run_one(url: str, index: int, *, model: str, prompt_words: int, max_tokens: int,
            ignore_eos: bool, timeout: float, api_key: str | None) -> Sample:
    s = Sample(index)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": make_prompt(index, prompt_words)}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        # llama-server extensions: prefill every prompt in full, decode exactly max_tokens.
        "cache_prompt": False,
        "ignore_eos": ignore_eos,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.monotonic()
    timings: Mapping[str, Any] | None = None
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers,
                           stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return s
            for ev in sse_events(r.iter_lines()):
                if ev == "[DONE]" or not isinstance(ev, dict):
                    break
                if "error" in ev:
                    err = ev["error"]
                    s.error = str(err.get("message") if isinstance(err, dict) else err)
                    return s
                for choice in ev.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if s.ttft_ms is None and (delta.get("content")
                                              or delta.get("reasoning_content")):
                        s.ttft_ms = (time.monotonic() - t0) * 1000
                if isinstance(ev.get("timings"), dict):
                    timings = ev["timings"]
    except requests.RequestException as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return s
    s.latency_s = time.monotonic() - t0
    if timings is None:
        s.error = "the stream ended without llama-server's timings (is this llama-server?)"
        return s
    s.prompt_n = _int(timings.get("prompt_n"))
    s.predicted_n = _int(timings.get("predicted_n"))
    s.prefill_tps = _rate(timings.get("prompt_per_second"))
    s.decode_tps = _rate(timings.get("predicted_per_second"))
    s.ok = True
    return s


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _rate(v: Any) -> float | None:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        return None  # llama-server reports 0 or inf when a phase had no tokens
    return float(v)


# ---------------------------------------------------------------------------------------------
# Statistics and the gate (pure)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p95": percentile(values, 95),
            "min": min(values) if values else None, "max": max(values) if values else None}


@dataclass
class Report:
    url: str
    profile: str
    concurrency: int
    requests: int
    ok: int
    failed: int
    wall_s: float
    throughput_tps: float  # all requests' decoded tokens / wall time
    ttft_ms: dict[str, float | None]
    decode_tps: dict[str, float | None]
    prefill_tps: dict[str, float | None]
    latency_s: dict[str, float | None]
    prompt_tokens: float | None
    completion_tokens: float | None
    errors: list[str]
    expect: dict[str, dict[str, Any]] = field(default_factory=dict)
    passed: bool = True


def summarize(samples: Sequence[Sample], *, url: str, profile: str, concurrency: int,
              wall_s: float) -> Report:
    good = [s for s in samples if s.ok]

    def vals(attr: str) -> list[float]:
        return [float(v) for s in good if (v := getattr(s, attr)) is not None]

    decoded = sum(s.predicted_n or 0 for s in good)
    prompts, completions = vals("prompt_n"), vals("predicted_n")
    errors = [f"request {s.index}: {s.error}" for s in samples if not s.ok]
    return Report(
        url=url, profile=profile, concurrency=concurrency, requests=len(samples), ok=len(good),
        failed=len(samples) - len(good), wall_s=wall_s,
        throughput_tps=decoded / wall_s if wall_s > 0 else 0.0,
        ttft_ms=_dist(vals("ttft_ms")), decode_tps=_dist(vals("decode_tps")),
        prefill_tps=_dist(vals("prefill_tps")), latency_s=_dist(vals("latency_s")),
        prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        completion_tokens=sum(completions) / len(completions) if completions else None,
        errors=errors[:10],
    )


def check_expect(report: Report, expect: Mapping[str, float]) -> Report:
    """Fill report.expect and report.passed: each threshold against the p50 of its metric;
    any failed request fails the run too."""
    out: dict[str, dict[str, Any]] = {}
    passed = report.failed == 0 and report.ok > 0
    for key in EXPECT_KEYS:
        if key not in expect:
            continue
        want = float(expect[key])
        got = getattr(report, key)["p50"]
        ok = got is not None and (got <= want if key in AT_MOST else got >= want)
        out[key] = {"want": want, "got": got, "ok": ok,
                    "rule": "p50 <= want" if key in AT_MOST else "p50 >= want"}
        passed = passed and ok
    report.expect = out
    report.passed = passed
    return report


def parse_expect(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in EXPECT_KEYS:
            raise HydraError(f"--expect {item!r}: want KEY=NUMBER with KEY one of "
                             f"{', '.join(EXPECT_KEYS)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise HydraError(f"--expect {item!r}: {value!r} is not a number") from None
    return out


# ---------------------------------------------------------------------------------------------
# The command




def _fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}{unit}"


def _print(report: Report) -> None:
    r = report
    click.echo(f"bench {r.profile} at {r.url}: {r.ok}/{r.requests} ok, concurrency "
               f"{r.concurrency}, {r.wall_s:.1f}s, {r.throughput_tps:,.1f} tokens/s overall")
    click.echo(f"  prompt {_fmt(r.prompt_tokens, '', 0)} tokens, completion "
               f"{_fmt(r.completion_tokens, '', 0)} tokens per request")
    click.echo(f"  {'':14}{'p50':>10}{'p95':>10}{'min':>10}{'max':>10}")
    for label, dist in (("decode t/s", r.decode_tps), ("prefill t/s", r.prefill_tps),
                        ("ttft ms", r.ttft_ms), ("latency s", r.latency_s)):
        digits = 2 if label == "latency s" else 1
        click.echo(f"  {label:14}" + "".join(f"{_fmt(dist[k], '', digits):>10}"
                                             for k in ("p50", "p95", "min", "max")))
    for key, e in r.expect.items():
        mark = "ok" if e["ok"] else "MISSED"
        click.echo(f"  expect {key}: {e['rule'].replace('want', _fmt(e['want']))}, got "
                   f"{_fmt(e['got'])}: {mark}")
    for line in r.errors:
        click.echo(f"  {line}", err=True)
    click.echo("PASS" if r.passed else "FAIL")


@dataclass(frozen=True)
class Target:
    """What `hydra bench` measures: the profile (its name is the request's `model`: a port
    serving several profiles routes by it), where requests go, and the head's own address for
    a sweep's direct leg."""

    profile: str
    url: str | None  # None: the profile's own port (nothing runs here that serves it)
    direct: str | None = None
    source: str | None = None  # the profile's file, as the running hydra read it
    state: str | None = None  # its lane's state in the running hydra


def resolve(snap: Snapshot | None, profile: str | None, port: int | None,
            url: str | None) -> Target:
    """The target from the running hydra's snapshot (None: none runs here): the port that
    serves `profile` (`--port` narrows it), or with no `--profile` the default profile of
    `--port` (or of its only port). `--url` wins over the port; without a running hydra, the
    profile's own port is the fallback (Target.url None)."""
    if snap is None:
        name = profile or "demo"
        return Target(name, url or (f"http://127.0.0.1:{port}" if port else None))
    served = running.find(snap, profile, port) if profile else running.default_of(snap, port)
    if served is None:
        if port is not None and running.port_named(snap, port) is None:
            # not this hydra's port: another server (another state dir), taken at its word
            return Target(profile or "demo", url or f"http://127.0.0.1:{port}")
        if url is not None:
            return Target(profile or "demo", url)
        at = f" on port {port}" if port is not None else ""
        if profile is None:
            raise HydraError(f"the hydra running here has no default profile{at} (it serves "
                             f"{running.where(snap)})", hint="name one: hydra bench -p NAME")
        raise HydraError(f"the hydra running here does not serve profile {profile}{at} (it "
                         f"serves {running.where(snap)})",
                         hint=f"load it first (hydra switch {profile}), or bench what it "
                              "serves (hydra bench -p NAME)")
    mine = url is None or url.rstrip("/") == served.url
    return Target(served.lane.profile, url or served.url,
                  direct=served.head_url() if mine else None, source=served.lane.source,
                  state=served.lane.state)


@click.command("bench")
@click.option("--profile", "-p", default=None,
              help="profile to bench, sent as the request's model [default: what the running "
                   "hydra serves (its default profile), else demo]; its expect: is the gate")
@click.option("--node", "node_file", default=None, help="node file")
@click.option("--profiles-dir", default=None, help="extra directory of profiles")
@click.option("--port", type=PORT, default=None,
              help="the hydra port to bench [default: the port the running hydra serves the "
                   "profile on, else the profile's port]")
@click.option("--url", default=None,
              help="base URL to bench (default: the port the running hydra serves the profile "
                   "on)")
@click.option("--concurrency", "-c", default="1", show_default=True, metavar="N[,N...]",
              help="requests in flight at once (1..256); a list such as 1,4,16 runs a sweep")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="write a chart of tokens/s and TTFT against concurrency, router against "
                   "direct: .html (self-contained) or .png (rendered by a headless chromium)")
@click.option("--requests", "-n", "n_requests", type=click.IntRange(1, 100000), default=8,
              show_default=True, help="requests in all")
@click.option("--max-tokens", type=click.IntRange(1, 1 << 20), default=128, show_default=True,
              help="tokens to decode per request")
@click.option("--prompt-words", type=click.IntRange(1, 1 << 20), default=200,
              show_default=True, help="prompt length in words (~1.3 tokens each)")
@click.option("--ignore-eos/--stop-at-eos", default=True, show_default=True,
              help="decode exactly --max-tokens (llama-server's ignore_eos)")
@click.option("--expect", "expect_items", multiple=True, metavar="KEY=VALUE",
              help="override the profile's expect: (decode_tps, prefill_tps, ttft_ms)")
@click.option("--no-expect", is_flag=True, help="report only; ignore thresholds")
@click.option("--api-key", envvar="HYDRA_API_KEY", default=None,
              help="llama-server --api-key, if the profile sets one [$HYDRA_API_KEY]")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="seconds one request may take")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@exits_2
def bench(profile: str | None, node_file: str | None, profiles_dir: str | None,
          port: int | None, url: str | None, concurrency: str, plot: Path | None,
          n_requests: int, max_tokens: int, prompt_words: int, ignore_eos: bool,
          expect_items: tuple[str, ...], no_expect: bool, api_key: str | None, timeout: float,
          as_json: bool) -> None:
    """Benchmark a serving profile: streaming chat requests, llama-server's own prefill and
    decode speed, time to first token; fails when the profile's expect: is missed.

    With hydra running here, it benches the port that serves the profile (found through the
    state dir, whatever --port hydra was started with); progress goes to stderr."""
    levels = benchplot.parse_levels(concurrency)
    if plot is not None:
        benchplot.check_target(plot)
    if url is not None:
        url = _check_url(url)
    node = load_node(find_node_file(node_file))
    named = profile
    if profile is not None and _is_path(profile):  # a file: its name is what hydra serves
        named = load_profile(find_profile(profile, profiles_dir), node).name
    target = resolve(running.snapshot(), named, port, url)
    prof = load_profile(find_profile(profile if profile is not None and _is_path(profile)
                                     else target.source or target.profile, profiles_dir), node)
    if prof.mode is Mode.PEER:
        raise HydraError(f"profile {prof.name} is a peer (it lends a device over ggml-RPC and "
                         "serves no HTTP); bench the head's profile on its host instead")
    base = (target.url or f"http://{client_host(prof.host)}:{prof.port}").rstrip("/")
    if target.state in states.NOT_LOADED:
        click.echo(f"profile {target.profile} is not loaded ({target.state}): the first request "
                   "loads it, and its time counts", err=True)
    if len(levels) > 1 or plot is not None:
        _sweep(target.profile, base, target.direct, levels, plot, n_requests=n_requests,
               max_tokens=max_tokens, prompt_words=prompt_words, ignore_eos=ignore_eos,
               api_key=api_key, timeout=timeout, as_json=as_json)
        return
    expect = {} if no_expect else {**prof.expect, **parse_expect(expect_items)}
    _check_serving(base, target.profile, timeout=min(timeout, 10.0))
    run = functools.partial(run_one, base, model=target.profile,
                            prompt_words=prompt_words, max_tokens=max_tokens,
                            ignore_eos=ignore_eos, timeout=timeout, api_key=api_key)
    t0 = time.monotonic()
    samples = _measure(run, n_requests, levels[0],
                       f"bench {target.profile} at {base}: {n_requests} requests, "
                       f"concurrency {levels[0]}")
    report = summarize(samples, url=base, profile=target.profile, concurrency=levels[0],
                       wall_s=time.monotonic() - t0)
    check_expect(report, expect)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
    else:
        _print(report)
    sys.exit(exits.OK if report.passed else exits.FAILED)


def _check_url(url: str) -> str:
    """--url is http(s)://HOST[:PORT][/PATH] with a port in range (no traceback, no request)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise HydraError(f"--url {url!r} is not a base URL",
                         hint="give http://HOST:PORT (a port from 1 to 65535), e.g. "
                              "http://127.0.0.1:8080")
    return url


def _is_path(profile: str) -> bool:
    """`-p` names a file, not a profile (config.find_profile's rule)."""
    return Path(profile).suffix in (".yaml", ".yml") or os.sep in profile


def _measure(run: Callable[[int], Sample], n: int, level: int, label: str) -> list[Sample]:
    """`n` requests, `level` at once, with progress on stderr: a bar on a terminal, the label
    as one line otherwise (logs, pipes). The workers are daemon threads: Ctrl-C ends the run
    at once (exit 130, cli.py), not after the requests in flight."""
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(n):
        todo.put(i)
    done: queue.SimpleQueue[Sample] = queue.SimpleQueue()

    def work() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put(run(i))
            except Exception as exc:  # noqa: BLE001 - one request's bug is its sample
                done.put(Sample(i, error=f"{type(exc).__name__}: {exc}"))

    for _ in range(min(level, n)):
        threading.Thread(target=work, name="bench", daemon=True).start()
    samples: list[Sample] = []
    with click.progressbar(length=n, label=label, file=sys.stderr, show_pos=True,
                           show_eta=True) as bar:
        while len(samples) < n:
            try:
                samples.append(done.get(timeout=0.5))
            except queue.Empty:
                continue
            bar.update(1)
    return sorted(samples, key=lambda s: s.index)


def _sweep(profile: str, router: str, direct: str | None, levels: list[int],
           plot: Path | None, *, n_requests: int, max_tokens: int, prompt_words: int,
           ignore_eos: bool, api_key: str | None, timeout: float, as_json: bool) -> None:
    """Each concurrency level through the router and straight to the head (when hydra serves
    the profile here); a level runs max(--requests, level) requests. Report only: a sweep
    checks no expect: (its thresholds are single-stream goals). Exit 1 when a request failed.
    Each step says what it runs on stderr (a sweep takes minutes)."""
    legs = [("router", router)]
    if direct:
        legs.append(("direct", direct))
    elif not as_json:
        click.echo(f"no direct leg: hydra here does not serve {profile} at {router} "
                   f"(hydra up -p {profile})", err=True)
    for _, target in legs:
        _check_serving(target, profile, timeout=min(timeout, 10.0))
    points, reports = [], []
    steps = len(levels) * len(legs)
    for i, (level, (leg, target)) in enumerate(
            ((lv, lg) for lv in levels for lg in legs), start=1):
        run = functools.partial(run_one, target, model=profile, prompt_words=prompt_words,
                                max_tokens=max_tokens, ignore_eos=ignore_eos,
                                timeout=timeout, api_key=api_key)
        n = max(n_requests, level)
        t0 = time.monotonic()
        samples = _measure(run, n, level, f"[{i}/{steps}] {leg} c={level}: {n} requests")
        rep = summarize(samples, url=target, profile=profile, concurrency=level,
                        wall_s=time.monotonic() - t0)
        rep.passed = rep.failed == 0 and rep.ok > 0
        reports.append(rep)
        points.append(benchplot.point(rep, leg))
        if not as_json:
            click.echo(f"{leg:7} c={level:<4} {rep.ok}/{rep.requests} ok  "
                       f"{rep.throughput_tps:8.1f} tokens/s  TTFT p50 "
                       f"{_fmt(rep.ttft_ms['p50'], ' ms')}  decode p50 "
                       f"{_fmt(rep.decode_tps['p50'], ' t/s')}")
            for line in rep.errors:
                click.echo(f"  {line}", err=True)
    if plot is not None:
        benchplot.write(plot, points, f"hydra bench {profile}: router vs direct")
        if not as_json:
            click.echo(f"wrote {plot}")
    passed = all(r.passed for r in reports)
    if as_json:
        click.echo(json.dumps({"profile": profile, "points": points, "passed": passed,
                               "reports": [asdict(r) for r in reports]}, indent=2))
    else:
        click.echo("PASS" if passed else "FAIL")
    sys.exit(exits.OK if passed else exits.FAILED)


def _check_serving(url: str, profile: str, timeout: float) -> None:
    """Fail fast, with the fix, when nothing serves at `url`."""
    try:
        r = requests.get(f"{url}/health", timeout=timeout)
    except requests.RequestException as exc:
        raise HydraError(f"nothing answers at {url} ({type(exc).__name__})",
                         hint=f"start it: hydra up -p {profile} (or pass --url)") from None
    if r.status_code != 200:
        raise HydraError(f"{url}/health answered {r.status_code}: {r.text[:200]}",
                         hint="wait until the model has loaded (`hydra status`)")
