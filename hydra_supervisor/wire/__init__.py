"""The Hydra wire protocol on the engine port (docs/protocol.md).

- ``codec``: sans-IO frames and incremental parsers (bytes in, events out);
- ``tiers``: the one table of CONFIGURE keys (``tier_values``: their coercers and checks);
  ``tier_diff``: the pure tier diff and the mapping onto a profile;
- ``control``: the ``EngineControl`` protocol the engine implements, and ``ConfigureRefused``;
- ``slots``: llama-server's slot save/restore API as the handlers use it;
- ``handlers``: what each opcode does; ``server``: connections the router hands over, on its
  own threads (no port of its own); ``trust``: who may drive it (peer uid, the owner's token);
- ``client``: a blocking client (``hydra configure``, cli/configure_cmd.py, uses it).
docs/protocol.md is the protocol as served.
"""

from hydra_supervisor.wire.codec import Op, Status
from hydra_supervisor.wire.control import ConfigureRefused, EngineControl
from hydra_supervisor.wire.server import WireServer
from hydra_supervisor.wire.tier_diff import TierDiff, classify
from hydra_supervisor.wire.tiers import Tier

__all__ = [
    "ConfigureRefused",
    "EngineControl",
    "Op",
    "Status",
    "Tier",
    "TierDiff",
    "WireServer",
    "classify",
]
