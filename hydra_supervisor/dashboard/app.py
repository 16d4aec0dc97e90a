"""The dashboard's HTTP side: a WSGI app in front of the metrics server's `/metrics`.

Routes (all on the loopback metrics address; `/metrics` passes through untouched):
  GET  /                      the page (the per-start token in a <meta>)
  GET  /static/...            its script, styles and the vendored chart library
  GET  /api/state             the published snapshot + devices' memory + recent actions
  GET  /api/log?name=&cursor= hydra's or a process's log past the cursor (polled; follows
                              restarts)
  GET  /api/history           every lane's last 15 minutes, one point a second (tokens/s, in
                              flight, queued, requests; router/traffic.py `Traffic.history`)
  POST /api/switch {"profile"}       \
  POST /api/restart {"engine"}        |
  POST /api/reload                     > the control API's own handlers (control.py), on the loop
  POST /api/load {"profile"}          |
  POST /api/unload {"profile"|"all"} /

Security (docs/dashboard.md): served on loopback only (MetricsServer refuses anything else);
every route checks Host is this loopback address (DNS rebinding) and that the connecting
socket belongs to hydra's user (or root, or HYDRA_DASHBOARD_USERS); every POST must come from
the page's own origin (Origin, or Referer without it), carry the per-start token in
X-Hydra-Token, and be JSON (a cross-site form cannot send it without a CORS preflight, which is
never answered). Responses forbid framing and carry a strict Content-Security-Policy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import mimetypes
import os
import pwd
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from hydra_supervisor.dashboard.feed import (
    DeviceMemory,
    Publisher,
    process_logs,
    read_log,
)
from hydra_supervisor.proc import logfiles
from hydra_supervisor.wire.trust import peer_uid

log = logging.getLogger("hydra.dashboard")

Handler = Callable[[dict[str, Any]], Coroutine[Any, Any, tuple[int, dict[str, Any]]]]
StartResponse = Callable[..., Any]
WsgiApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

ACTIONS = {"/api/switch": ("POST", "/switch"), "/api/restart": ("POST", "/restart"),
           "/api/reload": ("POST", "/reload"), "/api/load": ("POST", "/load"),
           "/api/unload": ("POST", "/unload")}
TOKEN_HEADER = "HTTP_X_HYDRA_TOKEN"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
SECURITY_HEADERS = [("Content-Security-Policy", CSP), ("X-Frame-Options", "DENY"),
                    ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "same-origin"),
                    ("Cache-Control", "no-store")]
ACTION_TIMEOUT_S = 1800.0  # a switch loads a model: minutes on a big one
MAX_BODY = 64 << 10  # bytes: the largest action body read (a switch's is ~50)


def allowed_uids() -> frozenset[int]:
    """hydra's own uid, root, and HYDRA_DASHBOARD_USERS (comma-separated names or uids)."""
    uids = {os.getuid(), 0}
    for item in os.environ.get("HYDRA_DASHBOARD_USERS", "").split(","):
        item = item.strip()
        if not item:
            continue
        if item.isdigit():
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            log.warning("HYDRA_DASHBOARD_USERS: no user %r; ignored", item)
    return frozenset(uids)


def _static_root() -> Path:
    return Path(str(resources.files("hydra_supervisor.dashboard") / "static"))


