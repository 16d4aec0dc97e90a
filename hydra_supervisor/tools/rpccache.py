"""ggml-rpc-server's tensor cache (`-c`), filled from a local GGUF so weights need not cross
the wire.

Facts from the pinned source (``ggml/src/ggml-rpc/ggml-rpc.cpp``, ``tools/rpc/rpc-server.cpp``;
docs/multi-host.md "Weights over the wire" has the proof against a real load):

- The head (the RPC client) sets a tensor in a *weights* buffer
  (``GGML_BACKEND_BUFFER_USAGE_WEIGHTS``) of more than ``HASH_THRESHOLD`` = 10 MiB (strictly
  greater) by sending ``RPC_CMD_SET_TENSOR_HASH`` with the FNV-1a 64 (offset basis
  0xcbf29ce484222325, prime 0x100000001b3, over every byte) of the bytes it would send. Those are
  the tensor's bytes as stored in the GGUF: llama.cpp's loader sets a tensor in a non-host buffer
  whole, from the mmap or a read of exactly ``ggml_nbytes`` at the tensor's offset (the chunked
  async upload needs a device with host buffers, which RPC does not have), and nothing repacks a
  tensor bound for an RPC buffer.
- The server (run with ``-c``) looks for ``<cache dir>/<hash as %016 PRIx64>`` (16 lowercase
  hex digits) and, when the file exists, sets the tensor from the file's bytes -- all of them:
  the file's size is the size it uses, so a short file is a corrupt load. On a miss the client
  sends the bytes with ``cache_flag`` = 1 and the server writes the file (not atomically).
- The cache dir is ``$LLAMA_CACHE/rpc`` when LLAMA_CACHE is set and not empty, else
  ``$XDG_CACHE_HOME/llama.cpp/rpc``, else ``$HOME/.cache/llama.cpp/rpc`` (Linux), created by
  the server at start.

So a host with the same GGUF can write those files itself: ``prefill`` hashes every tensor over
the threshold and writes ``<cache dir>/<hash>`` (temp file + rename, so the server never reads a
half-written file), skipping files already there with the right size. It writes every tensor
over the threshold, also those a head keeps on its own devices (the token embedding, or the
dense layers when only experts go to the peer): they cost disk, never a wrong load.

The hash (FNV-1a 64 in C, compiled on first use, or pure Python) is in rpchash.py. Hashes are
memoised per GGUF (real path, size, mtime_ns) under ``cache_dir()/rpccache/index``, so a second
prefill or a status of an unchanged file reads no tensor data. This module is the cache dir
(its plan, status and prefill, the memo of hashes) and hydra's side of it (a peer profile's
`prefill:`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import gguf
import numpy as np

from hydra_supervisor.config.profile import Node
from hydra_supervisor.errors import HydraError

if TYPE_CHECKING:
    from hydra_supervisor.plan.plan import Plan

from hydra_supervisor.tools.rpchash import CHUNK, hash_extent, hash_file, mapped, own_dir

log = logging.getLogger(__name__)

# ggml-rpc.cpp: `const size_t HASH_THRESHOLD = 10 * 1024 * 1024;` and `size > HASH_THRESHOLD`.
HASH_THRESHOLD = 10 * 1024 * 1024
_INDEX_VERSION = 1
_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-00001-of-(?P<count>\d{5})\.gguf$")
_TMP_PREFIX = ".hydra-prefill-"
# Plan.meta key under which layout.build puts a peer profile's resolved `prefill:` paths.
PLAN_KEY: Final = "prefill"

# progress(bytes of tensor data handled so far, bytes in all)
Progress = Callable[[int, int], None]


# -- pure functions -----------------------------------------------------------------------------


def cache_file_name(h: int) -> str:
    """The server's file name for a hash: ``snprintf("%016" PRIx64)``."""
    return f"{h:016x}"


@dataclass(frozen=True)
class CacheEntry:
    """One weight tensor the server would look up by hash."""
    name: str
    file: str  # the GGUF (shard) it is stored in
    offset: int  # absolute byte offset of its data in `file`
    size: int
    hash: int

    @property
    def file_name(self) -> str:
        return cache_file_name(self.hash)


@dataclass(frozen=True)
class CachePlan:
    gguf: str
    tensors_total: int  # every tensor in the model
    entries: tuple[CacheEntry, ...]  # those over the threshold, in file order

    @property
    def tensors(self) -> int:
        return len(self.entries)

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries)

    def unique(self) -> dict[str, CacheEntry]:
        """File name -> first tensor with that content (equal tensors share one file)."""
        out: dict[str, CacheEntry] = {}
        for e in self.entries:
            out.setdefault(e.file_name, e)
        return out


