"""The per-process state machine: legal paths, illegal transitions, backoff and FATAL (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_supervisor.config import RestartPolicy
from hydra_supervisor.deployment import load_timeout_for
from hydra_supervisor.plan import EngineSpec, Role
from hydra_supervisor.supervisor import (
    TRANSITIONS,
    Fatal,
    IllegalTransition,
    ManagedProcess,
    State,
)


def mp(policy: RestartPolicy | None = None) -> ManagedProcess:
    spec = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
                      host="127.0.0.1", port=1, device="cpu", start_order=0)
    seen: list[State] = []
    m = ManagedProcess(spec=spec, binary="x", log_path=Path("/nonexistent.log"),
                       policy=policy or RestartPolicy(), on_change=lambda p: seen.append(p.state))
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
    assert m.state is State.BACKOFF and "restart in 4s" in m.reason
    m.state = State.STARTING
    with pytest.raises(Fatal, match="5 failures within 300s"):
        m.record_failure("crash")
    assert m.state is State.FATAL


def test_backoff_resets_after_stable_period():
    m = mp(RestartPolicy(backoff_initial=1, backoff_max=30, stable_after=60, max_failures=99))
    for _ in range(3):
        m.state = State.STARTING
        m.record_failure("crash")
    m.ready_at = -1e9  # it then ran "forever"
    m.state = State.READY
    assert m.record_failure("crash") == 1


def test_load_timeout_scales_with_size():
    assert load_timeout_for(0, None) == 60
    assert load_timeout_for(20 * 2**30, None) == 360
    assert load_timeout_for(20 * 2**30, 45) == 45
