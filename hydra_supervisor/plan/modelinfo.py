"""Model inspection: what the resolver needs to know about a GGUF file, read with gguf-py.

This module owns turning a GGUF file into a ModelInfo (architecture, block and expert counts,
attention shape, and every tensor's name, layer, shape, type and byte size) and caching that
result. A split model (``name-00001-of-00003.gguf``, as llama.cpp's gguf-split writes it) is
inspected as one model when given its first shard.

gguf-py's reader builds a numpy view per element of every metadata array: for Gemma 3's
262,144-token vocabulary (three such arrays) that took 9 s of CPU and 720 MB of RSS, and the
process kept ~60 MB of it after the reader was gone (glibc keeps freed heap). ``_HeaderReader``
(the same reader) takes a numeric array as one view and steps over a long string array without
viewing its strings (hydra reads none): 0.1 s, no peak. Results are still cached as JSON under
``cache_dir()/modelinfo``, one entry per real path, valid while the file's identity (real path,
size, mtime_ns, inode of every shard) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import numpy.typing as npt

from hydra_supervisor.config.paths import cache_dir
from hydra_supervisor.errors import HydraError

# Bump when ModelInfo's fields or their meaning change: older cache entries are then ignored.
_CACHE_VERSION = 1
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
_EXPERT_RE = re.compile(r"_exps\.")
_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-00001-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    n_bytes: int
    layer: int | None  # N for blk.N.*, else None
    shape: tuple[int, ...]  # ggml order (ne0 first), as llama.cpp prints it
    ggml_type: str  # GGMLQuantizationType name: "F16", "Q4_K", ...

    @property
    def is_expert(self) -> bool:
        """Routed-expert tensor (experts stacked: blk.N.ffn_{gate,up,down}_exps.*)."""
        return bool(_EXPERT_RE.search(self.name))


@dataclass(frozen=True)
class ModelInfo:
    path: str  # real path of the file (the first shard of a split model)
    file_size: int  # bytes on disk, all shards together
    arch: str  # general.architecture
    name: str  # general.name or file stem
    block_count: int
    context_length: int  # training context; 0 when the file does not say
    n_embd: int
    n_head: int  # max over layers where the file stores a per-layer array
    n_head_kv: int  # likewise
    expert_count: int  # 0 when dense
    expert_used_count: int
    tensors: tuple[TensorInfo, ...]
    head_dim_k: int = 0  # {arch}.attention.key_length, else n_embd / n_head
    head_dim_v: int = 0  # {arch}.attention.value_length, else head_dim_k

    @property
    def is_moe(self) -> bool:
        return self.expert_count > 0

    def layer_bytes(self) -> list[int]:
        """Bytes per block index 0..block_count-1 (blk.N tensors past block_count are excluded)."""
        out = [0] * self.block_count
        for t in self.tensors:
            if t.layer is not None and t.layer < self.block_count:
                out[t.layer] += t.n_bytes
        return out

    def expert_bytes_per_layer(self) -> list[int]:
        """Bytes of the routed-expert (*_exps) tensors per block index."""
        out = [0] * self.block_count
        for t in self.tensors:
            if t.layer is not None and t.layer < self.block_count and t.is_expert:
                out[t.layer] += t.n_bytes
        return out

    def non_layer_bytes(self) -> int:
        """Bytes outside blocks 0..block_count-1: token_embd, output, output_norm, ..."""
        return self.tensor_bytes() - sum(self.layer_bytes())

    def output_bytes(self) -> int:
        """What the output layer puts on its device: everything outside the blocks but the
        input embedding, which llama.cpp always keeps on the CPU; with tied embeddings (no
        output.weight) the output layer uses token_embd, so its bytes count here instead."""
        names = {t.name for t in self.tensors}
        embd = sum(t.n_bytes for t in self.tensors if t.name == "token_embd.weight")
        tied = "output.weight" not in names
        return self.non_layer_bytes() - embd + (embd if tied else 0)

    def tensor_bytes(self) -> int:
        """All tensor data, in bytes (layer_bytes() + non_layer_bytes())."""
        return sum(t.n_bytes for t in self.tensors)

    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def kv_bytes_per_token(self, type_bytes: float = 2.0) -> int:
        """K+V cache bytes per token over all layers (type_bytes 2.0 = f16 cache).

        An upper bound for models with sliding-window or attention-free layers.
        """
        head_k = self.head_dim_k or (self.n_embd // self.n_head if self.n_head else 0)
        head_v = self.head_dim_v or head_k
        return int(self.n_head_kv * (head_k + head_v) * self.block_count * type_bytes)


def _cache_root() -> Path:
    return cache_dir() / "modelinfo"


def _shards(real: str) -> list[str]:
    """The files of the model: every shard of a split model given its first, else just it."""
    m = _SPLIT_RE.match(real)
    if not m:
        return [real]
    count = int(m.group("count"))
    return [f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


_Identity = dict[str, list[list[str | int]]]  # the shards' path, size, mtime, inode


def _identity(files: list[str]) -> _Identity:
    idents: list[list[str | int]] = []
    for f in files:
        try:
            st = os.stat(f)
        except FileNotFoundError as err:
            raise HydraError(f"model shard not found: {f}") from err
        idents.append([f, st.st_size, st.st_mtime_ns, st.st_ino])
    return {"files": idents}


def _cache_file(real: str) -> Path:
    # One entry per real path: a changed file overwrites its entry instead of piling up new ones.
    return _cache_root() / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".json")


def _to_json(info: ModelInfo) -> dict[str, object]:
    return asdict(info)


def _from_json(d: dict[str, Any]) -> ModelInfo:  # a cache entry: any mistake is a miss
    tensors = tuple(
        TensorInfo(
            name=t["name"],
            n_bytes=int(t["n_bytes"]),
            layer=t["layer"],
            shape=tuple(t["shape"]),
            ggml_type=t["ggml_type"],
        )
        for t in d["tensors"]
    )
    return ModelInfo(**{**d, "tensors": tensors})


def _load_cached(real: str, ident: _Identity) -> ModelInfo | None:
    f = _cache_file(real)
    try:
        entry = json.loads(f.read_text())
        if entry.get("version") != _CACHE_VERSION or entry.get("identity") != ident:
            return None
        return _from_json(entry["info"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        # A corrupt or foreign entry is only a cache miss; it is overwritten below.
        return None


def _store_cached(real: str, ident: _Identity, info: ModelInfo) -> None:
    f = _cache_file(real)
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(
            json.dumps({"version": _CACHE_VERSION, "identity": ident, "info": _to_json(info)})
        )
        os.replace(tmp, f)
    except OSError:
        # The cache is an optimisation: a read-only or full cache dir must not fail inspection.
        tmp.unlink(missing_ok=True)


def _field(reader: gguf.GGUFReader, key: str) -> object:
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _int(reader: gguf.GGUFReader, key: str) -> int:
    """An integer key, 0 when absent; per-layer arrays (head_count_kv in some archs) give max."""
    v = _field(reader, key)
    if v is None:
        return 0
    if isinstance(v, list):
        return int(max(v)) if v else 0
    return int(cast("int | float | str", v))  # a number (anything else raises here)


# A string array longer than this is stepped over, not viewed (hydra reads no such array: they
# are the tokenizer's vocabulary and merges).
_SKIP_STRINGS_OVER = 1024


class _HeaderReader(gguf.GGUFReader):
    """gguf-py's reader, with arrays read cheaply: a numeric array as one numpy view (gguf-py
    makes one per element), a long string array stepped over (its ``contents()`` is empty).
    Every offset, field and tensor comes out as gguf-py's own reader gives them."""

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[npt.NDArray[np.generic]], list[int],
                                    list[gguf.GGUFValueType]]:
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        n = int(alen[0])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, n)
            if len(values) != n:
                raise ValueError(f"array of {n} values runs past the end of the file")
            return (12 + int(values.nbytes), [raw_itype, alen, values], [2],
                    [gguf.GGUFValueType.ARRAY, itype])
        if itype == gguf.GGUFValueType.STRING and n > _SKIP_STRINGS_OVER:
            little = (sys.byteorder == "little") != (self.byte_order == "S")
            fmt = "<Q" if little else ">Q"
            buf = memoryview(self.data)  # type: ignore[arg-type]
            unpack = struct.Struct(fmt).unpack_from
            try:
                for _ in range(n):
                    offs += 8 + unpack(buf, offs)[0]
            except struct.error as e:
                raise ValueError(f"array of {n} strings runs past the end of the file") from e
            if offs > len(buf):
                raise ValueError(f"array of {n} strings runs past the end of the file")
            return offs - orig_offs, [raw_itype, alen], [], [gguf.GGUFValueType.ARRAY, itype]
        return super()._get_field_parts(orig_offs, raw_type)


