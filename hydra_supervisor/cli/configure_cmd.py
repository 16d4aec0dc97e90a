"""`hydra configure KEY=VALUE…`: send one CONFIGURE (0x40) to an engine port and print the reply.

The same path Hydra.Core uses (the wire protocol through the engine's router), so what the
operator sees is what a coordinator gets: the tier, what changed, what was already so, unknown
keys, or why it was refused. VALUE is read as JSON when it parses (`0.2`, `true`, `[21,44]`)
and as a string otherwise (`q8_0`, `21/44`); the server's key table does the rest.
Exit status (runtime/exits.py): 0 applied (or nothing to do), 1 refused or unknown keys, 2 usage
or another connection error (host unreachable, no complete reply), 3 nothing listens on the port.

Only hydra's owner may change settings (docs/protocol.md "Trust model"): on the same host that
is hydra's own user (or root); from elsewhere, `--token-file` presents the token hydra keeps in
its state dir (`STATE/wire.token`, copied over a private channel).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from hydra_supervisor.cli.clickutil import PORT, exits_2
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.runtime import exits
from hydra_supervisor.wire import client, tiers, trust
from hydra_supervisor.wire.codec import Op, Status


def parse_settings(items: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise click.UsageError(f"expected KEY=VALUE, got {item!r}")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


def describe(status: int, meta: dict[str, Any]) -> list[str]:
    """The reply as lines for a human."""
    if status != Status.OK:
        name = Status(status).name if status <= max(Status) else str(status)
        return [f"refused ({name}): {meta.get('error', meta)}"]
    lines = []
    applied = meta.get("params_applied") or {}
    if meta.get("noop") or not applied:
        lines.append("nothing to change")
    else:
        kv = ", ".join(f"{k}={json.dumps(v)}" for k, v in applied.items())
        lines.append(f"applied ({meta.get('tier')}): {kv}")
    if meta.get("restarted"):
        lines.append(f"restarted: {', '.join(map(str, meta['restarted']))}")
    if meta.get("unchanged"):
        lines.append(f"already set: {', '.join(meta['unchanged'])}")
    if "state_chunk_size_applied" in meta:
        lines.append(f"state_chunk_size_applied: {meta['state_chunk_size_applied']}")
    if meta.get("unknown_keys"):
        lines.append(f"unknown keys (ignored): {', '.join(meta['unknown_keys'])}; "
                     "`hydra configure --keys` lists the recognised ones")
    return lines


def keys_table() -> str:
    rows = [("key", "tier", "maps to", "aliases")]
    rows += [(k, t, where, aliases) for k, aliases, t, where, _ in tiers.table_rows()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip()
        for r in rows
    )


def _address(host: str | None, port: int | None) -> tuple[str, int]:
    """Where CONFIGURE goes: --host/--port as given; else the running hydra's port (found
    through the state dir, whatever --port it was started with); else 127.0.0.1:8080."""
    if port is not None and host is not None:
        return host, port
    from hydra_supervisor.cli import running

    snap = running.snapshot() if host is None or host in ("127.0.0.1", "localhost") else None
    ports = [p for p in running.http_ports(snap) if p.router is not None] if snap else []
    if port is not None:
        mine = next((p for p in ports if p.port == port), None)
        return host or (client_host(mine.host) if mine else "127.0.0.1"), port
    if len(ports) > 1:
        urls = ", ".join(p.url for p in ports)
        raise HydraError(f"the hydra running here serves several ports ({urls})",
                         hint="name one: hydra configure -p PORT")
    if ports:
        return host or client_host(ports[0].host), ports[0].port
    return host or "127.0.0.1", 8080


def _token_from(path: Path) -> str:
    """--token-file's token: a readable regular file holding one token and nothing else
    (what `hydra up` writes to STATE/wire.token); anything else is refused, never sent."""
    from hydra_supervisor.config import infile

    hint = "--token-file names a copy of STATE/wire.token (64 hex digits)"
    infile.check(path, "--token-file", hint=hint)
    try:
        with path.open("rb") as fh:
            raw = fh.read(4 * trust.TOKEN_BYTES + 1)
    except OSError as e:
        raise HydraError(f"--token-file {path} cannot be read: {e.strerror or e}",
                         hint=hint) from None
    token = raw.decode(errors="replace").strip()
    if not trust.is_token(token):
        shown = f"{len(raw):,} bytes" if len(raw) <= 4 * trust.TOKEN_BYTES else "more bytes"
        raise HydraError(f"--token-file {path} holds no hydra token ({shown}; a token is "
                         f"{2 * trust.TOKEN_BYTES} hex digits): nothing was sent", hint=hint)
    return token


@click.command("configure")
@click.argument("settings", nargs=-1)
@click.option("--host", default=None,
              help="engine host [default: the running hydra's, else 127.0.0.1]")
@click.option("--port", "-p", type=PORT, default=None,
              help="the engine's external port (its router relays the Hydra protocol) "
                   "[default: the running hydra's port, else 8080]")
@click.option("--slot", default="0", show_default=True, help="the request key")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="seconds to wait; a T2/T3 change restarts processes")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="present the owner's token from this file (STATE/wire.token); not needed "
                   "as hydra's own user on its host")
@click.option("--json", "as_json", is_flag=True, help="print the reply meta as JSON")
@click.option("--keys", "list_keys", is_flag=True, help="list the recognised keys and exit")
@exits_2
def configure_command(settings: tuple[str, ...], host: str | None, port: int | None, slot: str,
                      timeout: float, token_file: Path | None, as_json: bool,
                      list_keys: bool) -> None:
    """Change an engine's settings at runtime: T1 (sampling, n_predict…) without a restart,
    T2 (context, KV types, batch…) and T3 (model, split, peers…) by restarting only what they
    affect; ports, host and binaries (T4) are refused. Example:
    `hydra configure temperature=0.2 n_predict=256` (the running hydra's port; -p names
    one)."""
    if list_keys:
        click.echo(keys_table())
        return
    if not settings:
        raise click.UsageError("give at least one KEY=VALUE (or --keys to list them)")
    params = parse_settings(settings)
    host, port = _address(host, port)
    token = None
    if token_file is not None:
        token = _token_from(token_file)
    try:
        status, meta, _ = client.request(host, port, Op.CONFIGURE, slot,
                                         json.dumps(params).encode(), timeout=timeout,
                                         trace=trust.with_token(token))
    except client.NotListening as e:
        click.echo(f"error: {e}\n  fix: is hydra up on that port? (`hydra status` shows its "
                   "ports; -p PORT names one)", err=True)
        raise SystemExit(exits.NOT_RUNNING) from None
    except client.WireError as e:
        raise HydraError(str(e), hint="check --host and --port") from None
    if as_json:
        click.echo(json.dumps({"status": status, **meta}, indent=2))
    else:
        for line in describe(status, meta):
            click.echo(line, err=status != Status.OK)
    if status != Status.OK or meta.get("unknown_keys"):
        raise SystemExit(exits.FAILED)
