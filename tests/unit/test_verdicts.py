"""The verdict cache of worker-backed tiers (kvoffload.tiers.verdicts), on an injected clock: no
processes, no sleeps."""

import pytest

from kvoffload.tiers.verdicts import VerdictCache


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cache(max_entries: int = 100, **kw) -> tuple[VerdictCache, Clock]:
    clock = Clock()
    return VerdictCache(max_entries, timer=clock, **kw), clock


def test_an_unknown_key_waits_for_its_probe_and_the_waiters_are_owed_a_miss():
    v, _ = cache()
    assert v.lookup(b"k", "r1") is None and v.lookup(b"k", "r2") is None
    assert v.waiting == {b"k": {"r1", "r2"}}
    v.settle(b"k", False, ttl_s=0.0)  # a "not found" kept for no time at all (C36)
    assert not v.waiting and not v.is_absent(b"k")
    assert v.lookup(b"k", "r1") is False  # paid once...
    assert v.lookup(b"k", "r2") is False
    assert v.lookup(b"k", "r1") is None  # ...then the key is unknown again: probe again


def test_a_request_that_asked_without_waiting_for_the_probe_is_owed_nothing():
    """``verdict`` answers without making the request a waiter (it waits for another probe of
    its own request instead, kvoffload.tiers.speculation); ``wait`` makes it one."""
    v, _ = cache()
    assert v.verdict(b"k", "deferred") is None
    v.wait(b"k", "waiter")
    assert v.waiting == {b"k": {"waiter"}}
    v.settle(b"k", False, ttl_s=0.0)
    assert v.verdict(b"k", "deferred") is None  # not owed: asked again, it is probed
    assert v.verdict(b"k", "waiter") is False


def test_a_probe_that_finds_the_key_makes_it_present_and_owes_nothing():
    v, _ = cache()
    assert v.lookup(b"k", "r") is None
    v.settle(b"k", True)
    assert v.lookup(b"k", "r") is True and v.lookup(b"k", "other") is True
    assert not v.owed and not v.waiting


def test_absent_verdicts_expire_each_after_its_own_lifetime():
    v, clock = cache()
    v.mark_absent(b"short", 1.0)
    v.mark_absent(b"long", 60.0)
    assert v.lookup(b"short", "r") is False and v.lookup(b"long", "r") is False
    clock.now += 1.0
    assert v.lookup(b"short", "r") is None  # expired: unknown, a probe goes out
    assert v.lookup(b"long", "r") is False
    clock.now += 59.0
    assert v.lookup(b"long", "r") is None


def test_a_lifetime_of_zero_keeps_no_absent_verdict_but_drops_the_present_one():
    v, _ = cache()
    v.mark_present([b"k"])
    v.mark_absent(b"k", 0.0)
    assert not v.is_present(b"k") and not v.is_absent(b"k")


def test_present_and_absent_replace_each_other():
    v, _ = cache()
    v.mark_absent(b"k", 30.0)
    v.mark_present([b"k"])
    assert v.lookup(b"k", "r") is True and not v.is_absent(b"k")
    v.mark_absent(b"k", 30.0)
    assert v.lookup(b"k", "r") is False and not v.is_present(b"k")
    v.mark_present([b"k"])
    v.forget(b"k")  # evicted
    assert v.lookup(b"k", "r") is None


def test_owed_misses_are_per_request_and_survive_a_present_verdict_expiring():
    v, _ = cache()
    v.owe_miss(b"k", ["r1"])  # r1's load of k failed
    v.owe_miss(b"k", ["r2"])
    assert v.lookup(b"k", "r3") is None  # not owed to r3
    assert v.lookup(b"k", "r1") is False
    assert v.owed[b"k"] == {"r2"}
    assert v.lookup(b"k", "r2") is False
    assert b"k" not in v.owed


def test_a_full_absent_cache_forgets_one_verdict_per_new_one_never_all():
    v, clock = cache(max_entries=3)
    for i, ttl in enumerate((10.0, 20.0, 30.0)):
        v.mark_absent(bytes([i]), ttl)
    v.mark_absent(b"new", 40.0)
    assert len(v.absent) == 3
    assert not v.is_absent(bytes([0]))  # the one that expires soonest went
    assert all(v.is_absent(k) for k in (bytes([1]), bytes([2]), b"new"))
    clock.now += 20.0  # expired verdicts go first, without pushing out live ones
    v.mark_absent(b"newer", 40.0)
    assert v.is_absent(b"new") and v.is_absent(b"newer") and v.is_absent(bytes([2]))


def test_a_full_present_cache_drops_the_least_recently_used():
    v, _ = cache(max_entries=3)
    v.mark_present([b"a", b"b", b"c"])
    v.touch([b"a", b"unknown"])  # a is used: b is now the least recently used
    v.mark_present([b"d"])
    assert [k for k in (b"a", b"b", b"c", b"d") if v.is_present(k)] == [b"a", b"c", b"d"]
    assert not v.is_present(b"unknown")


def test_owed_misses_are_bounded_oldest_first():
    v, _ = cache(owed_max=2)
    for k in (b"1", b"2", b"3"):
        v.owe_miss(k, ["r"])
    assert list(v.owed) == [b"2", b"3"]


@pytest.mark.parametrize("kw", [{"max_entries": 0}, {"max_entries": 5, "owed_max": 0}])
def test_bounds_below_one_are_refused(kw):
    with pytest.raises(ValueError, match="at least 1"):
        VerdictCache(**kw)
