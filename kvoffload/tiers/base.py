"""The secondary-tier contract (DESIGN.md §4) and the types that cross it.

A secondary tier holds chunks below the host tier: a filesystem, an object store, peers, memory. It
never touches accelerator memory; every byte passes through host-arena slots. The tiering manager
drives it with four calls, all of which must return in microseconds whatever the tier's latency:

- :meth:`SecondaryTierManager.lookup`: HIT, MISS or RETRY (an answer is being fetched; ask again).
- :meth:`SecondaryTierManager.submit_store`: copy pinned host slots into the tier, asynchronously.
- :meth:`SecondaryTierManager.submit_load`: copy chunks into reserved host slots, asynchronously.
- :meth:`SecondaryTierManager.get_finished_jobs`: drain finished jobs, never blocking.

Every submitted job yields exactly one :class:`JobResult`: success, partial success (which keys), or
failure with a reason, even when a worker dies, a server hangs or the disk fills. A tier whose load of a
key failed answers MISS for that key afterwards, so no request waits on it forever.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeGuard, runtime_checkable

import msgspec

from kvoffload.costs import SMOOTHING
from kvoffload.metrics import CORE_METRICS, MetricDef, MetricSet

if TYPE_CHECKING:
    from kvoffload.quotas import TenantQuotas


class LookupResult(enum.Enum):
    """Answer to a chunk lookup (the same four values as vLLM's ``LookupResult``)."""

    MISS = 0
    HIT = 1
    HIT_PENDING = 2  # present but not yet readable (a write or promotion is in flight)
    RETRY = 3  # unknown yet (an existence probe is in flight): ask again next step


class JobMetadata(msgspec.Struct, kw_only=True, gc=False):
    """A transfer between host slots and a tier.

    Attributes:
        job_id: unique per tiering manager.
        keys: chunk keys (bytes), one per slot.
        slots: host-arena slot indices (rows of the arena), same order as ``keys``.
        is_promotion: True for tier → host loads, False for host → tier stores.
        req_id: the request that caused it ("" when none; :data:`PEER_PROMOTION` for a promotion
            a peer's lookup started, or a probe of a tier judged slower than recompute: no
            request of this engine waits for it).
        tenant: the tenant whose chunks ``keys`` are (a tenant id of
            :func:`kvoffload.tenants.tenant_id`; the keys are then tenant keys,
            :func:`kvoffload.tenants.tenant_key`), "" for none. A persistent tier keeps them in
            that tenant's directory or prefix (``t-<tenant id>/`` below the namespace's).
    """

    job_id: int
    keys: list[bytes]
    slots: list[int]
    is_promotion: bool
    req_id: str = ""
    tenant: str = ""

    @property
    def request(self) -> str:
        """The request whose prefix the job's chunks are ranked in for eviction (CASES C47):
        ``req_id``, or "" (none: ranked as used now) for a peer's promotion, which never
        finishes as a request does."""
        return "" if self.req_id == PEER_PROMOTION else self.req_id


PEER_PROMOTION = "\x00peer"
"""The ``req_id`` of promotions :meth:`~kvoffload.tiering.TieringManager.serve_lookup` starts for
peers."""


KNOWN_PRESENT = "known_present"
"""Why a store did not write a chunk: the tier's own index knew it held it (nothing was sent to
storage): a chunk stored again after the host tier evicted it."""
FOUND_PRESENT = "found_present"
"""Why a store did not write a chunk: the tier found it already stored (an fs worker saw its file:
written by another instance sharing the root, or by this one earlier)."""
DEDUP_REASONS = (KNOWN_PRESENT, FOUND_PRESENT)
"""The ``reason`` values of ``kvoffload_tier_deduplicated_chunks_total``."""
SPECULATIVE_MISS = "speculative_miss"
"""Why a load failed for a chunk (:attr:`JobResult.failed`): it was loaded without asking the tier
first (:meth:`SecondaryTierManager.lookup_for_load` answered HIT on expectation) and the tier did
not hold it: a miss, as ``missing`` is, but one the tier took the risk of."""


class JobResult(msgspec.Struct, kw_only=True, gc=False):
    """The one result of a submitted job.

    Attributes:
        job_id: the job's id.
        success: True when every key succeeded.
        successful_keys: on partial failure, the keys that succeeded; None means all keys share the
            fate given by ``success``.
        reason: on failure, a summary such as ``"corrupt=1 missing=2"``.
        failed: per failed key, its cause (``missing``, ``corrupt``, ``io_error``, ``no_space``,
            ``timeout``, ``worker_died``, ``cancelled``, ``rejected``, ...: the keys of
            :data:`kvoffload.reasons.FAILED`, which says what each means).
        transfer_bytes: bytes the tier actually moved between the host tier and its medium for
            this job (bytes): what its workers wrote or read (fs: file bytes, obj: object bytes,
            headers included; memory, p2p: the rows copied or sent), never chunks x row bytes
            assumed; 0 for chunks it did not write. Exported as
            ``kvoffload_tier_transfer_bytes_total`` (CASES C50).
        transfer_seconds: wall time from submit to completion (seconds).
        status: protocol status per failed key where one exists (e.g. HTTP status), else empty.
        deduplicated: a store: chunks of the job the tier already held and did not write, by
            reason (:data:`KNOWN_PRESENT`, :data:`FOUND_PRESENT`); they count among the
            successful keys, and as ``kvoffload_tier_deduplicated_chunks_total``, not as chunks
            moved (CASES C50).
        done_at: ``time.monotonic()`` when the tier finished the job's I/O, as its workers report
            it (seconds, at most the time its result was taken); 0.0: not known (the engine's
            reading of the result stands in).
    """

    job_id: int
    success: bool
    successful_keys: list[bytes] | None = None
    reason: str = ""
    failed: dict[bytes, str] = {}
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    status: dict[bytes, int] = {}
    deduplicated: dict[str, int] = {}
    done_at: float = 0.0


class TierEvent(msgspec.Struct, array_like=True, gc=False):
    """A change of what a tier holds: ``keys`` were stored (``removed=False``) or removed."""

    keys: list[bytes]
    removed: bool


class SecondaryTierManager(ABC):
    """One secondary tier, engine side. Subclasses add files, not branches elsewhere.

    Construction: ``cls(name=..., arena_view=..., namespace=..., config=...)`` where ``arena_view`` is a
    zero-copy 2-D ``memoryview`` ``(num_slots, row_bytes)`` of the host arena, ``namespace`` the
    :class:`~kvoffload.namespace.Namespace` of the chunks, and ``config`` an instance of
    ``config_class`` (validated from the tier's entry in ``secondary_tiers``).

    Capabilities (class attributes) instead of special cases in callers:
        medium: ``"STORAGE"``, ``"CPU"`` or ``"PEER"`` (reported in KV events).
        locality: ``"LOCAL"`` or ``"REMOTE"``.
        shared: chunks may be read by other processes or instances, so chunk keys must be
            deterministic across processes.
        metric_definitions: the tier's own Prometheus metrics (:func:`kvoffload.metrics.Counter`,
            ``Gauge``, ``Histogram``), exported standalone and under vLLM with no other wiring.
            Record them with ``self.metrics.inc / set / observe(name, value, *labels)``; a counter
            counted with :meth:`count` (engine side) or ``kvoffload.workers.counters.count`` (in
            a worker) under a declared counter's name goes to that counter (label ``tier``).

    Metrics: ``self.metrics`` is the manager's :class:`~kvoffload.metrics.MetricSet` once the tier
    joins a tiering manager; :meth:`report_metrics` sets gauges (queue depths, live workers) at each
    scrape. Counters of :meth:`count` appear as ``kvoffload_tier_events_total{tier, event}``.
    """

    config_class: ClassVar[type[msgspec.Struct]]
    medium: ClassVar[str] = "STORAGE"
    locality: str = "LOCAL"  # a class default; a tier may set its own (config `locality`)
    shared: ClassVar[bool] = False
    metric_definitions: ClassVar[tuple[MetricDef, ...]] = ()
    #: What a lookup this tier answered RETRY takes until its verdict with nothing queued ahead
    #: of it (seconds: a probe's round trip; exponentially weighted by
    #: :data:`kvoffload.costs.SMOOTHING`), None until one is measured (:meth:`lookup_answered`):
    #: a request waits at RETRY no longer than a few of them behind the tier's outstanding loads
    #: (reason ``lookup_overran``, :meth:`kvoffload.tiering.TieringManager._wait`).
    lookup_seconds: float | None = None

    def __init__(
        self, *, name: str, arena_view: memoryview, namespace: Any, config: msgspec.Struct
    ):
        self.name = name
        self.arena_view = arena_view
        self.namespace = namespace
        self.config = config
        self.counters: dict[str, float] = {}
        self.record_events = True
        self.metrics = MetricSet(CORE_METRICS + type(self).metric_definitions)
        self._own_counters = {d.name for d in type(self).metric_definitions if d.kind == "counter"}

    def lookup_answered(self, seconds: float) -> None:
        """A lookup answered RETRY got its verdict after ``seconds``, with nothing queued ahead
        of it (a sample of :attr:`lookup_seconds`; a timeout is no sample)."""
        ls = self.lookup_seconds
        self.lookup_seconds = seconds if ls is None else ls + SMOOTHING * (seconds - ls)

    @classmethod
    def effective_config(cls, config: Any) -> Any:
        """``config`` (an instance of ``config_class``) with every default that this tier decides
        from the configuration alone filled in, as the tier will run with it: the tier uses this
        to start, and ``kvoffload check`` and the start-up log line show it. A field still None
        is decided at run time (from the model, the filesystem...) or off; the config class's
        ``unset_means`` (``{field: words}``, optional) says which. This base: ``config``
        unchanged."""
        return config

    @classmethod
    def purge_storage(
        cls, name: str, config: Any, *, tenant: str | None, namespace: str | None
    ) -> Any:
        """``kvoffload purge``: remove tenant ``tenant``'s chunks (a tenant id,
        :func:`kvoffload.tenants.tenant_id`) or namespace ``namespace``'s (a namespace id) from
        the storage ``config`` (an instance of ``config_class``) names, safely while engines use
        it, and say what was removed: a :class:`kvoffload.tiers.purging.TierPurge`. Exactly one of
        ``tenant`` and ``namespace`` is given.

        This base answers None: the tier keeps nothing that outlives its engine (the memory tier;
        the p2p tier, whose chunks are its peers' host tiers'), and the command lists it as
        skipped. A tier whose storage outlives its engines (fs, obj, a persistent out-of-tree
        tier) overrides it; the tier contract suite checks that it leaves nothing of the tenant.

        Raises:
            kvoffload.tiers.purging.PurgeError: the storage cannot be reached; the command reports
                it as this tier's error and purges the others all the same.
        """
        return None

    def count(self, counter: str, n: float = 1) -> None:
        """Add ``n`` to one of this tier's counters: a declared counter of ``metric_definitions``
        (label ``tier``), else ``kvoffload_tier_events_total{tier, event=counter}``."""
        if counter in self._own_counters:
            self.metrics.inc(counter, n, self.name)
            return
        self.counters[counter] = self.counters.get(counter, 0) + n

    def report_metrics(self, metrics: MetricSet) -> None:
        """Set this tier's gauges (called at each scrape, from the scraping thread: read only)."""

    def tenant_of(self, key: bytes) -> str:
        """The tenant (a tenant id, "" for none) of chunk ``key`` as the tiering manager knows
        it: a lookup's or a delete's key, where no job names one (the manager replaces this
        with its own when the tier joins it). Jobs name theirs (:attr:`JobMetadata.tenant`).
        This base: "" (no tenant)."""
        return ""

    def engine_key_of(self, key: bytes) -> bytes:
        """The engine's key of chunk ``key`` as the tiering manager knows it: a tenant key's
        engine key (:mod:`kvoffload.tenants`), ``key`` itself for an engine key or a key the
        manager does not know. For a tier whose hints are kept by engine key (the p2p tier's
        locations, learnt from peers' KV events, which name engine keys) asked for a tenant key
        (the manager replaces this with its own when the tier joins it; engine thread, under
        the manager's lock). This base: ``key``."""
        return key

    def held_tenant(self, key: bytes) -> str:
        """The tenant of chunk ``key`` as this tier's own count holds it ("" for none, or a
        chunk it does not count): a bounded tier's stored and scanned chunks. The tiering
        manager keeps the engine key of what a tier holds so, and leaves out the events of a
        tenant's chunk whose engine key it never knew (found by a start scan). This base: ""."""
        return ""

    def holds_tenants(self) -> bool:
        """Whether :meth:`held_tenant` may answer a tenant for some chunk. This base: False."""
        return False

    def tenant_quotas(self) -> TenantQuotas | None:
        """The tier's per-tenant quotas and the bytes each tenant holds in it
        (:class:`~kvoffload.quotas.TenantQuotas`, read by metrics scrapes), None when it holds
        no tenant to a quota. This base: None."""
        return None

    @abstractmethod
    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        """HIT, MISS or RETRY for one chunk. Never blocks, never raises."""

    def lookup_for_load(self, key: bytes, req_id: str = "") -> LookupResult:
        """:meth:`lookup` of a chunk whose HIT the caller promotes at once (a load job of
        ``req_id`` follows): the tiering manager asks this way for an engine request's prefix,
        in order. A tier may then answer HIT for a chunk it expects to hold without asking its
        storage first, provided a load that finds nothing is a clean miss
        (:data:`SPECULATIVE_MISS`; the worker-backed tiers, :mod:`kvoffload.tiers.speculation`).
        Never blocks, never raises. Default: :meth:`lookup`."""
        return self.lookup(key, req_id)

    @abstractmethod
    def submit_store(self, job: JobMetadata) -> None:
        """Start copying ``job.slots`` (pinned until the job's result) into the tier."""

    @abstractmethod
    def submit_load(self, job: JobMetadata) -> None:
        """Start copying ``job.keys`` into the reserved slots ``job.slots``."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Results of jobs finished since the last call. Never blocks."""

    def known_present(self, key: bytes) -> bool:
        """True when the tier is known to hold ``key`` without asking it (what it stored, or a
        cached verdict); False when it does not, or cannot tell now. Never blocks or probes: the
        host tier asks it on the scheduler's thread (see ``TieringManager.prepare_store``)."""
        return False

    def store_refusal(self, num_chunks: int) -> str | None:
        """Why the tier would not take a store of ``num_chunks`` more now (the store is then
        dropped), or None when it takes it: ``queue_full`` (too many stores in flight) or
        ``breaker_open`` (its circuit breaker is not closed); a tier may name its own reason (a
        short snake_case word: it becomes the ``reason`` label of
        ``kvoffload_refused_chunks_total``). The default takes every store."""
        return None

    def flush(self) -> None:
        """Send work batched during this scheduler step (e.g. existence probes)."""

    def has_pending_work(self) -> bool:
        """True while jobs or probes are in flight."""
        return False

    def touch(self, keys: Iterable[bytes]) -> None:
        """The keys were used: refresh them in the tier's own eviction order."""

    def holds_covered(self, req_id: str) -> bool:
        """True when the tier keeps, for ``req_id``, every chunk the request covers, not only those
        it stores: chunks it found in the host tier (or had promoted) and loads are then submitted
        to the tier as a store job too (the p2p tier holds them for a remote decoder, CASES C49).
        Asked at each load of a request, only of tiers that override it. Default: False."""
        return False

    def yield_pins(self, num_chunks: int, req_id: str) -> list[JobResult]:
        """Give up store jobs that only keep host slots pinned (nothing left to write), so that a
        store of ``req_id`` that would not fit the tier's pin budget fits: end such jobs, oldest
        first, until at least ``num_chunks`` pins are freed or none is left to give, and return
        their results (the manager applies them at once, not at the next poll). Asked only of
        tiers that override it, only when a write-through store of ``req_id`` (chunks it
        computed, never those it found stored: :meth:`holds_covered`) would be cut by the
        budget.
        Default: nothing to yield. The p2p tier yields the holds nobody has begun to read for
        a newer request's remote decoder (a flood of requests naming decoders cannot keep the
        tier from holding the chunks of the next honest one)."""
        return []

    def request_finished(self, req_id: str) -> None:
        """The request finished (every tier is told; :meth:`RoutedTier.on_request_finished` is
        the routing's own): a tier that ranks its chunks by request for eviction (CASES C47)
        ranks that request's afresh. Default: nothing."""

    def take_events(self) -> list[TierEvent]:
        """Stored/removed events since the last call."""
        return []

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a job to finish (standalone tools, never the scheduler).
        Returns True if something may be ready."""
        return True

    def workers_ready(self) -> bool:
        """True once the tier's worker processes, if it has any, have started and reported
        ready (their hellos arrive with :meth:`get_finished_jobs`). Tools wait for it before
        timing anything; a tier without worker processes is always ready."""
        return True

    def shutdown(self) -> None:
        """Fail or finish in-flight jobs and release processes, sockets and memory."""


class ServedHost(Protocol):
    """What a :class:`RoutedTier` may use of the :class:`~kvoffload.tiering.TieringManager` it
    joins (:meth:`RoutedTier.attach`): the arena and host tier, and the entry points that serve
    peers from the host tier, each taking the manager's lock."""

    arena: Any
    host: Any
    data_parallel_rank: int

    def poll(self, submit: bool = True) -> None:
        """Apply finished tier jobs (a promotion that landed is READY after it); submit the
        queued promotions unless not ``submit`` (the p2p node thread, between the engine's
        lookups, submits peers' only: :meth:`submit_promotions`)."""
        ...

    def submit_promotions(self, peers_only: bool = False) -> None:
        """Submit the queued promotions (``peers_only``: those for no request, peers' and
        probes)."""
        ...

    def serving_promotions(self) -> int:
        """Chunks promoted for peers that have not landed yet."""
        ...

    def slots_of(self, keys: Iterable[bytes]) -> list[int]:
        """The host slot of each key, -1 for one not in the host tier."""
        ...

    def serve_lookup(
        self, keys: Sequence[bytes], requester: str = "peer", max_promotions: int | None = None
    ) -> list[LookupResult]:
        """A peer's lookup of ``keys`` in the host tier (and this instance's own tiers)."""
        ...

    def lease(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Pin READY ``keys`` for a peer's read; their slots (-1 for one not READY)."""
        ...

    def release(self, holder: str) -> None:
        """Drop every pin ``holder`` holds."""
        ...

    def admit(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Reserve host slots for a peer's push of ``keys``; -1 where not taken."""
        ...

    def commit(self, keys: Iterable[bytes], holder: str, ok: bool) -> list[bytes]:
        """End ``holder``'s admitted writes of ``keys``: published (``ok``) or freed."""
        ...


@runtime_checkable
class RoutedTier(Protocol):
    """The hooks of a tier that follows the orchestrator's routing (the p2p tier): it joins the
    manager's host tier, reads each request's ``kv_transfer_params``, names the instance each of
    its chunks lives at and stores only what its routes need. A tier implements all of them or
    none; :func:`routed` checks that once, when the manager is built.
    """

    name: str

    def attach(self, manager: ServedHost) -> None:
        """Called once by the manager the tier joins, after its host tier exists."""
        ...

    def on_request(self, req_id: str, kv_transfer_params: Any) -> None:
        """A request arrived; ``kv_transfer_params`` is the orchestrator's routing (a dict or
        None), as vLLM passes it."""
        ...

    def on_request_finished(self, req_id: str) -> None:
        """The request finished: forget what :meth:`on_request` kept for it."""
        ...

    def origin(self, key: bytes) -> str:
        """The other instance (``host:port``) a chunk of this tier lives at, for movement
        events; empty when not known."""
        ...

    def wants_store(self, req_id: str) -> bool:
        """False when this tier does not keep ``req_id``'s chunks at all (a peer tier stores
        only what a remote decoder will fetch or what it pushes): the write-through skips it,
        and nothing is counted as dropped."""
        ...


ROUTED_HOOKS = ("attach", "on_request", "on_request_finished", "origin", "wants_store")


def routed(tier: SecondaryTierManager) -> TypeGuard[RoutedTier]:
    """True when ``tier`` implements every hook of :class:`RoutedTier`, False when none.

    Raises:
        TypeError: it implements some of them only (naming those missing), as a tier written
            against an older contract would.
    """
    have = [h for h in ROUTED_HOOKS if callable(getattr(tier, h, None))]
    if not have:
        return False
    missing = [h for h in ROUTED_HOOKS if h not in have]
    if missing:
        raise TypeError(
            f"tier {tier.name!r} ({type(tier).__qualname__}) defines {', '.join(have)} of "
            f"kvoffload.tiers.base.RoutedTier's hooks but not {', '.join(missing)}: a tier "
            "that follows requests' routing implements all of them, any other none"
        )
    return isinstance(tier, RoutedTier)
