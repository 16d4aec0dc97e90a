"""Profiles you can read before they fail (issue 29): `server_args` checked against the binaries'
own `--help` at plan time, `hydra profiles [--json]` with a validity check, and `hydra plan`
printing exactly the argv that runs.

tests/help/*.txt are captured `--help` outputs of the pinned build (llama-server: an excerpt
that keeps the awkward lines: aliases on one line, a flag list with no description, a
continuation line that names a flag; ggml-rpc-server: whole). The fast tests put them behind a
stand-in binary; the slow ones read the real cached binaries.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from hydra_supervisor.config.config import load_node
from hydra_supervisor.config.models import SYNTH_SHAPES, resolve_model
from hydra_supervisor.config.paths import cache_dir, repo_root
from hydra_supervisor.plan import flagcheck
from hydra_supervisor.testing.harness import HYDRA, REPO, make_env, run_hydra, status_json
from hydra_supervisor.tools import helpflags

HELP = Path(__file__).parent / "help"


def _help(name: str) -> helpflags.Help:
    return helpflags.Help(Path(name), helpflags.parse_help((HELP / f"{name}.txt").read_text()))


# ----------------------------------------------------------------------- parsing (golden)


def test_llama_server_help_parses_every_spelling_of_every_option() -> None:
    groups = helpflags.parse_help((HELP / "llama-server.txt").read_text())
    assert groups[:3] == (("-h", "--help", "--usage"), ("--poll-batch",), ("-c", "--ctx-size"))
    assert ("-n", "--predict", "--n-predict") in groups
    assert ("-kvo", "--kv-offload", "-nkvo", "--no-kv-offload") in groups  # no description
    assert ("--perf", "--no-perf") in groups and ("-e", "--escape", "--no-escape") in groups
    assert ("-ngl", "--gpu-layers", "--n-gpu-layers") in groups
    assert ("-fitt", "--fit-target") in groups  # a metavar with commas is no flag
    assert ("-hf", "-hfr", "--hf-repo") in groups
    assert ("--slot-save-path",) in groups and ("-s", "--seed") in groups
    flags = {f for g in groups for f in g}
    assert "--no-mmproj" not in flags  # named in a description's continuation line
    assert not any(f.startswith("---") or f in ("-1", "--fit") for f in flags)
    assert len(groups) == 26


def test_rpc_server_help_parses_its_indented_options() -> None:
    assert helpflags.parse_help((HELP / "ggml-rpc-server.txt").read_text()) == (
        ("-h", "--help"), ("-t", "--threads"), ("-d", "--device"), ("-H", "--host"),
        ("-p", "--port"), ("-c", "--cache"))


def test_unknown_server_args_with_suggestions() -> None:
    help_ = _help("llama-server")
    args = {"ctx-size": 4096, "c": 1, "--seed": 1, "swa-full": True, "no-perf": True,
            "ctx-sise": 1, "ngl": 3, "no-such-flag": 1, "n-predict": False}
    got = {u.key: u for u in flagcheck.unknown_args(args, help_)}
    assert set(got) == {"ctx-sise", "ngl", "no-such-flag"}
    assert got["ctx-sise"].suggestion == "ctx-size"
    assert got["ctx-sise"].text() == "llama-server has no flag --ctx-sise; did you mean ctx-size?"
    # `ngl` is written `--ngl`, which llama-server refuses: its long name is what works
    assert (got["ngl"].flag, got["ngl"].short, got["ngl"].suggestion) == (
        "--ngl", "-ngl", "n-gpu-layers")
    assert got["no-such-flag"].suggestion is None
    assert got["no-such-flag"].text() == "llama-server has no flag --no-such-flag"


# ------------------------------------------------------------- a stand-in binary behind it


def _stand_in(tmp: Path, name: str, calls: Path, text: Path | None = None) -> Path:
    """A binary whose --help prints the captured text (or `text`) and counts its calls."""
    path = tmp / "bin" / name
    path.parent.mkdir(exist_ok=True)
    text = text or HELP / f"{name}.txt"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {shlex.quote(str(calls))}\n"
                    f"[ \"$1\" = --help ] && exec cat {shlex.quote(str(text))}\n"
                    "exit 97\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A hydra environment whose llama-server and ggml-rpc-server print the captured --help,
    with a private cache dir (the flag cache) and no profiles but the test's and the repo's."""
    e = make_env(tmp_path)
    calls = tmp_path / "help-calls"
    e["HYDRA_LLAMA_SERVER"] = str(_stand_in(tmp_path, "llama-server", calls))
    e["HYDRA_RPC_SERVER"] = str(_stand_in(tmp_path, "ggml-rpc-server", calls))
    # A private cache dir for the flag cache, sharing the real one's GGUF facts and synthetic
    # models (reading a vocabulary, or writing a model, again in every test costs seconds).
    cache = tmp_path / "cache"
    cache.mkdir()
    for part in ("modelinfo", "models"):
        (cache_dir() / part).mkdir(parents=True, exist_ok=True)  # a fresh machine has neither
        (cache / part).symlink_to(cache_dir() / part, target_is_directory=True)
    # the synthetic models written into the real cache (they need its llama.cpp source's
    # tokenizer, which the private cache lacks)
    for alias in SYNTH_SHAPES:
        resolve_model(alias, load_node(None), tmp_path)
    e["HYDRA_CACHE_DIR"] = str(cache)
    e["XDG_CONFIG_HOME"] = str(tmp_path / "config")
    e.pop("HYDRA_PROFILE_PATH", None)
    return e


