"""Capacity accounting of worker-backed tiers (kvoffload.tiers.capacity) on its own: no processes, no
files, an injected clock. The same ledger runs under real workers in tests/integration/:
test_fs_tier.py, test_fs_capacity.py (fs) and test_obj_tier.py (obj with max_bytes)."""

import errno

import pytest

from kvoffload.ipc import messages as m
from kvoffload.tiers.capacity import RETRY_FIRST_S, RETRY_MAX_S, Capacity

U = 100  # bytes of one stored chunk


class Ledger:
    """A Capacity with its counters, forgotten keys and clock in view."""

    def __init__(self, max_bytes: int | None = 3 * U):
        self.counters: dict[str, float] = {}
        self.forgotten: list[bytes] = []
        self.now = 10.0
        self.cap = Capacity(
            max_bytes,
            U,
            count=lambda name, n: self.counters.__setitem__(name, self.counters.get(name, 0) + n),
            forget=self.forgotten.append,
            clock=lambda: self.now,
        )

    def store(self, *keys: bytes, request: str = "") -> None:
        """Admit and finish a successful store of ``keys``, each its own job (used one after the
        other, as by separate requests) unless ``request`` names the request of one job."""
        for batch in [list(keys)] if request else [[k] for k in keys]:
            admitted, rejected = self.cap.admit(batch)
            assert not rejected and admitted == list(range(len(batch)))
            assert self.cap.stores_done(batch, {}, request=request) == ([], 0)


def test_stores_are_counted_and_the_least_recently_used_are_evicted_for_room():
    led = Ledger()
    cap = led.cap
    led.store(b"a", b"b", b"c")
    assert cap.used_bytes == 3 * U and cap.eviction_order() == [b"a", b"b", b"c"]
    cap.loads_started([b"a"])
    cap.loads_done([b"a"], {})  # a was read: now the most recently used
    led.store(b"d")
    assert cap.eviction_order() == [b"c", b"a", b"d"] and cap.used_bytes == 3 * U
    assert led.forgotten == [b"b"] and led.counters["evictions"] == 1
    assert cap.take_deletes() == [b"b"] and cap.deleting == {b"b": 1}
    assert cap.unconfirmed_bytes == U  # still stored until the delete answers
    assert cap.deletes_answered([b"b"], [m.OK], []) == []
    assert cap.unconfirmed_bytes == 0 and not cap.deleting


def test_chunks_loading_and_keys_of_the_store_are_never_evicted():
    led = Ledger(max_bytes=2 * U)
    cap = led.cap
    led.store(b"a", b"b")
    cap.loads_started([b"a"])
    admitted, rejected = cap.admit([b"b", b"c"])  # b is part of this store, a is loading
    assert admitted == [0] and rejected == {b"c": m.NO_SPACE}
    assert led.counters["store_refused_no_room"] == 1 and not led.forgotten
    assert cap.stores_done([b"b", b"c"], {b"c": m.NO_SPACE}) == ([], 0)  # refused, never written
    cap.loads_done([b"a"], {})  # a was read after b was stored again: b is the LRU now
    admitted, rejected = cap.admit([b"c"])
    assert admitted == [0] and not rejected and led.forgotten == [b"b"]


def test_a_store_of_a_chunk_whose_delete_is_pending_is_refused():
    led = Ledger(max_bytes=U)
    cap = led.cap
    led.store(b"a")
    led.store(b"b")  # evicts a
    cap.take_deletes()
    admitted, rejected = cap.admit([b"a"])
    assert admitted == [] and rejected == {b"a": m.REJECTED}
    assert led.counters["store_skipped_deleting"] == 1
    assert cap.stores_done([b"a"], {b"a": m.REJECTED}) == ([], 0)
    assert not cap.refused


