"""The cost estimates and decisions of "never slower than recompute" (kvoffload.costs): pure
functions, no clock."""

import pytest

from kvoffload.costs import RateEstimate, TierLoadCost, load_beats_recompute, promotion_deadline


def test_a_rate_is_unknown_until_observed_and_then_the_first_sample():
    r = RateEstimate()
    assert r.rate is None and r.seconds_for(100) is None
    r.observe(1000, 2.0)
    assert r.rate == 500.0
    assert r.seconds_for(100) == pytest.approx(0.2)


def test_a_rate_weighs_samples_by_size_and_follows_the_newest():
    r = RateEstimate(smoothing=0.5)
    r.observe(1000, 1.0)  # 1000/s
    r.observe(10, 1.0)  # a tiny slow sample: 10/s
    # (1000 + 0.5 * (10 - 1000)) / (1 + 0.5 * 0) = 505/s: the big sample still counts half
    assert r.rate == pytest.approx(505.0)
    for _ in range(40):
        r.observe(10, 1.0)
    assert r.rate == pytest.approx(10.0, rel=1e-6)


def test_empty_samples_say_nothing():
    r = RateEstimate()
    r.observe(0, 1.0)
    r.observe(100, 0.0)
    assert r.rate is None and r.samples == 0


def test_a_configured_rate_replaces_every_observation():
    r = RateEstimate(fixed=42.0)
    assert r.rate == 42.0
    r.observe(1e9, 1.0)
    assert r.rate == 42.0


def test_smoothing_out_of_range_is_refused():
    with pytest.raises(ValueError, match="smoothing"):
        RateEstimate(smoothing=0.0)


def test_a_tier_uses_its_stores_until_its_first_load():
    c = TierLoadCost()
    assert c.bytes_per_s is None and c.expected_s(100) is None
    c.stores.observe(1000, 1.0)
    assert c.bytes_per_s == 1000.0
    c.loads.observe(100, 1.0)
    assert c.bytes_per_s == 100.0  # loads, once there are any


def test_a_load_waits_behind_what_the_tier_has_outstanding_and_queued():
    c = TierLoadCost()
    c.loads.observe(1000, 1.0)
    assert c.expected_s(500) == pytest.approx(0.5)
    c.outstanding_bytes = 1500
    assert c.expected_s(500) == pytest.approx(2.0)
    assert c.expected_s(500, queued_bytes=1000) == pytest.approx(3.0)


def test_a_load_is_expected_to_take_at_least_a_jobs_usual_time():
    c = TierLoadCost(smoothing=0.5)
    for t0, nbytes in ((0.0, 1000), (10.0, 100_000)):  # each alone on an idle tier, 1 s each
        alone = c.started(nbytes, t0)
        assert alone
        c.ended(nbytes, t0 + 1.0, nbytes, 1.0, alone)
    assert c.job_seconds == pytest.approx(1.0)  # its fixed cost, not its bytes
    assert c.expected_s(10) == pytest.approx(1.0)  # a tiny load: the job's usual time
    big = c.expected_s(1_000_000)
    assert big == pytest.approx(1_000_000 / c.bytes_per_s) and big > 1.0


def test_overlapping_jobs_measure_the_tiers_throughput_not_each_jobs_wait():
    """Ten 1 MB jobs submitted together to a tier that moves 1 MB per 10 ms: the last ends after
    100 ms, so each job's own rate is 10-100 MB/s; the tier's is 100 MB/s, and a job queued
    behind them is expected to take what the tier needs for them and it, not ten times that.
    (Before, the per-job rate with the queue added on top judged a busy fs tier slower than
    recomputing and it stopped serving: BENCHMARKS 6c.)"""
    c = TierLoadCost()
    mb = 1_000_000
    flags = [c.started(mb, 0.0) for _ in range(10)]
    assert flags == [True] + [False] * 9  # only the first found the tier idle
    for i in range(10):
        c.ended(mb, 0.01 * (i + 1), mb, 0.01 * (i + 1), flags[i])
    assert c.bytes_per_s == pytest.approx(100 * mb)
    assert c.job_seconds == pytest.approx(0.01)  # the job that ran alone: no queue in it
    c.started(9 * mb, 1.0)  # nine more in flight
    assert c.expected_s(mb) == pytest.approx(0.1)


def test_completions_seen_at_one_instant_and_idle_gaps_keep_the_rate_true():
    c = TierLoadCost(smoothing=1.0)  # the newest sample alone
    mb = 1_000_000
    for _ in range(4):
        c.started(mb, 0.0)
    c.ended(mb, 0.04, mb)  # four jobs' results read in the same poll, 40 ms after
    c.ended(mb, 0.04, mb)
    c.ended(mb, 0.04, mb)
    assert c.bytes_per_s == pytest.approx(25 * mb)  # the first: 1 MB in 40 ms
    c.ended(mb, 0.05, mb)  # the other two carried into the next interval: 3 MB in 10 ms
    assert c.bytes_per_s == pytest.approx(300 * mb)
    assert c.outstanding_bytes == 0
    # an idle minute is not the tier's time: the next job's interval starts at its submission
    c.started(mb, 60.0)
    c.ended(mb, 60.01, mb)
    assert c.bytes_per_s == pytest.approx(100 * mb)


def test_a_job_that_says_nothing_of_speed_leaves_the_rate_but_not_the_outstanding_bytes():
    c = TierLoadCost(smoothing=1.0)
    c.started(100, 0.0)
    c.ended(100, 0.01, 100)
    rate = c.bytes_per_s
    c.started(100, 1.0)
    c.ended(100, 5.0)  # failed fast or forgotten after a reset: no sample
    assert c.bytes_per_s == rate and c.outstanding_bytes == 0


@pytest.mark.parametrize(
    ("load_s", "recompute_s", "margin", "served"),
    [
        (None, 1.0, 1.5, True),  # tier not measured yet: as before
        (5.0, None, 1.5, True),  # prefill not measured yet: as before
        (0.01, 1.0, 1.5, True),  # a healthy tier
        (1.5, 1.0, 1.5, True),  # at the margin: still served
        (1.6, 1.0, 1.5, False),  # past it: recomputed
        (1.1, 1.0, 1.0, False),
    ],
)
def test_a_load_is_served_unless_expected_slower_than_recompute_by_the_margin(
    load_s, recompute_s, margin, served
):
    assert load_beats_recompute(load_s, recompute_s, margin) is served


def test_a_promotion_overruns_a_multiple_of_its_expected_load_or_of_the_recompute_if_sooner():
    assert promotion_deadline(100.0, 0.5, 20.0, 3.0, 1.5) == pytest.approx(101.5)  # 3 x load
    assert promotion_deadline(100.0, 4.0, 2.0, 3.0, 1.5) == pytest.approx(103.0)  # 1.5 x recompute
    assert promotion_deadline(100.0, None, 2.0, 3.0, 1.5) is None
    assert promotion_deadline(100.0, 1.0, None, 3.0, 1.5) is None
