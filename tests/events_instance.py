"""A standalone kvoffload instance publishing KV events, for the router-view tests (CASES C54): its
own process, arena, tiering manager and tier worker processes, as a vLLM server would have, so a
test can SIGKILL it and start another on the same fs root and endpoints.

Started as ``python tests/events_instance.py``; reads one JSON command per line on stdin and
answers one JSON line each on the stdout it was started with (:mod:`pipe_commands`). Commands:

- ``init(tiers, num_slots, row_bytes, name, tokens_per_chunk, kv_events)``: build the instance;
  answers its publisher's ``endpoint`` and ``replay_endpoint``, its arena's ``arena`` name and the
  tier workers' ``worker_pids``.
- ``store(chunks)``: accelerator → host store of ``chunks`` (``{"key", "hashes", "parent",
  "tokens", "block_size"}``, hashes hex) with their chunk event infos; waits for the
  write-through, steps (the step's events are published) and flushes the publisher.
- ``serves(keys)``: per medium (``cpu``, ``storage``), the hex ``keys`` this instance would serve
  from it: in the host tier, or a settled HIT of the fs tier's own lookup.
- ``step()``: one engine step (publishes what the tiers reported), then a publisher flush.
- ``close()``.
"""

from __future__ import annotations

import os
import time

_reply_fd = os.dup(1)
os.dup2(2, 1)

from pipe_commands import serve  # noqa: E402

from kvoffload.config import parse_config  # noqa: E402
from kvoffload.events import ChunkEventInfo  # noqa: E402
from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.namespace import Namespace  # noqa: E402
from kvoffload.testing.tier_contract import payload  # noqa: E402
from kvoffload.tiering import TieringManager  # noqa: E402
from kvoffload.tiers.base import LookupResult  # noqa: E402


def _hash(h: str | None) -> bytes | None:
    return None if h is None else bytes.fromhex(h)


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
        tokens_per_chunk: int,
        kv_events: dict,
    ) -> dict:
        config = parse_config(
            {
                "cpu_bytes_to_use": num_slots * row_bytes,
                "secondary_tiers": tiers,
                "kv_events": kv_events,
            }
        )
        ns = Namespace(
            model="test/model",
            kv_dtype="bfloat16",
            layout="raw-v1",
            tokens_per_chunk=tokens_per_chunk,
            row_bytes=row_bytes,
        )
        self.arena = Arena.create(name, num_slots, row_bytes)
        self.tm = TieringManager(self.arena, ns, config)
        tier = self.tm.tiers[0]
        deadline = time.monotonic() + 120
        while any(p.awaiting_hello for p in tier._pools):
            if time.monotonic() > deadline:
                raise TimeoutError("the tier workers did not start")
            self.tm.poll()
            time.sleep(0.01)
        pub = self.tm.publisher
        pids = [pid for p in tier._pools for pid in p.pids()]
        return {
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "arena": name,
            "worker_pids": pids,
        }

    def store(self, chunks: list[dict]) -> dict:
        tm, arena = self.tm, self.arena
        assert tm is not None and arena is not None
        keys = [bytes.fromhex(c["key"]) for c in chunks]
        infos = {
            k: ChunkEventInfo(
                block_hashes=[bytes.fromhex(h) for h in c["hashes"]],
                parent_block_hash=_hash(c["parent"]),
                token_ids=c["tokens"],
                block_size=c["block_size"],
            )
            for k, c in zip(keys, chunks)
        }
        plan = tm.prepare_store(keys, "req", infos)
        assert plan is not None
        for k, s in zip(plan.keys, plan.slots):
            arena.rows[s] = payload(k, arena.row_bytes)
        tm.complete_store(plan.keys, True, "req")
        if not tm.wait_idle(120):
            raise TimeoutError("the write-through did not finish")
        return self.step()

    def step(self) -> dict:
        tm = self.tm
        assert tm is not None and tm.publisher is not None
        tm.step()
        if not tm.publisher.flush():
            raise TimeoutError("the publisher did not flush")
        return {"published": tm.publisher.published["engine"]}

    def serves(self, keys: list[str]) -> dict:
        tm = self.tm
        assert tm is not None
        fs = tm.tiers[0]
        ks = [bytes.fromhex(k) for k in keys]
        deadline = time.monotonic() + 120
        while True:
            res = [fs.lookup(k) for k in ks]
            if LookupResult.RETRY not in res or time.monotonic() > deadline:
                break
            tm.step()
            time.sleep(0.002)
        return {
            "cpu": [k.hex() for k in ks if k in tm.host.index],
            "storage": [k.hex() for k, r in zip(ks, res) if r is LookupResult.HIT],
        }

    def close(self) -> dict:
        if self.tm is not None:
            self.tm.shutdown()
        if self.arena is not None:
            self.arena.close()
        return {}


if __name__ == "__main__":
    serve(Instance(), _reply_fd)
