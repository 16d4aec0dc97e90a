"""A real llama-server on a synthetic model, for tests and bench/rpccache.py: ports, startup,
shutdown.

Every wait has a deadline and every server started here is killed by `running_server`'s exit.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests

from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.tools.install import BuildOptions, bin_dir

START_DEADLINE_S = 120.0
REQUEST_TIMEOUT_S = 60.0


def llama_server_bin() -> Path | None:
    """The pinned CPU llama-server, or None when it has not been built."""
    p = bin_dir(BuildOptions()) / "llama-server"
    return p if p.is_file() else None


def log_tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, route: str, body: Mapping[str, object]) -> dict[str, object]:
        """POST a JSON body; the JSON object answered (asserts HTTP 200)."""
        r = requests.post(self.url + route, json=body, timeout=REQUEST_TIMEOUT_S)
        assert r.status_code == 200, f"{route}: HTTP {r.status_code} {r.text}\n{log_tail(self.log)}"
        out: dict[str, object] = r.json()
        return out


def wait_healthy(server: Server, deadline_s: float = START_DEADLINE_S) -> None:
    """Poll /health until 200; fail early, with the log, if the process exits first."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        rc = server.proc.poll()
        if rc is not None:
            raise AssertionError(
                f"llama-server exited with {rc} before it was healthy:\n{log_tail(server.log)}"
            )
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError(f"llama-server not healthy after {deadline_s}s:\n{log_tail(server.log)}")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)


@contextmanager
def running_server(
    binary: Path, model: Path, log: Path, extra: Sequence[str] = ()
) -> Iterator[Server]:
    """Start llama-server on `model` on a free port, wait until healthy, kill it on exit."""
    port = free_port()
    argv = [
        str(binary),
        "-m", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-c", "512",
        "-t", "2",
        "-np", "1",
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    server = Server(proc, port, log)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop(proc)
