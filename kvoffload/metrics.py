"""Prometheus metrics of the tiering manager and its tiers (names in docs/observability.md).

Two ways out, fed by the same values:

- standalone: :func:`serve` starts prometheus-client's HTTP server on a registry holding one collector
  for every live :class:`~kvoffload.tiering.TieringManager` of the process, each with its own
  ``instance`` label (two managers in one process never collide);
- under vLLM: the offloading spec's ``build_metric_definitions`` hook declares the metrics
  (:func:`kvoffload.vllm.compat.vllm_metric_definitions`) and :meth:`MetricSet.take_stats` hands
  vLLM the increments since the last call (``OffloadingManager.get_stats``), so they appear on
  vLLM's own ``/metrics``.

Counters that the hot path touches are plain integers on the manager (no per-call metric object);
they are read into a :class:`MetricSet` when a scrape or ``get_stats`` asks (:func:`refresh`), so
metrics cost nothing between scrapes. :func:`refresh` reads a manager through the typed
:class:`ManagerReadings` it hands over, never its attributes: this module imports nothing of the
manager or the tiers (they import it), so no import cycle runs through it. Histograms are bucket
arrays filled as observations come. Counts made in other processes (tier workers, accelerator
workers) reach the same values: tier workers send theirs with their task results, accelerator
workers add theirs to the arena's header page (:meth:`kvoffload.ipc.arena.Arena.device_stats`).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvoffload.ipc import names

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

log = logging.getLogger("kvoffload.metrics")

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

#: Latency buckets (seconds): a host lookup takes about a microsecond, an object-store job seconds.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: Observations kept per histogram series between two ``take_stats`` calls (vLLM wants samples).
MAX_PENDING_SAMPLES = 4096


class MetricDef(msgspec.Struct, frozen=True):
    """One metric: ``kind`` is ``counter``, ``gauge`` or ``histogram``; ``name`` has no ``_total``
    suffix (prometheus-client adds it to counters); ``buckets`` are histogram upper bounds (seconds
    or whatever unit the name says)."""

    kind: str
    name: str
    documentation: str
    labelnames: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


def Counter(name: str, documentation: str, labelnames: Sequence[str] = ()) -> MetricDef:
    """Declare a counter (monotonic; exposed as ``<name>_total``)."""
    return MetricDef(COUNTER, name, documentation, tuple(labelnames))


def Gauge(name: str, documentation: str, labelnames: Sequence[str] = ()) -> MetricDef:
    """Declare a gauge (a current value)."""
    return MetricDef(GAUGE, name, documentation, tuple(labelnames))


def Histogram(
    name: str,
    documentation: str,
    labelnames: Sequence[str] = (),
    buckets: Sequence[float] = LATENCY_BUCKETS,
) -> MetricDef:
    """Declare a histogram with upper bounds ``buckets`` (+Inf is implied)."""
    return MetricDef(HISTOGRAM, name, documentation, tuple(labelnames), tuple(buckets))


T, D, R, E, S = ("tier",), ("direction",), ("tier", "direction"), ("tier", "event"), ("stream",)

CORE_METRICS: tuple[MetricDef, ...] = (
    Gauge("kvoffload_host_slots", "Host-tier capacity in slots (one chunk each)."),
    Gauge("kvoffload_host_slot_bytes", "Bytes per host-tier slot (arena row bytes)."),
    Gauge(
        "kvoffload_host_slots_used", "Host-tier slots holding a chunk (ready, writing or pinned)."
    ),
    Gauge("kvoffload_host_slots_pinned", "Host-tier slots pinned by in-flight transfers."),
    Gauge("kvoffload_host_usage_ratio", "Host-tier fill ratio: slots used / slots (0 to 1)."),
    Counter(
        "kvoffload_lookup_requested_chunks",
        "Chunks looked up, counted at their verdict (a RETRY answer is not counted).",
    ),
    Counter("kvoffload_lookup_hit_chunks", "Chunks looked up and found in some tier."),
    Counter(
        "kvoffload_tier_queries",
        "Chunk lookups that reached this tier, counted at their verdict.",
        T,
    ),
    Counter("kvoffload_tier_hits", "Chunk lookups answered by this tier with a hit.", T),
    Histogram(
        "kvoffload_lookup_latency_seconds",
        "Lookup latency in seconds: host, one lookup call (1 in 64 sampled); other tiers, the "
        "existence probe round trip.",
        T,
    ),
    Counter(
        "kvoffload_device_transfer_bytes",
        "Accelerator <-> host bytes, counted by the accelerator workers.",
        D,
    ),
    Counter("kvoffload_device_transfer_seconds", "Accelerator <-> host copy time in seconds.", D),
    Counter(
        "kvoffload_tier_transfer_bytes",
        "Host <-> tier bytes the tier moved, as its workers report them (fs: file bytes, obj: "
        "object bytes, headers included); nothing for a chunk it did not write.",
        R,
    ),
    Counter(
        "kvoffload_tier_transfer_chunks",
        "Chunks moved successfully between host and tier (stores: chunks written, not those "
        "the tier already held: kvoffload_tier_deduplicated_chunks).",
        R,
    ),
    Counter(
        "kvoffload_tier_deduplicated_chunks",
        "Chunks stored to a tier that already held them, so nothing was written, by reason: "
        "known_present (its index knew it held them: nothing sent), found_present (a worker "
        "found them stored, e.g. by another instance sharing the root).",
        ("tier", "reason"),
    ),
    Histogram(
        "kvoffload_tier_transfer_latency_seconds",
        "Host <-> tier job latency in seconds, from submit to result.",
        R,
    ),
    Counter(
        "kvoffload_tier_failed_chunks",
        "Chunks of failed host <-> tier jobs, by reason (missing, corrupt, io_error, no_space, "
        "timeout, worker_died, cancelled, rejected, error, bad_reply; p2p: busy, peer_down, "
        "transfer_failed, deadline, not_fetched, hold_displaced, no_peer; docs/observability.md says what each "
        "means).",
        ("tier", "direction", "reason"),
    ),
    Counter(
        "kvoffload_tier_failed_jobs", "Host <-> tier jobs that failed for at least one chunk.", R
    ),
    Gauge("kvoffload_tier_queue_depth", "Tasks waiting for a tier worker.", R),
    Gauge("kvoffload_tier_inflight_jobs", "Tier jobs submitted and not finished.", T),
    Gauge("kvoffload_tier_workers_alive", "Live worker processes of the tier.", T),
    Counter("kvoffload_tier_worker_restarts", "Tier workers replaced after dying or hanging.", T),
    Gauge("kvoffload_tier_breaker_open", "1 while the tier's circuit breaker is open.", T),
    Gauge(
        "kvoffload_tier_breaker_state",
        "1 for the circuit breaker's current state (closed, open, half_open), 0 for the others.",
        ("tier", "state"),
    ),
    Counter("kvoffload_host_evictions", "Chunks evicted from the host tier."),
    Gauge(
        "kvoffload_promotion_holds",
        "Host chunks held for the requests they were promoted for, not loaded yet "
        "(promotion_hold_steps).",
    ),
    Counter(
        "kvoffload_promotion_waits",
        "Host-miss lookups told to wait (RETRY) because chunks held for earlier requests' "
        "promotions filled the host tier.",
    ),
    Counter(
        "kvoffload_promotion_hold_losses",
        "Promoted chunks whose hold ended before their request loaded them, by reason: evicted "
        "(a store or an older request's promotion found no other room), expired (not looked up "
        "for promotion_hold_steps steps). A lost chunk is loaded again if its request returns.",
        ("reason",),
    ),
    Counter(
        "kvoffload_window_retry_giveups",
        "Sliding-window chunks answered MISS (recomputed) after being told RETRY for 64 "
        "scheduler steps without being chosen for promotion: nonzero means a scan the manager "
        "could not resolve (a defect to report).",
    ),
    Counter(
        "kvoffload_recomputed_tokens",
        "Tokens of chunks a secondary tier held that were recomputed instead, because the tier "
        "was slower than recompute (config slower_than_recompute), by reason: "
        "slower_than_recompute (at lookup, its load was expected to be slower), "
        "promotion_overran (its promotion overran its expected time; the request gave up the "
        "chunk and the later ones it was promoting), lookup_overran (a probe kept the request "
        "waiting past its deadline; the chunk waited for, which the tier may not hold).",
        ("tier", "reason"),
    ),
    Counter("kvoffload_tier_evictions", "Chunks evicted from a capacity-bounded tier.", T),
    Counter(
        "kvoffload_dropped_stores",
        "Chunks not written to a tier (tier backed up, breaker open, no room); by reason: "
        "kvoffload_refused_chunks.",
        T,
    ),
    Counter(
        "kvoffload_refused_chunks",
        "Chunks a tier refused to take, by direction and reason. host store: "
        "no_evictable_slot (the whole batch), batch_truncated (the tail of a batch that did "
        "not fit), in_tier (chunks a secondary tier holds, left there so as not to evict "
        "chunks promoted for waiting requests), tenant_quota (chunks of a tenant at its quota "
        "whose own chunks could not make room); host load: no_evictable_slot, tenant_quota (a "
        "promotion); "
        "secondary tier store: pin_limit, queue_full, breaker_open.",
        ("tier", "direction", "reason"),
    ),
    Counter(
        "kvoffload_tier_eviction_errors",
        "Chunks a tier failed to delete when evicting or removing them, by errno name.",
        ("tier", "errno"),
    ),
    Counter("kvoffload_tier_events", "A tier's own named counters (engine or worker side).", E),
    Counter("kvoffload_kv_events_published", "KV event batches published, per stream.", S),
    Counter(
        "kvoffload_warm_restart_chunks",
        "Chunks a warm restart found in the host arena its predecessor left (warm_restart_s), "
        "by outcome: adopted, or dropped_<reason>: torn (entry cut by the crash), unsealed (no "
        "seal of that entry), digest (row changed after its seal), duplicate (key in two "
        "slots), key (empty key), namespace (another namespace's table), table (table header "
        "torn). Counted once, at start.",
        ("outcome",),
    ),
    Counter(
        "kvoffload_canary_checks",
        "Checks of the online canary (config canary), by outcome: match (the reuse run loaded "
        "offloaded chunks and its tokens equal a recompute's), mismatch (they differ, and a second "
        "recompute agrees with the first: wrong KV), not_exercised (no chunk was loaded from a "
        "tier: nothing tested), unstable (two recomputes differ: the engine is not deterministic "
        "for the canary's prompt), error (a request failed or timed out). No series without it.",
        ("outcome",),
    ),
    Gauge(
        "kvoffload_tenant_bytes",
        "Bytes a tenant (a request's cache_salt, named by its tenant id, never the salt) holds "
        "in a tier with per-tenant quotas (host_tenant_quota_bytes, a tier's "
        "tenant_quota_bytes): the tenants named in the tier's quota overrides, the "
        "tenant_metrics_top others holding the most, and the rest summed under "
        'tenant="other". Through vLLM\'s /metrics (whose exporter keeps every label set it saw) '
        "only the named tenants; every series on kvoffload's own endpoint. No series without "
        "quotas.",
        ("tier", "tenant"),
    ),
    Counter(
        "kvoffload_tenant_quota_evictions",
        "Chunks a tier evicted to keep a tenant within its quota (that tenant's own "
        "least-recently-used chunks).",
        T,
    ),
    Counter(
        "kvoffload_tenant_quota_refusals",
        "Chunks a tier refused because their tenant was at its quota and none of its own "
        "chunks could be evicted (pinned, being written, loading, or part of the same store).",
        T,
    ),
    Counter(
        "kvoffload_canary_seconds",
        "Wall time the online canary's checks took (its HTTP requests; seconds): the cost per "
        "check is this over kvoffload_canary_checks.",
    ),
)

CORE_NAMES = frozenset(d.name for d in CORE_METRICS)

#: Counter families exported as a labelled metric of their own (defined with the other tier
#: counter names in :mod:`kvoffload.ipc.names`).
TIER_COUNTER_FAMILIES = names.TIER_COUNTER_FAMILIES


class HistogramValue:
    """Bucket counts (not cumulative), sum and, while vLLM collects, the raw samples since the last
    :meth:`MetricSet.take_stats`."""

    __slots__ = ("bounds", "counts", "sum", "samples")

    def __init__(self, bounds: tuple[float, ...], keep_samples: bool):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.samples: list[float] | None = [] if keep_samples else None

    def observe(self, value: float) -> None:
        """Count one observation (seconds for the latency histograms) in its bucket and the sum."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        s = self.samples
        if s is not None and len(s) < MAX_PENDING_SAMPLES:
            s.append(value)


