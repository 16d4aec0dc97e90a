"""Synthetic GGUF generator: structure, determinism, CLI, and loading in the real llama-server."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import gguf
import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.testing.synthhelp import llama_server_bin, log_tail, running_server
from hydra_supervisor.tools import synth

# Tiny shapes: the 2-core test machine is shared; the 32000-token vocab dominates the size anyway.
TINY = dict(n_layers=2, n_embd=64, n_head=2, n_head_kv=1)


@pytest.fixture(scope="module", autouse=True)
def _need_vocab() -> None:
    try:
        synth.vocab_path("llama-spm")
    except HydraError as err:
        pytest.skip(f"pinned llama.cpp source not fetched: {err}")


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_dense_structure_and_tokenizer(tmp_path: Path) -> None:
    out = synth.write_dense(tmp_path / "d.gguf", n_ff=128, ctx=1024, **TINY)
    r = gguf.GGUFReader(out)
    vocab = gguf.GGUFReader(synth.vocab_path("llama-spm"))

    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["llama.context_length"].contents() == 1024
    assert r.fields["llama.attention.head_count_kv"].contents() == 1
    vocab_keys = {k for k in vocab.fields if k.startswith("tokenizer.")}
    assert vocab_keys <= set(r.fields)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.scores"):
        assert r.fields[key].contents() == vocab.fields[key].contents()
    tokens = vocab.fields["tokenizer.ggml.tokens"].contents()
    assert r.fields["tokenizer.ggml.tokens"].contents() == tokens
    n_vocab = len(tokens)

    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes["token_embd.weight"] == (64, n_vocab)  # ggml order: ne0 first
    assert shapes["output.weight"] == (64, n_vocab)
    assert shapes["blk.1.attn_q.weight"] == (64, 64)
    assert shapes["blk.1.attn_k.weight"] == (64, 32)  # 1 kv head of 32
    assert shapes["blk.1.ffn_gate.weight"] == (64, 128)
    assert shapes["blk.1.ffn_down.weight"] == (128, 64)
    assert not any("exps" in n for n in shapes)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16


def test_moe_structure_q8(tmp_path: Path) -> None:
    out = synth.write_moe(
        tmp_path / "m.gguf", n_ff_exp=32, n_expert=4, n_expert_used=2, ftype="q8_0", **TINY
    )
    r = gguf.GGUFReader(out)
    assert r.fields["llama.expert_count"].contents() == 4
    assert r.fields["llama.expert_used_count"].contents() == 2
    t = {t.name: t for t in r.tensors}
    for i in range(2):
        assert tuple(int(x) for x in t[f"blk.{i}.ffn_gate_inp.weight"].shape) == (64, 4)
        assert tuple(int(x) for x in t[f"blk.{i}.ffn_gate_exps.weight"].shape) == (64, 32, 4)
        assert tuple(int(x) for x in t[f"blk.{i}.ffn_up_exps.weight"].shape) == (64, 32, 4)
        assert tuple(int(x) for x in t[f"blk.{i}.ffn_down_exps.weight"].shape) == (32, 64, 4)
        assert t[f"blk.{i}.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
        assert f"blk.{i}.ffn_gate.weight" not in t


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    a = synth.write_dense(tmp_path / "a.gguf", n_ff=64, seed=7, **TINY)
    b = synth.write_dense(tmp_path / "b.gguf", n_ff=64, seed=7, **TINY)
    c = synth.write_dense(tmp_path / "c.gguf", n_ff=64, seed=8, **TINY)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    assert not list(tmp_path.glob(".*.partial"))  # temp files renamed away


def test_bad_parameters_raise() -> None:
    with pytest.raises(HydraError, match="multiple of heads"):
        synth.write_dense("/nonexistent/x.gguf", n_embd=65, n_head=2)
    with pytest.raises(HydraError, match="experts-used"):
        synth.write_moe("/nonexistent/x.gguf", n_expert=2, n_expert_used=3)
    with pytest.raises(HydraError, match="unknown ftype"):
        synth.write_dense("/nonexistent/x.gguf", ftype="q4_k")
    with pytest.raises(HydraError, match="ggml-vocab-nope.gguf"):
        synth.write_dense("/nonexistent/x.gguf", vocab="nope")


def test_cli(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from hydra_supervisor.cli.cli import main

    out = tmp_path / "cli.gguf"
    res = CliRunner().invoke(main, [
        "synth", "moe", str(out), "--layers", "1", "--embd", "64", "--ff", "32", "--experts", "2",
        "--experts-used", "1", "--heads", "2", "--heads-kv", "2", "--ftype", "q8_0", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert str(out) in res.stdout
    r = gguf.GGUFReader(out)
    assert r.fields["llama.expert_count"].contents() == 2
    bad = CliRunner().invoke(main, ["synth", "dense", str(tmp_path / "bad.gguf"), "--embd", "65"])
    assert bad.exit_code == 2
    assert "multiple of heads" in bad.stderr


# --- real llama-server -------------------------------------------------------------------------


def _server_bin() -> Path:
    b = llama_server_bin()
    if b is None:
        pytest.skip("pinned llama-server not built (run `hydra install`)")
    return b


def _assert_generates(server_completion: dict[str, object]) -> None:
    assert server_completion.get("tokens_predicted") == 8, server_completion


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["f16", "q8_0"])
def test_dense_loads_and_generates(tmp_path: Path, ftype: str) -> None:
    binary = _server_bin()
    model = synth.write_dense(tmp_path / f"dense-{ftype}.gguf", ftype=ftype)
    with running_server(binary, model, tmp_path / "server.log") as srv:
        # ignore_eos: random weights may sample EOS at once; we want exactly 8 tokens back.
        done = srv.post(
            "/completion",
            {"prompt": "Hello world", "n_predict": 8, "temperature": 0, "ignore_eos": True},
        )
        _assert_generates(done)
        chat = srv.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
             "temperature": 0, "ignore_eos": True},
        )  # fmt: skip
        assert chat["usage"]["completion_tokens"] == 8, chat


@pytest.mark.slow
def test_moe_loads_with_experts_overridden(tmp_path: Path) -> None:
    binary = _server_bin()
    n_layers = 4
    model = synth.write_moe(tmp_path / "moe.gguf", n_layers=n_layers, ftype="q8_0")
    log = tmp_path / "server.log"
    # -v: the per-tensor "buffer type overridden" lines are debug-level.
    extra = ["-v", "-ot", r"blk\.[0-9]+\.ffn_.*_exps\.weight=CPU"]
    with running_server(binary, model, log, extra) as srv:
        done = srv.post(
            "/completion",
            {"prompt": "Hello world", "n_predict": 8, "temperature": 0, "ignore_eos": True},
        )
        _assert_generates(done)
    text = log.read_text(errors="replace")
    overridden = set(
        re.findall(r"tensor (blk\.\d+\.ffn_(?:gate|up|down)_exps\.weight) .*overridden to CPU",
                   text)
    )
    expected = {
        f"blk.{i}.ffn_{p}_exps.weight" for i in range(n_layers) for p in ("gate", "up", "down")
    }
    assert overridden == expected, log_tail(log)
    assert "n_expert              = 8" in text
    assert not re.search(r"^\S+ E ", text, re.M), log_tail(log)
