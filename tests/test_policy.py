"""The supervisor's policy on fake children (tests/fake_children.py), with its real code: every
case of issue 8 — peer death in each head state, frozen peer, two peers, a remote peer lost and
back, backoff and budgets, busy vs hung, unkillable child, stop during backoff, illegal
transition, ports, degrade — in milliseconds each (policy time runs SCALE× faster)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.config.profile import HealthPolicy, PeerLoss, RestartPolicy
from hydra_supervisor.proc.managed import State
from tests.fake_children import Behaviour, FakeWorld, Run, UpstreamMoves, deployment, go

pytestmark = pytest.mark.timeout(60)


def states(run: Run, name: str) -> list[str]:
    return [s for n, s, _ in run.transitions if n == name]


# -- start order and the happy path -----------------------------------------------------------


def test_peers_then_head_and_listeners(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(2), tmp).start()
        await r.all_ready()
        assert w.spawned() == ["peer-0", "peer-1", "head"]
        assert states(r, "head") == ["STARTING", "READY"]
        snap = r.sup.snapshot()
        assert [e["state"] for e in snap["engines"]] == ["READY"] * 3
        assert all("last_exit" in e for e in snap["engines"])
        status = json.loads((tmp / "state" / "status.json").read_text())
        assert status["engines"][2]["reason"] == "health check passed"
        await r.stop()
        assert r.sup.stop_reason == "test done"
        assert all(p.state is State.STOPPED for p in r.sup.procs)
    go(tmp_path, body)


def test_reason_is_published_while_loading(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=20)]
        r = Run(w, deployment(0), tmp).start()

        def loading() -> bool:
            f = tmp / "state" / "status.json"
            return f.exists() and json.loads(f.read_text())["engines"][0]["reason"] == \
                "loading model"
        await r.until(loading, 15)
        await r.stop()
    go(tmp_path, body)


# -- a peer is watched whatever the head does -------------------------------------------------


def test_peer_killed_while_head_ready_restarts_pair_peer_first(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        w.live("peer-0").kill()  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned()) == 4)
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert r.mp("head").restarts == 1 and r.mp("peer-0").restarts == 1
        assert r.mp("peer-0").last_exit == -signal.SIGKILL
        assert "peer peer-0 killed by SIGKILL" in r.mp("head").reason or any(
            "peer peer-0 killed by SIGKILL" in why for n, _, why in r.transitions if n == "head")
        await r.stop()
    go(tmp_path, body)


def test_peer_killed_while_head_loads(tmp_path: Path) -> None:
    """Seen on main: the head was restarted 5 times against a dead peer, FATAL blaming the
    head, the peer still READY. Now: the loss is seen within a poll, the pair restarts."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=20), Behaviour(load=1)]
        r = Run(w, deployment(1), tmp).start()
        await r.until(lambda: r.mp("head").state is State.STARTING and w.live("head"))
        t0 = w.clock()
        first_head = w.live("head")
        w.live("peer-0").kill()  # type: ignore[union-attr]
        await r.until(lambda: first_head.returncode is not None)  # type: ignore[union-attr]
        # Stopped by hydra for the peer's loss while it loaded, not after its 20 s load: it
        # never got ready, and hydra's signal ended it. (Causes, not the scaled clock: a
        # busy machine stretches policy time, so "within 4 s" failed under a loaded suite.)
        assert not first_head.ready and first_head.signals  # type: ignore[union-attr]
        assert first_head.returncode == -first_head.signals[0]  # type: ignore[union-attr]
        assert w.clock() - t0 < 20
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert r.sup.fatal is None
        assert r.mp("head").backoff.consecutive == 0  # not the head's failure
        await r.stop()
    go(tmp_path, body)


