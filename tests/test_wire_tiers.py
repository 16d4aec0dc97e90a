"""The CONFIGURE key table and the pure tier diff."""

from __future__ import annotations

import pytest

from hydra_supervisor.config.config import Mode, Profile
from hydra_supervisor.wire import tier_diff, tiers
from hydra_supervisor.wire.tier_diff import classify
from hydra_supervisor.wire.tiers import KEYS, Target, Tier, lookup

EXPECTED = {
    # key (any spelling) -> (canonical, tier)
    "temperature": ("temperature", Tier.T1), "temp": ("temperature", Tier.T1),
    "top_p": ("top_p", Tier.T1), "top_k": ("top_k", Tier.T1), "min_p": ("min_p", Tier.T1),
    "repeat_penalty": ("repeat_penalty", Tier.T1), "n_predict": ("n_predict", Tier.T1),
    "max_tokens": ("n_predict", Tier.T1), "seed": ("seed", Tier.T1),
    "ctx_size": ("ctx_size", Tier.T2), "n_ctx": ("ctx_size", Tier.T2),
    "ctx": ("ctx_size", Tier.T2), "--ctx-size": ("ctx_size", Tier.T2),
    "cache_type_k": ("cache_type_k", Tier.T2), "cache_type_v": ("cache_type_v", Tier.T2),
    "batch_size": ("batch_size", Tier.T2), "batch": ("batch_size", Tier.T2),
    "ubatch_size": ("ubatch_size", Tier.T2), "flash_attn": ("flash_attn", Tier.T2),
    "parallel": ("parallel", Tier.T2), "n_parallel": ("parallel", Tier.T2),
    "model": ("model", Tier.T3), "split": ("tensor_split", Tier.T3),
    "tensor_split": ("tensor_split", Tier.T3), "rpc": ("rpc", Tier.T3),
    "peers": ("rpc", Tier.T3), "rpc_servers": ("rpc", Tier.T3),
    "override_tensor": ("override_tensor", Tier.T3), "ot": ("override_tensor", Tier.T3),
    "override_tensors": ("override_tensor", Tier.T3),
    "n_gpu_layers": ("n_gpu_layers", Tier.T3), "ngl": ("n_gpu_layers", Tier.T3),
    "n_cpu_moe": ("n_cpu_moe", Tier.T3), "split_mode": ("split_mode", Tier.T3),
    "host": ("host", Tier.T4), "port": ("port", Tier.T4), "binaries": ("binaries", Tier.T4),
    "binary": ("binaries", Tier.T4),
}


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_every_named_key_has_its_tier(key: str) -> None:
    spec = lookup(key)
    assert spec is not None, key
    assert (spec.name, spec.tier) == EXPECTED[key]


def test_table_is_consistent() -> None:
    names = [s.name for s in KEYS]
    assert len(names) == len(set(names))
    for s in KEYS:
        assert (s.tier is Tier.T1) == (s.target is Target.REQUEST), s.name
        assert (s.tier is Tier.T4) == (s.target is Target.FIXED), s.name
        if s.tier is Tier.T4:
            assert s.note, f"{s.name}: a refused key needs the message the client reads"
    assert lookup("state_chunk_size") is None  # handled apart from the table
    assert lookup("no_such_key") is None


def test_classify_tiers_and_values() -> None:
    d = classify({"temperature": "0.2", "top_k": 40}, {})
    assert d.ok and d.tier is Tier.T1 and d.changed == {"temperature": 0.2, "top_k": 40}
    d = classify({"temperature": 0.2, "n_ctx": 8192}, {"temperature": 0.2})
    assert d.tier is Tier.T2 and d.changed == {"ctx_size": 8192} and d.unchanged == (
        "temperature",)
    d = classify({"ts": "21/44", "ngl": 99}, {})
    assert d.tier is Tier.T3 and d.changed == {"tensor_split": [21, 44], "n_gpu_layers": 99}
    assert d.by_tier(Tier.T3) == d.changed and d.by_tier(Tier.T1) == {}
    d = classify({"flash_attn": True, "rpc": "a:1,b:2"}, {})
    assert d.changed == {"flash_attn": "on", "rpc": ["a:1", "b:2"]}


