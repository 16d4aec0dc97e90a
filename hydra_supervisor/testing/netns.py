"""Hosts on one machine: network namespaces joined by veth links to a bridge, for the multi-host
tests (tests/test_multihost*.py) and bench/multihost.py; NsUp is a `hydra up` inside one of them.

    with Hosts(["head", "peer", "client"]) as net:   # 10.A.B.1, .2, .3 on one /24
        net.addr("peer")                              # "10.A.B.2"
        net.popen("peer", [...])                      # a command inside that namespace
        net.call("client", fn)                        # fn() on a thread whose sockets live there
        net.cut("peer") / net.restore("peer")         # `ip link set eth0 down|up` on that host
        net.blackhole("head", "peer")                 # `ip route add blackhole PEER/32` in head

The bridge lives in a namespace of its own (the machine's own network is never touched); every
host's link has `tc qdisc ... tbf rate <rate>` on its egress (1 Gbit by default) and loopback up.
Names are unique per run (`hy<pid><random>-<host>`); `close()` (and the context manager's exit,
a test failure included) kills what still runs in each namespace and deletes them all.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from hydra_supervisor.testing.harness import Up

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2, no veth/bridge): the reason."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def why_unavailable() -> str | None:
    """None when namespaces, veth, bridges and tbf can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    try:
        with Hosts(["a"], rate="1gbit"):
            pass
    except (NetnsUnavailable, RuntimeError, OSError) as exc:
        return f"cannot make network namespaces here: {exc}"
    return None