def test_peer_killed_while_head_backs_off(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        policy = RestartPolicy(backoff_initial=6, backoff_max=8, max_failures=4, window=100,
                               stable_after=10)
        w.behaviours["head"] = [Behaviour(load=1, exit_at_load=1)]
        r = Run(w, deployment(1, policy=policy), tmp).start()
        await r.until(lambda: r.mp("head").state is State.BACKOFF)
        w.live("peer-0").kill()  # type: ignore[union-attr]
        await r.all_ready()
        # the peer came back before the head's next attempt
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert r.sup.fatal is None
        await r.stop()
    go(tmp_path, body)


def test_head_exit_with_healthy_peer_restarts_head_only(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        peer = w.live("peer-0")
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned("head")) == 2)
        await r.all_ready()
        assert w.live("peer-0") is peer and r.mp("peer-0").restarts == 0
        assert r.mp("head").restarts == 1 and r.mp("head").last_exit == 134
        await r.stop()
    go(tmp_path, body)


def test_a_peer_is_spawned_to_outlive_its_head(tmp_path: Path) -> None:
    """A ggml-rpc-server is started with SIGPIPE ignored (a head killed mid-answer must not
    take it down); a llama-server is not."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        assert w.live("peer-0").outlive_client  # type: ignore[union-attr]
        assert not w.live("head").outlive_client  # type: ignore[union-attr]
        peer = w.live("peer-0")
        w.live("head").kill()  # type: ignore[union-attr]  # kill -9 of the head
        await r.until(lambda: len(w.spawned("head")) == 2)
        await r.all_ready()
        assert w.live("peer-0") is peer and r.mp("peer-0").restarts == 0  # reused
        assert r.mp("head").last_exit == -signal.SIGKILL
        died = [why for n, st, why in r.transitions if n == "head" and st == "BACKOFF"]
        assert died == ["head killed by SIGKILL; restart 1 in 1.0s"], died
        await r.stop()
    go(tmp_path, body)


def test_a_head_that_died_before_its_peer_is_named_as_the_cause(tmp_path: Path) -> None:
    """The head killed, its peer dying after it (an rpc-server that still dies of SIGPIPE):
    the pair restarts, and the status says the head died first — not that it was killed
    "after its peer was lost"."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        w.live("head").kill()  # type: ignore[union-attr]
        await w.sleep(0.05)
        w.live("peer-0").kill(-signal.SIGPIPE)  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned()) == 4)
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        head_why = [why for n, st, why in r.transitions if n == "head" and st == "STOPPED"]
        assert head_why == ["killed by SIGKILL (it died first; its peer was lost after it)"], \
            head_why
        peer_why = [why for n, st, why in r.transitions if n == "peer-0" and st == "BACKOFF"]
        assert peer_why and peer_why[0].startswith(
            "peer peer-0 killed by SIGPIPE after its head died (head killed by SIGKILL)"), \
            peer_why
        assert r.mp("head").backoff.consecutive == 0  # counted as the pair's restart
        await r.stop()
    go(tmp_path, body)


def test_a_peer_that_died_before_its_head_is_named_as_the_cause(tmp_path: Path) -> None:
    """The other order (a peer killed, its head aborting at its next request): the head
    "exit 134 after its peer was lost"."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        w.live("peer-0").kill()  # type: ignore[union-attr]
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned()) == 4)
        await r.all_ready()
        head_why = [why for n, st, why in r.transitions if n == "head" and st == "STOPPED"]
        assert len(head_why) == 1 and head_why[0].startswith(
            "exit 134 (SIGABRT: llama.cpp aborted) after its peer was lost (peer peer-0 "
            "killed by SIGKILL"), head_why
        await r.stop()
    go(tmp_path, body)


def test_frozen_peer_is_lost_and_pair_restarts(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        frozen = w.live("peer-0")
        frozen.stop()  # type: ignore[union-attr]
        t0 = w.clock()
        await r.until(lambda: signal.SIGKILL in frozen.signals)  # type: ignore[union-attr]
        assert w.clock() - t0 < 4  # freeze grace: min(hang_timeout, max(2*interval, 1))
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert any("frozen" in why for n, _, why in r.transitions if n == "head")
        await r.stop()
    go(tmp_path, body)


def test_frozen_peer_while_head_loads(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=60), Behaviour(load=1)]
        r = Run(w, deployment(1), tmp).start()
        await r.until(lambda: w.live("head") is not None)
        w.live("peer-0").stop()  # type: ignore[union-attr]
        await r.all_ready(40)
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        await r.stop()
    go(tmp_path, body)


def test_stalled_request_with_peer_not_progressing_restarts_pair(tmp_path: Path) -> None:
    """A peer wedged without being 'stopped' (driver hang, D state): the head answers /health
    but its request makes no progress, and neither does the peer's CPU."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        w.live("head").processing = True  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned()) == 4, 30)
        await r.all_ready()
        assert any("no progress" in why for n, _, why in r.transitions if n == "head")
        await r.stop()
    go(tmp_path, body)


