"""The engine process's thread switch interval while p2p tiers run (``engine_switch_interval_s``,
:class:`kvoffload.tiers.p2p.node.SwitchInterval`): lowered to the lowest held, never raised above
the process's own, given back when the last tier lets go, and someone else's setting kept."""

import sys

import pytest

from kvoffload.tiers.p2p.node import SwitchInterval


@pytest.fixture
def interval():
    """The process's interval is 5 ms (CPython's default) during the test, and put back after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def now() -> float:
    return sys.getswitchinterval()


def test_the_lowest_held_interval_wins_and_the_last_release_gives_the_processs_back(interval):
    si = SwitchInterval()
    si.hold(0.0005)
    assert now() == pytest.approx(0.0005)
    si.hold(0.0002)  # a second tier asking lower
    assert now() == pytest.approx(0.0002)
    si.hold(0.001)  # a third asking higher changes nothing
    assert now() == pytest.approx(0.0002)
    si.release(0.0002)
    assert now() == pytest.approx(0.0005)
    si.release(0.0005)
    assert now() == pytest.approx(0.001)
    si.release(0.001)
    assert now() == pytest.approx(0.005)


def test_a_process_that_runs_lower_already_keeps_its_own(interval):
    sys.setswitchinterval(0.0001)
    si = SwitchInterval()
    si.hold(0.0005)
    assert now() == pytest.approx(0.0001)
    si.release(0.0005)
    assert now() == pytest.approx(0.0001)


def test_a_setting_made_by_someone_else_while_held_is_kept_and_given_back_to(interval):
    si = SwitchInterval()
    si.hold(0.0005)
    sys.setswitchinterval(0.002)  # the host changed it meanwhile
    si.hold(0.0004)  # a later tier still lowers it...
    assert now() == pytest.approx(0.0004)
    si.release(0.0004)
    si.release(0.0005)
    assert now() == pytest.approx(0.002)  # ...and the end gives back the host's, not 5 ms


def test_releasing_what_was_never_held_raises(interval):
    si = SwitchInterval()
    with pytest.raises(ValueError):
        si.release(0.0005)
    assert now() == pytest.approx(0.005)


def test_a_setting_made_by_someone_else_is_given_back_even_when_nothing_was_lowered(interval):
    """A process already below the held interval: nothing is set; a change the host makes while
    it is held is still the one given back (not the value from before the hold)."""
    sys.setswitchinterval(0.0001)
    si = SwitchInterval()
    si.hold(0.0005)
    sys.setswitchinterval(0.002)
    si.release(0.0005)
    assert now() == pytest.approx(0.002)


def test_hold_and_release_cycles_give_back_the_interval_to_the_microsecond(interval):
    """CPython keeps the interval in whole µs, truncating: reading it back and setting it again
    must not creep down a µs a cycle."""
    for start in (0.0002, 0.003, 0.005):
        sys.setswitchinterval(start)
        want = round(sys.getswitchinterval() * 1e6)
        si = SwitchInterval()
        for lower in (0.0001, 0.0003, 0.0007) * 5:
            si.hold(lower)
            assert round(now() * 1e6) == min(want, round(lower * 1e6))
            si.release(lower)
            assert round(now() * 1e6) == want
