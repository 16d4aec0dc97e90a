"""Local TCP ports: is one free, who holds it (for the error message), and TCP self-connects.

A connect() to a local port nobody listens on can, rarely, pick that very port as its own
ephemeral source port and "succeed" (TCP simultaneous open): the socket is then connected to
itself and holds the port, so the server that should bind it next fails. Anything that
retries connects against a local port that may be down (health probes, the router) must
detect that and let go. Ports below the kernel's ephemeral range cannot self-connect: hydra's
default port ranges sit there.
"""

from __future__ import annotations

import errno
import socket

import psutil


def port_free(host: str, port: int) -> bool:
    return bind_problem(host, port) is None


def bind_problem(host: str, port: int) -> str | None:
    """Why hydra could not listen on host:port, in words, or None when it can: in use (the
    holder named), a name that does not resolve, an address no interface has, a port below
    1024 without the right. A name is resolved first, so an unknown host is never called "in
    use"."""
    bind_host = "0.0.0.0" if host in ("", "*") else host
    try:
        family, _, _, _, addr = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        return f"host {host} does not resolve ({getattr(exc, 'strerror', None) or exc})"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use by {port_holder(port)}"
            if exc.errno == errno.EADDRNOTAVAIL:
                return f"{host} is not an address of this host"
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def port_holder(port: int) -> str:
    """Who listens on `port`, for the error message (pid and command), or 'another process'."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return "another process"
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
            try:
                proc = psutil.Process(c.pid)
                cmd = " ".join(proc.cmdline()) or proc.name()
            except psutil.Error:
                cmd = "?"
            return f"pid {c.pid} ({cmd[:120]})"
    return "another process"


def self_connected(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return False


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the kernel's pick for a bind to 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def client_host(bind_host: str) -> str:
    """Where a local client reaches a server bound to `bind_host` (a wildcard means loopback)."""
    return "127.0.0.1" if bind_host in ("0.0.0.0", "::", "", "*") else bind_host


def endpoint_parts(endpoint: str) -> tuple[str, int]:
    """(host, port) of a `host:port` endpoint as the node file writes it (checked there); the
    host as written (an IPv6 address keeps its brackets)."""
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def host_port(host: str, port: int) -> str:
    """`host:port` as URLs and `--rpc` write it: an IPv6 address goes in brackets ([::1]:8080)."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def url_for(bind_host: str, port: int, scheme: str = "http") -> str:
    """The URL a local client uses for a server bound to `bind_host`:`port` (the one place
    hydra builds one: wildcards become loopback, IPv6 gets brackets)."""
    return f"{scheme}://{host_port(client_host(bind_host), port)}"
