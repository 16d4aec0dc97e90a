"""`hydra load`, `hydra unload` and `hydra switch` with real llama-server processes (issue 29's
Done-when): `hydra unload demo` on `hydra up -p demo -p demo-moe` leaves demo not loaded and
demo-moe serving, and the next request for demo loads it again; a switch stops only what does
not fit beside its target, and says what it stopped and why.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from hydra_supervisor.testing.harness import Up, lanes, make_env, run_hydra, snapshot, wait_until

pytestmark = pytest.mark.slow  # real hydra up with llama-server processes


def _states(env: dict[str, str]) -> dict[str, str]:
    return {x.profile: x.state for x in lanes(env)}


def _ask(port: int, model: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=240)
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4).model


def _json(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    res = run_hydra(env, *args, "--json", timeout=240)
    return res.returncode, json.loads(res.stdout)


def test_unload_leaves_the_other_serving_and_a_request_loads_it_again(
        hydra_env: dict[str, str], tmp_path: Path) -> None:
    up = Up(hydra_env, ["-p", "demo", "-p", "demo-moe", "--port", "0"], tmp_path)
    try:
        up.wait_ready()
        port = snapshot(hydra_env).ports[0].port
        assert _ask(port, "demo-moe") == "demo-moe"  # loaded on request, beside demo
        # (the route opens when the head is READY; the lane says serving a moment later)
        both = {"demo": "serving", "demo-moe": "serving"}
        wait_until(lambda: _states(hydra_env) == both, 30, "both serving")

        res = run_hydra(hydra_env, "unload", "demo", timeout=120)
        assert res.returncode == 0, res
        assert res.stdout.startswith("Unloaded demo in "), res.stdout
        assert "the next request for it loads it again" in res.stdout
        assert _states(hydra_env) == {"demo": "stopped", "demo-moe": "serving"}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            models = {m["id"]: m["status"]["value"] for m in json.load(r)["data"]}
        assert models == {"demo": "unloaded", "demo-moe": "loaded"}
        res = run_hydra(hydra_env, "unload", "demo", timeout=60)
        assert res.returncode == 0 and "Nothing to do for demo: it is not loaded" in res.stdout

        assert _ask(port, "demo") == "demo"  # the next request loads it again
        wait_until(lambda: _states(hydra_env) == both, 30, "demo serving again")
        rows = {x.profile: x for x in lanes(hydra_env)}
        assert rows["demo"].state == "serving" and rows["demo"].loads == 2
        assert rows["demo-moe"].state == "serving" and rows["demo-moe"].loads == 1

        # hydra switch to a profile that fits beside what serves stops nothing (it stopped
        # every profile sharing the CPU before issue 29)
        code, rep = _json(hydra_env, "unload", "demo")
        assert code == 0 and rep["unloaded"] == ["demo"], rep
        code, rep = _json(hydra_env, "switch", "demo")
        assert code == 0 and rep["result"] == "ok" and rep["stopped"] == [], rep
        assert "nothing else was stopped" in rep["message"], rep
        assert _states(hydra_env) == {"demo": "serving", "demo-moe": "serving"}

        # bad input: one error line naming the choices, exit 2
        res = run_hydra(hydra_env, "load", "nope", timeout=60)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res
        assert "no profile 'nope' in this hydra (its profiles: demo, demo-moe)" in res.stderr

        code, rep = _json(hydra_env, "unload", "--all")
        assert code == 0 and sorted(rep["unloaded"]) == ["demo", "demo-moe"], rep
        assert _states(hydra_env) == {"demo": "stopped", "demo-moe": "stopped"}
    finally:
        up.stop()
        up.kill_everything()


def test_switch_and_load_stop_only_what_does_not_fit_and_say_why(tmp_path: Path) -> None:
    devices = tmp_path / "devices.yaml"
    # demo needs 563 MiB, demo-moe 307 (hydra plan --json): alone each fits, together not
    devices.write_text("cpu:\n  total_mib: 800\n  threads: 2\n")
    env = make_env(tmp_path, "defaults:\n  min_resident: 0\n")
    env["HYDRA_DEVICES_FILE"] = str(devices)
    up = Up(env, ["-p", "demo", "-p", "demo-moe", "--port", "0"], tmp_path)
    try:
        up.wait_ready()
        code, rep = _json(env, "switch", "demo-moe")
        assert code == 0 and rep["result"] == "ok" and rep["from"] == "demo", rep
        [stopped] = rep["stopped"]
        assert stopped["profile"] == "demo", rep
        assert stopped["why"].startswith("it did not fit beside demo-moe (demo-moe needs "), rep
        assert "MiB of host memory, " in stopped["why"] and "MiB free)" in stopped["why"], rep
        assert f"Stopped demo: {stopped['why']}." in rep["message"], rep
        assert _states(env) == {"demo": "stopped", "demo-moe": "serving"}

        res = run_hydra(env, "load", "demo", timeout=240)
        assert res.returncode == 0, res
        assert res.stdout.startswith("demo is serving (loaded in "), res.stdout
        assert "Stopped demo-moe: it did not fit beside demo (demo needs " in res.stdout
        assert _states(env) == {"demo": "serving", "demo-moe": "stopped"}
    finally:
        up.stop()
        up.kill_everything()
