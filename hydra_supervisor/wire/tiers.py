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
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

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


class InvalidValue(ValueError):
    pass


# --------------------------------------------------------------------------- value coercers
# Each takes a JSON value or a CLI string and returns the normalised value (what is compared
# and what is applied), or raises InvalidValue.


def _num(kind: type) -> Callable[[Any], Any]:
    def coerce(v: Any) -> Any:
        if isinstance(v, bool):
            raise InvalidValue(f"expected {'a number' if kind is float else 'an integer'}, "
                               f"got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidValue(f"expected a finite number, got {v!r}")
        if isinstance(v, str):
            try:
                v = float(v) if kind is float else int(v, 0)
            except ValueError:
                raise InvalidValue(f"expected {'a number' if kind is float else 'an integer'}, "
                                   f"got {v!r}") from None
        if kind is int:
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if not isinstance(v, int):
                raise InvalidValue(f"expected an integer, got {v!r}")
            return v
        if not isinstance(v, int | float):
            raise InvalidValue(f"expected a number, got {v!r}")
        if not math.isfinite(v):
            raise InvalidValue(f"expected a finite number, got {v!r}")
        return float(v)

    return coerce


_float = _num(float)
_int = _num(int)


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("1", "true", "on", "yes", "enabled"):
        return True
    if isinstance(v, str) and v.lower() in ("0", "false", "off", "no", "disabled"):
        return False
    raise InvalidValue(f"expected true/false, got {v!r}")


def _str(v: Any) -> str:
    if isinstance(v, str | int | float) and not isinstance(v, bool):
        return str(v)
    raise InvalidValue(f"expected a string, got {v!r}")


def _on_off_auto(v: Any) -> str:
    if isinstance(v, str) and v.lower() in ("on", "off", "auto"):
        return v.lower()
    try:
        return "on" if _bool(v) else "off"
    except InvalidValue:
        raise InvalidValue(f"expected on/off/auto, got {v!r}") from None


def _str_list(v: Any) -> list[str]:
    """A list of strings; a string is split on commas (`--rpc a,b`, `-ot x=CPU,y=CPU`)."""
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()]
    if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return list(v)
    raise InvalidValue(f"expected a list of strings or 'a,b', got {v!r}")


def _split(v: Any) -> list[float | int]:
    """Layers per device, llama.cpp order (peers first): [21, 44], "21/44", "21,44"."""
    if isinstance(v, str):
        parts = v.replace("/", ",").split(",")
        try:
            v = [float(p) if "." in p else int(p) for p in parts if p.strip()]
        except ValueError:
            raise InvalidValue(f"expected numbers like [21, 44] or '21/44', got {v!r}") from None
    if (isinstance(v, list | tuple) and v and all(
            isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in v)):
        return list(v)
    raise InvalidValue(f"expected a list of non-negative numbers, got {v!r}")


def _any(v: Any) -> Any:
    return v


# ----------------------------------------------------------------------- ranges and choices
# A check takes the coerced value and raises InvalidValue saying the valid range.

INT32_MAX = 2**31 - 1


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _range(lo: float | None = None, hi: float | None = None,
           special: Mapping[Any, str] | None = None) -> Callable[[Any], None]:
    """lo <= v <= hi (either end open when None), or one of `special` (value -> meaning)."""
    special = dict(special or {})
    if lo is not None and hi is not None:
        span = f"from {_fmt(lo)} to {_fmt(hi)}"
    elif lo is not None:
        span = f"at least {_fmt(lo)}"
    elif hi is not None:
        span = f"at most {_fmt(hi)}"
    else:
        span = "any finite number"
    desc = " or ".join([*(f"{_fmt(k)} ({m})" for k, m in special.items()), span])

    def check(v: Any) -> None:
        if v in special:
            return
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise InvalidValue(f"must be {desc}; got {v!r}")

    check.desc = desc  # type: ignore[attr-defined]
    return check


def _choice(*choices: str) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if str(v).lower() not in choices:
            raise InvalidValue(f"must be one of {', '.join(choices)}; got {v!r}")

    check.desc = "one of " + ", ".join(choices)  # type: ignore[attr-defined]
    return check