class MetricSet:
    """Current values of a set of metric definitions, keyed by label values.

    Args:
        definitions: the metrics (names must be unique).
        keep_samples: keep histogram samples for :meth:`take_stats` (vLLM's path).

    Raises:
        ValueError: two definitions share a name.
    """

    def __init__(self, definitions: Iterable[MetricDef], keep_samples: bool = False):
        self.defs: dict[str, MetricDef] = {}
        for d in definitions:
            if d.name in self.defs and self.defs[d.name] != d:
                raise ValueError(f"metric {d.name} declared twice with different definitions")
            self.defs[d.name] = d
        self.values: dict[str, dict[tuple[str, ...], Any]] = {n: {} for n in self.defs}
        self.keep_samples = keep_samples
        self._taken: dict[tuple[str, tuple[str, ...]], float] = {}
        # the series of the metrics of NAMED_THROUGH_VLLM that take_stats hands vLLM
        self.through_vllm: dict[str, set[tuple[str, ...]]] = {n: set() for n in NAMED_THROUGH_VLLM}
        self.lock = threading.Lock()

    def _check(self, name: str, labels: tuple[str, ...]) -> MetricDef:
        d = self.defs.get(name)
        if d is None:
            raise KeyError(f"metric {name} is not declared (declare it in metric_definitions)")
        if len(labels) != len(d.labelnames):
            raise ValueError(f"metric {name} takes labels {d.labelnames}, got {labels}")
        return d

    def inc(self, name: str, value: float = 1, *labels: str) -> None:
        """Add ``value`` (≥ 0) to a counter."""
        series = self.values.get(name)
        if series is None or labels not in series:
            self._check(name, labels)
            series = self.values[name]
        series[labels] = series.get(labels, 0) + value

    def set_total(self, name: str, value: float, *labels: str) -> None:
        """Set a counter from a monotonic total kept elsewhere (never lower it)."""
        series = self.values[name]
        if value > series.get(labels, 0):
            series[labels] = value
        elif labels not in series:
            self._check(name, labels)
            series[labels] = value

    def set(self, name: str, value: float, *labels: str) -> None:
        """Set a gauge."""
        series = self.values.get(name)
        if series is None or labels not in series:
            self._check(name, labels)
            series = self.values[name]
        series[labels] = value

    def histogram(self, name: str, *labels: str) -> HistogramValue:
        """The series of histogram ``name`` with ``labels``, created empty if new."""
        series = self.values.get(name)
        h = series.get(labels) if series is not None else None
        if h is None:
            d = self._check(name, labels)
            series = self.values[name]
            h = series[labels] = HistogramValue(d.buckets or LATENCY_BUCKETS, self.keep_samples)
        return h

    def observe(self, name: str, value: float, *labels: str) -> None:
        """Add one observation to a histogram."""
        self.histogram(name, *labels).observe(value)

    def forget(self, name: str, labels: tuple[str, ...]) -> None:
        """Drop what :meth:`take_stats` remembers of series ``labels`` of ``name`` (a series
        removed for good)."""
        self._taken.pop((name, labels), None)

    def get(self, name: str, *labels: str) -> float:
        """Current value of a counter or gauge series (0 when never set)."""
        v = self.values[name].get(labels, 0)
        return v if not isinstance(v, HistogramValue) else sum(v.counts)

    # -- exposition ---------------------------------------------------------------------------

    def families(self, extra: dict[str, str] | None = None) -> list[Metric]:
        """prometheus-client metric families of every series, with ``extra`` labels first."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        extra = extra or {}
        xnames, xvalues = list(extra), list(extra.values())
        out: list[Metric] = []
        for name, d in self.defs.items():
            series = list(self.values[name].items())
            labelnames = xnames + list(d.labelnames)
            if d.kind == COUNTER:
                counter = CounterMetricFamily(name, d.documentation, labels=labelnames)
                for labels, v in series:
                    counter.add_metric(xvalues + list(labels), v)
                out.append(counter)
            elif d.kind == GAUGE:
                gauge = GaugeMetricFamily(name, d.documentation, labels=labelnames)
                for labels, v in series:
                    gauge.add_metric(xvalues + list(labels), v)
                out.append(gauge)
            else:
                hist = HistogramMetricFamily(name, d.documentation, labels=labelnames)
                for labels, h in series:
                    counts = list(h.counts)
                    cumulative = list(itertools.accumulate(counts))
                    buckets = [(_fmt(b), c) for b, c in zip(h.bounds, cumulative)]
                    buckets.append(("+Inf", cumulative[-1]))
                    hist.add_metric(xvalues + list(labels), buckets, h.sum)
                out.append(hist)
        return out

    def take_stats(self) -> dict[str, Any] | None:
        """What changed since the last call, in vLLM's ``OffloadingConnectorStats`` data layout:
        ``{"types": {name: kind}, "data": {name: {labels: value}}}``: counter increments, gauge
        values, histogram samples. None when nothing changed. Of the metrics of
        :data:`NAMED_THROUGH_VLLM`, only the series in :attr:`through_vllm`."""
        types: dict[str, str] = {}
        data: dict[str, dict[tuple[str, ...], Any]] = {}
        taken = self._taken
        for name, d in self.defs.items():
            only = self.through_vllm.get(name)
            for labels, v in list(self.values[name].items()):
                if only is not None and labels not in only:
                    continue
                if d.kind == COUNTER:
                    key = (name, labels)
                    delta = v - taken.get(key, 0)
                    if delta <= 0:
                        continue
                    taken[key] = v
                    value: Any = delta
                elif d.kind == GAUGE:
                    key = (name, labels)
                    if taken.get(key) == v:
                        continue
                    taken[key] = v
                    value = v
                else:
                    if not v.samples:
                        continue
                    value, v.samples = v.samples, []
                types[name] = d.kind
                data.setdefault(name, {})[labels] = value
        return {"types": types, "data": data} if data else None


def _fmt(bound: float) -> str:
    return repr(float(bound))


# -- the tiering manager's values ---------------------------------------------------------------


class CounterReadings(Protocol):
    """The counters of a tiering manager that :func:`refresh` exports (the manager's
    :class:`~kvoffload.stats.Stats`; chunks unless named). Read only."""

    @property
    def host_queries(self) -> int:
        """Chunks looked up (every verdict passes the host tier)."""

    @property
    def host_hits(self) -> int:
        """Chunks found in the host tier."""

    @property
    def tier_queries(self) -> Mapping[str, int]:
        """Tier name -> lookups that reached it."""

    @property
    def tier_hits(self) -> Mapping[str, int]:
        """Tier name -> lookups it answered with a hit."""

    @property
    def promotions(self) -> Mapping[str, int]:
        """Tier name -> chunks loaded from it into the host tier."""

    @property
    def cascaded(self) -> Mapping[str, int]:
        """Tier name -> chunks stored into it (written, or already held)."""

    @property
    def written(self) -> Mapping[str, int]:
        """Tier name -> chunks it wrote (stored, less those it already held)."""

    @property
    def deduplicated(self) -> Mapping[tuple[str, str], int]:
        """``(tier, reason)`` -> chunks stored to it that it already held (nothing written)."""

    @property
    def transfer_bytes(self) -> Mapping[tuple[str, str], int]:
        """``(tier, direction)`` -> bytes it reported moved (``JobResult.transfer_bytes``)."""

    @property
    def dropped_stores(self) -> Mapping[str, int]:
        """Tier name -> chunks not written to it."""

    @property
    def promotion_waits(self) -> int:
        """Host misses told RETRY because held promotions filled the host tier."""

    @property
    def evicted_holds(self) -> int:
        """Held chunks evicted before their request loaded them."""

    @property
    def expired_holds(self) -> int:
        """Holds that lapsed unlooked-up."""

    @property
    def window_retry_giveups(self) -> int:
        """Sliding-window chunks answered MISS after too many RETRYs."""

    @property
    def recomputed(self) -> Mapping[tuple[str, str], int]:
        """``(tier, reason)`` -> tokens it held that were recomputed because it was slower."""

    @property
    def failed_jobs(self) -> Mapping[tuple[str, str], int]:
        """``(tier, direction)`` -> jobs that failed for at least one chunk."""

    @property
    def failed(self) -> Mapping[tuple[str, str, str], int]:
        """``(tier, direction, reason)`` -> chunks of failed jobs."""

    @property
    def refused(self) -> Mapping[tuple[str, str, str], int]:
        """``(tier, direction, reason)`` -> chunks a tier refused."""


class TierReadings(Protocol):
    """A secondary tier as :func:`refresh` reads it (a
    :class:`~kvoffload.tiers.base.SecondaryTierManager`)."""

    @property
    def name(self) -> str:
        """The tier's name (its ``tier`` label)."""

    @property
    def counters(self) -> Mapping[str, float]:
        """The tier's own named counters (engine and worker side)."""

    def report_metrics(self, metrics: MetricSet) -> None:
        """Set the tier's gauges in ``metrics``."""


