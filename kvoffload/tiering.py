"""The tiering manager: host tier first, then secondary tiers in configured order.

::

    lookup(key) ── host READY ──▶ HIT          (no I/O, no polling: the hot path)
         │  host WRITING ─ poll ─▶ HIT_PENDING  (a store or promotion is in flight; a poll, at
         │                                      most every poll_interval_s while tier jobs are
         │                                      out, first applies a promotion that landed: HIT)
         └─ host miss: poll completions, then ask tiers in order (lookup_for_load)
               tier HIT  ─▶ reserve a host slot now (WRITING), queue a promotion ─▶ HIT_PENDING
                            (the tier may expect the chunk: a request's chunks after one its
                            probe found; tiers/speculation.py)
               tier RETRY ─▶ RETRY (probe in flight)          all MISS ─▶ MISS
    step()  ─▶ submit queued promotions (one load job per tier and request), flush probes, poll
    prepare_store ─▶ poll first (completions free pins before eviction decisions), allocate slots
    complete_store(ok) ─▶ host READY, then write-through: pin each slot once per tier and submit a
                          store job to every tier; each pin drops when that tier reports

Reserving the host slot at lookup time means concurrent requests never promote the same chunk twice:
the second one finds it WRITING. A failed promotion frees the slot and the tier answers MISS for the
chunk afterwards, so the request goes on with a shorter prefix instead of waiting forever: also
when the tier answered HIT on expectation and the chunk was not there (``speculative_miss``; the
engine's prefix ends at that chunk, so nothing after it is served).

The manager routes: chunks between tiers, pins to holders, results to jobs. Its parts, each in its
own module and each reset by itself: the promotion-hold policy (:class:`~kvoffload.holds
.PromotionHolds`: which slots a promotion or store may evict, whether a request waits for room),
the serving of peers from the host tier (:class:`~kvoffload.serving.PeerServing`, behind the
manager's serving entry points and its lock), the store refusals (:class:`~kvoffload.refusals
.Refusals`: counted and explained) and the counters (:class:`~kvoffload.stats.Stats`).

It imports no vLLM: :mod:`kvoffload.vllm.manager` adapts it to vLLM's ``OffloadingManager``, its
published KV events take vLLM's event types from :mod:`kvoffload.vllm.kv_events` (vLLM-free), its
counters reach Prometheus through :func:`kvoffload.metrics.refresh`; the stress tool and tests
drive it directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvoffload import metrics as _metrics
from kvoffload.config import OffloadConfig, secret_env_names
from kvoffload.costs import RateEstimate, TierLoadCost, load_beats_recompute, promotion_deadline
from kvoffload.events import EventPublisher
from kvoffload.holds import NO_RANK, PromotionHolds
from kvoffload.host import READY, HostTier, StorePlan
from kvoffload.ipc.childenv import withhold
from kvoffload.ipc.slot_table import OUTCOMES, SlotTableError
from kvoffload.kv_events import EventStream
from kvoffload.policies import make_policy
from kvoffload.refusals import Refusals
from kvoffload.serving import PEER_MEDIUM, PeerServing
from kvoffload.stats import HOST, HOST_REFUSALS, RECOMPUTE_REASONS, TIER_REFUSALS, Stats
from kvoffload.tenants import TENANT_KEY_BYTES, tenant_id, tenant_key, tenant_secret
from kvoffload.tiers import create_tier
from kvoffload.tiers.base import (
    PEER_PROMOTION,
    SPECULATIVE_MISS,
    JobMetadata,
    LookupResult,
    RoutedTier,
    SecondaryTierManager,
    TierEvent,
    routed,
)

__all__ = [
    "HOST",
    "HOST_REFUSALS",
    "PEER_MEDIUM",
    "RECOMPUTE_REASONS",
    "TIER_REFUSALS",
    "Stats",
    "TieringManager",
]

log = logging.getLogger("kvoffload")

_HIT, _MISS, _PENDING, _RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
_MAX_COUNTED_REQUESTS = 65_536
"""Requests whose counted lookup verdicts are kept (see :meth:`TieringManager._first_verdict`)."""
_ENGINE_KEYS_SWEEP_MIN = 4096
"""The tenant keys' engine keys are swept (:meth:`TieringManager._sweep_engine_keys`) once the map
holds at least this many, and twice as many as the last sweep kept."""
_OVERRUN_STEPS = 2
"""A promotion overruns no sooner than this many scheduler steps after its submission: the one
it was submitted at the end of, and one more for its result to be polled and its request asked
again (however fast the estimates say it should have been)."""
_PROBE_INTERVAL_S = 5.0
"""A tier judged slower than recompute is given one load now and then all the same (a probe),
at most this often (seconds): with no load, its estimate would never learn that it recovered."""


def _request_set(per_request: dict[str, set[Any]], req_id: str) -> set[Any]:
    """``req_id``'s set in ``per_request`` (made empty if missing): at most
    :data:`_MAX_COUNTED_REQUESTS` requests are kept, the oldest forgotten first (requests that
    never finished)."""
    s = per_request.get(req_id)
    if s is None:
        if len(per_request) >= _MAX_COUNTED_REQUESTS:
            del per_request[next(iter(per_request))]
        s = per_request[req_id] = set()
    return s


class _EngineKeyInfo:
    """A store's ``chunk_info`` asked with tenant keys: it answers for their engine keys."""

    __slots__ = ("info", "known")

    def __init__(self, info: Any, known: dict[bytes, tuple[bytes, str]]):
        self.info = info
        self.known = known

    def get(self, key: bytes) -> Any:
        e = self.known.get(key)
        return self.info.get(key if e is None else e[0])


class _Job:
    __slots__ = ("tier", "meta", "orphaned", "nbytes", "deadline", "step", "alone", "started")

    def __init__(self, tier: int, meta: JobMetadata):
        self.tier = tier
        self.meta = meta
        self.orphaned = False  # a reset forgot its chunks; its result only ends a quarantine
        self.nbytes = 0  # a promotion: the bytes it was expected to load (outstanding until done)
        self.deadline: float | None = None  # a promotion: when it has overrun (kvoffload.costs)
        self.step = 0  # a promotion: the scheduler step it was submitted in
        self.alone = False  # a promotion started on a tier with no load outstanding
        self.started = 0.0  # a promotion: time.monotonic() at its submission


class _Wait:
    """A request kept at RETRY by a tier's lookup (:meth:`TieringManager._wait`): the chunk it
    waits for, since when (deadline clock) and which step, the step it was last asked in, its
    deadline (None: no estimate yet; only ever raised), and the most chunks the request asked
    in one step while waiting (what a verdict may serve: vLLM asks every chunk each step)."""

    __slots__ = ("key", "since", "first", "last", "deadline", "seen_step", "seen", "stake")

    def __init__(self, key: bytes, since: float, step: int):
        self.key = key
        self.since = since
        self.first = self.last = self.seen_step = step
        self.deadline: float | None = None
        self.seen = self.stake = 0


