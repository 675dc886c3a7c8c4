"""kvoffload's side of the driver: its p2p tier on the same chunks as vLLM's (:class:`KvPair`:
producer A spawned, a ``TieringManager`` holding every chunk in its host tier; consumer B here, a
``TieringManager`` with A as its peer), driven by the same measurements.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from kvoffload.tiers.base import LookupResult
from kvoffload.tools.bench.harness import Payloads, ends_process, p2p_tier_instance
from kvoffload.tools.bench.vllm_p2p.driver import (
    POLL_S,
    REPLY_TIMEOUT_S,
    LoadingPair,
    answer,
    chunk_digest,
)


def kv_key(row_bytes: int, i: int | str) -> bytes:
    """kvoffload's key of chunk ``i``: the same sha256 digest vLLM's key of chunk ``i`` is made of."""
    return chunk_digest(row_bytes, i)


@ends_process
def _kv_producer(conn: Any, row_bytes: int, rows: int, poll_s: float, secret: str) -> None:
    """Producer process of kvoffload's side: a TieringManager whose host tier holds chunk ``i``
    (:class:`Payloads`) under :func:`kv_key` ``i`` for every row, and one p2p tier (NIXL, on
    loopback, authenticated with ``secret``) serving it. Peers are answered by the tier's node
    thread and peer worker; this process's engine thread is never stepped (an idle engine is not),
    it only answers ``conn``."""
    arena, tm = p2p_tier_instance("nixl", rows, row_bytes, [], secret)
    try:
        keys = [kv_key(row_bytes, i) for i in range(rows)]
        plan = tm.prepare_store(keys)
        if plan is None or len(plan.keys) != rows:
            raise RuntimeError("the producer's host tier took only part of the chunks")
        payloads = Payloads(rows, row_bytes)
        index = {k: i for i, k in enumerate(keys)}
        for k, slot in zip(plan.keys, plan.slots):
            arena.rows[slot] = payloads.base
            payloads.stamp(arena.rows[slot], index[k])
        tm.complete_store(plan.keys, True)
        conn.send(("ready", tm.tiers[0].advertise))
        # every chunk is held already: nothing to do per request
        answer(conn, {"park": lambda msg: ("parked", len(msg[1]))})
    finally:
        tm.shutdown()
        arena.close()
        conn.send(("stopped", None))


class KvPair(LoadingPair):
    """kvoffload's counterpart of :class:`~kvoffload.tools.bench.vllm_p2p.vllm_side.Pair`, with the
    same interface (so the measurements drive both): producer A in a spawned process
    holds the ``rows`` chunks in its host tier; consumer B here is a ``TieringManager`` with one p2p
    tier (NIXL) naming A as its peer. A request's "load job" is what vLLM's scheduler does with
    kvoffload: ``on_request``, a lookup per chunk (RETRY / HIT_PENDING while the tier fetches),
    each step ``TieringManager.step()`` and the lookups again; done when every chunk is HIT (then
    ``prepare_load`` pins them until they are checked or fetched again). Before a chunk is
    requested again it is unpinned and removed from B's host tier, so every request moves bytes.
    A warm-up pass fetches every chunk once: B then knows A holds them (as a decoder is told its
    prefiller, or learns it from A's KV events), and A's NIXL registration is up."""

    def __init__(self, row_bytes: int, rows: int, poll_s: float = POLL_S):
        self.row_bytes, self.rows = row_bytes, rows
        self.payloads = Payloads(rows, row_bytes)
        self.keys = [kv_key(row_bytes, i) for i in range(rows)]
        self._held: dict[int, tuple[str, int]] = {}  # chunk -> (request holding its pin, slot)
        self.reasked = 0  # lookups of a requested chunk that answered MISS and were asked again
        secret = secrets.token_hex(32)
        super().__init__(_kv_producer, row_bytes, rows, poll_s, secret)
        self.b: Any = None
        self.tm: Any = None
        try:
            addr = self.ask(("hello",), expect="ready")
            self.b, self.tm = p2p_tier_instance("nixl", rows, row_bytes, [addr], secret)
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while not self.tm.tiers[0].peers_up():
                if time.monotonic() > deadline:
                    raise TimeoutError("kvoffload p2p: the session with the producer never came up")
                time.sleep(0.01)
            self.load([(self.kv_id("warm-up"), 0, rows)])
            self.verify(0, rows)
        except BaseException:
            self.close()
            raise

    def _forget(self, first: int, count: int) -> None:
        """Unpin chunks ``first ..`` on B and drop them from its host tier (fetched anew next)."""
        tm = self.tm
        with tm.lock:
            gone = []
            for i in range(first, first + count):
                held = self._held.pop(i, None)
                if held is not None:
                    tm.complete_load([self.keys[i]], held[0])
                gone.append(self.keys[i])
            tm.host.remove(gone)

    def submit(self, jobs: list[tuple[str, int, int]], out: dict) -> None:
        """B's side of a request per job: chunks dropped from B (untimed), then ``on_request``
        and a lookup per chunk; ``out[request] = [first, count, submit time, chunks not HIT]``.

        A lookup that answers MISS (A refused the lease: at most half its host tier is leased to
        peers at once, and a refused chunk's load fails as busy) is asked again next step and
        counted in :attr:`reasked`; a chunk that never arrives ends in the callers' timeout."""
        tm = self.tm
        for kv_id, first, count in jobs:
            self._forget(first, count)
            req = f"b-{kv_id}"
            t0 = time.perf_counter()
            tm.on_request(req, None)
            out[req] = [first, count, t0, self._not_hit(req, range(first, first + count))]

    def _not_hit(self, req: str, chunks: Any) -> list[int]:
        """Look each of ``chunks`` up for ``req``; the ones not HIT (a MISS counted in
        :attr:`reasked`: see :meth:`submit`)."""
        tm, hit, miss = self.tm, LookupResult.HIT, LookupResult.MISS
        left = []
        for i in chunks:
            r = tm.lookup(self.keys[i], req)
            if r is miss:
                self.reasked += 1
            if r is not hit:
                left.append(i)
        return left

    def step(self, inflight: dict) -> list:
        """One scheduler step: ``TieringManager.step()``, then the lookups of every request still
        waiting; returns the requests whose chunks are all HIT, their chunks pinned
        (``prepare_load``)."""
        self.tm.step()
        done = []
        for req, job in inflight.items():
            job[3] = self._not_hit(req, job[3])
            if not job[3]:
                done.append(req)
        return done

    def settle(self, results: list, inflight: dict, latencies: list | None = None) -> int:
        now, n = time.perf_counter(), 0
        tm = self.tm
        for req in results:
            first, count, t0, _ = inflight.pop(req)
            chunks = range(first, first + count)
            slots = tm.prepare_load([self.keys[i] for i in chunks], req)
            for i, slot in zip(chunks, slots):
                self._held[i] = (req, slot)
            tm.on_request_finished(req)
            if latencies is not None:
                latencies.append(now - t0)
            n += count
        return n

    def clear(self, first: int, count: int) -> None:
        self._forget(first, count)

    def verify(self, first: int, count: int) -> None:
        """Every byte of B's loaded chunks ``first ..`` equals A's chunk of the same index.

        Raises:
            AssertionError: naming the first chunk that is not loaded or whose bytes differ."""
        rows = self.b.rows
        for i in range(first, first + count):
            held = self._held.get(i)
            if held is None or not self.payloads.check(rows[held[1]], i):
                raise AssertionError(f"kvoffload p2p: chunk {i} arrived with wrong bytes")

    def wait_stores(self, ok_before: int, jobs: int) -> dict:
        return self.a_stats()  # A holds its chunks already: no store jobs to wait for

    def close_consumer(self) -> None:
        if self.tm is not None:
            self.tm.shutdown()
            self.tm = None
        if self.b is not None:
            self.b.close()
            self.b = None
