"""One serving path for any number of profiles (issue 28): a profile alone on its address is
the same whether `hydra up` was given it alone or beside another profile on another port —
its processes have the same names (PROFILE.ROLE) and /v1/models describes it with the same
fields. Planned for real (serve/setup.py on the repository's demo profile); nothing starts."""

from __future__ import annotations

from pathlib import Path

from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve import setup
from hydra_supervisor.serve.port import Port
from hydra_supervisor.testing.harness import REPO


def _profiles(tmp: Path) -> Path:
    """The demo profile on a free port, and `other` (the same model) on another."""
    d = tmp / "profiles"
    d.mkdir()
    text = (REPO / "profiles" / "demo.yaml").read_text()
    a, b = free_port(), free_port()
    while b == a:
        b = free_port()
    (d / "demo.yaml").write_text(text.replace("port: 8080", f"port: {a}"))
    (d / "other.yaml").write_text(text.replace("profile: demo", "profile: other")
                                  .replace("port: 8080", f"port: {b}"))
    return d


def _demo_port(ports: list[Port]) -> Port:
    return next(p for p in ports if any(d.profile == "demo" for d in p.planned()))


def _view(tmp: Path, names: list[str]) -> tuple[list[str], set[str], int]:
    """(demo's process names, the keys of its /v1/models entry, how many ports)."""
    ports, _ = setup.build(StateDir(tmp / f"state-{len(names)}"), names, node_file=None,
                           profiles_dir=str(tmp / "profiles"), overrides={},
                           host="127.0.0.1", port=8080)
    p = _demo_port(ports)
    dep = next(d for d in p.planned() if d.profile == "demo")
    lane = p.add_lane(dep.layout.profile if dep.layout is not None else None, dep)
    entry = next(m for m in p.models_json()["data"] if m["id"] == "demo")
    return [e.name for e in lane.dep.plan.engines], set(entry), len(ports)


def test_a_profile_alone_or_beside_another_is_described_the_same(tmp_path: Path) -> None:
    _profiles(tmp_path)
    alone = _view(tmp_path, ["demo"])
    beside = _view(tmp_path, ["demo", "other"])
    assert alone[2] == 1 and beside[2] == 2  # `other` has a port of its own
    assert alone[0] == beside[0] == ["demo.head"]
    assert alone[1] == beside[1]
    assert {"id", "state", "status", "default", "devices", "mode", "model"} <= alone[1]


def test_a_misspelt_standby_fails_hydra_up_naming_the_file(tmp_path: Path) -> None:
    """The standby is planned with the active layout at `hydra up` (issue 28), not later in a
    thread where a mistake would only surface as a note."""
    import pytest

    from hydra_supervisor.errors import HydraError

    d = _profiles(tmp_path)
    (d / "demo.yaml").write_text((d / "demo.yaml").read_text() + "standby: nope\n")
    with pytest.raises(HydraError, match=r"demo\.yaml: standby: nope: unknown profile 'nope'"):
        setup.build(StateDir(tmp_path / "state"), ["demo"], node_file=None,
                    profiles_dir=str(d), overrides={}, host="127.0.0.1", port=8080)
