"""TLS between hydra hosts (docs/multi-host.md "Over a network you do not trust").

A peer host's router may take TLS only (its profile's ``tls:``), and a head host reaches such a
peer over TLS (its device's ``tls:``): its own probes directly (``client_context``), its
llama-server through a local tunnel (router/tunnel.py). Both sides authenticate: each requires
the other's certificate, signed by the CA both name (``CERT_REQUIRED`` both ways). Host names
are not checked: the CA is private to the hydra hosts, so whatever it signed is one of them,
and peers are often named by address. Python's ``ssl`` has no pre-shared-key API, so it is
certificates only.

What lives here: building the contexts (a bad file is one ``error:``/``fix:``), saying why a TLS
connection failed in the operator's terms (``explain``), and ``pump``: both directions of a
TLS connection and a plain one on one thread. One thread, because one OpenSSL connection must
not be read and written by two threads at once (the plain byte relay runs a thread per
direction, router/relay.py); non-blocking, because a record that carries no application data
(a TLS 1.3 ticket or key update) must not block the other direction.
"""

from __future__ import annotations

import functools
import select
import selectors
import socket
import ssl
import time
from typing import Protocol

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.errors import HydraError

HANDSHAKE = 0x16  # a TLS record of type handshake: the first byte of every ClientHello
COPY_BUFFER = 256 * 1024
FIX_FILES = ("make them as docs/multi-host.md \"Over a network you do not trust\" shows "
             "(openssl), and name them in tls: {ca, cert, key}")


def _context(files: TlsFiles, purpose: ssl.Purpose) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose is ssl.Purpose.CLIENT_AUTH
                         else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False  # the private CA is the trust anchor (module doc)
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=files.ca)
    except (OSError, ssl.SSLError) as exc:
        raise HydraError(f"tls: cannot load the CA {files.ca}: {exc}",
                         hint="give the CA certificate (PEM) that signed every hydra host's "
                         "certificate; " + FIX_FILES) from exc
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (OSError, ssl.SSLError) as exc:
        raise HydraError(f"tls: cannot load this host's certificate {files.cert} with key "
                         f"{files.key}: {exc}",
                         hint="give this host's certificate and the key it was made for "
                         "(PEM, the key unencrypted); " + FIX_FILES) from exc
    if purpose is ssl.Purpose.CLIENT_AUTH:
        # No session tickets: nothing resumes (each connection is long-lived), and a ticket
        # is a record a relay would read for no application byte.
        ctx.num_tickets = 0
    return ctx


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """The peer router's context: TLS only, a client certificate signed by ``files.ca``
    required. HydraError (error/fix) when a file does not load."""
    return _context(files, ssl.Purpose.CLIENT_AUTH)


@functools.lru_cache(maxsize=16)
def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A head host's context for one remote peer: this host's certificate, the peer's
    verified against ``files.ca``. Built once per set of files (a context is safe to share
    between threads); HydraError when a file does not load."""
    return _context(files, ssl.Purpose.SERVER_AUTH)


def connect(host: str, port: int, files: TlsFiles, timeout: float) -> ssl.SSLSocket:
    """A TLS connection to a peer host's router, handshake done, TCP_NODELAY on, blocking
    with ``timeout``. OSError (ssl.SSLError included) when it fails: ``explain`` says why."""
    ctx = client_context(files)
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return ctx.wrap_socket(sock)
        except ConnectionResetError as exc:
            # A peer router closes a handshake it will not take (a plain port, a source off
            # its rpc_allow) with the ClientHello unread, which the kernel turns into a reset:
            # said as the closed handshake it is (``explain``).
            raise ssl.SSLEOFError(ssl.SSL_ERROR_EOF, "EOF occurred in violation of protocol "
                                  "(connection reset during the TLS handshake)") from exc
    except BaseException:
        sock.close()
        raise


def explain(exc: BaseException, endpoint: str, files: TlsFiles) -> tuple[str, str] | None:
    """(error, fix) for a TLS failure talking to the peer at ``endpoint``; None when ``exc``
    is not about TLS (a refused connection, a time-out: said as for plain TCP)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"the peer at {endpoint} presented a certificate that does not verify against "
                f"the CA {files.ca}: {exc.verify_message or exc}",
                "give the CA that signed the peer host's certificate in the device's tls.ca "
                "(both hosts name the same CA)")
    if not isinstance(exc, ssl.SSLError):
        return None
    reason = getattr(exc, "reason", None) or exc  # made in Python (connect): no reason
    text = f"{reason} {exc}".lower()
    if "wrong version number" in text or "record layer failure" in text \
            or "packet length too long" in text:
        return (f"the peer at {endpoint} does not speak TLS ({reason})",
                "give the peer profile tls: {ca, cert, key} (its router then takes TLS), or "
                "remove tls: from this device to speak plain TCP to it")
    if "unexpected eof" in text or "eof occurred" in text:
        return (f"the peer at {endpoint} closed the connection during the TLS handshake: it "
                "does not speak TLS, or its rpc_allow does not list this host",
                "give the peer profile tls: {ca, cert, key} and an rpc_allow that lists this "
                "host, or remove tls: from this device to speak plain TCP to it")
    if any(a in text for a in ("unknown ca", "bad certificate", "certificate required",
                               "certificate unknown", "decrypt error", "access denied")):
        return (f"the peer at {endpoint} refused this host's certificate {files.cert} "
                f"({reason})",
                "sign this host's certificate with the CA the peer profile's tls.ca names "
                "(docs/multi-host.md \"Over a network you do not trust\")")
    return (f"TLS with the peer at {endpoint} failed: {reason}",
            "check that both hosts name the same CA and each its own certificate and key")


