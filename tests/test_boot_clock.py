"""The serving policy on a freshly booted machine: its tests pass under a monotonic clock that
reads two minutes.

A policy that reads the machine's clock instead of its injected one (serve/clock.py) passes on
a host that has been up for hours and fails on a CI machine booted a moment ago (issue 28: a
lane on a fake clock at 1000 s, its Node on the real one). This test runs the policy modules in
a time namespace (`unshare -T --monotonic=-N`) whose CLOCK_MONOTONIC reads about 120 s, the
way a new user's CI machine does. Where time namespaces are not permitted (not root, an older
kernel, a container without CAP_SYS_ADMIN) it is skipped and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOTED = 120  # seconds the child's monotonic clock reads when it starts
MODULES = ("tests/test_change_policy.py", "tests/test_fleet_policy.py",
           "tests/test_standby_policy.py", "tests/test_engine_policy.py")
PROBE_S = 30.0  # one python start in a namespace
RUN_S = 240.0  # the modules take about 20 s on 2 busy cores

# The child prints its clock, then runs pytest in the same process (the clock it reports is
# the one the policy tests read).
CHILD = ("import sys, time; print('monotonic', time.monotonic(), flush=True); "
         "import pytest; sys.exit(pytest.main(sys.argv[1:]))")


def _in_namespace(offset: int, *argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `argv` in a new time namespace whose monotonic clock is the host's + `offset` s."""
    unshare = shutil.which("unshare")
    assert unshare is not None
    return subprocess.run([unshare, "-T", f"--monotonic={offset}", *argv], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # this checkout's hydra_supervisor and tests, whoever runs the suite from where
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _monotonic_of(out: str) -> float:
    line = next((ln for ln in out.splitlines() if ln.startswith("monotonic ")), None)
    assert line is not None, f"the child did not print its clock:\n{out}"
    return float(line.split()[1])


def _host_clock() -> float:
    """CLOCK_MONOTONIC as a new time namespace counts from (offset 0): the host's clock (a
    namespace's offsets are set from it, not from ours, should this suite run in one)."""
    if sys.platform != "linux":
        pytest.skip("time namespaces are Linux's")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux `unshare` is not installed")
    probe = _in_namespace(0, sys.executable, "-c",
                          "import time; print('monotonic', time.monotonic())", timeout=PROBE_S)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[-1]
        pytest.skip(f"`unshare -T` is not permitted here ({why}): time namespaces need root "
                    "(CAP_SYS_ADMIN) and Linux 5.6+")
    return _monotonic_of(probe.stdout)


def test_policy_modules_pass_on_a_machine_booted_two_minutes_ago() -> None:
    offset = BOOTED - int(_host_clock())  # negative unless the host itself just booted
    run = _in_namespace(offset, sys.executable, "-c", CHILD, "-q", "-m", "not slow",
                        "-p", "no:cacheprovider", *MODULES, timeout=RUN_S)
    out = run.stdout + run.stderr
    clock = _monotonic_of(run.stdout)
    assert BOOTED <= clock < BOOTED + PROBE_S, f"the child's clock read {clock:.1f} s\n{out}"
    assert run.returncode == 0, f"policy tests failed with the clock at {clock:.0f} s:\n{out}"
    assert " passed" in out and " failed" not in out, out
