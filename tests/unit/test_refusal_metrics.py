"""Nothing silent, in process: the circuit breaker's three states and its half-open trials, on a
fake clock (no processes, no sleeps); the rate-limited log's one line per reason per interval; and
``kvoffload top``'s rows of the breakers, refusals and eviction errors derived from an exposition.
The labelled metrics of a real manager with real workers and its real ``/metrics`` endpoint are
tests/integration/test_refusal_metrics.py.
"""

from __future__ import annotations

import logging

import pytest

from kvoffload.ipc.ratelimit import RateLimitedLog
from kvoffload.tiers.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvoffload.tools.top.model import derive, parse_exposition


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- the breaker alone ----------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_only():
    clock = FakeClock()
    br = CircuitBreaker(failures=3, cooldown_s=5.0, clock=clock)
    assert br.state == CLOSED and br.admit()
    assert br.record(False, clock()) is None
    assert br.record(False, clock()) is None
    assert br.record(True, clock()) is None  # a success resets the count
    assert br.record(False, clock()) is None and br.record(False, clock()) is None
    assert br.state == CLOSED and br.consecutive_failures == 2
    assert br.record(False, clock()) == "opened"
    assert br.state == OPEN and br.opens == 1
    assert not br.admit() and not br.admit()
    assert br.record(False, clock()) is None  # tasks in flight failing late: no second opening
    assert br.opens == 1 and br.reopens_at == clock() + 5.0


def test_half_open_admits_only_the_trial_requests_until_one_answers():
    clock = FakeClock()
    br = CircuitBreaker(failures=1, cooldown_s=5.0, trial_requests=2, clock=clock)
    br.record(False, clock())
    clock.t += 4.9
    assert br.state == OPEN and not br.admit()
    clock.t += 0.1
    assert br.state == HALF_OPEN
    assert [br.admit() for _ in range(5)] == [True, True, False, False, False]
    assert br.trials_in_flight == 2
    sent = clock()
    clock.t += 1.0
    assert br.record(True, sent) == "closed"
    assert br.state == CLOSED and br.closes == 1 and br.trials_in_flight == 0
    assert all(br.admit() for _ in range(100))


def cooldowns_of_failed_trials(br: CircuitBreaker, clock: FakeClock, trials: int) -> list[float]:
    """Open ``br``, then fail ``trials`` trials, each as soon as the cooldown allows one: the
    cooldown of each opening (seconds)."""
    br.record(False, clock())
    cooldowns = []
    for _ in range(trials):
        opened_at = clock()
        cooldowns.append(br.reopens_at - opened_at)
        clock.t = br.reopens_at
        assert br.state == HALF_OPEN and br.admit() and not br.admit()
        assert br.record(False, clock()) == "opened"
        assert br.state == OPEN
    return cooldowns


def test_a_failed_trial_reopens_with_a_doubled_cooldown_up_to_max_cooldown_s():
    clock = FakeClock()
    br = CircuitBreaker(
        failures=1, cooldown_s=1.0, trial_requests=1, max_cooldown_s=16.0, clock=clock
    )
    assert cooldowns_of_failed_trials(br, clock, 7) == [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    clock.t = br.reopens_at
    assert br.admit() and br.record(True, clock()) == "closed"
    br.record(False, clock())  # closed again: the back-off starts over
    assert br.reopens_at - clock() == 1.0


def test_c51_the_cooldown_never_exceeds_max_cooldown_s_so_recovery_is_bounded():
    """However many trials fail, no cooldown is longer than ``max_cooldown_s`` (not a power of
    two of the first here), nor 4 times the first cooldown without it; equal to the first: no
    back-off. The endpoint recovering at any moment of the outage is tried again within
    ``max_cooldown_s``, and the first trial that answers closes the breaker."""
    clock = FakeClock()
    br = CircuitBreaker(
        failures=1, cooldown_s=0.25, trial_requests=1, max_cooldown_s=0.6, clock=clock
    )
    assert cooldowns_of_failed_trials(br, clock, 6) == pytest.approx([0.25, 0.5] + [0.6] * 4)
    recovered_at = clock()  # just after the last reopening: the longest wait there is
    assert br.reopens_at - recovered_at == pytest.approx(0.6)
    clock.t = br.reopens_at
    assert br.state == HALF_OPEN
    assert br.admit() and br.record(True, clock()) == "closed"
    for cap, first, expected in ((None, 1.0, [1.0, 2.0, 4.0, 4.0]), (2.0, 2.0, [2.0] * 4)):
        clock = FakeClock()
        br = CircuitBreaker(
            failures=1, cooldown_s=first, trial_requests=1, max_cooldown_s=cap, clock=clock
        )
        assert cooldowns_of_failed_trials(br, clock, 4) == pytest.approx(expected)


def test_late_failures_of_tasks_sent_before_the_cooldown_ended_do_not_reopen():
    clock = FakeClock()
    br = CircuitBreaker(failures=1, cooldown_s=5.0, trial_requests=1, clock=clock)
    sent_before = clock()
    br.record(False, sent_before)
    clock.t += 6.0
    assert br.state == HALF_OPEN
    assert br.record(False, sent_before) is None  # sent while closed, answered late
    assert br.state == HALF_OPEN and br.admit()
    assert br.record(False, clock()) == "opened"  # the trial failed


def test_a_trial_that_never_answers_gives_its_place_back_after_the_trial_timeout():
    clock = FakeClock()
    br = CircuitBreaker(
        failures=1, cooldown_s=5.0, trial_requests=1, trial_timeout_s=30.0, clock=clock
    )
    br.record(False, clock())
    clock.t += 5.0
    assert br.admit()  # e.g. a lookup HIT whose promotion found no host slot: no task is sent
    clock.t += 29.0
    assert not br.admit()
    clock.t += 1.0
    assert br.trials_in_flight == 0 and br.admit()
    br.release()  # e.g. a store of chunks the tier already holds: nothing was sent
    assert br.admit() and not br.admit()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(failures=0, cooldown_s=1.0),
        dict(failures=1, cooldown_s=0.0),
        dict(failures=1, cooldown_s=1.0, trial_requests=0),
        dict(failures=1, cooldown_s=1.0, trial_timeout_s=-1.0),
        dict(failures=1, cooldown_s=1.0, max_cooldown_s=0.5),
        dict(failures=1, cooldown_s=1.0, max_cooldown_s=float("nan")),
    ],
)
def test_breaker_refuses_settings_that_cannot_work(kwargs):
    with pytest.raises(ValueError, match="must be"):
        CircuitBreaker(**kwargs)


