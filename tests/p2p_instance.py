"""A standalone kvoffload instance with a p2p tier, for the p2p tier tests: its own process, arena,
tiering manager, peer worker and node thread, as a second vLLM server would have.

Started as ``python tests/p2p_instance.py``; reads one JSON command per line on stdin and answers one
JSON line each on the stdout it was started with (fd 1 is pointed at stderr first: NIXL logs to
stdout). Commands (``op`` plus arguments):

- ``init(tiers, num_slots, row_bytes, name, extra, model)``: build the instance (``extra``: more
  ``kv_connector_extra_config`` keys, e.g. ``kv_events``; ``model``: its namespace's model, which
  peers must share); answers ``advertise`` (``host:port`` peers reach it at) and the peer worker's
  ``worker_pid``.
- ``store(keys, salt)``: accelerator → host store of hex ``keys`` with their :func:`payload` bytes
  (``salt``: as a request with that ``cache_salt`` under vLLM: held under its tenant keys, with
  chunk infos naming the engine's block hash of each chunk, which its KV events then carry).
- ``resolve(keys, req_id, params)``: look ``keys`` up every step until settled; answers the results.
- ``lookup_once(keys, req_id)``: one round of lookups and one step; answers the results.
- ``digest(keys)``: xxh3 of the host rows of READY ``keys`` (None where not READY).
- ``drop(keys)``: remove ``keys`` from the host tier.
- ``scribble(keys, value)``: overwrite the host rows of ``keys`` with ``value`` behind the
  manager's back (a slot reused for other bytes, as a lapsed lease would allow).
- ``state()``: pins held vs ref counts, busy slots, peers up, the serving role's counters.
- ``counters()``: (as of a snapshot the node thread took after the call) the p2p tier's refusals by kind and reason (``refused_messages`` of its server,
  ``refused_connections`` of its node, ``failed_handshakes`` of its client, ``refused_routes``),
  its server's other counters (``server``), its sessions' advertise addresses
  (``authenticated``) and its links (``links``).
- ``close()``.
Errors are answered as ``{"error": "<type>", "message": ...}``; the process goes on.
"""

from __future__ import annotations

import os
import time

_reply_fd = os.dup(1)
os.dup2(2, 1)

import xxhash  # noqa: E402
from pipe_commands import serve  # noqa: E402

from kvoffload.config import parse_config  # noqa: E402
from kvoffload.events import ChunkEventInfo  # noqa: E402
from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.namespace import Namespace  # noqa: E402
from kvoffload.testing.tier_contract import payload  # noqa: E402
from kvoffload.tiering import TieringManager  # noqa: E402
from kvoffload.tiers.base import LookupResult  # noqa: E402

_UNSETTLED = (LookupResult.RETRY, LookupResult.HIT_PENDING)


def namespace(row_bytes: int, model: str = "test/model") -> Namespace:
    """The namespace every p2p test instance shares (same as ``tests/helpers.namespace``; the
    tier contract suite's engines name their own ``model``)."""
    return Namespace(
        model=model,
        kv_dtype="bfloat16",
        layout="raw-v1",
        tokens_per_chunk=16,
        row_bytes=row_bytes,
    )


