"""Shared fixtures: an isolated state dir per test and a real `hydra up` harness (see
hydra_supervisor/testing/harness.py).

Every process a test starts is stopped in a finally, and the harness asserts that no child
outlives its `hydra up`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import psutil
import pytest

# The shared fakes and rigs assert too: give their asserts pytest's messages (before import).
pytest.register_assert_rewrite("tests.fake_children", "tests.lane_fakes", "tests.notify_listener",
                               "hydra_supervisor.testing")

from hydra_supervisor.testing.harness import Up, make_env  # noqa: E402
from tests.wire_fakes import FakeSlots, StubControl  # noqa: E402

# `slow` means something: a test that starts a real llama.cpp process is marked slow, and
# `-m "not slow"` starts none. Outside slow tests the binaries hydra finds are stand-ins that
# exit at once saying so, so a test that would start llama.cpp fails, naming the marker,
# instead of quietly making the fast run slow (finding a binary is still fine).
_STAND_IN = """#!/bin/sh
echo "$0: a test that starts llama.cpp must be marked @pytest.mark.slow" >&2
exit 97
"""


@pytest.fixture(scope="session")
def _stand_ins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("no-llama")
    for name in ("llama-server", "ggml-rpc-server", "llama-bench"):
        (d / name).write_text(_STAND_IN)
        (d / name).chmod(0o755)
    return d


_LLAMA = (("HYDRA_LLAMA_SERVER", "llama-server"), ("HYDRA_RPC_SERVER", "ggml-rpc-server"),
          ("HYDRA_LLAMA_BENCH", "llama-bench"))


@pytest.fixture(scope="session")
def _llama_missing() -> str | None:
    """Why the real llama.cpp binaries cannot be found (None: they can); slow tests skip
    with it. `./scripts/test` builds them first, so there this is always None."""
    from hydra_supervisor.errors import HydraError
    from hydra_supervisor.tools import binaries
    try:
        for _, name in _LLAMA[:2]:
            binaries.find(name)
    except HydraError as exc:
        first = str(exc).splitlines()[0]
        return f"llama.cpp binaries not installed ({first}): run `hydra install-llama`"
    return None


@pytest.fixture(autouse=True)
def _llama_only_in_slow_tests(request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch, _stand_ins: Path,
                              _llama_missing: str | None) -> None:
    if request.node.get_closest_marker("slow") is None:
        for var, name in _LLAMA:
            monkeypatch.setenv(var, str(_stand_ins / name))
    elif _llama_missing is not None:
        pytest.skip(_llama_missing)


@pytest.fixture
def hydra_env(tmp_path: Path) -> dict[str, str]:
    return make_env(tmp_path)


class StartUp(Protocol):
    """The `hydra_up` fixture: start `hydra up ARGS`."""

    def __call__(self, *args: str) -> Up: ...


@pytest.fixture
def hydra_up(hydra_env: dict[str, str], tmp_path: Path) -> Iterator[StartUp]:
    """Factory: start `hydra up ARGS`; everything it started is gone after the test."""
    ups: list[Up] = []

    def start(*args: str) -> Up:
        up = Up(hydra_env, list(args), tmp_path)
        ups.append(up)
        return up

    yield start
    for up in ups:
        children = list(up.children)
        if up.proc.poll() is None:
            up.stop()
        up.kill_everything()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"processes outlived hydra up: {alive}"


@pytest.fixture
def fake_slots(tmp_path: Path) -> Iterator[FakeSlots]:
    """A stand-in llama-server's /slots (the wire server's STATE_* ops)."""
    f = FakeSlots(tmp_path)
    yield f
    f.close()


@pytest.fixture
def control(tmp_path: Path, fake_slots: FakeSlots) -> StubControl:
    """A stand-in engine for the wire server, its head at `fake_slots`."""
    return StubControl(tmp_path, head=fake_slots.addr)