def _profile(tmp: Path, name: str, text: str) -> Path:
    path = tmp / "profiles" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_plan_refuses_an_unknown_flag_naming_file_line_and_flag(env: dict[str, str],
                                                                tmp_path: Path) -> None:
    prof = _profile(tmp_path, "typo", "model: gemma3-270m\nserver_args:\n  ctx-size: 2048\n"
                    "  no-such-flag: 1\n  ctx-sise: 5\n")
    res = run_hydra(env, "plan", "-p", str(prof))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == (f"error: {prof}:4: server_args.no-such-flag: llama-server has no flag "
                        "--no-such-flag")
    assert lines[1] == (f"{prof}:5: server_args.ctx-sise: llama-server has no flag --ctx-sise; "
                        "did you mean ctx-size?")
    assert "fix: server_args are llama-server's own flags" in res.stderr
    # parsed once: the second plan reads the cache dir, not the binary
    cached = list((tmp_path / "cache" / "flags").glob("llama-server-*.json"))
    assert len(cached) == 1 and ["-c", "--ctx-size"] in json.loads(cached[0].read_text())[
        "options"]
    assert run_hydra(env, "plan", "-p", str(prof)).returncode == 2
    assert (tmp_path / "help-calls").read_text().splitlines() == ["--help"]


def test_up_refuses_an_unknown_flag_before_starting_anything(env: dict[str, str],
                                                             tmp_path: Path) -> None:
    prof = _profile(tmp_path, "typo", "model: gemma3-270m\nserver_args: {no-such-flag: 1}\n")
    res = run_hydra(env, "up", "-p", str(prof), "--port", "0", timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{prof}:2: server_args.no-such-flag: llama-server has no flag --no-such-flag" \
        in res.stderr
    assert (tmp_path / "help-calls").read_text().splitlines() == ["--help"]  # nothing started


def test_a_node_default_flag_is_named_at_its_node_file_line(env: dict[str, str],
                                                            tmp_path: Path) -> None:
    node = Path(env["HYDRA_NODE"])
    node.write_text(node.read_text() + "defaults:\n  server_args:\n    flash-atn: 'on'\n")
    res = run_hydra(env, "plan", "-p", "demo")
    assert res.returncode == 2
    assert (f"{node}:5: server_args.flash-atn: llama-server has no flag --flash-atn; did you "
            "mean flash-attn?") in res.stderr


def test_peer_argv_is_checked_against_ggml_rpc_server(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    """hydra's own peer flags (-H -p -c -t) are all in the captured help: demo-combine plans;
    the plan says which binaries it was checked against."""
    res = run_hydra(env, "plan", "-p", "demo-combine", "--json")
    assert res.returncode == 0, res.stderr
    check = json.loads(res.stdout)["flag_check"]
    assert check == {"checked": [env["HYDRA_RPC_SERVER"], env["HYDRA_LLAMA_SERVER"]],
                     "skipped": []}


def test_a_peer_binary_without_a_flag_hydra_gives_it_is_refused(env: dict[str, str],
                                                                tmp_path: Path) -> None:
    """A ggml-rpc-server of another llama.cpp version, without -c (its tensor cache)."""
    older = tmp_path / "older-rpc-help.txt"
    older.write_text("\n".join(line for line in (HELP / "ggml-rpc-server.txt").read_text()
                               .splitlines() if "--cache" not in line))
    (tmp_path / "older").mkdir()
    rpc = _stand_in(tmp_path / "older", "ggml-rpc-server", tmp_path / "calls2", older)
    env["HYDRA_RPC_SERVER"] = str(rpc)
    res = run_hydra(env, "plan", "-p", "demo-combine")
    assert res.returncode == 2, res.stdout
    assert (f"demo-combine.yaml: peer-cpu-peer: ggml-rpc-server ({rpc}) has no flag -c, which "
            "hydra gives it: another llama.cpp version than hydra's?") in res.stderr


def test_a_missing_binary_skips_the_check_and_says_so(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    env["HYDRA_LLAMA_SERVER"] = str(tmp_path / "nowhere" / "llama-server")
    prof = _profile(tmp_path, "typo", "model: gemma3-270m\nserver_args: {no-such-flag: 1}\n")
    res = run_hydra(env, "plan", "-p", str(prof))
    assert res.returncode == 0, res.stderr
    assert "flags not checked: llama-server: $HYDRA_LLAMA_SERVER=" in res.stdout
    assert "(llama-server is not found on this host: hydra up would stop here)" in res.stdout


def test_a_binary_that_lists_no_flags_skips_the_check(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "not-llama"
    fake.write_text("#!/bin/sh\necho 'not llama.cpp' >&2\nexit 3\n")
    fake.chmod(0o755)
    env["HYDRA_LLAMA_SERVER"] = str(fake)
    res = run_hydra(env, "plan", "-p", "demo", "--json")
    assert res.returncode == 0, res.stderr
    (why,) = json.loads(res.stdout)["flag_check"]["skipped"]
    assert why == f"llama-server: `{fake} --help` listed no flags (exit 3: not llama.cpp)"
    assert not (tmp_path / "cache" / "flags").exists()  # a failure is not cached


# ------------------------------------------------------------------------ hydra profiles


def test_profiles_lists_each_profile_with_its_verdict(env: dict[str, str],
                                                      tmp_path: Path) -> None:
    d = tmp_path / "profiles"
    _profile(tmp_path, "good", "description: the demo model\nmodel: gemma3-270m\n"
             "server_args: {ctx-size: 2048}\n")
    _profile(tmp_path, "syntax", "model: gemma3-270m\nserver_args: [\n  ctx-size: 2\n")
    _profile(tmp_path, "badkey", "model: gemma3-270m\nmodle: x\n")
    _profile(tmp_path, "nomodel", "description: gone\nmodel: /nowhere/x.gguf\n")
    _profile(tmp_path, "toobig", "model: gemma3-270m\nserver_args: {ctx-size: 100000000}\n")
    _profile(tmp_path, "flag", "model: gemma3-270m\nserver_args: {ctx-sise: 1}\n")
    _profile(tmp_path, "nodevice", "model: gemma3-270m\nhead: gpu7\n")
    _profile(tmp_path, "combo", "model: synth-dense\nmode: combine\npeers: [cpu-peer]\n")
    res = run_hydra(env, "profiles", "--profiles-dir", str(d), "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    mine = {n: rows[n] for n in ("good", "syntax", "badkey", "nomodel", "toobig", "flag",
                                 "nodevice", "combo")}
    assert {n: (r["usable"], r["problem"]) for n, r in mine.items()} == {
        "good": (True, None), "syntax": (False, "broken"), "badkey": (False, "broken"),
        "nomodel": (False, "model missing"), "toobig": (False, "does not fit"),
        "flag": (False, "unknown flag"), "nodevice": (False, "invalid"), "combo": (True, None)}
    assert mine["good"] == {"name": "good", "path": str(d / "good.yaml"),
                            "description": "the demo model", "mode": "solo",
                            "model": "gemma3-270m", "devices": ["cpu"], "usable": True,
                            "problem": None, "reason": None}
    assert mine["combo"]["devices"] == ["cpu", "cpu-peer"] and mine["combo"]["mode"] == "combine"
    reason = {n: r["reason"] for n, r in mine.items()}
    assert reason["syntax"].startswith(f"{d / 'syntax.yaml'}:4:1: YAML syntax error")
    assert reason["badkey"].startswith(f"{d / 'badkey.yaml'}:2: modle: unknown key 'modle'")
    assert reason["nomodel"].startswith(f"{d / 'nomodel.yaml'}:2: model file not found")
    assert mine["nomodel"]["description"] == "gone"  # readable, so described
    assert "model does not fit the devices of profile 'toobig'" in reason["toobig"]
    assert reason["flag"].startswith(f"{d / 'flag.yaml'}:2: server_args.ctx-sise: llama-server "
                                     "has no flag --ctx-sise; did you mean ctx-size?")
    assert "unknown device 'gpu7'" in reason["nodevice"]
    # the shipped demo profiles are found too, and usable here
    assert all(rows[n]["usable"] for n in ("demo", "demo-combine", "demo-moe",
                                           "demo-moe-combine", "demo-peer")), rows

    text = run_hydra(env, "profiles", "--profiles-dir", str(d))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["NAME", "MODE", "MODEL", "DEVICES", "CHECK", "DESCRIPTION"]
    good = next(line for line in lines if line.startswith("good "))
    assert good.split() == ["good", "solo", "gemma3-270m", "cpu", "usable", "the", "demo",
                            "model"]
    syntax = lines.index(next(line for line in lines if line.startswith("syntax ")))
    assert lines[syntax].split()[-1] == "broken"
    assert lines[syntax + 1].strip().startswith(f"{d / 'syntax.yaml'}:4:1: YAML syntax error")


def test_every_shipped_profile_has_a_description_and_the_demos_a_seed() -> None:
    for path in sorted((repo_root() / "profiles").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        assert data.get("description"), path
        if path.stem in ("demo", "demo-combine"):  # Gemma: the README's reply is readable
            assert data["server_args"]["seed"] == 1, path


# -------------------------------------------------------------- the plan is what runs


def test_plan_json_argv_is_the_command_line_prepare_runs(env: dict[str, str]) -> None:
    """`hydra plan --json`'s argv per engine is what the supervisor spawns: the binary's path,
    the resolver's flags and the state dir's slot dir (`deployment.final_plan` and
    `EngineSpec.argv`, which the supervisor's spawn uses too)."""
    res = run_hydra(env, "plan", "-p", "demo-combine", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    argv = {e["name"]: e["argv"] for e in plan["engines"]}
    slots = str(Path(env["HYDRA_STATE_DIR"]) / "slots")
    assert argv["head"][0] == env["HYDRA_LLAMA_SERVER"]
    assert argv["head"][-2:] == ["--slot-save-path", slots]
    assert argv["peer-cpu-peer"][0] == env["HYDRA_RPC_SERVER"]
    assert not Path(slots).exists()  # named, not made

    code = ("import json, os, sys\n"
            "from pathlib import Path\n"
            "from hydra_supervisor.plan import deployment\n"
            "from hydra_supervisor.proc.state import StateDir\n"
            "dep = deployment.prepare('demo-combine', slot_dir=StateDir.default().slots())\n"
            "print(json.dumps({e.name: e.argv(dep.binaries[e.program])"
            " for e in dep.plan.engines}))\n")
    ran = subprocess.run([HYDRA[0], "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=False)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == argv


def test_solo_plan_has_no_transport(env: dict[str, str]) -> None:
    plan = json.loads(run_hydra(env, "plan", "-p", "demo", "--json").stdout)
    assert plan["mode"] == "solo" and plan["transport"] == "none"
    text = run_hydra(env, "plan", "-p", "demo").stdout
    assert "mode solo (dense), ctx 4096" in text and "transport" not in text
    combine = run_hydra(env, "plan", "-p", "demo-combine").stdout
    assert "mode combine (dense), transport rpc, ctx 4096" in combine


# ------------------------------------------------------------------- the real binaries


@pytest.mark.slow
def test_the_real_binaries_know_every_flag_hydra_and_the_shipped_profiles_use() -> None:
    """Against the cached build: its --help parses, the captured excerpt is a part of it (the
    fixture is not stale), and every flag hydra writes for the demo profiles, and every
    server_args key of every shipped profile, is one it lists."""
    from hydra_supervisor.plan import layout
    from hydra_supervisor.tools import binaries

    server = helpflags.flags_of(binaries.find("llama-server").path)
    rpc = helpflags.flags_of(binaries.find("ggml-rpc-server").path)
    assert server.known and rpc.known, (server.why, rpc.why)
    assert set(_help("llama-server").options) <= set(server.options)
    assert _help("ggml-rpc-server").options == rpc.options
    for name in ("demo", "demo-combine", "demo-moe", "demo-moe-combine", "demo-peer"):
        lay = layout.build(name, check_ports=False)
        for e in lay.plan.engines:
            known = server.flags if e.program == "llama-server" else rpc.flags
            assert not [a for a in e.args if a.startswith("-") and a[1:2].isalpha()
                        and a not in known], (name, e.args)
    for path in sorted((repo_root() / "profiles").glob("*.yaml")):
        args = yaml.safe_load(path.read_text()).get("server_args") or {}
        assert flagcheck.unknown_args(args, server) == [], path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_argv_is_the_running_heads_cmdline(hydra_up, hydra_env) -> None:  # type: ignore[no-untyped-def]
    """`hydra plan --json` before `hydra up`: the head's argv is /proc/PID/cmdline of the head
    hydra started (the node file's internal port range is the test's own, so the first port
    in it, the one `hydra plan` names, is the one the head gets)."""
    planned = run_hydra(hydra_env, "plan", "-p", "demo", "--json")
    assert planned.returncode == 0, planned.stderr
    (head,) = json.loads(planned.stdout)["engines"]
    up = hydra_up("-p", "demo", "--port", "0")
    up.wait_ready(120)
    pid = next(e["pid"] for e in status_json(hydra_env)["status"]["engines"]
               if e["name"].endswith("head"))
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert cmdline == head["argv"]
    assert os.path.samefile(cmdline[0], head["binary"])
