"""Load YAML while remembering where every value came from (file and line).

Validation reports problems by YAML path (``profile.server_args.ctx-size``) *and* by file:line,
so the loader keeps a side table from path tuples to 1-based line numbers. Syntax errors become a
ConfigError that names file:line:column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hydra_supervisor.errors import ConfigError

PathKey = tuple[str | int, ...]


@dataclass
class Sourced:
    """A parsed YAML document plus the line of each path in it."""

    file: str
    data: Any
    lines: dict[PathKey, int] = field(default_factory=dict)

    def where(self, path: PathKey) -> str:
        """``file:line`` for ``path``, falling back to the nearest parent that has a line."""
        probe = path
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe, 1)
        return f"{self.file}:{line}"


def _convert(node: yaml.Node, path: PathKey, lines: dict[PathKey, int], file: str) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
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


def load_text(text: str, file: str) -> Sourced:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else file
        raise ConfigError(f"{where}: YAML syntax error: {exc.problem or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: YAML error: {exc}") from exc
    lines: dict[PathKey, int] = {}
    data = None if node is None else _convert(node, (), lines, file)
    return Sourced(file=file, data=data, lines=lines)


def load_file(path: Path) -> Sourced:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    return load_text(text, str(path))
