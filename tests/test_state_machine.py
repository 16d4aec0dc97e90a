"""The per-process state machine and the backoff unit: legal paths, illegal transitions,
backoff sequences and budgets on an injected clock (pure, microseconds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_supervisor.config.profile import RestartPolicy
from hydra_supervisor.plan.deployment import load_timeout_for
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.proc.backoff import Backoff
from hydra_supervisor.proc.managed import (
    TRANSITIONS,
    Fatal,
    IllegalTransition,
    ManagedProcess,
    State,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def mp(policy: RestartPolicy | None = None, clock: Clock | None = None) -> ManagedProcess:
    spec = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
                      host="127.0.0.1", port=1, device="cpu", start_order=0)
    seen: list[State] = []
    m = ManagedProcess(spec=spec, binary="x", log_path=Path("/nonexistent.log"),
                       policy=policy or RestartPolicy(),
                       on_change=lambda p, transition: seen.append(p.state) if transition
                       else None, clock=clock or Clock())
    m.seen = seen  # type: ignore[attr-defined]
    return m


def test_happy_path_and_change_callbacks():
    m = mp()
    for s in (State.STARTING, State.READY, State.UNHEALTHY, State.READY, State.STOPPING,
              State.STOPPED):
        m.to(s, "x")
    assert m.seen == [State.STARTING, State.READY, State.UNHEALTHY, State.READY,  # type: ignore
                      State.STOPPING, State.STOPPED]


@pytest.mark.parametrize("src", list(State))
def test_every_illegal_transition_raises(src):
    for dst in State:
        if dst is src or dst in TRANSITIONS[src]:
            continue
        m = mp()
        m.state = src
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
            m.to(dst)


def test_every_state_can_be_left():
    assert all(TRANSITIONS[s] for s in State)
    # FATAL is left only by an explicit stop (manual restart goes through STOPPED).
    assert TRANSITIONS[State.FATAL] == {State.STOPPED}


def test_backoff_doubles_and_caps_then_fatal():
    m = mp(RestartPolicy(backoff_initial=1, backoff_max=4, max_failures=5, window=300))
    delays = []
    for _ in range(4):
        m.state = State.STARTING
        delays.append(m.record_failure("crash"))
    assert delays == [1, 2, 4, 4]
    assert m.state is State.BACKOFF and "in 4.0s" in m.reason
    m.state = State.STARTING
    with pytest.raises(Fatal, match="5 failures within 300s"):
        m.record_failure("crash")
    assert m.state is State.FATAL


def test_backoff_resets_after_stable_period_and_the_mark_is_consumed():
    clock = Clock()
    b = Backoff(RestartPolicy(backoff_initial=1, backoff_max=30, stable_after=60,
                              max_failures=99, window=10))
    assert [b.failure(clock()).delay for _ in range(3)] == [1, 2, 4]
    b.ready(clock())
    clock.t += 61
    assert b.failure(clock()).delay == 1  # a fresh incident
    # main never cleared the mark: every later failure looked fresh and stayed at 1 s
    assert [b.failure(clock()).delay for _ in range(3)] == [2, 4, 8]


def test_a_short_run_does_not_reset():
    clock = Clock()
    b = Backoff(RestartPolicy(backoff_initial=1, stable_after=60, max_failures=99))
    b.failure(clock())
    b.ready(clock())
    clock.t += 59
    assert b.failure(clock()).delay == 2


def test_window_rule_catches_a_flapping_process():
    clock = Clock()
    b = Backoff(RestartPolicy(backoff_initial=1, stable_after=5, max_failures=3, window=300))
    verdicts = []
    for _ in range(3):
        b.ready(clock())
        clock.t += 10  # each run is "stable", so the consecutive count resets
        verdicts.append(b.failure(clock()))
    assert [v.consecutive for v in verdicts] == [1, 1, 1]
    assert verdicts[-1].fatal and "3 failures within 300s" in verdicts[-1].fatal


def test_long_attempts_end_by_the_consecutive_rule():
    """Attempts longer than window / max_failures: the window never holds max_failures."""
    clock = Clock()
    b = Backoff(RestartPolicy(backoff_initial=1, backoff_max=30, stable_after=60,
                              max_failures=5, window=300))
    verdicts = []
    for _ in range(5):
        clock.t += 200  # a 200 s load that fails
        verdicts.append(b.failure(clock()))
    assert [v.fatal is None for v in verdicts] == [True] * 4 + [False]
    assert "5 failures in a row" in (verdicts[-1].fatal or "")


def test_reset_forgets_history():
    clock = Clock()
    b = Backoff(RestartPolicy(backoff_initial=1, max_failures=99))
    for _ in range(4):
        b.failure(clock())
    b.reset()
    assert b.failure(clock()).delay == 1


def test_load_timeout_scales_with_size():
    assert load_timeout_for(0, None) == 60
    assert load_timeout_for(20 * 2**30, None) == 360
    assert load_timeout_for(20 * 2**30, 45) == 45
