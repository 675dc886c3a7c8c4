"""The arena's slot table (ipc/slot_table.py): what a warm restart adopts. Over plain buffers: the
table's logic, not the segment (tests/integration covers the arena and the keeper)."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.ipc import slot_table as stm
from kvoffload.ipc.slot_table import (
    DROP_REASONS,
    ENTRY_BYTES,
    SlotTable,
    SlotTableError,
    table_bytes,
)

NS = "ns-" + "ab" * 16
SLOTS, ROW = 8, 256


def make(slots: int = SLOTS) -> tuple[SlotTable, bytearray, np.ndarray]:
    buf = bytearray(table_bytes(slots))
    rows = np.random.default_rng(slots).integers(0, 256, size=(slots, ROW), dtype=np.uint8)
    t = SlotTable(buf, rows)
    t.format(NS)
    return t, buf, rows


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def fresh(buf: bytearray, rows: np.ndarray) -> SlotTable:
    """The table as a new engine sees it (no state carried in the object), on a copy: adopting
    clears what it does not adopt, and the tests go on with the old engine's table."""
    return SlotTable(bytearray(buf), rows)


def test_published_and_sealed_chunks_are_adopted_in_publication_order():
    t, buf, rows = make()
    for slot, i in [(3, 30), (0, 10), (5, 50)]:
        t.publish(slot, key(i))
    assert t.seal_pending() == 3 and t.seal_pending() == 0  # nothing sealed twice
    got = fresh(buf, rows).adopt(NS)
    assert list(got.slots.items()) == [(key(30), 3), (key(10), 0), (key(50), 5)]
    assert got.dropped == dict.fromkeys(DROP_REASONS, 0)


def test_a_chunk_published_but_not_yet_sealed_is_dropped_as_unsealed():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.seal_pending()
    t.publish(2, key(2))  # the engine died before the keeper came round
    got = fresh(buf, rows).adopt(NS)
    assert got.slots == {key(1): 1} and got.dropped["unsealed"] == 1


def test_a_row_changed_after_its_seal_is_dropped_on_its_digest():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.publish(2, key(2))
    t.seal_pending()
    rows[2, 17] ^= 0x40
    got = fresh(buf, rows).adopt(NS)
    assert got.slots == {key(1): 1} and got.dropped["digest"] == 1


def test_a_retracted_slot_is_not_adopted_and_a_republished_one_needs_a_new_seal():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.publish(2, key(2))
    t.seal_pending()
    t.retract(1)  # evicted: its bytes may be another chunk's now
    t.retract(2)
    t.publish(2, key(22))  # the slot's new chunk: the old seal does not cover it
    got = fresh(buf, rows).adopt(NS)
    assert got.slots == {} and got.dropped["unsealed"] == 1
    t.seal_pending()
    assert fresh(buf, rows).adopt(NS).slots == {key(22): 2}


def test_a_seal_is_not_written_when_the_entry_changed_while_its_row_was_hashed(monkeypatch):
    t, buf, rows = make()
    t.publish(4, key(4))
    real = stm._h

    def hash_then_retract(b):
        if len(b) == ROW:  # the row: the engine evicts the slot meanwhile
            t.retract(4)
            t.publish(4, key(44))
        return real(b)

    monkeypatch.setattr(stm, "_h", hash_then_retract)
    assert t.seal_pending() == 0
    monkeypatch.setattr(stm, "_h", real)
    assert fresh(buf, rows).adopt(NS).dropped["unsealed"] == 1


def test_the_same_key_in_two_slots_adopts_neither():
    t, buf, rows = make()
    t.publish(1, key(7))
    t.publish(3, key(7))
    t.publish(5, key(8))
    t.seal_pending()
    got = fresh(buf, rows).adopt(NS)
    assert got.slots == {key(8): 5} and got.dropped["duplicate"] == 2


def test_adopting_clears_every_entry_it_does_not_adopt():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.publish(2, key(2))
    t.seal_pending()
    t.publish(3, key(3))  # unsealed
    rows[2, 0] ^= 1  # changed after its seal
    successor = SlotTable(buf, rows)
    assert successor.adopt(NS).slots == {key(1): 1}
    again = fresh(buf, rows).adopt(NS)  # a second restart finds only what the first adopted
    assert again.slots == {key(1): 1} and again.dropped == dict.fromkeys(DROP_REASONS, 0)


