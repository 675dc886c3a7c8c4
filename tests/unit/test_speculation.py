"""Which chunks of a request a worker-backed tier loads without a probe, and which wait for the
request's one probe (kvoffload.tiers.speculation): pure bookkeeping, no process."""

import pytest

from kvoffload.tiers.speculation import Speculation

SCOUT, NEXT, OTHER = b"scout", b"next", b"other"


def found(spec: Speculation, req: str = "r") -> Speculation:
    """``req`` probed its scout and the probe found it."""
    spec.probed(req, SCOUT)
    spec.answered(req, SCOUT, True)
    return spec


def test_after_the_scout_is_found_the_requests_unknown_chunks_are_expected():
    spec = Speculation(8)
    assert not spec.expects("r", NEXT)  # nothing found yet: probe it
    found(spec)
    assert spec.expects("r", NEXT) and spec.expects("r", OTHER)
    assert spec.expected_keys("r", [SCOUT, NEXT, OTHER, b"never"]) == {NEXT, OTHER}
    assert not spec.expects("someone else", NEXT)  # only within the request


def test_a_chunk_found_from_the_tiers_own_records_expects_nothing():
    """A HIT the tier answered from what it stored or counted says nothing about the unknown
    chunks after it: a new turn's tail, stored nowhere."""
    spec = Speculation(8)
    spec.answered("r", b"stored", True)
    assert not spec.expects("r", NEXT)
    spec.probed("r", SCOUT)
    spec.answered("r", b"stored", True)  # another known chunk, not the scout
    assert not spec.expects("r", NEXT)
    spec.answered("r", SCOUT, True)
    assert spec.expects("r", NEXT)


def test_while_the_scout_is_probed_the_other_unknown_chunks_wait_for_it():
    spec = Speculation(8)
    spec.probed("r", SCOUT)
    assert spec.defers("r", NEXT, probing={SCOUT})
    assert not spec.defers("r", SCOUT, probing={SCOUT})  # the scout itself asks its probe
    assert not spec.defers("r", NEXT, probing=set())  # answered: NEXT is probed now
    spec.probed("r", NEXT)  # ...and is the request's scout from then on
    assert spec.defers("r", OTHER, probing={NEXT})
    assert not spec.defers("someone else", NEXT, probing={SCOUT})


def test_the_open_scout_is_the_one_that_decided_nothing_yet():
    spec = Speculation(8)
    assert spec.open_scout("r") is None
    spec.probed("r", SCOUT)
    assert spec.open_scout("r") == SCOUT
    spec.answered("r", SCOUT, True)
    assert spec.open_scout("r") is None  # found
    spec.probed("r2", SCOUT)
    spec.answered("r2", b"absent", False)
    assert spec.open_scout("r2") is None  # missed


@pytest.mark.parametrize("how", ["miss_verdict", "failed_load"])
def test_after_a_miss_nothing_is_expected_or_deferred_again(how):
    spec = found(Speculation(8))
    assert spec.expects("r", NEXT)
    if how == "miss_verdict":
        spec.answered("r", NEXT, False)
    else:
        spec.load_failed("r")
    assert not spec.expects("r", OTHER) and not spec.expects("r", NEXT)
    spec.probed("r", OTHER)
    assert not spec.defers("r", b"more", probing={OTHER})
    spec.answered("r", OTHER, True)  # found now: too late, the request missed a chunk
    assert not spec.expects("r", b"more")


def test_a_miss_before_anything_was_found_also_stops_it():
    spec = Speculation(8)
    spec.answered("r", b"absent", False)
    spec.probed("r", SCOUT)
    assert not spec.defers("r", NEXT, probing={SCOUT})
    spec.answered("r", SCOUT, True)
    assert not spec.expects("r", NEXT)


def test_at_most_max_chunks_are_expected_per_request_each_counted_once():
    spec = found(Speculation(2))
    assert spec.expects("r", b"a") and spec.expects("r", b"b")
    assert spec.expects("r", b"a")  # asked again: the same expectation
    assert not spec.expects("r", b"c")  # past the cap: probed
    assert found(spec, "r2").expects("r2", b"c")  # per request


@pytest.mark.parametrize("max_chunks, req", [(0, "r"), (8, "")], ids=["max_chunks_0", "no_request"])
def test_off_or_for_a_lookup_naming_no_request_nothing_is_expected_deferred_or_kept(
    max_chunks, req
):
    spec = Speculation(max_chunks)
    spec.probed(req, SCOUT)
    assert not spec.defers(req, NEXT, probing={SCOUT})
    spec.answered(req, SCOUT, True)
    assert not spec.expects(req, NEXT)
    spec.answered(req, NEXT, False)
    assert len(spec) == 0


def test_a_finished_request_is_forgotten_and_at_most_max_requests_are_kept():
    spec = found(Speculation(8, max_requests=2))
    spec.finished("r")
    assert not spec.expects("r", NEXT) and len(spec) == 0
    for req in ("a", "b", "c"):
        found(spec, req)
    assert len(spec) == 2
    assert not spec.expects("a", NEXT)  # the first seen went first
    assert spec.expects("b", NEXT) and spec.expects("c", NEXT)


def test_bounds_below_their_minimum_are_refused():
    with pytest.raises(ValueError, match="max_chunks"):
        Speculation(-1)
    with pytest.raises(ValueError, match="max_requests"):
        Speculation(1, max_requests=0)
