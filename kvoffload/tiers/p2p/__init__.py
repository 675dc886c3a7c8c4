"""The p2p tier (``type: "p2p"``): other instances' host tiers, reached host to host (arena to arena).

One module per part (DESIGN.md §4, "The p2p tier"):

- :mod:`.tier`: :class:`P2PTier`, the engine thread's side (lookups, jobs, verdicts, holds);
- :mod:`.config`: :class:`P2PTierConfig` and its checks; :mod:`.routing`: a request's routing
  from its ``kv_transfer_params``;
- :mod:`.commands`: the typed commands and results between the engine thread and the node thread;
- :mod:`.node`: the node thread: every socket, the poll loop, the wiring of the roles;
- :mod:`.client` and :mod:`.server`: the client and serving roles, socket-free;
- :mod:`.locations`: where chunks are, from the peers' KV events;
- :mod:`.worker_handle`: the engine side of the peer worker process.

The control protocol is :mod:`kvoffload.ipc.peer_messages`; the bytes move in the peer worker,
:mod:`kvoffload.workers.p2p_worker` over :mod:`kvoffload.workers.p2p_transport`.
"""

from __future__ import annotations

from kvoffload.tiers.p2p.config import SECRET_ENV, P2PTierConfig, parse_peer
from kvoffload.tiers.p2p.tier import P2PTier

__all__ = ["SECRET_ENV", "P2PTier", "P2PTierConfig", "parse_peer"]