def test_another_namespace_or_a_torn_header_adopts_nothing():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.seal_pending()
    with pytest.raises(SlotTableError, match="namespace"):
        fresh(buf, rows).adopt("ns-other")
    buf[20] ^= 1
    with pytest.raises(SlotTableError, match="missing or torn"):
        fresh(buf, rows).adopt(NS)
    with pytest.raises(SlotTableError):  # another shape
        SlotTable(buf, np.zeros((SLOTS, ROW * 2), np.uint8)).adopt(NS)


def test_a_table_not_adopted_counts_the_ready_chunks_it_drops():
    t, buf, rows = make()
    for slot in (1, 2, 6):
        t.publish(slot, key(slot))
    t.seal_pending()
    t.publish(4, key(4))  # unsealed, READY all the same
    t.retract(2)
    assert fresh(buf, rows).ready_entries() == 3
    buf[20] ^= 1  # a torn header: the entries are still read where they are
    assert fresh(buf, rows).ready_entries() == 3


def test_an_entry_that_cannot_be_sealed_does_not_hold_the_others_back(monkeypatch):
    t, buf, rows = make()
    for slot in range(SLOTS):
        t.publish(slot, key(slot))
    real = stm._h

    def slot_0_keeps_changing(b):
        if len(b) == ROW and np.shares_memory(np.frombuffer(b, np.uint8), rows[0]):
            t.retract(0)
            t.publish(0, key(100))
        return real(b)

    monkeypatch.setattr(stm, "_h", slot_0_keeps_changing)
    assert sum(t.seal_pending(1) for _ in range(SLOTS)) == SLOTS - 1  # passes of one row
    monkeypatch.setattr(stm, "_h", real)
    assert len(fresh(buf, rows).adopt(NS).slots) == SLOTS - 1


def test_the_keepers_final_seal_stops_at_its_bound_and_what_is_left_is_dropped():
    """After the engine's death the keeper seals what is still unsealed, a pass at a time, until
    its bound (janitor.final_seal; a clock that moves one unit a pass)."""
    from kvoffload.ipc import janitor

    slots = 3 * janitor._SEALS_PER_PASS
    t, buf, rows = make(slots)
    for slot in range(slots):
        t.publish(slot, key(slot))
    ticks = iter(range(100))
    assert janitor.final_seal(t, 2, clock=lambda: next(ticks)) == 2 * janitor._SEALS_PER_PASS
    got = fresh(buf, rows).adopt(NS)
    assert len(got.slots) == 2 * janitor._SEALS_PER_PASS
    assert got.dropped["unsealed"] == janitor._SEALS_PER_PASS
    t2, buf2, rows2 = make(slots)  # with time enough, every one
    for slot in range(slots):
        t2.publish(slot, key(slot))
    assert janitor.final_seal(t2, 1e9) == slots
    assert len(fresh(buf2, rows2).adopt(NS).slots) == slots


def test_a_key_longer_than_the_table_holds_is_never_adopted():
    t, buf, rows = make()
    t.publish(1, key(1))
    t.seal_pending()
    t.publish(1, b"k" * (stm.MAX_KEY_BYTES + 1))  # retracts the slot instead
    t.seal_pending()
    assert fresh(buf, rows).adopt(NS).slots == {}