class Hosts:
    """2-3 hosts as namespaces on one bridged /24 (see the module docstring)."""

    def __init__(self, names: Sequence[str], rate: str | None = "1gbit",
                 burst: str = "1mb") -> None:
        self.tag = f"hy{os.getpid() % 100000}{random.randrange(1000):03d}"
        self.names = list(names)
        self.rate = rate
        self.burst = burst
        self.subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
        self._made: list[str] = []
        self._links = 0
        try:
            self._build()
        except Exception:
            self.close()
            raise

    # -- names ------------------------------------------------------------------------------

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.names.index(host) + 1}"

    # -- building and tearing down ----------------------------------------------------------

    def _add_ns(self, name: str) -> None:
        res = _ip("netns", "add", name, check=False)
        if res.returncode != 0:
            raise NetnsUnavailable(f"ip netns add: {res.stderr.strip()}")
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.ns("sw")
        self._add_ns(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for host in self.names:
            self._boot(host)
        for host in self.names:  # the bridge learns; wait until each host reaches the others
            for other in self.names:
                if other != host:
                    self.wait_reachable(host, other, 10.0)

    def _boot(self, host: str) -> None:
        """The host's namespace, its link to the bridge, its address and its tbf."""
        ns, sw = self.ns(host), self.ns("sw")
        self._add_ns(ns)
        self._links += 1
        port = f"p{self._links}"
        _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
            "netns", sw)
        _ip("-n", sw, "link", "set", port, "master", "br0")
        _ip("-n", sw, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        if self.rate:
            # tbf: `rate` on the host's egress. The default burst of 1 MB lets a 1 MB message
            # after an idle moment through at veth speed (a token's logits, for one); a small
            # burst (64kb: one veth GSO segment) charges every byte at `rate`.
            self.run(host, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                            self.rate, "burst", self.burst, "latency", "50ms"])

    def crash(self, host: str) -> None:
        """The host loses power: its link goes first (so not one FIN or RST leaves it), then
        everything in it dies and its namespace (sockets included) is deleted."""
        ns = self.ns(host)
        self.cut(host)
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.pids(host) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Its name is free at once; the kernel frees the namespace itself (and its veth, down)
        # only once the dead host's orphaned TCP sockets give up: the rebooted host gets a
        # new link.
        _ip("netns", "del", ns)
        self._made.remove(ns)

    def boot(self, host: str) -> None:
        """The crashed host back, same address, nothing running, nothing remembered."""
        self._boot(host)
        for other in self.names:
            if other != host:
                self.wait_reachable(host, other, 10.0)

    def wait_reachable(self, src: str, dst: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            res = self.run(src, ["ping", "-c", "1", "-W", "1", self.addr(dst)], check=False) \
                if shutil.which("ping") else None
            if res is None or res.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{src} cannot reach {dst} ({self.addr(dst)})")
            time.sleep(0.1)

    def pids(self, host: str) -> list[int]:
        """Every process whose network namespace is this host's."""
        res = _ip("netns", "pids", self.ns(host), check=False)
        return [int(x) for x in res.stdout.split()]

    def close(self) -> None:
        """Kill whatever still runs in the namespaces, then delete them (idempotent)."""
        for name in self._made:
            for pid in [int(x) for x in _ip("netns", "pids", name, check=False).stdout.split()]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in reversed(self._made):
            for _ in range(50):
                if _ip("netns", "del", name, check=False).returncode == 0:
                    break
                time.sleep(0.1)
        self._made.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things ---------------------------------------------------------------------

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`ip netns exec` execs the command in place: the pid Popen sees is the command's."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def run(self, host: str, argv: Sequence[str], check: bool = True, timeout: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(self.argv(host, argv), capture_output=True, text=True,
                             timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise RuntimeError(f"[{host}] {' '.join(argv)}: {res.stderr.strip()}")
        return res

    def popen(self, host: str, argv: Sequence[str], *,
              stdout: int | IO[str] | IO[bytes] | None = None,
              stderr: int | IO[str] | IO[bytes] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv(host, argv), stdout=stdout, stderr=stderr)

    def call(self, host: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        """fn() on a thread that entered this host's network namespace: every socket it makes
        lives there (setns(2) moves the calling thread only; the test's own threads stay)."""
        out: list[T] = []
        err: list[BaseException] = []

        def body() -> None:
            try:
                self.enter(host)
                out.append(fn())
            except BaseException as exc:  # handed to the caller, raised there
                err.append(exc)

        t = threading.Thread(target=body, daemon=True, name=f"in-{host}")
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call in {host} still running after {timeout}s")
        if err:
            raise err[0]
        return out[0]

    def enter(self, host: str) -> None:
        """Move the calling thread into this host's network namespace (for good)."""
        fd = os.open(f"/run/netns/{self.ns(host)}", os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"setns {self.ns(host)}: {os.strerror(e)}")
        finally:
            os.close(fd)

    def thread(self, host: str, fn: Callable[[], None], name: str = "") -> threading.Thread:
        """A started daemon thread running fn() inside this host's namespace."""
        def body() -> None:
            self.enter(host)
            fn()
        t = threading.Thread(target=body, daemon=True, name=name or f"in-{host}")
        t.start()
        return t

    # -- faults -----------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        """The host's cable pulled: its link down (its address and routes go with it)."""
        _ip("-n", self.ns(host), "link", "set", "eth0", "down")

    def restore(self, host: str) -> None:
        _ip("-n", self.ns(host), "link", "set", "eth0", "up")
        for other in self.names:
            if other != host:
                self.wait_reachable(host, other, 10.0)

    def blackhole(self, at: str, dst: str) -> None:
        """Packets from `at` to `dst` dropped silently at `at` (netfilter and netem are not in
        every kernel; a blackhole route is)."""
        _ip("-n", self.ns(at), "route", "add", "blackhole", f"{self.addr(dst)}/32")

    def unblackhole(self, at: str, dst: str) -> None:
        _ip("-n", self.ns(at), "route", "del", "blackhole", f"{self.addr(dst)}/32")


class NsUp(Up):
    """`hydra up` inside one host's namespace (the pid is hydra's: `ip netns exec` execs); its
    output is appended to tmp/up.{out,err} (tmp is made if missing), across restarts."""

    def __init__(self, net: Hosts, host: str, env: dict[str, str], args: list[str],
                 tmp: Path) -> None:
        super().__init__(env, args, tmp, launcher=net.argv(host, []), append=True)
