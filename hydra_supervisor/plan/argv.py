"""Turn a profile's `server_args` mapping into stock llama-server flags (pure).

Keys are stock flag names without dashes (`ctx-size: 4096` → `--ctx-size 4096`; one-letter keys
get one dash: `c: 4096` → `-c 4096`). `true` or an empty value gives the bare flag, `false`
drops it, a list repeats the flag once per item (for `override-tensor`). Keys hydra sets itself
from profile fields are refused here, naming the profile key to use instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from hydra_supervisor.errors import HydraError

# flag (any spelling) -> the profile key that controls it
OWNED_FLAGS = {
    "m": "model", "model": "model",
    "host": "host", "port": "port",
    "rpc": "peers",
    "ts": "split", "tensor-split": "split",
    "sm": "mode/transport", "split-mode": "mode/transport",
    "dev": "head/peers", "device": "head/peers",
    "n-cpu-moe": "n_cpu_moe", "ncmoe": "n_cpu_moe",
    "a": "name (the profile's name is the model name clients see)",
    "alias": "name (the profile's name is the model name clients see)",
}
# owned only in COMBINE (in SOLO the operator may set them)
COMBINE_OWNED = {"ngl": "split", "n-gpu-layers": "split", "gpu-layers": "split"}


def flag(key: str) -> str:
    return f"-{key}" if len(key) == 1 else f"--{key}"


def server_flags(args: Mapping[str, object], *, combine: bool, source: str) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        bare = key.lstrip("-")
        owner = OWNED_FLAGS.get(bare) or (COMBINE_OWNED.get(bare) if combine else None)
        if owner:
            raise HydraError(
                f"{source}: server_args.{key}: hydra sets {flag(bare)} itself; "
                f"use the profile key '{owner}' instead")
        if value is False:
            continue
        values = value if isinstance(value, list) else [value]
        for item in values:
            out.append(flag(bare))
            if item is not None and item is not True and item != "":
                out.append(str(item))
    return out
