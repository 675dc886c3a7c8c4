"""``kvoffload top``: a live terminal monitor of a running engine or stress run.

::

    engine / stress run                           kvoffload top (one process)
    ───────────────────                           ───────────────────────────
    GET /metrics ──HTTP (urllib, in a thread)───▶ fetch_snapshot() ─▶ Snapshot ─┐
                                                                                ▼
                                          history of Snapshots ─▶ derive() ─▶ Stats ─▶ tables
    PUB socket ──ZMQ (topic, seq, payload)──────▶ MovementFeed.poll() ─▶ [Movement] ─▶ log, routes
                   (SUB, drained by a UI timer,
                    never blocks)

Metrics: every ``--interval`` seconds the exposition is fetched and parsed off the UI thread into
a :class:`Snapshot` (samples summed over labels the monitor does not show, e.g. ``instance``).
:func:`derive` turns the newest snapshot, the one before it and the oldest one inside
``--window`` into :class:`Stats`: gauges as they are; counter rates as the difference between two
scrapes divided by the time between them; latency percentiles estimated from histogram buckets
the way Prometheus' ``histogram_quantile`` does. A failed scrape leaves the last good values on
screen under a banner and is retried at the next interval.

Events: a SUB socket subscribed to the movements topic (``docs/observability.md``: frames
``(topic, 8-byte big-endian seq, msgpack payload)``) is drained without blocking by a UI timer.
Gaps in ``seq`` are counted as missed messages; a socket monitor tells whether a publisher is
connected.

Everything above the ``# -- textual app`` line is plain data code, tested without a terminal.
"""

from __future__ import annotations

import asyncio
import http.client
import math
import socket
import time
import urllib.error
import urllib.request
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import click
import msgspec
import zmq
from prometheus_client.parser import text_string_to_metric_families
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, RichLog, Static, TabbedContent, TabPane
from zmq.utils.monitor import recv_monitor_message

METRIC_PREFIX = "kvoffload_"
DEFAULT_MOVEMENTS_TOPIC = "kvoffload-movements"
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

    def has(self, name: str) -> bool:
        return name in self.samples

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


def fetch_snapshot(url: str, timeout: float) -> Snapshot:
    """GET ``url`` (at most ``timeout`` seconds per socket operation) and parse it. Blocks: call it
    from a thread. Raises OSError (URLError, HTTPError, timeouts), http.client.HTTPException or
    ValueError (not an exposition)."""
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode("utf-8")
    return parse_exposition(text, time.monotonic(), time.time())


def describe_error(e: BaseException) -> str:
    """One line for a banner: what went wrong, without a traceback."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        reason = e.reason
        return describe_error(reason) if isinstance(reason, BaseException) else str(reason)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def normalize_metrics_url(url: str) -> str:
    """``HOST:PORT`` → ``http://HOST:PORT/metrics``; a URL with a scheme and a path is kept."""
    if "://" not in url:
        url = f"http://{url}"
    scheme, rest = url.split("://", 1)
    if "/" not in rest:
        url = f"{scheme}://{rest}/metrics"
    return url


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


# -- KV movement events -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Movement:
    """One chunk moved between tiers: ``ts`` publisher time (seconds since the epoch), ``key`` the
    chunk key, ``src``/``dst`` tier names (``device``, ``host``, a secondary tier, ``none`` for an
    eviction), ``locality`` ``local``/``remote``, ``nbytes`` payload bytes."""

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


