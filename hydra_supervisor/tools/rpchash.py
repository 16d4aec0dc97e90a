"""FNV-1a 64, the hash ggml-rpc-server's tensor cache (`-c`) names its files by, at speed.

The head sends ``RPC_CMD_SET_TENSOR_HASH`` with the FNV-1a 64 (offset basis 0xcbf29ce484222325,
prime 0x100000001b3, over every byte) of a tensor's bytes (rpccache.py has the facts and the
cache dir).

Hashing is sequential by nature (every byte's step needs the last one's result), so Python
cannot do it at speed: a 10-line C function is compiled with the system's C compiler on first use
(``cache_dir()/rpccache``), loaded with ctypes, and run on an mmap of the GGUF. Without a
compiler a pure-Python loop does it, correctly at ~16 MB/s, 60x slower (warned).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np

from hydra_supervisor.config.paths import cache_dir as hydra_cache_dir

log = logging.getLogger("hydra_supervisor.tools.rpccache")  # (its messages say "rpccache:")

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1
# Bytes hashed per call into the C function (progress granularity; the mmap is read in place).
CHUNK = 64 * 1024 * 1024


def own_dir() -> Path:
    """hydra's files for this module: the compiled hash and the memo of hashes."""
    return hydra_cache_dir() / "rpccache"



def fnv1a64_py(data: bytes | bytearray | memoryview, h: int = FNV_OFFSET) -> int:
    """FNV-1a 64 in pure Python (the reference; ~16 MB/s here)."""
    for b in bytes(data):
        h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


_C_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
/* FNV-1a 64, as fnv_hash() in ggml-rpc.cpp; `h` carries the state across chunks. */
uint64_t hydra_fnv1a64(const unsigned char *p, size_t n, uint64_t h) {
    const uint64_t prime = 0x100000001b3ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= prime;
    }
    return h;
}
"""

_native: Callable[[int, int, int], int] | Literal[False] | None = None  # False: no compiler
_native_why = ""


def _build_native() -> Callable[[int, int, int], int] | None:
    """Compile (once per source digest) and load the C hash; None when no compiler works."""
    global _native, _native_why
    if _native is not None:
        return _native or None
    digest = hashlib.sha256(_C_SOURCE.encode()).hexdigest()[:12]
    out_dir = own_dir()
    lib = out_dir / f"fnv1a64-{digest}-{os.uname().machine}.so"
    try:
        if not lib.is_file():
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not cc:
                raise OSError("no C compiler (cc or gcc) on PATH")
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "fnv.c"
                src.write_text(_C_SOURCE)
                built = Path(tmp) / "fnv.so"
                res = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(built), str(src)],
                                     capture_output=True, text=True, timeout=120, check=False)
                if res.returncode != 0:
                    raise OSError(f"{cc} failed: {res.stderr.strip()[:300]}")
                os.replace(built, lib)
        fn = ctypes.CDLL(str(lib)).hydra_fnv1a64
        fn.restype = ctypes.c_uint64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
        if fn(b"a", 1, FNV_OFFSET) != 0xAF63DC4C8601EC8C:  # the published test vector
            raise OSError(f"{lib} computes a wrong FNV-1a 64")
        _native = fn
    except (OSError, subprocess.SubprocessError) as exc:
        _native, _native_why = False, str(exc)
        log.warning("rpccache: hashing in pure Python (~16 MB/s, 60x slower): %s", exc)
        return None
    return fn


def fnv1a64(data: bytes | bytearray | memoryview | np.ndarray, h: int = FNV_OFFSET) -> int:
    """FNV-1a 64 of a buffer, continuing from `h` (chain calls to hash a stream in chunks)."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    arr = np.ascontiguousarray(arr.reshape(-1).view(np.uint8))
    fn = _build_native()
    if fn is None:
        return fnv1a64_py(arr.tobytes(), h)
    return int(fn(arr.ctypes.data, arr.nbytes, h))


def mapped(path: str) -> np.ndarray:
    """The file as a read-only uint8 array (an mmap; unmapped when the array is collected)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def hash_extent(arr: np.ndarray, offset: int, size: int,
                 tick: Callable[[int], None] | None = None) -> int:
    h = FNV_OFFSET
    pos = offset
    end = offset + size
    while pos < end:
        n = min(CHUNK, end - pos)
        h = fnv1a64(arr[pos:pos + n], h)
        pos += n
        if tick:
            tick(n)
    return h


def hash_file(path: Path) -> int:
    arr = mapped(str(path))
    try:
        return hash_extent(arr, 0, arr.size)
    finally:
        del arr
