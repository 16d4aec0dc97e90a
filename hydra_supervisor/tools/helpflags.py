"""The flags a llama.cpp binary accepts, read from its own `--help`: parsed once per binary file
and kept in hydra's cache dir, so a profile's `server_args` are checked at plan time instead of
failing (and being retried) when the process starts.

llama-server lists its options one per line at the left margin, the flag and its aliases first,
then the description from column 40 (or on the next lines when the flags are long)::

    -c,    --ctx-size N                     size of the prompt context (default: 0, ...)
    -kvo,  --kv-offload, -nkvo, --no-kv-offload
    --perf, --no-perf                       whether to enable internal libllama ...

ggml-rpc-server indents its options by two spaces (``  -c, --cache   enable local file
cache``). Continuation lines (indented to the description column) are not options.

Cache: ``<cache dir>/flags/<binary name>-<digest>.json`` beside the builds in
``<cache dir>/llama.cpp/``; the digest is of the binary's file identity (real path, size, mtime:
buildid.file_key, the key its build identity is cached under), so a rebuild or another build
is read afresh. A binary whose `--help` lists no flags (not llama.cpp, a stand-in, a crash) is
not cached on disk, and the check is skipped saying why.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from hydra_supervisor.config.paths import cache_dir
from hydra_supervisor.tools.buildid import file_key

HELP_TIMEOUT = 30.0  # a CUDA build's --help initialises nothing, but a loaded box is slow
# Where the description starts: two or more spaces that do not follow a comma or a space
# ("-h,    --help" is one option part, "--help, --usage        print usage" is not).
_DESCRIPTION = re.compile(r"(?<![,\s])\s{2,}")
_FLAG = re.compile(r"(?:^|[\s,])(-{1,2}[A-Za-z][\w-]*)")
_MAX_INDENT = 8  # deeper lines continue a description


def parse_help(text: str) -> tuple[tuple[str, ...], ...]:
    """The options a `--help` text lists, each as its spellings in the order listed
    (`("-c", "--ctx-size")`, `("--perf", "--no-perf")`)."""
    groups: list[tuple[str, ...]] = []
    for line in text.splitlines():
        stripped = line.lstrip()
        if not stripped.startswith("-") or len(line) - len(stripped) > _MAX_INDENT:
            continue
        part = _DESCRIPTION.split(stripped, maxsplit=1)[0]
        found = tuple(_FLAG.findall(part))
        if found:
            groups.append(found)
    return tuple(groups)


@dataclass(frozen=True)
class Help:
    """What a binary's `--help` says it accepts: its options, each a group of spellings.
    No options: not known (`why` says why)."""

    binary: Path
    options: tuple[tuple[str, ...], ...]
    why: str = ""

    @property
    def known(self) -> bool:
        return bool(self.options)

    @property
    def flags(self) -> frozenset[str]:
        """Every spelling of every option."""
        return frozenset(f for group in self.options for f in group)

    def spellings(self, flag: str) -> tuple[str, ...]:
        """The spellings of the option `flag` is one of (() when none is)."""
        return next((group for group in self.options if flag in group), ())


_memo: dict[str, Help] = {}
_lock = threading.Lock()


def cache_path(binary: Path) -> Path:
    digest = hashlib.sha256(file_key(binary.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "flags" / f"{binary.name}-{digest}.json"


def flags_of(binary: Path, timeout: float = HELP_TIMEOUT) -> Help:
    """The flags `binary --help` lists: from memory, else the cache dir, else by running it
    once (then cached). Never raises: a binary that cannot say gives a Help with `why`."""
    key = file_key(binary.resolve())
    with _lock:
        hit = _memo.get(key)
        if hit is None:
            hit = _memo[key] = _read_or_run(binary, timeout)
        return hit


def _read_or_run(binary: Path, timeout: float) -> Help:
    path = cache_path(binary)
    try:
        data = json.loads(path.read_text())
        options = data.get("options") if isinstance(data, dict) else None
        if isinstance(options, list) and options and all(
                isinstance(g, list) and all(isinstance(f, str) for f in g) for g in options):
            return Help(binary, tuple(tuple(g) for g in options))
    except (OSError, ValueError):
        pass
    try:
        # No GPU is needed to print the options (and a CUDA build then starts faster).
        proc = subprocess.run([str(binary), "--help"], capture_output=True, text=True,
                              timeout=timeout, check=False,
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Help(binary, (), f"`{binary} --help` did not run: {exc}")
    found = Help(binary, parse_help(proc.stdout + "\n" + proc.stderr))
    if "--help" not in found.flags:
        first = (proc.stderr or proc.stdout).strip().splitlines()
        said = f": {first[0][:160]}" if first else ""
        return Help(binary, (), f"`{binary} --help` listed no flags (exit {proc.returncode}{said})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"binary": str(binary), "file": file_key(binary.resolve()),
                                   "options": [list(g) for g in found.options]}))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache dir: read again next time
    return found