def decode_movements(frames: Sequence[bytes]) -> tuple[str, int, list[Movement]]:
    """``(topic, seq, movements)`` of one message ``(topic, 8-byte big-endian seq, payload)``,
    payload the msgpack map ``{"ts", "instance", "events": [{"key", "src", "dst", "locality",
    "nbytes"}]}`` (``docs/observability.md``). Raises ValueError for any other shape."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"expected 3 frames (topic, 8-byte seq, payload), got {len(frames)}")
    topic, seq = bytes(frames[0]).decode("utf-8", "replace"), int.from_bytes(frames[1], "big")
    try:
        msg = msgspec.msgpack.decode(frames[2])
        ts, instance = float(msg.get("ts", 0.0)), str(msg.get("instance", ""))
        out = [
            Movement(
                ts,
                instance,
                bytes(e["key"]),
                str(e["src"]),
                str(e["dst"]),
                str(e.get("locality", "")),
                int(e.get("nbytes", 0)),
            )
            for e in msg["events"]
        ]
    except (msgspec.DecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"undecodable movements payload: {describe_error(e)}") from None
    return topic, seq, out


def normalize_events_endpoint(endpoint: str) -> str:
    """``HOST:PORT`` → ``tcp://HOST:PORT``; an endpoint with a transport is kept."""
    return endpoint if "://" in endpoint else f"tcp://{endpoint}"