class Dashboard:
    """The page and its API. `publisher` holds the daemon's published snapshot; `routes` are
    the control API's handlers (run on the loop once `bind` gave it); `profiles` lists the
    profiles a single-engine hydra can switch to."""

    def __init__(self, publisher: Publisher,
                 profiles: Callable[[], list[str]] = list,
                 history: Callable[[], Mapping[str, object]] | None = None) -> None:
        """`history`: the daemon's traffic history (GET /api/history), read on the page's
        thread (it is thread-safe)."""
        self.publisher = publisher
        self._history = history
        self.token = secrets.token_urlsafe(32)  # per start: a page of an older hydra is stale
        self._profiles = profiles
        self._routes: dict[tuple[str, str], Handler] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._devices = DeviceMemory()
        self.port: int | None = None  # the metrics server's, once it listens
        self.actions: list[dict[str, Any]] = []  # the last actions and their results
        self.refused = 0  # requests refused by the checks below (the page shows the count)
        self.uids = allowed_uids()

    def bind(self, loop: asyncio.AbstractEventLoop,
             routes: dict[tuple[str, str], Handler]) -> None:
        self._loop = loop
        self._routes = routes
        self.publisher.bind(loop)

    def wrap(self, metrics_app: WsgiApp) -> WsgiApp:
        """The WSGI app the metrics server serves: `/metrics` as before, the rest here."""
        def app(environ: dict[str, Any], start: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO") or "/"
            if path == "/metrics":
                return metrics_app(environ, start)
            if self.port is None:
                self.port = int(environ.get("SERVER_PORT") or 0)
            try:
                return self._serve(environ, start, path)
            except Exception as exc:  # noqa: BLE001 - a bug answers 500, the server lives on
                log.exception("dashboard %s failed", path)
                return self._json(start, 500, {"error": f"internal error: {exc}"})
        return app

    # -- checks ---------------------------------------------------------------------------------

    def check_user(self, environ: dict[str, Any]) -> str | None:
        """Why this connection's user may not use the dashboard (None: it may). Loopback is
        every user of the host: the kernel says who owns the client's socket (/proc/net/tcp,
        as the wire protocol checks it), and only hydra's user, root and HYDRA_DASHBOARD_USERS
        pass."""
        peer, local = environ.get("hydra.peer"), environ.get("hydra.local")
        if peer is None or local is None:
            return "cannot tell which user connected"
        uid = peer_uid(peer, local)
        if uid is None:
            return "cannot tell which user connected (not a socket of this host?)"
        if uid not in self.uids:
            return f"uid {uid} is not hydra's user (HYDRA_DASHBOARD_USERS adds users)"
        return None

    def _origin(self, environ: dict[str, Any]) -> str | None:
        """http://HOST:PORT when the Host header names this loopback listener, else None
        (a rebound DNS name, or a proxy in front)."""
        host = str(environ.get("HTTP_HOST") or "")
        port = str(environ.get("SERVER_PORT") or "")
        if host not in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            return None
        return f"http://{host}"

    def check_post(self, environ: dict[str, Any]) -> str | None:
        """Why a POST is refused (None: it may act)."""
        origin = self._origin(environ)
        if origin is None:
            return "Host is not this loopback address"
        sent = environ.get("HTTP_ORIGIN")
        if sent is not None:
            if sent != origin:
                return f"cross-site request refused (Origin {sent!r})"
        else:
            ref = str(environ.get("HTTP_REFERER") or "")
            if not ref.startswith(origin + "/"):
                return "cross-site request refused (no Origin, Referer not this page)"
        site = environ.get("HTTP_SEC_FETCH_SITE")
        if site is not None and site != "same-origin":
            return f"cross-site request refused (Sec-Fetch-Site {site})"
        token = str(environ.get(TOKEN_HEADER) or "")
        if not token or not hmac.compare_digest(token.encode(), self.token.encode()):
            return "missing or wrong X-Hydra-Token (reload the page: hydra restarted?)"
        ctype = str(environ.get("CONTENT_TYPE") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return "actions take application/json"
        return None

    # -- routes ---------------------------------------------------------------------------------

    def _serve(self, environ: dict[str, Any], start: StartResponse,
               path: str) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if self._origin(environ) is None:
            self.refused += 1
            log.warning("dashboard: refused %s %s: Host %r is not this loopback address",
                        method, path, environ.get("HTTP_HOST"))
            return self._json(start, 403, {"error": "Host is not this loopback address"})
        who = self.check_user(environ)
        if who is not None:
            self.refused += 1
            log.warning("dashboard: refused %s %s: %s", method, path, who)
            return self._json(start, 403, {"error": f"the dashboard is hydra's user's: {who}"})
        if method == "POST" and path in ACTIONS:
            return self._action(environ, start, path)
        if method not in ("GET", "HEAD"):
            return self._json(start, 405, {"error": f"{method} {path} is not allowed"})
        if path in ("/", "/index.html"):
            return self._page(start)
        if path.startswith("/static/"):
            return self._static(start, path[len("/static/"):])
        if path == "/api/state":
            return self._json(start, 200, self.state())
        if path == "/api/history":
            if self._history is None:
                return self._json(start, 200, {"step_s": 1.0, "end": time.time(),
                                               "series": {}})
            return self._json(start, 200, self._history())
        if path == "/api/log":
            qs = parse_qs(environ.get("QUERY_STRING") or "")
            return self._log(start, (qs.get("name") or [""])[0], (qs.get("cursor") or [None])[0])
        return self._json(start, 404, {"error": f"no such page: {path}"})

    def _page(self, start: StartResponse) -> Iterable[bytes]:
        html = (_static_root() / "index.html").read_text()
        html = html.replace("__HYDRA_TOKEN__", self.token)
        data = html.encode()
        start("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                         ("Content-Length", str(len(data))), *SECURITY_HEADERS])
        return [data]

    def _static(self, start: StartResponse, rel: str) -> Iterable[bytes]:
        root = _static_root().resolve()
        target = (root / rel).resolve()
        if root not in target.parents or not target.is_file() or target.name == "index.html":
            return self._json(start, 404, {"error": "no such file"})
        data = target.read_bytes()
        ctype = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
        if ctype.startswith("text/") or ctype.endswith("javascript"):
            ctype += "; charset=utf-8"
        start("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(data))),
                         *SECURITY_HEADERS])
        return [data]

    def state(self) -> dict[str, object]:
        """/api/state: the snapshot's JSON (docs/control.md) and what the page adds."""
        snap, age = self.publisher.get()
        if snap is None:
            return {"snapshot": None, "age_s": None, "now": time.time()}
        return {"snapshot": snap.to_json(), "age_s": round(age, 3), "now": time.time(),
                "devices": self._devices.get(),
                "profiles": self._safe_profiles(), "actions": self.actions[-20:],
                "refused": self.refused}

    def _safe_profiles(self) -> list[str]:
        try:
            return sorted(self._profiles())
        except Exception:  # noqa: BLE001 - an unreadable profiles dir: no list
            return []

    def _log(self, start: StartResponse, name: str, cursor: str | None) -> Iterable[bytes]:
        snap, _ = self.publisher.get(max_age=2.0)
        logs = process_logs(snap)
        if name not in logs:  # stopped with its profile (or never was): nothing to follow
            return self._json(start, 200, {"name": name, "gone": True, "known": sorted(logs),
                                           "error": f"no process {name!r} runs now"})
        path, pid = logs[name]
        chunk = read_log(path, cursor)
        # llama.cpp's relative stamps as wall-clock times, as `hydra logs` prints them
        stamper = logfiles.Stamper(logfiles.run_of(path))
        chunk["text"] = "".join(stamper.line(ln) for ln in chunk["text"].splitlines(True))
        reply = {**chunk, "name": name, "pid": pid, "path": str(path)}
        return self._json(start, 200, reply)

    def _action(self, environ: dict[str, Any], start: StartResponse,
                path: str) -> Iterable[bytes]:
        why = self.check_post(environ)
        if why is not None:
            self.refused += 1
            log.warning("dashboard: refused POST %s: %s", path, why)
            return self._json(start, 403, {"error": why})
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return self._json(start, 400, {"error": "Content-Length is not a number"})
        if not 0 <= length <= MAX_BODY:  # an action's body is a few bytes: never read more
            return self._json(start, 413, {"error": f"request body of {length} bytes: an "
                                           f"action takes at most {MAX_BODY}"})
        try:
            raw = environ["wsgi.input"].read(length) if length else b""
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._json(start, 400, {"error": "request body is not JSON"})
        if not isinstance(body, dict):
            return self._json(start, 400, {"error": "request body must be a JSON object"})
        what = path.rsplit("/", 1)[-1]
        handler = self._routes.get(ACTIONS[path])
        loop = self._loop
        if loop is None or loop.is_closed():
            return self._json(start, 503, {"error": "hydra is not ready for actions yet"})
        if handler is None:
            return self._json(start, 404, {"error": f"this hydra has no {what} action"})
        arg = body.get("profile") or body.get("engine") or ("all" if body.get("all") else "")
        rec: dict[str, Any] = {"action": what, "arg": arg, "at": time.time(), "code": None,
                               "result": None, "error": None, "message": None}
        self.actions.append(rec)
        del self.actions[:-50]
        log.info("dashboard: %s %s", what, arg)
        fut = asyncio.run_coroutine_threadsafe(handler(body), loop)
        try:
            code, reply = fut.result(ACTION_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            code, reply = 504, {"error": "hydra did not answer in time"}
        except Exception as exc:  # noqa: BLE001 - the handler's bug answers 500
            log.exception("dashboard action %s failed", path)
            code, reply = 500, {"error": f"internal error: {exc}"}
        rec.update(code=code, done=time.time(), error=reply.get("error"),
                   message=reply.get("message"),
                   result=reply.get("result") or ("ok" if code == 200 else "failed"))
        return self._json(start, code, reply)

    @staticmethod
    def _json(start: StartResponse, code: int, body: Mapping[str, object]) -> Iterable[bytes]:
        data = json.dumps(body, default=str).encode()
        reason = {200: "OK", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
                  405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
                  500: "Internal Server Error",
                  503: "Service Unavailable", 504: "Gateway Timeout"}.get(code, "Error")
        start(f"{code} {reason}", [("Content-Type", "application/json"),
                                   ("Content-Length", str(len(data))), *SECURITY_HEADERS])
        return [data]
