"""The GGUF writing helpers of the synthetic models (synth.py): the tensor table of a llama
shape, dense or Mixtral-style MoE (`plan_tensors`), its hyperparameter KVs, the header, and random
tensor data streamed one chunk of rows at a time (so peak RAM stays ~100 MB whatever the size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import gguf
import numpy as np

WEIGHT_STD = 0.02
# Elements generated per chunk: bounds peak RAM (float32 source + quantized copy) to ~100 MB.
CHUNK_ELEMS = 8 * 1024 * 1024

QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class _TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order (rows last dim = ggml ne0)
    qtype: gguf.GGMLQuantizationType
    ones: bool  # norm weights are 1.0 so activations keep their scale

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


def _weight_type(qtype: gguf.GGMLQuantizationType, row: int) -> gguf.GGMLQuantizationType:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    # A row that is not a whole number of blocks cannot be quantized (convert_hf_to_gguf agrees).
    return qtype if row % block == 0 else QT.F16


def plan_tensors(
    *,
    n_layers: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_vocab: int,
    qtype: gguf.GGMLQuantizationType,
    n_ff: int,
    n_expert: int,
) -> list[_TensorPlan]:
    head_dim = n_embd // n_head
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim

    def w(name: str, *shape: int) -> _TensorPlan:
        return _TensorPlan(name, shape, _weight_type(qtype, shape[-1]), ones=False)

    def norm(name: str) -> _TensorPlan:
        return _TensorPlan(name, (n_embd,), QT.F32, ones=True)

    plan = [w("token_embd.weight", n_vocab, n_embd)]
    for i in range(n_layers):
        b = f"blk.{i}"
        plan += [
            norm(f"{b}.attn_norm.weight"),
            w(f"{b}.attn_q.weight", q_dim, n_embd),
            w(f"{b}.attn_k.weight", kv_dim, n_embd),
            w(f"{b}.attn_v.weight", kv_dim, n_embd),
            w(f"{b}.attn_output.weight", n_embd, q_dim),
            norm(f"{b}.ffn_norm.weight"),
        ]
        if n_expert == 0:
            plan += [
                w(f"{b}.ffn_gate.weight", n_ff, n_embd),
                w(f"{b}.ffn_up.weight", n_ff, n_embd),
                w(f"{b}.ffn_down.weight", n_embd, n_ff),
            ]
        else:
            plan += [
                # The router stays F32 as llama-quantize leaves it: tiny, and precision-sensitive.
                _TensorPlan(f"{b}.ffn_gate_inp.weight", (n_expert, n_embd), QT.F32, ones=False),
                w(f"{b}.ffn_gate_exps.weight", n_expert, n_ff, n_embd),
                w(f"{b}.ffn_up_exps.weight", n_expert, n_ff, n_embd),
                w(f"{b}.ffn_down_exps.weight", n_expert, n_embd, n_ff),
            ]
    plan += [norm("output_norm.weight"), w("output.weight", n_vocab, n_embd)]
    return plan


def add_model_kv(
    writer: gguf.GGUFWriter,
    *,
    name: str,
    n_layers: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    ctx: int,
    n_vocab: int,
    qtype: gguf.GGMLQuantizationType,
    file_type: gguf.LlamaFileType,
    n_expert: int,
    n_expert_used: int,
) -> None:
    """The llama-architecture hyperparameter KVs (everything but the tokenizer)."""
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(n_layers)
    writer.add_context_length(ctx)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    # Required by llama.cpp's llama loader (no default); the rest below are for clarity.
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(n_vocab)
    if n_expert:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
    writer.add_file_type(int(file_type))
    if qtype not in (QT.F32, QT.F16, QT.BF16):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def write_header(writer: gguf.GGUFWriter, plan: Sequence[_TensorPlan]) -> BinaryIO:
    """KV data and tensor infos; returns the file, positioned where tensor data starts."""
    for t in plan:
        # raw_dtype given and a non-uint8 dtype: the writer takes `shape` as element shape.
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None and len(writer.fout) == 1
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    return fout


def write_tensor(fout: BinaryIO, t: _TensorPlan, rng: np.random.Generator,
                  advance: Callable[[int], None]) -> None:
    cols = t.shape[-1]
    rows = math.prod(t.shape[:-1])
    chunk_rows = max(1, CHUNK_ELEMS // cols)
    written = 0
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        if t.ones:
            data = np.ones((n, cols), dtype=np.float32)
        else:
            data = rng.standard_normal((n, cols), dtype=np.float32)
            data *= WEIGHT_STD
        # Quantization works row by row, so quantizing a slab of rows equals quantizing the whole.
        out = gguf.quants.quantize(data, t.qtype)
        fout.write(out.tobytes())
        written += out.nbytes
        advance(out.nbytes)
    if written != t.n_bytes:  # a bug here would make every later tensor offset wrong
        raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.n_bytes}")
