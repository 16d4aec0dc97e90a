"""systemd units: what `hydra systemd render` writes passes `systemd-analyze verify` with no
complaint, says what the operations doc promises, and the checked-in example is the renderer's
own output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hydra_supervisor.cli.systemd_cmd import hydra_command, systemd, unreadable_by_others, verify
from hydra_supervisor.tools import systemd_units
from hydra_supervisor.tools.systemd_units import UnitOptions

REPO = Path(__file__).resolve().parent.parent
needs_verify = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (apt-get install systemd)")


def directives(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            out.append((key, value))
    return out


def one(text: str, key: str) -> str:
    values = [v for k, v in directives(text) if k == key]
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


@needs_verify
def test_rendered_units_verify_clean(tmp_path: Path) -> None:
    res = CliRunner().invoke(systemd, ["render", "--profile", "demo", "--output", str(tmp_path)])
    assert res.exit_code == 0, res.output
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["hydra.service", "hydra@.service"]
    assert verify(files) is None
    # an instance of the template verifies too (specifiers expanded)
    inst = tmp_path / "inst"
    inst.mkdir()
    shutil.copy(tmp_path / "hydra@.service", inst / "hydra@demo.service")
    assert verify([inst / "hydra@demo.service"]) is None


@needs_verify
def test_verify_reports_what_systemd_ignores(tmp_path: Path) -> None:
    """systemd-analyze exits 0 on an unknown key; verify() still counts it as a failure."""
    text = systemd_units.render_template(UnitOptions(hydra=hydra_command()))
    bad = tmp_path / "hydra@.service"
    bad.write_text(text.replace("Type=notify", "Type=notify\nWatchDogSec=30"))
    problems = verify([bad])
    assert problems and "WatchDogSec" in problems


def test_template_says_what_operations_md_promises() -> None:
    opts = UnitOptions(hydra=("/opt/hydra/.venv/bin/hydra",), node_file="/etc/hydra/node.yaml")
    text = systemd_units.render_template(opts)
    assert one(text, "Type") == "notify" and one(text, "NotifyAccess") == "main"
    assert one(text, "ExecStart") == "/opt/hydra/.venv/bin/hydra up --profile %i"
    assert one(text, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(text, "KillMode") == "mixed" and one(text, "Restart") == "on-failure"
    assert int(one(text, "WatchdogSec")) > 0 and int(one(text, "LimitNOFILE")) >= 65536
    assert one(text, "User") == "hydra" and one(text, "StateDirectory") == "hydra/%i"
    env = dict(v.split("=", 1) for k, v in directives(text) if k == "Environment")
    assert env["HYDRA_STATE_DIR"] == "%S/hydra/%i" and env["HYDRA_NODE"] == "/etc/hydra/node.yaml"
    # GPU access kept: no PrivateDevices, NVIDIA devices allowed under a closed policy
    assert one(text, "PrivateDevices") == "no" and one(text, "DevicePolicy") == "closed"
    allowed = [v for k, v in directives(text) if k == "DeviceAllow"]
    assert "char-nvidia* rw" in allowed and "/dev/nvidiactl rw" in allowed
    assert one(text, "ProtectSystem") == "strict" and one(text, "ProtectHome") == "yes"
    assert one(text, "NoNewPrivileges") == "yes" and one(text, "CapabilityBoundingSet") == ""
    assert "MemoryDenyWriteExecute" not in dict(directives(text))  # CUDA's JIT needs W+X


def test_node_unit_starts_the_profile() -> None:
    opts = UnitOptions(hydra=("/usr/bin/python3", "-m", "hydra_supervisor"))
    units = systemd_units.render(opts, "moe35b-solo")
    assert set(units) == {"hydra@.service", "hydra.service"}
    node = units["hydra.service"]
    assert one(node, "ExecStart") == "/usr/bin/python3 -m hydra_supervisor up --profile moe35b-solo"
    assert one(node, "StateDirectory") == "hydra/node"
    idle = systemd_units.render(opts)
    assert idle["hydra@.service"] == units["hydra@.service"]
    assert one(idle["hydra.service"], "ExecStart") == \
        "/usr/bin/python3 -m hydra_supervisor up --no-profile"
    several = systemd_units.render(opts, ("demo", "demo-moe-combine"))["hydra.service"]
    assert one(several, "ExecStart") == \
        "/usr/bin/python3 -m hydra_supervisor up -p demo -p demo-moe-combine"
    assert "routed by model" in one(several, "Description")
    listed = systemd_units.render(opts, (), ("a", "b"))["hydra.service"]
    assert one(listed, "ExecStart") == "/usr/bin/python3 -m hydra_supervisor up"
    assert "node file's profiles (a, b)" in one(listed, "Description")


def test_protect_home_and_low_ports() -> None:
    base = UnitOptions(hydra=("/opt/hydra/bin/hydra",))
    assert base.protect_home == "yes"
    assert UnitOptions(hydra=("/home/op/hydra/.venv/bin/hydra",)).protect_home == "read-only"
    assert UnitOptions(hydra=base.hydra, read_paths=("/root/models/x.gguf",)
                       ).protect_home == "read-only"
    assert UnitOptions(hydra=base.hydra, read_paths=("/homeless/x",)).protect_home == "yes"
    low = systemd_units.with_profile_port(base, 80)
    text = systemd_units.render_template(low)
    assert one(text, "AmbientCapabilities") == "CAP_NET_BIND_SERVICE"
    assert systemd_units.with_profile_port(base, 8080).bind_below_1024 is False


def test_percent_in_paths_is_escaped() -> None:
    text = systemd_units.render_node_unit(UnitOptions(hydra=("/opt/100%/hydra",)), "p")
    assert one(text, "ExecStart") == "/opt/100%%/hydra up --profile p"


def test_checked_in_example_is_rendered() -> None:
    want = systemd_units.render_template(systemd_units.example_options())
    got = (REPO / "systemd" / "hydra@.service").read_text()
    assert got == want, "regenerate: hydra systemd render --example --output systemd/"


@needs_verify
def test_checked_in_example_verifies(tmp_path: Path) -> None:
    text = (REPO / "systemd" / "hydra@.service").read_text()
    # the example's /opt/hydra venv does not exist here: point ExecStart at this hydra
    (tmp_path / "hydra@.service").write_text(
        text.replace("/opt/hydra/.venv/bin/hydra", " ".join(hydra_command())))
    assert verify([tmp_path / "hydra@.service"]) is None


def test_install_into_a_unit_dir(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    res = CliRunner().invoke(systemd, ["install", "--unit-dir", str(unit_dir), "--no-user",
                                       "--no-reload"])
    assert res.exit_code == 0, res.output
    assert (unit_dir / "hydra@.service").is_file() and (unit_dir / "hydra.service").is_file()
    assert "--no-profile" in (unit_dir / "hydra.service").read_text()
    assert not (unit_dir / ".hydra-staging").exists()
    assert "systemctl enable --now hydra@PROFILE" in res.output


def test_unknown_profile_fails_at_render_time() -> None:
    res = CliRunner().invoke(systemd, ["render", "--profile", "no-such-profile"])
    assert res.exit_code == 2 and "unknown profile 'no-such-profile'" in res.output


def test_unreadable_paths_are_named(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "bin").mkdir(parents=True)
    closed.chmod(0o700)
    try:
        found = unreadable_by_others([str(closed / "bin")])
    finally:
        closed.chmod(0o755)
    assert found and str(closed) in found[0]
