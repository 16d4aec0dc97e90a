"""Find the stock llama.cpp binaries hydra drives, and say where each came from.

Lookup order for each of llama-server, ggml-rpc-server, llama-bench (first hit wins):
  1. the node file's ``binaries:`` (a path per binary, or ``bin_dir``);
  2. environment: ``HYDRA_LLAMA_SERVER`` / ``HYDRA_RPC_SERVER`` / ``HYDRA_LLAMA_BENCH``, then
     ``HYDRA_LLAMA_BIN_DIR``;
  3. hydra's build cache (``hydra install-llama``), CUDA builds before CPU builds;
  4. ``PATH`` (``ggml-rpc-server`` also as its older name ``rpc-server``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hydra_supervisor.errors import HydraError
from hydra_supervisor.tools.install import cached_builds

ENV_BY_BINARY = {
    "llama-server": "HYDRA_LLAMA_SERVER",
    "ggml-rpc-server": "HYDRA_RPC_SERVER",
    "llama-bench": "HYDRA_LLAMA_BENCH",
}
PATH_NAMES = {"ggml-rpc-server": ("ggml-rpc-server", "rpc-server")}
INSTALL_HINT = "run `hydra install-llama` (add --cuda on GPU hosts), or point " \
    "HYDRA_LLAMA_BIN_DIR / the node file's binaries: at your own build"


@dataclass(frozen=True)
class Found:
    name: str
    path: Path
    origin: str


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find(name: str, configured: dict[str, str] | None = None) -> Found:
    configured = configured or {}
    tried: list[str] = []
    if name in configured:
        path = Path(configured[name]).expanduser()
        if _executable(path):
            return Found(name, path, "node file binaries:")
        raise HydraError(f"{name}: the node file points at {path}, which is not an executable "
                         "file", hint=INSTALL_HINT)
    if "bin_dir" in configured:
        path = Path(configured["bin_dir"]).expanduser() / name
        if _executable(path):
            return Found(name, path, "node file binaries.bin_dir")
        tried.append(str(path))
    env = os.environ.get(ENV_BY_BINARY[name])
    if env:
        path = Path(env)
        if _executable(path):
            return Found(name, path, f"${ENV_BY_BINARY[name]}")
        raise HydraError(f"{name}: ${ENV_BY_BINARY[name]}={env} is not an executable file",
                         hint=INSTALL_HINT)
    bin_env = os.environ.get("HYDRA_LLAMA_BIN_DIR")
    if bin_env:
        path = Path(bin_env) / name
        if _executable(path):
            return Found(name, path, "$HYDRA_LLAMA_BIN_DIR")
        tried.append(str(path))
    for bdir in cached_builds():
        path = bdir / name
        if _executable(path):
            return Found(name, path, "hydra build cache")
        tried.append(str(path))
    for candidate in PATH_NAMES.get(name, (name,)):
        hit = shutil.which(candidate)
        if hit:
            return Found(name, Path(hit), "PATH")
    tried.append("PATH")
    raise HydraError(f"{name} not found (looked in: {', '.join(tried)})", hint=INSTALL_HINT)


def version_line(path: Path, timeout: float = 10.0) -> str:
    """The binary's own `--version` line (llama.cpp prints it on stderr), or why there is none."""
    try:
        proc = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(cannot run: {exc})"
    for line in (proc.stderr + proc.stdout).splitlines():
        if line.startswith("version:"):
            return line.strip()
    if "unknown argument" in proc.stderr + proc.stdout:
        return "(this binary has no --version flag)"
    text = (proc.stderr + proc.stdout).strip().splitlines()
    return text[0] if text else f"(no version output, exit {proc.returncode})"
