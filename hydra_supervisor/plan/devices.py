"""Device inventory: what memory each named device has, from NVML, nvidia-smi or /proc/meminfo.

The node file names devices (``rtx: {cuda: 0}``); this module attaches live numbers to them.
GPUs the node file does not name appear as ``gpu0``, ``gpu1``, ... Remote peers carry the memory
the node file declares (hydra cannot see another host's GPU). ``$HYDRA_DEVICES_FILE`` (YAML)
replaces the live inventory, for tests and for planning on a machine without the GPUs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from types import ModuleType

import yaml

from hydra_supervisor.config.profile import Node, TlsFiles
from hydra_supervisor.errors import HydraError

MIB = 1024 * 1024


class Kind(Enum):
    CPU = "cpu"
    CUDA = "cuda"
    REMOTE = "remote"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    model: str
    total: int  # bytes
    free: int


@dataclass(frozen=True)
class Device:
    name: str
    kind: Kind
    total: int  # bytes; 0 = unknown
    free: int
    cuda_index: int | None = None
    endpoint: str | None = None
    model: str = ""
    threads: int = 0  # CPU devices: cores to use (ggml-rpc-server defaults to 1 thread)
    reported: bool = False  # remote: total/free as its peer host reported them (Hydra INFO)
    tls: TlsFiles | None = None  # remote: its router takes TLS only (the node file's tls:)

    @property
    def label(self) -> str:
        if self.kind is Kind.CUDA:
            return f"{self.name} (CUDA{self.cuda_index} {self.model})"
        if self.kind is Kind.REMOTE:
            return f"{self.name} (remote {self.endpoint})"
        return f"{self.name} (CPU)"


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[GpuInfo, ...]
    cpu_total: int
    cpu_free: int
    source: str
    cpu_count: int = 0


def _meminfo() -> tuple[int, int]:
    total = free = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "MemTotal":
                total = int(rest.split()[0]) * 1024
            elif key == "MemAvailable":
                free = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return total, free


@contextlib.contextmanager
def nvml_session() -> Iterator[ModuleType | None]:
    """pynvml, initialised for the block (shut down after it), or None where there is no
    NVML (no package, no driver). NVMLError inside the block is the caller's to handle."""
    try:
        import pynvml
    except ImportError:
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def _import_pynvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    mod: ModuleType = pynvml
    return mod


class Nvml:
    """One NVML initialisation held for its owner's life (the daemon): every reading made
    through `session()` uses it, instead of an init and a shutdown of its own (9-10 ms
    together on an H200 host, where the query itself takes 0.01-0.03 ms). Initialised at the
    first reading; NVML that is not there (no package, no driver) is remembered as such.
    NVML's calls are thread-safe: the loop and worker threads share the one initialisation.
    `load`: the pynvml module (tests pass a fake)."""

    def __init__(self, load: Callable[[], ModuleType | None] = _import_pynvml) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._mod: ModuleType | None = None
        self._tried = False

    def _open(self) -> ModuleType | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                mod = self._load()
                if mod is not None:
                    try:
                        mod.nvmlInit()
                    except mod.NVMLError:
                        mod = None
                self._mod = mod
            return self._mod

    @contextlib.contextmanager
    def session(self) -> Iterator[ModuleType | None]:
        """pynvml, initialised (held), or None without NVML; like `nvml_session()` but
        nothing is initialised or shut down per use."""
        yield self._open()

    def close(self) -> None:
        """Shut the held initialisation down (the owner's end); a later reading opens it
        again."""
        with self._lock:
            mod, self._mod, self._tried = self._mod, None, False
        if mod is not None:
            with contextlib.suppress(mod.NVMLError):
                mod.nvmlShutdown()


def _nvml() -> tuple[GpuInfo, ...] | None:
    with nvml_session() as pynvml:
        if pynvml is None:
            return None
        return _nvml_gpus(pynvml)