@dataclass(frozen=True)
class ManagerReadings:
    """What :func:`refresh` reads of a tiering manager, handed over by its
    ``metric_readings()`` (:meth:`kvoffload.tiering.TieringManager.metric_readings`).

    Attributes:
        host_tier: the host tier's name (its ``tier`` label).
        host_slots: host-tier slots.
        host_slots_used: slots holding a chunk (ready, writing or pinned).
        host_slots_pinned: slots pinned by in-flight transfers.
        host_evictions: chunks evicted from the host tier so far.
        slot_bytes: bytes per host slot (the arena's row bytes).
        device_totals: the accelerator workers' counts in the arena header, summed over ranks:
            load bytes, load seconds, store bytes, store seconds.
        promotion_holds: host chunks held now for the requests they were promoted for.
        stats: the manager's counters, read in place.
        tiers: the secondary tiers, in order.
        published: KV-event batches published per stream (empty without a publisher).
        warm_restart: chunks a warm restart found at start, by outcome (``adopted``,
            ``dropped_<reason>``; empty without a slot table).
        canary: the online canary's checks by outcome (empty without a canary).
        canary_seconds: the wall time its checks took (seconds).
        tenants: per tier with per-tenant quotas, its :class:`TenantReadings` (empty without
            quotas).
        tenant_top: tenants with a ``kvoffload_tenant_bytes`` series of their own per tier.
    """

    host_tier: str
    host_slots: int
    host_slots_used: int
    host_slots_pinned: int
    host_evictions: int
    slot_bytes: int
    device_totals: Sequence[float]
    promotion_holds: int
    stats: CounterReadings
    tiers: Sequence[TierReadings]
    published: Mapping[str, int]
    warm_restart: Mapping[str, int] = field(default_factory=dict)
    canary: Mapping[str, int] = field(default_factory=dict)
    canary_seconds: float = 0.0
    tenants: Mapping[str, TenantReadings] = field(default_factory=dict)
    tenant_top: int = 10