def test_same_payload_twice_is_no_change() -> None:
    payload = {"temperature": 0.7, "n_ctx": 4096, "model": "gemma3-270m", "tensor_split": [1, 2]}
    first = classify(payload, {})
    assert not first.noop
    # what the engine reports after applying it (any spelling, CLI strings included)
    current = {"temp": "0.7", "ctx-size": "4096", "model": "gemma3-270m", "split": "1/2"}
    again = classify(payload, current)
    assert again.ok and again.noop and again.tier is None
    assert set(again.unchanged) == {"temperature", "ctx_size", "model", "tensor_split"}


def test_t4_refused_only_when_it_changes() -> None:
    d = classify({"port": 9000, "temperature": 0.1}, {"port": 8080})
    assert not d.ok and "port" in d.refused and "restart hydra" in d.refused["port"]
    assert "nothing applied" in d.error()
    assert classify({"port": 8080}, {"port": 8080}).ok  # sending the current value is fine
    assert not classify({"binaries": "/opt/x"}, {}).ok


def test_unknown_and_invalid_keys() -> None:
    d = classify({"tempurature": 0.2, "top_k": 3}, {})
    assert d.ok and d.unknown == ("tempurature",) and d.changed == {"top_k": 3}
    d = classify({"top_k": "many", "ctx_size": True}, {})
    assert not d.ok and set(d.invalid) == {"top_k", "ctx_size"}


@pytest.mark.parametrize("sent, applied", [
    (1, 64 << 10), (64 << 10, 64 << 10), (2 << 20, 2 << 20), (1 << 40, 64 << 20),
    ("1048576", 1 << 20),
])
def test_state_chunk_size_clamped(sent: object, applied: int) -> None:
    d = classify({"state_chunk_size": sent}, {})
    assert d.ok and d.noop and d.state_chunk_size_applied == applied


def test_profile_round_trip() -> None:
    p = Profile(name="p", source="p.yaml", model="gemma3-270m", mode=Mode.COMBINE,
                peers=("cpu-peer",), split=(10, 9), server_args={"ctx-size": 2048, "fa": "on"})
    cur = tier_diff.current_settings(p, {"temperature": 0.3})
    assert cur["ctx_size"] == 2048 and cur["flash_attn"] == "on"
    assert cur["temperature"] == 0.3 and cur["split_mode"] == "layer"
    assert cur["tensor_split"] == [10, 9] and cur["rpc"] == ["cpu-peer"]
    assert classify({"ctx_size": 2048, "temp": 0.3, "split": [10, 9]}, cur).noop
    d = classify({"ctx_size": 4096, "model": "other", "split_mode": "none", "top_p": 0.5}, cur)
    new = tier_diff.apply_to_profile(p, d.changed)
    assert new.server_args == {"ctx-size": 4096, "fa": "on"} or new.server_args == {
        "fa": "on", "ctx-size": 4096}
    assert new.model == "other" and new.mode is Mode.SOLO
    assert tier_diff.request_defaults(d) == {"top_p": 0.5}
    assert p.server_args == {"ctx-size": 2048, "fa": "on"}  # the original is untouched


def test_table_rows_for_the_docs() -> None:
    rows = list(tiers.table_rows())
    assert len(rows) == len(KEYS)
    assert ("ctx_size", "n_ctx, ctx, c, ctx-size", "T2", "llama-server `--ctx-size`", "") in rows


def test_docs_list_every_key() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    for key, _aliases, tier, _where, _note in tiers.table_rows():
        assert f"| `{key}` |" in doc and tier in doc, f"docs/protocol.md lacks {key}"
