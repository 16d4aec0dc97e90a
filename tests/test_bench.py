"""`hydra bench`: statistics and the expect: gate on their own, the expect: block in the profile
schema, and a real run against `hydra up --profile demo` (plausible numbers; an impossible
threshold exits 1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from hydra_supervisor.cli.bench_cmd import (
    Sample,
    bench,
    check_expect,
    parse_expect,
    percentile,
    sse_events,
    summarize,
)
from hydra_supervisor.config.config import load_node, load_profile
from hydra_supervisor.errors import ConfigError, HydraError
from hydra_supervisor.testing.harness import free_port

REPO = Path(__file__).resolve().parent.parent


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(i) for i in range(1, 101)], 95) == pytest.approx(95.05)


def test_sse_events_stop_at_done() -> None:
    lines = [b": comment", b"", b'data: {"choices": []}', b"data: not json",
             b'data: {"timings": {"predicted_n": 3}}', b"data: [DONE]", b'data: {"late": 1}']
    assert list(sse_events(iter(lines))) == [{"choices": []}, {"timings": {"predicted_n": 3}},
                                             "[DONE]"]


def _samples() -> list[Sample]:
    return [
        Sample(0, ok=True, ttft_ms=100, latency_s=2, prompt_n=50, predicted_n=32,
               prefill_tps=500, decode_tps=20),
        Sample(1, ok=True, ttft_ms=300, latency_s=3, prompt_n=50, predicted_n=32,
               prefill_tps=300, decode_tps=30),
        Sample(2, ok=True, ttft_ms=200, latency_s=4, prompt_n=50, predicted_n=32,
               prefill_tps=400, decode_tps=25),
    ]


def test_summary_and_gate() -> None:
    rep = summarize(_samples(), url="u", profile="p", concurrency=1, wall_s=4.0)
    assert rep.ok == 3 and rep.failed == 0 and rep.throughput_tps == 24.0
    assert rep.decode_tps["p50"] == 25 and rep.ttft_ms["p50"] == 200
    assert rep.prefill_tps["max"] == 500 and rep.completion_tokens == 32
    assert check_expect(rep, {"decode_tps": 25, "prefill_tps": 400, "ttft_ms": 200}).passed
    rep = check_expect(rep, {"decode_tps": 26, "ttft_ms": 500})
    assert not rep.passed
    assert rep.expect["decode_tps"] == {"want": 26, "got": 25, "ok": False, "rule": "p50 >= want"}
    assert rep.expect["ttft_ms"]["ok"] and "prefill_tps" not in rep.expect
    failing = [*_samples(), Sample(3, error="HTTP 503: busy")]
    rep = check_expect(summarize(failing, url="u", profile="p", concurrency=1, wall_s=1), {})
    assert not rep.passed and rep.errors == ["request 3: HTTP 503: busy"]


def test_parse_expect() -> None:
    assert parse_expect(["decode_tps=24", "ttft_ms = 500"]) == {"decode_tps": 24.0,
                                                                "ttft_ms": 500.0}
    with pytest.raises(HydraError, match="KEY one of"):
        parse_expect(["decode=1"])
    with pytest.raises(HydraError, match="not a number"):
        parse_expect(["decode_tps=fast"])


def test_expect_in_the_profile_schema(tmp_path: Path) -> None:
    node = load_node(None)
    good = tmp_path / "good.yaml"
    good.write_text("model: gemma3-270m\nexpect:\n  decode_tps: 24\n  ttft_ms: 800\n")
    assert dict(load_profile(good, node).expect) == {"decode_tps": 24.0, "ttft_ms": 800.0}
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: gemma3-270m\nexpect:\n  decode_tp: 24\n  prefill_tps: -3\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(bad, node)
    msg = str(exc.value)
    assert f"{bad}:3: expect.decode_tp: unknown key 'decode_tp'" in msg
    assert "did you mean 'decode_tps'" in msg
    assert f"{bad}:4: expect.prefill_tps: expected a positive number" in msg


def test_rig_profiles_carry_the_acceptance_goals() -> None:
    node = load_node(REPO / "docs" / "node.rig.example.yaml")
    want = {"dense27b-combine": 24.0, "moe35b-combine": 45.0, "moe35b-solo": 190.0}
    for name, decode in want.items():
        prof = load_profile(REPO / "profiles" / f"{name}.yaml", node)
        assert prof.expect.get("decode_tps") == decode, name


def test_nothing_serving_is_a_clear_error() -> None:
    port = free_port()
    res = CliRunner().invoke(bench, ["-p", "demo", "--url", f"http://127.0.0.1:{port}"])
    assert res.exit_code == 2
    assert "nothing answers at" in res.output and "hydra up -p demo" in res.output


# ----------------------------------------------------------------------- real hydra up


def _bench(*args: str) -> tuple[int, dict[str, Any]]:
    res = CliRunner().invoke(bench, [*args, "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)  # progress goes to stderr


@pytest.mark.slow
def test_bench_against_hydra_up_demo(hydra_up: Any, hydra_env: dict[str, str],
                                     tmp_path: Path) -> None:
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready(timeout=300)
    url = f"http://127.0.0.1:{port}"

    code, rep = _bench("-p", "demo", "--url", url, "-c", "2", "-n", "4", "--max-tokens", "16",
                       "--prompt-words", "60")
    assert code == 0 and rep["passed"], rep
    assert rep["ok"] == 4 and rep["failed"] == 0 and rep["concurrency"] == 2
    assert rep["completion_tokens"] == 16  # ignore_eos: exactly max_tokens
    assert rep["prompt_tokens"] > 60  # the whole prompt prefilled (cache_prompt off)
    for key in ("decode_tps", "prefill_tps"):
        assert 0.1 < rep[key]["p50"] < 100_000, (key, rep[key])
        assert rep[key]["min"] <= rep[key]["p50"] <= rep[key]["p95"] <= rep[key]["max"]
    assert 0 < rep["ttft_ms"]["p50"] < rep["latency_s"]["p50"] * 1000
    assert 0 < rep["throughput_tps"]

    # The profile's expect: block is the gate: an impossible decode speed fails the run.
    prof_dir = tmp_path / "profiles"
    prof_dir.mkdir()
    demo = (REPO / "profiles" / "demo.yaml").read_text().replace("profile: demo",
                                                                "profile: demo-gated")
    (prof_dir / "demo-gated.yaml").write_text(demo + "expect:\n  decode_tps: 1000000\n")
    code, rep = _bench("-p", "demo-gated", "--profiles-dir", str(prof_dir), "--url", url,
                       "-n", "1", "--max-tokens", "8", "--prompt-words", "20")
    assert code == 1 and not rep["passed"]
    assert rep["expect"]["decode_tps"]["ok"] is False and rep["ok"] == 1
    # --expect overrides the profile: a threshold it meets passes
    code, rep = _bench("-p", "demo-gated", "--profiles-dir", str(prof_dir), "--url", url,
                       "-n", "1", "--max-tokens", "8", "--prompt-words", "20",
                       "--expect", "decode_tps=0.01", "--expect", "ttft_ms=600000")
    assert code == 0 and rep["passed"] and set(rep["expect"]) == {"decode_tps", "ttft_ms"}
    # the human-readable form
    res = CliRunner().invoke(bench, ["-p", "demo", "--url", url, "-n", "1", "--max-tokens", "4",
                                     "--prompt-words", "10", "--expect", "ttft_ms=0.001"])
    assert res.exit_code == 1
    assert "decode t/s" in res.output and "expect ttft_ms" in res.output
    assert "MISSED" in res.output and res.output.rstrip().endswith("FAIL")