class TieringManager:
    """Host tier plus ordered secondary tiers over one arena.

    Driven by the engine thread; the p2p tier's node thread also serves peers from the host tier
    (:meth:`serve_lookup`, :meth:`lease`, :meth:`release`, :meth:`admit`, :meth:`commit`, which
    take the lock and call :attr:`serving`) and polls. Every public entry point that reads or
    changes host-tier or tier state takes :attr:`lock` (a :class:`threading.RLock`; uncontended,
    it adds well under a microsecond per call); nothing waits or does I/O while holding it.

    Parts: :attr:`holds` (the promotion-hold policy), :attr:`serving` (peers' leases and pushes),
    :attr:`refusals` (store refusals, counted and explained), :attr:`stats` (the counters); the
    manager keeps the jobs (tier jobs in flight, queued promotions) and the holders' pins.

    Args:
        arena: the host :class:`~kvoffload.ipc.arena.Arena` (its slots are the host tier).
        namespace: :class:`~kvoffload.namespace.Namespace` of the chunks.
        config: parsed :class:`~kvoffload.config.OffloadConfig`.
        tiers: prebuilt tiers (tests); by default they are built from ``config.secondary_tiers``.
        record_events: keep host/tier events for :meth:`take_events` (vLLM's KV events).
        keep_metric_samples: keep histogram samples for :meth:`take_metric_stats` (vLLM's metrics).
        data_parallel_rank: the engine's data-parallel rank: published KV events bind the
            configured ports + this rank and carry it (:class:`~kvoffload.events.EventPublisher`).
        event_block_hash: ``key -> block hash`` published for a chunk stored without a
            :class:`~kvoffload.events.ChunkEventInfo` and in removals (default: the key itself).
        request_chunks: host-tier chunks one request of the engine's longest length takes (vLLM:
            ``max_model_len`` tokens; 0: unknown). The warnings of the host tier's refusals then
            name a ``cpu_bytes_to_use`` that holds one such request.

    Metrics: :meth:`refresh_metrics` (also called by :func:`kvoffload.metrics.serve`'s endpoint,
    where this manager is exported under its ``instance`` label). KV events: with
    ``config.kv_events`` set, each :meth:`step` publishes that step's events (:mod:`kvoffload.events`).

    Raises:
        ConfigError: a tier config is invalid or a tier cannot start.
    """

    def __init__(
        self,
        arena: Any,
        namespace: Any,
        config: OffloadConfig,
        *,
        tiers: list[SecondaryTierManager] | None = None,
        record_events: bool = True,
        poll_interval_s: float = 0.0005,
        keep_metric_samples: bool = False,
        data_parallel_rank: int = 0,
        event_block_hash: Any = None,
        request_chunks: int = 0,
    ):
        #: Taken by every entry point that reads or changes host-tier or tier state (reentrant:
        #: entry points call each other). Held briefly: no I/O, no waiting under it.
        self.lock = threading.RLock()
        self.arena = arena
        self.namespace = namespace
        self.config = config
        self.request_chunks = request_chunks
        keep_events = record_events
        record_events = record_events or config.kv_events is not None
        self.host = HostTier(
            arena.num_slots,
            make_policy(config.eviction_policy, arena.num_slots, config.cache_policy_module_path),
            record_events=record_events,
        )
        #: A warm restart (the arena has a slot table): chunks by outcome, adopted or dropped by
        #: reason (:data:`~kvoffload.ipc.slot_table.OUTCOMES`, the ``outcome`` label of
        #: ``kvoffload_warm_restart_chunks_total``); None without one.
        # warm-restart adopted tenant keys whose engine keys are not known yet (_warm_start)
        self._unconfirmed: set[bytes] = set()
        self.warm_restart: dict[str, int] | None = self._warm_start(arena, namespace)
        # The variables holding this engine's secrets (a p2p tier's secret_env) never reach a
        # child process (tier workers, janitors), whatever allow-list admits them.
        withhold(*secret_env_names(config))
        # before any tier starts: an unset tenant_key_env stops the start with nothing to undo
        self._tenant_secret = tenant_secret(config.tenant_key_env)
        if config.host_tenant_quota_bytes is not None or config.host_tenant_quotas:
            # a quota smaller than a slot stops the start here, with nothing to undo; chunks a
            # warm restart adopted count for no tenant until a request names their tenant
            self.host.limit_tenants(
                config.host_tenant_quota_bytes,
                config.host_tenant_quotas,
                arena.row_bytes,
                self._tenant_of_key,
            )
        self.tenant_metrics_top = config.tenant_metrics_top
        self.tiers: list[SecondaryTierManager] = []
        if tiers is not None:
            self.tiers = list(tiers)
        else:
            try:
                for i, spec in enumerate(config.secondary_tiers):
                    self.tiers.append(
                        create_tier(
                            spec,
                            arena,
                            namespace,
                            f"kv_connector_extra_config.secondary_tiers[{i}]",
                        )
                    )
            except BaseException:
                for t in self.tiers:
                    t.shutdown()
                raise
        for t in self.tiers:
            t.record_events = record_events
        self.tier_names = [t.name for t in self.tiers]
        try:
            #: The tiers that follow requests' routing (:class:`~kvoffload.tiers.base.RoutedTier`),
            #: checked once here: only they are attached, told of requests and asked what to store.
            self._routed_at: dict[int, RoutedTier] = {
                i: t for i, t in enumerate(self.tiers) if routed(t)
            }
        except TypeError:
            for t in self.tiers:
                t.shutdown()
            raise
        defs = list(_metrics.CORE_METRICS)
        for t in self.tiers:
            defs.extend(type(t).metric_definitions)
        self.metrics = _metrics.MetricSet(defs, keep_samples=keep_metric_samples)
        for t in self.tiers:
            t.metrics = self.metrics
        for name in [
            HOST,
            *self.tier_names,
        ]:  # series created up front: scrapes never see them grow
            self.metrics.histogram("kvoffload_lookup_latency_seconds", name)
            if name != HOST:
                for d in ("load", "store"):
                    self.metrics.histogram("kvoffload_tier_transfer_latency_seconds", name, d)
        self.instance = _metrics.register_source(self, config.instance_id)
        self._lookup_sample = 0
        try:
            #: KV events: kept for :meth:`take_events`, published with ``config.kv_events``.
            self.events = EventStream(
                self.host,
                self.tiers,
                config.kv_events,
                routed=self._routed_at.values(),
                keep=keep_events,
                host_name=HOST,
                instance=self.instance,
                data_parallel_rank=data_parallel_rank,
                block_size=namespace.tokens_per_chunk,
                block_hash=event_block_hash,
                row_bytes=arena.row_bytes,
            )
        except BaseException:
            _metrics.unregister_source(self.instance)
            for t in self.tiers:
                t.shutdown()
            raise
        self.stats = Stats(self.tier_names)
        self._store_pins = [0] * len(self.tiers)  # host slots pinned by each tier's stores
        self._pin_limit = max(1, int(config.tier_pin_fraction * arena.num_slots))
        self.refusals = Refusals(
            self.host,
            self.stats,
            arena.row_bytes,
            config.cpu_bytes_to_use,
            request_chunks,
            self._pin_limit,
        )
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._promotions: dict[int, dict[str, tuple[list[bytes], list[int]]]] = {}
        # Pins held for host -> accelerator copies, per holder (request): req_id -> key ->
        # [slot, pins]. A completion drops only its own holder's pins (CASES C28).
        self._load_pins: dict[str, dict[bytes, list[int]]] = {}
        # Writes reserved by prepare_store and not yet completed: key -> the request that holds it.
        self._writes: dict[bytes, str] = {}
        self._load_source: dict[str, dict[bytes, int]] = {}
        # Chunks whose lookup verdict has been counted, per request (dropped when it finishes; at
        # most _MAX_COUNTED_REQUESTS requests kept, the oldest forgotten first)
        self._counted: dict[str, set[bytes]] = {}
        # The tiers (indices) each running request's prefix has a hole in: a chunk of it was
        # dropped or failed there, so later ones are not written to them (CASES C48). Dropped when
        # it finishes; at most _MAX_COUNTED_REQUESTS requests kept, the oldest forgotten first.
        self._holes: dict[str, set[int]] = {}
        # The requests finished lately (at most _MAX_COUNTED_REQUESTS): no hole is kept for them.
        self._ended: OrderedDict[str, None] = OrderedDict()
        # The tiers that keep every chunk a request covers, loaded as well as stored (C49).
        self._hold_covered = [
            (i, t)
            for i, t in enumerate(self.tiers)
            if type(t).holds_covered is not SecondaryTierManager.holds_covered
        ]
        # The tiers (indices) whose in-flight stores may only keep slots pinned, and give them
        # up for a newer store that would not fit their pin budget (``yield_pins``).
        self._yielding = frozenset(
            i
            for i, t in enumerate(self.tiers)
            if type(t).yield_pins is not SecondaryTierManager.yield_pins
        )
        #: The promotion-hold policy (docs/profiles/thrash.md). Holds take at most what one
        #: tier's in-flight stores may leave (tier_pin_fraction), so write-through keeps room
        #: without evicting held chunks (CASES C37).
        self.holds = PromotionHolds(
            self.host,
            config.promotion_hold_steps,
            max(1, arena.num_slots - self._pin_limit),
            self.stats,
        )
        #: The serving side of the p2p tier: peers' leases and admitted writes.
        self.serving = PeerServing(self)
        # Never slower than recompute (kvoffload.costs, config slower_than_recompute): what a
        # load from each tier costs, what prefill costs, the promotions in flight by chunk (for
        # their deadlines) and, per request, the chunks answered MISS for it because a tier was
        # slower (MISS for the rest of its life: vLLM recomputes from the first one).
        #: The clock of the deadlines (seconds; tests replace it). A tier's throughput is
        #: measured in real time (time.monotonic) whatever this clock says.
        self.clock = time.monotonic
        #: Per secondary tier (in order): its load throughput and the loads it has outstanding.
        self.load_costs = [TierLoadCost() for _ in self.tiers]
        #: The engine's prefill throughput (tokens/s): ``recompute_tokens_per_s``, else fed by
        #: :meth:`observe_prefill`.
        self.prefill = RateEstimate(fixed=config.recompute_tokens_per_s)
        self._gating = config.slower_than_recompute == "recompute"
        self._margin = config.recompute_margin
        self._overrun = config.promotion_overrun_factor
        self._promoting: dict[bytes, _Job] = {}
        self._recompute: dict[str, set[bytes]] = {}
        # per request, the wait a tier's lookup keeps it in (_wait)
        self._waiting: dict[str, _Wait] = {}
        self._probed_at = [float("-inf")] * len(self.tiers)
        # The tiers judged on their costs: not the routed ones (p2p), whose job times hold a
        # peer's own prefill, its lease refusals and protocol steps, not what a load costs (a
        # p2p job measured so answered every later lookup MISS on vLLM-CPU): served as before.
        self._costed = [i not in self._routed_at for i in range(len(self.tiers))]
        # Tenants (kvoffload.tenants): the tenant id of each request with a cache_salt. A live
        # request's is never forgotten (its keys must not change mid-request: its reserved
        # writes and pins are held under its tenant keys); once it finishes it is kept for its
        # late completions among the last _MAX_COUNTED_REQUESTS finished (_tenants_ended).
        # The engine key and tenant of each tenant key (_engine_keys) are kept while anything
        # holds the chunk (the host tier, a bounded tier's count, a write, pin, job, promotion
        # or untaken event: _sweep_engine_keys drops the rest once the map doubles), so every
        # exit names the engine's key. A tenant's chunk whose engine key was never known here
        # (found by a tier's start scan, adopted by a warm restart: _unconfirmed) gets no
        # event rather than a wrong hash. All empty while no request has a salt: every entry
        # point then costs one truthiness test.
        self._tenants: dict[str, str] = {}
        self._tenants_ended: OrderedDict[str, None] = OrderedDict()
        self._engine_keys: dict[bytes, tuple[bytes, str]] = {}
        self._sweep_at = _ENGINE_KEYS_SWEEP_MIN
        # each running salted request's tenant keys by engine key (_request_tenant_key)
        self._req_tenant_keys: dict[str, dict[bytes, bytes]] = {}
        self.events.to_engine = self._events_to_engine
        for t in self.tiers:
            t.tenant_of = self._tenant_of_key  # type: ignore[method-assign]
            t.engine_key_of = self._engine_key_of_key  # type: ignore[method-assign]
        # The online canary (kvoffload.canary; empty without it): tiers (indices) whose loads a
        # mismatch closed (fail_closed; swapped whole, so another thread's closing is atomic),
        # and the one tier (or none, -1) each canary run may load from.
        self._closed_loads: frozenset[int] = frozenset()
        self._only: dict[str, int] = {}
        #: The canary's checks by outcome (:data:`kvoffload.canary.OUTCOMES`) and the wall time
        #: they took (seconds); empty and 0 without a canary.
        self.canary_checks: dict[str, int] = {}
        self.canary_seconds = 0.0
        self._poll_interval = poll_interval_s
        self._last_poll = 0.0
        self._closed = False
        self._tiers_stopped = False
        self.data_parallel_rank = data_parallel_rank
        try:
            for hooks in self._routed_at.values():
                hooks.attach(self)
        except BaseException:
            self.shutdown()
            raise

    # -- lookup ---------------------------------------------------------------------------------

    def lookup(self, key: bytes, req_id: str = "", promote: bool = True) -> LookupResult:
        """Where is ``key``? HIT (host, readable now), HIT_PENDING (host, being written or promoted),
        RETRY (a tier is still looking) or MISS. Never blocks (beyond :attr:`lock`).

        A tier's HIT starts the key's promotion into the host tier (HIT_PENDING); with ``promote``
        False it starts none and answers RETRY (the caller may not need the key: a chunk outside
        every window a sliding-window lookup can still choose, :class:`kvoffload.hybrid.WindowScans`);
        a later lookup with ``promote`` promotes it."""
        # acquire/release rather than ``with``: half the cost on the hot path (BENCHMARKS.md)
        lock = self.lock
        lock.acquire()
        try:
            if self._tenants:
                tenant = self._tenants.get(req_id)
                if tenant is not None:
                    key = self._request_tenant_key(req_id, key, tenant)
                elif self._unconfirmed:
                    self._unconfirmed.discard(key)  # an unsalted request's: an engine key
            elif self._unconfirmed:
                self._unconfirmed.discard(key)
            recompute = self._recompute
            if recompute and key in recompute.get(req_id, ()):
                return _MISS  # a tier was slower: this request recomputes it (never HIT later)
            host = self.host
            slot = host.index.get(key)
            if slot is not None and host.state[slot] != READY and (self._jobs or self._promotions):
                # being written: a promotion that landed since the last poll answers HIT now,
                # not one scheduler step later (docs/profiles/ttft.md)
                if time.monotonic() - self._last_poll >= self._poll_interval:
                    self.poll(submit=False)
                    slot = host.index.get(key)  # a failed promotion freed it: ask the tiers
                if slot is not None and host.state[slot] != READY and self._overran(key, req_id):
                    return _MISS
            stats = self.stats
            if slot is not None:
                if self._waiting:
                    self._answered(key, req_id)
                if self._first_verdict(key, req_id):
                    stats.host_queries += 1
                    stats.host_hits += 1
                holds = self.holds
                holds.hit_slots.add(slot)
                if holds.chunks:  # its holder still wants it: the hold lives on
                    holds.seen(key, req_id)
                self._lookup_sample += 1
                if self._lookup_sample & 63 == 0:  # time 1 in 64 host lookups (histogram's cost)
                    t0 = time.perf_counter()
                    r = _HIT if host.state[host.index[key]] == READY else _PENDING
                    self.metrics.observe(
                        "kvoffload_lookup_latency_seconds", time.perf_counter() - t0, HOST
                    )
                    return r
                return _HIT if host.state[slot] == READY else _PENDING
            now = time.monotonic()
            if now - self._last_poll >= self._poll_interval:
                self.poll(submit=False)  # results only: a request's promotions go out together
            r = self._ask_tiers(key, req_id, promote)
            if self._waiting and r is not _RETRY:
                self._answered(key, req_id)
            return r
        finally:
            lock.release()

    def _ask_tiers(self, key: bytes, req_id: str, promote: bool) -> LookupResult:
        """:meth:`lookup` of a host miss: the tiers in order (under :attr:`lock`)."""
        retrying: list[int] = []
        # the canary's: tiers closed by a mismatch, the one tier a canary run may load from
        closed = self._closed_loads
        only = self._only.get(req_id) if self._only else None
        for i, tier in enumerate(self.tiers):
            if only is not None and i != only:
                continue
            if closed and i in closed:
                if tier.lookup(key, req_id) is _HIT:  # held there, not loaded: recomputed
                    self._count_verdict(key, req_id, i + 1, -1)
                    self._give_way(req_id, i, [key], "canary")
                    return _MISS
                continue
            # a chunk to promote when found may be loaded on the tier's expectation; one a
            # window scan may not choose needs the tier's verdict (present or absent)
            r = tier.lookup_for_load(key, req_id) if promote else tier.lookup(key, req_id)
            if r is _HIT:
                if self._waiting:
                    self._answered(key, req_id)  # found: whatever follows is no tier's wait
                if not promote:
                    return _RETRY
                if self._gating and self._slower_than_recompute(i):
                    self._count_verdict(key, req_id, i + 1, -1)
                    self._give_way(req_id, i, [key], "slower_than_recompute")
                    self._probe(i, key)
                    return _MISS
                result = self._start_promotion(i, key, req_id)
                if result is _RETRY:  # no room yet: held for requests that asked earlier
                    return result
                self._count_verdict(key, req_id, i + 1, i if result is _PENDING else -1)
                return result
            if r is _RETRY:
                retrying.append(i)
        if retrying:
            if self._gating and req_id and promote:
                return self._wait(key, req_id, retrying)
            return _RETRY
        self._count_verdict(key, req_id, len(self.tiers), -1)
        return _MISS

    # -- never slower than recompute (kvoffload.costs) ------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` tokens of prefill in ``seconds``: a sample of the live
        prefill estimate (ignored with ``recompute_tokens_per_s`` set). The vLLM plug-in feeds
        its scheduler's steps (:class:`~kvoffload.vllm.manager.KVOffloadManager`)."""
        with self.lock:
            self.prefill.observe(tokens, seconds)

    def _slower_than_recompute(self, tier_idx: int) -> bool:
        """Whether tier ``tier_idx`` moves a chunk slower than the engine recomputes it, by more
        than ``recompute_margin``: its bytes at the tier's throughput against its tokens at the
        prefill rate. What the tier has queued and a job's fixed cost are weighed when the
        request's promotions are submitted, together (:meth:`_judged_at_submission`): judged at
        its first chunk, a long prefix behind other requests' loads would always lose to that
        one chunk's recompute. False while an estimate is missing."""
        cost = self.load_costs[tier_idx]
        rate = cost.loads.rate
        if rate is None or self.prefill.rate is None or not self._costed[tier_idx]:
            return False  # a tier is judged on its loads only (its stores' queueing is no load's)
        load_s = self.arena.row_bytes / rate
        recompute_s = self.prefill.seconds_for(self.namespace.tokens_per_chunk)
        slower = not load_beats_recompute(load_s, recompute_s, self._margin)
        if slower and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvoffload: %s judged slower than recompute at lookup: a chunk %.2f ms to load "
                "(%.1f MB/s) against %.2f ms to recompute (%.0f prefill tokens/s), margin %g",
                self.tier_names[tier_idx], load_s * 1e3, rate / 1e6,
                (recompute_s or 0.0) * 1e3, self.prefill.rate or 0.0, self._margin,
            )  # fmt: skip
        return slower

    def _judged_at_submission(self, job: _Job) -> bool:
        """Whether a promotion about to be submitted serves its request: its chunks (the
        request's found prefix from that tier this step, vLLM looks a request's chunks up
        together), behind everything the tier has outstanding and at least a job's fixed cost,
        are expected to load within ``recompute_margin`` times their recompute. False: the
        request gives way (:meth:`_give_way`, reason ``slower_than_recompute``): MISS from the
        job's first chunk, the load goes on and lands in the host tier for later requests."""
        cost = self.load_costs[job.tier]
        meta = job.meta
        if not (self._gating and self._costed[job.tier]) or meta.req_id in ("", PEER_PROMOTION):
            return True  # not judged, or no request waits for it (a probe, a peer's)
        if cost.loads.rate is None or self.prefill.rate is None:
            return True  # no evidence, no change
        load_s = cost.expected_s(len(meta.keys) * self.arena.row_bytes)
        recompute_s = self.prefill.seconds_for(len(meta.keys) * self.namespace.tokens_per_chunk)
        serves = load_beats_recompute(load_s, recompute_s, self._margin)
        if not serves and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvoffload: request %s gives way to recompute at submission: %d chunk(s) from %s "
                "expected in %.1f ms (%.1f MB/s, %.0f KiB outstanding, a job at least %.1f ms) "
                "against %.1f ms to recompute (%.0f prefill tokens/s), margin %g",
                meta.req_id, len(meta.keys), self.tier_names[job.tier], (load_s or 0.0) * 1e3,
                (cost.bytes_per_s or 0.0) / 1e6, cost.outstanding_bytes / 1024,
                (cost.job_seconds or 0.0) * 1e3, (recompute_s or 0.0) * 1e3,
                self.prefill.rate or 0.0, self._margin,
            )  # fmt: skip
        return serves

    def _probe(self, tier_idx: int, key: bytes) -> None:
        """Tier ``tier_idx`` was judged slower than recompute for ``key``: promote ``key`` all the
        same, for no request (none waits for it: the chunk lands in the host tier for later
        ones), when the tier has no load outstanding or queued and was not probed in the last
        :data:`_PROBE_INTERVAL_S` seconds, so that its estimate follows it when it recovers."""
        now = self.clock()
        if (
            self.load_costs[tier_idx].outstanding_bytes
            or tier_idx in self._promotions
            or now - self._probed_at[tier_idx] < _PROBE_INTERVAL_S
        ):
            return
        self._probed_at[tier_idx] = now
        self._start_promotion(tier_idx, key, PEER_PROMOTION, True)

    def _overran(self, key: bytes, req_id: str) -> bool:
        """Whether ``key`` (host WRITING) is being promoted by a job past its deadline
        (:func:`~kvoffload.costs.promotion_deadline`, and at least :data:`_OVERRUN_STEPS` steps
        after it was submitted): then ``req_id`` gives way (:meth:`_give_way`) and is answered
        MISS. The load goes on: its chunk is published when it lands."""
        if not self._gating or not self._promoting:
            return False
        job = self._promoting.get(key)
        if job is None or job.deadline is None or job.orphaned:
            return False
        if self.holds.step_no - job.step < _OVERRUN_STEPS or self.clock() < job.deadline:
            return False
        keys = [key]
        meta = job.meta
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvoffload: promotion job %d (%d chunk(s) from %s) overran: %.1f ms past its "
                "deadline, %d steps in flight",
                meta.job_id, len(meta.keys), self.tier_names[job.tier],
                (self.clock() - job.deadline) * 1e3, self.holds.step_no - job.step,
            )  # fmt: skip
        if req_id and meta.req_id == req_id:
            # its own promotion: it gives up this job's chunks from this one on, and those of
            # its later jobs (later chunks of its prefix, which its lookups no longer reach)
            keys = meta.keys[meta.keys.index(key) :]
            for other in self._jobs.values():
                m = other.meta
                if m.is_promotion and m.req_id == req_id and m.job_id > meta.job_id:
                    keys.extend(m.keys)
        self._give_way(req_id, job.tier, keys, "promotion_overran")
        return True

    def _wait(self, key: bytes, req_id: str, retrying: list[int]) -> LookupResult:
        """``req_id``'s lookup of ``key`` was answered RETRY by tiers ``retrying`` (a probe is
        out): RETRY while the request may wait. It gives way (:meth:`_give_way`; MISS, vLLM
        recomputes from this chunk) at once when each of those tiers is slower than recompute
        (reason ``slower_than_recompute``: a HIT from it would be answered MISS), else when the
        chunk it waits for is asked past its deadline (``lookup_overran``).

        The wait is the request's, from its first RETRY until that chunk gets a verdict (vLLM
        0.32 asks every chunk of a prompt each step, each RETRY while the request's probe is
        out; only the chunk waited for is judged, so a deadline passing in the middle of a pass
        cuts nothing after it). A wait whose chunk was not asked in this step or the one before
        is over (the request went on, or was preempted): the next RETRY begins a new one. Its
        deadline, from its start: ``promotion_overrun_factor`` times the longest of those tiers'
        expected lookups (:meth:`_expected_lookup_s`: a usual lookup behind the loads the tier
        has outstanding), never less than one chunk's recompute (a hiccup does not cost a
        prefix) and never more than ``recompute_margin`` times the recompute of the most chunks
        the request asked in one step (what the verdict may serve); only ever raised (the
        queue it waits behind drains as it waits), and at least :data:`_OVERRUN_STEPS` steps.
        A probe queued behind another request's abandoned slow loads kept a fresh request
        waiting for them (BENCHMARKS.md §6, item 4 on a slow tier). Not judged while an
        estimate is missing (the tier's lookups or throughput, the engine's prefill), nor for
        a tier not costed (p2p)."""
        if not all(self._costed[i] for i in retrying):
            return _RETRY
        if all(self._slower_than_recompute(i) for i in retrying):
            self._count_verdict(key, req_id, len(self.tiers), -1)
            self._give_way(req_id, retrying[0], [key], "slower_than_recompute")
            self._answered(key, req_id)
            return _MISS
        now, step = self.clock(), self.holds.step_no
        waiting = self._waiting
        w = waiting.get(req_id)
        if w is None or (w.key != key and w.last < step - 1):
            if w is None and len(waiting) >= _MAX_COUNTED_REQUESTS:  # never finished
                del waiting[next(iter(waiting))]
            w = waiting[req_id] = _Wait(key, now, step)
        if w.seen_step != step:
            w.seen_step, w.seen = step, 0
        w.seen += 1
        w.stake = max(w.stake, w.seen)
        if w.key != key:
            return _RETRY  # only the chunk waited for is judged
        w.last = step
        tokens = self.namespace.tokens_per_chunk
        chunk_s = self.prefill.seconds_for(tokens)
        if chunk_s is None:
            return _RETRY  # no evidence: no change
        expected = 0.0
        for i in retrying:
            e = self._expected_lookup_s(i)
            if e is None:
                return _RETRY
            expected = max(expected, e)
        wait_s = min(
            max(self._overrun * expected, chunk_s), self._margin * chunk_s * max(1, w.stake)
        )
        if w.deadline is None or w.since + wait_s > w.deadline:
            w.deadline = w.since + wait_s
        if step - w.first < _OVERRUN_STEPS or now < w.deadline:
            return _RETRY
        del waiting[req_id]
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "kvoffload: request %s waited %.1f ms and %d steps for %s to look a chunk up "
                "(expected %.1f ms, %d chunk(s) at stake): gives way to recompute",
                req_id, (now - w.since) * 1e3, step - w.first,
                "/".join(self.tier_names[i] for i in retrying), expected * 1e3, w.stake,
            )  # fmt: skip
        self._count_verdict(key, req_id, len(self.tiers), -1)
        self._give_way(req_id, retrying[0], [key], "lookup_overran")
        return _MISS

    def _expected_lookup_s(self, tier_idx: int) -> float | None:
        """What a lookup of tier ``tier_idx`` answered RETRY is expected to take (seconds): its
        usual lookup (:attr:`~kvoffload.tiers.base.SecondaryTierManager.lookup_seconds`;
        before its first answered lookup, one chunk's load at the tier's known throughput, at
        least a job's usual time: a generous stand-in, a probe moves no bytes) plus the loads
        it has outstanding at its throughput (its probes queue behind them: the same
        readers). None without either estimate."""
        cost = self.load_costs[tier_idx]
        rate = cost.bytes_per_s
        usual = self.tiers[tier_idx].lookup_seconds
        if rate is None:
            return usual
        if usual is None:
            usual = max(self.arena.row_bytes / rate, cost.job_seconds or 0.0)
        return usual + cost.outstanding_bytes / rate

    def _answered(self, key: bytes, req_id: str) -> None:
        """``req_id``'s lookup of ``key`` got a verdict: if it is the chunk the request waited
        for, its wait ends (:meth:`_wait`; one whose chunk is no longer asked ends there)."""
        w = self._waiting.get(req_id)
        if w is not None and w.key == key:
            del self._waiting[req_id]

    def _give_way(self, req_id: str, tier_idx: int, keys: list[bytes], reason: str) -> None:
        """``req_id`` recomputes ``keys`` (its first one answered MISS now) instead of waiting
        for tier ``tier_idx``: they are MISS for it from now on, their tokens counted once
        (``Stats.recomputed``), and what it held on them ends: promotion holds and load
        sources (it never loads them; no pin was taken: pins come with prepare_load)."""
        if req_id:
            mine = _request_set(self._recompute, req_id)
            new = [k for k in keys if k not in mine]
            mine.update(new)
            self.holds.loaded(req_id, new)  # its holds end: the chunks are evictable once landed
            src = self._load_source.get(req_id)
            if src:
                for k in new:
                    src.pop(k, None)
        else:
            new = keys
        k2 = (self.tier_names[tier_idx], reason)
        self.stats.recomputed[k2] += len(new) * self.namespace.tokens_per_chunk
        if new:
            log.debug(
                "kvoffload: %d chunk(s) of request %s recomputed: %s %s",
                len(new),
                req_id,
                self.tier_names[tier_idx],
                reason,
            )

    @property
    def promotion_holds(self) -> int:
        """Host chunks held now for the requests they were promoted for (not loaded yet)."""
        return len(self.holds)

    def _first_verdict(self, key: bytes, req_id: str) -> bool:
        """Whether this is the first verdict on ``key`` for request ``req_id`` (always, for a
        caller that names no request): only that one is counted (see :class:`Stats`)."""
        if not req_id:
            return True
        counted = self._counted.get(req_id)
        if counted is None:
            if len(self._counted) >= _MAX_COUNTED_REQUESTS:  # requests never finished
                del self._counted[next(iter(self._counted))]
            counted = self._counted[req_id] = set()
        elif key in counted:
            return False
        counted.add(key)
        return True

    def _count_verdict(self, key: bytes, req_id: str, num_tiers: int, hit_tier: int) -> None:
        """A host miss of ``req_id`` got its verdict after asking the first ``num_tiers`` tiers
        (``hit_tier`` answered with a hit, -1 for none); counted if it is the first."""
        if not self._first_verdict(key, req_id):
            return
        stats = self.stats
        stats.host_queries += 1
        tq = stats.tier_queries
        for name in self.tier_names[:num_tiers]:
            tq[name] += 1
        if hit_tier >= 0:
            stats.tier_hits[self.tier_names[hit_tier]] += 1

    def _start_promotion(
        self, tier_idx: int, key: bytes, req_id: str, for_peer: bool = False
    ) -> LookupResult:
        """Reserve a host slot for ``key`` (found in tier ``tier_idx``) and queue its promotion:
        HIT_PENDING. No room: RETRY while the host tier is full of chunks held for requests that
        asked earlier (at most ``promotion_hold_steps`` steps per request, :attr:`holds`), else
        MISS."""
        host, holds = self.host, self.holds
        holding = holds.steps > 0 and not for_peer
        if holding:
            rank, hold, may_promote = holds.claim(req_id)
        else:
            rank, hold, may_promote = NO_RANK, False, True
        plan = None
        if may_promote:
            protect = holds.protected(rank)
            if host.num_used < host.num_slots or holds.victim_outside(protect):
                plan = host.allocate([key], protect)
        if plan is None and holding:
            if holds.wait(req_id, rank):  # chunks held for requests that asked earlier
                return _RETRY
            return self._refuse_promotion(tier_idx)
        if plan is not None and plan.refused:  # its tenant's quota: none of its chunks may go
            self.stats.promotion_alloc_failures += 1
            self.refusals.tenant_quota("load", 1, self._tenant_of_key(key))
            return _MISS
        if plan is None or not plan.slots:  # no room, or a write a reset quarantined holds the key
            return self._refuse_promotion(tier_idx)
        if plan.evicted:
            holds.evicted(plan.evicted)  # younger requests' holds
        per_req = self._promotions.setdefault(tier_idx, {})
        keys, slots = per_req.setdefault(req_id, ([], []))
        keys.append(key)
        slots.append(plan.slots[0])
        if not for_peer:  # a peer's promotion is no request's load
            self._load_source.setdefault(req_id, {})[key] = tier_idx
        if holding:
            holds.promoted(key, plan.slots[0], req_id, rank, hold)
        return _PENDING

    def _refuse_promotion(self, tier_idx: int) -> LookupResult:
        """A chunk found in tier ``tier_idx`` is not promoted: MISS, counted and logged."""
        self.stats.promotion_alloc_failures += 1
        self.refusals.promotion(self.tier_names[tier_idx])
        return _MISS

    def submit_promotions(self, peers_only: bool = False) -> None:
        """Submit the promotions queued by lookups since the last call: one load job per tier and
        request (the first thing :meth:`poll`, and so :meth:`step`, does; benchmarks call it
        alone to time the hand-off). ``peers_only``: only those for no request (peers', probes),
        as the p2p node thread does between the engine's lookups, which must not split a
        request's found prefix (:meth:`poll`). Never blocks."""
        with self.lock:
            if not self._promotions:
                return
            if peers_only:
                pending = {}
                for tier_idx, per_req in list(self._promotions.items()):
                    peers = per_req.pop(PEER_PROMOTION, None)
                    if peers is not None:
                        pending[tier_idx] = {PEER_PROMOTION: peers}
                    if not per_req:
                        del self._promotions[tier_idx]
            else:
                pending, self._promotions = self._promotions, {}
            for tier_idx, per_req in pending.items():
                tier = self.tiers[tier_idx]
                for req_id, keys, slots, tenant in self._promotion_jobs(per_req, tier):
                    meta = JobMetadata(
                        job_id=self._job_id(),
                        keys=keys,
                        slots=slots,
                        is_promotion=True,
                        req_id=req_id,
                        tenant=tenant,
                    )
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug(
                            "promotion job %d: %d chunk(s) from %s for %s",
                            meta.job_id,
                            len(keys),
                            tier.name,
                            req_id,
                        )
                    job = self._jobs[meta.job_id] = _Job(tier_idx, meta)
                    serves = self._judged_at_submission(job)
                    self._promotion_submitted(job)
                    tier.submit_load(meta)
                    if not serves:
                        self._give_way(req_id, tier_idx, list(keys), "slower_than_recompute")

    def _promotion_jobs(
        self, per_req: dict[str, tuple[list[bytes], list[int]]], tier: SecondaryTierManager
    ) -> list[tuple[str, list[bytes], list[int], str]]:
        """``tier``'s queued promotions as jobs ``(req_id, keys, slots, tenant)``: one per
        request; the peers' (no request) one per tenant, so that a job names one tenant
        (:attr:`JobMetadata.tenant`): the tier's own (a chunk its scan found, whose engine key
        nobody here knows), else this manager's."""
        out = []
        for req_id, (keys, slots) in per_req.items():
            if req_id != PEER_PROMOTION or not (self._engine_keys or tier.holds_tenants()):
                out.append((req_id, keys, slots, self._tenant_of_job(keys, req_id)))
                continue
            groups: dict[str, tuple[list[bytes], list[int]]] = {}
            for k, slot in zip(keys, slots):
                g = groups.setdefault(tier.held_tenant(k) or self._tenant_of_key(k), ([], []))
                g[0].append(k)
                g[1].append(slot)
            out.extend((req_id, ks, ss, t) for t, (ks, ss) in groups.items())
        return out

    def _promotion_submitted(self, job: _Job) -> None:
        """Account a promotion about to be submitted: its bytes are outstanding on its tier, and
        it gets its deadline (:func:`~kvoffload.costs.promotion_deadline`; none without both
        estimates, or with ``slower_than_recompute: serve``)."""
        meta = job.meta
        cost = self.load_costs[job.tier]
        job.nbytes = len(meta.keys) * self.arena.row_bytes
        if self._gating and self._costed[job.tier]:
            job.step = self.holds.step_no
            job.deadline = promotion_deadline(
                self.clock(),
                cost.expected_s(job.nbytes),
                self.prefill.seconds_for(len(meta.keys) * self.namespace.tokens_per_chunk),
                self._overrun,
                self._margin,
            )
            promoting = self._promoting
            for k in meta.keys:
                promoting[k] = job
        # the tier's throughput is real elapsed time (clock is for deadlines: tests hold it)
        job.started = time.monotonic()
        job.alone = cost.started(job.nbytes, job.started)

    def _promotion_ended(self, job: _Job, res: Any) -> None:
        """A promotion's result came: its bytes are no longer outstanding, its chunks no longer
        promoting, and a successful load (or one that timed out) is a sample of its tier's
        throughput."""
        cost = self.load_costs[job.tier]
        promoting = self._promoting
        if promoting:
            for k in job.meta.keys:
                if promoting.get(k) is job:
                    del promoting[k]
        moved, timed_out = None, False  # a job a reset forgot says nothing of the tier's speed
        if job.orphaned:
            pass
        elif res.success:
            moved = res.transfer_bytes
        elif res.failed and "timeout" in res.failed.values():
            # a load that timed out took at least that long for its bytes: evidence of a slow
            # tier (a fast failure, a missing chunk, says nothing of its speed)
            moved, timed_out = job.nbytes, True
        # when the tier says it finished (a timeout's time is its own: at least the timeout)
        done_at = 0.0 if timed_out else res.done_at
        seconds = done_at - job.started if done_at > job.started else res.transfer_seconds
        cost.ended(job.nbytes, moved, seconds, job.alone, timed_out, done_at)

    # -- the online canary (kvoffload.canary) ---------------------------------------------------

    def restrict_loads(self, req_id: str, tier: str | None) -> None:
        """Request ``req_id`` (a canary run) may load a chunk the host tier does not hold from
        secondary tier ``tier`` only (None: from none). Forgotten when the request finishes.

        Raises:
            ValueError: ``tier`` names no secondary tier of this manager.
        """
        idx = -1 if tier is None else self.tier_names.index(tier)
        with self.lock:
            self._only[req_id] = idx

    def close_loads(self, tiers: Iterable[str]) -> list[str]:
        """Stop loading from ``tiers`` (names; ``"host"`` for the host tier) until this manager
        is rebuilt: the canary's ``fail_closed``. A closed secondary tier's chunks are answered
        MISS and counted as recomputed (``kvoffload_recomputed_tokens{reason="canary"}``); with
        the host tier closed, every lookup is a MISS (every load passes through it). Takes effect
        at the next lookup; chunks already promoted into the host tier from a closed tier stay
        there until evicted (:meth:`remove_host_copies` removes named ones). Safe from any
        thread. Returns the names closed now (not closed before).

        Raises:
            ValueError: a name is neither ``"host"`` nor a secondary tier of this manager.
        """
        names = list(tiers)
        bad = [n for n in names if n != HOST and n not in self.tier_names]
        if bad:
            raise ValueError(f"close_loads: no tier named {bad}; tiers: {[HOST, *self.tier_names]}")
        with self.lock:
            new = [
                n for n in names if n != HOST and self.tier_names.index(n) not in self._closed_loads
            ]
            self._closed_loads = self._closed_loads | {self.tier_names.index(n) for n in new}
            if HOST in names and "lookup" not in self.__dict__:
                self.lookup = self._lookup_host_closed  # type: ignore[method-assign]
                new.append(HOST)
            return new

    @property
    def closed_loads(self) -> list[str]:
        """The tiers :meth:`close_loads` closed (``"host"`` first when it is closed)."""
        host = [HOST] if "lookup" in self.__dict__ else []
        return host + [self.tier_names[i] for i in sorted(self._closed_loads)]

    def _lookup_host_closed(
        self, key: bytes, req_id: str = "", promote: bool = True
    ) -> LookupResult:
        """:meth:`lookup` once the host tier's loads are closed: MISS, a chunk the host tier
        held counted as recomputed (once per request and chunk)."""
        with self.lock:
            held = self._for_request([key], req_id)[0] if self._tenants else key
            if held in self.host.index and self._first_verdict(key, req_id):
                self.stats.host_queries += 1
                self.stats.recomputed[(HOST, "canary")] += self.namespace.tokens_per_chunk
            return _MISS

    def remove_host_copies(self, keys: Iterable[bytes], cache_salt: str = "") -> list[bytes]:
        """Remove ``keys`` (the engine's keys of chunks stored by requests with ``cache_salt``;
        "" for none) from the host tier where they are READY and unpinned (the canary's own
        chunks, before a check that must load them from a secondary tier, or after they were
        found wrong). Returns the engine's keys removed. Safe from any thread."""
        keys = list(keys)
        with self.lock:
            if not cache_salt:
                return self.host.remove(keys)
            tenant = tenant_id(cache_salt, self._tenant_secret)
            held = {self._tenant_key(k, tenant): k for k in keys}
            return [held[q] for q in self.host.remove(list(held))]

    def source_of(self, key: bytes, req_id: str = "") -> str:
        """The tier that served ``key`` for this request: ``"host"`` or a secondary tier's name."""
        with self.lock:
            if self._tenants:
                key = self._for_request([key], req_id)[0]
            idx = self._load_source.get(req_id, {}).get(key)
            return HOST if idx is None else self.tier_names[idx]

    @property
    def publishes_events(self) -> bool:
        """True when this manager publishes KV events itself (``config.kv_events``)."""
        return self.events.publisher is not None

    @property
    def publisher(self) -> EventPublisher | None:
        """The KV-event publisher (``config.kv_events``; None when off): its bound ``endpoint``
        and ``replay_endpoint``, ``published`` batch counts per stream, ``flush()``."""
        return self.events.publisher

    # -- host ↔ accelerator ---------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes], req_id: str = "") -> list[int]:
        """Pin READY keys for a host → accelerator copy and return their slots. The pins belong
        to ``req_id`` (the holder) until its :meth:`complete_load` of the same keys.

        Raises:
            KeyError: a key is not READY in the host tier (callers pass keys that looked up HIT);
                nothing is pinned then.
        """
        with self.lock:
            if self._tenants:
                keys = self._for_request(keys, req_id)
            slots = self.host.pin(keys)
            holds = self._load_pins.get(req_id)
            if holds is None:
                holds = self._load_pins[req_id] = {}
            for k, slot in zip(keys, slots):
                h = holds.get(k)
                if h is None:
                    holds[k] = [slot, 1]
                else:
                    h[1] += 1
            self.host.access(keys, req_id)
            self.events.moved(keys, HOST, "device")
            loads_from = self.stats.loads_from
            src = self._load_source.get(req_id)
            for k in keys:
                idx = src.get(k) if src else None
                loads_from[HOST if idx is None else self.tier_names[idx]] += 1
            if req_id and self._hold_covered:
                # chunks the request found stored (or promoted for it): a tier that keeps what a
                # request covers gets them as a store of its own (CASES C49)
                for i, tier in self._hold_covered:
                    if tier.holds_covered(req_id):
                        self._store_to(i, tier, list(keys), req_id, whole_when_idle=False)
            return slots

    def complete_load(self, keys: Iterable[bytes], req_id: str = "") -> None:
        """The accelerator copy of ``keys`` finished: drop the pins ``req_id`` took in
        :meth:`prepare_load`. A key this holder holds no pin on (a duplicated completion, another
        request's key) is ignored and counted (``Stats.unheld_completions``): it never releases
        someone else's pin (CASES C28)."""
        with self.lock:
            if self._tenants:
                keys = self._for_request(list(keys), req_id)
            holds = self._load_pins.get(req_id) or {}
            host = self.host
            for k in keys:
                h = holds.get(k)
                if h is None:
                    self.stats.unheld_completions += 1
                    continue
                h[1] -= 1
                if h[1] == 0:
                    del holds[k]
                host.unpin_slot(h[0])
            if not holds:
                self._load_pins.pop(req_id, None)
            self.holds.loaded(req_id, keys)  # loaded: its promotion holds end

    def pins_held(self) -> dict[int, int]:
        """Pins held on host slots, by slot: accelerator copies (per holder), peers' leases (per
        holder) and in-flight tier stores. Equals the host tier's ref counts when the bookkeeping is right (tests)."""
        with self.lock:
            out: dict[int, int] = {}
            for holds in self._load_pins.values():
                for slot, n in holds.values():
                    out[slot] = out.get(slot, 0) + n
            for slot, n in self.serving.pins():
                out[slot] = out.get(slot, 0) + n
            for job in self._jobs.values():
                if not job.meta.is_promotion:
                    for slot in job.meta.slots:
                        out[slot] = out.get(slot, 0) + 1
            return out

    def busy_slots(self) -> set[int]:
        """Host slots a transfer is in flight into or out of: tier jobs (promotions writing,
        stores reading), queued promotions, accelerator copies not yet completed, peers' leases
        (a peer reading) and admissions (a pull writing)."""
        with self.lock:
            busy = {s for job in self._jobs.values() for s in job.meta.slots}
            for per_req in self._promotions.values():
                for _, slots in per_req.values():
                    busy.update(slots)
            for holds in self._load_pins.values():
                busy.update(h[0] for h in holds.values())
            busy.update(self.serving.busy_slots())
            return busy

    # -- the serving side of the p2p tier (its node thread): PeerServing, under the lock --------

    def serve_lookup(
        self, keys: Sequence[bytes], requester: str = "peer", max_promotions: int | None = None
    ) -> list[LookupResult]:
        """A peer's lookup of ``keys``: HIT, HIT_PENDING or MISS per key
        (:meth:`PeerServing.lookup <kvoffload.serving.PeerServing.lookup>`). Never blocks; after
        :meth:`shutdown` every key is a MISS."""
        with self.lock:
            if self._tiers_stopped:
                return [_MISS] * len(keys)
            return self.serving.lookup(keys, requester, max_promotions)

    def serving_promotions(self) -> int:
        """Chunks :meth:`serve_lookup` is promoting for peers that have not landed yet (queued or
        loading, or loading into slots a reset quarantined; probes of a tier judged slower than
        recompute, :meth:`_probe`, count too). While this is not 0 the caller keeps
        calling :meth:`poll`: an idle engine is not stepped, and a promotion's result is applied
        only by a poll."""
        with self.lock:
            if self._tiers_stopped:
                return 0
            n = sum(
                len(keys)
                for per_req in self._promotions.values()
                for req, (keys, _slots) in per_req.items()
                if req == PEER_PROMOTION
            )
            for job in self._jobs.values():
                meta = job.meta
                # orphans (a reset forgot their chunks) too: their results end quarantines
                if meta.is_promotion and meta.req_id == PEER_PROMOTION:
                    n += len(meta.keys)
            return n

    def promote_for_peer(self, tier_idx: int, key: bytes) -> bool:
        """Queue a promotion of ``key``, found in tier ``tier_idx``, for peers (True), or not
        (False: no host slot). It is held for no request and is no request's load."""
        with self.lock:
            return self._start_promotion(tier_idx, key, PEER_PROMOTION, True) is _PENDING

    def lease(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Pin the READY ``keys`` for a peer's read, for ``holder``: a slot per key, -1 where not
        READY (:meth:`PeerServing.lease <kvoffload.serving.PeerServing.lease>`). The pins count in
        :meth:`pins_held`; a reset quarantines their slots until :meth:`release` (CASES C28)."""
        with self.lock:
            return self.serving.lease(keys, holder)

    def release(self, holder: str) -> None:
        """Drop every pin ``holder`` took with :meth:`lease` (an unknown holder is counted as
        ``Stats.stale_peer_completions``)."""
        with self.lock:
            self.serving.release(holder)

    def admit(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Reserve host slots (WRITING) for a peer's push of ``keys``, for ``holder``: a slot per
        key, -1 where present, repeated or without room (:meth:`PeerServing.admit
        <kvoffload.serving.PeerServing.admit>`); each write ends with that holder's
        :meth:`commit` once the pull into it has settled."""
        with self.lock:
            return self.serving.admit(keys, holder)

    def commit(self, keys: Iterable[bytes], holder: str, ok: bool) -> list[bytes]:
        """End ``holder``'s writes of ``keys`` reserved by :meth:`admit`: published when ``ok``,
        else freed; returns the keys published (:meth:`PeerServing.commit
        <kvoffload.serving.PeerServing.commit>`)."""
        with self.lock:
            return self.serving.commit(keys, holder, ok)

    def slots_of(self, keys: Iterable[bytes]) -> list[int]:
        """The host slot of each key (any state), -1 for a key not in the host tier."""
        with self.lock:
            index = self.host.index
            return [index.get(k, -1) for k in keys]

    def touch(self, keys: Sequence[bytes], req_id: str = "") -> None:
        """Mark ``keys`` recently used in every tier."""
        with self.lock:
            if self._tenants:
                keys = self._for_request(keys, req_id)
            self.host.access(keys, req_id)
            for tier in self.tiers:
                tier.touch(keys)

    def prepare_store(
        self, keys: Sequence[bytes], req_id: str = "", chunk_info: Any = None
    ) -> StorePlan | None:
        """Reserve host slots for the keys not yet present (accelerator → host copy).

        ``chunk_info``: optional, anything with ``get(key) -> ChunkEventInfo | None`` (a dict, or a
        lazy view the caller computes per key): the block hashes, parent hash and token ids that
        the chunk's ``BlockStored`` events carry. Read only for reserved keys, and only when KV
        events are published.

        Completions are processed first (unless a poll ran within ``poll_interval_s``, as it
        does for every request of one scheduler step after the first), and again before a batch
        is found not to fit, so pins released by finished tier jobs count before any eviction
        decision. When the whole batch does not fit, its longest prefix that fits is reserved;
        returns None only when not a single slot can be freed (everything pinned). The reserved
        writes belong to ``req_id``: only its :meth:`complete_store` ends them.
        """
        with self.lock:
            tenant = self._tenants.get(req_id) if self._tenants else None
            if tenant is not None:
                keys = self._for_request(keys, req_id)
                if chunk_info is not None:
                    chunk_info = _EngineKeyInfo(chunk_info, self._engine_keys)
            polled = self.poll_due()
            if polled:
                self.poll()
            host, holds = self.host, self.holds
            # held chunks (promoted, not loaded yet) are evicted only when nothing else makes room
            protect = holds.store_protect(keys)
            if len(protect) < len(holds.slots):
                keys = self._spare_holds(keys)
                protect = holds.store_protect(keys)
            plan = host.allocate(keys, protect)
            if plan is None and not polled:
                self.poll()
                protect = holds.store_protect(keys)
                plan = host.allocate(keys, protect)
            if plan is None:
                # Not enough room for the whole batch (slots pinned by in-flight transfers, or a batch
                # larger than the tier): keep its longest prefix that fits now. Lookups are prefix
                # ordered, so the head of a request is what later requests can reuse; the engine does
                # not offer the rest again.
                new = [k for k in dict.fromkeys(keys) if not host.is_present(k)]
                room = min(host.room_for(keys), len(new))
                if room > 0:
                    cut = keys.index(new[room - 1]) + 1
                    plan = host.allocate(keys[:cut], protect)
                    self.stats.store_truncations += 1
                    if plan is not None:
                        self.refusals.store_truncated(room, len(new))
                if plan is None:
                    self.stats.store_rejections += 1
                    self.refusals.store_rejected(len(new))
            if plan is not None and plan.evicted:
                holds.evicted(plan.evicted)
            if plan is not None and plan.refused:
                self.refusals.tenant_quota("store", plan.refused, tenant or "")
            if plan is not None and req_id:
                # the batch is the request's prefix, the chunks it found stored included (C47):
                # ranked in its order, those found ready counted as used (as vLLM does)
                host.order(keys, req_id)
                if len(plan.keys) < len(keys):  # some were stored already
                    written = set(plan.keys)
                    host.access(
                        [k for k in keys if k not in written and host.lookup(k) is _HIT], req_id
                    )
            if plan is not None and plan.keys:
                writes = self._writes
                for k in plan.keys:
                    writes[k] = req_id
            if chunk_info is not None and plan is not None:
                self.events.remember(plan.keys, chunk_info)
            if plan is not None and (self._engine_keys or self._unconfirmed):
                known = self._engine_keys
                plan = StorePlan(
                    # one engine key per reserved slot (never left out: they pair with slots)
                    [known[k][0] if k in known else k for k in plan.keys],
                    plan.slots,
                    self._engine_keys_of(plan.evicted),
                    plan.refused,
                )
            return plan

    def _spare_holds(self, keys: Sequence[bytes]) -> Sequence[bytes]:
        """A store of ``keys`` that would evict chunks held for waiting requests, less the new
        keys a secondary tier is known to hold (:meth:`~kvoffload.tiers.base.SecondaryTierManager
        .known_present`: a recomputed prefix tail offered again): the host tier does not take
        those now (counted as refused, reason ``in_tier``), so the held chunks their requests are
        about to load are not evicted for a copy the tier already has (docs/profiles/thrash.md).
        Later lookups find them in that tier as before."""
        host, tiers = self.host, self.tiers
        keep = [k for k in keys if host.is_present(k) or not any(t.known_present(k) for t in tiers)]
        skipped = len(keys) - len(keep)
        if skipped:
            self.refusals.left_to_tier(skipped)
        return keep

    def complete_store(self, keys: Iterable[bytes], success: bool = True, req_id: str = "") -> None:
        """The accelerator → host copy finished: publish the chunks (or free their slots on
        failure) and write them through to every secondary tier.

        Only writes ``req_id`` reserved in :meth:`prepare_store` and has not completed yet are
        ended. Any other key — a completion arriving twice, or late after its key was evicted or
        reset and reserved anew by another request, or a key being promoted from a tier — is
        ignored and counted (``Stats.stale_store_completions``): it must neither publish another
        writer's slot before its copy ended nor free it under the writer.
        """
        with self.lock:
            if self._tenants:
                keys = self._for_request(list(keys), req_id)
            writes = self._writes
            mine = []
            for k in keys:
                if writes.get(k) == req_id:
                    del writes[k]
                    mine.append(k)
                else:
                    self.stats.stale_store_completions += 1
            keys = mine
            self.holds.unblock()
            done = self.host.complete_write(keys, success, req_id)
            if not success:
                self.events.forget(keys)
            if success and done:
                self.events.moved(done, "device", HOST)
            if success and done and self.tiers:
                self.write_through(done, req_id)

    def write_through(self, keys: list[bytes], req_id: str = "") -> None:
        """Write ``keys`` (just published in the host tier: READY) through to every tier: one
        store job per tier, each pinning the keys' host slots until its result. What
        :meth:`complete_store` does after publishing; benchmarks call it alone to time the
        hand-off. Never blocks.

        Each tier may pin at most ``tier_pin_fraction`` of the host slots with its in-flight
        stores: of a batch that does not fit, the tier gets the longest prefix that does (lookups
        are prefix ordered) and the rest is dropped and counted, never waited for, so a slow tier
        cannot keep the host tier from taking new chunks (CASES C37). A tier with nothing in
        flight takes the whole batch, so a batch larger than the limit still reaches every tier.

        A request's chunks reach a tier in prefix order or not at all past the first one dropped
        (CASES C48): once a chunk of ``req_id`` was dropped for a tier (unless the tier is known
        to hold it) or failed there, its later chunks are dropped for that tier too (reason
        ``prefix_hole``), as no lookup could reach them past the hole.
        """
        with self.lock:
            routed_at = self._routed_at
            for i, tier in enumerate(self.tiers):
                hooks = routed_at.get(i)
                if hooks is not None and not hooks.wants_store(req_id):
                    continue
                self._store_to(i, tier, keys, req_id)

    def _store_to(
        self,
        i: int,
        tier: SecondaryTierManager,
        keys: list[bytes],
        req_id: str,
        whole_when_idle: bool = True,
    ) -> None:
        """One store job of the READY ``keys`` (or of their longest prefix its pin budget allows,
        none past a hole of ``req_id``'s prefix) to tier ``i``; the rest is dropped and counted
        (:meth:`write_through`). ``whole_when_idle``: a tier with nothing in flight takes the
        whole batch, past its budget (a write-through's; a hold of chunks a request found stored
        never does: a request that computes nothing must not pin more, C49 review)."""
        pins = self._store_pins
        holes = self._holes.get(req_id) if req_id else None
        if holes is not None and i in holes:
            take, reason = [], "prefix_hole"
        else:
            whole = whole_when_idle and not pins[i]
            over = pins[i] + len(keys) - self._pin_limit
            if whole_when_idle and not whole and over > 0 and i in self._yielding:
                # only chunks the request computed may take others' places: a hold of chunks it
                # found stored (C49) costs it nothing and takes only the room there is
                self._apply_results(tier, tier.yield_pins(over, req_id))
            take = keys if whole else keys[: max(0, self._pin_limit - pins[i])]
            reason = "pin_limit"  # why what is not taken is dropped
            # Asked even when over budget: a tier that refuses (open breaker, backlog) counts its
            # own drops, so the cause stays visible whatever the pin budget did.
            refusal = tier.store_refusal(len(take) or len(keys))
            if refusal is not None:
                take, reason = [], refusal
        dropped = len(keys) - len(take)
        if dropped:
            self.stats.dropped_stores[tier.name] += dropped
            self.refusals.tier_store(tier.name, reason, dropped, pins[i])
            if req_id and not all(map(tier.known_present, keys[len(take) :])):
                self._hole(req_id, i)
        if not take:
            return
        pins[i] += len(take)
        slots = self.host.pin(take)
        meta = JobMetadata(
            job_id=self._job_id(),
            keys=list(take),
            slots=slots,
            is_promotion=False,
            req_id=req_id,
            tenant=self._tenant_of_job(take, req_id),
        )
        self._jobs[meta.job_id] = _Job(i, meta)
        tier.submit_store(meta)

    def _hole(self, req_id: str, tier_idx: int) -> None:
        """``req_id``'s prefix has a hole in tier ``tier_idx`` (C48). Nothing is kept for a
        request that has finished (a store of it ending after its finish, a hold that expired)."""
        if req_id in self._ended:
            return
        _request_set(self._holes, req_id).add(tier_idx)

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    # -- completions ----------------------------------------------------------------------------

    def poll_due(self) -> bool:
        """Whether ``poll_interval_s`` has passed since the last :meth:`poll`."""
        return time.monotonic() - self._last_poll >= self._poll_interval

    def poll(self, submit: bool = True) -> None:
        """Submit queued promotions and probes (unless not ``submit``), and apply every finished
        tier job. Never blocks.

        A lookup polls with ``submit`` False: vLLM looks a request's chunks up one by one within
        a scheduler step, and a poll between two of them would split the request's found prefix
        into jobs of a chunk or two. Its promotions go out together at the step's end (or at the
        next store's poll, after the step's lookups): one job per request and tier, one hand-off
        per job, and the request's prefix judged whole (``slower_than_recompute``); measured, a
        request split so gave way for one chunk at a time behind the whole queue
        (BENCHMARKS.md §6).

        Safe from another thread than the engine's (the p2p tier's node polls while promotions
        it started are in flight, :meth:`serving_promotions`): it runs under :attr:`lock`, which
        every entry point that touches the tiers' sockets takes, so a socket is never used by
        two threads at once (ZMQ allows a socket to change threads behind a full memory
        barrier, which the lock is). Does nothing once :meth:`shutdown` has begun."""
        # acquire/release rather than ``with``: half the cost, and poll runs every step
        lock = self.lock
        lock.acquire()
        try:
            if self._tiers_stopped:
                return
            self._last_poll = time.monotonic()
            if submit and self._promotions:
                self.submit_promotions()
            for tier in self.tiers:
                tier.flush()
                self._apply_results(tier, tier.get_finished_jobs())
        finally:
            lock.release()

    def _apply_results(self, tier: SecondaryTierManager, results: Iterable[Any]) -> None:
        """Apply ``tier``'s finished jobs (:class:`~kvoffload.tiers.base.JobResult`): pins drop,
        loaded chunks are published, what failed is counted. Under :attr:`lock`."""
        promotions = False
        for res in results:
            job = self._finished_job(tier, res)
            if job is None:
                continue
            self.holds.unblock()  # a result may free or publish slots
            if not job.meta.is_promotion:
                self._store_done(tier, job, res)
                continue
            promotions = True
            self._promotion_ended(job, res)
            if job.orphaned:
                self._orphaned_promotion_done(job)
            else:
                self._promotion_done(tier, job, res)
        if promotions:  # the poll's results: one sample of the tier's throughput (real time)
            now = time.monotonic()
            for cost in self.load_costs:
                cost.sample(now)

    def _finished_job(self, tier: SecondaryTierManager, res: Any) -> _Job | None:
        """The job ``res`` (a :class:`~kvoffload.tiers.base.JobResult`) answers, no longer in
        flight; None, counted and logged, for a result of a job ``tier`` does not hold."""
        job = self._jobs.pop(res.job_id, None)
        if job is not None and self.tiers[job.tier] is tier:
            return job
        if job is not None:  # another tier's job: not this tier's to answer
            self._jobs[res.job_id] = job
        self.stats.unknown_job_results += 1
        log.warning(
            "tier %s reported job %d, which it does not hold; dropped", tier.name, res.job_id
        )
        return None

    def _transfer_done(
        self, tier: SecondaryTierManager, direction: str, meta: JobMetadata, res: Any
    ) -> None:
        """Count a finished job's time, the bytes the tier moved for it (as the tier reports
        them, CASES C50) and, when it failed, its failed chunks by reason."""
        self.metrics.observe(
            "kvoffload_tier_transfer_latency_seconds", res.transfer_seconds, tier.name, direction
        )
        stats = self.stats
        if res.transfer_bytes:
            k = (tier.name, direction)
            stats.transfer_bytes[k] = stats.transfer_bytes.get(k, 0) + res.transfer_bytes
        if res.success:
            return
        k2 = (tier.name, direction)
        stats.failed_jobs[k2] = stats.failed_jobs.get(k2, 0) + 1
        failed_stats = stats.failed
        for reason in (
            res.failed.values()
            if res.failed
            else ["unknown"] * (len(meta.keys) - len(res.successful_keys or ()))
        ):
            k3 = (tier.name, direction, reason)
            failed_stats[k3] = failed_stats.get(k3, 0) + 1

    def _orphaned_promotion_done(self, job: _Job) -> None:
        """A reset forgot these chunks while the load ran: the write has ended, so the
        quarantined slots can be reused; nothing is published."""
        for slot in job.meta.slots:
            self.host.end_quarantined_write(slot)
        self.stats.reset_discarded_promotions += len(job.meta.keys)

    def _promotion_done(self, tier: SecondaryTierManager, job: _Job, res: Any) -> None:
        """A promotion's load ended: publish the chunks it loaded, free the others' slots (their
        holds end; the tier served the request nothing)."""
        meta, host, stats = job.meta, self.host, self.stats
        self._transfer_done(tier, "load", meta, res)
        if res.success:
            ok, failed = meta.keys, []
        else:
            # only keys of this job the tier confirmed: anything else it names is ignored,
            # anything it does not name failed
            ok_set = set(res.successful_keys or ())
            ok = [k for k in meta.keys if k in ok_set]
            failed = [k for k in meta.keys if k not in ok_set]
        # ranked as the request's (it loads them next); a promotion for a peer is no request's
        host.complete_write(ok, True, meta.request)
        if ok:
            self.events.moved(ok, tier.name, HOST, tier=tier)
        if failed:
            host.complete_write(failed, False)
            self.holds.failed(failed)
            src = self._load_source.get(meta.req_id)
            if src:
                for k in failed:
                    src.pop(k, None)
            stats.promotion_failures[tier.name] += len(failed)
            # chunks loaded on the tier's expectation and not there are a plain miss
            expected = all(r == SPECULATIVE_MISS for r in res.failed.values()) and res.failed
            log.log(
                logging.DEBUG if expected else logging.INFO,
                "promotion from %s failed for %d chunk(s): %s",
                tier.name,
                len(failed),
                res.reason,
            )
        stats.promotions[tier.name] += len(ok)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "promotion job %d done: %d/%d chunk(s), %.1f MB in %.1f ms",
                res.job_id,
                len(ok),
                len(meta.keys),
                res.transfer_bytes / 1e6,
                res.transfer_seconds * 1e3,
            )

    def _store_done(self, tier: SecondaryTierManager, job: _Job, res: Any) -> None:
        """A store to ``tier`` ended: its pins on the host slots drop; count what it stored."""
        meta, stats = job.meta, self.stats
        self._transfer_done(tier, "store", meta, res)
        self.host.unpin_slots(meta.slots)
        self._store_pins[job.tier] -= len(meta.slots)
        if res.success:
            stored = meta.keys
            # the tier's throughput until its first load (kvoffload.costs.TierLoadCost)
            self.load_costs[job.tier].stores.observe(res.transfer_bytes, res.transfer_seconds)
        else:
            ok_set = set(res.successful_keys or ())
            stored = [k for k in meta.keys if k in ok_set]
            stats.cascade_failures[tier.name] += len(meta.keys) - len(stored)
            if meta.request and len(stored) < len(meta.keys):
                self._hole(meta.req_id, job.tier)  # its later chunks are not written there
        # chunks the tier already held are counted apart from those it wrote (CASES C50)
        held = 0
        if res.deduplicated:
            dedup = stats.deduplicated
            for reason, n in res.deduplicated.items():
                k2 = (tier.name, reason)
                dedup[k2] = dedup.get(k2, 0) + n
                held += n
        stats.written[tier.name] += max(0, len(stored) - held)
        stats.cascaded[tier.name] += len(stored)
        if stored:
            self.events.moved(stored, HOST, tier.name, tier=tier)

    def step(self) -> None:
        """End of a scheduler step: submit this step's promotions and probes, apply completions,
        publish the step's KV events (sent after :attr:`lock` is released)."""
        with self.lock:
            self.holds.next_step()
            self.poll()
            batch = self.events.take_batch()
            if len(self._engine_keys) >= self._sweep_at:
                self._sweep_engine_keys()
        if batch is not None:
            self.events.publish(batch)

    # -- metrics --------------------------------------------------------------------------------

    def refresh_metrics(self) -> _metrics.MetricSet:
        """Bring :attr:`metrics` up to date from the manager's counters, its tiers and the
        accelerator workers' counts in the arena header (:func:`kvoffload.metrics.refresh`);
        returns it. Safe from another thread (it only reads engine state)."""
        return _metrics.refresh(self)

    def take_metric_stats(self) -> dict[str, Any] | None:
        """Metric changes since the last call in vLLM's stats layout (see
        :meth:`kvoffload.metrics.MetricSet.take_stats`)."""
        self.refresh_metrics()
        with self.metrics.lock:
            return self.metrics.take_stats()

    def has_pending_work(self) -> bool:
        """True while promotions, tier jobs or probes are in flight (the engine should keep
        stepping)."""
        with self.lock:
            return bool(self._jobs or self._promotions) or any(
                t.has_pending_work() for t in self.tiers
            )

    def jobs_in_flight(self) -> list[tuple[str, str, JobMetadata]]:
        """``(tier name, "load" | "store", job)`` of every tier job submitted and not yet finished:
        the host slots a tier worker may still write (load) or read (store). Promotions queued for
        the next step are not in flight yet. For tests and tools; the list is a copy."""
        with self.lock:
            names = self.tier_names
            return [
                (names[j.tier], "load" if j.meta.is_promotion else "store", j.meta)
                for j in self._jobs.values()
            ]

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
            # Not tier.wait(): it would use a tier's socket outside the lock, while another
            # thread (the p2p tier's node) may poll under it.
            time.sleep(min(left, 0.001))

    def wait_workers_ready(self, timeout_s: float = 60.0) -> bool:
        """Block until every tier's worker processes have started and reported ready
        (:meth:`~kvoffload.tiers.base.SecondaryTierManager.workers_ready`; standalone tools and
        benchmarks, before any clock starts). Returns False on timeout (seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                self.poll()
                if all(t.workers_ready() for t in self.tiers):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    # -- requests, events, lifecycle ----------------------------------------------------------

    # -- tenants (kvoffload.tenants) -------------------------------------------------------------

    def set_cache_salt(self, req_id: str, cache_salt: str | None) -> None:
        """Request ``req_id`` carries ``cache_salt`` (vLLM's per-request field; None or "":
        none): its chunks are its tenant's. Every key the engine names for it at this manager's
        entry points (:meth:`lookup`, :meth:`prepare_store`, :meth:`complete_store`,
        :meth:`prepare_load`, :meth:`complete_load`, :meth:`touch`, :meth:`source_of`) is its
        tenant key (:func:`~kvoffload.tenants.tenant_key`) inside, in the host tier and in every
        secondary tier, and the engine's key again at the exits (a store plan's keys and
        evictions, :meth:`take_events`). Call it before the request's first lookup. The salt is
        not kept: only its tenant id (:func:`~kvoffload.tenants.tenant_id`)."""
        if not cache_salt:
            if req_id in self._tenants:  # a reused request id: its old tenant is not its own
                with self.lock:
                    self._tenants.pop(req_id, None)
                    self._tenants_ended.pop(req_id, None)
                    self._req_tenant_keys.pop(req_id, None)
            return
        tenant = tenant_id(cache_salt, self._tenant_secret)
        with self.lock:
            if self._tenants.get(req_id) != tenant:
                self._req_tenant_keys.pop(req_id, None)
            self._tenants[req_id] = tenant
            self._tenants_ended.pop(req_id, None)  # live again: never forgotten while it runs

    def tenant_of_request(self, req_id: str) -> str:
        """The tenant id of ``req_id`` (:meth:`set_cache_salt`), "" for none."""
        return self._tenants.get(req_id, "")

    def _tenant_key(self, key: bytes, tenant: str) -> bytes:
        """``key``'s tenant key for ``tenant``, remembered (under :attr:`lock`)."""
        qkey = tenant_key(key, tenant)
        known = self._engine_keys
        if qkey not in known:
            known[qkey] = (key, tenant)
            if self._unconfirmed:
                self._unconfirmed.discard(qkey)
            if self.host.quotas is not None:  # adopted or pushed before its tenant was known
                self.host.attribute(qkey, tenant)
        return qkey

    def _for_request(self, keys: Sequence[bytes], req_id: str) -> list[bytes]:
        """``keys`` as tiers hold them for ``req_id``: its tenant keys, or the keys unchanged
        when it has no tenant."""
        tenant = self._tenants.get(req_id)
        if tenant is None:
            return list(keys)
        return [self._request_tenant_key(req_id, k, tenant) for k in keys]

    def _request_tenant_key(self, req_id: str, key: bytes, tenant: str) -> bytes:
        """:meth:`_tenant_key` for request ``req_id`` (of ``tenant``), computed once per key
        while it runs (a keyed hash costs about 3 µs; a long prompt's lookups ask again each
        step): its cache goes when it finishes or its tenant changes (under :attr:`lock`)."""
        cache = self._req_tenant_keys.get(req_id)
        if cache is None:
            if req_id in self._tenants_ended:  # a late completion: nothing kept for it
                return self._tenant_key(key, tenant)
            cache = self._req_tenant_keys[req_id] = {}
        qkey = cache.get(key)
        if qkey is None or qkey not in self._engine_keys:  # new, or swept since: known again
            qkey = cache[key] = self._tenant_key(key, tenant)
        return qkey

    def _engine_keys_of(
        self, keys: Iterable[bytes], tier: SecondaryTierManager | None = None
    ) -> list[bytes]:
        """The engine's key of each of ``keys`` held by ``tier`` (None: the host tier): a tenant
        key's engine key, an engine key unchanged. A tenant's chunk whose engine key is not
        known here (``tier`` counts it as a tenant's: found by its start scan; or adopted by a
        warm restart and named by no request since: :attr:`_unconfirmed`) is left out: no
        event rather than one naming a hash the engine never made."""
        known = self._engine_keys
        unconfirmed = self._unconfirmed
        out = []
        for k in keys:
            e = known.get(k)
            if e is not None:
                out.append(e[0])
            elif k in unconfirmed or (tier is not None and tier.held_tenant(k)):
                continue
            else:
                out.append(k)
        return out

    def _sweep_engine_keys(self) -> None:
        """Forget the engine keys of tenant keys nothing holds any more (under :attr:`lock`):
        kept are those of chunks in the host tier or counted by a bounded tier, of writes,
        pins, jobs and promotions in flight, and of events not taken yet. Run once the map has
        doubled since the last sweep (amortized O(1) per entry); what it keeps is bounded by
        the chunks held."""
        known = self._engine_keys
        self.events.drain()  # the tiers' events, translated while their chunks are known
        held: set[bytes] = set(self._writes)
        held.update(self._promoting)
        for job in self._jobs.values():
            held.update(job.meta.keys)
        for per_req in self._promotions.values():
            for keys, _slots in per_req.values():
                held.update(keys)
        for pins in self._load_pins.values():
            held.update(pins)
        index = self.host.index
        tiers = self.tiers
        for k in [k for k in known if k not in held and k not in index]:
            if not any(t.held_tenant(k) for t in tiers):
                del known[k]
        if self._unconfirmed:
            self._unconfirmed.intersection_update(index)
        self._sweep_at = max(_ENGINE_KEYS_SWEEP_MIN, 2 * len(known))

    def _engine_key_of_key(self, key: bytes) -> bytes:
        """The engine key of a key tiers hold (a tenant key's; ``key`` itself otherwise)."""
        e = self._engine_keys.get(key) if self._engine_keys else None
        return key if e is None else e[0]

    def _tenant_of_key(self, key: bytes) -> str:
        """The tenant of a key tiers hold ("" for an engine key, or a tenant key forgotten)."""
        e = self._engine_keys.get(key) if self._engine_keys else None
        return "" if e is None else e[1]

    def _tenant_of_job(self, keys: Sequence[bytes], req_id: str) -> str:
        """The tenant of a job of ``keys`` for ``req_id``: the request's, else (a peer's
        promotion, a request forgotten) its first key's."""
        if not self._tenants:
            return self._tenant_of_key(keys[0]) if keys and self._engine_keys else ""
        tenant = self._tenants.get(req_id)
        if tenant is not None:
            return tenant
        return self._tenant_of_key(keys[0]) if keys else ""

    def on_request(self, req_id: str, kv_transfer_params: Any = None) -> None:
        """A request arrived with the orchestrator's routing (``kv_transfer_params``, a dict or
        None): each tier takes what it reads from it (the p2p tier: which peer to ask, what to
        hold for a remote decoder)."""
        for tier in self._routed_at.values():
            tier.on_request(req_id, kv_transfer_params)

    def on_request_finished(self, req_id: str) -> None:
        """Forget per-request bookkeeping (which tier served which chunk, its routing)."""
        with self.lock:
            self._load_source.pop(req_id, None)
            self._counted.pop(req_id, None)
            self._holes.pop(req_id, None)
            self._recompute.pop(req_id, None)
            self._waiting.pop(req_id, None)
            if self._only:
                self._only.pop(req_id, None)
            ended = self._ended
            if len(ended) >= _MAX_COUNTED_REQUESTS:
                ended.popitem(last=False)
            ended[req_id] = None
            if req_id in self._tenants:
                self._req_tenant_keys.pop(req_id, None)
                # kept for its late completions among the last finished, then forgotten
                tended = self._tenants_ended
                tended[req_id] = None
                if len(tended) > _MAX_COUNTED_REQUESTS:
                    self._tenants.pop(tended.popitem(last=False)[0], None)
            self.holds.forget(req_id)
            self.host.request_finished(req_id)
            for tier in self.tiers:
                tier.request_finished(req_id)
            for hooks in self._routed_at.values():
                hooks.on_request_finished(req_id)

    def take_events(self) -> list[tuple[str, TierEvent]]:
        """``(tier name, event)`` pairs since the last call, host first (tier name ``"host"``);
        a tenant's chunks under the engine's keys (:meth:`_engine_keys_of`)."""
        with self.lock:
            return self.events.take()

    def _events_to_engine(self, keys: list[bytes], tier: Any) -> list[bytes]:
        """:attr:`EventStream.to_engine`: the events' keys as the engine names them, as they are
        collected from the tiers (a tier still knows then which chunks it counted as a
        tenant's)."""
        if self._engine_keys or self._unconfirmed or (tier is not None and tier.holds_tenants()):
            return self._engine_keys_of(keys, tier)
        return keys

    def reset_cache(self) -> None:
        """Forget every host-tier chunk now, without waiting for tier jobs (never blocks the
        scheduler for a tier's I/O). Takes no argument, as vLLM's ``OffloadingManager.reset_cache``.

        Slots with a transfer still in flight — promotions loading into them, tier stores reading
        them, accelerator copies not completed — are quarantined by the host tier and reused only
        once that transfer has ended (CASES C26). Promotions queued but not yet submitted are
        dropped. KV events queued before the reset are kept and published, followed by the
        removal of every chunk that was stored (C27).
        """
        with self.lock:
            self.poll()
            self._forget_jobs()
            quarantined = self.host.clear()
            self.holds.reset()
            # the serving side keeps its leases and admitted writes: their slots are quarantined
            # (host.clear) until their holders release or commit them
            if quarantined:
                log.info(
                    "kvoffload: cache reset with %d host slot(s) still in use by transfers; "
                    "they are reused once those end",
                    len(quarantined),
                )

    def _forget_jobs(self) -> None:
        """A reset: queued promotions are dropped (never submitted: nothing writes their slots),
        jobs in flight are orphaned (their results only end quarantines), and no request's load
        source is kept."""
        for per_req in self._promotions.values():
            for keys, _slots in per_req.values():
                self.host.complete_write(keys, False)
        self._promotions.clear()
        self._load_source.clear()
        self._promoting.clear()  # the orphans' chunks are forgotten: nothing waits for them
        for job in self._jobs.values():
            job.orphaned = True

    def _warm_start(self, arena: Any, namespace: Any) -> dict[str, int] | None:
        """Adopt what a predecessor left in the arena's slot table when a take-over from its
        keeper left an adoption pending (whichever process of this engine claimed the segment:
        this one owns the host tier's index), else start the table empty; then mirror the host
        tier into it (DESIGN.md "Warm restart"). Returns the chunks by outcome
        (:data:`~kvoffload.ipc.slot_table.OUTCOMES`), or None when the arena has no slot
        table."""
        slot_table = getattr(arena, "slot_table", None)
        table = slot_table() if slot_table is not None else None
        if table is None:
            return None
        counts = dict.fromkeys(OUTCOMES, 0)
        ns_id = namespace.id()
        found = None
        if arena.take_adoption():
            try:
                found = table.adopt(ns_id)
            except SlotTableError as e:
                why = "namespace" if table.namespace_id() is not None else "table"
                counts[f"dropped_{why}"] = table.ready_entries()
                log.warning(
                    "kvoffload: warm restart: nothing adopted from arena %s (%d chunks dropped): %s",
                    arena.name,
                    counts[f"dropped_{why}"],
                    e,
                )
        if found is None:
            table.format(ns_id)
        else:
            adopted = self.host.adopt(found.slots)
            counts["adopted"] = len(adopted)
            # a tenant key (TENANT_KEY_BYTES long) whose engine key is unknown until a request
            # of its tenant names it: no event until then (an engine key of that length too)
            self._unconfirmed = {k for k in adopted if len(k) == TENANT_KEY_BYTES}
            for reason, n in found.dropped.items():
                counts[f"dropped_{reason}"] = n
            log.info(
                "kvoffload: warm restart: adopted %d chunks from arena %s; dropped %s",
                counts["adopted"],
                arena.name,
                ", ".join(f"{n} {r}" for r, n in found.dropped.items() if n) or "none",
            )
        self.host.mirror_to(table)
        return counts

    def shutdown(self) -> None:
        """Stop every tier (failing what is still in flight). Idempotent.

        The tiers are shut down outside :attr:`lock` (a tier may join a thread of its own that
        waits for the lock); from the moment this starts, :meth:`poll` and :meth:`serve_lookup`
        leave the tiers alone, so another thread calling them meanwhile touches no tier."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            if self.events.publisher is not None:
                try:
                    self.step()
                except Exception:
                    log.exception("kvoffload: publishing the last KV events failed")
            self._tiers_stopped = True
        _metrics.unregister_source(self.instance)
        self.events.close()
        for tier in self.tiers:
            try:
                tier.shutdown()
            except Exception:
                log.exception("tier %s failed to shut down", tier.name)

    def metric_readings(self) -> _metrics.ManagerReadings:
        """What :func:`kvoffload.metrics.refresh` exports of this manager (the counters read in
        place, as a scrape always read them)."""
        host = self.host
        return _metrics.ManagerReadings(
            host_tier=HOST,
            host_slots=host.num_slots,
            host_slots_used=host.num_used,
            host_slots_pinned=host.num_pinned,
            host_evictions=host.evictions,
            slot_bytes=self.arena.row_bytes,
            device_totals=self.arena.device_stats.sum(axis=0).tolist(),
            promotion_holds=self.promotion_holds,
            stats=self.stats,
            tiers=self.tiers,
            published=self.events.published,
            warm_restart=self.warm_restart or {},
            canary=self.canary_checks,
            canary_seconds=self.canary_seconds,
            tenants=self._tenant_readings(),
            tenant_top=self.tenant_metrics_top,
        )

    def _tenant_readings(self) -> dict[str, _metrics.TenantReadings]:
        """Per tier with per-tenant quotas (the host tier's and the secondary tiers'): the
        bytes each tenant holds, and the chunks evicted and refused for a tenant's quota."""
        held = [(HOST, self.host.quotas)] + [(t.name, t.tenant_quotas()) for t in self.tiers]
        return {
            name: _metrics.TenantReadings(
                dict(q.held), q.evictions, q.refusals, frozenset(q.overrides)
            )
            for name, q in held
            if q is not None
        }
