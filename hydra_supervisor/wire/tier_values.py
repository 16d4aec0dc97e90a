"""The values of CONFIGURE keys: each key's coercer (its type) and check (its range or
choices), used by the key table (wire/tiers.py).

A coercer takes a JSON value or a CLI string and returns the normalised value, so that
`"0.2"` and 0.2 compare equal; a check takes the coerced value and says the valid range in its
error and in its `desc` (what `KeySpec.valid` shows).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import cast


class InvalidValue(ValueError):
    pass


# --------------------------------------------------------------------------- value coercers
# Each takes a JSON value or a CLI string and returns the normalised value (what is compared
# and what is applied), or raises InvalidValue.


Coercer = Callable[[object], object]  # a JSON value or a CLI string -> the normalised value
Check = Callable[[object], None]  # the coerced value -> None, or InvalidValue


def _num(kind: type[int] | type[float]) -> Callable[[object], int | float]:
    def coerce(v: object) -> int | float:
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


as_float = _num(float)
as_int = _num(int)


def as_bool(v: object) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in ("1", "true", "on", "yes", "enabled"):
        return True
    if isinstance(v, str) and v.lower() in ("0", "false", "off", "no", "disabled"):
        return False
    raise InvalidValue(f"expected true/false, got {v!r}")


def as_str(v: object) -> str:
    if isinstance(v, str | int | float) and not isinstance(v, bool):
        return str(v)
    raise InvalidValue(f"expected a string, got {v!r}")


def as_on_off_auto(v: object) -> str:
    if isinstance(v, str) and v.lower() in ("on", "off", "auto"):
        return v.lower()
    try:
        return "on" if as_bool(v) else "off"
    except InvalidValue:
        raise InvalidValue(f"expected on/off/auto, got {v!r}") from None


def as_str_list(v: object) -> list[str]:
    """A list of strings; a string is split on commas (`--rpc a,b`, `-ot x=CPU,y=CPU`)."""
    if isinstance(v, str):
        return [p.strip() for p in v.split(",") if p.strip()]
    if isinstance(v, list | tuple) and all(isinstance(x, str) for x in v):
        return list(v)
    raise InvalidValue(f"expected a list of strings or 'a,b', got {v!r}")


def as_split(v: object) -> list[float | int]:
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


def as_is(v: object) -> object:
    return v


# ----------------------------------------------------------------------- ranges and choices
# A check takes the coerced value and raises InvalidValue saying the valid range.

INT32_MAX = 2**31 - 1


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def in_range(lo: float | None = None, hi: float | None = None,
           special: Mapping[float, str] | None = None) -> Check:
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

    def check(v: object) -> None:
        if v in special:
            return
        n = cast(float, v)  # a number: the key's coercer ran first
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise InvalidValue(f"must be {desc}; got {v!r}")

    check.desc = desc  # type: ignore[attr-defined]
    return check


def one_of(*choices: str) -> Check:
    def check(v: object) -> None:
        if str(v).lower() not in choices:
            raise InvalidValue(f"must be one of {', '.join(choices)}; got {v!r}")

    check.desc = "one of " + ", ".join(choices)  # type: ignore[attr-defined]
    return check


def text_of(max_len: int) -> Check:
    def check(v: object) -> None:
        if len(str(v)) > max_len or "\0" in str(v):
            raise InvalidValue(f"must be text of at most {max_len} characters; got "
                               f"{len(str(v))}")

    check.desc = f"text of at most {max_len} characters"  # type: ignore[attr-defined]
    return check


def entries_of(what: str, *, max_items: int = 64, need: str = "") -> Check:
    """A list of at most `max_items` non-empty entries of at most 256 characters, each
    containing `need` when given (`-ot PATTERN=BUFFER`, `--override-kv KEY=TYPE:VALUE`)."""

    def check(v: object) -> None:
        v = cast("list[str]", v)  # a list of strings: the key's coercer ran first
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


def split_check(v: object) -> None:
    v = cast("list[float | int]", v)  # as_split ran first
    if len(v) > 64 or not all(math.isfinite(x) for x in v) or sum(v) <= 0:
        raise InvalidValue("must be 1 to 64 finite non-negative numbers, not all zero; "
                           f"got {v!r}")


split_check.desc = "1 to 64 non-negative numbers, not all zero"  # type: ignore[attr-defined]

GGML_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
PROB = in_range(0, 1)
_NONNEG = in_range(0)
THREADS = in_range(1, 1024, {-1: "auto"})
