"""Client commands import only what they use (issue 18: `hydra --version` and `hydra status`
paid ~0.7 s of the daemon's imports). Checked by module, not by the clock."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("numpy", "gguf", "prometheus_client", "requests", "asyncio",
         "hydra_supervisor.runtime.daemon", "hydra_supervisor.serve.port",
         "hydra_supervisor.router.relay")


def _loaded_after(code: str) -> set[str]:
    probe = (f"import sys, json\n{code}\n"
             "print(json.dumps(sorted(sys.modules)))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60)
    return set(json.loads(res.stdout.strip().splitlines()[-1]))


def test_importing_the_cli_pulls_none_of_the_daemon() -> None:
    loaded = _loaded_after("import hydra_supervisor.cli.cli")
    assert not [m for m in HEAVY if m in loaded]


def test_status_json_without_a_hydra_pulls_none_of_the_daemon(tmp_path: Path) -> None:
    code = ("import os, sys\n"
            f"os.environ['HYDRA_STATE_DIR'] = {str(tmp_path)!r}\n"
            "from hydra_supervisor.cli import cli\n"
            "try:\n"
            "    cli.main(['status', '--json'], standalone_mode=False)\n"
            "except SystemExit:\n"
            "    pass")
    loaded = _loaded_after(code)
    assert not [m for m in HEAVY if m in loaded]


def test_synth_ftype_names_match_the_writer() -> None:
    from hydra_supervisor.cli import setup_cmds
    from hydra_supervisor.tools import synth

    assert setup_cmds.SYNTH_FTYPES == tuple(synth.FTYPES)
