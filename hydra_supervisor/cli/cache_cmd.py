"""`hydra cache prefill|status`: fill a ggml-rpc-server's tensor cache (-c) from a local GGUF by
hand, or say how much of a model is in it (rpccache.py). Registered in cli.py as a lazy group.

MODEL is resolved as a profile's `model:` (an alias, a node file's models: name, or a path).
The cache dir is, in this order: --dir; the dir the rpc-server of peer profile --profile uses
(its env: LLAMA_CACHE); the dir a ggml-rpc-server -c started from this shell uses
($LLAMA_CACHE/rpc, else ~/.cache/llama.cpp/rpc). With --profile and no MODEL, the profile's own
`prefill:` list is used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hydra_supervisor.cli.clickutil import exits_2
from hydra_supervisor.cli.lazy import lazy_module
from hydra_supervisor.errors import HydraError
from hydra_supervisor.runtime import exits

if TYPE_CHECKING:
    from hydra_supervisor.tools import rpccache
else:  # numpy and gguf-py load when a command runs, not for `hydra --help`
    rpccache = lazy_module("hydra_supervisor.tools.rpccache")

_node = click.option("--node", "node_file", default=None,
                     help="node file (default: $HYDRA_NODE, ~/.config/hydra/node.yaml)")
_dir = click.option("--dir", "cache_dir", type=click.Path(path_type=Path), default=None,
                    help="the rpc-server's cache dir (default: as ggml-rpc-server -c picks it)")
_profile = click.option("--profile", "-p", default=None,
                        help="a mode: peer profile: its rpc-server's cache dir, and with no "
                             "MODEL its prefill: list")
_profiles_dir = click.option("--profiles-dir", default=None, help="extra directory of profiles")


def _targets(models: tuple[str, ...], cache_dir: Path | None, profile: str | None,
             node_file: str | None, profiles_dir: str | None) -> tuple[list[Path], Path]:
    from hydra_supervisor.config import models as model_refs
    from hydra_supervisor.config.config import find_node_file, find_profile, load_node, load_profile
    from hydra_supervisor.config.profile import Mode

    node = load_node(find_node_file(node_file))
    env: dict[str, str] = dict(os.environ)
    paths: list[Path] = []
    if profile is not None:
        ppath = find_profile(profile, profiles_dir)
        prof = load_profile(ppath, node)
        if prof.mode is not Mode.PEER:
            raise HydraError(f"{ppath}: --profile takes a mode: peer profile (it runs the "
                             f"ggml-rpc-server whose cache this fills); this one is "
                             f"mode: {prof.mode.value}")
        env.update(prof.env)
        if not models:
            if not prof.prefill:
                raise HydraError(f"{ppath} has no prefill: list; name a MODEL")
            paths = [Path(p) for p in rpccache.resolve_prefill(prof.prefill, node, ppath.parent,
                                                                str(ppath))]
    if models:
        paths = [model_refs.resolve_model(m, node, Path.cwd()) for m in models]
    if not paths:
        raise HydraError("name a MODEL (an alias or a .gguf path), or a peer --profile with a "
                         "prefill: list")
    return paths, cache_dir if cache_dir is not None else rpccache.default_cache_dir(env)


def _bar(label: str) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(TextColumn(label + " {task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _updater(bar: Any, name: str) -> rpccache.Progress:
    task = bar.add_task(name, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return update


@click.group("cache")
def cache() -> None:
    """ggml-rpc-server's tensor cache (-c): fill it from local GGUFs so heads send only hashes."""


@cache.command("prefill")
@click.argument("models", nargs=-1)
@_dir
@_profile
@_node
@_profiles_dir
@click.option("--verify", is_flag=True,
              help="re-hash files already there and rewrite any that do not match")
@exits_2
def prefill_cmd(models: tuple[str, ...], cache_dir: Path | None, profile: str | None,
                node_file: str | None, profiles_dir: str | None, verify: bool) -> None:
    """Write every weight over 10 MiB of MODEL(s) as <dir>/<FNV-1a 64>, as a remote load would.

    A head loading the same GGUF onto this host's ggml-rpc-server -c then sends hashes, not
    weights. Files already there with the right size are kept; safe to run while the server
    runs (each file appears whole, by rename)."""
    paths, cdir = _targets(models, cache_dir, profile, node_file, profiles_dir)
    for path in paths:
        with _bar("hashing + copying") as bar:
            res = rpccache.prefill(path, cdir, _updater(bar, path.name), verify=verify)
        click.echo(f"{path.name}: {rpccache.describe(res)}")


@cache.command("status")
@click.argument("models", nargs=-1)
@_dir
@_profile
@_node
@_profiles_dir
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--verify", is_flag=True, help="also re-hash every file present (reads them all)")
@exits_2
def status_cmd(models: tuple[str, ...], cache_dir: Path | None, profile: str | None,
               node_file: str | None, profiles_dir: str | None, as_json: bool,
               verify: bool) -> None:
    """How much of MODEL(s) is in the cache: tensors over 10 MiB, files present, bytes.

    The first look at a model hashes it (seconds per GB); later ones only stat files while
    the GGUF is unchanged. Exit status 1 when a file is missing."""
    paths, cdir = _targets(models, cache_dir, profile, node_file, profiles_dir)
    rows = []
    for path in paths:
        with _bar("hashing") as bar:
            st = rpccache.status(path, cdir, _updater(bar, path.name), verify=verify)
        rows.append(st)
    if as_json:
        click.echo(json.dumps([{
            "gguf": s.gguf, "cache_dir": s.cache_dir, "tensors": s.tensors, "bytes": s.bytes,
            "files": s.files, "cached": s.cached, "cached_bytes": s.cached_bytes,
            "missing": list(s.missing), "complete": s.complete} for s in rows], indent=2))
    else:
        mib = 1024 * 1024
        for s in rows:
            click.echo(f"{Path(s.gguf).name}: {s.cached}/{s.files} file(s) cached "
                       f"({s.cached_bytes / mib:.1f} of {s.bytes / mib:.1f} MiB in "
                       f"{s.tensors} tensor(s) over 10 MiB) in {s.cache_dir}"
                       + ("" if s.complete else f"; missing: {', '.join(s.missing[:4])}"
                          + (", ..." if len(s.missing) > 4 else "")))
    if not all(s.complete for s in rows):
        raise SystemExit(exits.FAILED)