def test_c32_a_failed_removal_keeps_the_chunk_counted_and_space_is_reused_only_once_confirmed():
    led = Ledger()
    cap = led.cap
    led.store(b"a", b"b", b"c")
    led.store(b"d")  # evicts a
    cap.take_deletes()
    kept = cap.deletes_answered([b"a"], [m.IO_ERROR], [errno.EPERM])
    assert kept == [b"a"] and not cap.retry_at
    assert cap.eviction_order()[-1] == b"a" and cap.used_bytes == 4 * U  # over the cap, counted
    assert led.counters["eviction_errors.EPERM"] == 1 and cap.undeletable == {b"a"}
    assert cap.cautious() and "could not be removed" in cap.why_no_room()
    cap.enforce()  # back under the cap, never retrying the failed removal in a loop
    assert cap.used_bytes == 3 * U and cap.take_deletes() == [b"b"]
    admitted, rejected = cap.admit([b"e"])  # b's removal not confirmed: no room yet
    assert rejected == {b"e": m.NO_SPACE} and cap.headroom == U
    cap.stores_done([b"e"], rejected)
    cap.deletes_answered([b"b"], [m.OK], [])
    cap.enforce()
    cap.deletes_answered(cap.take_deletes(), [m.OK], [])  # the headroom evicted ahead
    admitted, rejected = cap.admit([b"e"])
    assert admitted == [0] and not rejected


def test_a_delete_with_no_answer_is_asked_again_after_a_growing_wait_until_one_answers():
    """No answer says nothing about whether the chunk is gone: it stays in flight and unconfirmed
    (never counted, never forgotten) and is sent again after 0.05 s, 0.1 s, ... up to 5 s, for as
    long as it takes (a soak met ten unanswered tries in a row when retries were bounded)."""
    led = Ledger(max_bytes=U)
    cap = led.cap
    led.store(b"a")
    led.store(b"b")  # evicts a
    keys = cap.take_deletes()
    assert keys == [b"a"]
    waits = []
    for i in range(12):
        assert (
            cap.deletes_answered(keys, [(m.WORKER_DIED, m.TIMEOUT, m.BAD_REPLY)[i % 3]], []) == []
        )
        assert cap.deleting == {b"a": 1} and cap.unconfirmed_bytes == U and b"a" not in cap.index
        assert cap.due_retries() == []  # not before its wait is over
        waits.append(cap.retry_at[b"a"] - led.now)
        led.now = cap.retry_at[b"a"]
        assert cap.due_retries() == [b"a"] and not cap.retry_at
    assert waits[:3] == pytest.approx([RETRY_FIRST_S, 2 * RETRY_FIRST_S, 4 * RETRY_FIRST_S])
    assert waits == sorted(waits) and waits[-1] == RETRY_MAX_S
    assert led.counters["delete_retries"] == 12
    assert cap.deletes_answered(keys, [m.OK], []) == []
    assert not cap.deleting and cap.unconfirmed_bytes == 0 and not cap.delete_retries
    assert cap.used_bytes == U and list(cap.index) == [b"b"]
    assert not any(k.startswith("eviction_errors") for k in led.counters)


def test_a_write_that_failed_after_a_worker_had_it_is_removed_as_unconfirmed():
    led = Ledger()
    cap = led.cap
    admitted, _ = cap.admit([b"a", b"b"])
    unconfirmed, full = cap.stores_done([b"a", b"b"], {b"a": m.WORKER_DIED})
    assert unconfirmed == [b"a"] and full == 0 and list(cap.index) == [b"b"]
    cap.unconfirmed_stores(unconfirmed)
    assert cap.deleting == {b"a": 1} and cap.unconfirmed_bytes == U
    assert cap.removed_since(b"a", led.now) and not cap.removed_since(b"b", 0.0)
    assert led.counters["unconfirmed_store_removals"] == 1


def test_removals_since_tell_a_probe_that_raced_an_eviction():
    led = Ledger(max_bytes=U)
    cap = led.cap
    led.store(b"a")
    t_probe = led.now
    led.now += 1.0
    led.store(b"b")  # evicts a after the probe was sent
    assert cap.removed_since(b"a", t_probe) and cap.removals_since(t_probe)
    cap.deletes_answered(cap.take_deletes(), [m.OK], [])
    assert cap.removed_since(b"a", t_probe) and not cap.removed_since(b"a", led.now + 1)
    assert not cap.removals_since(led.now + 1)


