"""A head's load onto remote peers, as `hydra status` shows it (serve/progress.py)."""

from __future__ import annotations

from hydra_supervisor.cli.status_view import remote_load_text
from hydra_supervisor.plan.plan import EngineSpec, Placement, Plan, Role
from hydra_supervisor.serve import progress
from hydra_supervisor.serve.snapshot import RemoteLoad

MIB = 1 << 20


def _plan(remote: bool) -> Plan:
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
                      host="127.0.0.1", port=30200, device="cpu", start_order=1)
    peer = EngineSpec(name="peer-far", role=Role.PEER, program="ggml-rpc-server", args=(),
                      env=(), host="10.0.0.2", port=8090, device="far", start_order=0,
                      managed=not remote)
    places = (Placement("far", 9, 300 * MIB, 0, 0, 0), Placement("cpu", 9, 100 * MIB, 0, 0, 0))
    return Plan(profile="p", source="p.yaml", model_path="m.gguf", model_kind="dense",  # type: ignore[arg-type]
                mode="combine", transport="rpc",  # type: ignore[arg-type]
                engines=(peer, head), placements=places)


def _io(wchar: int) -> str:
    return f"rchar: 5\nwchar: {wchar}\nsyscr: 1\n"


def test_progress_counts_the_bytes_written_against_the_remote_weights() -> None:
    plan = _plan(remote=True)
    assert progress.remote_weight_bytes(plan) == 300 * MIB
    got = progress.remote_load(plan, 42, "STARTING", read=lambda pid: _io(120 * MIB))
    assert got == {"sent_bytes": 120 * MIB, "remote_bytes": 300 * MIB}
    # never past the total (logs count too), and nothing once the head is READY
    assert progress.remote_load(plan, 42, "STARTING", read=lambda pid: _io(900 * MIB)) == {
        "sent_bytes": 300 * MIB, "remote_bytes": 300 * MIB}
    assert progress.remote_load(plan, 42, "READY", read=lambda pid: _io(1)) is None


def test_a_local_peer_or_an_unreadable_process_shows_nothing() -> None:
    assert progress.remote_load(_plan(remote=False), 42, "STARTING",
                                read=lambda pid: _io(1)) is None

    def gone(pid: int) -> str:
        raise FileNotFoundError(pid)

    assert progress.remote_load(_plan(remote=True), 42, "STARTING", read=gone) is None


def test_hydra_status_says_it_in_the_reason() -> None:
    text = remote_load_text(RemoteLoad(sent_bytes=120 * MIB, remote_bytes=300 * MIB))
    assert text == "; sent 120 of 300 MiB to remote peers (40%; a warm peer cache sends less)"
    assert remote_load_text(None) == ""
