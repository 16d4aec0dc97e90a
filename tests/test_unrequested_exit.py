"""Only a requested stop (SIGTERM, SIGINT, `hydra down`, the control API's /down) ends hydra
with status 0 (docs/control.md, "Exit status"): a failure that ends it otherwise — an exception
out of the daemon's run, one of its own tasks dying, a lane's supervisor failing with a bug —
says its real cause in hydra.log and status.json and exits 1 (EXIT_FATAL), so that systemd's
Restart=on-failure brings it back. The real Daemon in process on a real port (no profile: no
llama.cpp); the failures are injected, as no real binary shows them on demand. The supervisor's
own side: tests/test_starved.py."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from hydra_supervisor.config.config import known_profiles
from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime.daemon import EXIT_FATAL, EXIT_OK, Daemon, Options
from hydra_supervisor.serve import setup


def daemon(tmp_path: Path) -> Daemon:
    state = StateDir(tmp_path / "state")
    state.ensure_writable()
    opts = Options(profile=None, port=0)
    ports, node = setup.build(state, [], node_file=None, profiles_dir=None, overrides={},
                              host=opts.host, port=opts.port,
                              profiles=lambda: list(known_profiles(None)))
    return Daemon(state, opts, ports, node)


async def started(d: Daemon) -> asyncio.Task[int]:
    run = asyncio.create_task(d.run())
    for _ in range(500):  # 5 s
        if d.ctl is not None and all(p.ready() for p in d.ports) or run.done():
            break
        await asyncio.sleep(0.01)
    assert not run.done(), run.result()
    return run


def test_a_requested_stop_exits_0(tmp_path: Path) -> None:
    d = daemon(tmp_path)

    async def go() -> int:
        run = await started(d)
        d.request_stop("hydra down")
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(go()) == EXIT_OK
    assert d.stop_reason == "hydra down"


def test_an_exception_out_of_the_run_exits_1_with_its_cause(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = daemon(tmp_path)

    async def broken_wait() -> int:
        raise RuntimeError("injected: the loop's wait failed")

    d._wait = broken_wait  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="hydra"):
        code = asyncio.run(asyncio.wait_for(d.run(), 30))
    assert code == EXIT_FATAL
    cause = "internal error (RuntimeError: injected: the loop's wait failed)"
    assert d.stop_reason == f"FATAL: {cause}"
    said = [r.getMessage() for r in caplog.records]
    assert f"stopped: FATAL: {cause}" in said
    assert "stopped: stop requested" not in said
    status = json.loads((tmp_path / "state" / "status.json").read_text())
    assert cause in json.dumps(status)


def test_a_daemon_task_that_dies_ends_hydra_with_exit_1(tmp_path: Path) -> None:
    d = daemon(tmp_path)
    die = asyncio.Event()

    async def dying_watch() -> None:  # the port watch loop itself dies (not one tick of it)
        await die.wait()
        raise RuntimeError("injected: the port watch died")

    d._watch_ports = dying_watch  # type: ignore[method-assign]

    async def go() -> int:
        run = await started(d)
        die.set()
        return await asyncio.wait_for(run, 30)

    assert asyncio.run(go()) == EXIT_FATAL
    assert d.fatal == "the port watch failed (RuntimeError: injected: the port watch died)"
    assert d.stop_reason == f"FATAL: {d.fatal}"


def test_bad_input_found_while_starting_stays_bad_input(tmp_path: Path) -> None:
    """A HydraError (bad input) out of the run is not turned into exit 1: it reaches `hydra
    up`, which says `error:` and exits 2, and the log says why it stopped."""
    d = daemon(tmp_path)

    async def refused() -> int:
        raise HydraError("profile x: no such model", hint="hydra profiles")

    d._wait = refused  # type: ignore[method-assign]
    with pytest.raises(HydraError, match="no such model"):
        asyncio.run(asyncio.wait_for(d.run(), 30))
    assert d.stop_reason == "error: profile x: no such model"
    assert d.fatal is None
