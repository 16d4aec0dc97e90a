"""Load YAML while remembering where every value came from (file and line).

Validation reports problems by YAML path (``profile.server_args.ctx-size``) *and* by file:line,
so the loader keeps a side table from path tuples to 1-based line numbers. Syntax errors become a
ConfigError that names file:line:column.

Bounded input: a file over MAX_BYTES is refused unread, and before anything is built the
composed document's size *with every alias expanded* is counted (linear in the file, each
anchored node counted once): past MAX_VALUES (a "billion laughs" alias bomb, which would grow
without end in the daemon on a reload) the file is refused naming the line of the smallest part
that expands past the bound. A recursive alias and nesting past Python's recursion limit are
refused too. Anchors and aliases themselves stay allowed within the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hydra_supervisor.errors import ConfigError

PathKey = tuple[str | int, ...]

MAX_BYTES = 1 << 20  # a profile or node file is a few KiB
MAX_VALUES = 10_000  # values once aliases are expanded (a big node file has a few hundred)


@dataclass
class Sourced:
    """A parsed YAML document plus the line of each path in it."""

    file: str
    data: object  # what YAML gave: None, scalars, lists, dicts with str keys
    lines: dict[PathKey, int] = field(default_factory=dict)

    def where(self, path: PathKey) -> str:
        """``file:line`` for ``path``, falling back to the nearest parent that has a line."""
        probe = path
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe, 1)
        return f"{self.file}:{line}"


def _convert(node: yaml.Node, path: PathKey, lines: dict[PathKey, int], file: str) -> object:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, object] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if not isinstance(
                key_node, yaml.ScalarNode
            ) else key_node.value
            key = str(key)
            if key in out:
                raise ConfigError(
                    f"{file}:{key_node.start_mark.line + 1}: duplicate key '{key}'"
                )
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _convert(value_node, path + (key,), lines, file)
            lines[path + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, path + (i,), lines, file) for i, item in enumerate(node.value)]
    # Scalars: let the safe constructor apply YAML's own typing (ints, bools, nulls) -- but
    # YAML 1.2 booleans only: a plain `on`/`off`/`yes`/`no` stays a string, so
    # `flash-attn: on` means `--flash-attn on`, as the operator wrote it.
    value = yaml.safe_load(yaml.serialize(node))
    if isinstance(value, bool) and isinstance(node, yaml.ScalarNode) and not node.style \
            and node.value.lower() not in ("true", "false"):
        return node.value
    return value


def _expanded_size(root: yaml.Node, file: str) -> int:
    """How many values `root` holds with every alias expanded, counting each shared node once
    (memo): ConfigError past MAX_VALUES, naming the line of the first (smallest) node that
    expands past it, or on a recursive alias."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def count(node: yaml.Node) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise ConfigError(f"{file}:{node.start_mark.line + 1}: a recursive YAML alias "
                              "(a value that contains itself) is not allowed")
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += count(k) + count(v)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += count(item)
        active.discard(key)
        if total > MAX_VALUES:
            raise ConfigError(
                f"{file}:{node.start_mark.line + 1}: YAML aliases expand this to more than "
                f"{MAX_VALUES} values (an alias bomb?); refused")
        memo[key] = total
        return total

    return count(root)


def load_text(text: str, file: str) -> Sourced:
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{file}: {len(text)} characters; a profile or node file may have "
                          f"at most {MAX_BYTES} bytes")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _expanded_size(node, file)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else file
        raise ConfigError(f"{where}: YAML syntax error: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: YAML error: {exc}") from exc
    except RecursionError:
        raise ConfigError(f"{file}: YAML nested too deeply; refused") from None
    lines: dict[PathKey, int] = {}
    data = None if node is None else _convert(node, (), lines, file)
    return Sourced(file=file, data=data, lines=lines)


def load_file(path: Path) -> Sourced:
    """Read at most MAX_BYTES (+1, to tell a file that is too big: a FIFO or /dev/zero given
    as a profile is refused as well as a huge file)."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES} bytes; a profile or node file is "
                          "a few KiB: refused")
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return load_text(text, str(path))