def stores_of_a_write(before: bytes, after: bytes) -> list[tuple[int, int]]:
    """The byte stores of one entry change in the order the protocol makes them (DESIGN "Warm
    restart"): the entry with an odd seq, then the even seq, then the entry check."""
    odd = bytearray(after)
    seq = struct.unpack_from("<I", after, 0)[0]
    struct.pack_into("<I", odd, 0, (seq - 1) & 0xFFFFFFFF)
    out = [(i, odd[i]) for i in range(80)]
    out += [(i, after[i]) for i in range(4)]
    out += [(i, after[i]) for i in range(80, 88)]
    return out


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("prs"), st.integers(0, 3), st.integers(0, 5)), max_size=25
    ),
    cut=st.integers(0, 92),
    last=st.tuples(st.sampled_from("pr"), st.integers(0, 3), st.integers(0, 5)),
)
def test_a_write_cut_anywhere_never_adopts_a_chunk_that_was_not_whole_and_sealed(ops, cut, last):
    """Publish / retract / seal at random, then one more change cut after any byte (a SIGKILL in
    the middle of it): every adopted slot holds the key of a completed, sealed publication whose
    row is unchanged, and nothing that was retracted."""
    t, buf, rows = make(4)
    truth: dict[int, bytes | None] = {}  # slot -> key of its last completed publication, sealed
    published: dict[int, bytes | None] = {}
    for op, slot, k in ops:
        if op == "p":
            t.publish(slot, key(k))
            published[slot] = key(k)
            truth[slot] = None  # not sealed yet
        elif op == "r":
            t.retract(slot)
            published[slot] = truth[slot] = None
        else:
            t.seal_pending()
            truth = {s: k_ for s, k_ in published.items()}
    op, slot, k = last
    at = stm.TABLE_HEADER_BYTES + slot * ENTRY_BYTES
    before = bytes(buf[at : at + ENTRY_BYTES])
    shadow = SlotTable(bytearray(buf), rows)
    shadow._stamp = t._stamp
    (shadow.publish if op == "p" else lambda s, _k: shadow.retract(s))(slot, key(k))
    after = bytes(shadow.mv[at : at + ENTRY_BYTES])
    stores = stores_of_a_write(before, after)
    for i, b in stores[:cut]:
        buf[at + i] = b
    if cut >= len(stores):  # the change completed: the full protocol gives the real write's bytes
        assert bytes(buf[at : at + ENTRY_BYTES]) == after
    got = fresh(buf, rows).adopt(NS)
    for k_, s in got.slots.items():
        assert truth.get(s) == k_, (s, k_, truth)
        if s == slot and cut > 0:
            # the cut change touched this slot: only its old, sealed state may survive, and
            # only if the change had not begun (a retraction not yet visible)
            pytest.fail(f"slot {s} adopted after a change to it was cut at byte {cut}")


def host(n: int = SLOTS):
    from kvoffload.host import HostTier
    from kvoffload.policies import LRUPolicy

    return HostTier(n, LRUPolicy(n))


def store(h, keys: list[bytes], ok: bool = True) -> list[int]:
    plan = h.allocate(keys)
    assert plan is not None
    h.complete_write(plan.keys, ok)
    return plan.slots


def test_the_host_tier_publishes_ready_chunks_and_retracts_each_slot_before_its_reuse():
    t, buf, rows = make(4)
    h = host(4)
    h.mirror_to(t)
    a = [store(h, [key(i)])[0] for i in (1, 2, 3)]  # one batch each: LRU order
    store(h, [key(9)], ok=False)  # a failed write is never published
    t.seal_pending()
    assert fresh(buf, rows).adopt(NS).slots == dict(zip([key(1), key(2), key(3)], a))
    store(h, [key(4), key(5)])  # evicts key(1), the least recent: its slot is retracted
    h.remove([key(2)])
    t.seal_pending()
    got = fresh(buf, rows).adopt(NS)
    assert set(got.slots) == {key(3), key(4), key(5)}
    assert got.slots[key(3)] == a[2]
    h.clear()
    assert fresh(buf, rows).adopt(NS).slots == {}


def test_a_slot_evicted_while_its_new_write_is_in_flight_is_never_adopted():
    t, buf, rows = make(2)
    h = host(2)
    h.mirror_to(t)
    store(h, [key(1)])
    store(h, [key(2)])
    t.seal_pending()
    plan = h.allocate([key(3)])  # evicts key(1); the new write has not landed
    assert plan is not None and plan.evicted == [key(1)]
    rows[plan.slots[0], :8] = 7  # its bytes change under the old seal
    got = fresh(buf, rows).adopt(NS)
    assert got.slots == {key(2): 1 - plan.slots[0]}  # the old chunk is not adopted


def test_an_adopting_host_tier_serves_the_chunks_and_evicts_the_oldest_first():
    t, buf, rows = make(4)
    old = host(4)
    old.mirror_to(t)
    for i in (1, 2, 3):
        store(old, [key(i)])
    t.seal_pending()
    found = fresh(buf, rows).adopt(NS)
    h = host(4)
    h.take_events()
    assert h.adopt(found.slots) == [key(1), key(2), key(3)]
    [event] = h.take_events()
    assert event.keys == [key(1), key(2), key(3)] and not event.removed  # announced as stored
    from kvoffload.tiers.base import LookupResult

    assert all(h.lookup(key(i)) is LookupResult.HIT for i in (1, 2, 3))
    assert h.pin([key(2)]) == [found.slots[key(2)]]
    h.unpin([key(2)])
    plan = h.allocate([key(4), key(5)])  # one free slot, then the oldest adopted chunk
    assert plan is not None and plan.evicted == [key(1)]
    with pytest.raises(ValueError, match="already holds"):
        h.adopt(found.slots)