def test_two_peers_killed_together_are_one_incident(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(2), tmp).start()
        await r.all_ready()
        w.live("peer-0").kill()  # type: ignore[union-attr]
        w.live("peer-1").kill()  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned()) == 6)
        await r.all_ready()
        assert w.spawned()[3:] == ["peer-0", "peer-1", "head"]
        assert r.mp("head").restarts == 1
        assert r.mp("peer-0").restarts == 1 and r.mp("peer-1").restarts == 1
        await r.stop()
    go(tmp_path, body)


def test_remote_peer_lost_and_back(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[50100] = True
        r = Run(w, deployment(1, remote=True), tmp).start()
        await r.all_ready()
        w.remote_up[50100] = False
        w.live("head").kill(134)  # type: ignore[union-attr]   # aborts at its next RPC call
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF)
        assert len(w.spawned("head")) == 1  # the head is not crash-looped meanwhile
        await w.sleep(10)
        assert len(w.spawned("head")) == 1 and r.sup.fatal is None
        w.remote_up[50100] = True
        await r.all_ready(30)
        assert len(w.spawned("head")) == 2
        assert r.mp("head").backoff.consecutive == 0
        await r.stop()
    go(tmp_path, body)


def test_remote_peer_gone_for_good_is_fatal_after_window(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[50100] = True
        policy = RestartPolicy(backoff_initial=1, backoff_max=4, max_failures=3, window=30,
                               stable_after=10)
        r = Run(w, deployment(1, remote=True, policy=policy), tmp).start()
        await r.all_ready()
        w.remote_up[50100] = False
        w.live("head").kill(134)  # type: ignore[union-attr]
        assert r.task is not None
        await w.wait_for(r.task.done, 80)
        assert r.sup.fatal and "unreachable" in r.sup.fatal and "peer-0" in r.sup.fatal
        assert len(w.spawned("head")) == 1
    go(tmp_path, body)


def test_on_peer_loss_fail(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1, on_peer_loss=PeerLoss.FAIL), tmp).start()
        await r.all_ready()
        w.live("peer-0").kill()  # type: ignore[union-attr]
        assert r.task is not None
        await w.wait_for(r.task.done, 20)
        assert r.sup.fatal and "on_peer_loss is fail" in r.sup.fatal
        assert r.mp("peer-0").state is State.FATAL
        assert w.live("head") is None
    go(tmp_path, body)


# -- backoff and budgets ----------------------------------------------------------------------


