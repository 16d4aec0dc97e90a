"""Local TCP ports: is one free, and who holds it (for the error message)."""

from __future__ import annotations

import socket

import psutil


def port_free(host: str, port: int) -> bool:
    bind_host = "0.0.0.0" if host in ("", "*") else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((bind_host, port))
        except OSError:
            return False
    return True


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
