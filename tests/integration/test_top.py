"""``kvoffload top``: the movement feed over a real ZMQ socket; the app, driven headless, against a
live ``kvoffload stress`` run and against endpoints nobody listens on. The data model, against
numbers checked by hand and by Prometheus, is tests/unit/test_top.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from textual.widgets import DataTable, RichLog, Static, TabbedContent
from unit.test_top import TOPIC, _movements_payload

from kvoffload.tools.ports import free_port
from kvoffload.tools.top.app import TopApp, fmt_bytes, fmt_num
from kvoffload.tools.top.feed import MovementFeed, fetch_snapshot

# -- the movement feed ------------------------------------------------------------------------


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
        # probes sent before the feed joined may still be on their way: a last one of another
        # route marks the end (ZMQ keeps one connection's messages in order)
        pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), _movements_payload("host", "fs")])
        deadline = time.monotonic() + 30
        while not any(m.route == "host→fs" for m in feed.poll()):
            assert time.monotonic() < deadline, "the last probe never came"
            time.sleep(0.05)
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