def test_crash_loop_backs_off_then_fatal_with_reason(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.default = Behaviour(load=0.5)
        w.behaviours["head"] = [Behaviour(load=0.5, exit_at_load=1) for _ in range(10)]
        r = Run(w, deployment(0), tmp).start()
        assert r.task is not None
        await w.wait_for(r.task.done, 60)
        assert r.sup.fatal and "4 failures" in r.sup.fatal
        assert "exited during start-up (exit 1)" in r.sup.fatal
        reasons = [why for n, s, why in r.transitions if n == "head" and s == "BACKOFF"]
        assert [x.split("in ")[-1] for x in reasons] == ["1.0s", "2.0s", "4.0s"]
        assert len(w.spawned("head")) == 4
        assert r.mp("head").state is State.FATAL
        assert r.mp("head").last_exit == 1
    go(tmp_path, body)


def test_long_attempts_still_end(tmp_path: Path) -> None:
    """Each attempt takes longer than window / max_failures: the window rule never fires,
    the consecutive rule does."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=40, exit_at_load=1) for _ in range(5)]
        policy = RestartPolicy(backoff_initial=1, backoff_max=2, max_failures=3, window=60,
                               stable_after=10)
        r = Run(w, deployment(0, policy=policy, load=100), tmp).start()
        assert r.task is not None
        await w.wait_for(r.task.done, 200)
        assert r.sup.fatal and "3 failures in a row" in r.sup.fatal
    go(tmp_path, body)


def test_backoff_grows_again_after_one_stable_run(tmp_path: Path) -> None:
    """main never cleared ready_at: after one stable run every later failure looked fresh."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        fail, ok = Behaviour(load=0.5, exit_at_load=1), Behaviour(load=0.5)
        w.behaviours["head"] = [fail, fail, ok, fail, fail, ok]
        policy = RestartPolicy(backoff_initial=1, backoff_max=30, max_failures=6, window=1000,
                               stable_after=10)
        r = Run(w, deployment(0, policy=policy), tmp).start()
        await r.all_ready()
        await w.sleep(11)  # stable_after 10: the next failure starts a fresh incident
        w.live("head").kill()  # type: ignore[union-attr]
        await r.until(lambda: len(w.spawned("head")) == 6)
        await r.all_ready()
        reasons = [why.split("in ")[-1] for n, s, why in r.transitions
                   if n == "head" and s == "BACKOFF"]
        assert reasons == ["1.0s", "2.0s", "1.0s", "2.0s", "4.0s"]
        await r.stop()
    go(tmp_path, body)


def test_stop_during_backoff_is_prompt(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        policy = RestartPolicy(backoff_initial=100, backoff_max=100, max_failures=5,
                               window=1000, stable_after=10)
        w.behaviours["head"] = [Behaviour(load=0.5, exit_at_load=1)]
        r = Run(w, deployment(1, policy=policy), tmp).start()
        await r.until(lambda: r.mp("head").state is State.BACKOFF)
        t0 = w.clock()
        await r.stop()
        assert w.clock() - t0 < 30  # not the 100 s backoff
        assert all(p.state is State.STOPPED for p in r.sup.procs)
        assert w.live("peer-0") is None
    go(tmp_path, body)


# -- busy is not hung; hung is caught ---------------------------------------------------------


def test_busy_head_is_not_killed(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0), tmp).start()
        await r.all_ready()
        head = w.live("head")
        head.busy = True  # type: ignore[union-attr]   # /health silent, CPU advancing
        await w.sleep(20)  # 4× hang_timeout
        assert w.live("head") is head and len(w.spawned("head")) == 1
        assert r.mp("head").state is State.READY and r.mp("head").reason.startswith("busy")
        head.busy = False  # type: ignore[union-attr]
        await r.until(lambda: r.mp("head").reason == "serving")
        await r.stop()
    go(tmp_path, body)


def test_sigstopped_head_is_killed_after_short_grace(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0, health=HealthPolicy(interval=0.5, hang_timeout=30)),
                tmp).start()
        await r.all_ready()
        head = w.live("head")
        head.stop()  # type: ignore[union-attr]
        t0 = w.clock()
        await r.until(lambda: len(w.spawned("head")) == 2)
        assert w.clock() - t0 < 15  # not hang_timeout (30)
        assert signal.SIGKILL in head.signals  # type: ignore[union-attr]
        await r.all_ready()
        await r.stop()
    go(tmp_path, body)


def test_hung_head_without_progress_is_killed_at_hang_timeout(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0), tmp).start()
        await r.all_ready()
        head = w.live("head")
        head.hung = True  # type: ignore[union-attr]
        t0 = w.clock()
        await r.until(lambda: r.mp("head").state is State.UNHEALTHY)
        await r.until(lambda: len(w.spawned("head")) == 2)
        assert 5 <= w.clock() - t0 < 20
        await r.all_ready()
        await r.stop()
    go(tmp_path, body)


# -- stopping ---------------------------------------------------------------------------------


