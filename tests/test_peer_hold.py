"""A peer lent by one hydra stays usable while a second head tries it (issue 32, items 1 and 8),
with real binaries on loopback: a `demo-peer` hydra lends its CPU rpc-server, a head hydra
splits Gemma 3 270M onto it; a second head's `hydra up` is refused four times in a row, each
time at once and naming the holder (address, build), while the first head keeps answering;
the peer host's `hydra status` says who holds its device; once the first head is killed -9
(hydra and its llama-server: nothing closes its connection but the kernel), the second head
gets the peer. A head whose peer another head took while it was away says who holds it on its
re-probe. tests/test_rpc_holder.py has the router's side with stand-ins."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import Up, free_port, make_env, run_hydra, status_json
from hydra_supervisor.tools import buildid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DENSE = ("model: gemma3-270m\nmode: combine\nhead: cpu\nsplit: [9, 9]\npeers: [far]\n"
         "server_args: {ctx-size: 512, parallel: 1, threads: 1, chat-template: gemma,"
         " no-jinja: true, n-predict: 8}\n")


def _complete(port: int) -> int:
    return _complete_within(port, 120)


def _complete_within(port: int, timeout: float) -> int:
    r = requests.post(f"http://127.0.0.1:{port}/completion", timeout=timeout,
                      json={"prompt": "Once upon a time", "n_predict": 4})
    return r.status_code


class Hosts:
    """The hosts of one test, each a `hydra up` in its own state dir under tmp_path: the peer
    host lending its CPU (demo-peer) and head hosts whose device far is that peer."""

    def __init__(self, tmp_path: Path, heads: tuple[str, ...]) -> None:
        self.tmp = tmp_path
        self.ups: list[Up] = []
        for d in ("peer", *heads):
            (tmp_path / d).mkdir()
        self.peer_port = free_port()
        self.node = f"devices:\n  far: {{endpoint: '127.0.0.1:{self.peer_port}'}}\n"
        self.peer_env = make_env(tmp_path / "peer")
        self.peer_args = ["--profile", "demo-peer", "--port", str(self.peer_port)]

    def start(self, env: dict[str, str], args: list[str], where: str, timeout: float) -> Up:
        up = Up(env, args, self.tmp / where)
        self.ups.append(up)
        up.wait_ready(timeout)
        return up

    def start_peer(self) -> Up:
        return self.start(self.peer_env, self.peer_args, "peer", 120)

    def head(self, name: str, port: int, extra: str = "") -> tuple[dict[str, str], list[str]]:
        """Host `name`'s environment and `hydra up` arguments: profile far<name> on `port`,
        dense COMBINE with its peer on the peer host."""
        env = make_env(self.tmp / name, self.node)
        prof = self.tmp / name / f"far{name}.yaml"
        prof.write_text(f"profile: far{name}\n{DENSE}port: {port}\n{extra}")
        return env, ["--profile", str(prof)]

    def end(self) -> None:
        for up in reversed(self.ups):
            if up.proc.poll() is None:
                up.stop()
            up.kill_everything()


def test_a_second_head_is_told_busy_four_times_and_gets_the_peer_once_the_first_dies(
        tmp_path: Path) -> None:
    from hydra_supervisor.testing.routerhelp import llama_bins

    llama_bins()
    ident = buildid.local_identity()
    hosts = Hosts(tmp_path, ("head", "second"))
    peer_port, head_port, second_port = hosts.peer_port, free_port(), free_port()
    try:
        peer_env = hosts.peer_env
        hosts.start_peer()
        head = hosts.start(*hosts.head("head", head_port), "head", 300)
        assert _complete(head_port) == 200

        second_env, second_args = hosts.head("second", second_port)
        took = []
        for i in range(4):
            t0 = time.monotonic()
            res = run_hydra(second_env, "up", *second_args, timeout=120)
            took.append(time.monotonic() - t0)
            err = res.stdout + res.stderr
            assert res.returncode == 2, err
            line = next((x for x in err.splitlines() if "is busy" in x), "")
            assert (f"remote peer far at 127.0.0.1:{peer_port} is busy: its rpc-server is held "
                    "by 127.0.0.1:") in line, err
            assert f"(build {ident.fingerprint})" in line, err
            if i == 0:
                print(f"\nsecond head, refused: {line.strip()}")
            assert _complete(head_port) == 200  # the first head was not disturbed
        print("hydra up of the second head took " + ", ".join(f"{t:.1f}s" for t in took))
        # a head that does not ask INFO first (a plain llama-server, an older hydra) sends
        # HELLO: the peer's router closes it itself, the rpc-server never sees it
        for _ in range(4):
            t0 = time.monotonic()
            with pytest.raises(rpcproto.HelloError, match="after 0 bytes"):
                rpcproto.probe("127.0.0.1", peer_port, timeout=10)
            took.append(time.monotonic() - t0)
            assert _complete(head_port) == 200
        print("a bare HELLO refused after " + ", ".join(f"{t:.2f}s" for t in took[4:]))

        # the peer host sees who holds its device: status, --json, the dashboard's state
        (port_st,) = [p for p in status_json(peer_env)["daemon"]["ports"]  # type: ignore[typeddict-item]
                      if p["port"] == peer_port]
        holder = port_st["router"]["rpc_holder"]
        assert holder["addr"].startswith("127.0.0.1:") and holder["build"] == ident.fingerprint
        assert holder["bytes_up"] > 0 and holder["held_s"] > 0
        assert port_st["router"]["refused"].get("rpc_held", 0) >= 4
        shown = run_hydra(peer_env, "status", timeout=60).stdout
        assert f"lent to {holder['addr']} (build {ident.fingerprint}) for " in shown, shown
        assert " other heads' connections refused since start" in shown, shown
        print("peer host: " + next(x for x in shown.splitlines() if "lent to" in x).strip())
        print("holder in --json: " + json.dumps(holder))

        head.kill_everything()  # hydra and its llama-server, -9: the kernel closes for them
        t0 = time.monotonic()
        hosts.start(second_env, second_args, "second", 300)
        print(f"second head ready {time.monotonic() - t0:.1f}s after the first was killed")
        assert _complete(second_port) == 200
    finally:
        hosts.end()


def test_a_head_whose_peer_another_head_took_says_who_holds_it_on_re_probe(
        tmp_path: Path) -> None:
    """The re-probe's side: head B serves on the peer; the peer host's hydra is killed -9 (B's
    head aborts at its next request, its first re-probe is refused) and started again, and
    head A takes the peer while B waits out its backoff (restart.backoff_initial: 60 here).
    B's next re-probe is closed by the peer's router (A holds the rpc-server) and asks it INFO,
    as `hydra up` does: B's status names A's address and build, not "closed at once"."""
    import threading

    from hydra_supervisor.testing.routerhelp import llama_bins

    llama_bins()
    ident = buildid.local_identity()
    hosts = Hosts(tmp_path, ("a", "b"))
    peer_port, a_port, b_port = hosts.peer_port, free_port(), free_port()
    try:
        peer = hosts.start_peer()
        b_env, b_args = hosts.head("b", b_port,
                                   "restart: {backoff_initial: 60, backoff_max: 60}\n")
        hosts.start(b_env, b_args, "b", 300)
        assert _complete(b_port) == 200

        peer.kill_everything()  # its hydra and rpc-server: B's next RPC call fails
        peer.proc.wait(30)

        def poke() -> None:  # B's head aborts on it; the router holds it meanwhile
            try:
                _complete_within(b_port, 5)
            except requests.RequestException:
                pass
        threading.Thread(target=poke, daemon=True).start()

        def b_peer() -> dict[str, object]:
            st = status_json(b_env)
            engines = list((st.get("status") or {}).get("engines") or [])  # type: ignore[attr-defined]
            return next(e for e in engines if e["role"] == "peer")

        deadline = time.monotonic() + 60
        while "probing again" not in str(b_peer()["reason"]):
            assert time.monotonic() < deadline, b_peer()["reason"]
            time.sleep(0.2)
        hosts.start_peer()  # back (its service manager)
        hosts.start(*hosts.head("a", a_port), "a", 300)
        assert _complete(a_port) == 200

        deadline = time.monotonic() + 150  # B's next re-probe: its 60 s backoff
        while "held by" not in str(b_peer()["reason"]):
            assert time.monotonic() < deadline, b_peer()["reason"]
            time.sleep(0.5)
        reason = str(b_peer()["reason"])
        print(f"\nB's peer: {reason}")
        assert f"127.0.0.1:{peer_port}: busy: its rpc-server is held by 127.0.0.1:" in reason
        assert f"(build {ident.fingerprint})" in reason, reason
        assert "closed at once" not in reason, reason
        assert _complete(a_port) == 200  # A undisturbed
    finally:
        hosts.end()