def _text(max_len: int) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if len(str(v)) > max_len or "\0" in str(v):
            raise InvalidValue(f"must be text of at most {max_len} characters; got "
                               f"{len(str(v))}")

    check.desc = f"text of at most {max_len} characters"  # type: ignore[attr-defined]
    return check


def _items(what: str, *, max_items: int = 64, need: str = "") -> Callable[[Any], None]:
    """A list of at most `max_items` non-empty entries of at most 256 characters, each
    containing `need` when given (`-ot PATTERN=BUFFER`, `--override-kv KEY=TYPE:VALUE`)."""

    def check(v: Any) -> None:
        if len(v) > max_items:
            raise InvalidValue(f"must list at most {max_items} entries; got {len(v)}")
        for x in v:
            if not x or len(x) > 256 or any(c.isspace() or c == "\0" for c in x) or (
                    need and need not in x):
                raise InvalidValue(f"each entry must be {what} (non-empty, no spaces"
                                   f"{', with ' + repr(need) if need else ''}); got {x!r}")

    check.desc = (f"at most {max_items} entries, each {what}"  # type: ignore[attr-defined]
                  + (f" (each with {need!r})" if need else ""))
    return check


def _split_check(v: Any) -> None:
    if len(v) > 64 or not all(math.isfinite(x) for x in v) or sum(v) <= 0:
        raise InvalidValue("must be 1 to 64 finite non-negative numbers, not all zero; "
                           f"got {v!r}")


_split_check.desc = "1 to 64 non-negative numbers, not all zero"  # type: ignore[attr-defined]

GGML_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_PROB = _range(0, 1)
_NONNEG = _range(0)
_THREADS = _range(1, 1024, {-1: "auto"})


# ---------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class KeySpec:
    name: str  # canonical: llama-server's long flag with underscores
    tier: Tier
    target: Target
    field: str  # request-body key | server_args flag name | profile field
    coerce: Callable[[Any], Any] = _any
    aliases: tuple[str, ...] = ()
    note: str = ""
    check: Callable[[Any], None] | None = None  # range/choices of the coerced value
    names_file: bool = False  # the value is a path: refused over the wire

    @property
    def valid(self) -> str:
        """The valid values, for messages and docs."""
        if self.names_file:
            return "a file path: refused over the wire (set it in the profile)"
        if self.check is not None:
            return str(getattr(self.check, "desc", ""))
        if self.coerce is _bool:
            return "true or false"
        return "on, off or auto" if self.coerce is _on_off_auto else ""


Check = Callable[[Any], None] | None


def _t1(name: str, coerce: Callable[[Any], Any], check: Check, *aliases: str,
        body: str | None = None, note: str = "") -> KeySpec:
    return KeySpec(name, Tier.T1, Target.REQUEST, body or name, coerce, aliases, note, check)


def _t2(name: str, coerce: Callable[[Any], Any], check: Check, *aliases: str,
        flag: str | None = None, note: str = "", names_file: bool = False) -> KeySpec:
    return KeySpec(name, Tier.T2, Target.SERVER_ARG, flag or name.replace("_", "-"), coerce,
                   aliases, note, check, names_file)


def _t3(name: str, coerce: Callable[[Any], Any], check: Check, *aliases: str,
        flag: str | None = None, profile: str | None = None, note: str = "",
        names_file: bool = False) -> KeySpec:
    if profile:
        return KeySpec(name, Tier.T3, Target.PROFILE, profile, coerce, aliases, note, check,
                       names_file)
    return KeySpec(name, Tier.T3, Target.SERVER_ARG, flag or name.replace("_", "-"), coerce,
                   aliases, note, check, names_file)


def _t4(name: str, *aliases: str, note: str) -> KeySpec:
    return KeySpec(name, Tier.T4, Target.FIXED, name, _any, aliases, note)