@dataclass(frozen=True)
class TenantReadings:
    """One tier's per-tenant quota accounting, as :func:`refresh` reads it.

    Attributes:
        held: bytes held per tenant id (tenants holding none absent).
        evictions: chunks evicted so far to keep a tenant within its quota.
        refusals: chunks refused so far for a tenant's quota.
        named: the tenants the tier's quota overrides name: a series each, always (0 when
            they hold nothing), and the only ones through vLLM.
    """

    held: Mapping[str, int]
    evictions: int
    refusals: int
    named: frozenset[str] = frozenset()


class MetricSource(Protocol):
    """A tiering manager as :func:`refresh` sees it: its metric set and its readings."""

    @property
    def metrics(self) -> MetricSet:
        """The manager's metric set (its lock guards a refresh)."""

    def metric_readings(self) -> ManagerReadings:
        """The manager's values to export now."""


def refresh(tm: MetricSource) -> MetricSet:
    """Copy a tiering manager's counters into its metric set (``tm.metrics``) and return it.

    Read, through ``tm.metric_readings()`` (:class:`ManagerReadings`, taken under
    ``tm.metrics.lock``): the host tier's slots (gauges), the manager's counters (lookups,
    transfers, failures, refusals, drops), each tier's own counters (``tier.counters``;
    ``<family>.<value>`` ones of :data:`TIER_COUNTER_FAMILIES` as that metric, the others as
    ``kvoffload_tier_events``) and its
    :meth:`~kvoffload.tiers.base.SecondaryTierManager.report_metrics`, the accelerator workers'
    byte and second counts in the arena header, the KV-event batches published, and what a warm
    restart adopted and dropped. Totals kept
    elsewhere only ever raise a counter (:meth:`MetricSet.set_total`). Safe from another thread
    than the engine's (it only reads engine state, under ``tm.metrics.lock``).
    """
    m = tm.metrics
    with m.lock:
        r = tm.metric_readings()
        st = r.stats
        host = r.host_tier
        n = r.host_slots
        used = r.host_slots_used
        m.set("kvoffload_host_slots", n)
        m.set("kvoffload_host_slot_bytes", r.slot_bytes)
        m.set("kvoffload_host_slots_used", used)
        m.set("kvoffload_host_slots_pinned", r.host_slots_pinned)
        m.set("kvoffload_host_usage_ratio", used / n if n else 0.0)
        tier_hits = dict(st.tier_hits)
        tier_queries = dict(st.tier_queries)
        m.set_total("kvoffload_lookup_requested_chunks", st.host_queries)
        m.set_total("kvoffload_lookup_hit_chunks", st.host_hits + sum(tier_hits.values()))
        m.set_total("kvoffload_tier_queries", st.host_queries, host)
        m.set_total("kvoffload_tier_hits", st.host_hits, host)
        m.set_total("kvoffload_host_evictions", r.host_evictions)
        m.set("kvoffload_promotion_holds", r.promotion_holds)
        m.set_total("kvoffload_promotion_waits", st.promotion_waits)
        m.set_total("kvoffload_promotion_hold_losses", st.evicted_holds, "evicted")
        m.set_total("kvoffload_promotion_hold_losses", st.expired_holds, "expired")
        m.set_total("kvoffload_window_retry_giveups", st.window_retry_giveups)
        dev = r.device_totals
        m.set_total("kvoffload_device_transfer_bytes", float(dev[0]), "load")
        m.set_total("kvoffload_device_transfer_seconds", float(dev[1]), "load")
        m.set_total("kvoffload_device_transfer_bytes", float(dev[2]), "store")
        m.set_total("kvoffload_device_transfer_seconds", float(dev[3]), "store")
        for (tname, direction), v in list(st.failed_jobs.items()):
            m.set_total("kvoffload_tier_failed_jobs", v, tname, direction)
        for (tname, direction, reason), v in list(st.failed.items()):
            m.set_total("kvoffload_tier_failed_chunks", v, tname, direction, reason)
        for (tname, direction, reason), v in list(st.refused.items()):
            m.set_total("kvoffload_refused_chunks", v, tname, direction, reason)
        for (tname, reason), v in list(st.deduplicated.items()):
            m.set_total("kvoffload_tier_deduplicated_chunks", v, tname, reason)
        for (tname, reason), v in list(st.recomputed.items()):
            m.set_total("kvoffload_recomputed_tokens", v, tname, reason)
        moved = st.transfer_bytes
        for tier in r.tiers:
            name = tier.name
            c = dict(tier.counters)
            m.set_total("kvoffload_tier_queries", tier_queries[name], name)
            m.set_total("kvoffload_tier_hits", tier_hits[name], name)
            # what the tier reports it moved, never chunks x row bytes (CASES C50): a store of
            # a chunk the tier already held wrote nothing
            m.set_total("kvoffload_tier_transfer_bytes", moved.get((name, "load"), 0), name, "load")
            m.set_total(
                "kvoffload_tier_transfer_bytes", moved.get((name, "store"), 0), name, "store"
            )
            m.set_total("kvoffload_tier_transfer_chunks", st.promotions[name], name, "load")
            m.set_total("kvoffload_tier_transfer_chunks", st.written[name], name, "store")
            m.set_total("kvoffload_tier_worker_restarts", c.get(names.WORKER_RESTARTS, 0), name)
            m.set_total("kvoffload_tier_evictions", c.get(names.EVICTIONS, 0), name)
            m.set_total("kvoffload_dropped_stores", st.dropped_stores[name], name)
            for event, count in c.items():
                family, dot, value = event.partition(".")
                labelled = TIER_COUNTER_FAMILIES.get(family) if dot else None
                if labelled is not None:  # e.g. eviction_errors.EACCES -> {errno="EACCES"}
                    m.set_total(labelled, count, name, value)
                else:
                    m.set_total("kvoffload_tier_events", count, name, event)
            tier.report_metrics(m)
        for stream, v in r.published.items():
            m.set_total("kvoffload_kv_events_published", v, stream)
        for outcome, v in r.warm_restart.items():
            m.set_total("kvoffload_warm_restart_chunks", v, outcome)
        if r.tenants:
            _tenant_series(m, r.tenants, r.tenant_top)
        if r.canary:
            for outcome, v in list(r.canary.items()):
                m.set_total("kvoffload_canary_checks", v, outcome)
            m.set_total("kvoffload_canary_seconds", r.canary_seconds)
    return m


