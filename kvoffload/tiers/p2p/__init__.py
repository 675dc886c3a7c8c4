"""The p2p tier (``type: "p2p"``): other instances' host tiers, reached host to host (arena to arena).

One module per part (DESIGN.md §4, "The p2p tier"): :mod:`.config` (its settings), :mod:`.tier` (the engine
thread's :class:`P2PTier`), :mod:`.node` (the node thread: every socket, both roles), :mod:`.server` (the
serving role, socket-free), :mod:`.locations` (where chunks are, from peers' KV events),
:mod:`.worker_handle` (the peer worker's engine-side handle). The control protocol is
:mod:`kvoffload.ipc.peer_messages`; the bytes move in :mod:`kvoffload.workers.p2p_worker`.
"""

from __future__ import annotations

from kvoffload.tiers.p2p.config import SECRET_ENV, P2PTierConfig, parse_peer
from kvoffload.tiers.p2p.tier import P2PTier

__all__ = ["SECRET_ENV", "P2PTier", "P2PTierConfig", "parse_peer"]
