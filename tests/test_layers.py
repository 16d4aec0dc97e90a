"""The folders are layers (docs/architecture.md): nothing below the serving layers imports them,
and `testing` (the stand-ins shared by tests and bench scripts) is the top: nothing else in the
package imports it."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hydra_supervisor"
LOW = {"config", "plan", "proc", "router", "wire", "tools"}
HIGH = {"serve", "runtime", "dashboard", "cli"}
TOP = {"testing"}
IMPORT = re.compile(r"^\s*(?:from|import) hydra_supervisor\.([a-z_]+)", re.M)
# every spelling of an import of hydra_supervisor.testing: absolute, `from hydra_supervisor
# import testing`, and relative (`from ..testing import x`, `from .. import testing`)
IMPORTS_TESTING = re.compile(
    r"^\s*(?:(?:from|import)\s+hydra_supervisor\.testing\b"
    r"|from\s+hydra_supervisor\s+import\s+[^\n]*\btesting\b"
    r"|from\s+\.+testing\b"
    r"|from\s+\.+\s+import\s+[^\n]*\btesting\b)", re.M)


def test_no_low_layer_imports_a_serving_layer() -> None:
    bad = [f"{f.relative_to(PKG)}: hydra_supervisor.{m.group(1)}"
           for layer in LOW for f in (PKG / layer).rglob("*.py")
           for m in IMPORT.finditer(f.read_text()) if m.group(1) in HIGH]
    assert not bad, bad


def test_nothing_outside_testing_imports_it() -> None:
    bad = [f"{f.relative_to(PKG)}: {m.group(0).strip()}"
           for f in PKG.rglob("*.py") if f.relative_to(PKG).parts[0] not in TOP
           for m in IMPORTS_TESTING.finditer(f.read_text())]
    assert not bad, bad


def test_the_import_check_sees_every_spelling() -> None:
    for line in ("from hydra_supervisor.testing.harness import Up",
                 "import hydra_supervisor.testing", "    from hydra_supervisor import testing",
                 "from ..testing import faults", "from .. import cli, testing"):
        assert IMPORTS_TESTING.search(line), line
    for line in ("from hydra_supervisor.tools import testing_support",
                 "# see hydra_supervisor/testing", "from .testingx import y"):
        assert not IMPORTS_TESTING.search(line), line


def test_every_module_lives_in_a_layer() -> None:
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "jsontypes.py"], top
    folders = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert folders == LOW | HIGH | TOP, folders ^ (LOW | HIGH | TOP)