class _ExtentReader(_HeaderReader):
    """Reads the header and tensor infos only and records where the tensor data should end,
    without viewing the data (which is what fails on a truncated file)."""

    data_end = 0

    def _build_tensors(self, start_offs: int, fields: list[gguf.ReaderField]) -> None:
        for fld in fields:
            _name_len, _name, _n_dims, dims, raw_dtype, offset = fld.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
            n_bytes = int(np.prod(dims)) * type_size // block
            self.data_end = max(self.data_end, start_offs + int(offset[0]) + n_bytes)
        self.tensors = []


def _damaged(path: str, err: Exception) -> HydraError:
    """A GGUF that gguf-py cannot read: say truncated or corrupt, with the sizes that show it."""
    size = os.path.getsize(path)
    try:
        need = _ExtentReader(path).data_end
    except (ValueError, IndexError, KeyError, TypeError, OSError):
        need = 0  # the header itself is cut short or damaged
    if need > size:
        why = (f"the file is {size:,} bytes but its header says the tensor data runs to "
               f"{need:,} bytes ({need - size:,} missing)")
    elif need:
        why = (f"the file is {size:,} bytes, as its header says, but a tensor is malformed "
               f"(gguf: {err})")
    else:
        why = f"the file is {size:,} bytes and its header is cut short or damaged (gguf: {err})"
    return HydraError(f"truncated or corrupt GGUF: {path}: {why}",
                      hint="download or copy the model again (an interrupted copy is the usual "
                           "cause); compare its size and checksum with the source")


