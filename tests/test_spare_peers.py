"""Spare peers (issue 32, item 6): a remote device may name alternates for its endpoint
(`far: {endpoint: A, spares: [B, C]}`). At prepare (`hydra up`, switch, reload) the first of
A, B, C that answers HELLO, passes the build identity check and fits the plan is used, and said;
on a peer's loss under `on_peer_loss: restart` the supervisor moves it onto a spare that passes
the same checks (the layout re-planned there) and restarts the head on it.

The node file's checks; the choice at prepare against fake peer hosts answering HELLO and INFO
(tests/test_peer_identity.py's FakePeer; the demo GGUF's header, nothing started); the move at
a loss on fake children (tests/fake_children.py). The real hosts, in network namespaces, are in
tests/test_multihost.py (test_a_lost_peer_moves_onto_its_spare)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from hydra_supervisor.cli import doctor
from hydra_supervisor.config.config import load_node
from hydra_supervisor.config.profile import DeviceDecl, HealthPolicy, Node, PeerLoss
from hydra_supervisor.errors import ConfigError, HydraError
from hydra_supervisor.plan import deployment as deployment_mod
from hydra_supervisor.plan import spares
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.plan.devices import MIB
from hydra_supervisor.plan.layout import PeerRefused
from hydra_supervisor.plan.placement import DoesNotFit
from hydra_supervisor.plan.spares import PeerChoice
from hydra_supervisor.proc.managed import State
from hydra_supervisor.testing.harness import free_port, make_env, run_hydra
from hydra_supervisor.tools import buildid
from hydra_supervisor.tools.buildid import PeerInfo
from tests.fake_children import FakeWorld, Run, deployment, go, head_spec, peer_spec
from tests.test_peer_identity import HERE, OTHER, FakePeer

pytestmark = pytest.mark.timeout(120)
GIB = 1024 * MIB

# -- the node file -------------------------------------------------------------------------------


def test_spares_are_read_and_checked(tmp_path: Path):
    node = tmp_path / "node.yaml"
    node.write_text("devices:\n  far: {endpoint: '10.0.0.2:8090', spares: ['10.0.0.3:8090',"
                    " '10.0.0.4:8090']}\n  near: {endpoint: '10.0.0.5:8090'}\n")
    n = load_node(node)
    assert n.devices["far"].spares == ("10.0.0.3:8090", "10.0.0.4:8090")
    assert n.devices["near"].spares == ()
    assert spares.alternates(n) == {"far": ("10.0.0.2:8090", "10.0.0.3:8090", "10.0.0.4:8090")}
    node.write_text("devices:\n"
                    "  gpu: {cuda: 0, spares: ['10.0.0.3:8090']}\n"
                    "  far: {endpoint: '10.0.0.2:8090', spares: ['10.0.0.3', '10.0.0.2:8090']}\n"
                    "  odd: {endpoint: '10.0.0.2:8091', spares: 7}\n")
    with pytest.raises(ConfigError) as exc:
        load_node(node)
    text = str(exc.value)
    assert f"{node}:2: devices.gpu.spares: only for a remote peer (a device with endpoint:)" \
        in text
    assert "devices.far.spares.0: expected host:port, got '10.0.0.3'" in text
    assert "devices.far.spares.1: 10.0.0.2:8090 is named twice" in text
    assert f"{node}:4: devices.odd.spares: expected a list of names" in text


# -- the choice (pure, with a fake attempt) ------------------------------------------------------

NODE = Node(source="node.yaml", devices={
    "far": DeviceDecl(name="far", endpoint="A:1", spares=("B:1", "C:1")),
    "near": DeviceDecl(name="near", endpoint="N:1")})


def attempt_on(refuse: dict[str, str]) -> Any:
    """A fake build-and-check: the endpoints `refuse` names fail as the real checks do."""
    def attempt(node: Node) -> str:
        ep = node.devices["far"].endpoint
        assert ep is not None
        why = refuse.get(ep)
        if why == "short":
            raise DoesNotFit("model does not fit the devices of profile 'p':\n  far: ...",
                             devices=("far",))
        if why:
            raise PeerRefused("far", HydraError(f"remote peer far at {ep} {why}",
                                                hint="start it"))
        return ep
    return attempt


def used(_: str) -> set[str]:
    return {"far"}


def test_the_primary_when_it_serves():
    got, (choice,) = spares.choose(attempt_on({}), NODE, used)
    assert got == "A:1" and not choice.on_spare
    assert choice == PeerChoice("far", ("A:1", "B:1", "C:1"), "A:1")


def test_a_dead_primary_then_a_spare_of_another_build_then_the_next_spare():
    got, (choice,) = spares.choose(attempt_on({
        "A:1": "is unreachable: Connection refused",
        "B:1": "runs another build"}), NODE, used)
    assert got == "C:1"
    assert choice.says() == ("far: serving on spare C:1 (primary A:1: remote peer far at A:1 "
                             "is unreachable: Connection refused; spare B:1: remote peer far "
                             "at B:1 runs another build)")


def test_a_primary_short_of_memory_then_a_spare():
    got, (choice,) = spares.choose(attempt_on({"A:1": "short"}), NODE, used)
    assert got == "B:1" and choice.why == "does not fit: far: ..."


def test_none_serves_the_primary_s_error_with_what_each_spare_said():
    with pytest.raises(HydraError) as exc:
        spares.choose(attempt_on({"A:1": "is unreachable: refused", "B:1": "short",
                                  "C:1": "is busy"}), NODE, used)
    assert exc.value.message.splitlines() == [
        "remote peer far at A:1 is unreachable: refused",
        "  spare B:1: does not fit: far: ...",
        "  spare C:1: remote peer far at C:1 is busy"]
    assert exc.value.hint == "start it"


def test_without_spares_the_error_is_as_before():
    node = replace(NODE, devices={"far": DeviceDecl(name="far", endpoint="A:1")})
    refused = PeerRefused("far", HydraError("remote peer far at A:1 is unreachable"))
    with pytest.raises(PeerRefused) as exc:
        spares.choose(attempt_on({"A:1": "is unreachable"}), node, used)
    assert exc.value.message == refused.message
    other = HydraError("model file not found: m.gguf")

    def broken(_: Node) -> str:
        raise other
    with pytest.raises(HydraError) as exc2:
        spares.choose(broken, NODE, used)
    assert exc2.value is other  # not about a peer: no spare is tried


# -- prepare against fake peer hosts (HELLO and INFO; the demo GGUF's header) ---------------------

PROFILE = ("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\nsplit: [9, 9]\n"
           "server_args: {ctx-size: 1024}\n")


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[FakePeer]]:
    monkeypatch.setattr(buildid, "local_identity", lambda configured=None: HERE)
    made: list[FakePeer] = []
    yield made
    for p in made:
        p.close()


def _prepare(tmp_path: Path, endpoint: str, spare_eps: list[str]) -> Deployment:
    from hydra_supervisor.testing.routerhelp import gemma_path

    gemma_path()  # skip with a reason when the demo model is absent
    listed = ", ".join(f"'{e}'" for e in spare_eps)
    env = make_env(tmp_path, f"devices:\n  far: {{endpoint: '{endpoint}', spares: [{listed}]}}\n")
    (tmp_path / "remote.yaml").write_text(PROFILE)
    return deployment_mod.prepare(str(tmp_path / "remote.yaml"), node_file=env["HYDRA_NODE"])


def test_prepare_plans_on_the_first_spare_that_serves(tmp_path: Path, hosts: list[FakePeer]):
    other, good = FakePeer(OTHER), FakePeer(HERE)
    hosts += [other, good]
    dead = f"127.0.0.1:{free_port()}"
    dep = _prepare(tmp_path, dead, [other.endpoint, good.endpoint])
    (peer,) = dep.plan.peers
    assert peer.endpoint == good.endpoint
    args = list(dep.plan.head.args)
    assert args[args.index("--rpc") + 1] == good.endpoint
    (choice,) = dep.peer_choices
    assert choice.using == good.endpoint and choice.endpoints[0] == dead
    said = choice.says()
    assert said.startswith(f"far: serving on spare {good.endpoint} (primary {dead}: remote "
                           f"peer far at {dead} is unreachable"), said
    assert f"spare {other.endpoint}: build identity mismatch" in said, said


def test_prepare_skips_a_spare_short_of_memory(tmp_path: Path, hosts: list[FakePeer]):
    small, big = FakePeer(HERE, free=40 * MIB), FakePeer(HERE, free=3 * GIB)
    hosts += [small, big]
    dep = _prepare(tmp_path, small.endpoint, [big.endpoint])
    assert dep.plan.peers[0].endpoint == big.endpoint
    (choice,) = dep.peer_choices
    assert choice.why.startswith("does not fit: far: needs "), choice.why
    assert choice.why.endswith("has 38 MiB usable"), choice.why
    # the supervisor's re-plan back onto the primary, should it serve again: refused, short
    with pytest.raises(DoesNotFit):
        deployment_mod.on_spare(dep, "far", small.endpoint, "gone")
    back = deployment_mod.on_spare(dep, "far", big.endpoint, "x")
    assert back.plan.head.args == dep.plan.head.args  # the same plan, the same ports


def test_hydra_plan_plans_on_the_primary_and_lists_the_spares(tmp_path: Path,
                                                              hosts: list[FakePeer]):
    """`hydra plan` probes no HELLO (it would wait in the queue of an rpc-server a running head
    holds): it plans on the device's own endpoint and says so, with the spares in order."""
    primary = FakePeer(HERE, free=3 * GIB)
    hosts.append(primary)
    from hydra_supervisor.testing.routerhelp import gemma_path

    gemma_path()  # skip with a reason when the demo model is absent
    dead = f"127.0.0.1:{free_port()}"
    env = make_env(tmp_path, f"devices:\n  far: {{endpoint: '{primary.endpoint}', spares: "
                   f"['{dead}', '10.0.0.4:8090']}}\n")
    profile = str(tmp_path / "remote.yaml")
    (tmp_path / "remote.yaml").write_text(PROFILE)
    res = run_hydra(env, "plan", "--profile", profile, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    said = (f"far: planned on its endpoint {primary.endpoint}; spares {dead}, 10.0.0.4:8090 "
            "(not probed here: `hydra up` plans on the first of them that answers HELLO, runs "
            "this build and fits; `hydra doctor --peers` checks each)")
    assert said in " ".join(res.stdout.split()), res.stdout
    assert primary.seen == ["op 0x41"]  # its free memory asked (INFO), never a HELLO
    res = run_hydra(env, "plan", "--json", "--profile", profile, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["spares"] == [
        {"device": "far", "planned_on": primary.endpoint, "spares": [dead, "10.0.0.4:8090"]}]


def test_doctor_peers_checks_each_spare(hosts: list[FakePeer]):
    same, other = FakePeer(HERE), FakePeer(OTHER)
    hosts += [same, other]
    dead = f"127.0.0.1:{free_port()}"
    node = Node(source="node.yaml", devices={"far": DeviceDecl(
        name="far", endpoint=same.endpoint, spares=(dead, other.endpoint))})
    buf = io.StringIO()
    ok = doctor.run_peers(Console(file=buf, width=300, color_system=None), node, timeout=10)
    text = buf.getvalue()
    assert not ok  # a spare that fails is a finding
    lines = text.splitlines()
    at = [ln for ln in lines if ln.startswith("peer far at ")]
    assert at == [f"peer far at {same.endpoint}:", f"peer far at {dead} (spare 1 of far):",
                  f"peer far at {other.endpoint} (spare 2 of far):"], text
    assert "unreachable" in text and "✗ build identity mismatch" in text
    assert "✓ same build as this host" in text


# -- the move at a loss (fake children) ----------------------------------------------------------

PRIMARY, SPARE_OTHER, SPARE = 50100, 50101, 50102


def with_spares(dep: Deployment, ports: list[int]) -> Deployment:
    """The fake remote peer-0 (device gpu1) with spares on `ports`, as prepare makes it."""
    eps = tuple(f"127.0.0.1:{p}" for p in (PRIMARY, *ports))
    node = Node(source="node.yaml", devices={"gpu1": DeviceDecl(
        name="gpu1", endpoint=eps[0], spares=eps[1:])})
    lay: Any = SimpleNamespace(node=node)
    return replace(dep, layout=lay, peer_choices=(PeerChoice("gpu1", eps, eps[0]),))


class Replans:
    """The supervisor's re-plan seam: the fake layout moved onto the spare (its peer spec and
    the head's --rpc), or refused for the ports in `short` (the spare's memory does not fit)."""

    def __init__(self, short: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        self.short = short
        self.asked: list[str] = []

    async def __call__(self, dep: Deployment, device: str, endpoint: str, why: str
                       ) -> Deployment:
        self.asked.append(endpoint)
        port = int(endpoint.rpartition(":")[2])
        if port in self.short:
            raise DoesNotFit("model does not fit the devices of profile 't'", devices=(device,))
        peer = peer_spec(0, port, remote=True)
        head = head_spec([peer])
        plan = replace(dep.plan, engines=(peer, head))
        choices = tuple(c.moved(endpoint, why) for c in dep.peer_choices)
        return replace(dep, plan=plan, peer_choices=choices)


def spare_world(w: FakeWorld, replans: Replans) -> None:
    w.identity = HERE
    for port in (PRIMARY, SPARE_OTHER, SPARE):
        w.remote_up[port] = True
        w.remote_info[port] = PeerInfo(hydra=True, identity=HERE)
    w.remote_info[SPARE_OTHER] = PeerInfo(hydra=True, identity=OTHER)
    seams = w.seams()
    w.seams = lambda: replace(seams, replan=replans)  # type: ignore[method-assign]


def rpc_of(argv: list[str]) -> str:
    return argv[argv.index("--rpc") + 1]


def test_a_lost_peer_moves_onto_the_spare_that_passes(tmp_path: Path):
    replans = Replans()

    async def body(w: FakeWorld, tmp: Path) -> None:
        spare_world(w, replans)
        r = Run(w, with_spares(deployment(1, remote=True), [SPARE_OTHER, SPARE]), tmp)
        told: list[Deployment] = []
        r.sup.on_replanned = told.append  # the lane's plan follows (Lane._adopt)
        r.start()
        await r.all_ready()
        head0 = w.live("head")
        assert head0 is not None and rpc_of(head0.argv) == f"127.0.0.1:{PRIMARY}"
        w.remote_up[PRIMARY] = False  # the primary's host gone (HELLO silent)
        head0.kill(134)  # its next RPC call aborts
        await r.until(lambda: r.mp("head").state is State.READY and w.live("head") is not None
                      and w.live("head") is not head0)
        head1 = w.live("head")
        assert head1 is not None and rpc_of(head1.argv) == f"127.0.0.1:{SPARE}"
        peer = r.mp("peer-0")
        assert peer.state is State.READY and peer.spec.port == SPARE
        assert f"serving on spare 127.0.0.1:{SPARE} (primary 127.0.0.1:{PRIMARY}: no HELLO " \
            "answer" in peer.reason, peer.reason
        assert replans.asked == [f"127.0.0.1:{SPARE}"]  # the other build: never re-planned
        assert r.sup.plan.peers[0].port == SPARE
        assert [d.plan.peers[0].port for d in told] == [SPARE]
        assert told[0] is r.sup.deployment
        # on the spare while it serves: the primary back changes nothing
        w.remote_up[PRIMARY] = True
        restarts = r.mp("head").restarts
        head1.kill(134)  # the head alone crashes: its peer answers, it restarts on the spare
        await r.until(lambda: r.mp("head").restarts > restarts
                      and r.mp("head").state is State.READY)
        head2 = w.live("head")
        assert head2 is not None and rpc_of(head2.argv) == f"127.0.0.1:{SPARE}"
        await r.stop()
    go(tmp_path, body)


def test_a_spare_short_of_memory_is_skipped_and_none_left_probes_on(tmp_path: Path):
    replans = Replans(short={SPARE})

    async def body(w: FakeWorld, tmp: Path) -> None:
        spare_world(w, replans)
        r = Run(w, with_spares(deployment(1, remote=True), [SPARE_OTHER, SPARE]), tmp).start()
        await r.all_ready()
        del w.remote_up[PRIMARY]  # refused at once
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF
                      and "probing again" in r.mp("peer-0").reason)
        assert replans.asked == [f"127.0.0.1:{SPARE}"]
        assert r.mp("peer-0").spec.port == PRIMARY  # still the primary's, probed on
        w.remote_up[PRIMARY] = True  # back: served on it again, as without spares
        await r.until(lambda: r.mp("head").state is State.READY
                      and r.mp("peer-0").state is State.READY)
        assert rpc_of(w.live("head").argv) == f"127.0.0.1:{PRIMARY}"  # type: ignore[union-attr]
        assert "spare" not in r.mp("peer-0").reason
        await r.stop()
    go(tmp_path, body)


def test_degraded_the_peer_comes_back_on_a_spare_and_combine_returns_there(tmp_path: Path):
    replans = Replans()

    async def body(w: FakeWorld, tmp: Path) -> None:
        spare_world(w, replans)
        dep = deployment(1, remote=True, on_peer_loss=PeerLoss.DEGRADE)
        r = Run(w, with_spares(dep, [SPARE]), tmp).start()
        await r.all_ready()
        del w.remote_up[PRIMARY]
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.sup.degraded is not None)
        await r.until(lambda: r.sup.degraded is None and r.mp("head").state is State.READY
                      and "--rpc" in (w.live("head").argv if w.live("head") else []))
        assert rpc_of(w.live("head").argv) == f"127.0.0.1:{SPARE}"  # type: ignore[union-attr]
        assert "serving on spare" in r.mp("peer-0").reason
        await r.stop()
    go(tmp_path, body)


@pytest.mark.parametrize("found", ["hello", "connect"])
def test_a_peer_found_lost_by_a_probe_tries_its_spares_at_once(tmp_path: Path, found: str):
    """The probe that found the peer lost (its HELLO after the head died, or the stall rule's
    TCP connect under a silent request) stands for the first re-probe: the spare is tried at
    once, not after the lost endpoint's HELLO has been silent again for its 2 s."""
    replans = Replans()

    async def body(w: FakeWorld, tmp: Path) -> None:
        spare_world(w, replans)
        dep = deployment(1, remote=True, health=HealthPolicy(interval=0.5, hang_timeout=5,
                                                             stall_timeout=30))
        r = Run(w, with_spares(dep, [SPARE]), tmp).start()
        await r.all_ready()
        head0 = w.live("head")
        assert head0 is not None
        w.remote_up[PRIMARY] = False  # the primary's host gone: HELLO silent for its timeout
        w.hellos.clear()
        if found == "connect":
            w.connect_fails[PRIMARY] = "timeout"
            w.inflight, w.owed_since = 1, w.clock()
            # (the move may be over before a look at it: READY again, on the spare)
            await r.until(lambda: r.mp("peer-0").state is not State.READY
                          or w.live("head") not in (None, head0))
            w.inflight = 0
        else:
            head0.kill(134)  # its next RPC call aborts
        await r.until(lambda: r.mp("head").state is State.READY
                      and w.live("head") not in (None, head0))
        assert rpc_of(w.live("head").argv) == f"127.0.0.1:{SPARE}"  # type: ignore[union-attr]
        # the HELLO that found it lost (after the head died), none after it
        assert w.hellos.count(PRIMARY) == (1 if found == "hello" else 0), w.hellos
        said = ("no HELLO answer when found lost" if found == "hello"
                else "TCP connect timed out after 3s")
        assert f"(primary 127.0.0.1:{PRIMARY}: {said})" in r.mp("peer-0").reason, \
            r.mp("peer-0").reason
        await r.stop()
    go(tmp_path, body)


def test_without_spares_the_lost_peer_is_probed_again_at_once(tmp_path: Path):
    """No spares: the lost endpoint is the only one, so its first re-probe comes at once, as
    before (the probe that found it lost does not stand for it)."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[PRIMARY] = True
        r = Run(w, deployment(1, remote=True), tmp).start()
        await r.all_ready()
        w.remote_up[PRIMARY] = False
        w.hellos.clear()
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF
                      and "probing again" in r.mp("peer-0").reason)
        assert w.hellos.count(PRIMARY) == 2, w.hellos  # found lost, then re-probed
        w.remote_up[PRIMARY] = True
        await r.all_ready(30)
        await r.stop()
    go(tmp_path, body)
