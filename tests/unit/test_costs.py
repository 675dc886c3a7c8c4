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
        c.ended(nbytes, nbytes, 1.0, alone)
        c.sample(t0 + 1.0)
    assert c.job_seconds == pytest.approx(1.0)  # its fixed cost, not its bytes
    assert c.expected_s(10) == pytest.approx(1.0)  # a tiny load: the job's usual time
    big = c.expected_s(1_000_000)
    assert big == pytest.approx(1_000_000 / c.bytes_per_s) and big > 1.0


MB = 1_000_000


def test_overlapping_jobs_measure_the_tiers_throughput_not_each_jobs_wait():
    """Ten 1 MB jobs submitted together to a tier that moves 1 MB per 10 ms, each result read by
    its own poll: the last ends after 100 ms, so each job's own rate is 10-100 MB/s; the tier's
    is 100 MB/s, and a job queued behind nine more in flight is expected to take what the tier
    needs for them and it. (Before, the per-job rate with the queue added on top judged a busy
    fs tier slower than recomputing and it stopped serving: BENCHMARKS 6.)"""
    c = TierLoadCost()
    flags = [c.started(MB, 0.0) for _ in range(10)]
    assert flags == [True] + [False] * 9  # only the first found the tier idle
    for i in range(10):
        c.ended(MB, MB, 0.01 * (i + 1), flags[i])
        c.sample(0.01 * (i + 1))
    assert c.bytes_per_s == pytest.approx(100 * MB)
    assert c.job_seconds == pytest.approx(0.01)  # the job that ran alone: no queue in it
    c.started(9 * MB, 1.0)  # nine more in flight
    assert c.expected_s(MB) == pytest.approx(0.1)


def test_results_read_in_one_poll_are_one_sample_and_idle_time_is_never_charged():
    c = TierLoadCost(smoothing=1.0)  # the newest sample alone
    for _ in range(4):
        c.started(MB, 0.0)
    for _ in range(4):  # four jobs' results read in the same poll, 40 ms after
        c.ended(MB, MB)
    c.sample(0.04)
    assert c.bytes_per_s == pytest.approx(100 * MB)  # 4 MB in 40 ms
    assert c.outstanding_bytes == 0
    c.sample(30.0)  # a poll that read nothing: no sample, the interval is not moved
    assert c.bytes_per_s == pytest.approx(100 * MB)
    # an idle minute is not the tier's time: the next job's interval starts at its submission
    c.started(MB, 60.0)
    c.ended(MB, MB)
    c.sample(60.02)
    assert c.bytes_per_s == pytest.approx(50 * MB)


def test_a_load_that_timed_out_is_a_sample_of_its_own_time():
    """Ten jobs time out together after 10 s while others keep finishing: each timeout is its
    bytes over its own 10 s, never over the moment since the last result."""
    c = TierLoadCost(smoothing=1.0)
    for _ in range(2):
        c.started(MB, 0.0)
    c.ended(MB, MB, 10.0, timed_out=True)
    c.sample(10.0)
    assert c.bytes_per_s == pytest.approx(0.1 * MB)
    c.ended(MB, MB, 0.01)  # a fast one read in the same poll as the timeout
    c.sample(10.0)
    assert c.bytes_per_s == pytest.approx(0.1 * MB)  # the timeout's sample stands
    assert c.outstanding_bytes == 0


def test_a_job_that_says_nothing_of_speed_leaves_the_rate_but_not_the_outstanding_bytes():
    c = TierLoadCost(smoothing=1.0)
    c.started(100, 0.0)
    c.ended(100, 100)
    c.sample(0.01)
    rate = c.bytes_per_s
    c.started(100, 1.0)
    c.ended(100)  # failed fast or forgotten after a reset: no sample
    c.sample(5.0)
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


def test_the_tiers_own_end_times_make_a_tier_fed_one_job_per_step_as_fast_as_it_is():
    """One 1 MB job per scheduler step of 1 s, each done 10 ms after its submission: read at the
    next step, the tier would look like 1 MB/s; by the end times its workers report it moves 100
    MB/s. A batch in which one result does not say when it ended falls back to the reading."""
    c = TierLoadCost(smoothing=1.0)
    for step in range(5):
        t = float(step)
        c.started(MB, t)
        c.ended(MB, MB, 0.01, done_at=t + 0.01)
        c.sample(t + 1.0)  # read at the next step
        assert c.bytes_per_s == pytest.approx(100 * MB)
    c.started(MB, 10.0)
    c.started(MB, 10.0)
    c.ended(MB, MB, done_at=10.01)
    c.ended(MB, MB)  # did not say
    c.sample(10.04)
    assert c.bytes_per_s == pytest.approx(50 * MB)  # 2 MB up to the reading, 40 ms
    c.started(MB, 20.0)
    c.ended(MB, MB, done_at=99.0)  # a claim past the reading is bounded by it
    c.sample(20.02)
    assert c.bytes_per_s == pytest.approx(50 * MB)
