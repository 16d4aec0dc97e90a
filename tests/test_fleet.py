"""Several profiles behind one port with real processes: `hydra up -p demo -p demo-moe-combine`.

Requests by model (openai client, keep-alive, streaming and not) reach the right llama-server;
/v1/models tells each profile's state; an unknown model gets 404; a stopped profile loads on
request; ttl unloads an idle one; on a node whose memory (a device file) fits only one of
them, two clients alternating between them fail nothing and reload no more often than
min_resident allows; a profile that fails to load answers with its reason while the other
serves.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from hydra_supervisor.serve.snapshot import LaneStatus
from hydra_supervisor.testing.harness import REPO, lanes, make_env, run_hydra, snapshot, wait_until

pytestmark = pytest.mark.slow  # real hydra up with llama-server processes

# llama-server's reply "model" is the profile that served it (hydra passes --alias NAME), so
# each reply names the llama-server process it came from.


def _port(env: dict[str, str]) -> int:
    return snapshot(env).ports[0].port


def _models(port: int) -> dict[str, dict[str, Any]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return {m["id"]: m for m in json.load(r)["data"]}


def _profiles(env: dict[str, str]) -> dict[str, LaneStatus]:
    return {lane.profile: lane for lane in lanes(env)}


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=240)


def _ask(client: openai.OpenAI, model: str, stream: bool) -> str:
    msgs: Any = [{"role": "user", "content": "Say hi"}]
    if stream:
        served = ""
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                                    stream=True):
            served = chunk.model or served
        return served
    return client.chat.completions.create(model=model, messages=msgs, max_tokens=4).model


def _profile_copy(tmp: Path, base: str, name: str, extra: str) -> None:
    text = (REPO / "profiles" / f"{base}.yaml").read_text()
    text = text.replace(f"profile: {base}\n", f"profile: {name}\n")
    (tmp / f"{name}.yaml").write_text(text + extra)


def test_two_profiles_one_port_routed_by_model(hydra_up, hydra_env):
    up = hydra_up("-p", "demo", "-p", "demo-moe-combine", "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    models = _models(port)
    assert models["demo"]["state"] == "serving" and models["demo"]["default"] is True
    assert models["demo-moe-combine"]["state"] == "stopped"
    assert models["demo-moe-combine"]["devices"] == ["cpu-peer", "cpu"]

    client = _client(port)
    # The first request for the stopped profile loads it and is held until it serves.
    for i in range(3):
        stream = bool(i % 2)
        assert _ask(client, "demo", stream) == "demo"
        assert _ask(client, "demo-moe-combine", stream) == "demo-moe-combine"
    models = _models(port)
    assert {m["state"] for m in models.values()} == {"serving"}

    with pytest.raises(openai.NotFoundError, match="known models: demo, demo-moe-combine"):
        _ask(client, "gpt-4", False)
    # No model: the default profile (demo).
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=b'{"messages":[{"role":"user","content":"hi"}],'
                                      b'"max_tokens":2}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.load(r)["model"] == "demo"

    res = run_hydra(hydra_env, "status")
    assert res.returncode == 0, res.stderr
    assert "demo-moe-combine" in res.stdout and "serving" in res.stdout

    res = run_hydra(hydra_env, "switch", "demo-moe-combine", "--json", timeout=240)
    rep = json.loads(res.stdout)
    assert res.returncode == 0 and rep["result"] == "noop"  # already serving

    # The wire protocol on a shared port reconfigures the default profile (its head restarts
    # alone) and the fleet keeps its record: demo keeps serving under its name.
    from tests.wire_client import OK, WireClient

    pids = {p.name: p.pid for r in _profiles(hydra_env).values() for p in r.processes}
    with WireClient("127.0.0.1", port) as wc:
        assert wc.info().meta["profile"] == "demo"
        r = wc.configure({"ctx_size": 2048})
        assert r.status == OK, r.meta
    after = {p.name: p.pid for r in _profiles(hydra_env).values() for p in r.processes}
    assert after["demo.head"] != pids["demo.head"]
    assert after["demo-moe-combine.head"] == pids["demo-moe-combine.head"]
    assert _ask(client, "demo", False) == "demo"
    # The fleet recorded the configured plan: a reload (the file says ctx 4096) restarts the
    # head back; the MoE profile is unchanged.
    res = run_hydra(hydra_env, "reload", timeout=120)
    assert res.returncode == 0 and "Reloaded demo: restarted demo.head" in res.stdout, res
    assert "demo-moe-combine" not in res.stdout
    profiles = _profiles(hydra_env)
    assert profiles["demo"].loads == 1
    assert profiles["demo-moe-combine"].loads == 1


def test_ttl_unloads_then_the_next_request_reloads(hydra_up, hydra_env, tmp_path):
    # ttl 10 s: long against the steps below on a busy 2-core box (2 s expired mid-test there)
    _profile_copy(tmp_path, "demo", "brief", "ttl: 10\n")
    # The set from the node file (no -p), its default answering requests without a model.
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + "profiles: [demo, brief]\ndefault_profile: brief\n")
    up = hydra_up("--profiles-dir", str(tmp_path), "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    assert snapshot(hydra_env).ports[0].default == "brief"
    client = _client(port)
    assert _ask(client, "brief", True) == "brief"
    pids = [p.pid for p in _profiles(hydra_env)["brief"].processes]
    assert pids
    assert _ask(client, "demo", True) == "demo"
    wait_until(lambda: _models(port)["brief"]["state"] == "stopped", 60, "ttl unload")
    assert _profiles(hydra_env)["brief"].processes == ()
    assert _models(port)["demo"]["state"] == "serving"  # no ttl: stays
    assert _ask(client, "brief", False) == "brief"
    brief = _profiles(hydra_env)["brief"]
    assert brief.loads == 2 and brief.unloads == 1
    # hydra reload: a new alias and threads for brief (its head restarts), demo unchanged
    prof = tmp_path / "brief.yaml"
    prof.write_text(prof.read_text().replace("threads: 1", "threads: 2")
                    + "aliases: [short]\n")
    res = run_hydra(hydra_env, "reload", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "Reloaded brief: restarted brief.head" in res.stdout  # (the reply's message)
    assert "demo" not in res.stdout
    assert _ask(client, "short", False) == "brief"
    assert _models(port)["brief"]["aliases"] == ["short"]


def test_profiles_that_cannot_fit_together_alternate_without_failures(hydra_up, tmp_path):
    devices = tmp_path / "devices.yaml"
    devices.write_text("cpu:\n  total_mib: 1000\n  threads: 2\n")  # demo 563 + moe 578 > 1000
    env = make_env(tmp_path, "defaults:\n  min_resident: 4\n")
    env["HYDRA_DEVICES_FILE"] = str(devices)
    from hydra_supervisor.testing.harness import Up

    up = Up(env, ["-p", "demo", "-p", "demo-moe-combine", "--port", "0"], tmp_path)
    try:
        up.wait_ready()
        port = _port(env)
        # hydra switch: the explicit form stops the profiles that share its devices.
        res = run_hydra(env, "switch", "demo-moe-combine", "--json", timeout=240)
        rep = json.loads(res.stdout)
        assert res.returncode == 0 and rep["result"] == "ok" and rep["from"] == "demo", rep
        assert {m: d["state"] for m, d in _models(port).items()} == {
            "demo": "stopped", "demo-moe-combine": "serving"}
        failures: list[str] = []
        served = {"demo": 0, "demo-moe-combine": 0}
        stop = threading.Event()

        def client_loop(model: str) -> None:
            c = _client(port)
            n = 0
            while not stop.is_set():
                try:
                    _ask(c, model, bool(n % 2))
                    served[model] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    failures.append(f"{model}: {exc!r}")
                n += 1
                time.sleep(0.2)

        threads = [threading.Thread(target=client_loop, args=(m,), daemon=True)
                   for m in served]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(14)
        stop.set()
        for t in threads:
            t.join(240)
        elapsed = time.monotonic() - t0
        assert not failures, failures
        assert served["demo"] >= 1 and served["demo-moe-combine"] >= 1, served
        profiles = _profiles(env)
        loads = sum(p.loads for p in profiles.values())
        # Never both at once; a profile stays >= 4 s once loaded, so at most one load per
        # 4 s after the first two (plus the one at start).
        assert sum(p.state == "serving" for p in profiles.values()) <= 1
        assert loads <= 2 + int(elapsed / 4) + 1, (loads, elapsed)
        assert loads >= 2
    finally:
        up.stop()
        up.kill_everything()


def test_a_profile_that_fails_to_load_answers_why_and_the_other_serves(
        hydra_up, hydra_env, tmp_path):
    (tmp_path / "broken.yaml").write_text(
        "profile: broken\nmodel: gemma3-270m\nmode: solo\nhead: cpu\n"
        "server_args:\n  cache-type-k: nonsense\n")  # plans fine; llama-server exits at start
    up = hydra_up("-p", "demo", "-p", "broken", "--profiles-dir", str(tmp_path), "--port", "0")
    up.wait_ready()
    port = _port(hydra_env)
    client = _client(port)
    with pytest.raises(openai.APIStatusError) as info:
        _ask(client, "broken", False)
    assert info.value.status_code == 503
    assert "profile broken failed to load" in str(info.value)
    assert "Unsupported cache type: nonsense" in str(info.value)  # llama.cpp's own words
    assert _models(port)["broken"]["state"] == "failed"
    assert _ask(client, "demo", True) == "demo"
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).close()
    except urllib.error.URLError as exc:  # pragma: no cover - the assertion says it
        raise AssertionError(exc) from exc


def test_own_port_profiles_are_engines_of_their_own_and_metrics_name_each(
        hydra_up, hydra_env, tmp_path):
    from hydra_supervisor.testing.harness import free_port

    p1, p2, mport = free_port(), free_port(), free_port()
    for base, name, port in (("demo", "front", p1), ("demo-moe-combine", "front-moe", p1),
                             ("demo", "side", p2)):
        text = (REPO / "profiles" / f"{base}.yaml").read_text()
        text = text.replace(f"profile: {base}\n", f"profile: {name}\n")
        (tmp_path / f"{name}.yaml").write_text(text.replace("port: 8080", f"port: {port}"))
    up = hydra_up("-p", "front", "-p", "front-moe", "-p", "side", "--profiles-dir",
                  str(tmp_path), "--metrics-port", str(mport))
    up.wait_ready()
    # `hydra up` presents its ports in turn, each once its default serves: the second port's
    # line comes after the first's (its engines may be READY a moment before its lane serves)
    wait_until(lambda: f"ready: side serving gemma3-270m at http://127.0.0.1:{p2}"
               in up.output(), 120, "the second port's ready line")
    ports = {p.port: p for p in snapshot(hydra_env).ports}
    assert ports[p1].profiles == ("front", "front-moe") and ports[p1].default == "front"
    assert ports[p2].profiles == ("side",) and ports[p2].default == "side"
    assert set(_models(p1)) == {"front", "front-moe"} and set(_models(p2)) == {"side"}
    # Each port's default loaded at start; a model of the other port is unknown here.
    assert _models(p2)["side"]["state"] == "serving"
    assert _ask(_client(p2), "side", False) == "side"
    with pytest.raises(openai.NotFoundError):
        _ask(_client(p2), "front", False)
    # The wire protocol addresses a lane: each port's wire server its own default lane.
    from tests.wire_client import WireClient
    for port, want in ((p1, "front"), (p2, "side")):
        with WireClient("127.0.0.1", port) as wc:
            assert wc.info().meta["profile"] == want, (port, wc.info().meta)
    assert _ask(_client(p1), "front-moe", True) == "front-moe"
    # A request without a model on the second port: counted there, under its own default.
    req = urllib.request.Request(f"http://127.0.0.1:{p2}/v1/chat/completions",
                                 data=b'{"messages":[{"role":"user","content":"hi"}],'
                                      b'"max_tokens":2}',
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.load(r)["model"] == "side"
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> tuple[str, dict[tuple[str, str], float]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30) as r:
            text = r.read().decode()
        served: dict[tuple[str, str], float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if (s.name == "hydra_http_requests_total"
                        and s.labels.get("endpoint") == "/v1/chat/completions"):
                    key = (s.labels["engine"], s.labels["profile"])
                    served[key] = served.get(key, 0.0) + s.value  # summed over model, status
        return text, served

    # (a request is counted just after its reply is written: wait for the count)
    def counted() -> tuple[str, dict[tuple[str, str], float]] | None:
        got = scrape()
        return got if got[1].get((f"port-{p2}/side", "side")) == 2.0 else None

    try:
        text, served = wait_until(counted, 30, "the model-less request counted under side")
    except AssertionError as e:
        raise AssertionError(f"{e}: {scrape()[1]}") from None
    assert served.get((f"port-{p1}/front-moe", "front-moe")) == 1.0, served
    assert not any(p == "front" for _, p in served), served  # nothing guessed onto p1's default

    samples = {(s.name, s.labels.get("profile"), s.labels.get("state")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    for prof in ("front", "front-moe", "side"):
        assert samples[("hydra_profile_loads_total", prof, None)] == 1.0
        assert samples[("hydra_engine_state", prof, "serving")] == 1.0
    # The port's router counters once per port, not once per profile. (They are labelled by
    # the port alone now, engine="port-N" and no profile: the key above has no engine, so
    # count them by their own labels.)
    routers = [s.labels for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "hydra_router_alive"]
    assert sorted(r["engine"] for r in routers) == sorted([f"port-{p1}", f"port-{p2}"]), routers
    assert not any("profile" in r for r in routers), routers