def explain_line(exc: BaseException, endpoint: str, files: TlsFiles | None) -> str | None:
    """``explain`` as one line for a log or a status reason ("…; fix: …")."""
    said = explain(exc, endpoint, files) if files is not None else None
    return None if said is None else f"{said[0]}; fix: {said[1]}"


class Counts(Protocol):
    """What ``pump`` counts: bytes client → upstream (``up``), back (``down``), and when a
    byte last moved (``last``, monotonic seconds). The router's Conn is one."""

    up: int
    down: int
    last: float


def _wait(sock: socket.socket, events: int) -> None:
    """Until ``sock`` is ready for ``events`` (POLLIN / POLLOUT): one poll, no selector made
    and closed per wait (this is the bulk path's back-pressure)."""
    p = select.poll()
    p.register(sock, events)
    p.poll()


def _send_all(dst: socket.socket, data: memoryview) -> None:
    """All of ``data`` to a non-blocking socket (TLS or plain), waiting for room as needed
    (that direction's back-pressure; the other direction waits meanwhile, as in a blocking
    relay). A socket shut down under it raises OSError, which ends the pump."""
    while data:
        try:
            n = dst.send(data)
        except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
            _wait(dst, select.POLLOUT)
            continue
        except ssl.SSLWantReadError:  # a TLS write that needs a record from the peer first
            _wait(dst, select.POLLIN)
            continue
        data = data[n:]


def pump(client: socket.socket, upstream: socket.socket, counts: Counts) -> str:
    """Both directions between ``client`` and ``upstream`` (either or both TLS) on this
    thread until one side ends; returns which ("client closed", "upstream closed"). OSError
    on a failed socket (a shutdown from another thread included). A TLS connection has no
    half-close a relay could pass on, so the first EOF ends both directions; ggml-RPC and
    Hydra frames never half-close."""
    client.setblocking(False)
    upstream.setblocking(False)
    buf = bytearray(COPY_BUFFER)
    view = memoryview(buf)
    clock = time.monotonic
    with selectors.DefaultSelector() as sel:
        sel.register(client, selectors.EVENT_READ, True)
        sel.register(upstream, selectors.EVENT_READ, False)
        while True:
            for key, _ in sel.select():
                upward = bool(key.data)
                src, dst = (client, upstream) if upward else (upstream, client)
                while True:  # drain it: a TLS socket buffers records select cannot see
                    try:
                        n = src.recv_into(buf)
                    except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                        break
                    except ssl.SSLWantWriteError:
                        _wait(src, select.POLLOUT)
                        continue
                    if not n:
                        return "client closed" if upward else "upstream closed"
                    _send_all(dst, view[:n])
                    if upward:
                        counts.up += n
                    else:
                        counts.down += n
                    counts.last = clock()