@dataclass(frozen=True)
class PrefillResult:
    tensors: int  # tensors over the threshold (each is looked up by hash)
    cached_already: int  # cache files that were there with the right size
    written: int  # cache files written now
    bytes_written: int
    seconds: float
    bytes_total: int = 0  # bytes of all tensors over the threshold
    cache_dir: str = ""


@dataclass(frozen=True)
class CacheStatus:
    gguf: str
    cache_dir: str
    tensors: int
    bytes: int
    files: int  # distinct cache files the model needs
    cached: int  # of those, present with the right size
    cached_bytes: int
    missing: tuple[str, ...]  # file names absent or of the wrong size

    @property
    def complete(self) -> bool:
        return not self.missing


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The dir a ggml-rpc-server started with `env` (default: this process's) uses for -c:
    tools/rpc/rpc-server.cpp's fs_get_cache_directory() / "rpc" on Linux."""
    env = os.environ if env is None else env
    if env.get("LLAMA_CACHE"):
        return Path(env["LLAMA_CACHE"]) / "rpc"
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "llama.cpp" / "rpc"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "llama.cpp" / "rpc"


# -- reading the GGUF ---------------------------------------------------------------------------


def shards(gguf_path: Path) -> list[Path]:
    """The files of a model: every shard of a split model given its first, else just it."""
    real = os.path.realpath(gguf_path)
    m = _SPLIT_RE.match(real)
    if not m:
        return [Path(real)]
    count = int(m.group("count"))
    return [Path(f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class _OffsetReader(gguf.GGUFReader):
    """gguf-py's reader without a numpy view per tensor: name, absolute offset, byte size."""

    extents: list[tuple[str, int, int]]

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        self.extents = []
        for fld in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset = fld.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
            n_bytes = int(np.prod(dims)) * type_size // block
            self.extents.append((str(bytes(name_data), encoding="utf-8"),
                                 int(start_offs + offset[0]), n_bytes))
        self.tensors = []


def tensor_extents(gguf_path: Path) -> list[tuple[str, str, int, int]]:
    """(name, file, absolute offset, bytes) of every tensor of the model, in file order."""
    out: list[tuple[str, str, int, int]] = []
    for f in shards(gguf_path):
        if not f.is_file():
            raise HydraError(f"model file not found: {f}")
        try:
            reader = _OffsetReader(str(f))
        except (ValueError, IndexError, KeyError, OSError) as err:
            raise HydraError(f"cannot read GGUF {f}: {err}") from err
        size = f.stat().st_size
        for name, off, n in reader.extents:
            if off + n > size:
                raise HydraError(f"truncated GGUF {f}: tensor {name} ends at byte {off + n:,}, "
                                 f"the file has {size:,}")
            out.append((name, str(f), off, n))
    return out



# -- the memo of hashes -------------------------------------------------------------------------


def _identity(files: list[Path]) -> list[list[str | int]]:
    out: list[list[str | int]] = []
    for f in files:
        st = f.stat()
        out.append([str(f), st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def _index_path(first: Path) -> Path:
    key = hashlib.sha256(str(first).encode()).hexdigest()[:24]
    return own_dir() / "index" / f"{key}.json"


def _load_index(files: list[Path]) -> CachePlan | None:
    path = _index_path(files[0])
    try:
        data = json.loads(path.read_text())
        if (data.get("version") != _INDEX_VERSION or data.get("threshold") != HASH_THRESHOLD
                or data.get("identity") != _identity(files)):
            return None
        entries = tuple(CacheEntry(name=e[0], file=e[1], offset=e[2], size=e[3],
                                   hash=int(e[4], 16)) for e in data["entries"])
        return CachePlan(gguf=str(files[0]), tensors_total=int(data["tensors_total"]),
                         entries=entries)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _save_index(files: list[Path], plan: CachePlan) -> None:
    path = _index_path(files[0])
    data = {"version": _INDEX_VERSION, "threshold": HASH_THRESHOLD, "identity": _identity(files),
            "tensors_total": plan.tensors_total,
            "entries": [[e.name, e.file, e.offset, e.size, e.file_name] for e in plan.entries]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as exc:  # the memo is an optimisation; a read-only cache dir costs time only
        log.warning("rpccache: cannot save the hash index %s: %s", path, exc)


# -- plan, status, prefill ----------------------------------------------------------------------


def plan(gguf_path: Path, progress: Progress | None = None) -> CachePlan:
    """Every tensor of the model over the threshold with its hash (hashing reads them all,
    unless the memo for this exact file is valid)."""
    files = shards(Path(gguf_path))
    for f in files:
        if not f.is_file():
            raise HydraError(f"model file not found: {f}")
    cached = _load_index(files)
    if cached is not None:
        if progress:
            progress(cached.bytes, cached.bytes)
        return cached
    extents = tensor_extents(Path(gguf_path))
    big = [x for x in extents if x[3] > HASH_THRESHOLD]
    total = sum(x[3] for x in big)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    entries: list[CacheEntry] = []
    by_file: dict[str, list[tuple[str, str, int, int]]] = {}
    for x in big:
        by_file.setdefault(x[1], []).append(x)
    for fname, xs in by_file.items():
        arr = mapped(fname)
        for name, file, off, n in xs:
            entries.append(CacheEntry(name, file, off, n, hash_extent(arr, off, n, tick)))
        del arr
    if progress and not big:
        progress(0, 0)
    result = CachePlan(gguf=str(files[0]), tensors_total=len(extents), entries=tuple(entries))
    _save_index(files, result)
    return result


def status(gguf_path: Path, cache_dir: Path | None = None,
           progress: Progress | None = None, *, verify: bool = False) -> CacheStatus:
    """How much of the model's cache is in `cache_dir` (present with the right size; with
    `verify`, also re-hashed: a file whose bytes do not hash to its name counts as missing)."""
    cdir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    p = plan(gguf_path, progress)
    unique = p.unique()
    missing = []
    cached_bytes = 0
    for fname, e in unique.items():
        if _has(cdir / fname, e.size) and (not verify or hash_file(cdir / fname) == e.hash):
            cached_bytes += e.size
        else:
            missing.append(fname)
    return CacheStatus(gguf=p.gguf, cache_dir=str(cdir), tensors=p.tensors, bytes=p.bytes,
                       files=len(unique), cached=len(unique) - len(missing),
                       cached_bytes=cached_bytes, missing=tuple(missing))



def _sweep_temps(cdir: Path, older_than_s: float = 3600.0) -> None:
    """Temp files a killed prefill left behind (a live one's mtime moves as it writes)."""
    now = time.time()
    for tmp in cdir.glob(_TMP_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > older_than_s:
                tmp.unlink()


def _check_room(cdir: Path, need: int) -> None:
    try:
        free = shutil.disk_usage(cdir).free
    except OSError:
        return
    if need > free:
        gb = 1e9
        raise HydraError(f"rpc cache: {cdir} needs {need / gb:.1f} GB more for these weights "
                         f"and its filesystem has {free / gb:.1f} GB free",
                         hint="free space there, or point the rpc-server elsewhere "
                              "(LLAMA_CACHE in the peer profile's env:, or --dir)")


def _has(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _copy_extent(src: str, offset: int, size: int, dst_fd: int) -> None:
    with open(src, "rb") as fin:
        pos, left = offset, size
        while left:
            try:
                n = os.copy_file_range(fin.fileno(), dst_fd, left, pos)
            except OSError:
                n = 0
            if n <= 0:  # not supported here (or across these filesystems): read and write
                fin.seek(pos)
                buf = fin.read(min(left, CHUNK))
                if not buf:
                    raise HydraError(f"{src}: unexpected end of file at byte {pos:,}")
                os.write(dst_fd, buf)
                n = len(buf)
            pos += n
            left -= n


def _write_entry(cdir: Path, e: CacheEntry) -> None:
    final = cdir / e.file_name
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=cdir)
    try:
        try:
            _copy_extent(e.file, e.offset, e.size, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.getsize(tmp) != e.size:
            raise HydraError(f"rpc cache: wrote {os.path.getsize(tmp):,} bytes of {e.name} "
                             f"to {tmp}, expected {e.size:,}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def prefill(gguf: Path, cache_dir: Path, progress: Progress | None = None, *,
            verify: bool = False) -> PrefillResult:
    """Write `<cache_dir>/<hash>` for every tensor of `gguf` over the threshold, so a
    ggml-rpc-server -c using `cache_dir` is sent hashes only. Files already there with the right
    size are kept. `progress(done, total)` counts bytes of work, monotonic: every tensor's bytes
    once hashed (instant when the memo is valid), then once copied or found in the cache.
    `verify`: re-hash files already present, and rewrite those whose bytes do not match."""
    t0 = time.monotonic()
    cdir = Path(cache_dir)
    try:
        cdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HydraError(f"rpc cache: cannot create {cdir}: {exc.strerror}") from exc
    # The hashing pass reads every tensor once; the copy pass reads only the missing ones.
    _sweep_temps(cdir)
    p = plan(Path(gguf), (lambda d, t: progress(d, 2 * t)) if progress else None)

    def present(e: CacheEntry) -> bool:
        path = cdir / e.file_name
        return _has(path, e.size) and (not verify or hash_file(path) == e.hash)

    _check_room(cdir, sum(e.size for e in p.unique().values() if not _has(cdir / e.file_name,
                                                                          e.size)))
    done, total = p.bytes, 2 * p.bytes
    seen: set[str] = set()
    found = written = bytes_written = 0
    for e in p.entries:
        if e.file_name not in seen:  # equal tensors share one file
            seen.add(e.file_name)
            if present(e):
                found += 1
            else:
                try:
                    _write_entry(cdir, e)
                except OSError as exc:
                    raise HydraError(f"rpc cache: cannot write {cdir / e.file_name} ({e.name}): "
                                     f"{exc.strerror or exc}") from exc
                written += 1
                bytes_written += e.size
        done += e.size
        if progress:
            progress(done, total)
    return PrefillResult(tensors=p.tensors, cached_already=found, written=written,
                         bytes_written=bytes_written, seconds=time.monotonic() - t0,
                         bytes_total=p.bytes, cache_dir=str(cdir))


def describe(result: PrefillResult) -> str:
    mib = 1024 * 1024
    rate = (f", {result.bytes_written / mib / result.seconds:.0f} MiB/s"
            if result.bytes_written and result.seconds > 0 else "")
    return (f"{result.tensors} tensor(s) over 10 MiB ({result.bytes_total / mib:.1f} MiB): "
            f"{result.cached_already} file(s) already cached, {result.written} written "
            f"({result.bytes_written / mib:.1f} MiB) in {result.seconds:.1f} s{rate}"
            f" -> {result.cache_dir}")


# -- hydra's side: the peer profile's `prefill:` ------------------------------------------------


def resolve_prefill(refs: Sequence[str], node: Node, profile_dir: Path | None,
                    source: str) -> tuple[str, ...]:
    """A peer profile's `prefill:` entries as GGUF paths, resolved as `model:` is
    (models.resolve_model); a miss names the profile file."""
    from hydra_supervisor.config import models

    out = []
    for ref in refs:
        try:
            out.append(str(models.resolve_model(ref, node, profile_dir)))
        except HydraError as exc:
            raise HydraError(f"{source}: prefill: {exc.message}", hint=exc.hint) from exc
    return tuple(out)


def prefill_all(paths: Sequence[str], cache_dir: Path, *,
                note: Callable[[str], None] | None = None,
                stop: threading.Event | None = None,
                every_s: float = 2.0) -> list[PrefillResult]:
    """Prefill each GGUF in turn (run it in a thread); `note(text)` is called with progress at
    most every `every_s` seconds and with each result; a set `stop` ends it between chunks. A
    model that cannot be read or written is logged and skipped: the cache only saves transfer,
    the rpc-server serves without it."""
    results = []
    for path in paths:
        name = Path(path).name
        last = 0.0

        def progress(done: int, total: int, name: str = name) -> None:
            nonlocal last
            if stop is not None and stop.is_set():
                raise _Stopped
            now = time.monotonic()
            if note and total and now - last >= every_s:
                last = now
                note(f"filling its tensor cache from {name}: {100 * done // total}%")

        try:
            res = prefill(Path(path), cache_dir, progress)
        except _Stopped:
            break
        except HydraError as exc:
            log.warning("rpc cache: %s not pre-filled: %s", name, exc)
            continue
        log.info("rpc cache: %s: %s", name, describe(res))
        if note:
            note(f"tensor cache from {name}: {res.cached_already + res.written} file(s) ready")
        results.append(res)
    return results


class _Stopped(Exception):
    pass


def plan_note(plan: Plan) -> str:
    """`hydra plan`'s line for a peer plan with `prefill:` (layout.build adds it)."""
    peer = plan.engines[0]
    cdir = default_cache_dir({**os.environ, **peer.env_dict()})
    names = ", ".join(Path(p).name for p in plan.meta.get(PLAN_KEY, ()))
    return (f"prefill: {names} -> {cdir} (the {peer.name} tensor cache, filled before it "
            "starts: a head with the same GGUF sends hashes, not weights)")
