"""Remote memory in the plan (issue 32, item 4): the planner uses the free memory a remote
peer's host reports in Hydra INFO (`lent`), bounded by the node file's `memory_mib` for that
device, refuses a layout that does not fit with the numbers (as for a local device), and
`hydra plan` prints it. A fake peer host answers INFO (tests/test_peer_identity.py's FakePeer);
the model is the demo's GGUF (its header only: nothing is started)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_supervisor.plan import devices, layout
from hydra_supervisor.plan.devices import MIB, Device, Kind
from hydra_supervisor.plan.placement import DoesNotFit
from hydra_supervisor.plan.plan import EngineSpec, Placement, Plan, Role
from hydra_supervisor.testing.harness import free_port, make_env, run_hydra
from tests.test_peer_identity import HERE, FakePeer

GIB = 1024 * MIB
PROFILE = ("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\nsplit: [9, 9]\n"
           "server_args: {ctx-size: 1024}\n")


@pytest.fixture
def peers() -> Iterator[list[FakePeer]]:
    made: list[FakePeer] = []
    yield made
    for p in made:
        p.close()


def remote(endpoint: str, memory_mib: int = 0) -> Device:
    m = memory_mib * MIB
    return Device("far", Kind.REMOTE, m, m, endpoint=endpoint)


def test_reported_memory_bounded_by_the_node_file():
    devs = {"far": remote("10.0.0.7:1"), "cpu": Device("cpu", Kind.CPU, 8 * GIB, 4 * GIB)}
    out = devices.with_reported(devs, {"far": (16 * GIB, 15 * GIB), "cpu": (1, 1)})
    assert (out["far"].total, out["far"].free, out["far"].reported) == (16 * GIB, 15 * GIB, True)
    assert out["cpu"] == devs["cpu"]  # only remote devices take a peer's word
    lent = devices.with_reported({"far": remote("10.0.0.7:1", 8192)},
                                 {"far": (16 * GIB, 15 * GIB)})
    assert lent["far"].free == 8 * GIB  # the node file says it lends 8 GiB: no more
    small = devices.with_reported({"far": remote("10.0.0.7:1", 8192)},
                                  {"far": (16 * GIB, 2 * GIB)})
    assert small["far"].free == 2 * GIB  # ...and no more than is free there now
    assert devices.with_reported(devs, {}) == devs


def test_peer_memory_asks_info_and_leaves_out_who_does_not_say(peers: list[FakePeer]):
    hydra, bare = FakePeer(HERE, free=3 * GIB), FakePeer(None)
    peers += [hydra, bare]
    dead = f"127.0.0.1:{free_port()}"
    devs = {"far": Device("far", Kind.REMOTE, 0, 0, endpoint=hydra.endpoint),
            "bare": Device("bare", Kind.REMOTE, 0, 0, endpoint=bare.endpoint),
            "gone": Device("gone", Kind.REMOTE, 0, 0, endpoint=dead),
            "cpu": Device("cpu", Kind.CPU, 8 * GIB, 4 * GIB)}
    got = layout.peer_memory(devs, ["far", "bare", "gone", "cpu", "far"], timeout=10)
    assert got == {"far": (16 * GIB, 3 * GIB)}
    assert hydra.seen == ["op 0x41"]  # INFO once; never a HELLO into its rpc-server's queue


def test_a_running_layout_s_own_share_counts_as_free():
    spec = EngineSpec(name="peer-far", role=Role.PEER, program="ggml-rpc-server", args=(),
                      env=(), host="127.0.0.1", port=1, device="far", start_order=0,
                      managed=False)
    keep = Plan(profile="p", source="p.yaml", model_path="m", model_kind="dense",
                mode="combine", transport="rpc", engines=(spec,),
                placements=(Placement(device="far", layers=9, weight_bytes=GIB, kv_bytes=0,
                                      overhead_bytes=0, free_bytes=0, what="layers"),))
    assert layout.held_back({"far": (16 * GIB, 2 * GIB)}, keep) == {"far": (16 * GIB, 3 * GIB)}
    assert layout.held_back({"far": (16 * GIB, 2 * GIB)}, None) == {"far": (16 * GIB, 2 * GIB)}


def _env(tmp_path: Path, peer: FakePeer, extra: str = "") -> dict[str, str]:
    from hydra_supervisor.testing.routerhelp import gemma_path

    gemma_path()  # skip with a reason when the demo model is absent
    env = make_env(tmp_path, f"devices:\n  far: {{endpoint: '{peer.endpoint}'{extra}}}\n")
    (tmp_path / "remote.yaml").write_text(PROFILE)
    return env


def test_hydra_plan_prints_what_the_peer_reports(tmp_path: Path, peers: list[FakePeer]):
    peer = FakePeer(HERE, free=3 * GIB)
    peers.append(peer)
    env = _env(tmp_path, peer)
    res = run_hydra(env, "plan", "--profile", str(tmp_path / "remote.yaml"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("far:")]
    assert row.endswith("(2,918 MiB usable: its peer host reports 3,072 MiB free of 16,384)"), row
    assert "free unknown" not in res.stdout
    res = run_hydra(env, "plan", "--json", "--profile", str(tmp_path / "remote.yaml"),
                    timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {p["device"]: p for p in json.loads(res.stdout)["placements"]}
    assert rows["far"]["free_reported"] is True and not rows["cpu"]["free_reported"]
    assert rows["far"]["free_bytes"] == int(3 * GIB * 0.95)


def test_a_layout_that_does_not_fit_the_peer_is_refused_with_the_numbers(
        tmp_path: Path, peers: list[FakePeer]):
    peer = FakePeer(HERE, free=40 * MIB)
    peers.append(peer)
    env = _env(tmp_path, peer)
    with pytest.raises(DoesNotFit) as exc:
        layout.build(str(tmp_path / "remote.yaml"), node_file=env["HYDRA_NODE"],
                     check_ports=False)
    assert "model does not fit the devices of profile 'remote'" in str(exc.value)
    (row,) = [ln for ln in str(exc.value).splitlines() if ln.strip().startswith("far:")]
    assert "has 38 MiB usable" in row and "needs" in row
    res = run_hydra(env, "plan", "--profile", str(tmp_path / "remote.yaml"), timeout=120)
    assert res.returncode == 2 and "has 38 MiB usable" in res.stderr, res.stdout + res.stderr


def test_without_a_report_the_node_file_or_unknown(tmp_path: Path, peers: list[FakePeer]):
    bare = FakePeer(None)  # a bare ggml-rpc-server: no INFO
    peers.append(bare)
    env = _env(tmp_path, bare)
    res = run_hydra(env, "plan", "--profile", str(tmp_path / "remote.yaml"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(free unknown: its peer host does not report it" in res.stdout
    (tmp_path / "b").mkdir()
    env = _env(tmp_path / "b", bare, ", memory_mib: 4096")
    res = run_hydra(env, "plan", "--profile", str(tmp_path / "b" / "remote.yaml"), timeout=120)
    assert "(3,891 MiB usable: the node file's memory_mib)" in res.stdout, res.stdout + res.stderr
