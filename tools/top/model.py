"""The data model of ``kvoffload top``: scrapes as :class:`Snapshot`, what is shown as :class:`Stats`,
movements as :class:`ReceivedMovement` counted per route. Plain data code, no I/O, tested without a
terminal.

Metrics: :func:`parse_exposition` turns an exposition into a :class:`Snapshot` (samples summed over
labels the monitor does not show, e.g. ``instance``). :func:`derive` turns the newest snapshot, the
one before it and the oldest one inside the latency window into :class:`Stats`: gauges as they are;
counter rates as the difference between two scrapes divided by the time between them; latency
percentiles estimated from histogram buckets the way Prometheus' ``histogram_quantile`` does.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

METRIC_PREFIX = "kvoffload_"
QUANTILES = (0.5, 0.9, 0.99)
DIRECTIONS = ("store", "load")

Labels = tuple[str, ...]


# -- scrape → snapshot ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Histogram:
    """One histogram series: ``buckets`` are ``(upper bound, cumulative count)`` sorted by bound,
    the last bound ``+inf``; ``count`` observations summing to ``total`` (in the metric's unit:
    seconds for the latency histograms)."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    total: float

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier``; this histogram itself when ``earlier`` is None,
        has other bounds, or is larger (the target restarted and its counters reset)."""
        if (
            earlier is None
            or earlier.count > self.count
            or [b for b, _ in earlier.buckets] != [b for b, _ in self.buckets]
        ):
            return self
        return Histogram(
            tuple((b, c - e) for (b, c), (_, e) in zip(self.buckets, earlier.buckets)),
            self.count - earlier.count,
            self.total - earlier.total,
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The ``kvoffload_*`` samples of one scrape.

    ``t``: ``time.monotonic()`` seconds when the response was read (rates divide by differences
    of it); ``wall``: ``time.time()`` seconds of the same moment (shown to the user). ``samples``
    maps a sample name as exposed (``kvoffload_tier_hits_total``, ``..._bucket``) to its
    ``(labels, value)`` pairs.
    """

    t: float
    wall: float
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **match: str) -> float | None:
        """Sum of the samples of ``name`` whose labels include ``match``; None if there are none."""
        found = [v for labels, v in self.samples.get(name, ()) if _matches(labels, match)]
        return math.fsum(found) if found else None

    def by(self, name: str, keys: Sequence[str], **match: str) -> dict[Labels, float]:
        """Samples of ``name`` summed per value of the ``keys`` labels (a missing label is "")."""
        out: dict[Labels, float] = defaultdict(float)
        for labels, v in self.samples.get(name, ()):
            if _matches(labels, match):
                out[tuple(labels.get(k, "") for k in keys)] += v
        return dict(out)

    def histograms(self, name: str, keys: Sequence[str]) -> dict[Labels, Histogram]:
        """The histogram ``name`` (without ``_bucket``) per value of the ``keys`` labels, every
        other label (``instance``) summed, which is exact for histograms with the same bounds."""
        buckets: dict[Labels, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        for labels, v in self.samples.get(f"{name}_bucket", ()):
            le = labels.get("le")
            if le is not None:
                buckets[tuple(labels.get(k, "") for k in keys)][float(le)] += v
        counts = self.by(f"{name}_count", keys)
        sums = self.by(f"{name}_sum", keys)
        out = {}
        for key, by_bound in buckets.items():
            ordered = tuple(sorted(by_bound.items()))
            out[key] = Histogram(ordered, counts.get(key, ordered[-1][1]), sums.get(key, 0.0))
        return out


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def parse_exposition(text: str, t: float, wall: float, prefix: str = METRIC_PREFIX) -> Snapshot:
    """Parse a Prometheus text exposition with ``prometheus_client``'s parser, keeping the samples
    whose name starts with ``prefix``; ``_created`` samples (creation timestamps) are dropped.

    Raises ValueError when the text is not an exposition.
    """
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix) and not s.name.endswith("_created"):
                samples[s.name].append((dict(s.labels), float(s.value)))
    return Snapshot(t, wall, dict(samples))


# -- snapshot → stats -------------------------------------------------------------------------


