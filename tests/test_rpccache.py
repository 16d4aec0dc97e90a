"""rpccache: FNV-1a 64, the cache dir, prefill; and against a real remote load, that prefill
writes exactly the files ggml-rpc-server -c writes, and that a pre-filled first load is sent
hashes only (bytes counted by a relay between llama-server and ggml-rpc-server)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.testing.rpcrelay import CountingRelay, wait_port
from hydra_supervisor.testing.synthhelp import llama_server_bin, running_server
from hydra_supervisor.tools import rpccache, rpchash, synth
from hydra_supervisor.tools.install import BuildOptions, bin_dir

MiB = 1024 * 1024
# Big enough that every FFN matrix (12288 x 512 F16 = 12 MiB) and both embeddings (32000 x 512
# F16 = 31 MiB) are over the 10 MiB threshold, small enough to load in seconds: 145 MB.
BIG = dict(n_layers=2, n_embd=512, n_ff=12288, n_head=4, n_head_kv=2, ctx=512, seed=3)
TINY = dict(n_layers=2, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, ctx=256)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # The hash memo and the compiled hash live under hydra's cache dir: one per test session.
    own = tmp_path_factory.getbasetemp() / "hydra-rpccache"
    monkeypatch.setattr(rpccache, "own_dir", lambda: own)  # the memo
    monkeypatch.setattr(rpchash, "own_dir", lambda: own)  # the compiled hash


def _vocab_or_skip() -> None:
    try:
        synth.vocab_path("llama-spm")
    except HydraError as err:
        pytest.skip(f"pinned llama.cpp source not fetched: {err}")


# -- pure parts ---------------------------------------------------------------------------------


def test_fnv1a64_vectors_and_chaining() -> None:
    # Published FNV-1a 64 test vectors.
    assert rpchash.fnv1a64(b"") == 0xCBF29CE484222325
    assert rpchash.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert rpchash.fnv1a64(b"foobar") == 0x85944171F73967E8
    data = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8)
    whole = rpchash.fnv1a64(data)
    assert whole == rpchash.fnv1a64_py(data.tobytes())
    assert rpchash.fnv1a64(data[20_000:], rpchash.fnv1a64(data[:20_000])) == whole
    assert rpccache.cache_file_name(0xAB) == "00000000000000ab"


def test_default_cache_dir_follows_rpc_server() -> None:
    assert rpccache.default_cache_dir({"LLAMA_CACHE": "/x", "XDG_CACHE_HOME": "/y",
                                       "HOME": "/h"}) == Path("/x/rpc")
    assert rpccache.default_cache_dir({"LLAMA_CACHE": "", "XDG_CACHE_HOME": "/y",
                                       "HOME": "/h"}) == Path("/y/llama.cpp/rpc")
    assert rpccache.default_cache_dir({"HOME": "/h"}) == Path("/h/.cache/llama.cpp/rpc")


def test_prefill_writes_hash_files_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _vocab_or_skip()
    model = synth.write_dense(tmp_path / "tiny.gguf", **TINY)  # type: ignore[arg-type]
    # Lower the threshold so the tiny model's matrices count (the embeddings are ~4 MiB).
    monkeypatch.setattr(rpccache, "HASH_THRESHOLD", 10_000)
    cdir = tmp_path / "cache"
    seen: list[tuple[int, int]] = []
    res = rpccache.prefill(model, cdir, progress=lambda d, t: seen.append((d, t)))
    plan = rpccache.plan(model)
    assert res.tensors == plan.tensors > 4
    assert res.written == len(plan.unique()) and res.cached_already == 0
    assert res.bytes_written == sum(e.size for e in plan.unique().values())
    assert seen and seen[-1][0] == seen[-1][1]
    raw = model.read_bytes()
    for e in plan.entries:
        assert e.size > 10_000
        body = (cdir / e.file_name).read_bytes()
        assert body == raw[e.offset:e.offset + e.size]
        assert rpchash.fnv1a64(body) == e.hash
    assert sorted(os.listdir(cdir)) == sorted(plan.unique())  # no temp file left behind

    again = rpccache.prefill(model, cdir)
    assert (again.written, again.cached_already, again.bytes_written) == (0, res.written, 0)

    # A short file (a crash mid-write by the server, which writes in place) is replaced.
    victim = cdir / plan.entries[0].file_name
    victim.write_bytes(b"short")
    st = rpccache.status(model, cdir)
    assert st.missing == (victim.name,) and not st.complete
    fixed = rpccache.prefill(model, cdir)
    assert fixed.written == 1 and victim.stat().st_size == plan.entries[0].size
    assert rpccache.status(model, cdir).complete


def test_plan_memo_reads_no_tensor_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _vocab_or_skip()
    model = synth.write_dense(tmp_path / "tiny.gguf", **TINY)  # type: ignore[arg-type]
    monkeypatch.setattr(rpccache, "HASH_THRESHOLD", 10_000)
    first = rpccache.plan(model)

    def boom(*_a: object, **_k: object) -> int:
        raise AssertionError("hashed again although the file did not change")

    monkeypatch.setattr(rpccache, "hash_extent", boom)
    assert rpccache.plan(model) == first
    os.utime(model, ns=(time.time_ns(), time.time_ns() + 10**9))  # a changed file is re-hashed
    with pytest.raises(AssertionError, match="hashed again"):
        rpccache.plan(model)


def test_verify_split_models_room_and_leftovers(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _vocab_or_skip()
    monkeypatch.setattr(rpccache, "HASH_THRESHOLD", 10_000)
    # A split model given by its first shard: every shard's tensors.
    one = synth.write_dense(tmp_path / "m-00001-of-00002.gguf", **TINY)  # type: ignore[arg-type]
    synth.write_dense(tmp_path / "m-00002-of-00002.gguf", seed=9, **TINY)  # type: ignore[arg-type]
    plan = rpccache.plan(one)
    assert {Path(e.file).name for e in plan.entries} == {"m-00001-of-00002.gguf",
                                                         "m-00002-of-00002.gguf"}
    cdir = tmp_path / "c"
    # A temp file a killed prefill left an hour ago goes; a fresh one (a live prefill's) stays.
    cdir.mkdir()
    old, live = cdir / ".hydra-prefill-old", cdir / ".hydra-prefill-live"
    old.write_bytes(b"x")
    live.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    rpccache.prefill(one, cdir)
    assert not old.exists() and live.exists()
    live.unlink()
    # Same size, other bytes: only verify sees it; prefill --verify rewrites it.
    victim = cdir / plan.entries[-1].file_name
    body = bytearray(victim.read_bytes())
    body[0] ^= 0xFF
    victim.write_bytes(bytes(body))
    assert rpccache.status(one, cdir).complete
    assert rpccache.status(one, cdir, verify=True).missing == (victim.name,)
    assert rpccache.prefill(one, cdir).written == 0
    assert rpccache.prefill(one, cdir, verify=True).written == 1
    assert rpccache.status(one, cdir, verify=True).complete
    # Not enough room: said before anything is written.
    monkeypatch.setattr(rpccache.shutil, "disk_usage",
                        lambda _p: types.SimpleNamespace(total=10, used=0, free=10))
    with pytest.raises(HydraError, match="GB free"):
        rpccache.prefill(one, tmp_path / "c2")


def test_prefill_all_skips_a_bad_model_and_stops(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _vocab_or_skip()
    monkeypatch.setattr(rpccache, "HASH_THRESHOLD", 10_000)
    model = synth.write_dense(tmp_path / "tiny.gguf", **TINY)  # type: ignore[arg-type]
    notes: list[str] = []
    out = rpccache.prefill_all([str(tmp_path / "gone.gguf"), str(model)], tmp_path / "c",
                               note=notes.append, every_s=0.0)
    assert len(out) == 1 and out[0].written == 8
    assert any("filling its tensor cache from tiny.gguf" in n for n in notes)
    assert notes[-1] == "tensor cache from tiny.gguf: 8 file(s) ready"
    stop = threading.Event()
    stop.set()
    assert rpccache.prefill_all([str(model)], tmp_path / "c3", stop=stop) == []


def test_missing_model_is_a_hydra_error(tmp_path: Path) -> None:
    with pytest.raises(HydraError, match="not found"):
        rpccache.prefill(tmp_path / "nope.gguf", tmp_path / "c")


# -- against the real binaries ------------------------------------------------------------------


def _rpc_server_bin() -> Path | None:
    p = bin_dir(BuildOptions()) / "ggml-rpc-server"
    return p if p.is_file() else None


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if llama_server_bin() is None or _rpc_server_bin() is None:
        pytest.skip("llama-server / ggml-rpc-server not built (hydra install-llama)")
    _vocab_or_skip()
    return synth.write_dense(tmp_path_factory.mktemp("rpcc") / "big.gguf", **BIG)  # type: ignore[arg-type]


@pytest.fixture
def rpc_server(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A ggml-rpc-server -c whose LLAMA_CACHE is a temp dir: (port, cache dir, log)."""
    binary = _rpc_server_bin()
    assert binary is not None
    llama_cache = tmp_path / "llama-cache"
    port = free_port()
    log = tmp_path / "rpc.log"
    env = {**os.environ, "LLAMA_CACHE": str(llama_cache), "GGML_NO_BACKTRACE": "1"}
    with open(log, "wb") as logf:
        proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-c", "-t", "1"],
                                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env)
    try:
        wait_port(port, proc, log)
        # The server creates its cache dir at start: the one default_cache_dir names.
        assert rpccache.default_cache_dir(env) == llama_cache / "rpc"
        assert (llama_cache / "rpc").is_dir(), sorted(os.listdir(tmp_path))
        yield port, llama_cache / "rpc", log
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def _remote_load(model: Path, rpc_port: int, tmp_path: Path, tag: str) -> int:
    """Load `model` in a CPU llama-server with every layer on the rpc device, through a
    counting relay; answer one completion; return the bytes llama-server sent the peer."""
    binary = llama_server_bin()
    assert binary is not None
    relay = CountingRelay(("127.0.0.1", rpc_port))
    try:
        with running_server(binary, model, tmp_path / f"head-{tag}.log",
                            extra=("--rpc", f"127.0.0.1:{relay.port}", "-ngl", "99")) as srv:
            out = srv.post("/completion", {"prompt": "Hello", "n_predict": 2})
            assert "content" in out
        return relay.up
    finally:
        relay.close()


