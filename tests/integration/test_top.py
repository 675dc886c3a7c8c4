"""``kvoffload top``: the data model against numbers checked by hand and by Prometheus; the app,
driven headless, against a live ``kvoffload stress`` run and against endpoints nobody listens on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
from textual.widgets import DataTable, RichLog, Static, TabbedContent

from kvoffload.tools.ports import free_port
from kvoffload.tools.top.app import TopApp, fmt_bytes, fmt_num
from kvoffload.tools.top.feed import MovementFeed, decode_movements, fetch_snapshot
from kvoffload.tools.top.model import (
    Histogram,
    Snapshot,
    derive,
    histogram_quantile,
    parse_exposition,
)

LATENCY = "kvoffload_tier_transfer_latency_seconds"
TOPIC = b"kvoffload-movements"

# Two managers (instances a and b) of one process. Prometheus 2.42 evaluated
# histogram_quantile(q, sum by (le) (kvoffload_tier_transfer_latency_seconds_bucket)) on this
# exposition to the values in test_percentiles_interpolate_within_buckets_as_prometheus_does.
EXPOSITION = (
    "\n".join(
        [
            "# TYPE kvoffload_host_slots gauge",
            'kvoffload_host_slots{instance="a"} 64',
            'kvoffload_host_slots{instance="b"} 32',
            "# TYPE kvoffload_tier_hits counter",
            'kvoffload_tier_hits_total{instance="a",tier="fs"} 5',
            'kvoffload_tier_hits_total{instance="b",tier="fs"} 2',
            'kvoffload_tier_hits_created{instance="a",tier="fs"} 1.7e9',
            f"# TYPE {LATENCY} histogram",
            *(
                f'{LATENCY}_bucket{{instance="{i}",tier="fs",direction="store",le="{le}"}} {n}'
                for i, counts in (("a", (2, 7, 19, 30, 31)), ("b", (0, 1, 1, 4, 9)))
                for le, n in zip(("0.001", "0.005", "0.01", "0.05", "+Inf"), counts)
            ),
            f'{LATENCY}_count{{instance="a",tier="fs",direction="store"}} 31',
            f'{LATENCY}_sum{{instance="a",tier="fs",direction="store"}} 0.4',
            f'{LATENCY}_count{{instance="b",tier="fs",direction="store"}} 9',
            f'{LATENCY}_sum{{instance="b",tier="fs",direction="store"}} 0.9',
            "# TYPE go_goroutines gauge",
            "go_goroutines 7",
        ]
    )
    + "\n"
)


# -- data model -------------------------------------------------------------------------------


def test_snapshot_sums_instances_and_keeps_only_kvoffload_samples():
    snap = parse_exposition(EXPOSITION, t=0.0, wall=0.0)
    assert snap.value("kvoffload_host_slots") == 96
    assert snap.by("kvoffload_tier_hits_total", ("tier",)) == {("fs",): 7}
    assert "go_goroutines" not in snap.samples
    assert "kvoffload_tier_hits_created" not in snap.samples
    h = snap.histograms(LATENCY, ("tier", "direction"))[("fs", "store")]
    assert h.count == 40 and h.total == pytest.approx(1.3)
    assert h.buckets[-1] == (float("inf"), 40)


@pytest.mark.parametrize(
    "q, expected",
    [
        (0.01, 0.0002),
        (0.05, 0.001),
        (0.25, 0.005833333333333334),
        (0.5, 0.01),
        (0.75, 0.038571428571428576),
        (0.9, 0.05),
        (0.99, 0.05),
    ],
)
def test_percentiles_interpolate_within_buckets_as_prometheus_does(q, expected):
    snap = parse_exposition(EXPOSITION, t=0.0, wall=0.0)
    h = snap.histograms(LATENCY, ("tier", "direction"))[("fs", "store")]
    assert histogram_quantile(q, h.buckets) == pytest.approx(expected)


def test_percentile_of_an_empty_histogram_is_unknown():
    assert histogram_quantile(0.5, [(0.1, 0), (float("inf"), 0)]) is None
    assert histogram_quantile(0.5, [(0.1, 3)]) is None  # no +Inf bucket


def _snap(t: float, **values: float) -> Snapshot:
    labels = {"tier": "fs", "direction": "store"}
    return Snapshot(t, 1.7e9 + t, {f"kvoffload_{n}": [(labels, v)] for n, v in values.items()})


def test_rates_are_the_counter_difference_over_the_time_between_scrapes():
    first = _snap(10.0, tier_transfer_bytes_total=1_000_000, tier_transfer_chunks_total=10)
    second = _snap(12.0, tier_transfer_bytes_total=5_000_000, tier_transfer_chunks_total=50)
    row = derive(second, first).throughput[0]
    assert (row.tier, row.direction) == ("fs", "store")
    assert row.bytes_per_s == 2_000_000 and row.chunks_per_s == 20
    assert derive(second).throughput[0].bytes_per_s is None  # one scrape: no rate yet


def test_a_counter_reset_counts_the_new_value_not_a_negative_rate():
    before = _snap(10.0, tier_transfer_bytes_total=9_000_000)
    restarted = _snap(11.0, tier_transfer_bytes_total=300)
    assert derive(restarted, before).throughput[0].bytes_per_s == 300


def test_latency_covers_the_window_and_falls_back_to_all_time_when_it_is_empty():
    def snap(t, counts):
        labels = {"tier": "fs", "direction": "load"}
        buckets = [({**labels, "le": le}, c) for le, c in zip(("0.01", "0.1", "+Inf"), counts)]
        return Snapshot(
            t, t, {f"{LATENCY}_bucket": buckets, f"{LATENCY}_count": [(labels, counts[-1])]}
        )

    old, new = snap(0.0, (100, 100, 100)), snap(10.0, (100, 100, 110))
    row = next(r for r in derive(new, old, old).latency if r.metric == "transfer")
    assert row.observations == 10 and row.scope == "last 10 s"
    assert row.quantiles[0] == 0.1  # the ten recent ones are all above 0.1 s: highest finite bound
    idle = next(r for r in derive(new, new, new).latency if r.metric == "transfer")
    assert idle.observations == 110 and idle.scope == "since start"
    assert Histogram(((1.0, 5),), 5, 1.0).minus(Histogram(((2.0, 1),), 1, 0.1)).count == 5


def _movements_payload(src: str = "host", dst: str = "fs") -> bytes:
    return msgspec.msgpack.encode(
        {
            "ts": 1.5,
            "instance": "m0",
            "events": [
                {
                    "key": b"\xab\xcd" * 8,
                    "src": src,
                    "dst": dst,
                    "locality": "local",
                    "nbytes": 4096,
                }
            ],
        }
    )


def test_movement_messages_decode_and_malformed_ones_are_rejected():
    topic, seq, moves = decode_movements([TOPIC, (7).to_bytes(8, "big"), _movements_payload()])
    assert (topic, seq) == ("kvoffload-movements", 7)
    assert moves[0].route == "host→fs" and moves[0].key.hex().startswith("abcd")
    assert moves[0].nbytes == 4096 and moves[0].ts == 1.5
    with pytest.raises(ValueError):
        decode_movements([TOPIC, (8).to_bytes(8, "big"), b"\xc1not msgpack"])
    with pytest.raises(ValueError):
        decode_movements([TOPIC, b"\x00", _movements_payload()])


def test_feed_counts_lost_and_malformed_messages_and_ignores_other_topics():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    feed = MovementFeed(f"127.0.0.1:{port}", context=ctx)
    try:
        payload = _movements_payload("device", "host")
        deadline = time.monotonic() + 30
        while not feed.messages and time.monotonic() < deadline:  # a SUB misses what precedes it
            pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), payload])
            time.sleep(0.05)
            feed.poll()
        joined = feed.messages
        pub.send_multipart([TOPIC + b"-other", (0).to_bytes(8, "big"), b"not msgpack"])
        for seq in (1, 2, 5):
            pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        pub.send_multipart([TOPIC, (6).to_bytes(8, "big"), b"\xc1"])
        # the malformed message (seq 6) is the last one sent: once it is counted, all were seen
        deadline = time.monotonic() + 30
        while feed.malformed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
            feed.poll()
        assert feed.connected and feed.error is None
        assert feed.messages == joined + 3 and feed.missed == 2 and feed.malformed == 1
    finally:
        feed.close()
        pub.close()
        ctx.term()


# -- the app ----------------------------------------------------------------------------------


def _rows(app: TopApp, table: str) -> list[list[str]]:
    t = app.query_one(f"#{table}-table", DataTable)
    return [[str(c) for c in t.get_row_at(i)] for i in range(t.row_count)]


def _text(app: TopApp, widget_id: str) -> str:
    """What a Static shows ("" while it is hidden)."""
    w = app.query_one(f"#{widget_id}", Static)
    return str(w.render()) if w.display else ""


async def _until(pilot, condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await pilot.pause(0.1)


async def _until_banner(pilot, app: TopApp, which: str, timeout_s: float = 60) -> None:
    await _until(
        pilot,
        lambda: f"{which} endpoint unreachable" in _text(app, f"{which}-banner"),
        timeout_s,
        f"the {which} banner",
    )


def test_unreachable_endpoints_show_banners_and_the_app_keeps_running():
    metrics_port, events_port = free_port(), free_port()  # nothing listens on either

    async def drive() -> TopApp:
        app = TopApp(
            f"http://127.0.0.1:{metrics_port}/metrics",
            f"tcp://127.0.0.1:{events_port}",
            interval=0.2,
        )
        async with app.run_test(size=(120, 36)) as pilot:
            await _until_banner(pilot, app, "metrics")
            banner = _text(app, "metrics-banner")
            assert "Connection refused" in banner and "last good scrape never" in banner
            await _until_banner(pilot, app, "events")
            failures = app.scrape_failures
            await _until(
                pilot, lambda: app.scrape_failures > failures, 60, "another scrape attempt"
            )  # still retrying
            for key in ("2", "3", "tab", "p", "p"):
                await pilot.press(key)
            assert app.query_one("#views", TabbedContent).active == "overview"
            assert app.is_running
            await pilot.press("q")
        return app

    app = asyncio.run(drive())
    assert app.return_code == 0


def _wait_for_metrics(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"kvoffload stress exited ({proc.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if b"kvoffload_host_slots" in resp.read():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no metrics at {url} after {timeout_s} s:\n{log.read_text()}")
        time.sleep(0.2)


@pytest.fixture
def stress_run(tmp_path):
    """A real ``kvoffload stress`` subprocess on free loopback ports: ``(metrics URL, events
    endpoint, process)``. Terminated and waited for afterwards, whatever the test did to it."""
    metrics_port, events_port = free_port(), free_port()
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    events = f"tcp://127.0.0.1:{events_port}"
    log = tmp_path / "stress.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvoffload.tools.cli",
                "stress",
                "--duration",
                "300",
                "--metrics-port",
                str(metrics_port),
                "--events-endpoint",
                events,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        _wait_for_metrics(metrics_url, proc, log)
        yield metrics_url, events, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_top_shows_a_live_stress_run_and_outlives_it(stress_run, tmp_path):
    metrics_url, events, proc = stress_run
    # KVOFFLOAD_TOP_SCREENSHOT=docs/top.svg refreshes the README's screenshot
    screenshot = Path(os.environ.get("KVOFFLOAD_TOP_SCREENSHOT", tmp_path / "top.svg")).resolve()

    async def drive() -> TopApp:
        app = TopApp(metrics_url, events, interval=0.5)
        async with app.run_test(size=(120, 40)) as pilot:

            def live() -> bool:
                s = app.stats
                return (
                    s is not None
                    and s.interval_s is not None
                    and any(r.tier == "fs" and r.bytes_per_s for r in s.throughput)
                    and app.feed.movements > 0
                )

            await _until(pilot, live, 120, "rates, fs traffic and movements")
            direct = fetch_snapshot(metrics_url, timeout=30)

            host = dict(_rows(app, "host"))
            assert host["capacity (slots)"] == fmt_num(direct.value("kvoffload_host_slots"))
            assert host["slot size"] == fmt_bytes(direct.value("kvoffload_host_slot_bytes"))
            hits = {row[0]: row for row in _rows(app, "hits")}
            assert {"host", "fs", "all"} <= hits.keys()
            shown_requested = int(hits["all"][1].replace(",", ""))
            assert 0 < shown_requested <= direct.value("kvoffload_lookup_requested_chunks_total")
            fs_store = next(r for r in _rows(app, "bandwidth") if r[:2] == ["fs", "store"])
            assert fs_store[2].endswith("/s") and fs_store[2] != "–"
            assert "fs" in [row[0] for row in _rows(app, "health")]
            assert any(row[1] == "fs" and row[3] != "–" for row in _rows(app, "latency"))
            assert _text(app, "metrics-banner") == "" and _text(app, "events-banner") == ""
            status = _text(app, "status")
            assert " connected:" in status and "not connected" not in status

            views = app.query_one("#views", TabbedContent)
            for key, view in (
                ("2", "latency"),
                ("3", "movements"),
                ("tab", "overview"),
                ("tab", "latency"),
                ("1", "overview"),
            ):
                await pilot.press(key)
                assert views.active == view
                if view == "movements":  # a log fills once it is on screen
                    await _until(
                        pilot,
                        lambda: app.query_one("#movements-log", RichLog).lines,
                        60,
                        "lines in the movements log",
                    )
                    assert {"device→host", "host→fs"} <= {row[0] for row in _rows(app, "routes")}

            await pilot.press("p")
            assert app.paused and "PAUSED" in _text(app, "status")
            frozen = _rows(app, "hits")
            await pilot.pause(1.5)
            assert _rows(app, "hits") == frozen
            await pilot.press("p")
            assert not app.paused

            # the host tier fills within seconds; from then on chunks come back from the fs tier
            await _until(
                pilot,
                lambda: any(
                    r.tier == "fs" and r.direction == "load" and r.total_bytes
                    for r in app.stats.throughput
                ),
                120,
                "loads from the fs tier",
            )
            await pilot.pause(1.0)
            app.save_screenshot(screenshot.name, str(screenshot.parent))

            proc.terminate()  # the engine goes away under the monitor (it finishes requests first)
            await _until(pilot, lambda: proc.poll() is not None, 60, "the end of the stress run")
            await _until_banner(pilot, app, "metrics")
            assert "last good scrape" in _text(app, "metrics-banner")
            await _until_banner(pilot, app, "events")
            assert dict(_rows(app, "host"))["capacity (slots)"] == host["capacity (slots)"]
            assert app.is_running
            await pilot.press("q")
        return app

    app = asyncio.run(drive())
    assert app.return_code == 0
    svg = screenshot.read_text()
    assert svg.startswith("<svg") and "kvoffload&#160;top" in svg