KEYS: tuple[KeySpec, ...] = (
    # T1: llama-server request-body fields (/completion and the OpenAI endpoints)
    _t1("temperature", _float, _range(0, 100), "temp"),
    _t1("top_k", _int, _range(0, INT32_MAX)),
    _t1("top_p", _float, _PROB),
    _t1("min_p", _float, _PROB),
    _t1("typical_p", _float, _PROB, "typical"),
    _t1("top_n_sigma", _float, _range(0, 100, {-1: "off"})),
    _t1("xtc_probability", _float, _PROB),
    _t1("xtc_threshold", _float, _PROB),
    _t1("repeat_penalty", _float, _range(0, 100)),
    _t1("repeat_last_n", _int, _range(0, INT32_MAX, {-1: "the context size"})),
    _t1("presence_penalty", _float, _range(-100, 100)),
    _t1("frequency_penalty", _float, _range(-100, 100)),
    _t1("dry_multiplier", _float, _range(0, 100)),
    _t1("dry_base", _float, _range(1, 100)),
    _t1("dry_allowed_length", _int, _range(0, INT32_MAX)),
    _t1("dry_penalty_last_n", _int, _range(0, INT32_MAX, {-1: "the context size"})),
    _t1("dynatemp_range", _float, _range(0, 100)),
    _t1("dynatemp_exponent", _float, _range(0, 100)),
    _t1("mirostat", _int, _range(0, 2)),
    _t1("mirostat_tau", _float, _range(0, 100)),
    _t1("mirostat_eta", _float, _range(0, 100)),
    _t1("n_predict", _int, _range(0, INT32_MAX, {-1: "no limit", -2: "until the context is full"}),
        "predict", "n", "max_tokens",
        note="the router sends it as max_tokens on the OpenAI endpoints"),
    _t1("seed", _int, _range(0, 2**32 - 1, {-1: "random"})),
    _t1("n_keep", _int, _range(0, INT32_MAX, {-1: "all"}), "keep"),
    _t1("n_probs", _int, _range(0, 1024)),
    _t1("min_keep", _int, _range(0, INT32_MAX)),
    _t1("ignore_eos", _bool, None),
    _t1("cache_prompt", _bool, None),
    _t1("t_max_predict_ms", _int, _range(0, INT32_MAX)),
    # T2: llama-server flags read at context creation; the head restarts, peers stay
    _t2("ctx_size", _int, _range(1, INT32_MAX), "n_ctx", "ctx", "c", "ctx-size"),
    _t2("batch_size", _int, _range(1, INT32_MAX), "n_batch", "batch", "b", "batch-size"),
    _t2("ubatch_size", _int, _range(1, INT32_MAX), "n_ubatch", "ubatch", "ub", "ubatch-size"),
    _t2("parallel", _int, _range(1, 4096, {-1: "auto"}), "n_parallel", "np"),
    _t2("flash_attn", _on_off_auto, None, "fa", "flash-attn", "flash_attn_type"),
    _t2("cache_type_k", _str, _choice(*GGML_KV_TYPES), "ctk", "cache-type-k", "type_k"),
    _t2("cache_type_v", _str, _choice(*GGML_KV_TYPES), "ctv", "cache-type-v", "type_v"),
    _t2("kv_unified", _bool, None, "kvu", "kv-unified"),
    _t2("swa_full", _bool, None, "swa-full",
        note="needed for slot restore to hit the cache on sliding-window models (Gemma 3)"),
    _t2("cont_batching", _bool, None, "cb", "cont-batching"),
    _t2("cache_reuse", _int, _range(0, INT32_MAX), "n_cache_reuse", "cache-reuse"),
    _t2("context_shift", _bool, None, "ctx_shift", "context-shift"),
    _t2("no_kv_offload", _bool, None, "nkvo", "no-kv-offload"),
    _t2("threads", _int, _THREADS, "n_threads", "t"),
    _t2("threads_batch", _int, _THREADS, "tb", "threads-batch"),
    _t2("rope_scaling", _str, _choice("none", "linear", "yarn"), "rope-scaling",
        "rope_scaling_type"),
    _t2("rope_scale", _float, _range(1e-6, 1e6), "rope-scale"),
    _t2("rope_freq_base", _float, _range(0, 1e12), "rope-freq-base"),
    _t2("rope_freq_scale", _float, _range(0, 1e6), "rope-freq-scale"),
    _t2("yarn_orig_ctx", _int, _range(0, INT32_MAX), "yarn-orig-ctx"),
    _t2("yarn_ext_factor", _float, _range(-1, 100), "yarn-ext-factor"),
    _t2("yarn_attn_factor", _float, _range(-1, 100), "yarn-attn-factor"),
    _t2("yarn_beta_fast", _float, _range(-1, 1000), "yarn-beta-fast"),
    _t2("yarn_beta_slow", _float, _range(-1, 1000), "yarn-beta-slow"),
    _t2("slot_prompt_similarity", _float, _PROB, "sps", "slot-prompt-similarity"),
    _t2("cache_ram", _int, _range(0, INT32_MAX, {-1: "no limit"}), "cram", "cache-ram",
        "cache_ram_mib"),
    _t2("jinja", _bool, None),
    _t2("chat_template", _str, _text(1 << 16), "chat-template"),
    _t2("chat_template_file", _str, None, "chat-template-file", names_file=True),
    _t2("reasoning_format", _str, _choice("none", "deepseek", "deepseek-legacy", "auto"),
        "reasoning-format"),
    _t2("metrics", _bool, None),
    # T3: what the model load reads; the model's processes restart, peers before head
    _t3("model", _str, _text(256), "m", "model_path", "model_alias", profile="model",
        note="an alias from the node file (a path is refused over the wire)"),
    _t3("tensor_split", _split, _split_check, "split", "ts", "tensor-split", profile="split",
        note="layers per device in llama.cpp order: peers first, head last"),
    _t3("split_mode", _str, _choice("none", "layer"), "sm", "split-mode", profile="mode",
        note="none = SOLO, layer = COMBINE (hydra derives -sm from the profile's mode)"),
    _t3("rpc", _str_list, _items("a host:port endpoint or a device name"), "peers",
        "rpc_servers", profile="peers",
        note="peer endpoints host:port, or the node file's device names"),
    _t3("override_tensor", _str_list, _items("a PATTERN=BUFFER rule", need="="), "ot",
        "override-tensor", "override_tensors", "tensor_buft_overrides"),
    _t3("n_gpu_layers", _int, _range(0, 100000, {-1: "all"}), "ngl", "gpu_layers",
        "n-gpu-layers", "gpu-layers", note="in COMBINE hydra derives -ngl from the split"),
    _t3("n_cpu_moe", _int, _range(0, 100000), "ncmoe", "n-cpu-moe", profile="n_cpu_moe"),
    _t3("cpu_moe", _bool, None, "cmoe", "cpu-moe"),
    _t3("main_gpu", _int, _range(0, 1023), "mg", "main-gpu"),
    _t3("device", _str_list, _items("a device name", max_items=16), "dev", "devices",
        profile="head",
        note="hydra pins each process to its device from the profile's head/peers"),
    _t3("mmap", _bool, None, "use_mmap"),
    _t3("no_mmap", _bool, None, "no-mmap"),
    _t3("mlock", _bool, None, "use_mlock"),
    _t3("check_tensors", _bool, None, "check-tensors"),
    _t3("override_kv", _str_list, _items("a KEY=TYPE:VALUE override", need="="), "override-kv",
        "kv_overrides"),
    _t3("lora", _str_list, None, "lora_adapters", names_file=True),
    _t3("mmproj", _str, None, names_file=True),
    _t3("control_vector", _str_list, None, "control-vector", "control_vectors",
        names_file=True),
    _t3("model_draft", _str, None, "md", "model-draft", names_file=True),
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


def clamp_chunk(v: Any) -> int:
    n = int(_int(v))
    return max(STATE_CHUNK_MIN, min(STATE_CHUNK_MAX, n))


# ----------------------------------------------------------------------------------- the diff


@dataclass(frozen=True)
class TierDiff:
    """What a CONFIGURE payload changes. `tier` is the highest tier among the changes (None:
    nothing to do). `refused` (T4 keys whose value differs) and `invalid` make it refused as a
    whole: nothing is applied."""

    changed: dict[str, Any] = field(default_factory=dict)  # canonical key -> normalised value
    tiers: dict[str, Tier] = field(default_factory=dict)  # canonical key -> its tier
    unchanged: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    refused: dict[str, str] = field(default_factory=dict)  # key -> why
    invalid: dict[str, str] = field(default_factory=dict)  # key -> why
    state_chunk_size_applied: int | None = None

    @property
    def tier(self) -> Tier | None:
        return max(self.tiers.values(), default=None)

    @property
    def ok(self) -> bool:
        return not self.refused and not self.invalid

    @property
    def noop(self) -> bool:
        return not self.changed

    def by_tier(self, tier: Tier) -> dict[str, Any]:
        return {k: v for k, v in self.changed.items() if self.tiers[k] == tier}

    def error(self) -> str:
        parts = [f"{k}: {why}" for k, why in {**self.refused, **self.invalid}.items()]
        return "CONFIGURE refused, nothing applied: " + "; ".join(parts)


def canonical(params: Mapping[str, Any], *, check: bool = False
              ) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """(canonical key -> normalised value, unknown keys, invalid key -> why). With `check`,
    values outside their key's range or choices are invalid too (what a client sends; the
    engine's own settings are taken as they are)."""
    out: dict[str, Any] = {}
    unknown: list[str] = []
    invalid: dict[str, str] = {}
    for key, value in params.items():
        spec = lookup(key)
        if spec is None:
            unknown.append(key)
            continue
        try:
            v = spec.coerce(value)
            if check and spec.check is not None:
                spec.check(v)
            out[spec.name] = v
        except InvalidValue as e:
            invalid[key] = f"{e} (valid: {spec.valid})" if spec.valid and check and \
                "must be" not in str(e) else str(e)
    return out, unknown, invalid


def looks_like_path(value: str) -> bool:
    """A model reference that names a file rather than an alias."""
    v = value.strip()
    return ("/" in v or "\\" in v or v.startswith((".", "~")) or v.lower().endswith(".gguf")
            or v == "")


def file_refusal(spec: KeySpec, value: Any) -> str | None:
    """Why a value that names a file is refused over the wire, or None."""
    if spec.names_file:
        return ("names a file: paths are refused over the wire (llama-server, running as "
                "hydra's user, would open it); set it in the profile and `hydra reload`")
    if spec.name == "model" and isinstance(value, str) and looks_like_path(value):
        return ("a path is refused over the wire: name a model alias from the node file "
                "(`models:`), or set the path in the profile and `hydra reload`")
    return None


def classify(params: Mapping[str, Any], current: Mapping[str, Any]) -> TierDiff:
    """Diff a CONFIGURE payload against the current settings (canonical keys, as returned by
    `current_settings`). Pure; `current` keys that are spellings of a table key also count."""
    chunk: int | None = None
    invalid: dict[str, str] = {}
    rest = dict(params)
    if STATE_CHUNK_KEY in rest:
        try:
            chunk = clamp_chunk(rest.pop(STATE_CHUNK_KEY))
        except InvalidValue as e:
            invalid[STATE_CHUNK_KEY] = str(e)
    wanted, unknown, bad = canonical(rest, check=True)
    invalid.update(bad)
    have, _, _ = canonical(current)
    changed: dict[str, Any] = {}
    tiers: dict[str, Tier] = {}
    unchanged: list[str] = []
    refused: dict[str, str] = {}
    for name, value in wanted.items():
        spec = BY_NAME[name]
        if name in have and have[name] == value:
            unchanged.append(name)
            continue
        if spec.tier is Tier.T4:
            refused[name] = f"{spec.note} (tier T4)"
            continue
        why = file_refusal(spec, value)
        if why is not None:
            refused[name] = why
            continue
        changed[name] = value
        tiers[name] = spec.tier
    return TierDiff(changed, tiers, tuple(unchanged), tuple(unknown), refused, invalid, chunk)


# --------------------------------------------------------------- profile <-> settings mapping


def request_defaults(diff_or_settings: TierDiff | Mapping[str, Any]) -> dict[str, Any]:
    """The T1 settings as request-body defaults (for Router.set_request_defaults)."""
    items = (diff_or_settings.changed if isinstance(diff_or_settings, TierDiff)
             else diff_or_settings)
    out = {}
    for name, value in items.items():
        spec = lookup(name)
        if spec is not None and spec.target is Target.REQUEST:
            out[spec.field] = value
    return out


def _server_arg_value(args: Mapping[str, Any], spec: KeySpec) -> tuple[bool, Any]:
    """Find a setting in a profile's server_args under any of its flag spellings."""
    for key in (spec.field, spec.name, *spec.aliases):
        for k in (key, key.replace("_", "-")):
            if k in args:
                return True, args[k]
    return False, None


def current_settings(profile: Any, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The canonical settings a profile (config.Profile) and the T1 defaults in force amount to:
    what `classify` diffs against. Only what the profile states is listed (a key it leaves to
    llama.cpp's default counts as changed the first time it is sent)."""
    out: dict[str, Any] = {}
    for key, value in (defaults or {}).items():
        spec = lookup(key)
        if spec is not None and spec.tier is Tier.T1:
            out[spec.name] = spec.coerce(value)
    args = getattr(profile, "server_args", {}) or {}
    for spec in KEYS:
        if spec.target is Target.SERVER_ARG:
            found, value = _server_arg_value(args, spec)
            if found:
                try:
                    out[spec.name] = spec.coerce(value)
                except InvalidValue:
                    out[spec.name] = value
    mode = getattr(profile, "mode", None)
    mode_value = getattr(mode, "value", mode)
    for name, attr in (("model", "model"), ("tensor_split", "split"), ("rpc", "peers"),
                       ("n_cpu_moe", "n_cpu_moe"), ("host", "host"), ("port", "port")):
        value = getattr(profile, attr, None)
        if value in (None, "", ()):
            continue
        if isinstance(value, Mapping):
            value = list(value.values())
        if isinstance(value, tuple):
            value = list(value)
        out[name] = value
    if mode_value in ("solo", "combine"):
        out["split_mode"] = "none" if mode_value == "solo" else "layer"
    return out


def apply_to_profile(profile: Any, changed: Mapping[str, Any]) -> Any:
    """A new profile (dataclasses.replace) with the T2/T3 settings applied: SERVER_ARG keys go
    into server_args under their stock flag name, PROFILE keys into their field. T1 keys are
    not part of a profile (they are request defaults) and are ignored here."""
    args = dict(getattr(profile, "server_args", {}) or {})
    fields: dict[str, Any] = {}
    for name, value in changed.items():
        spec = lookup(name)
        if spec is None or spec.tier in (Tier.T1, Tier.T4):
            continue
        if spec.target is Target.SERVER_ARG:
            for key in (spec.field, spec.name, *spec.aliases):
                args.pop(key, None)
                args.pop(key.replace("_", "-"), None)
            args[spec.field] = value
        elif spec.name == "split_mode":
            fields["mode"] = type(profile.mode)("solo" if value == "none" else "combine")
        elif spec.name in ("tensor_split", "rpc", "device"):
            fields[spec.field] = (value[0] if spec.name == "device" and value
                                  else tuple(value))
        else:
            fields[spec.field] = value
    return replace(profile, server_args=args, **fields)


def table_rows() -> Iterable[tuple[str, str, str, str, str]]:
    """(key, aliases, tier, maps to, note) for docs/protocol.md and `hydra configure --keys`."""
    for s in KEYS:
        where = {Target.REQUEST: f"request body `{s.field}`",
                 Target.SERVER_ARG: f"llama-server `--{s.field}`",
                 Target.PROFILE: f"profile `{s.field}`",
                 Target.FIXED: "refused"}[s.target]
        yield s.name, ", ".join(s.aliases), str(s.tier), where, s.note