def _nvml_gpus(pynvml: ModuleType) -> tuple[GpuInfo, ...] | None:
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append(GpuInfo(i, name if isinstance(name, str) else name.decode(),
                                int(mem.total), int(mem.free)))
        return tuple(gpus)
    except pynvml.NVMLError:
        return None


def _nvidia_smi() -> tuple[GpuInfo, ...] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,memory.free",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=15, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = []
    for line in out.strip().splitlines():
        idx, name, total, free = (x.strip() for x in line.split(","))
        gpus.append(GpuInfo(int(idx), name, int(total) * MIB, int(free) * MIB))
    return tuple(gpus)


def _from_file(path: Path) -> Inventory:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise HydraError(f"device inventory {path}: {exc}") from exc
    gpus = tuple(
        GpuInfo(int(g["index"]), str(g.get("name", f"GPU{g['index']}")),
                int(g["total_mib"]) * MIB, int(g.get("free_mib", g["total_mib"])) * MIB)
        for g in data.get("gpus", []))
    cpu = data.get("cpu", {})
    return Inventory(gpus, int(cpu.get("total_mib", 0)) * MIB,
                     int(cpu.get("free_mib", cpu.get("total_mib", 0))) * MIB, str(path),
                     int(cpu.get("threads", 4)))


def inventory() -> Inventory:
    fake = os.environ.get("HYDRA_DEVICES_FILE")
    if fake:
        return _from_file(Path(fake))
    total, free = _meminfo()
    gpus = _nvml()
    source = "NVML"
    if gpus is None:
        gpus = _nvidia_smi()
        source = "nvidia-smi"
    if gpus is None:
        gpus = ()
        source = "CPU only"
    return Inventory(gpus, total, free, source, len(os.sched_getaffinity(0)))


def devices(node: Node, inv: Inventory) -> dict[str, Device]:
    """Named devices: the node file's, plus gpuN for every GPU it leaves unnamed."""
    by_index = {g.index: g for g in inv.gpus}
    out: dict[str, Device] = {}
    named_indexes = set()
    for decl in node.devices.values():
        override = decl.memory_mib * MIB if decl.memory_mib else None
        if decl.cpu:
            out[decl.name] = Device(decl.name, Kind.CPU, override or inv.cpu_total,
                                    override or inv.cpu_free, threads=inv.cpu_count)
        elif decl.endpoint:
            out[decl.name] = Device(decl.name, Kind.REMOTE, override or 0, override or 0,
                                    endpoint=decl.endpoint, tls=decl.tls)
        elif decl.cuda is not None:
            named_indexes.add(decl.cuda)
            gpu = by_index.get(decl.cuda)
            if gpu is None:
                out[decl.name] = Device(decl.name, Kind.CUDA, override or 0, override or 0,
                                        cuda_index=decl.cuda, model="(not present)")
            else:
                out[decl.name] = Device(decl.name, Kind.CUDA, override or gpu.total,
                                        override or gpu.free, cuda_index=gpu.index,
                                        model=gpu.model)
    for gpu in inv.gpus:
        if gpu.index not in named_indexes and f"gpu{gpu.index}" not in out:
            out[f"gpu{gpu.index}"] = Device(f"gpu{gpu.index}", Kind.CUDA, gpu.total, gpu.free,
                                            cuda_index=gpu.index, model=gpu.model)
    return out


def with_reported(devs: Mapping[str, Device], reported: Mapping[str, tuple[int, int]]
                  ) -> dict[str, Device]:
    """Remote devices with the memory their peer host reports (Hydra INFO's `lent`: total and
    free bytes), free bounded by what the node file says the peer lends (`memory_mib`, where
    given) and by the reported total. Others, and remote devices without a report, as they are."""
    out = dict(devs)
    for name, (total, free) in reported.items():
        dev = devs.get(name)
        if dev is None or dev.kind is not Kind.REMOTE or free <= 0:
            continue
        lent = dev.free  # the node file's memory_mib (0: not said)
        free = min(free, lent) if lent > 0 else free
        free = min(free, total) if total > 0 else free
        out[name] = replace(dev, total=total or dev.total, free=free, reported=True)
    return out
