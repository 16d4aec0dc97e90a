"""Client commands say what happened when hydra goes away mid-request: a message and exit 1,
never a traceback (issue 18: `hydra switch` printed RemoteDisconnected when hydra was killed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path


def test_switch_when_hydra_dies_mid_request(tmp_path: Path) -> None:
    sock_path = tmp_path / "control.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)

    def die_mid_request() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.close()  # as a killed hydra's socket does: no reply

    t = threading.Thread(target=die_mid_request, daemon=True)
    t.start()
    env = {**os.environ, "HYDRA_STATE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "hydra_supervisor", "switch", "demo"], env=env,
                         capture_output=True, text=True, timeout=60)
    srv.close()
    t.join(5)
    assert res.returncode == 1, res
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("error: hydra is no longer running"), res.stderr
    assert "POST /switch" in res.stderr
