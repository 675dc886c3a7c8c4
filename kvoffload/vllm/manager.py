"""The scheduler side of the vLLM plug-in: vLLM's ``OffloadingManager`` over a
:class:`~kvoffload.tiering.TieringManager`.

vLLM's ``OffloadingConnector`` calls it on the scheduler's thread: ``lookup`` / ``prepare_load`` /
``prepare_store`` / ``complete_*`` per request, ``on_schedule_end`` once a step (the tiering
manager's :meth:`~kvoffload.tiering.TieringManager.step`), ``take_events`` for vLLM's own KV-event
publisher (translated here into vLLM's ``OffloadingEvent``), ``get_stats`` for vLLM's metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import Any

from typing_extensions import override

from kvoffload.canary import RECOMPUTE, REUSE, Canary
from kvoffload.events import ChunkEventInfo
from kvoffload.hybrid import WindowScans
from kvoffload.ipc.ratelimit import RateLimitedLog
from kvoffload.tiering import HOST, TieringManager
from kvoffload.tiers.base import LookupResult as KVLookup
from kvoffload.vllm.compat import (
    CPULoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    calling_request,
    calling_scheduled_tokens,
    convert_block_hash,
    drop_tolerated,
    evict_device_prefix,
    hit_source,
)

log = logging.getLogger("kvoffload.vllm")
_giveups = RateLimitedLog(log)
_STATS_INTERVAL_S = 0.5
_IDLE_GAP = 10.0
"""A step sample more than this many times slower than the prefill estimate is taken for an
engine that went idle after the step (no requests: no step until the next one arrives), not for
prefill: it is ignored."""

_TO_VLLM = {
    KVLookup.HIT: LookupResult.HIT,
    KVLookup.MISS: LookupResult.MISS,
    KVLookup.HIT_PENDING: LookupResult.HIT_PENDING,
    KVLookup.RETRY: LookupResult.RETRY,
}
_MEDIUM = {"CPU": Medium.CPU, "STORAGE": Medium.STORAGE}
_LOCALITY = {"LOCAL": Locality.LOCAL, "REMOTE": Locality.REMOTE}


class _RequestChunks:
    """One request's chunks as :class:`~kvoffload.events.ChunkEventInfo`, computed per key when
    asked (:meth:`~kvoffload.tiering.TieringManager.prepare_store`'s ``chunk_info``): the
    request's block hashes and token ids over the key's token range (its end from the
    ``ReqContext``), the values of vLLM's own ``BlockStored`` for those blocks. Kept in the
    context's state; :meth:`release` (request finished) drops both references, so neither the
    request nor the context waits for the cyclic garbage collector."""

    __slots__ = ("ctx", "geometry", "req")

    def __init__(self, req: Any, ctx: ReqContext, geometry: dict[int, tuple[int, int]]):
        self.req = req
        self.ctx = ctx
        self.geometry = geometry

    def release(self) -> None:
        self.req = self.ctx = None

    def get(self, key: bytes) -> ChunkEventInfo | None:
        if self.req is None:
            return None
        end = self.ctx.get_offload_key_position(key)
        group = int.from_bytes(key[-4:], "big")
        shape = self.geometry.get(group)
        if end is None or shape is None:
            return None
        block, chunk = shape
        start = end - chunk
        hashes = self.req.block_hashes
        first, last = start // block, end // block
        # the key names the chunk's last block: anything else (a window group's layout, a
        # request whose hashes moved on) gets the plain event, never a wrong parent
        if start < 0 or last > len(hashes) or hashes[last - 1] != key[:-4]:
            return None
        return ChunkEventInfo(
            block_hashes=[convert_block_hash(h) for h in hashes[first:last]],
            parent_block_hash=convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(self.req.all_token_ids[start:end]),
            block_size=block,
            group_idx=group,
        )


class KVOffloadManager(OffloadingManager):
    """vLLM ``OffloadingManager`` delegating to a :class:`~kvoffload.tiering.TieringManager`.

    Args:
        tiering: the tiering manager.
        event_geometry: KV-cache group -> (tokens per block, tokens per chunk); with kvoffload's
            own KV events on, a chunk of such a group is published with its request's parent
            hash and token ids.
        window_scans: the engine's windowed groups: a chunk of one is promoted from a secondary
            tier only when the window the hit can end with includes it
            (:class:`~kvoffload.hybrid.WindowScans`).

    With ``tiering.config.canary`` set, the online canary's thread starts here
    (:class:`~kvoffload.canary.Canary`) and this manager marks its runs: a reuse run's prefix
    leaves the device prefix cache when it arrives and its loads are counted by source; a
    recompute run loads and stores nothing.
    """

    def __init__(
        self,
        tiering: TieringManager,
        event_geometry: dict[int, tuple[int, int]] | None = None,
        window_scans: WindowScans | None = None,
    ):
        self.tm = tiering
        self._scans = window_scans or None
        self._stats_at = 0.0
        self._warned_no_request = False  # calling_request found nothing (logged once)
        self._medium = {HOST: "CPU", **{t.name: t.medium for t in tiering.tiers}}
        self._locality = {
            HOST: Locality.LOCAL,
            **{t.name: _LOCALITY.get(t.locality, Locality.LOCAL) for t in tiering.tiers},
        }
        self._geometry = event_geometry if tiering.publishes_events else None
        # the live prefill estimate (kvoffload.costs): the previous step's scheduled tokens and
        # when it ended; a step of at least one chunk's tokens is a prefill sample
        self._step_tokens = 0
        self._step_at: float | None = None
        self._prefill_min_tokens = max(1, tiering.namespace.tokens_per_chunk)
        #: The online canary (None: off; then no request is checked for its marker).
        self.canary: Canary | None = None
        self._canary_runs: dict = {}
        if tiering.config.canary is not None:
            self.canary = Canary(tiering.config.canary, tiering)
            self._canary_runs = self.canary.board.running
            self.canary.start()

    @override
    def lookup(self, key, req_context: ReqContext, **kwargs) -> LookupResult:
        scans = self._scans
        if scans is not None:
            group = int.from_bytes(key[-4:], "big")
            end = req_context.get_offload_key_position(key) if scans.tracks(group) else None
            if end is not None and scans.tracks(group, end):  # promoted at the step's end if chosen
                req_id = req_context.req_id
                r = self.tm.lookup(key, req_id, promote=False)
                if r is KVLookup.RETRY and scans.exhausted(req_id, key):
                    r = KVLookup.MISS  # never chosen: a recompute, not a request that never runs
                    self.tm.stats.window_retry_giveups += 1
                    _giveups.log(
                        logging.WARNING,
                        "window",
                        "kvoffload: a sliding-window chunk of request %s was answered RETRY for "
                        "%d steps without being promoted; answered MISS (recomputed)",
                        req_id,
                        scans.max_retry_steps,
                    )
                scans.record(req_id, group, key, end, r.name)
                return _TO_VLLM[r]
        return _TO_VLLM[self.tm.lookup(key, req_context.req_id)]

    @override
    def get_load_source(self, key, req_context: ReqContext):
        name = self.tm.source_of(key, req_context.req_id)
        return hit_source(HOST if name == HOST else self._medium[name])

    @override
    def prepare_load(self, keys: Collection, req_context: ReqContext, **kwargs):
        drop_tolerated(kwargs)
        keys = list(keys)
        slots = self.tm.prepare_load(keys, req_context.req_id)
        if self._canary_runs:
            run = self._canary_runs.get(req_context.req_id)
            if run is not None:  # a canary run: which tier served each chunk it loads
                for k in keys:
                    run.sources[self.tm.source_of(k, req_context.req_id)] += 1
                run.keys.update(keys)
        return CPULoadStoreSpec(slots)

    @override
    def touch(self, keys: Collection, req_context: ReqContext, **kwargs):
        self.tm.touch(list(keys), req_context.req_id)

    @override
    def complete_load(self, keys: Collection, req_context: ReqContext, **kwargs):
        self.tm.complete_load(keys, req_context.req_id)

    @override
    def prepare_store(self, keys: Collection, req_context: ReqContext, **kwargs):
        info = req_context.get_state(_RequestChunks) if self._geometry else None
        if self._canary_runs:
            run = self._canary_runs.get(req_context.req_id)
            if run is not None:
                if run.role == RECOMPUTE:  # its fresh salt's chunks would never be asked again
                    return None
                run.keys.update(keys)
        plan = self.tm.prepare_store(list(keys), req_context.req_id, info)
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=plan.keys,
            store_spec=CPULoadStoreSpec(plan.slots),
            evicted_keys=plan.evicted,
        )

    @override
    def complete_store(
        self, keys: Collection, req_context: ReqContext, success: bool = True, **kwargs
    ):
        self.tm.complete_store(keys, success, req_context.req_id)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        req = calling_request(req_context.req_id)
        if req is None and not self._warned_no_request:
            # fails open: no salt (the request's chunks are stored as an unsalted request's,
            # vLLM's keys still differ per salt), no chunk infos for KV events
            self._warned_no_request = True
            log.warning(
                "kvoffload: vLLM's Request was not found in the caller's frame (a vLLM this "
                "version does not know?): requests' cache_salt is not read, so their chunks get "
                "no tenant directory and `kvoffload purge --salt` finds none of them"
            )
        salt = getattr(req, "cache_salt", None) if req is not None else None
        # its tenant's chunks, apart from everyone else's (kvoffload.tenants); no salt clears
        # what a reused request id had
        self.tm.set_cache_salt(req_context.req_id, salt)
        if self._geometry and req is not None:
            req_context.set_state(_RequestChunks(req, req_context, self._geometry))
        params = getattr(req_context, "kv_transfer_params", None)
        if params:  # the orchestrator's routing (p2p: which peer, what to hold for a decoder)
            if self.canary is not None:
                self._canary_request(req_context.req_id, params)
            self.tm.on_request(req_context.req_id, params)
        return RequestOffloadingContext()

    def _canary_request(self, req_id: str, params: Any) -> None:
        """A request with ``kv_transfer_params``: if it is a run the canary waits for, a reuse
        run's prefix leaves the device prefix cache (its lookups must reach the tiers) and may
        load only from its target tier; a recompute run may load from none. Called from
        :meth:`on_new_request` only (it reads vLLM's scheduler from the calling frames)."""
        assert self.canary is not None
        run = self.canary.board.claim(req_id, params)
        if run is None:
            return
        if run.role == REUSE:
            req = calling_request(req_id, depth=3)
            run.device_evicted = None if req is None else evict_device_prefix(req)
            if run.target is not None:
                self.tm.restrict_loads(req_id, run.target)
        else:
            self.tm.restrict_loads(req_id, None)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._geometry:
            chunks = req_context.get_state(_RequestChunks)
            if chunks is not None:
                chunks.release()
        if self._scans is not None:
            self._scans.forget(req_context.req_id)
        self.tm.on_request_finished(req_context.req_id)
        if self._canary_runs:
            assert self.canary is not None
            self.canary.board.finished(req_context.req_id)

    @override
    def on_schedule_end(self, context) -> None:
        self._observe_step(calling_scheduled_tokens())
        if self._scans is not None:
            for req_id, key in self._scans.chosen():  # windowed chunks the hit can end with
                self.tm.lookup(key, req_id)
        self.tm.step()

    def _observe_step(self, tokens: int | None, now: float | None = None) -> None:
        """A scheduler step ended having scheduled ``tokens`` tokens (None: unknown). The time
        since the previous step ended is what the engine took to compute that step's tokens
        (and schedule this one: the estimate errs slow, towards serving from the tiers): a
        sample of the prefill estimate when that step scheduled at least one chunk's tokens,
        unless it is an idle gap (:data:`_IDLE_GAP`)."""
        now = time.monotonic() if now is None else now
        prev, at = self._step_tokens, self._step_at
        self._step_tokens, self._step_at = tokens or 0, now
        if prev < self._prefill_min_tokens or at is None or now <= at:
            return
        seconds = now - at
        rate = self.tm.prefill.rate
        if rate is not None and prev / seconds * _IDLE_GAP < rate:
            return
        self.tm.observe_prefill(prev, seconds)

    @override
    def has_pending_work(self) -> bool:
        return self.tm.has_pending_work()

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        for tier_name, ev in self.tm.take_events():
            medium = _MEDIUM.get(self._medium[tier_name])
            if medium is None:
                continue
            host = tier_name == HOST
            # removal_expected: vLLM's tracker keeps a host chunk's payload until its removal
            # (bounded by the host slots); a tier's payload is not kept past the host's
            yield OffloadingEvent(
                keys=list(ev.keys),
                medium=medium,
                removed=ev.removed,
                locality=self._locality[tier_name],
                ownership=None if host else tier_name,
                removal_expected=host and not ev.removed,
            )

    def get_stats(self):
        """Metric changes since the last call (vLLM's ``OffloadingConnectorStats``), at most every
        ``_STATS_INTERVAL_S`` (vLLM asks every step; counters accumulate in between)."""
        now = time.monotonic()
        if now - self._stats_at < _STATS_INTERVAL_S:
            return None
        self._stats_at = now
        data = self.tm.take_metric_stats()
        return None if data is None else OffloadingConnectorStats(data=data)

    @override
    def reset_cache(self) -> None:
        self.tm.reset_cache()

    @override
    def shutdown(self) -> None:
        if self.canary is not None:
            self.canary.stop()
        self.tm.shutdown()
        self.tm.arena.close()
