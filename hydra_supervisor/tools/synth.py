"""Synthetic random-weight GGUF models for tests and benchmarks.

This module owns writing llama-architecture GGUF files (dense and Mixtral-style MoE) of any shape,
with random weights and a real tokenizer copied from one of the tokenizer-only GGUFs that ship in
the pinned llama.cpp source tree (``models/ggml-vocab-<name>.gguf``). The files load in stock
``llama-server`` and generate (gibberish) tokens, so layouts, splits and expert offload can be
exercised at realistic sizes without downloading weights.

Weights are generated and written one chunk of rows at a time, so an 8B-shaped file needs only
a few hundred MB of RAM. Output is deterministic for a given (shape, ftype, vocab, seed).

``write_shape_only`` writes a *planning* model instead: a complete header (hyperparameters and
every tensor's name, shape, quant type and offset, K-quants included) over a sparse hole where
the tensor data would be, so a 20 GB-shaped model costs tens of KB of disk and
``modelinfo.inspect`` reads its real sizes. It has no tokenizer and all-zero weights: it is for
``hydra plan`` tests, not for serving.

CLI: ``hydra synth dense|moe OUT.gguf [--layers N ...]`` (cli.py; it shows a progress bar fed
by the ``progress`` callback: an 8B-shaped file takes minutes).

This module is the models (dense, MoE, shape-only: their checks, types, tokenizer and files);
the GGUF writing helpers they share (the tensor table, the KVs, the header, streamed random
data) are in synth_gguf.py.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from hydra_supervisor.errors import HydraError
from hydra_supervisor.tools.install import source_dir
from hydra_supervisor.tools.synth_gguf import (
    CHUNK_ELEMS,
    add_model_kv,
    plan_tensors,
    write_header,
    write_tensor,
)

ARCH = "llama"
# progress(bytes of tensor data written so far, bytes in all): called after every chunk.
Progress = Callable[[int, int], None]

QT = gguf.GGMLQuantizationType

# Types gguf-py can quantize itself (the K-quants there only dequantize).
FTYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (QT.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (QT.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (QT.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (QT.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q5_1": (QT.Q5_1, gguf.LlamaFileType.MOSTLY_Q5_1),
    "q5_0": (QT.Q5_0, gguf.LlamaFileType.MOSTLY_Q5_0),
    "q4_1": (QT.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (QT.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}

# write_shape_only writes no tensor data, so it also takes the K-quants gguf-py cannot produce.
# Every weight matrix gets the one type (a real Q5_K_M mixes in some Q6_K), norms stay F32.
SHAPE_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    **FTYPES,
    "q2_k": (QT.Q2_K, gguf.LlamaFileType.MOSTLY_Q2_K),
    "q3_k": (QT.Q3_K, gguf.LlamaFileType.MOSTLY_Q3_K_M),
    "q4_k": (QT.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k": (QT.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (QT.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}


def vocab_path(vocab: str) -> Path:
    """The tokenizer-only GGUF for `vocab` ("llama-spm", "llama-bpe", ...) in the pinned source."""
    p = source_dir() / "models" / f"ggml-vocab-{vocab}.gguf"
    if not p.is_file():
        available = sorted(
            q.name[len("ggml-vocab-") : -len(".gguf")]
            for q in p.parent.glob("ggml-vocab-*.gguf")
        )
        raise HydraError(
            f"tokenizer GGUF not found: {p}",
            hint=(
                f"pick one of: {', '.join(available)}"
                if available
                else "fetch the pinned llama.cpp source first (hydra install)"
            ),
        )
    return p


# (key, value, type, subtype)
_TokEntry = tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]


def _read_tokenizer(vocab: str) -> tuple[tuple[_TokEntry, ...], int]:
    """All tokenizer.* KV entries of the vocab file, as (key, value, type, subtype); and n_vocab."""
    p = vocab_path(vocab)
    st = p.stat()
    return _read_tokenizer_file(str(p), st.st_size, st.st_mtime_ns)


# Parsing a vocab file takes about a second (gguf-py builds a view per token); callers writing
# several models in one process (tests, benchmarks) reuse it. Size and mtime key out stale copies.
@functools.lru_cache(maxsize=4)
def _read_tokenizer_file(path: str, size: int, mtime_ns: int) -> tuple[tuple[_TokEntry, ...], int]:
    reader = gguf.GGUFReader(path)
    entries: list[_TokEntry] = []
    n_vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            if len(field.types) != 2:
                raise HydraError(f"{path}: nested array in {key} is not supported")
            sub = field.types[1]
            if not field.data:
                continue  # the writer refuses empty arrays; llama.cpp treats absent == empty
            if sub == gguf.GGUFValueType.STRING:
                # Raw bytes, not str: copies tokens exactly even where they are not valid UTF-8.
                value: tuple[object, ...] = tuple(bytes(field.parts[i]) for i in field.data)
            else:
                value = tuple(field.contents())
            entries.append((key, value, main, sub))
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(field.data)
        elif main == gguf.GGUFValueType.STRING:
            entries.append((key, bytes(field.parts[-1]), main, None))
        else:
            entries.append((key, field.contents(), main, None))
    if n_vocab == 0:
        raise HydraError(f"{path} has no tokenizer.ggml.tokens")
    return tuple(entries), n_vocab


def _check_shape(n_layers: int, n_embd: int, n_head: int, n_head_kv: int, ctx: int) -> None:
    if min(n_layers, n_embd, n_head, n_head_kv, ctx) <= 0:
        raise HydraError("synthetic model: layers, embd, heads, heads-kv and ctx must be > 0")
    if n_embd % n_head:
        raise HydraError(f"synthetic model: embd {n_embd} is not a multiple of heads {n_head}")
    if n_head % n_head_kv:
        raise HydraError(
            f"synthetic model: heads {n_head} is not a multiple of heads-kv {n_head_kv}"
        )
    if (n_embd // n_head) % 2:
        raise HydraError(f"synthetic model: head dim {n_embd // n_head} must be even (RoPE)")


# llama.cpp's own bounds (src/llama-hparams.h of the pinned build): a model past them does not
# load, so writing one only fills a disk.
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
_TENSOR_INFO_RAM = 2048  # bytes of Python objects per tensor while the header is built (generous)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


@dataclass(frozen=True)
class Size:
    """What writing a shape costs, planned before a byte is written (plan_bytes)."""

    data: int  # bytes of tensor data in the file
    chunk: int  # peak memory for the random rows of one chunk and their quantized copy
    table: int  # memory for the tensor table while the header is built

    def ram(self, *, writes_data: bool = True) -> int:
        return self.table + (self.chunk if writes_data else 0)


def plan_bytes(*, n_layers: int, n_embd: int, n_head: int, n_head_kv: int, n_vocab: int,
               qtype: gguf.GGMLQuantizationType, n_ff: int, n_expert: int) -> Size:
    """The bytes a shape needs, by arithmetic: one layer's tensors are planned and multiplied,
    so refusing a shape of 10^8 layers costs nothing."""
    one = plan_tensors(n_layers=1, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                       n_vocab=n_vocab, qtype=qtype, n_ff=n_ff, n_expert=n_expert)
    layer = [t for t in one if t.name.startswith("blk.0.")]
    outside = [t for t in one if not t.name.startswith("blk.0.")]
    widest = max(t.shape[-1] for t in one)  # write_tensor's chunk: at least one whole row
    return Size(data=sum(t.n_bytes for t in outside) + n_layers * sum(t.n_bytes for t in layer),
                chunk=3 * max(CHUNK_ELEMS, widest) * 4,  # float32 rows, temporaries, output
                table=(len(outside) + n_layers * len(layer)) * _TENSOR_INFO_RAM)


def check_fits(size: Size, *, n_layers: int, n_expert: int, out_dir: Path,
               writes_data: bool = True) -> None:
    """Refuse, before a byte is written, a shape llama.cpp cannot load or this host cannot
    write: more layers or experts than llama.cpp takes, more memory than half of what is
    available, more data than the target's filesystem has free (not `writes_data`: a
    shape-only model, whose data is a sparse hole)."""
    import psutil

    what = f"synthetic model of {n_layers:,} layers: {size.data:,} bytes of tensors " \
        f"({_gb(size.data)})"
    if n_layers > MAX_LAYERS:
        raise HydraError(f"{what}; llama.cpp loads at most {MAX_LAYERS} layers "
                         "(LLAMA_MAX_LAYERS)", hint=f"--layers 1 to {MAX_LAYERS}")
    if n_expert > MAX_EXPERTS:
        raise HydraError(f"{what}; llama.cpp loads at most {MAX_EXPERTS} experts "
                         "(LLAMA_MAX_EXPERTS)", hint=f"--experts 1 to {MAX_EXPERTS}")
    ram, avail = size.ram(writes_data=writes_data), psutil.virtual_memory().available
    if ram > avail // 2:
        raise HydraError(f"{what}; writing it needs about {ram:,} bytes of memory "
                         f"({_gb(ram)}), and {_gb(avail)} is available",
                         hint="a narrower shape (--embd, --ff)")
    if writes_data:
        probe = out_dir
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        try:  # writable at all (root passes os.access even on a read-only /proc)
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError as exc:
            raise HydraError(f"cannot write in {probe}: {exc.strerror or exc}",
                             hint="write the model to a directory you can write") from None
        free = shutil.disk_usage(probe).free
        if size.data > free:
            raise HydraError(f"{what}; {probe} has {free:,} bytes free ({_gb(free)})",
                             hint="a smaller shape, or write it where there is room")


def _target(out: Path) -> Path:
    """OUT as a file to create or replace: a directory, FIFO, device or socket there is refused
    (the model is renamed over OUT at the end: over /dev/zero that would replace the device)."""
    try:
        st = os.stat(out)
    except FileNotFoundError:
        return out
    except OSError as exc:
        raise HydraError(f"cannot write {out}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else
                "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else
                "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "not a regular file")
        raise HydraError(f"{out} is {kind}: the model is written as a new file there",
                         hint="give a file name, e.g. model.gguf") from None
    return out


def _write(
    path: str | os.PathLike[str],
    *,
    name: str,
    n_layers: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    ctx: int,
    vocab: str,
    seed: int,
    ftype: str,
    n_expert: int = 0,
    n_expert_used: int = 0,
    progress: Progress | None = None,
) -> Path:
    _check_shape(n_layers, n_embd, n_head, n_head_kv, ctx)
    if n_ff <= 0:
        raise HydraError("synthetic model: ff must be > 0")
    if ftype not in FTYPES:
        raise HydraError(f"synthetic model: unknown ftype {ftype!r}; one of {', '.join(FTYPES)}")
    qtype, file_type = FTYPES[ftype]
    tok_entries, n_vocab = _read_tokenizer(vocab)
    out = _target(Path(path))
    size = plan_bytes(n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      n_vocab=n_vocab, qtype=qtype, n_ff=n_ff, n_expert=n_expert)
    check_fits(size, n_layers=n_layers, n_expert=n_expert, out_dir=out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename at the end: a crash never leaves a truncated model there.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        add_model_kv(
            writer,
            name=name,
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            ctx=ctx,
            n_vocab=n_vocab,
            qtype=qtype,
            file_type=file_type,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
        )
        for key, value, vtype, sub in tok_entries:
            writer.add_key_value(key, value, vtype, sub_type=sub)

        plan = plan_tensors(
            n_layers=n_layers,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_vocab=n_vocab,
            qtype=qtype,
            n_ff=n_ff,
            n_expert=n_expert,
        )
        # Tensor data is streamed here rather than through write_tensor_data, which needs each
        # whole tensor in memory (a stacked expert tensor of a big MoE is several GB).
        fout = write_header(writer, plan)
        total = sum(t.n_bytes for t in plan)
        done = 0

        def advance(n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(done, total)

        for index, t in enumerate(plan):
            write_tensor(fout, t, np.random.default_rng([seed, index]), advance)
            writer.write_padding(fout, t.n_bytes)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out


def write_dense(
    path: str | os.PathLike[str],
    *,
    n_layers: int = 4,
    n_embd: int = 256,
    n_ff: int = 512,
    n_head: int = 4,
    n_head_kv: int = 2,
    ctx: int = 2048,
    vocab: str = "llama-spm",
    seed: int = 0,
    ftype: str = "f16",
    name: str = "hydra-synth-dense",
    progress: Progress | None = None,
) -> Path:
    """Write a dense llama model with random weights to `path`; returns the path."""
    return _write(
        path,
        progress=progress,
        name=name,
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=n_head_kv,
        ctx=ctx,
        vocab=vocab,
        seed=seed,
        ftype=ftype,
    )


def write_moe(
    path: str | os.PathLike[str],
    *,
    n_layers: int = 4,
    n_embd: int = 256,
    n_ff_exp: int = 128,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    ctx: int = 2048,
    vocab: str = "llama-spm",
    seed: int = 0,
    ftype: str = "f16",
    name: str = "hydra-synth-moe",
    progress: Progress | None = None,
) -> Path:
    """Write a Mixtral-style llama MoE (experts stacked in blk.N.ffn_*_exps) to `path`."""
    if n_expert < 1 or not 1 <= n_expert_used <= n_expert:
        raise HydraError(
            f"synthetic MoE: need 1 <= experts-used ({n_expert_used}) <= experts ({n_expert})"
        )
    # Mixtral convention: llama.feed_forward_length is the per-expert FFN width.
    return _write(
        path,
        progress=progress,
        name=name,
        n_layers=n_layers,
        n_embd=n_embd,
        n_ff=n_ff_exp,
        n_head=n_head,
        n_head_kv=n_head_kv,
        ctx=ctx,
        vocab=vocab,
        seed=seed,
        ftype=ftype,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
    )


def write_shape_only(
    path: str | os.PathLike[str],
    *,
    kind: Literal["dense", "moe"],
    n_layers: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int = 0,
    n_ff_exp: int = 0,
    n_expert: int = 0,
    n_expert_used: int = 0,
    ctx: int = 4096,
    weight_type: str = "q5_k",
    vocab_size: int = 32000,
    name: str | None = None,
) -> Path:
    """Write a llama GGUF whose header is complete but whose tensor data is a sparse hole.

    For planning tests only (``hydra plan`` against a model of the real size): the tensor infos
    carry the real names, shapes, quant types and byte sizes, and the file has its full size, but
    the data region is made with truncate, so it costs (almost) no disk and reads as zeros. The
    model will not generate text: its weights are all zero and it has no tokenizer
    (``tokenizer.ggml.model = "none"``, so llama.cpp makes ``vocab_size`` dummy tokens). Stock
    llama-server loads it and answers /health, but aborts on the first token it generates (it
    cannot turn a token into text); nothing in hydra depends on loading it.

    `kind` "dense" takes the FFN width `n_ff`; "moe" takes the per-expert width `n_ff_exp` with
    `n_expert` / `n_expert_used` (experts stacked in ``blk.N.ffn_{gate,up,down}_exps.weight``).
    `weight_type` is a key of SHAPE_TYPES ("q5_k", "q4_k", "q3_k", "f16", ...).
    """
    _check_shape(n_layers, n_embd, n_head, n_head_kv, ctx)
    if kind == "dense":
        if n_ff_exp or n_expert or n_expert_used:
            raise HydraError("shape-only dense model: give n_ff, not n_ff_exp / experts")
        ff = n_ff
    elif kind == "moe":
        if n_ff:
            raise HydraError("shape-only MoE model: give the per-expert width as n_ff_exp")
        if n_expert < 1 or not 1 <= n_expert_used <= n_expert:
            raise HydraError(
                f"shape-only MoE: need 1 <= experts-used ({n_expert_used}) <= experts ({n_expert})"
            )
        ff = n_ff_exp
    else:
        raise HydraError(f"shape-only model: kind must be 'dense' or 'moe', got {kind!r}")
    if ff <= 0:
        raise HydraError("shape-only model: the FFN width must be > 0")
    if vocab_size <= 0:
        raise HydraError("shape-only model: vocab_size must be > 0")
    if weight_type not in SHAPE_TYPES:
        raise HydraError(
            f"shape-only model: unknown weight_type {weight_type!r}; "
            f"one of {', '.join(SHAPE_TYPES)}"
        )
    qtype, file_type = SHAPE_TYPES[weight_type]
    out = _target(Path(path))
    size = plan_bytes(n_layers=n_layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                      n_vocab=vocab_size, qtype=qtype, n_ff=ff,
                      n_expert=n_expert if kind == "moe" else 0)
    check_fits(size, n_layers=n_layers, n_expert=n_expert, out_dir=out.parent,
               writes_data=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(tmp, ARCH)
    try:
        add_model_kv(
            writer,
            name=name or f"hydra-shape-{kind}",
            n_layers=n_layers,
            n_embd=n_embd,
            n_ff=ff,
            n_head=n_head,
            n_head_kv=n_head_kv,
            ctx=ctx,
            n_vocab=vocab_size,
            qtype=qtype,
            file_type=file_type,
            n_expert=n_expert if kind == "moe" else 0,
            n_expert_used=n_expert_used if kind == "moe" else 0,
        )
        # A real tokenizer of a big vocabulary would make the header megabytes (and its parsing
        # seconds); the planner never reads it.
        writer.add_tokenizer_model("none")
        plan = plan_tensors(
            n_layers=n_layers,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_vocab=vocab_size,
            qtype=qtype,
            n_ff=ff,
            n_expert=n_expert if kind == "moe" else 0,
        )
        fout = write_header(writer, plan)
        # The offsets in the tensor infos advance by each tensor's size padded to the alignment;
        # extending the file to the end of the last one leaves a hole that reads as zeros.
        data = sum(writer.ggml_pad(t.n_bytes, writer.data_alignment) for t in plan)
        fout.truncate(fout.tell() + data)
        writer.close()
        os.replace(tmp, out)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return out
