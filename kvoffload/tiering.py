"""The tiering manager: host tier first, then secondary tiers in configured order.

::

    lookup(key) ── host READY ──▶ HIT          (no I/O, no polling: the hot path)
         │  host WRITING ───────▶ HIT_PENDING  (a store or promotion is in flight)
         └─ host miss: poll completions, then ask tiers in order
               tier HIT  ─▶ reserve a host slot now (WRITING), queue a promotion ─▶ HIT_PENDING
               tier RETRY ─▶ RETRY (probe in flight)          all MISS ─▶ MISS
    step()  ─▶ submit queued promotions (one load job per tier and request), flush probes, poll
    prepare_store ─▶ poll first (completions free pins before eviction decisions), allocate slots
    complete_store(ok) ─▶ host READY, then write-through: pin each slot once per tier and submit a
                          store job to every tier; each pin drops when that tier reports

Reserving the host slot at lookup time means concurrent requests never promote the same chunk twice:
the second one finds it WRITING. A failed promotion frees the slot and the tier answers MISS for the
chunk afterwards, so the request goes on with a shorter prefix instead of waiting forever.

This class knows nothing of vLLM; :mod:`kvoffload.vllm` adapts it to vLLM's ``OffloadingManager``,
and the stress tool and tests drive it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.host import READY, HostTier, StorePlan
from kvoffload.policies import make_policy
from kvoffload.tiers import create_tier
from kvoffload.tiers.base import JobMetadata, LookupResult, SecondaryTierManager, TierEvent

log = logging.getLogger("kvoffload")

_HIT, _MISS, _PENDING, _RETRY = (LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING,
                                 LookupResult.RETRY)
HOST = "host"


class _Job:
    __slots__ = ("tier", "meta")

    def __init__(self, tier: int, meta: JobMetadata):
        self.tier = tier
        self.meta = meta


class Stats:
    """Counters of one tiering manager (chunks unless named otherwise). ``per_tier`` maps a tier
    name to its own counters."""

    def __init__(self, tier_names: Sequence[str]):
        self.host_queries = 0
        self.host_hits = 0
        self.tier_queries = {n: 0 for n in tier_names}
        self.tier_hits = {n: 0 for n in tier_names}
        self.promotions = {n: 0 for n in tier_names}
        self.promotion_failures = {n: 0 for n in tier_names}
        self.promotion_alloc_failures = 0
        self.cascaded = {n: 0 for n in tier_names}
        self.cascade_failures = {n: 0 for n in tier_names}
        self.dropped_stores = {n: 0 for n in tier_names}
        self.store_rejections = 0
        self.store_truncations = 0
        self.loads_from = {HOST: 0, **{n: 0 for n in tier_names}}

    def snapshot(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(self).items()}


class TieringManager:
    """Host tier plus ordered secondary tiers over one arena (engine thread only).

    Args:
        arena: the host :class:`~kvoffload.ipc.arena.Arena` (its slots are the host tier).
        namespace: :class:`~kvoffload.namespace.Namespace` of the chunks.
        config: parsed :class:`~kvoffload.config.OffloadConfig`.
        tiers: prebuilt tiers (tests); by default they are built from ``config.secondary_tiers``.
        record_events: keep host/tier events for :meth:`take_events`.

    Raises:
        ConfigError: a tier config is invalid or a tier cannot start.
    """

    def __init__(self, arena: Any, namespace: Any, config: OffloadConfig, *,
                 tiers: list[SecondaryTierManager] | None = None, record_events: bool = True,
                 poll_interval_s: float = 0.0005):
        self.arena = arena
        self.namespace = namespace
        self.config = config
        self.host = HostTier(arena.num_slots,
                             make_policy(config.eviction_policy, arena.num_slots,
                                         config.cache_policy_module_path),
                             record_events=record_events)
        self.tiers: list[SecondaryTierManager] = []
        if tiers is not None:
            self.tiers = list(tiers)
        else:
            try:
                for i, raw in enumerate(config.secondary_tiers):
                    self.tiers.append(create_tier(raw, arena, namespace,
                                                  f"kv_connector_extra_config.secondary_tiers[{i}]"))
            except BaseException:
                for t in self.tiers:
                    t.shutdown()
                raise
        for t in self.tiers:
            t.record_events = record_events
        self.tier_names = [t.name for t in self.tiers]
        self.stats = Stats(self.tier_names)
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._promotions: dict[int, dict[str, tuple[list[bytes], list[int]]]] = {}
        self._load_source: dict[str, dict[bytes, int]] = {}
        self._poll_interval = poll_interval_s
        self._last_poll = 0.0
        self._closed = False

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        """Where is ``key``? HIT (host, readable now), HIT_PENDING (host, being written or promoted),
        RETRY (a tier is still looking) or MISS. Never blocks."""
        host = self.host
        slot = host.index.get(key)
        stats = self.stats
        stats.host_queries += 1
        if slot is not None:
            stats.host_hits += 1
            return _HIT if host.state[slot] == READY else _PENDING
        now = time.monotonic()
        if now - self._last_poll >= self._poll_interval:
            self.poll()
        any_retry = False
        for i, tier in enumerate(self.tiers):
            name = tier.name
            stats.tier_queries[name] += 1
            r = tier.lookup(key, req_id)
            if r is _HIT:
                stats.tier_hits[name] += 1
                return self._start_promotion(i, key, req_id)
            if r is _RETRY:
                any_retry = True
        return _RETRY if any_retry else _MISS

    def _start_promotion(self, tier_idx: int, key: bytes, req_id: str) -> LookupResult:
        plan = self.host.allocate([key])
        if plan is None:
            self.stats.promotion_alloc_failures += 1
            return _MISS
        per_req = self._promotions.setdefault(tier_idx, {})
        keys, slots = per_req.setdefault(req_id, ([], []))
        keys.append(key)
        slots.append(plan.slots[0])
        self._load_source.setdefault(req_id, {})[key] = tier_idx
        return _PENDING

    def _flush_promotions(self) -> None:
        if not self._promotions:
            return
        pending, self._promotions = self._promotions, {}
        for tier_idx, per_req in pending.items():
            tier = self.tiers[tier_idx]
            for req_id, (keys, slots) in per_req.items():
                meta = JobMetadata(job_id=self._job_id(), keys=keys, slots=slots, is_promotion=True,
                                   req_id=req_id)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("promotion job %d: %d chunk(s) from %s for %s", meta.job_id, len(keys),
                              tier.name, req_id)
                self._jobs[meta.job_id] = _Job(tier_idx, meta)
                tier.submit_load(meta)

    def source_of(self, key: bytes, req_id: str = "") -> str:
        """The tier that served ``key`` for this request: ``"host"`` or a secondary tier's name."""
        idx = self._load_source.get(req_id, {}).get(key)
        return HOST if idx is None else self.tier_names[idx]

    def tier_of(self, name: str) -> SecondaryTierManager | None:
        return next((t for t in self.tiers if t.name == name), None)

    # -- host ↔ accelerator ---------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes], req_id: str = "") -> list[int]:
        """Pin READY keys for a host → accelerator copy and return their slots.

        Raises:
            KeyError: a key is not READY in the host tier (callers pass keys that looked up HIT).
        """
        slots = self.host.pin(keys)
        self.host.access(keys)
        loads_from = self.stats.loads_from
        src = self._load_source.get(req_id)
        for k in keys:
            idx = src.get(k) if src else None
            loads_from[HOST if idx is None else self.tier_names[idx]] += 1
        return slots

    def complete_load(self, keys: Iterable[bytes], req_id: str = "") -> None:
        """The accelerator copy of ``keys`` finished: drop the pins of :meth:`prepare_load`."""
        self.host.unpin(keys)

    def touch(self, keys: Sequence[bytes], req_id: str = "") -> None:
        """Mark ``keys`` recently used in every tier."""
        self.host.access(keys)
        for tier in self.tiers:
            tier.touch(keys)

    def prepare_store(self, keys: Sequence[bytes], req_id: str = "") -> StorePlan | None:
        """Reserve host slots for the keys not yet present (accelerator → host copy).

        Completions are processed first, so pins released by finished tier jobs count before any
        eviction decision. When the whole batch does not fit, its longest prefix that fits is
        reserved; returns None only when not a single slot can be freed (everything pinned).
        """
        self.poll()
        host = self.host
        plan = host.allocate(keys)
        if plan is None:
            # Not enough room for the whole batch (slots pinned by in-flight transfers, or a batch
            # larger than the tier): keep its longest prefix that fits now. Lookups are prefix
            # ordered, so the head of a request is what later requests can reuse; the engine does
            # not offer the rest again.
            new = [k for k in dict.fromkeys(keys) if k not in host.index]
            room = min(host.room_for(keys), len(new))
            if room > 0:
                cut = keys.index(new[room - 1]) + 1
                plan = host.allocate(keys[:cut])
                self.stats.store_truncations += 1
            if plan is None:
                self.stats.store_rejections += 1
        return plan

    def complete_store(self, keys: Iterable[bytes], success: bool = True, req_id: str = "") -> None:
        """The accelerator → host copy finished: publish the chunks (or free their slots on
        failure) and write them through to every secondary tier."""
        done = self.host.complete_write(keys, success)
        if success and done and self.tiers:
            self._cascade(done, req_id)

    def _cascade(self, keys: list[bytes], req_id: str) -> None:
        host = self.host
        for i, tier in enumerate(self.tiers):
            if not tier.accepts_store(len(keys)):
                self.stats.dropped_stores[tier.name] += len(keys)
                continue
            slots = host.pin(keys)
            meta = JobMetadata(job_id=self._job_id(), keys=list(keys), slots=slots,
                               is_promotion=False, req_id=req_id)
            self._jobs[meta.job_id] = _Job(i, meta)
            tier.submit_store(meta)

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    # -- completions ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Submit queued promotions and probes, and apply every finished tier job. Never blocks."""
        self._last_poll = time.monotonic()
        self._flush_promotions()
        host = self.host
        stats = self.stats
        for tier in self.tiers:
            tier.flush()
            for res in tier.get_finished_jobs():
                job = self._jobs.pop(res.job_id, None)
                if job is None:
                    log.warning("tier %s reported unknown job %d", tier.name, res.job_id)
                    continue
                meta = job.meta
                if meta.is_promotion:
                    if res.success:
                        ok, failed = meta.keys, []
                    else:
                        ok_set = set(res.successful_keys or ())
                        ok = [k for k in meta.keys if k in ok_set]
                        failed = [k for k in meta.keys if k not in ok_set]
                    host.complete_write(ok, True)
                    if failed:
                        host.complete_write(failed, False)
                        src = self._load_source.get(meta.req_id)
                        if src:
                            for k in failed:
                                src.pop(k, None)
                        stats.promotion_failures[tier.name] += len(failed)
                        log.info("promotion from %s failed for %d chunk(s): %s", tier.name,
                                 len(failed), res.reason)
                    stats.promotions[tier.name] += len(ok)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("promotion job %d done: %d/%d chunk(s), %.1f MB in %.1f ms",
                                  res.job_id, len(ok), len(meta.keys), res.transfer_bytes / 1e6,
                                  res.transfer_seconds * 1e3)
                else:
                    host.unpin_slots(meta.slots)
                    if res.success:
                        stats.cascaded[tier.name] += len(meta.keys)
                    else:
                        n_ok = len(res.successful_keys or ())
                        stats.cascaded[tier.name] += n_ok
                        stats.cascade_failures[tier.name] += len(meta.keys) - n_ok

    def step(self) -> None:
        """End of a scheduler step: submit this step's promotions and probes, apply completions."""
        self.poll()

    def has_pending_work(self) -> bool:
        """True while promotions, tier jobs or probes are in flight (the engine should keep
        stepping)."""
        return bool(self._jobs or self._promotions) or any(t.has_pending_work() for t in self.tiers)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until nothing is in flight (standalone tools and tests only). Returns False on
        timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if not self.has_pending_work():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            waited = False
            for tier in self.tiers:
                if tier.has_pending_work():
                    tier.wait(min(left, 0.01))
                    waited = True
                    break
            if not waited:
                time.sleep(0.001)

    # -- requests, events, lifecycle ----------------------------------------------------------

    def on_request_finished(self, req_id: str) -> None:
        """Forget per-request bookkeeping (which tier served which chunk)."""
        self._load_source.pop(req_id, None)

    def take_events(self) -> list[tuple[str, TierEvent]]:
        """``(tier name, event)`` pairs since the last call, host first (tier name ``"host"``)."""
        out = [(HOST, e) for e in self.host.take_events()]
        for tier in self.tiers:
            out.extend((tier.name, e) for e in tier.take_events())
        return out

    def reset_cache(self, timeout_s: float = 60.0) -> None:
        """Forget every host-tier chunk, after in-flight tier jobs finish (their slots must not be
        reused while a worker may still touch them)."""
        self.wait_idle(timeout_s)
        self._promotions.clear()
        self._load_source.clear()
        self.host.clear()

    def shutdown(self) -> None:
        """Stop every tier (failing what is still in flight). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for tier in self.tiers:
            try:
                tier.shutdown()
            except Exception:  # noqa: BLE001 - keep shutting the others down
                log.exception("tier %s failed to shut down", tier.name)
