"""A CA and host certificates made with the `openssl` CLI, for the TLS tests and
bench/multihost.py --tls: the same commands docs/multi-host.md ("Over a network you do not
trust") gives the operator, run in a directory of the caller's.

    files = make_certs(tmp, ["peer", "head"])   # {"peer": TlsFiles, "head": TlsFiles}
    other = make_certs(tmp / "other", ["head"])  # a second CA: its certificates are refused
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from hydra_supervisor.config.profile import TlsFiles

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
HOST_EXT = ("basicConstraints=critical,CA:FALSE\n"
            "keyUsage=critical,digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
            "subjectKeyIdentifier=hash\n"
            "authorityKeyIdentifier=keyid\n")


def openssl_missing() -> str | None:
    """Why certificates cannot be made here, or None."""
    return None if shutil.which("openssl") else "the openssl command is not installed"


def _run(args: list[str], cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(where: Path, hosts: Sequence[str], days: int = 30) -> dict[str, TlsFiles]:
    """A new CA in ``where`` (ca.crt, ca.key) and for each host NAME.crt and NAME.key signed
    by it; returns each host's TlsFiles."""
    where.mkdir(parents=True, exist_ok=True)
    _run(["req", "-x509", *EC, "-days", str(days), "-subj", "/CN=hydra CA",
          "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign",
          "-keyout", "ca.key", "-out", "ca.crt"], where)
    (where / "host.ext").write_text(HOST_EXT)
    out = {}
    for name in hosts:
        _run(["req", *EC, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
              "-out", f"{name}.csr"], where)
        _run(["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
              "-CAcreateserial", "-days", str(days), "-extfile", "host.ext",
              "-out", f"{name}.crt"], where)
        out[name] = TlsFiles(ca=str(where / "ca.crt"), cert=str(where / f"{name}.crt"),
                             key=str(where / f"{name}.key"))
    return out
