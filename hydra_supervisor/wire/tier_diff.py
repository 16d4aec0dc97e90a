"""What a CONFIGURE payload changes, and how settings map onto a hydra profile: the pure diff
(`classify`, `TierDiff`), the wire's refusal of file paths, the settings a profile amounts to
(`current_settings`), a profile with changes applied (`apply_to_profile`) and the T1 request
defaults (`request_defaults`). The keys, their tiers and spellings: wire/tiers.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import cast

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.config.schema import ProfileFields
from hydra_supervisor.wire.tier_values import InvalidValue
from hydra_supervisor.wire.tiers import (
    BY_NAME,
    KEYS,
    STATE_CHUNK_KEY,
    KeySpec,
    Target,
    Tier,
    clamp_chunk,
    lookup,
)

# ----------------------------------------------------------------------------------- the diff


@dataclass(frozen=True)
class TierDiff:
    """What a CONFIGURE payload changes. `tier` is the highest tier among the changes (None:
    nothing to do). `refused` (T4 keys whose value differs) and `invalid` make it refused as a
    whole: nothing is applied."""

    changed: dict[str, object] = field(default_factory=dict)  # canonical key -> normalised value
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

    def by_tier(self, tier: Tier) -> dict[str, object]:
        return {k: v for k, v in self.changed.items() if self.tiers[k] == tier}

    def error(self) -> str:
        parts = [f"{k}: {why}" for k, why in {**self.refused, **self.invalid}.items()]
        return "CONFIGURE refused, nothing applied: " + "; ".join(parts)


def canonical(params: Mapping[str, object], *, check: bool = False
              ) -> tuple[dict[str, object], list[str], dict[str, str]]:
    """(canonical key -> normalised value, unknown keys, invalid key -> why). With `check`,
    values outside their key's range or choices are invalid too (what a client sends; the
    engine's own settings are taken as they are)."""
    out: dict[str, object] = {}
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


def file_refusal(spec: KeySpec, value: object) -> str | None:
    """Why a value that names a file is refused over the wire, or None."""
    if spec.names_file:
        return ("names a file: paths are refused over the wire (llama-server, running as "
                "hydra's user, would open it); set it in the profile and `hydra reload`")
    if spec.name == "model" and isinstance(value, str) and looks_like_path(value):
        return ("a path is refused over the wire: name a model alias from the node file "
                "(`models:`), or set the path in the profile and `hydra reload`")
    return None


def classify(params: Mapping[str, object], current: Mapping[str, object]) -> TierDiff:
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
    changed: dict[str, object] = {}
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


def request_defaults(diff_or_settings: TierDiff | Mapping[str, object]) -> dict[str, object]:
    """The T1 settings as request-body defaults (for Router.set_request_defaults)."""
    items = (diff_or_settings.changed if isinstance(diff_or_settings, TierDiff)
             else diff_or_settings)
    out: dict[str, object] = {}
    for name, value in items.items():
        spec = lookup(name)
        if spec is not None and spec.target is Target.REQUEST:
            out[spec.field] = value
    return out


def _server_arg_value(args: Mapping[str, object], spec: KeySpec) -> tuple[bool, object]:
    """Find a setting in a profile's server_args under any of its flag spellings."""
    for key in (spec.field, spec.name, *spec.aliases):
        for k in (key, key.replace("_", "-")):
            if k in args:
                return True, args[k]
    return False, None


def current_settings(profile: Profile, defaults: Mapping[str, object] | None = None
                     ) -> dict[str, object]:
    """The canonical settings a profile (config.Profile) and the T1 defaults in force amount to:
    what `classify` diffs against. Only what the profile states is listed (a key it leaves to
    llama.cpp's default counts as changed the first time it is sent)."""
    out: dict[str, object] = {}
    for key, value in (defaults or {}).items():
        spec = lookup(key)
        if spec is not None and spec.tier is Tier.T1:
            out[spec.name] = spec.coerce(value)
    args: Mapping[str, object] = getattr(profile, "server_args", {}) or {}
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


def apply_to_profile(profile: Profile, changed: Mapping[str, object]) -> Profile:
    """A new profile (dataclasses.replace) with the T2/T3 settings applied: SERVER_ARG keys go
    into server_args under their stock flag name, PROFILE keys into their field. T1 keys are
    not part of a profile (they are request defaults) and are ignored here."""
    args: dict[str, object] = dict(getattr(profile, "server_args", {}) or {})
    fields: dict[str, object] = {}
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
            items = cast("list[object]", value)  # coerced by as_split / as_str_list
            fields[spec.field] = (items[0] if spec.name == "device" and items
                                  else tuple(items))
        else:
            fields[spec.field] = value
    fields["server_args"] = args
    return replace(profile, **cast(ProfileFields, fields))
