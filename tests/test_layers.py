"""The folders are layers (docs/architecture.md): nothing below the serving layers imports them."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hydra_supervisor"
LOW = {"config", "plan", "proc", "router", "wire", "tools"}
HIGH = {"serve", "runtime", "dashboard", "cli"}
IMPORT = re.compile(r"^\s*(?:from|import) hydra_supervisor\.([a-z_]+)", re.M)


def test_no_low_layer_imports_a_serving_layer() -> None:
    bad = [f"{f.relative_to(PKG)}: hydra_supervisor.{m.group(1)}"
           for layer in LOW for f in (PKG / layer).rglob("*.py")
           for m in IMPORT.finditer(f.read_text()) if m.group(1) in HIGH]
    assert not bad, bad


def test_every_module_lives_in_a_layer() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "jsontypes.py"], top