NAMED_THROUGH_VLLM = frozenset({"kvoffload_tenant_bytes"})
"""Metrics of which :meth:`MetricSet.take_stats` hands vLLM only the series in
:attr:`MetricSet.through_vllm`: per-tenant bytes, of the tenants the configuration names (quota
overrides), a set the operator bounds. vLLM's exporter keeps every label set it ever bound, for
the life of the process, so tenants passing through the top N (or an attacker rotating salts)
would grow its series without bound, and with two readers (a standalone endpoint beside vLLM's) a
tenant's last value could stay. The top N and ``other`` are on kvoffload's own endpoint
(:func:`serve`); the quota counters (no tenant label) go through vLLM too."""

OTHER_TENANTS = "other"
"""The ``tenant`` label value of the bytes of every tenant outside the top N
(``kvoffload_tenant_bytes``)."""


def top_tenants(held: Mapping[str, int], n: int) -> tuple[list[tuple[str, int]], int]:
    """The ``n`` tenants holding the most bytes (most first; ties by id) and the bytes of all the
    others together: what ``kvoffload_tenant_bytes`` exports (at most ``n + 1`` series a tier)."""
    top = heapq.nsmallest(n, held.items(), key=lambda kv: (-kv[1], kv[0])) if n > 0 else []
    return top, sum(held.values()) - sum(b for _, b in top)


