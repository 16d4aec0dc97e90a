"""The one table of CONFIGURE keys: tier, how each maps onto a hydra profile, and the pure diff.

A CONFIGURE payload (0x40 over the wire, `hydra configure KEY=VALUE…` on the command line) is a
JSON object shaped like llama-server's parameters. Each recognised key has a *tier* that says what
changing it costs with stock binaries (docs/protocol.md, "CONFIGURE"):

- T1: per-request settings (sampling, n_predict…): sent as defaults in every request body
  (`Router.set_request_defaults`), no process restarts;
- T2: context settings read when llama-server starts (ctx size, KV types, batch, flash-attn…):
  the head restarts, peers keep running;
- T3: model settings (model, split, peers, -ot, ngl…): the processes that load the model
  restart, peers before head;
- T4: fixed for the life of the engine (host, port, binaries): refused with a clear error.

`classify(params, current)` is pure: it canonicalises aliases (`n_ctx`, `c`, `ctx-size` are all
`ctx_size`), coerces values (`"0.2"` → 0.2, `"21/44"` → [21, 44]) so that a CLI string and a JSON
number compare equal, and diffs against `current`. Same payload twice is no change. Unknown keys
are reported, never silently applied. `state_chunk_size` is not a setting of any process: it is
echoed back clamped (the wire server uses it for STATE_GET/PUT/PREFILL streaming).

Checked before anything restarts: every key has a type (its coercer) and a range or a set of
choices (its `check`: threads -1 or 1..1024, ctx_size 1..2^31-1, temperature finite and >= 0,
top_p 0..1, cache types ggml's own names…); a value outside it makes the payload invalid, with
the key and the valid range in the message. Keys that name files (`chat_template_file`,
`lora`, `mmproj`, `control_vector`, `model_draft`, and `model` given as a path) are refused over
the wire: a client must not make llama-server, running as hydra's user, open a file of its
choosing. `model` may name an alias (the engine checks it against the node file).

This module is the table (a KeySpec per key, looked up by any spelling); the values' coercers
and checks are in wire/tier_values.py, the diff of a payload and the mapping onto a profile
(`classify`, `current_settings`, `apply_to_profile`, `request_defaults`) in wire/tier_diff.py.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from hydra_supervisor.wire.tier_values import (
    GGML_KV_TYPES,
    INT32_MAX,
    PROB,
    THREADS,
    Check,
    Coercer,
    as_bool,
    as_float,
    as_int,
    as_is,
    as_on_off_auto,
    as_split,
    as_str,
    as_str_list,
    entries_of,
    in_range,
    one_of,
    split_check,
    text_of,
)

STATE_CHUNK_KEY = "state_chunk_size"
STATE_CHUNK_MIN = 64 << 10
STATE_CHUNK_MAX = 64 << 20
STATE_CHUNK_DEFAULT = 2 << 20  # Hydra.Core's HYDRA_COORD_STATE_CHUNK_SIZE_KB default (2048)


class Tier(enum.IntEnum):
    T1 = 1
    T2 = 2
    T3 = 3
    T4 = 4

    def __str__(self) -> str:
        return self.name


class Target(enum.Enum):
    REQUEST = "request"  # a request-body default (T1): Router.set_request_defaults
    SERVER_ARG = "server_arg"  # a llama-server flag in profile.server_args
    PROFILE = "profile"  # a hydra profile field (the resolver owns the flags)
    FIXED = "fixed"  # T4: cannot change while the engine runs


# ---------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class KeySpec:
    name: str  # canonical: llama-server's long flag with underscores
    tier: Tier
    target: Target
    field: str  # request-body key | server_args flag name | profile field
    coerce: Coercer = as_is
    aliases: tuple[str, ...] = ()
    note: str = ""
    check: Check | None = None  # range/choices of the coerced value
    names_file: bool = False  # the value is a path: refused over the wire

    @property
    def valid(self) -> str:
        """The valid values, for messages and docs."""
        if self.names_file:
            return "a file path: refused over the wire (set it in the profile)"
        if self.check is not None:
            return str(getattr(self.check, "desc", ""))
        if self.coerce is as_bool:
            return "true or false"
        return "on, off or auto" if self.coerce is as_on_off_auto else ""




def _t1(name: str, coerce: Coercer, check: Check | None, *aliases: str,
        body: str | None = None, note: str = "") -> KeySpec:
    return KeySpec(name, Tier.T1, Target.REQUEST, body or name, coerce, aliases, note, check)


def _t2(name: str, coerce: Coercer, check: Check | None, *aliases: str,
        flag: str | None = None, note: str = "", names_file: bool = False) -> KeySpec:
    return KeySpec(name, Tier.T2, Target.SERVER_ARG, flag or name.replace("_", "-"), coerce,
                   aliases, note, check, names_file)


def _t3(name: str, coerce: Coercer, check: Check | None, *aliases: str,
        flag: str | None = None, profile: str | None = None, note: str = "",
        names_file: bool = False) -> KeySpec:
    if profile:
        return KeySpec(name, Tier.T3, Target.PROFILE, profile, coerce, aliases, note, check,
                       names_file)
    return KeySpec(name, Tier.T3, Target.SERVER_ARG, flag or name.replace("_", "-"), coerce,
                   aliases, note, check, names_file)


def _t4(name: str, *aliases: str, note: str) -> KeySpec:
    return KeySpec(name, Tier.T4, Target.FIXED, name, as_is, aliases, note)


KEYS: tuple[KeySpec, ...] = (
    # T1: llama-server request-body fields (/completion and the OpenAI endpoints)
    _t1("temperature", as_float, in_range(0, 100), "temp"),
    _t1("top_k", as_int, in_range(0, INT32_MAX)),
    _t1("top_p", as_float, PROB),
    _t1("min_p", as_float, PROB),
    _t1("typical_p", as_float, PROB, "typical"),
    _t1("top_n_sigma", as_float, in_range(0, 100, {-1: "off"})),
    _t1("xtc_probability", as_float, PROB),
    _t1("xtc_threshold", as_float, PROB),
    _t1("repeat_penalty", as_float, in_range(0, 100)),
    _t1("repeat_last_n", as_int, in_range(0, INT32_MAX, {-1: "the context size"})),
    _t1("presence_penalty", as_float, in_range(-100, 100)),
    _t1("frequency_penalty", as_float, in_range(-100, 100)),
    _t1("dry_multiplier", as_float, in_range(0, 100)),
    _t1("dry_base", as_float, in_range(1, 100)),
    _t1("dry_allowed_length", as_int, in_range(0, INT32_MAX)),
    _t1("dry_penalty_last_n", as_int, in_range(0, INT32_MAX, {-1: "the context size"})),
    _t1("dynatemp_range", as_float, in_range(0, 100)),
    _t1("dynatemp_exponent", as_float, in_range(0, 100)),
    _t1("mirostat", as_int, in_range(0, 2)),
    _t1("mirostat_tau", as_float, in_range(0, 100)),
    _t1("mirostat_eta", as_float, in_range(0, 100)),
    _t1("n_predict", as_int,
        in_range(0, INT32_MAX, {-1: "no limit", -2: "until the context is full"}),
        "predict", "n", "max_tokens",
        note="the router sends it as max_tokens on the OpenAI endpoints"),
    _t1("seed", as_int, in_range(0, 2**32 - 1, {-1: "random"})),
    _t1("n_keep", as_int, in_range(0, INT32_MAX, {-1: "all"}), "keep"),
    _t1("n_probs", as_int, in_range(0, 1024)),
    _t1("min_keep", as_int, in_range(0, INT32_MAX)),
    _t1("ignore_eos", as_bool, None),
    _t1("cache_prompt", as_bool, None),
    _t1("t_max_predict_ms", as_int, in_range(0, INT32_MAX)),
    # T2: llama-server flags read at context creation; the head restarts, peers stay
    _t2("ctx_size", as_int, in_range(1, INT32_MAX), "n_ctx", "ctx", "c", "ctx-size"),
    _t2("batch_size", as_int, in_range(1, INT32_MAX), "n_batch", "batch", "b", "batch-size"),
    _t2("ubatch_size", as_int, in_range(1, INT32_MAX), "n_ubatch", "ubatch", "ub", "ubatch-size"),
    _t2("parallel", as_int, in_range(1, 4096, {-1: "auto"}), "n_parallel", "np"),
    _t2("flash_attn", as_on_off_auto, None, "fa", "flash-attn", "flash_attn_type"),
    _t2("cache_type_k", as_str, one_of(*GGML_KV_TYPES), "ctk", "cache-type-k", "type_k"),
    _t2("cache_type_v", as_str, one_of(*GGML_KV_TYPES), "ctv", "cache-type-v", "type_v"),
    _t2("kv_unified", as_bool, None, "kvu", "kv-unified"),
    _t2("swa_full", as_bool, None, "swa-full",
        note="needed for slot restore to hit the cache on sliding-window models (Gemma 3)"),
    _t2("cont_batching", as_bool, None, "cb", "cont-batching"),
    _t2("cache_reuse", as_int, in_range(0, INT32_MAX), "n_cache_reuse", "cache-reuse"),
    _t2("context_shift", as_bool, None, "ctx_shift", "context-shift"),
    _t2("no_kv_offload", as_bool, None, "nkvo", "no-kv-offload"),
    _t2("threads", as_int, THREADS, "n_threads", "t"),
    _t2("threads_batch", as_int, THREADS, "tb", "threads-batch"),
    _t2("rope_scaling", as_str, one_of("none", "linear", "yarn"), "rope-scaling",
        "rope_scaling_type"),
    _t2("rope_scale", as_float, in_range(1e-6, 1e6), "rope-scale"),
    _t2("rope_freq_base", as_float, in_range(0, 1e12), "rope-freq-base"),
    _t2("rope_freq_scale", as_float, in_range(0, 1e6), "rope-freq-scale"),
    _t2("yarn_orig_ctx", as_int, in_range(0, INT32_MAX), "yarn-orig-ctx"),
    _t2("yarn_ext_factor", as_float, in_range(-1, 100), "yarn-ext-factor"),
    _t2("yarn_attn_factor", as_float, in_range(-1, 100), "yarn-attn-factor"),
    _t2("yarn_beta_fast", as_float, in_range(-1, 1000), "yarn-beta-fast"),
    _t2("yarn_beta_slow", as_float, in_range(-1, 1000), "yarn-beta-slow"),
    _t2("slot_prompt_similarity", as_float, PROB, "sps", "slot-prompt-similarity"),
    _t2("cache_ram", as_int, in_range(0, INT32_MAX, {-1: "no limit"}), "cram", "cache-ram",
        "cache_ram_mib"),
    _t2("jinja", as_bool, None),
    _t2("chat_template", as_str, text_of(1 << 16), "chat-template"),
    _t2("chat_template_file", as_str, None, "chat-template-file", names_file=True),
    _t2("reasoning_format", as_str, one_of("none", "deepseek", "deepseek-legacy", "auto"),
        "reasoning-format"),
    _t2("metrics", as_bool, None),
    # T3: what the model load reads; the model's processes restart, peers before head
    _t3("model", as_str, text_of(256), "m", "model_path", "model_alias", profile="model",
        note="an alias from the node file (a path is refused over the wire)"),
    _t3("tensor_split", as_split, split_check, "split", "ts", "tensor-split", profile="split",
        note="layers per device in llama.cpp order: peers first, head last"),
    _t3("split_mode", as_str, one_of("none", "layer"), "sm", "split-mode", profile="mode",
        note="none = SOLO, layer = COMBINE (hydra derives -sm from the profile's mode)"),
    _t3("rpc", as_str_list, entries_of("a host:port endpoint or a device name"), "peers",
        "rpc_servers", profile="peers",
        note="peer endpoints host:port, or the node file's device names"),
    _t3("override_tensor", as_str_list, entries_of("a PATTERN=BUFFER rule", need="="), "ot",
        "override-tensor", "override_tensors", "tensor_buft_overrides"),
    _t3("n_gpu_layers", as_int, in_range(0, 100000, {-1: "all"}), "ngl", "gpu_layers",
        "n-gpu-layers", "gpu-layers", note="in COMBINE hydra derives -ngl from the split"),
    _t3("n_cpu_moe", as_int, in_range(0, 100000), "ncmoe", "n-cpu-moe", profile="n_cpu_moe"),
    _t3("cpu_moe", as_bool, None, "cmoe", "cpu-moe"),
    _t3("main_gpu", as_int, in_range(0, 1023), "mg", "main-gpu"),
    _t3("device", as_str_list, entries_of("a device name", max_items=16), "dev", "devices",
        profile="head",
        note="hydra pins each process to its device from the profile's head/peers"),
    _t3("mmap", as_bool, None, "use_mmap"),
    _t3("no_mmap", as_bool, None, "no-mmap"),
    _t3("mlock", as_bool, None, "use_mlock"),
    _t3("check_tensors", as_bool, None, "check-tensors"),
    _t3("override_kv", as_str_list, entries_of("a KEY=TYPE:VALUE override", need="="),
        "override-kv",
        "kv_overrides"),
    _t3("lora", as_str_list, None, "lora_adapters", names_file=True),
    _t3("mmproj", as_str, None, names_file=True),
    _t3("control_vector", as_str_list, None, "control-vector", "control_vectors",
        names_file=True),
    _t3("model_draft", as_str, None, "md", "model-draft", names_file=True),
    # T4: fixed while the engine runs
    _t4("host", "hostname", note="the external bind address is fixed; change the profile and "
                                 "restart hydra"),
    _t4("port", note="the external port is fixed; change the profile and restart hydra"),
    _t4("binaries", "binary", "bin_dir", note="llama.cpp binaries are fixed; change the node "
                                              "file and restart hydra"),
    _t4("rpc_port", "rpc-port", "rpc_server_port", note="ports are fixed; change the node file "
                                                         "and restart hydra"),
    _t4("threads_http", "threads-http", note="llama-server's HTTP pool is fixed by hydra"),
    _t4("slot_save_path", "slot-save-path", note="hydra owns the slot directory (its state dir)"),
    _t4("api_key", "api-key", "api_keys",
        note="authentication is set in the profile, never over the wire"),
    _t4("ssl_key_file", "ssl-key-file", note="TLS files are fixed; change the profile"),
    _t4("ssl_cert_file", "ssl-cert-file", note="TLS files are fixed; change the profile"),
)

BY_NAME: dict[str, KeySpec] = {}
for _spec in KEYS:
    for _k in (_spec.name, *_spec.aliases):
        if _k in BY_NAME:
            raise RuntimeError(f"tiers: key {_k!r} appears twice in the table")
        BY_NAME[_k] = _spec


def lookup(key: str) -> KeySpec | None:
    """The spec for any spelling: `n_ctx`, `ctx-size`, `--ctx-size`, `c` → ctx_size."""
    k = key.strip().lstrip("-")
    return BY_NAME.get(k) or BY_NAME.get(k.replace("-", "_"))


def clamp_chunk(v: object) -> int:
    n = int(as_int(v))
    return max(STATE_CHUNK_MIN, min(STATE_CHUNK_MAX, n))


def table_rows() -> Iterable[tuple[str, str, str, str, str]]:
    """(key, aliases, tier, maps to, note) for docs/protocol.md and `hydra configure --keys`."""
    for s in KEYS:
        where = {Target.REQUEST: f"request body `{s.field}`",
                 Target.SERVER_ARG: f"llama-server `--{s.field}`",
                 Target.PROFILE: f"profile `{s.field}`",
                 Target.FIXED: "refused"}[s.target]
        yield s.name, ", ".join(s.aliases), str(s.tier), where, s.note