class MovementFeed:
    """A ZMQ SUB socket on a KV-events publisher, subscribed to ``topic``; :meth:`poll` never
    blocks.

    State for the banner: ``connected`` (a publisher is connected), ``error`` (why not; None when
    connected), ``last_message_wall`` (``time.time()`` of the newest message). Counters:
    ``messages``, ``movements``, ``missed`` (messages lost, from gaps in ``seq``), ``malformed``
    (messages that did not decode; the newest reason in ``last_malformed``),
    ``publisher_restarts`` (``seq`` went backwards).
    """

    RETRY_SOCKET_S = 5.0  # after a connect() error (a bad endpoint), try again this often
    CONNECT_GRACE_S = 3.0  # not connected this long after connecting: say so

    def __init__(
        self,
        endpoint: str,
        topic: str = DEFAULT_MOVEMENTS_TOPIC,
        context: zmq.Context | None = None,
    ):
        self.endpoint = normalize_events_endpoint(endpoint)
        self.topic = topic.encode()
        self._ctx = context or zmq.Context()
        self._own_ctx = context is None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._opened_at = 0.0
        self._next_seq: int | None = None
        self.connected = False
        self.error: str | None = None
        self.last_malformed: str | None = None
        self.last_message_wall: float | None = None
        self.messages = self.movements = self.missed = self.malformed = self.publisher_restarts = 0
        self._open()

    def _open(self) -> None:
        self._opened_at = time.monotonic()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)  # a burst between two polls is not dropped
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        try:
            sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self.error = f"cannot connect to {self.endpoint}: {e}"
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            return
        self._sock, self._monitor = sock, monitor

    def _watch_connection(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.connected, self.error = True, None
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected, self.error = False, "publisher went away (reconnecting)"
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self.connected = False
                self.error = "no publisher accepts connections there (retrying)"
        if (
            not self.connected
            and self.error is None
            and time.monotonic() - self._opened_at > self.CONNECT_GRACE_S
        ):
            self.error = f"not connected after {self.CONNECT_GRACE_S:.0f} s (retrying)"

    def poll(self, max_messages: int = 2000) -> list[Movement]:
        """Movements of the messages waiting now (at most ``max_messages``), oldest first."""
        if self._sock is None:
            if time.monotonic() - self._opened_at >= self.RETRY_SOCKET_S:
                self._open()
            return []
        self._watch_connection()
        out: list[Movement] = []
        for _ in range(max_messages):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames[0] != self.topic:  # SUBSCRIBE matches prefixes: another topic
                continue
            try:
                _, seq, movements = decode_movements(frames)
            except ValueError as e:
                self.malformed += 1
                self.last_malformed = str(e)
                continue
            if self._next_seq is not None and seq > self._next_seq:
                self.missed += seq - self._next_seq
            elif self._next_seq is not None and seq < self._next_seq:
                self.publisher_restarts += 1
            self._next_seq = seq + 1
            self.messages += 1
            self.movements += len(movements)
            self.last_message_wall = time.time()
            self.connected = True
            out.extend(movements)
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        self._sock = self._monitor = None
        if self._own_ctx:
            self._ctx.term()


class RouteCounter:
    """Movements per route (``src→dst``): chunk and byte totals since the monitor started, and
    per-second rates over the last ``window_s`` seconds."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        self._recent: deque[tuple[float, str, int, int]] = deque()

    def add(self, movements: Iterable[Movement], now: float) -> None:
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


# -- formatting -------------------------------------------------------------------------------


def fmt_bytes(n: float | None, suffix: str = "") -> str:
    """Bytes in binary units: ``1.5 MiB``."""
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}{suffix}" if unit == "B" else f"{n:.1f} {unit}{suffix}"
        n /= 1024
    return f"{n:.1f} TiB{suffix}"


def fmt_seconds(s: float | None) -> str:
    """A duration in seconds in the unit that reads best: ``2.5 µs``, ``850 µs``, ``12.3 ms``,
    ``1.20 s``."""
    if s is None:
        return "–"
    if s < 1e-5:
        return f"{s * 1e6:.1f} µs"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def fmt_num(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f} %"


def fmt_breaker(state: str | None) -> str:
    """``closed`` as is, the others in capitals (``OPEN``, ``HALF-OPEN``); ``–`` when unknown."""
    if state is None:
        return "–"
    return state if state == "closed" else state.replace("_", "-").upper()


def fmt_clock(wall: float | None) -> str:
    return "never" if wall is None else time.strftime("%H:%M:%S", time.localtime(wall))


def movement_line(m: Movement) -> str:
    """One log line: time, key hex prefix, route, locality, size, instance."""
    clock = time.strftime("%H:%M:%S", time.localtime(m.ts)) + f".{int(m.ts % 1 * 1000):03d}"
    return (
        f"{clock}  {m.key.hex()[:16]:<16}  {m.route:<14}  {m.locality:<6}  "
        f"{fmt_bytes(m.nbytes):>10}  {m.instance}"
    )


# -- textual app ------------------------------------------------------------------------------

VIEWS = ("overview", "latency", "movements")

TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "host": ("host tier", "value"),
    "hits": ("tier", "queries (chunks)", "hits", "hit rate", "queries/s"),
    "bandwidth": ("tier", "direction", "bytes/s", "chunks/s", "total"),
    "queues": ("tier", "store queue", "load queue", "in flight jobs"),
    "health": (
        "tier",
        "workers alive",
        "restarts",
        "breaker",
        "dropped stores",
        "evictions",
        "failed chunks",
    ),
    "refusals": ("tier", "what", "reason", "chunks", "chunks/s"),
    "latency": (
        "metric",
        "tier",
        "direction",
        "p50",
        "p90",
        "p99",
        "mean",
        "observations",
        "scope",
    ),
    "routes": ("route", "chunks", "bytes", "chunks/s", "bytes/s"),
}


class TopApp(App):
    """The monitor. ``metrics_url`` is scraped every ``interval`` seconds (a fetch may take
    ``timeout`` seconds); ``events_endpoint`` (optional) is a ZMQ PUB endpoint publishing
    ``events_topic``; latency percentiles cover the last ``window`` seconds."""

    TITLE = "kvoffload top"
    LOG_LINES_PER_POLL = 20  # movement log lines written per events poll (10 polls a second)
    CSS = """
    .banner { background: $error; color: $text; text-style: bold; padding: 0 1; display: none; }
    #events-banner { background: $warning; color: $background; }
    #status { padding: 0 1; color: $text-muted; }
    #views { height: 1fr; }
    #overview-grid { grid-size: 2; grid-gutter: 1 2; grid-rows: auto; height: auto; }
    DataTable { height: auto; }
    DataTable.section { border-top: solid $primary; }
    #health-table, #refusals-table, #movements-log { margin-top: 1; }
    #movements-log { border-top: solid $primary; height: 1fr; }
    """
    BINDINGS = [
        Binding("1", "show_view('overview')", "Overview"),
        Binding("2", "show_view('latency')", "Latency"),
        Binding("3", "show_view('movements')", "Movements"),
        Binding("tab", "cycle_view(1)", "Next view", priority=True, show=False),
        Binding("shift+tab", "cycle_view(-1)", "Previous view", priority=True, show=False),
        Binding("p", "toggle_pause", "Pause"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        metrics_url: str,
        events_endpoint: str | None = None,
        events_topic: str = DEFAULT_MOVEMENTS_TOPIC,
        interval: float = 1.0,
        window: float = 10.0,
        timeout: float = 2.0,
    ):
        super().__init__()
        self.metrics_url = normalize_metrics_url(metrics_url)
        self.events_endpoint = events_endpoint
        self.events_topic = events_topic
        self.interval = interval
        self.window = window
        self.timeout = timeout
        self.paused = False
        self.history: deque[Snapshot] = deque()
        self.stats: Stats | None = None
        self.scrape_failures = 0
        self.scrape_error: str | None = None
        self.last_good_wall: float | None = None
        self.feed: MovementFeed | None = None
        self.routes = RouteCounter()
        self._pending_lines: deque[str] = deque(maxlen=500)  # while paused: the newest 500

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="metrics-banner", classes="banner")
        yield Static(id="events-banner", classes="banner")
        yield Static(id="status")
        with TabbedContent(initial="overview", id="views"):
            with TabPane("1 Overview", id="overview"):
                with VerticalScroll():
                    with Grid(id="overview-grid"):
                        yield self._table("host", "Host tier")
                        yield self._table("hits", "Hit rate")
                        yield self._table("bandwidth", "Bandwidth")
                        yield self._table("queues", "Queues")
                    yield self._table("health", "Worker health")
                    yield self._table("refusals", "Refused chunks and failed evictions")
            with TabPane("2 Latency", id="latency"):
                yield self._table("latency", "Latency percentiles")
            with TabPane("3 Movements", id="movements"):
                with Vertical():
                    yield self._table("routes", "Movements per route")
                    log = RichLog(id="movements-log", max_lines=2000, min_width=40)
                    log.border_title = (
                        "Recent movements: time, key, route, locality, size, instance"
                    )
                    yield log
        yield Footer()

    @staticmethod
    def _table(table_id: str, title: str) -> DataTable:
        table = DataTable(
            id=f"{table_id}-table", classes="section", show_cursor=False, zebra_stripes=True
        )
        table.border_title = title
        table.add_columns(*TABLE_COLUMNS[table_id])
        return table

    def on_mount(self) -> None:
        self.sub_title = self.metrics_url
        if self.events_endpoint:
            self.feed = MovementFeed(self.events_endpoint, self.events_topic)
            self.set_interval(0.1, self._poll_events)
        else:
            self.query_one("#movements-log", RichLog).write(
                "no events endpoint given (--events tcp://HOST:PORT): movements are not shown"
            )
        self.set_interval(1.0, self._tick)
        self._show_status()
        self.run_worker(self._scrape_loop(), name="scrape", exclusive=True)

    def on_unmount(self) -> None:
        if self.feed is not None:
            self.feed.close()

    # -- metrics

    async def _scrape_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            try:
                snap = await loop.run_in_executor(
                    None, fetch_snapshot, self.metrics_url, self.timeout
                )
            except (OSError, ValueError, http.client.HTTPException) as e:
                self._scrape_failed(f"metrics endpoint unreachable: {describe_error(e)}")
            else:
                if snap.samples:
                    self._scrape_succeeded(snap)
                else:
                    self._scrape_failed(
                        f"metrics endpoint answers without {METRIC_PREFIX}* "
                        "metrics (is this the right URL, is offloading enabled?)"
                    )
            await asyncio.sleep(max(0.05, self.interval - (time.monotonic() - started)))

    def _scrape_failed(self, error: str) -> None:
        self.scrape_failures += 1
        self.scrape_error = error
        self._show_status()

    def _scrape_succeeded(self, snap: Snapshot) -> None:
        self.scrape_error = None
        self.last_good_wall = snap.wall
        prev = self.history[-1] if self.history else None
        self.history.append(snap)
        while len(self.history) > 2 and self.history[1].t <= snap.t - self.window:
            self.history.popleft()
        self.stats = derive(snap, prev, self.history[0] if len(self.history) > 1 else None)
        if not self.paused:
            self._show_stats(self.stats)
        self._show_status()

    def _show_status(self) -> None:
        banner = self.query_one("#metrics-banner", Static)
        if self.scrape_error is not None:
            shown = (
                "last good scrape "
                + fmt_clock(self.last_good_wall)
                + (" (values below are from then)" if self.stats else "")
            )
            banner.update(
                f"{self.scrape_error} — {self.metrics_url} — {shown}; retrying every "
                f"{self.interval:g} s"
            )
            banner.display = True
        else:
            banner.display = False
        ebanner = self.query_one("#events-banner", Static)
        feed = self.feed
        if feed is not None and feed.error is not None:
            ebanner.update(
                f"events endpoint unreachable: {feed.error} — {feed.endpoint} — "
                f"last message {fmt_clock(feed.last_message_wall)}"
            )
            ebanner.display = True
        else:
            ebanner.display = False
        parts = [f"scraped {fmt_clock(self.last_good_wall)} every {self.interval:g} s"]
        if self.stats is not None and self.stats.instances > 1:
            parts.append(f"{self.stats.instances} managers (summed)")
        if feed is not None:
            state = "connected" if feed.connected else "not connected"
            parts.append(
                f"events {feed.endpoint} {state}: {feed.messages} msgs, "
                f"{feed.movements} movements, {feed.missed} missed"
                + (
                    f", {feed.malformed} malformed ({feed.last_malformed})"
                    if feed.malformed
                    else ""
                )
            )
        if self.paused:
            parts.append("PAUSED (p resumes)")
        self.query_one("#status", Static).update(" │ ".join(parts))

    def _fill(self, table_id: str, rows: Iterable[Sequence[object]]) -> None:
        table = self.query_one(f"#{table_id}-table", DataTable)
        table.clear()
        table.add_rows([tuple(str(c) for c in row) for row in rows])

    def _show_stats(self, s: Stats) -> None:
        h = s.host
        capacity_bytes = (
            h.capacity_slots * h.slot_bytes
            if h.capacity_slots is not None and h.slot_bytes is not None
            else None
        )
        self._fill(
            "host",
            [
                ("capacity (slots)", fmt_num(h.capacity_slots)),
                ("used (slots)", fmt_num(h.used_slots)),
                ("pinned (slots)", fmt_num(h.pinned_slots)),
                ("usage", fmt_ratio(h.usage_ratio)),
                ("slot size", fmt_bytes(h.slot_bytes)),
                ("capacity (bytes)", fmt_bytes(capacity_bytes)),
                ("evictions", f"{fmt_num(h.evictions)} ({fmt_num(h.evictions_per_s, 1)}/s)"),
            ],
        )
        self._fill(
            "hits",
            [
                (
                    r.tier,
                    fmt_num(r.queries),
                    fmt_num(r.hits),
                    fmt_ratio(r.ratio),
                    fmt_num(r.queries_per_s, 1),
                )
                for r in s.hits
            ],
        )
        self._fill(
            "bandwidth",
            [
                (
                    t.tier,
                    t.direction,
                    fmt_bytes(t.bytes_per_s, "/s"),
                    fmt_num(t.chunks_per_s, 1),
                    fmt_bytes(t.total_bytes),
                )
                for t in s.throughput
            ],
        )
        self._fill(
            "queues",
            [
                (t.tier, fmt_num(t.queue_store), fmt_num(t.queue_load), fmt_num(t.inflight_jobs))
                for t in s.health
            ],
        )
        self._fill(
            "health",
            [
                (
                    t.tier,
                    fmt_num(t.workers_alive),
                    fmt_num(t.restarts),
                    fmt_breaker(t.breaker),
                    fmt_num(t.dropped_stores),
                    fmt_num(t.evictions),
                    ", ".join(f"{k} {v:,.0f}" for k, v in t.failed.items()) or "none",
                )
                for t in s.health
            ],
        )
        self._fill(
            "refusals",
            [(r.tier, r.what, r.reason, fmt_num(r.total), fmt_num(r.per_s, 1)) for r in s.refusals]
            or [("none", "", "", "", "")],
        )
        self._fill(
            "latency",
            [
                (
                    r.metric,
                    r.tier,
                    r.direction or "–",
                    *(fmt_seconds(q) for q in r.quantiles),
                    fmt_seconds(r.mean),
                    fmt_num(r.observations),
                    r.scope,
                )
                for r in s.latency
            ],
        )

    # -- events

    def _poll_events(self) -> None:
        if self.feed is None:
            return
        movements = self.feed.poll()
        self.routes.add(movements, time.monotonic())
        # A busy engine moves thousands of chunks a second: the log shows the newest of each poll
        # (every movement is counted in the routes table).
        shown = movements[-self.LOG_LINES_PER_POLL :]
        if len(movements) > len(shown):
            self._pending_lines.append(f"… {len(movements) - len(shown):,} more not shown")
        self._pending_lines.extend(movement_line(m) for m in shown)
        if not self.paused:
            self._show_movement_lines()

    def _show_movement_lines(self) -> None:
        if self._pending_lines:
            self.query_one("#movements-log", RichLog).write("\n".join(self._pending_lines))
            self._pending_lines.clear()

    def _show_routes(self) -> None:
        self._fill(
            "routes",
            [
                (r, fmt_num(c), fmt_bytes(b), fmt_num(cps, 1), fmt_bytes(bps, "/s"))
                for r, c, b, cps, bps in self.routes.rows(time.monotonic())
            ],
        )

    def _tick(self) -> None:
        self._show_status()
        if self.feed is not None and not self.paused:
            self._show_routes()

    # -- keys

    def action_show_view(self, view: str) -> None:
        self.query_one("#views", TabbedContent).active = view

    def action_cycle_view(self, step: int) -> None:
        views = self.query_one("#views", TabbedContent)
        views.active = VIEWS[(VIEWS.index(views.active) + step) % len(VIEWS)]

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        if not self.paused:
            if self.stats is not None:
                self._show_stats(self.stats)
            self._show_movement_lines()
            self._show_routes()
        self._show_status()


@click.command()
@click.option(
    "--metrics-url",
    required=True,
    help="Prometheus endpoint of the engine or stress run, e.g. "
    "http://127.0.0.1:9100/metrics (HOST:PORT is enough).",
)
@click.option(
    "--events",
    "events_endpoint",
    default=None,
    help="ZMQ PUB endpoint of the KV events, e.g. tcp://127.0.0.1:5557 (movements are "
    "shown only with it).",
)
@click.option(
    "--events-topic",
    default=DEFAULT_MOVEMENTS_TOPIC,
    show_default=True,
    help="Topic of the movement events (kv_events.movements_topic).",
)
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between scrapes (rates are per second over one interval).",
)
@click.option(
    "--window",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.0),
    help="Seconds of history the latency percentiles cover.",
)
@click.option(
    "--timeout",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds a scrape may take before it counts as failed.",
)
def top(
    metrics_url: str,
    events_endpoint: str | None,
    events_topic: str,
    interval: float,
    window: float,
    timeout: float,
) -> None:
    """Live monitor of a running engine or stress run: host usage, hit rates, bandwidth, latency
    percentiles, queues, worker health and breaker states, refused chunks and failed evictions by
    reason, and chunk movements. Keys: 1/2/3 or tab switch views,
    p pauses, q quits."""
    TopApp(metrics_url, events_endpoint, events_topic, interval, window, timeout).run()


main = top
