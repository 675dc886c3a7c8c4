"""The ``kvoffload top`` command: a textual app showing :mod:`.model`'s :class:`Stats` in tables and
:mod:`.feed`'s movements in a log, refreshed by UI timers (scrapes run in a worker thread, the
event feed is drained every 0.1 s without blocking).
"""

from __future__ import annotations

import asyncio
import http.client
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence

import click
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical, VerticalScroll
from textual.widgets import DataTable, Footer, Header, RichLog, Static, TabbedContent, TabPane

from kvoffload.tools.top.feed import (
    DEFAULT_MOVEMENTS_TOPIC,
    MovementFeed,
    describe_error,
    fetch_snapshot,
    normalize_metrics_url,
)
from kvoffload.tools.top.model import (
    METRIC_PREFIX,
    ReceivedMovement,
    RouteCounter,
    Snapshot,
    Stats,
    derive,
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
    """``x`` with thousands separators, or a dash when unknown."""
    return "–" if x is None else f"{x:,.{digits}f}"


def fmt_ratio(x: float | None) -> str:
    """A 0..1 ratio as a percentage, or a dash when unknown."""
    return "–" if x is None else f"{x * 100:.1f} %"


def fmt_breaker(state: str | None) -> str:
    """``closed`` as is, the others in capitals (``OPEN``, ``HALF-OPEN``); ``–`` when unknown."""
    if state is None:
        return "–"
    return state if state == "closed" else state.replace("_", "-").upper()


def fmt_clock(wall: float | None) -> str:
    """Local wall-clock time ``HH:MM:SS`` of ``wall`` (seconds since the epoch), or never."""
    return "never" if wall is None else time.strftime("%H:%M:%S", time.localtime(wall))


def movement_line(m: ReceivedMovement) -> str:
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
    p pauses, q quits. It needs a terminal: run from a pipe, a file or cron it exits 2 (read
    the same figures with ``curl -s URL | grep ^kvoffload_``)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise click.UsageError(
            "kvoffload top is an interactive monitor and needs a terminal (stdin and stdout "
            "are not one here); for the figures in a script, read the exposition itself: "
            f"curl -s {normalize_metrics_url(metrics_url)} | grep ^kvoffload_"
        )
    TopApp(metrics_url, events_endpoint, events_topic, interval, window, timeout).run()


main = top