class Instance:
    def __init__(self) -> None:
        self.arena: Arena | None = None
        self.tm: TieringManager | None = None

    def init(
        self,
        tiers: list,
        num_slots: int,
        row_bytes: int,
        name: str,
        extra: dict | None = None,
        model: str = "test/model",
    ) -> dict:
        config = parse_config(
            {"cpu_bytes_to_use": num_slots * row_bytes, "secondary_tiers": tiers, **(extra or {})}
        )
        self.arena = Arena.create(name, num_slots, row_bytes)
        self.tm = TieringManager(self.arena, namespace(row_bytes, model), config)
        tier = self.tm.tiers[0]
        deadline = time.monotonic() + 120
        while not tier.workers_ready():
            if time.monotonic() > deadline:
                raise TimeoutError("the peer worker did not start")
            time.sleep(0.01)
        return {"advertise": tier.advertise, "worker_pid": tier.worker_pid}

    def store(self, keys: list[str], salt: str | None = None) -> dict:
        assert self.tm is not None and self.arena is not None
        ks = [bytes.fromhex(k) for k in keys]
        req = "store"
        self.tm.set_cache_salt(req, salt)
        info = None
        if salt is not None:  # as vLLM's scheduler: a chunk (one block) named by its engine hash
            tpc = self.tm.namespace.tokens_per_chunk
            info = {
                k: ChunkEventInfo([k[:-4]], None, [0] * tpc, tpc, int.from_bytes(k[-4:], "big"))
                for k in ks
            }
        plan = self.tm.prepare_store(ks, req, info)
        assert plan is not None
        for k, s in zip(plan.keys, plan.slots):
            self.arena.rows[s] = payload(k, self.arena.row_bytes)
        self.tm.complete_store(plan.keys, True, req)
        self.tm.step()  # publishes the step's KV events, when configured
        return {"stored": len(plan.keys)}

    def resolve(self, keys: list[str], req_id: str = "req", params: dict | None = None) -> dict:
        assert self.tm is not None
        ks = [bytes.fromhex(k) for k in keys]
        if params:
            self.tm.on_request(req_id, params)
        deadline = time.monotonic() + 120
        while True:
            res = [self.tm.lookup(k, req_id) for k in ks]
            if not any(r in _UNSETTLED for r in res) or time.monotonic() > deadline:
                return {"results": [r.name for r in res]}
            self.tm.step()
            time.sleep(0.002)

    def lookup_once(self, keys: list[str], req_id: str = "req") -> dict:
        """One round of lookups of ``keys`` and one engine step (never waits for an answer)."""
        assert self.tm is not None
        res = [self.tm.lookup(bytes.fromhex(k), req_id) for k in keys]
        self.tm.step()
        return {"results": [r.name for r in res]}

    def digest(self, keys: list[str]) -> dict:
        assert self.tm is not None and self.arena is not None
        out = []
        for k in keys:
            slot = self.tm.host.index.get(bytes.fromhex(k))
            out.append(None if slot is None else xxhash.xxh3_64_hexdigest(self.arena.rows[slot]))
        return {"digests": out}

    def drop(self, keys: list[str]) -> dict:
        assert self.tm is not None
        return {"removed": len(self.tm.host.remove([bytes.fromhex(k) for k in keys]))}

    def scribble(self, keys: list[str], value: int) -> dict:
        assert self.tm is not None and self.arena is not None
        slots = [self.tm.host.index[bytes.fromhex(k)] for k in keys]
        for s in slots:
            self.arena.rows[s] = value
        return {"slots": slots}

    def state(self) -> dict:
        assert self.tm is not None
        host = self.tm.host
        with self.tm.lock:
            pins = self.tm.pins_held()
            refs = {s: int(r) for s, r in enumerate(host.refs) if r}
        return {
            "pins_match": pins == refs,
            "pinned": len(refs),
            "busy": len(self.tm.busy_slots()),
            "peers_up": self.tm.tiers[0].peers_up(),
            "counters": dict(self.tm.tiers[0]._node.server_counters),
        }

    def counters(self) -> dict:
        assert self.tm is not None
        tier = self.tm.tiers[0]
        node = tier._node
        # the node thread snapshots its server's counters every 0.25 s: wait for one taken after
        # this call began, so that what happened before it is in
        asked = time.monotonic()
        deadline = asked + 120
        while node._counters_at <= asked + 0.25 and node.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError("the node thread took no snapshot of its counters")
            time.sleep(0.01)
        server = node.server_counters
        return {
            "refused_messages": {k[8:]: v for k, v in server.items() if k.startswith("refused.")},
            "server": {k: v for k, v in server.items() if not k.startswith("refused.")},
            "refused_connections": dict(node.refused_connections),
            "failed_handshakes": dict(node.client.handshake_failures),
            "refused_routes": dict(tier.refused_routes),
            "authenticated": sorted(node.authenticated_peers),
            "links": sorted(node.client.links),
        }

    def close(self) -> dict:
        if self.tm is not None:
            self.tm.shutdown()
        if self.arena is not None:
            self.arena.close()
        return {}


def main() -> None:
    serve(Instance(), _reply_fd)


if __name__ == "__main__":
    main()
