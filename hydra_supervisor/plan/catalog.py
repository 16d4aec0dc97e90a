"""Every profile hydra can find, read and planned for this node: `hydra profiles`.

Each profile is read and planned the way `hydra plan` does it (the node file and the device
inventory read once for all of them, GGUF facts from modelinfo's cache, flags from the binaries'
cached `--help`, no port probed), and gets a verdict: usable, or why not, with the first
problem's text (file:line where the problem is in a file):

  broken        the file cannot be read as a profile: YAML syntax, an unknown key, a bad value
  model missing the model file (or alias) is not there, or is not a GGUF hydra can read
  does not fit  the layout does not fit the devices of this node (the planner's own check)
  unknown flag  a server_args key llama-server's --help does not list
  invalid       any other planning error (an unknown device, peers in a SOLO, ...)
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from hydra_supervisor.config import models
from hydra_supervisor.config.config import (
    Mode,
    Node,
    find_node_file,
    known_profiles,
    load_node,
    load_profile,
)
from hydra_supervisor.config.profile import Profile
from hydra_supervisor.config.yamlsrc import load_file
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import devices, flagcheck, layout
from hydra_supervisor.plan.devices import Inventory
from hydra_supervisor.plan.modelinfo import inspect
from hydra_supervisor.plan.placement import DoesNotFit


class ProfileEntry(TypedDict):
    """One row of `hydra profiles --json` (docs/profiles.md, "Listing profiles")."""

    name: str  # what `-p` takes (the file's stem)
    path: str
    description: str  # "" when the profile has none (or cannot be read)
    mode: str | None  # solo | combine | peer; None when the file cannot be read
    model: str | None  # the profile's `model:` as written (None: mode peer, or unreadable)
    devices: list[str]  # the head first, then the peers
    usable: bool
    problem: str | None  # broken | model missing | does not fit | unknown flag | invalid
    reason: str | None  # the problem's message (first line: file:line where there is one)


class PeerMemory:
    """What each remote device's peer host reports (layout.peer_memory), asked once per
    device however many profiles name it."""

    def __init__(self, node: Node, inv: Inventory) -> None:
        self.devs = devices.devices(node, inv)
        self.asked: dict[str, tuple[int, int] | None] = {}

    def for_peers(self, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
        new = [n for n in names if n not in self.asked]
        if new:
            got = layout.peer_memory(self.devs, new)
            self.asked.update({n: got.get(n) for n in new})
        return {n: mem for n in names if (mem := self.asked.get(n)) is not None}


def entry(name: str, path: Path, node: Node, inv: Inventory,
          peers: PeerMemory | None = None) -> ProfileEntry:
    row = ProfileEntry(name=name, path=str(path), description="", mode=None, model=None,
                       devices=[], usable=False, problem=None, reason=None)
    try:
        prof = load_profile(path, node)
    except HydraError as exc:
        return {**row, "problem": "broken", "reason": str(exc)}
    row = {**row, "description": prof.description, "mode": prof.mode.value,
           "model": prof.model if prof.mode is not Mode.PEER else None,
           "devices": [prof.head, *prof.peers]}
    problem = _plan_problem(prof, path, node, inv, peers or PeerMemory(node, inv))
    if problem is not None:
        return {**row, "problem": problem[0], "reason": problem[1]}
    return {**row, "usable": True}


def _plan_problem(prof: Profile, path: Path, node: Node, inv: Inventory, peers: PeerMemory
                  ) -> tuple[str, str] | None:
    if prof.mode is not Mode.PEER:
        try:
            inspect(models.resolve_model(prof.model, node, path.parent))
        except HydraError as exc:
            where = load_file(path).where(("model",)) if path.is_file() else prof.source
            return "model missing", f"{where}: {exc}"
    try:
        layout.build(str(path), profile=prof, check_ports=False, read_node=node,
                     inventory=inv, remote_memory=peers.for_peers(prof.peers))
    except DoesNotFit as exc:
        return "does not fit", str(exc)
    except flagcheck.UnknownFlag as exc:
        return "unknown flag", str(exc)
    except HydraError as exc:
        return "invalid", str(exc)
    return None


def survey(profiles_dir: str | None = None, node_file: str | None = None
           ) -> list[ProfileEntry]:
    """Every profile `hydra up -p NAME` can find (first directory wins), checked."""
    node = load_node(find_node_file(node_file))
    inv = devices.inventory()
    peers = PeerMemory(node, inv)
    return [entry(name, path, node, inv, peers)
            for name, path in sorted(known_profiles(profiles_dir).items())]