def _open(path: str) -> gguf.GGUFReader:
    try:
        return _HeaderReader(path)
    except (ValueError, IndexError, KeyError, OSError) as err:
        # gguf-py raises ValueError/IndexError ("index 0 is out of bounds", "cannot reshape")
        # on a truncated or malformed file; that message alone says nothing to an operator.
        raise _damaged(path, err) from err


def _read_gguf(files: list[str], file_size: int) -> ModelInfo:
    real = files[0]
    reader = _open(real)

    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise HydraError(f"GGUF model {real} has no general.architecture")
    name = _field(reader, "general.name")
    n_embd = _int(reader, f"{arch}.embedding_length")
    n_head = _int(reader, f"{arch}.attention.head_count")
    head_dim_k = _int(reader, f"{arch}.attention.key_length") or (
        n_embd // n_head if n_head else 0
    )
    head_dim_v = _int(reader, f"{arch}.attention.value_length") or head_dim_k

    # Shards past the first hold only tensors (and split.* keys); their headers are small.
    readers = [reader] + [_open(f) for f in files[1:]]
    tensors = []
    for t in (t for r in readers for t in r.tensors):
        m = _LAYER_RE.match(t.name)
        tensors.append(
            TensorInfo(
                name=t.name,
                n_bytes=int(t.n_bytes),
                layer=int(m.group(1)) if m else None,
                shape=tuple(int(x) for x in t.shape),
                ggml_type=t.tensor_type.name,
            )
        )
    return ModelInfo(
        path=real,
        file_size=file_size,
        arch=arch,
        name=name if isinstance(name, str) and name else Path(real).stem,
        block_count=_int(reader, f"{arch}.block_count"),
        context_length=_int(reader, f"{arch}.context_length"),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=_int(reader, f"{arch}.attention.head_count_kv") or n_head,
        expert_count=_int(reader, f"{arch}.expert_count"),
        expert_used_count=_int(reader, f"{arch}.expert_used_count"),
        tensors=tuple(tensors),
        head_dim_k=head_dim_k,
        head_dim_v=head_dim_v,
    )


def inspect(path: str | os.PathLike[str], *, use_cache: bool = True) -> ModelInfo:
    """Read (or fetch from cache) the ModelInfo of the GGUF file at `path`.

    Raises HydraError naming the path when the file is missing, is not GGUF, or is malformed.
    """
    real = os.path.realpath(path)
    if not os.path.exists(real):
        raise HydraError(f"model file not found: {path}")
    if os.path.isdir(real):
        raise HydraError(f"model path is a directory, not a GGUF file: {path}",
                         hint="name the .gguf file inside it")
    if not os.path.isfile(real):
        raise HydraError(f"model path is not a regular file: {path}")
    try:
        with open(real, "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise HydraError(f"cannot read model file {path}: {err}") from err
    if magic != b"GGUF":
        raise HydraError(
            f"not a GGUF file: {path} (starts with {magic!r})",
            hint="point the profile at a .gguf model file",
        )

    files = _shards(real)
    ident = _identity(files)
    if use_cache:
        cached = _load_cached(real, ident)
        if cached is not None:
            return cached
    info = _read_gguf(files, sum(cast(int, size) for _, size, _, _ in ident["files"]))
    if use_cache:
        _store_cached(real, ident, info)
    return info
