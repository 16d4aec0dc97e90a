"""`hydra systemd render|install`: the I/O around systemd_units (find this node's facts, write
the files, create the user, reload systemd). cli.py's _LazyGroup imports this module when
`hydra systemd` is run.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import click

from hydra_supervisor.cli.clickutil import exits_2
from hydra_supervisor.config.config import find_node_file, find_profile, load_node, load_profile
from hydra_supervisor.config.paths import repo_root
from hydra_supervisor.errors import HydraError
from hydra_supervisor.tools import binaries, systemd_units
from hydra_supervisor.tools.systemd_units import UnitOptions

DEFAULT_UNIT_DIR = "/etc/systemd/system"
GPU_GROUPS = ("video", "render")  # who may open /dev/dri, and /dev/nvidia* on some distros




def hydra_command() -> tuple[str, ...]:
    """The absolute command that runs this hydra: the console script next to this Python (a
    venv's bin/), else `hydra` on PATH, else `python -m hydra_supervisor`."""
    beside = Path(sys.executable).with_name("hydra")
    if beside.is_file() and os.access(beside, os.X_OK):
        return (str(beside.absolute()),)
    found = shutil.which("hydra")
    if found:
        return (str(Path(found).absolute()),)
    return (str(Path(sys.executable).absolute()), "-m", "hydra_supervisor")


def _existing_groups(names: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for name in names:
        try:
            grp.getgrnam(name)
        except KeyError:
            continue  # systemd refuses to start a unit whose SupplementaryGroups= is unknown
        out.append(name)
    return tuple(out)


def options_for_this_node(*, node_file: str | None = None, profiles_dir: str | None = None,
                          user: str = "hydra", profile: str | None = None,
                          hydra: tuple[str, ...] | None = None) -> UnitOptions:
    """Read this node's facts: hydra's path, the node file, the llama.cpp build it runs, the
    profile dirs, and (for `profile`) its port and model; every one checked now, so a typo
    fails here with its file:line rather than at the first `systemctl start`."""
    node_path = find_node_file(node_file)
    node = load_node(node_path)
    dirs = [f"{systemd_units.ETC_DIR}/profiles"]
    if profiles_dir:
        dirs.insert(0, str(Path(profiles_dir).absolute()))
    read: list[str] = [str(repo_root())]  # the built-in profiles/ and the package itself
    read += [str(Path(d).expanduser().absolute()) for d in node.model_dirs]
    read += [str(Path(m).expanduser().absolute()) for m in node.models.values()]
    try:
        found = binaries.find("llama-server", dict(node.binaries))
        bin_dir: str | None = str(found.path.parent.absolute())
        if found.origin.startswith("node file"):
            bin_dir = None  # the node file already says where; the service reads the same file
    except HydraError:
        bin_dir = None
    port = None
    if profile is not None:
        path = find_profile(profile, profiles_dir)
        prof = load_profile(path, node)
        port = prof.port
        read.append(str(path.absolute()))
        if prof.model:
            from hydra_supervisor.config.models import resolve_model

            try:
                read.append(str(resolve_model(prof.model, node, path.parent).absolute()))
            except HydraError:
                pass  # `hydra up` says what is missing; the unit need not
    opts = UnitOptions(
        hydra=hydra or hydra_command(),
        user=user,
        group=user,
        supplementary_groups=_existing_groups(GPU_GROUPS),
        node_file=str(node_path.absolute()) if node_path else None,
        profile_dirs=tuple(dirs),
        llama_bin_dir=bin_dir,
        read_paths=tuple(read),
        docs=str(repo_root() / "docs" / "operations.md"),
    )
    return systemd_units.with_profile_port(opts, port) if port is not None else opts


def unreadable_by_others(paths: list[str]) -> list[str]:
    """Paths the service user probably cannot reach: a directory on the way without o+x (a
    build in /root/.cache, a checkout in a 0700 home). Best effort, for a warning: group
    membership and ACLs can still allow it."""
    bad = []
    for raw in paths:
        path = Path(raw)
        for part in [*reversed(path.parents), path]:
            try:
                st = part.stat()
            except OSError:
                break
            if part.is_dir() and not st.st_mode & 0o001:
                bad.append(f"{raw} (directory {part} is not searchable by other users)")
                break
    return bad


def verify(paths: list[Path]) -> str | None:
    """`systemd-analyze verify` on rendered files: None when clean, else its complaints
    (it exits 0 on unknown keys but prints them, so any output counts as a failure)."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        return None
    proc = subprocess.run([tool, "verify", *map(str, paths)], capture_output=True, text=True,
                          timeout=60, check=False)
    text = (proc.stdout + proc.stderr).strip()
    return text or (f"systemd-analyze verify exited {proc.returncode}"
                    if proc.returncode else None)


@click.group("systemd")
def systemd() -> None:
    """Run hydra under systemd: render or install its units."""


_profile = click.option("--profile", "-p", "profiles", multiple=True,
                        help="the profile hydra.service (the node's one unit) starts; several "
                             "are served together, routed by model; without it, the node "
                             "file's profiles: list, else model-less (hydra up --no-profile)")
_node = click.option("--node", "node_file", default=None,
                     help="node file the units use (default: $HYDRA_NODE, "
                          "~/.config/hydra/node.yaml)")
_dir = click.option("--profiles-dir", default=None, help="extra directory of profiles")
_user = click.option("--user", default="hydra", show_default=True,
                     help="the dedicated user the service runs as")


def _node_profiles(node_file: str | None, example: bool) -> tuple[str, ...]:
    """The node file's `profiles:` list (what a plain `hydra up` serves)."""
    if example:
        return ()
    return load_node(find_node_file(node_file)).profiles


@systemd.command()
@_profile
@_node
@_dir
@_user
@click.option("--output", "-o", type=click.Path(file_okay=False), default=None,
              help="write the unit files into DIR (default: print them)")
@click.option("--example", is_flag=True, hidden=True,
              help="render the repository's example (a venv at /opt/hydra)")
@exits_2
def render(profiles: tuple[str, ...], node_file: str | None, profiles_dir: str | None,
           user: str, output: str | None, example: bool) -> None:
    """Render this node's units: hydra@.service (instance = profile) and hydra.service (the
    node's one hydra, starting --profile or model-less)."""
    if example:
        opts = systemd_units.example_options()
    else:
        opts = options_for_this_node(node_file=node_file, profiles_dir=profiles_dir,
                                     user=user, profile=profiles[0] if profiles else None)
    units = systemd_units.render(opts, profiles, _node_profiles(node_file, example))
    if not example:
        _warn_unreadable(opts)
    if output is None:
        for name, text in units.items():
            click.echo(f"# ---- {name}")
            click.echo(text, nl=False)
        return
    out_dir = Path(output)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        (out_dir / name).write_text(text)
        click.echo(f"wrote {out_dir / name}")


@systemd.command()
@_profile
@_node
@_dir
@_user
@click.option("--unit-dir", default=DEFAULT_UNIT_DIR, show_default=True,
              help="where unit files go")
@click.option("--no-user", is_flag=True, help="do not create the user (it exists, or is "
                                                "managed elsewhere)")
@click.option("--no-reload", is_flag=True, help="do not run `systemctl daemon-reload`")
@exits_2
def install(profiles: tuple[str, ...], node_file: str | None, profiles_dir: str | None,
            user: str, unit_dir: str, no_user: bool, no_reload: bool) -> None:
    """Install the units (verified first), create the service user, reload systemd."""
    opts = options_for_this_node(node_file=node_file, profiles_dir=profiles_dir, user=user,
                                 profile=profiles[0] if profiles else None)
    units = systemd_units.render(opts, profiles, _node_profiles(node_file, False))
    _warn_unreadable(opts)
    target = Path(unit_dir)
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise HydraError(f"cannot write unit files to {target}",
                         hint="run it as root (sudo), or pass --unit-dir")
    staging = target / ".hydra-staging"
    staging.mkdir(parents=True, exist_ok=True)
    try:
        for name, text in units.items():
            (staging / name).write_text(text)
        problems = verify([staging / name for name in units])
        if problems:
            raise HydraError(f"the rendered units do not verify:\n{problems}",
                             hint="`hydra systemd render` shows them; fix the cause and rerun")
        for name in units:
            (staging / name).replace(target / name)
            click.echo(f"installed {target / name}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not no_user:
        _ensure_user(opts)
    if not no_reload and Path("/run/systemd/system").is_dir():
        subprocess.run(["systemctl", "daemon-reload"], check=False, timeout=60)
    click.echo("next: systemctl enable --now hydra@PROFILE   (one hydra per profile), or")
    click.echo(f"      systemctl enable --now hydra.service  (one hydra for the node, "
               f"{'starting ' + ', '.join(profiles) if profiles else 'model-less'}; "
               "`hydra switch`)")
    click.echo(f"      put node.yaml and profiles/ in {systemd_units.ETC_DIR} (or keep the "
               "paths baked into the unit), then `journalctl -u 'hydra*' -f`")


def _warn_unreadable(opts: UnitOptions) -> None:
    paths = [*opts.hydra[:1], *(p for p in (opts.node_file, opts.llama_bin_dir) if p),
             *opts.read_paths]
    for what in unreadable_by_others(paths):
        click.echo(f"warning: user {opts.user} may not read {what}; install hydra, its "
                   "binaries and models somewhere it can (e.g. /opt/hydra, /var/cache/hydra)",
                   err=True)


def _ensure_user(opts: UnitOptions) -> None:
    try:
        pwd.getpwnam(opts.user)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise HydraError(f"user {opts.user} does not exist and useradd is not available",
                         hint=f"create a system user {opts.user}, or pass --no-user")
    cmd = [useradd, "--system", "--user-group", "--home-dir", "/var/lib/hydra",
           "--no-create-home", "--shell", "/usr/sbin/nologin"]
    if opts.supplementary_groups:
        cmd += ["--groups", ",".join(opts.supplementary_groups)]
    proc = subprocess.run([*cmd, opts.user], capture_output=True, text=True, check=False,
                          timeout=60)
    if proc.returncode != 0:
        raise HydraError(f"useradd {opts.user} failed: {proc.stderr.strip()}")
    click.echo(f"created system user {opts.user}")


__all__ = ["hydra_command", "options_for_this_node", "systemd", "verify"]