def test_rate_limited_log_writes_one_line_per_reason_per_interval(caplog):
    clock = FakeClock()
    rl = RateLimitedLog(logging.getLogger("kvoffload.test"), interval_s=60.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="kvoffload.test"):
        assert rl.log(logging.WARNING, "a", "refused %d", 1)
        assert not rl.log(logging.WARNING, "a", "refused %d", 2)
        assert not rl.log(logging.WARNING, "a", "refused %d", 3)
        assert rl.log(logging.WARNING, "b", "dropped %d", 4)  # another reason has its own budget
        clock.t += 60.0
        assert rl.log(logging.WARNING, "a", "refused %d", 5)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 1",
        "dropped 4",
        "refused 5 (2 more since the last such line, not logged)",
    ]


# -- kvoffload top --------------------------------------------------------------------------------


TOP_EXPOSITION = (
    "\n".join(
        [
            "# TYPE kvoffload_tier_workers_alive gauge",
            'kvoffload_tier_workers_alive{instance="a",tier="fs"} 2',
            'kvoffload_tier_workers_alive{instance="b",tier="fs"} 2',
            'kvoffload_tier_workers_alive{instance="a",tier="obj"} 2',
            "# TYPE kvoffload_tier_breaker_state gauge",
            *(
                f'kvoffload_tier_breaker_state{{instance="{i}",tier="{t}",state="{s}"}} {v}'
                for i, t, states in (
                    ("a", "fs", (1, 0, 0)),
                    ("b", "fs", (0, 0, 1)),
                    ("a", "obj", (0, 1, 0)),
                )
                for s, v in zip(("closed", "open", "half_open"), states)
            ),
            "# TYPE kvoffload_refused_chunks counter",
            'kvoffload_refused_chunks_total{instance="a",tier="host",direction="store",'
            'reason="no_evictable_slot"} 7',
            'kvoffload_refused_chunks_total{instance="b",tier="host",direction="store",'
            'reason="no_evictable_slot"} 3',
            'kvoffload_refused_chunks_total{instance="a",tier="fs",direction="store",reason="pin_limit"} 0',
            'kvoffload_refused_chunks_total{instance="a",tier="obj",direction="store",'
            'reason="breaker_open"} 12',
            "# TYPE kvoffload_tier_eviction_errors counter",
            'kvoffload_tier_eviction_errors_total{instance="a",tier="fs",errno="EACCES"} 2',
        ]
    )
    + "\n"
)


def test_top_derives_breaker_states_refusals_and_eviction_errors():
    before = parse_exposition(TOP_EXPOSITION.replace("} 12", "} 2"), t=10.0, wall=0.0)
    now = parse_exposition(TOP_EXPOSITION, t=12.0, wall=2.0)
    s = derive(now, before)
    # fs: one manager closed, the other half-open -> the worse; obj: open
    assert {h.tier: h.breaker for h in s.health} == {"fs": "half_open", "obj": "open"}
    rows = [(r.tier, r.what, r.reason, r.total, r.per_s) for r in s.refusals]
    assert rows == [
        ("host", "store", "no_evictable_slot", 10, 0.0),
        ("fs", "eviction", "EACCES", 2, 0.0),
        ("obj", "store", "breaker_open", 12, 5.0),
    ]  # zero series are not shown
    assert derive(now).refusals[-1].per_s is None  # one scrape: no rate yet
