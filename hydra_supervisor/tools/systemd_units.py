"""systemd units for hydra: what they say and why, rendered from this node's facts.

Pure text from `UnitOptions` (the I/O that finds hydra's path, the node file and the binaries is
in `options_for_this_node`), so a golden test pins the output and `systemd-analyze verify`
checks it. Two shapes:
  - `hydra@.service`, a template whose instance is the profile: `systemctl enable --now
    hydra@dense27b-combine` runs `hydra up --profile dense27b-combine`, state in
    /var/lib/hydra/<profile>;
  - `hydra.service`, one unit for the node, starting one profile or none (`hydra up
    --no-profile`); `hydra switch` changes the layout at run time without touching the unit;
    state in /var/lib/hydra/node.
Both: Type=notify (hydra sends READY=1 only after its engines are health-gated), a watchdog,
SIGHUP to reload, SIGTERM to the main process only (hydra stops its own children: group TERM,
bounded wait, KILL), a dedicated user, and hardening that still lets llama.cpp open the GPUs.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

TEMPLATE_NAME = "hydra@.service"
NODE_UNIT_NAME = "hydra.service"
NODE_STATE_NAME = "node"  # /var/lib/hydra/node for hydra.service
ETC_DIR = "/etc/hydra"  # ConfigurationDirectory=hydra: a place for node.yaml and profiles/
# Directories whose contents ProtectHome=yes would hide from the service.
HOME_ROOTS = ("/home", "/root", "/run/user")


@dataclass(frozen=True)
class UnitOptions:
    """Everything a unit says that differs between nodes."""

    hydra: tuple[str, ...]  # absolute command that runs hydra, e.g. ("/opt/hydra/.venv/bin/hydra",)
    user: str = "hydra"
    group: str = "hydra"
    supplementary_groups: tuple[str, ...] = ()  # e.g. video/render where they exist
    node_file: str | None = None  # HYDRA_NODE
    profile_dirs: tuple[str, ...] = (f"{ETC_DIR}/profiles",)  # HYDRA_PROFILE_PATH
    llama_bin_dir: str | None = None  # HYDRA_LLAMA_BIN_DIR: the build this node runs
    read_paths: tuple[str, ...] = ()  # what the service must read (decides ProtectHome)
    watchdog_sec: int = 30
    start_timeout_sec: int = 900  # a big model over ggml-RPC loads for minutes
    stop_timeout_sec: int = 90
    restart_sec: int = 5
    nofile: int = 65536
    bind_below_1024: bool = False  # the profile's port needs CAP_NET_BIND_SERVICE
    extra_env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    docs: str | None = None  # absolute path of docs/operations.md, for Documentation=

    @property
    def protect_home(self) -> str:
        """`yes` hides /home, /root and /run/user; `read-only` when hydra, its binaries,
        models or profiles live there (a checkout in someone's home, the pip-installed demo
        model in a venv under /root)."""
        paths = [*self.hydra[:1], *(p for p in (self.node_file, self.llama_bin_dir) if p),
                 *self.profile_dirs, *self.read_paths]
        under_home = any(Path(p) == Path(r) or Path(r) in Path(p).parents
                         for p in paths for r in HOME_ROOTS)
        return "read-only" if under_home else "yes"


def example_options() -> UnitOptions:
    """The checked-in example (systemd/hydra@.service): a venv at /opt/hydra."""
    return UnitOptions(hydra=("/opt/hydra/.venv/bin/hydra",), node_file=f"{ETC_DIR}/node.yaml")


def _env_line(key: str, value: str) -> str:
    # systemd's Environment= takes "KEY=VALUE" quoted as a whole when it contains spaces.
    text = f"{key}={value}"
    return f'Environment="{text}"' if any(c.isspace() for c in text) else f"Environment={text}"


def _exec(argv: Sequence[str]) -> str:
    # systemd's own quoting is close enough to the shell's for paths and names; `%` is a
    # specifier in unit files and must be doubled, except in %i which we add on purpose.
    return " ".join(shlex.quote(a).replace("%", "%%") for a in argv)


def _service(opts: UnitOptions, *, description: str, exec_start: str, state: str,
             doc_note: Iterable[str]) -> str:
    env = [
        ("HYDRA_STATE_DIR", f"%S/hydra/{state}"),
        ("HYDRA_CACHE_DIR", "%C/hydra"),
        # ggml-rpc-server -c keeps its tensor cache under $LLAMA_CACHE (else ~/.cache).
        ("LLAMA_CACHE", "%C/hydra/llama.cpp"),
        ("HYDRA_PROFILE_PATH", ":".join(opts.profile_dirs)),
        ("PYTHONUNBUFFERED", "1"),
    ]
    if opts.node_file:
        env.append(("HYDRA_NODE", opts.node_file))
    if opts.llama_bin_dir:
        env.append(("HYDRA_LLAMA_BIN_DIR", opts.llama_bin_dir))
    env += list(opts.extra_env)
    caps = "CAP_NET_BIND_SERVICE" if opts.bind_below_1024 else ""
    lines = [
        *(f"# {n}" for n in doc_note),
        "[Unit]",
        f"Description={description}",
        *([f"Documentation=file://{opts.docs}"] if opts.docs else []),
        "After=network-online.target nvidia-persistenced.service",
        "Wants=network-online.target",
        # Restart=on-failure, but not forever: 5 failed starts in 10 minutes stop trying.
        "StartLimitIntervalSec=600",
        "StartLimitBurst=5",
        "",
        "[Service]",
        "Type=notify",
        # Only hydra itself may notify; its llama.cpp children never see $NOTIFY_SOCKET.
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        "ExecReload=/bin/kill -HUP $MAINPID",
        f"WatchdogSec={opts.watchdog_sec}",
        f"TimeoutStartSec={opts.start_timeout_sec}",
        f"TimeoutStopSec={opts.stop_timeout_sec}",
        # SIGTERM to hydra only: it stops its children (group TERM, bounded wait, KILL); what
        # is left after TimeoutStopSec gets SIGKILL from systemd.
        "KillMode=mixed",
        "Restart=on-failure",
        f"RestartSec={opts.restart_sec}",
        f"LimitNOFILE={opts.nofile}",
        # llama.cpp mlocks nothing by default; --mlock needs this raised.
        "LimitMEMLOCK=infinity",
        f"User={opts.user}",
        f"Group={opts.group}",
        *([f"SupplementaryGroups={' '.join(opts.supplementary_groups)}"]
          if opts.supplementary_groups else []),
        # /var/lib/hydra/<state>, /var/cache/hydra, /etc/hydra: created and owned for User=.
        f"StateDirectory=hydra/{state}",
        "StateDirectoryMode=0700",  # hydra keeps it so (filemodes.py; or 2750 with state_group)
        "CacheDirectory=hydra",
        "ConfigurationDirectory=hydra",
        "UMask=0077",
        *(_env_line(k, v) for k, v in env),
        "",
        "# Hardening. The GPUs stay reachable: no PrivateDevices= (it would hide /dev/nvidia*),",
        "# a closed device policy that allows every NVIDIA character device group (nvidia-frontend",
        "# = /dev/nvidia0..N, nvidiactl, nvidia-modeset; nvidia-uvm; nvidia-caps).",
        "# /proc stays whole (CUDA reads /proc/driver/nvidia), and memory may be W+X (CUDA's JIT).",
        "PrivateDevices=no",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia* rw",
        "DeviceAllow=/dev/nvidiactl rw",
        "DeviceAllow=/dev/nvidia-uvm rw",
        "DeviceAllow=/dev/nvidia-uvm-tools rw",
        "ProtectSystem=strict",
        f"ProtectHome={opts.protect_home}",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        f"CapabilityBoundingSet={caps}",
        f"AmbientCapabilities={caps}",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "SystemCallArchitectures=native",
        "# Not set on purpose: MemoryDenyWriteExecute (CUDA JIT), ProcSubset=pid (CUDA needs",
        "# /proc/driver/nvidia), PrivateUsers (device ownership). SystemCallFilter=@system-service",
        "# is a further step that has not been checked against CUDA drivers.",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def render_template(opts: UnitOptions) -> str:
    """hydra@.service: one hydra per profile, the instance name is the profile."""
    return _service(
        opts,
        description="hydra: llama.cpp layout %i",
        exec_start=f"{_exec([*opts.hydra, 'up', '--profile'])} %i",
        state="%i",
        doc_note=[
            "hydra@PROFILE: one hydra per profile, e.g. `systemctl enable --now "
            "hydra@dense27b-combine`.",
            "Rendered by `hydra systemd render`; re-render after moving hydra or its binaries.",
        ],
    )


def render_node_unit(opts: UnitOptions, profile: str | Sequence[str] | None,
                     node_profiles: Sequence[str] = ()) -> str:
    """hydra.service: the node's one hydra, starting `profile`, several profiles routed by
    model (`hydra up -p A -p B`; or plain `hydra up` for the node file's `profiles:` list,
    `node_profiles`), or model-less (`hydra up --no-profile`: the port answers 503 until
    `hydra switch NAME` loads a layout)."""
    names = [profile] if isinstance(profile, str) else list(profile or ())
    if len(names) == 1:
        args = ["up", "--profile", names[0]]
        starts = f"started with profile {names[0]}"
    elif names:
        args = ["up", *(a for n in names for a in ("-p", n))]
        starts = f"serving profiles {', '.join(names)}, routed by model"
    elif node_profiles:
        args = ["up"]
        starts = f"serving the node file's profiles ({', '.join(node_profiles)})"
    else:
        args = ["up", "--no-profile"]
        starts = "started model-less"
    return _service(
        opts,
        description=f"hydra: llama.cpp on this node ({starts})",
        exec_start=_exec([*opts.hydra, *args]),
        state=NODE_STATE_NAME,
        doc_note=[
            f"hydra.service: this node's hydra, {starts}; `hydra switch NAME` changes the "
            "layout at run time.",
            "Rendered by `hydra systemd render`; enable this or hydra@PROFILE instances, not "
            "both on one port.",
        ],
    )


def render(opts: UnitOptions, profile: str | Sequence[str] | None = None,
           node_profiles: Sequence[str] = ()) -> dict[str, str]:
    """File name -> text: the per-profile template and the node's one unit."""
    return {TEMPLATE_NAME: render_template(opts),
            NODE_UNIT_NAME: render_node_unit(opts, profile, node_profiles)}


def with_profile_port(opts: UnitOptions, port: int) -> UnitOptions:
    return replace(opts, bind_below_1024=0 < port < 1024)
