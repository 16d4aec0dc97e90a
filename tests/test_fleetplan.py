"""fleetplan: room on the devices for one more profile (pure; golden cases)."""

from __future__ import annotations

from hydra_supervisor.plan import fleetplan
from hydra_supervisor.plan.devices import Device, Kind
from hydra_supervisor.plan.fleetplan import Occupant, Verdict, make_room

GIB = 1 << 30
CAP = {"cuda0": 24 * GIB, "cuda1": 16 * GIB, "host": 64 * GIB}


def occ(name: str, last_used: float, evictable_at: float = 0.0, movable: bool = True,
        **needs_gib: float) -> Occupant:
    return Occupant(name, {k: int(v * GIB) for k, v in needs_gib.items()}, last_used,
                    evictable_at, movable)


def need(**gib: float) -> dict[str, int]:
    return {k: int(v * GIB) for k, v in gib.items()}


def test_fits_beside_what_runs() -> None:
    room = make_room(CAP, [occ("a", 1, cuda0=10)], need(cuda0=10), now=100)
    assert room.verdict is Verdict.FITS and room.victims == ()


def test_other_device_never_evicted() -> None:
    # b lives on cuda1 only: loading onto cuda0 never touches it, even when it is the LRU.
    room = make_room(CAP, [occ("b", 1, cuda1=15), occ("a", 5, cuda0=20)], need(cuda0=10),
                     now=100)
    assert room.verdict is Verdict.EVICT and room.victims == ("a",)


def test_least_recently_used_first_and_only_as_many_as_needed() -> None:
    occs = [occ("new", 50, cuda0=8), occ("old", 10, cuda0=8), occ("mid", 30, cuda0=8)]
    room = make_room(CAP, occs, need(cuda0=8), now=100)
    assert room.verdict is Verdict.EVICT and room.victims == ("old",)
    room = make_room(CAP, occs, need(cuda0=15), now=100)
    assert room.victims == ("old", "mid")


def test_min_resident_makes_it_wait_with_a_reason_and_a_time() -> None:
    occs = [occ("a", 1, evictable_at=130, cuda0=20)]
    room = make_room(CAP, occs, need(cuda0=10), now=100)
    assert room.verdict is Verdict.WAIT
    assert room.retry_at == 130
    assert "a stays loaded 30s more (min_resident)" in room.reason
    assert "cuda0" in room.reason
    # past the window it goes
    assert make_room(CAP, occs, need(cuda0=10), now=130).victims == ("a",)


def test_loading_or_stopping_profiles_are_never_chosen() -> None:
    occs = [occ("busy", 1, movable=False, cuda0=20)]
    room = make_room(CAP, occs, need(cuda0=10), now=100)
    assert room.verdict is Verdict.WAIT and room.retry_at is None
    assert "busy is loading or stopping" in room.reason


def test_skips_a_protected_one_for_the_next_lru() -> None:
    occs = [occ("young", 1, evictable_at=500, cuda0=12), occ("old", 20, cuda0=12)]
    room = make_room(CAP, occs, need(cuda0=12), now=100)
    assert room.verdict is Verdict.EVICT and room.victims == ("old",)


def test_never_when_larger_than_the_device() -> None:
    room = make_room(CAP, [], need(cuda1=20), now=0, name="big")
    assert room.verdict is Verdict.NEVER
    assert "big does not fit this node even alone" in room.reason
    assert "cuda1: needs 20,480 MiB of 16,384" in room.reason


def test_multi_device_profile_needs_room_on_each() -> None:
    occs = [occ("g0", 1, cuda0=20), occ("g1", 2, cuda1=12), occ("h", 0, host=10)]
    room = make_room(CAP, occs, need(cuda0=10, cuda1=10), now=100)
    assert room.verdict is Verdict.EVICT
    assert set(room.victims) == {"g0", "g1"}  # h (host memory) helps nothing


def test_unknown_capacity_is_not_budgeted() -> None:
    room = make_room({"cuda0": 0}, [occ("a", 1, cuda0=100)], need(cuda0=100), now=0)
    assert room.verdict is Verdict.FITS


def test_device_keys_join_names_of_one_physical_device() -> None:
    devs = {
        "cpu": Device("cpu", Kind.CPU, 32 * GIB, 30 * GIB),
        "cpu-peer": Device("cpu-peer", Kind.CPU, 32 * GIB, 30 * GIB),
        "rtx": Device("rtx", Kind.CUDA, 24 * GIB, 23 * GIB, cuda_index=0),
        "gpu0": Device("gpu0", Kind.CUDA, 24 * GIB, 23 * GIB, cuda_index=0),
        "far": Device("far", Kind.REMOTE, 8 * GIB, 8 * GIB, endpoint="10.0.0.2:50052"),
    }
    assert fleetplan.capacity_of(devs) == {"host": 30 * GIB, "cuda0": 23 * GIB,
                                           "remote:10.0.0.2:50052": 8 * GIB}
    needs = fleetplan.needs_of([("cpu", GIB), ("cpu-peer", 2 * GIB), ("rtx", 5 * GIB),
                                ("cpu (host RAM)", GIB)], devs)
    assert needs == {"host": 4 * GIB, "cuda0": 5 * GIB}