def test_unkillable_child_is_reported_and_does_not_block_the_others(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=0.5, unkillable=True)]
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        t0 = w.clock()
        await r.stop()
        assert w.clock() - t0 < 20  # grace 3 + kill wait 5, not forever
        assert r.mp("peer-0").state is State.STOPPED
        head = r.mp("head")
        assert head.state is State.FATAL and "survived SIGKILL" in head.reason
        assert r.sup.unkillable and "pid" in r.sup.unkillable[0]
        assert json.loads((tmp / "state" / "status.json").read_text())["unkillable"]
    go(tmp_path, body)


def test_illegal_transition_ends_fatal_with_reason(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0), tmp)

        def corrupt(_child: Any) -> None:
            r.mp("head").state = State.STOPPED  # a bug elsewhere: STOPPED -> READY next
        w.on_spawn = corrupt
        r.start()
        assert r.task is not None
        await w.wait_for(r.task.done, 20)
        assert r.sup.fatal and "illegal state transition" in r.sup.fatal
        assert "STOPPED -> READY" in r.sup.fatal
        assert json.loads((tmp / "state" / "status.json").read_text())["fatal"]
        assert w.live("head") is None
    go(tmp_path, body)


# -- ports: ready is hydra's own child --------------------------------------------------------


def test_head_port_taken_moves_and_router_follows(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.squatters[40100] = 4242
        r = Run(w, deployment(1), tmp)
        follow = UpstreamMoves(("127.0.0.1", 40100))
        r.sup.on_upstream_moved = follow
        r.start()
        await r.all_ready()
        head = r.mp("head")
        assert head.spec.port == 40101 and "--port" in head.spec.args
        assert head.spec.args[head.spec.args.index("--port") + 1] == "40101"
        assert follow.http == ("127.0.0.1", 40101)
        assert follow.moves == [("http", ("127.0.0.1", 40100), 40101)]
        await r.stop()
    go(tmp_path, body)


def test_someone_else_answering_health_is_not_ready(tmp_path: Path) -> None:
    """Two hydras raced for one internal port: the loser's /health reached the winner."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0), tmp)

        def squat(child: Any) -> None:
            if child.name == "head" and len(w.spawned("head")) == 1:
                w.squatters[child.port] = 4242  # taken right after our spawn
        w.on_spawn = squat
        r.start()
        await r.all_ready()
        assert any("not by hydra's llama-server" in why for n, _, why in r.transitions)
        assert r.mp("head").spec.port != 40100
        await r.stop()
    go(tmp_path, body)


# -- degrade ----------------------------------------------------------------------------------


def test_degrade_serves_solo_then_returns_after_both_stable(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1, on_peer_loss=PeerLoss.DEGRADE), tmp)
        swaps: list[float] = []

        async def hook(to: str) -> None:
            swaps.append(w.clock())
        r.sup.before_head_swap = hook
        r.start()
        await r.all_ready()
        w.live("peer-0").kill()  # type: ignore[union-attr]
        await r.until(lambda: r.sup.degraded and r.mp("head").state is State.READY
                      and "--rpc" not in r.mp("head").spec.args)
        solo_ready = w.clock()
        await r.until(lambda: not r.sup.degraded and r.mp("head").state is State.READY
                      and "--rpc" in r.mp("head").spec.args, 60)
        assert swaps and swaps[0] - solo_ready >= 10 - 0.5  # SOLO served stable_after
        peer_ready = r.mp("peer-0").ready_since
        assert peer_ready is not None and swaps[0] - peer_ready >= 10 - 0.5
        assert w.spawned() == ["peer-0", "head", "head", "peer-0", "head"] or \
            w.spawned() == ["peer-0", "head", "peer-0", "head", "head"]
        await r.stop()
    go(tmp_path, body)


# -- planned restart --------------------------------------------------------------------------


def test_planned_restart_of_a_peer_restarts_the_pair_peer_first(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        await asyncio.wait_for(r.sup.restart("peer-0"), 10)
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert all(p.state is State.READY for p in r.sup.procs)
        assert r.mp("head").backoff.consecutive == 0
        await asyncio.wait_for(r.sup.restart("head"), 10)
        assert w.spawned()[-1] == "head" and len(w.spawned("peer-0")) == 2
        await r.stop()
    go(tmp_path, body)