def _tenant_series(m: MetricSet, tenants: Mapping[str, TenantReadings], top: int) -> None:
    """Set ``kvoffload_tenant_bytes`` for each tier's named tenants (its quota overrides'), its
    ``top`` other tenants holding the most bytes and ``other`` for the rest (:func:`top_tenants`),
    and the quota counters; only the named tenants' series go through vLLM. A tenant that left the
    top is set to 0 once, then its series is removed: a tier never has more than
    ``named + 2 * top + 1`` series, whatever the tenants."""
    series = m.values["kvoffload_tenant_bytes"]
    to_vllm = m.through_vllm["kvoffload_tenant_bytes"]
    now: set[tuple[str, str]] = set()
    for tier, r in tenants.items():
        best, rest = top_tenants({t: b for t, b in r.held.items() if t not in r.named}, top)
        for tenant in r.named:
            m.set("kvoffload_tenant_bytes", r.held.get(tenant, 0), tier, tenant)
            now.add((tier, tenant))
            to_vllm.add((tier, tenant))
        for tenant, nbytes in best:
            m.set("kvoffload_tenant_bytes", nbytes, tier, tenant)
            now.add((tier, tenant))
        m.set("kvoffload_tenant_bytes", rest, tier, OTHER_TENANTS)
        now.add((tier, OTHER_TENANTS))
        m.set_total("kvoffload_tenant_quota_evictions", r.evictions, tier)
        m.set_total("kvoffload_tenant_quota_refusals", r.refusals, tier)
    for labels in [k for k in series if k not in now]:
        if series[labels]:
            series[labels] = 0
        else:
            del series[labels]
            m.forget("kvoffload_tenant_bytes", labels)


