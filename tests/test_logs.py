"""Child logs you can correlate: the run marker hydra writes at each spawn, wall-clock times
from llama.cpp's relative stamps, the current run's tail, which logs are the running hydra's,
and `hydra logs` on them (proc/logfiles.py, cli/client_cmds.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
from pathlib import Path

import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc import logfiles, process
from hydra_supervisor.proc.logfiles import RunMark, Stamper
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.testing.harness import HYDRA, REPO, run_hydra, wait_until

T0 = dt.datetime(2026, 12, 4, 5, 30, 0, 123000, tzinfo=dt.UTC)


def _mark(name: str = "demo.head", pid: int = 1234, hydra: int = 999,
          at: dt.datetime = T0) -> str:
    return RunMark(name, at, pid, hydra).line()


def _spawn(log: Path, script: str) -> int:
    async def go() -> int:
        child = await process.spawn(["sh", "-c", script], {}, log)
        return await child.wait()

    return asyncio.run(go())


def test_a_spawn_opens_its_log_with_the_run_marker_before_the_childs_first_line(tmp_path):
    log = tmp_path / "logs" / "demo.head.log"
    before = dt.datetime.now(dt.UTC)
    assert _spawn(log, f"echo first; echo $$ >{tmp_path / 'pid'}") == 0
    lines = log.read_text().splitlines()
    assert lines[1] == "first"
    mark = RunMark.parse(lines[0])
    assert mark is not None, lines
    assert mark.name == "demo.head" and mark.hydra_pid == os.getpid()
    assert mark.at.utcoffset() is not None
    assert before - dt.timedelta(seconds=1) <= mark.at <= dt.datetime.now(dt.UTC)
    # the pid the marker names is the child's own (the shell is what was exec'd)
    assert mark.pid == int((tmp_path / "pid").read_text())
    assert logfiles.run_of(log) == mark


def test_marker_round_trips_and_other_lines_are_not_markers():
    line = _mark()
    assert line == ("--- hydra: demo.head started 2026-12-04T05:30:00.123+00:00 pid 1234 "
                    "(hydra pid 999) ---")
    assert RunMark.parse(line + "\n") == RunMark("demo.head", T0, 1234, 999)
    assert RunMark.parse("--- hydra: x started yesterday pid 1 (hydra pid 2) ---") is None
    assert RunMark.parse("0.00.001.339 I srv  llama_server: initializing ...") is None


def test_stamper_turns_llama_cpps_relative_stamps_into_wall_clock_times():
    st = Stamper()
    assert st.line("0.00.001.339 I before any marker") == "0.00.001.339 I before any marker"
    assert st.line(_mark()) == _mark()
    local = T0.astimezone()
    got = st.line("2.03.400.500 E llama_model_load: error loading model\n")
    want = (local + dt.timedelta(minutes=2, seconds=3, milliseconds=400, microseconds=500))
    assert got == f"{want:%Y-%m-%d %H:%M:%S}.{want.microsecond // 1000:03d} E " \
                  "llama_model_load: error loading model\n"
    assert st.line("no stamp here") == "no stamp here"
    # the next run's marker restarts the clock
    st.line(_mark(at=T0 + dt.timedelta(hours=1)))
    assert st.line("0.00.000.000 I x").startswith(
        f"{(local + dt.timedelta(hours=1)):%Y-%m-%d %H:%M:%S}.123 I x")


def test_the_tail_a_failure_quotes_stops_at_the_current_runs_marker(tmp_path):
    log = tmp_path / "demo.head.log"
    logfiles.rotated(log, 1).write_text(_mark(pid=1) + "\n" + "".join(
        f"old run line {i}\n" for i in range(20)))
    log.write_text(_mark(pid=2) + "\nerror: invalid argument: --bogus\n")
    assert logfiles.tail(log, 12) == ["error: invalid argument: --bogus"]
    # a size rotation moved the run's start to .1: the tail reaches back to its marker only
    logfiles.rotated(log, 2).write_text(_mark(pid=1) + "\nolder run\n")
    logfiles.rotated(log, 1).write_text(_mark(pid=2) + "\na\nb\n")
    log.write_text("c\n")
    assert logfiles.tail(log, 12) == ["a", "b", "c"]
    assert logfiles.tail(log, 2) == ["b", "c"]
    assert logfiles.run_of(log).pid == 2  # type: ignore[union-attr]
    # `hydra logs` (tail_at) still shows the run before, with the marker between
    shown, _ = logfiles.tail_at(tmp_path / "demo.head.log", 3)
    assert shown == ["a", "b", "c"]


def test_current_logs_are_hydras_own_and_those_its_runs_marked(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "hydra.log").write_text("x\n")
    (logs / "demo.head.log").write_text(_mark("demo.head", hydra=999) + "\n")
    (logs / "demo-moe.head.log").write_text(_mark("demo-moe.head", hydra=999) + "\n")
    (logs / "head.log").write_text("a log of an earlier hydra, no marker\n")
    (logs / "old.head.log").write_text(_mark("old.head", hydra=5) + "\n")
    fb = tmp_path / "fallback"
    fb.mkdir()
    (fb / "peer-x.log").write_text(_mark("peer-x", hydra=999) + "\n")
    found = logfiles.current_logs(logs, 999, {"remote.head": tmp_path / "r.log"}, fallback=fb)
    assert list(found) == ["hydra", "demo-moe.head", "demo.head", "peer-x", "remote.head"]
    assert found["hydra"] == logs / "hydra.log" and found["peer-x"] == fb / "peer-x.log"
    assert set(logfiles.current_logs(logs, None)) == {"hydra", "demo-moe.head", "demo.head",
                                                      "head", "old.head"}
    assert logfiles.pick("demo.head", found) == ("demo.head", logs / "demo.head.log")
    assert logfiles.pick("x", {**found, "p.x": logs / "p.x.log"})[0] == "p.x"
    with pytest.raises(HydraError, match="'head' is ambiguous: demo-moe.head, demo.head, "
                                         "remote.head"):
        logfiles.pick("head", found)
    with pytest.raises(HydraError, match="no log for engine 'nope' of the running hydra "
                                         ".*its logs: hydra, demo-moe.head"):
        logfiles.pick("nope", found, "of the running hydra (pid 999)")


def _fake_running(state: StateDir, pid: int) -> None:
    """status.json and supervisor.json as a running hydra `pid` (this test process) writes
    them."""
    import psutil

    state.root.mkdir(parents=True, exist_ok=True)
    (state.root / "supervisor.json").write_text(
        f'{{"pid": {pid}, "create_time": {psutil.Process(pid).create_time()}, '
        '"profile": "demo,demo-moe", "source": "-", "started": 0}')
    (state.root / "status.json").write_text(f'{{"pid": {pid}, "engines": []}}')


def test_hydra_logs_offers_only_the_running_hydras_logs_and_its_own(hydra_env, tmp_path):
    state = StateDir(Path(hydra_env["HYDRA_STATE_DIR"]))
    state.logs.mkdir(parents=True)
    me = os.getpid()  # stands in for the running hydra
    _fake_running(state, me)
    state.log_path("hydra").write_text("2026-12-04 05:30:00,100 INFO hydra's own line\n")
    state.log_path("head").write_text("stale head.log of an earlier hydra\n")
    state.log_path("demo.head").write_text(
        _mark("demo.head", hydra=me) + "\n0.02.000.000 I srv  main: listening\n")
    state.log_path("demo-moe.head").write_text(_mark("demo-moe.head", hydra=me) + "\n")

    res = run_hydra(hydra_env, "logs", "head")
    assert res.returncode == 2, res
    assert "'head' is ambiguous: demo-moe.head, demo.head" in res.stderr
    assert "Traceback" not in res.stderr
    res = run_hydra(hydra_env, "logs", "peer-x")
    assert res.returncode == 2
    assert f"no log for engine 'peer-x' of the running hydra (pid {me}); its logs: hydra, " \
           "demo-moe.head, demo.head" in res.stderr
    res = run_hydra(hydra_env, "logs", "hydra")
    assert res.returncode == 0 and res.stdout == "2026-12-04 05:30:00,100 INFO hydra's own line\n"
    assert res.stderr == ""
    res = run_hydra(hydra_env, "logs", "demo.head")
    assert res.returncode == 0, res
    want = T0.astimezone() + dt.timedelta(seconds=2)
    assert res.stdout.splitlines() == [
        _mark("demo.head", hydra=me),
        f"{want:%Y-%m-%d %H:%M:%S}.123 I srv  main: listening"]
    raw = run_hydra(hydra_env, "logs", "demo.head", "--raw")
    assert raw.stdout.splitlines()[1] == "0.02.000.000 I srv  main: listening"


def test_hydra_logs_f_shows_the_marker_of_a_new_run_and_follows_it(hydra_env, tmp_path):
    state = StateDir(Path(hydra_env["HYDRA_STATE_DIR"]))
    log = state.log_path("demo.head")
    log.parent.mkdir(parents=True)
    log.write_text(_mark(pid=1) + "\nrun one\n")
    out = (tmp_path / "f.out").open("w+")
    p = subprocess.Popen([*HYDRA, "logs", "demo.head", "-f"], env=hydra_env, stdout=out,
                         stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        def text() -> str:
            return Path(out.name).read_text()
        wait_until(lambda: "run one" in text(), 15, "the tail")
        logfiles.shift(log, 3)  # what a restart does, then the new run's first lines
        log.write_text(_mark(pid=2, at=T0 + dt.timedelta(minutes=1)) + "\n0.01.000.000 I two\n")
        wait_until(lambda: "I two" in text(), 10, "the new run")
    finally:
        p.terminate()
        p.wait(10)
    lines = Path(out.name).read_text().splitlines()
    assert lines[:2] == [_mark(pid=1), "run one"]
    assert lines[2] == _mark(pid=2, at=T0 + dt.timedelta(minutes=1))
    want = T0.astimezone() + dt.timedelta(minutes=1, seconds=1)
    assert lines[3] == f"{want:%Y-%m-%d %H:%M:%S}.123 I two"


@pytest.mark.slow
def test_a_failed_reload_quotes_only_the_failing_runs_lines(hydra_up, hydra_env, tmp_path):  # type: ignore[no-untyped-def]
    """The head restarts under the same name (its last run's log moves to .1): the reply's
    log tail holds the new run's error, not the lines of the run before it."""
    import json

    from hydra_supervisor.config.paths import repo_root
    from hydra_supervisor.testing.harness import free_port

    prof = tmp_path / "mine.yaml"
    prof.write_text((repo_root() / "profiles" / "demo.yaml").read_text()
                    .replace("profile: demo", "profile: mine"))
    up = hydra_up("--profile", str(prof), "--port", str(free_port()))
    up.wait_ready()
    state = StateDir(Path(hydra_env["HYDRA_STATE_DIR"]))
    before = state.log_path("mine.head").read_text()
    assert "listening on" in before
    # a value llama-server refuses when it starts (an unknown flag is refused at plan time)
    prof.write_text(prof.read_text() + "  cache-type-k: nonsense\n")
    res = run_hydra(hydra_env, "reload", "--json")
    reply = json.loads(res.stdout)
    assert reply["result"] == "rolled_back", reply
    tail = reply["log_tail"]
    assert any("Unsupported cache type: nonsense" in line for line in tail), tail
    assert not any(line in before.splitlines() for line in tail if line.strip()), tail
    assert not any(RunMark.parse(line) for line in tail), tail
    # the run that failed is on record with its marker, between the two good ones
    runs = [RunMark.parse(x) for p in sorted(state.logs.glob("mine.head.log*"))
            for x in p.read_text().splitlines()[:1]]
    assert len([r for r in runs if r is not None]) == 3, runs
    assert up.stop() == 0


def test_a_peer_is_spawned_with_sigpipe_ignored_and_a_head_is_not(tmp_path):
    """A ggml-rpc-server child (`outlive_client`) keeps SIGPIPE ignored across exec — a head
    killed mid-answer must not kill it (process.py) — though Python's subprocess resets it to
    the default for children; any other child gets the default."""
    def sigign(outlive: bool) -> int:
        log = tmp_path / "logs" / f"x{outlive}.log"

        async def go() -> int:
            child = await process.spawn(["cat", "/proc/self/status"], {}, log,
                                        outlive_client=outlive)
            return await child.wait()

        assert asyncio.run(go()) == 0
        line = next(x for x in log.read_text().splitlines() if x.startswith("SigIgn:"))
        return int(line.split()[1], 16)

    assert sigign(True) & (1 << (13 - 1))  # SIGPIPE is signal 13: bit 12
    assert not sigign(False) & (1 << (13 - 1))
