"""Transparency: llama.cpp's own server tests give the same outcome, test by test, against
llama-server directly and behind hydra's Router (bench/llama_suite.py, the fast subset: CORS
headers, /metrics headers, a 204 through /cors-proxy, basic completions and streams).

Skipped when the pinned llama.cpp build, its source tree (the suite) or the suite's Python
packages (extra `suite`) or the Gemma model are missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "llama_suite.py"


def _suite_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_suite", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(1500)
def test_fast_subset_same_outcomes_direct_and_behind_the_router(tmp_path: Path) -> None:
    why = _suite_module().unavailable()
    if why:
        pytest.skip(f"llama.cpp server suite unavailable: {why}")
    out = tmp_path / "outcomes.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--subset", "fast", "--json", str(out),
         "--keep", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=1400, cwd=REPO)
    assert out.is_file(), f"no outcomes (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    rep = json.loads(out.read_text())
    direct, routed = rep["runs"]["direct"], rep["runs"]["router"]
    assert direct["results"], proc.stdout
    assert direct["results"].keys() == routed["results"].keys(), proc.stdout
    # The subset must really have exercised the server: most of it passes directly.
    assert direct["counts"].get("passed", 0) >= len(direct["results"]) // 2, proc.stdout
    assert rep["differences"] == [], proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