def _listing(d: Path) -> dict[str, tuple[int, int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(d.iterdir())}


@pytest.mark.slow
def test_prefill_matches_a_real_remote_load(big_model: Path, rpc_server: tuple[int, Path, Path],
                                            tmp_path: Path) -> None:
    port, server_cache, _log = rpc_server
    assert server_cache.is_dir() and not any(server_cache.iterdir())
    sent = _remote_load(big_model, port, tmp_path, "cold")

    plan = rpccache.plan(big_model)
    ours = tmp_path / "prefilled"
    rpccache.prefill(big_model, ours)
    theirs = {p.name: p for p in server_cache.iterdir()}
    mine = {p.name: p for p in ours.iterdir()}
    # The server cached every tensor the head put on it over 10 MiB; the token embedding stays
    # on the head's CPU (llama.cpp keeps the input layer on the host), so only prefill has it.
    by_name = {e.name: e.file_name for e in plan.entries}
    assert set(mine) - set(theirs) == {by_name["token_embd.weight"]}
    assert set(theirs) <= set(mine) and len(theirs) == len(plan.entries) - 1
    for name, path in theirs.items():
        assert path.read_bytes() == mine[name].read_bytes(), name
    # A cold load sends every weight on the peer: at least all the cached tensors' bytes.
    on_peer = sum(e.size for e in plan.entries if e.name != "token_embd.weight")
    print(f"\ncold load: {sent:,} bytes to the peer; {len(theirs)} files written by the server, "
          f"{on_peer:,} bytes; prefill wrote {len(mine)}: the same + token_embd.weight")
    assert sent > on_peer


@pytest.mark.slow
def test_prefilled_first_load_sends_hashes_only(big_model: Path,
                                                rpc_server: tuple[int, Path, Path],
                                                tmp_path: Path) -> None:
    port, server_cache, _log = rpc_server
    res = rpccache.prefill(big_model, server_cache)
    assert res.written == res.tensors == 8 and res.bytes_written > 100 * MiB
    before = _listing(server_cache)
    sent = _remote_load(big_model, port, tmp_path, "prefilled")
    assert _listing(server_cache) == before  # nothing written: every lookup was a hit
    plan = rpccache.plan(big_model)
    small = sum(n for _name, _f, _o, n in rpccache.tensor_extents(big_model)
                if n <= rpccache.HASH_THRESHOLD)
    # What crosses is the tensors under the threshold plus graphs and activations (~100 KB
    # here); every big tensor is a 56-byte hash request.
    print(f"\npre-filled first load: {sent:,} bytes to the peer (tensors <= 10 MiB: {small:,}; "
          f"model {big_model.stat().st_size:,}); prefill {res.bytes_written:,} bytes in "
          f"{res.seconds:.2f} s")
    assert sent < small + 4 * MiB, (sent, small, plan.bytes)
    assert sent < plan.bytes / 20


@pytest.mark.slow
def test_hydra_peer_profile_prefills_its_rpc_server(big_model: Path, tmp_path: Path) -> None:
    """`prefill:` in a mode: peer profile: hydra fills the cache dir its ggml-rpc-server uses
    (LLAMA_CACHE from the profile's env) before starting it, and a head loading the same GGUF
    through hydra's router sends hashes only."""
    from hydra_supervisor.testing.harness import Up, make_env

    env = make_env(tmp_path)
    llama_cache = tmp_path / "llama-cache"
    prof = tmp_path / "lend.yaml"
    prof.write_text(f"mode: peer\nhead: cpu-peer\nenv: {{LLAMA_CACHE: '{llama_cache}'}}\n"
                    f"prefill: ['{big_model}']\n")
    port = free_port()
    up = Up(env, ["--profile", str(prof), "--port", str(port)], tmp_path)
    try:
        up.wait_ready()
        cdir = llama_cache / "rpc"
        plan = rpccache.plan(big_model)
        assert sorted(os.listdir(cdir)) == sorted(plan.unique()), up.output()
        before = _listing(cdir)
        sent = _remote_load(big_model, port, tmp_path, "via-hydra")
        assert _listing(cdir) == before
        small = sum(n for _name, _f, _o, n in rpccache.tensor_extents(big_model)
                    if n <= rpccache.HASH_THRESHOLD)
        print(f"\nthrough hydra's router, pre-filled by hydra: {sent:,} bytes to the peer")
        assert sent < small + 4 * MiB
        assert "tensor cache" in up.output() + "".join(
            p.read_text(errors="replace") for p in (tmp_path / "state").rglob("*.log"))
    finally:
        up.stop()
        up.kill_everything()


def test_prefill_key_is_checked(tmp_path: Path) -> None:
    from hydra_supervisor.config import config
    from hydra_supervisor.errors import ConfigError

    node = config.load_node(None)
    solo = tmp_path / "solo.yaml"
    solo.write_text("model: gemma3-270m\nprefill: [x.gguf]\n")
    with pytest.raises(ConfigError, match=r"solo\.yaml:2.*prefill.*only with mode: peer"):
        config.load_profile(solo, node)
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: peer\nhead: cpu-peer\nprefill: {a: 1}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3.*prefill.*list"):
        config.load_profile(bad, node)
    ok = tmp_path / "ok.yaml"
    ok.write_text("mode: peer\nhead: cpu-peer\nprefill: one.gguf\n")
    assert config.load_profile(ok, node).prefill == ("one.gguf",)


def test_layout_resolves_prefill_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hydra_supervisor.plan import layout

    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    node = tmp_path / "node.yaml"
    node.write_text("rpc_ports: [41000, 41007]\ninternal_ports: [41008, 41015]\n")
    prof = tmp_path / "lend.yaml"
    prof.write_text("mode: peer\nhead: cpu-peer\nprefill: [m.gguf]\n")
    lay = layout.build(str(prof), node_file=str(node), check_ports=False)
    assert lay.plan.meta[rpccache.PLAN_KEY] == (str(tmp_path / "m.gguf"),)
    assert any(n.startswith("prefill: m.gguf -> ") for n in lay.plan.notes)
    prof.write_text("mode: peer\nhead: cpu-peer\nprefill: [missing.gguf]\n")
    with pytest.raises(HydraError, match=r"lend\.yaml: prefill: model file not found"):
        layout.build(str(prof), node_file=str(node), check_ports=False)


def test_cache_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hydra_supervisor.cli.cli import main

    _vocab_or_skip()
    model = synth.write_dense(tmp_path / "tiny.gguf", **TINY)  # type: ignore[arg-type]
    monkeypatch.setattr(rpccache, "HASH_THRESHOLD", 10_000)
    (tmp_path / "node.yaml").write_text("rpc_ports: [41000, 41007]\n")
    monkeypatch.setenv("HYDRA_NODE", str(tmp_path / "node.yaml"))
    cdir = tmp_path / "c"
    run = CliRunner().invoke
    res = run(main, ["cache", "status", str(model), "--dir", str(cdir)])
    assert res.exit_code == 1 and "0/8 file(s) cached" in res.output, res.output
    res = run(main, ["cache", "prefill", str(model), "--dir", str(cdir)])
    assert res.exit_code == 0 and "8 written" in res.output, res.output
    res = run(main, ["cache", "status", str(model), "--dir", str(cdir), "--json"])
    assert res.exit_code == 0 and json.loads(res.output)[0]["complete"] is True
    # --profile: the peer profile's env picks the dir, its prefill: list the models.
    prof = tmp_path / "lend.yaml"
    prof.write_text(f"mode: peer\nhead: cpu-peer\nenv: {{LLAMA_CACHE: '{tmp_path / 'lc'}'}}\n"
                    f"prefill: [tiny.gguf]\n")
    res = run(main, ["cache", "prefill", "--profile", str(prof)])
    assert res.exit_code == 0 and str(tmp_path / "lc" / "rpc") in res.output, res.output
    res = run(main, ["cache", "status", "nope.gguf"])
    assert res.exit_code == 2 and "model file not found" in res.output


def test_peer_load_budget_covers_the_prefill(tmp_path: Path) -> None:
    from hydra_supervisor.plan import deployment
    from hydra_supervisor.testing.harness import free_port_range

    if _rpc_server_bin() is None:
        pytest.skip("ggml-rpc-server not built (hydra install-llama)")
    with open(tmp_path / "m.gguf", "wb") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB of budget, no disk
    lo, hi = free_port_range(16)
    node = tmp_path / "node.yaml"
    node.write_text(f"rpc_ports: [{lo}, {lo + 7}]\ninternal_ports: [{lo + 8}, {hi}]\n")
    prof = tmp_path / "lend.yaml"
    prof.write_text("mode: peer\nhead: cpu-peer\nprefill: [m.gguf]\n")
    dep = deployment.prepare(str(prof), node_file=str(node))
    assert dep.timeouts.load == pytest.approx(60.0 + 15.0 * 2)
    prof.write_text("mode: peer\nhead: cpu-peer\n")
    assert deployment.prepare(str(prof), node_file=str(node)).timeouts.load == 60.0