def increase(earlier: float | None, later: float) -> float:
    """Counter increase between two readings. A smaller later reading means the counter was reset
    (the target restarted), so all of ``later`` is new, as in Prometheus' ``increase()``."""
    if earlier is None or later < earlier:
        return later
    return later - earlier


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q`` quantile (0–1) of cumulative ``(upper bound, count)`` buckets, estimated as
    Prometheus' ``histogram_quantile`` does: find the bucket holding rank ``q × observations`` and
    interpolate linearly inside it (the lowest bucket starts at 0; a rank in the ``+Inf`` bucket
    gives the highest finite bound). In the unit of the bounds; None without observations or
    without a ``+Inf`` bucket."""
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]) or not 0 <= q <= 1:
        return None
    bounds = [b for b, _ in ordered]
    counts: list[float] = []
    for _, c in ordered:  # scrapes are not atomic: a bucket may be read before its neighbour grew
        counts.append(max(c, counts[-1]) if counts else c)
    observations = counts[-1]
    if observations <= 0:
        return None
    rank = q * observations
    b = next(i for i, c in enumerate(counts) if c >= rank)
    if b == len(counts) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[b - 1] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return start
    return start + (bounds[b] - start) * (rank - below) / in_bucket


@dataclass(frozen=True, slots=True)
class HostUsage:
    """The host tier: capacity and occupancy in slots (one chunk each), ``slot_bytes`` bytes per
    slot, ``usage_ratio`` used / capacity (0–1), ``evictions`` chunks evicted since the target
    started and ``evictions_per_s`` per second over the last scrape interval."""

    capacity_slots: float | None
    slot_bytes: float | None
    used_slots: float | None
    pinned_slots: float | None
    usage_ratio: float | None
    evictions: float | None
    evictions_per_s: float | None


@dataclass(frozen=True, slots=True)
class HitRow:
    """Chunk lookups that reached ``tier`` and those it answered with a hit, since the target
    started, and ``queries_per_s`` lookups per second. ``tier`` "all" is every lookup: requested
    chunks and chunks found in some tier."""

    tier: str
    queries: float
    hits: float
    queries_per_s: float | None

    @property
    def ratio(self) -> float | None:
        return self.hits / self.queries if self.queries else None


@dataclass(frozen=True, slots=True)
class Throughput:
    """Payload moved between ``tier`` ("device": the accelerator) and the host tier in
    ``direction`` (``store`` towards the slower tier, ``load`` towards the accelerator): bytes and
    chunks per second over the last scrape interval, bytes since the target started. The device
    has no chunk count (None)."""

    tier: str
    direction: str
    bytes_per_s: float | None
    chunks_per_s: float | None
    total_bytes: float


@dataclass(frozen=True, slots=True)
class LatencyRow:
    """Percentiles (seconds, one per :data:`QUANTILES`) and mean of ``metric`` ("lookup" or
    "transfer") for ``tier`` and ``direction`` ("" for lookups) over ``scope``: the latency window
    ("last 10 s"), or "since start" when the window holds no observation. ``observations`` is
    their number in that scope."""

    metric: str
    tier: str
    direction: str
    observations: float
    quantiles: tuple[float | None, ...]
    mean: float | None
    scope: str


@dataclass(frozen=True, slots=True)
class TierHealth:
    """Workers and queues of one secondary tier: live worker processes, restarts since start,
    breaker state (``closed``, ``open``, ``half_open``; None when not exported), tasks waiting per
    direction, jobs in flight; chunks since start: failed (per ``"direction/reason"``), dropped
    stores, evictions."""

    tier: str
    workers_alive: float | None
    restarts: float | None
    breaker: str | None
    queue_store: float | None
    queue_load: float | None
    inflight_jobs: float | None
    failed: dict[str, float]
    dropped_stores: float | None
    evictions: float | None


@dataclass(frozen=True, slots=True)
class RefusalRow:
    """Chunks ``tier`` refused or failed to handle: ``what`` is ``store`` or ``load`` (refused,
    ``kvoffload_refused_chunks_total``; ``reason`` such as ``no_evictable_slot``, ``pin_limit``,
    ``breaker_open``) or ``eviction`` (a delete that failed,
    ``kvoffload_tier_eviction_errors_total``; ``reason`` the errno name). ``total`` since the
    target started, ``per_s`` over the last scrape interval (None after the first scrape)."""

    tier: str
    what: str
    reason: str
    total: float
    per_s: float | None


#: Breaker states from the best to the worst: managers summed together show the worst one.
BREAKER_STATES = ("closed", "half_open", "open")


@dataclass(frozen=True, slots=True)
class Stats:
    """What the monitor shows. ``interval_s``: seconds between the two scrapes the rates come from
    (None after the first scrape: no rates yet). ``instances``: managers summed together."""

    interval_s: float | None
    instances: int
    host: HostUsage
    hits: list[HitRow]
    throughput: list[Throughput]
    latency: list[LatencyRow]
    health: list[TierHealth]
    refusals: list[RefusalRow]


def _tier_order(tiers: Iterable[str]) -> list[str]:
    """``host`` first, ``device`` last, secondary tiers in the order first seen (configured)."""
    seen = list(dict.fromkeys(t for t in tiers if t))
    return (
        [t for t in seen if t == "host"]
        + [t for t in seen if t not in ("host", "device")]
        + [t for t in seen if t == "device"]
    )


def _direction_rank(direction: tuple[str, ...]) -> int:
    if direction and direction[0] in DIRECTIONS:
        return DIRECTIONS.index(direction[0])
    return len(DIRECTIONS)


def _rate(
    cur: Snapshot, prev: Snapshot | None, name: str, keys: Sequence[str]
) -> dict[Labels, float]:
    if prev is None or cur.t <= prev.t:
        return {}
    before = prev.by(name, keys)
    dt = cur.t - prev.t
    return {k: increase(before.get(k), v) / dt for k, v in cur.by(name, keys).items()}


def derive(
    cur: Snapshot,
    prev: Snapshot | None = None,
    window_base: Snapshot | None = None,
    quantiles: Sequence[float] = QUANTILES,
) -> Stats:
    """Stats from the newest snapshot ``cur``, the scrape before it ``prev`` (rates) and the oldest
    snapshot inside the latency window ``window_base`` (percentiles of the observations made in
    the ``cur.t - window_base.t`` seconds between them)."""
    p = METRIC_PREFIX
    instances = {labels.get("instance", "") for rows in cur.samples.values() for labels, _ in rows}
    used, capacity = cur.value(f"{p}host_slots_used"), cur.value(f"{p}host_slots")
    ratio = cur.value(f"{p}host_usage_ratio")
    if len(instances) > 1 and used is not None and capacity:
        ratio = used / capacity  # ratios do not add up across managers; slots do
    host = HostUsage(
        capacity,
        cur.value(f"{p}host_slot_bytes"),
        used,
        cur.value(f"{p}host_slots_pinned"),
        ratio,
        cur.value(f"{p}host_evictions_total"),
        _rate(cur, prev, f"{p}host_evictions_total", ()).get(()),
    )

    queries = cur.by(f"{p}tier_queries_total", ("tier",))
    tier_hits = cur.by(f"{p}tier_hits_total", ("tier",))
    query_rates = _rate(cur, prev, f"{p}tier_queries_total", ("tier",))
    hits = [
        HitRow(t, queries.get((t,), 0.0), tier_hits.get((t,), 0.0), query_rates.get((t,)))
        for t in _tier_order(k[0] for k in (*queries, *tier_hits))
    ]
    requested = cur.value(f"{p}lookup_requested_chunks_total")
    if requested is not None:
        hits.append(
            HitRow(
                "all",
                requested,
                cur.value(f"{p}lookup_hit_chunks_total") or 0.0,
                _rate(cur, prev, f"{p}lookup_requested_chunks_total", ()).get(()),
            )
        )

    keys = ("tier", "direction")
    tier_bytes = cur.by(f"{p}tier_transfer_bytes_total", keys)
    tier_bytes_rate = _rate(cur, prev, f"{p}tier_transfer_bytes_total", keys)
    tier_chunks_rate = _rate(cur, prev, f"{p}tier_transfer_chunks_total", keys)
    throughput = [
        Throughput(
            t, d, tier_bytes_rate.get((t, d)), tier_chunks_rate.get((t, d)), tier_bytes[(t, d)]
        )
        for t in _tier_order(k[0] for k in tier_bytes)
        for d in DIRECTIONS
        if (t, d) in tier_bytes
    ]
    device_bytes = cur.by(f"{p}device_transfer_bytes_total", ("direction",))
    device_rate = _rate(cur, prev, f"{p}device_transfer_bytes_total", ("direction",))
    throughput += [
        Throughput("device", d, device_rate.get((d,)), None, device_bytes[(d,)])
        for d in DIRECTIONS
        if (d,) in device_bytes
    ]

    latency = []
    window_s = cur.t - window_base.t if window_base is not None else 0.0
    for metric, name, hkeys in (
        ("lookup", f"{p}lookup_latency_seconds", ("tier",)),
        ("transfer", f"{p}tier_transfer_latency_seconds", keys),
    ):
        now = cur.histograms(name, hkeys)
        then = window_base.histograms(name, hkeys) if window_base is not None else {}
        order = _tier_order(k[0] for k in now)
        for key in sorted(now, key=lambda k: (order.index(k[0]), _direction_rank(k[1:]))):
            h, scope = now[key], "since start"
            if window_s > 0:
                recent = now[key].minus(then.get(key))
                if recent.count > 0:
                    h, scope = recent, f"last {window_s:.0f} s"
            latency.append(
                LatencyRow(
                    metric,
                    key[0],
                    key[1] if len(key) > 1 else "",
                    h.count,
                    tuple(histogram_quantile(q, h.buckets) for q in quantiles),
                    h.total / h.count if h.count else None,
                    scope,
                )
            )

    health_tiers = _tier_order(
        k[0]
        for name in (
            "tier_workers_alive",
            "tier_queue_depth",
            "tier_inflight_jobs",
            "tier_breaker_open",
        )
        for k in cur.by(f"{p}{name}", ("tier",))
    )
    queue = cur.by(f"{p}tier_queue_depth", keys)
    failed = cur.by(f"{p}tier_failed_chunks_total", ("tier", "direction", "reason"))
    breaker_states = cur.by(f"{p}tier_breaker_state", ("tier", "state"))
    health = []
    for t in health_tiers:
        states = [s for s in BREAKER_STATES if breaker_states.get((t, s), 0) > 0]
        if states:
            breaker: str | None = states[-1]
        else:  # a target without the state gauge
            was_open = cur.value(f"{p}tier_breaker_open", tier=t)
            breaker = None if was_open is None else ("open" if was_open > 0 else "closed")
        health.append(
            TierHealth(
                t,
                cur.value(f"{p}tier_workers_alive", tier=t),
                cur.value(f"{p}tier_worker_restarts_total", tier=t),
                breaker,
                queue.get((t, "store")),
                queue.get((t, "load")),
                cur.value(f"{p}tier_inflight_jobs", tier=t),
                {f"{d}/{r}": v for (ft, d, r), v in sorted(failed.items()) if ft == t and v > 0},
                cur.value(f"{p}dropped_stores_total", tier=t),
                cur.value(f"{p}tier_evictions_total", tier=t),
            )
        )

    refusals, seen = [], []
    for name, what_of, rkeys in (
        (f"{p}refused_chunks_total", lambda k: k[1], ("tier", "direction", "reason")),
        (f"{p}tier_eviction_errors_total", lambda k: "eviction", ("tier", "errno")),
    ):
        totals = cur.by(name, rkeys)
        rates = _rate(cur, prev, name, rkeys)
        seen += [k[0] for k in totals]  # zero series too: they list the tiers in their order
        refusals += [
            RefusalRow(k[0], what_of(k), k[-1], v, rates.get(k)) for k, v in totals.items() if v > 0
        ]
    order = _tier_order(seen)
    what_order = (*DIRECTIONS, "eviction")
    refusals.sort(
        key=lambda r: (
            order.index(r.tier),
            what_order.index(r.what) if r.what in what_order else len(what_order),
            r.reason,
        )
    )

    return Stats(
        cur.t - prev.t if prev is not None else None,
        len(instances),
        host,
        hits,
        throughput,
        latency,
        health,
        refusals,
    )


# -- chunk movements --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReceivedMovement:
    """One chunk moved between tiers, as the monitor received it: the fields of a
    :class:`kvoffload.events.Movement` and of the :class:`~kvoffload.events.MovementBatch` it came
    in. ``ts`` publisher time (seconds since the epoch), ``instance`` the publishing manager,
    ``key`` the chunk key, ``src``/``dst`` tier names (``device``, ``host``, a secondary tier,
    ``none`` for an eviction), ``locality`` ``local``/``remote``, ``nbytes`` payload bytes."""

    ts: float
    instance: str
    key: bytes
    src: str
    dst: str
    locality: str
    nbytes: int

    @property
    def route(self) -> str:
        return f"{self.src}→{self.dst}"


class RouteCounter:
    """Movements per route (``src→dst``): chunk and byte totals since the monitor started, and
    per-second rates over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._recent: deque[tuple[float, str, int, int]] = deque()

    def add(self, movements: Iterable[ReceivedMovement], now: float) -> None:
        """Count ``movements`` received at ``now`` (monotonic seconds)."""
        batch: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for m in movements:
            batch[m.route][0] += 1
            batch[m.route][1] += m.nbytes
        for route, (chunks, nbytes) in batch.items():
            self.totals[route][0] += chunks
            self.totals[route][1] += nbytes
            self._recent.append((now, route, chunks, nbytes))

    def rows(self, now: float) -> list[tuple[str, int, int, float, float]]:
        """``(route, chunks, bytes, chunks/s, bytes/s)`` per route, busiest first."""
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        recent: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for _, route, chunks, nbytes in self._recent:
            recent[route][0] += chunks
            recent[route][1] += nbytes
        return sorted(
            (
                (r, c, b, recent[r][0] / self.window_s, recent[r][1] / self.window_s)
                for r, (c, b) in self.totals.items()
            ),
            key=lambda row: -row[1],
        )
