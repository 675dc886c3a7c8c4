"""``kvoffload top``'s data model, in process, against numbers checked by hand and by Prometheus,
and the movement messages it decodes. The feed over a real ZMQ socket and the app, driven headless
against a live ``kvoffload stress`` run and against endpoints nobody listens on, are
tests/integration/test_top.py."""

from __future__ import annotations

import msgspec
import pytest

from kvoffload.tools.top.feed import decode_movements
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