# -- the standalone endpoint --------------------------------------------------------------------

_sources: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_sources_lock = threading.Lock()
_instance_ids = itertools.count()


def register_source(source: Any, instance: str | None = None) -> str:
    """Export ``source`` (anything with ``refresh_metrics() -> MetricSet``) on :func:`serve`'s
    endpoint under a unique ``instance`` label; returns that label. Held weakly."""
    import os

    with _sources_lock:
        base = instance or f"{os.getpid()}-{next(_instance_ids)}"
        name, n = base, 1
        while name in _sources:
            n += 1
            name = f"{base}-{n}"
        _sources[name] = source
    return name


def unregister_source(instance: str) -> None:
    """Stop exporting the manager registered as ``instance`` (no error if it is not)."""
    with _sources_lock:
        _sources.pop(instance, None)


class _Collector:
    def collect(self):
        with _sources_lock:
            items = list(_sources.items())
        merged: dict[str, Any] = {}
        for instance, src in items:
            try:
                mset = src.refresh_metrics()
            except Exception:
                log.exception("kvoffload metrics: instance %s could not be collected", instance)
                continue
            with mset.lock:
                fams = mset.families({"instance": instance})
            for fam in fams:
                have = merged.get(fam.name)
                if have is None:
                    merged[fam.name] = fam
                else:
                    have.samples.extend(fam.samples)
        yield from merged.values()


_server_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}


_registry: CollectorRegistry | None = None


def registry() -> CollectorRegistry:
    """A prometheus-client registry exporting every registered manager (one per process)."""
    global _registry
    with _server_lock:
        if _registry is None:
            from prometheus_client import CollectorRegistry

            reg = CollectorRegistry(auto_describe=False)
            reg.register(_Collector())
            _registry = reg
        return _registry


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` for every manager of this process on ``addr:port`` (``port`` 0 picks a
    free one). Returns the port. Serving twice on the same address is a no-op.

    Raises:
        OSError: the port is taken.
    """
    from prometheus_client import start_http_server

    with _server_lock:
        if (addr, port) in _servers and port:
            return port
    reg = registry()
    server, _thread = start_http_server(port, addr=addr, registry=reg)
    bound = server.server_address[1]
    with _server_lock:
        _servers[(addr, bound)] = server
    return bound


def stop_serving() -> None:
    """Stop every endpoint started by :func:`serve` (tests, tools at exit)."""
    with _server_lock:
        servers = list(_servers.values())
        _servers.clear()
    for s in servers:
        s.shutdown()
        s.server_close()