def test_c33_a_full_medium_lowers_the_cap_until_a_sample_shows_room():
    led = Ledger(max_bytes=10 * U)
    cap = led.cap
    led.store(b"a", b"b", b"c", b"d")
    cap.admit([b"e"])
    assert cap.stores_done([b"e"], {b"e": m.NO_SPACE}) == ([], 1)
    assert cap.lower_cap(1) == 4 * U and cap.capacity_bytes == 4 * U and cap.cautious()
    cap.enforce()  # evicts ahead for the chunk that did not fit
    assert cap.used_bytes == 3 * U and cap.take_deletes() == [b"a"]
    assert not cap.raise_cap(2 * U) and cap.capacity_bytes == 5 * U
    assert not cap.raise_cap(0)  # a sample never lowers it
    assert cap.capacity_bytes == 5 * U
    assert cap.raise_cap(100 * U) and cap.capacity_bytes == 10 * U and cap.lowered_cap is None


def test_c52_a_short_medium_frees_only_its_shortage_never_more_than_the_failed_stores():
    """Three chunks failed on a medium with room for 1.5 of them: the cap is what it holds plus
    that room, and two chunks are evicted (the shortage, rounded up to whole chunks), not three;
    five failed chunks on a ledger of six evict no more than three (half of what it holds)."""
    led = Ledger(max_bytes=20 * U)
    cap = led.cap
    led.store(*(bytes([i]) for i in range(10)))
    assert cap.lower_cap(3, room=U + U // 2) == 11 * U + U // 2
    cap.enforce()
    assert cap.take_deletes() == [b"\x00", b"\x01"] and cap.used_bytes == 8 * U
    led = Ledger(max_bytes=20 * U)
    cap = led.cap
    led.store(*(bytes([i]) for i in range(6)))
    assert cap.lower_cap(5, room=0) == 6 * U
    cap.enforce()
    assert len(cap.take_deletes()) == 3 and cap.used_bytes == 3 * U


def test_chunks_found_at_start_are_adopted_oldest_first_and_older_than_new_ones():
    led = Ledger(max_bytes=10 * U)
    cap = led.cap
    led.store(b"new")
    assert cap.adopt([(b"mid", U, 200.0), (b"old", U, 100.0), (b"new", U, 300.0)]) == 2 * U
    assert cap.eviction_order() == [b"old", b"mid", b"new"] and cap.used_bytes == 3 * U
    assert led.counters["adopted_chunks"] == 2


def test_a_loaded_chunk_found_missing_is_no_longer_counted():
    led = Ledger()
    cap = led.cap
    led.store(b"a", b"b")
    cap.loads_started([b"a", b"b"])
    cap.loads_done([b"a", b"b"], {b"a": m.MISSING, b"b": m.IO_ERROR})
    assert list(cap.index) == [b"b"] and cap.used_bytes == U and not cap.loading


def test_unbounded_counts_nothing_but_tracks_explicit_removals():
    led = Ledger(max_bytes=None)
    cap = led.cap
    assert cap.capacity_bytes is None and not cap.bounded
    assert cap.admit([b"a", b"b"]) == ([0, 1], {})
    assert cap.stores_done([b"a", b"b"], {b"a": m.WORKER_DIED}) == ([], 0)
    assert cap.adopt([(b"c", U, 1.0)]) == 0 and cap.used_bytes == 0
    cap.remove([b"a"])
    assert cap.take_deletes() == [b"a"] and cap.removed_since(b"a", 0.0)
    assert cap.deletes_answered([b"a"], [m.IO_ERROR], [errno.EBUSY]) == []
    assert led.counters["eviction_errors.EBUSY"] == 1 and not cap.deleting


def test_a_cap_smaller_than_one_chunk_is_refused_naming_max_bytes():
    with pytest.raises(ValueError, match=r"^max_bytes: 99 is smaller than one chunk \(100 bytes\)"):
        Capacity(99, U, count=lambda name, n: None, forget=lambda key: None)


def _layout(cap: Capacity, keys: list[bytes]) -> str:
    """``x`` for a chunk the ledger counts, ``-`` for one it does not, head first."""
    return "".join("x" if k in cap.index else "-" for k in keys)


def test_c47_a_requests_prefix_is_evicted_tail_first_and_a_read_keeps_its_head():
    """CASES C47 in a capped tier's ledger: a request stores its prefix in batches (head first) and
    finishes; room for another prefix is made from its tail. A request that reads a prefix head to
    tail (one load job a step) and finishes leaves its head ranked highest: evictions go on from
    the tail (never ``----xxxx``)."""
    led = Ledger(max_bytes=8 * U)
    cap = led.cap
    a = [b"a%d" % i for i in range(8)]
    b = [b"b%d" % i for i in range(4)]
    for batch in (a[:3], a[3:6], a[6:]):
        led.store(*batch, request="r1")
    cap.request_finished("r1")
    led.store(*b, request="r2")
    assert _layout(cap, a) == "xxxx----" and led.forgotten == a[:3:-1]
    cap.request_finished("r2")
    for batch in (a[:2], a[2:4]):  # a third request reads a's head, two chunks a step
        cap.loads_started(batch)
        cap.loads_done(batch, {}, request="r3")
    cap.request_finished("r3")
    assert cap.eviction_order() == b[::-1] + a[3::-1]
    led.store(b"c0", b"c1", b"c2", b"c3", b"c4", b"c5")  # no request: each as used now
    assert _layout(cap, a) == "xx------" and _layout(cap, b) == "----"


def test_c47_a_store_or_load_of_a_running_request_shares_its_rank_and_position_order():
    """While a request runs, its stores and loads (in any order) rank its chunks by position
    (the order it first placed them), its tail lowest; a store that ends after the request
    finished keeps the fresh ranks the finish gave (vLLM ends a request before its last copy)."""
    led = Ledger(max_bytes=10 * U)
    cap = led.cap
    led.store(b"p0", b"p1")  # an earlier prefix, no request
    cap.loads_started([b"p0", b"p1"])
    cap.loads_done([b"p0", b"p1"], {}, request="r")  # r reads it, then stores its own tail
    led.store(b"t0", b"t1", request="r")
    assert cap.eviction_order() == [b"t1", b"t0", b"p1", b"p0"]
    admitted, _ = cap.admit([b"t2"])
    cap.request_finished("r")
    assert cap.stores_done([b"t2"], {}, request="r") == ([], 0)  # late: ranked as used now
    assert cap.eviction_order() == [b"t1", b"t0", b"p1", b"p0", b"t2"]
    led.store(b"q0", b"q1", request="s")  # another request: ranked above r's finish
    assert cap.eviction_order()[:4] == [b"t1", b"t0", b"p1", b"p0"]


def test_evictions_take_the_lowest_ranked_chunk_neither_loading_nor_protected():
    """Random stores, loads, finishes, failed removals and evictions: every eviction takes the
    lowest-ranked counted chunk that is not loading, not protected and (without retry) whose
    removal has not failed, as a walk over the whole ledger would."""
    import random

    rnd = random.Random(47)
    led = Ledger(max_bytes=40 * U)
    cap = led.cap
    keys = [b"k%d" % i for i in range(80)]
    requests = [f"r{i}" for i in range(5)]
    for _ in range(3000):
        op = rnd.random()
        if op < 0.35:
            batch = rnd.sample(keys, rnd.randint(1, 4))
            admitted, rejected = cap.admit(batch)
            cap.stores_done(batch, rejected, request=rnd.choice(requests + [""]))
        elif op < 0.55:
            batch = [k for k in rnd.sample(keys, 4) if k in cap.index]
            cap.loads_started(batch)
            if rnd.random() < 0.8:
                cap.loads_done(batch, {}, request=rnd.choice(requests + [""]))
        elif op < 0.65:
            cap.request_finished(rnd.choice(requests))
        elif op < 0.7:
            deletes = cap.take_deletes()
            failing = set(rnd.sample(deletes, len(deletes) // 3))
            codes = [m.IO_ERROR if k in failing else m.OK for k in deletes]
            cap.deletes_answered(deletes, codes, [])
        else:
            protect = set(rnd.sample(keys, 6))
            retry = rnd.random() < 0.5
            order = cap.eviction_order()
            expected = next(
                (
                    k
                    for k in order
                    if k not in cap.loading
                    and k not in protect
                    and (retry or k not in cap.undeletable)
                ),
                None,
            )
            before = set(cap.index)
            assert cap.evict_one(protect, retry) is (expected is not None)
            assert before - set(cap.index) == ({expected} if expected else set())
        assert cap.used_bytes == sum(cap.index.values())


def test_c48_new_chunks_after_one_refused_in_a_store_are_refused_too():
    """CASES C48 within one store: ``keys`` are a prefix, so once a chunk is refused (its delete
    pending, or no room) every new chunk after it is refused with the same code (counted apart);
    chunks already stored after it stay admitted (nothing to write)."""
    led = Ledger(max_bytes=4 * U)
    cap = led.cap
    led.store(b"a", b"b")
    cap.remove([b"a"])
    cap.take_deletes()  # a's delete in flight
    admitted, rejected = cap.admit([b"a", b"b", b"c", b"d"])
    assert admitted == [1] and rejected == {b"a": m.REJECTED, b"c": m.REJECTED, b"d": m.REJECTED}
    assert led.counters["store_refused_after_hole"] == 2
    assert cap.stores_done([b"a", b"b", b"c", b"d"], rejected) == ([], 0) and not cap.refused
    assert not cap.reserved and cap.used_bytes == U
    cap.loads_started([b"b"])  # b cannot be evicted: the third new chunk finds no room
    admitted, rejected = cap.admit([b"e", b"f", b"g", b"h", b"i"])
    assert admitted == [0, 1, 2] and rejected == {b"h": m.NO_SPACE, b"i": m.NO_SPACE}
    assert led.counters["store_refused_no_room"] == 1
    assert led.counters["store_refused_after_hole"] == 3


def test_a_store_ending_after_its_request_finished_keeps_no_request_in_the_ledger():
    """A capped tier hears of a request only when a job of it ends, which can be after vLLM
    finished it (the last store's write-through): the request is not kept as running (its table
    grew by one request per prefill, review of C47)."""
    led = Ledger(max_bytes=10 * U)
    cap = led.cap
    for i in range(50):
        rid = f"r{i}"
        admitted, _ = cap.admit([b"%d" % i])
        cap.request_finished(rid)
        cap.stores_done([b"%d" % i], {}, request=rid)
    assert not cap.ranks.requests and len(cap.ranks.done) == 50


def test_a_chunk_counted_after_a_probe_went_out_is_not_taken_as_gone_by_its_answer():
    """What a worker saw of a key before it was counted says nothing of the copy counted since:
    ``counted_before`` tells a probe's MISSING that raced a store (review of C55)."""
    led = Ledger()
    cap = led.cap
    t_probe = led.now
    led.now += 1.0
    led.store(b"a")
    assert not cap.counted_before(b"a", t_probe) and cap.counted_before(b"a", led.now + 1)
    assert not cap.counted_before(b"b", led.now + 1)


def test_a_listing_of_a_chunk_whose_delete_is_in_flight_does_not_count_it():
    """A scan's listing may predate a removal in flight: that chunk is not adopted."""
    cap = Ledger().cap
    cap.remove([b"a"])  # not counted: its delete queued, then sent
    cap.take_deletes()
    assert cap.adopt([(b"a", U, 1.0), (b"b", U, 2.0)]) == U and list(cap.index) == [b"b"]


def test_a_listed_entry_of_another_size_than_a_chunk_is_not_counted():
    """A scan entry whose size is not one chunk's (a file a co-tenant planted on a shared root,
    a sparse file claiming terabytes) is not adopted: its claimed size would move the cap."""
    led = Ledger(max_bytes=10 * U)
    cap = led.cap
    assert cap.adopt([(b"a", U, 1.0), (b"huge", 1 << 40, 2.0), (b"short", U - 1, 3.0)]) == U
    assert list(cap.index) == [b"a"] and cap.used_bytes == U
    assert led.counters["scan_odd_sizes"] == 2 and led.counters["adopted_chunks"] == 1
