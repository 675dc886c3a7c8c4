"""Faults that used to serve the wrong bytes as a hit, or lose events: CASES C24, C26, C27, C28.

Real arena, real TieringManager, real tier worker processes; the faults are the workers' own fault
points (``reply``, ``wait_file``), not mocks.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from helpers import (
    HIT,
    MISS,
    PENDING,
    ROW,
    Rig,
    fs_tier,
    keys_for,
    payload,
    replay,
    wait_paused,
    wait_until,
)

SENTINEL = 0xEE


def _settle(rig, keys, req="req"):
    """Look ``keys`` up every step until none is RETRY / HIT_PENDING; returns the verdicts."""
    verdicts = {}

    def settled():
        verdicts.clear()
        verdicts.update({k: rig.tm.lookup(k, req) for k in keys})
        return all(v in (HIT, MISS) for v in verdicts.values())

    wait_until(settled, what="lookups to settle", step=rig.tm.step)
    return [verdicts[k] for k in keys]


def _fill_free_rows(rig, byte):
    host = rig.tm.host
    for slot in range(host.num_slots):
        if host.keys[slot] is None:
            rig.arena.rows[slot] = byte


@pytest.mark.parametrize("action", ["reply_short", "reply_empty", "reply_bad_code", "reply_long"])
def test_c24_a_reply_that_does_not_confirm_every_key_never_publishes_it(tmp_path, action):
    """A load reply that is short, empty, longer than the task or carries an unknown code: any key
    it does not positively confirm fails (counted, MISS afterwards), and no HIT ever returns the
    sentinel bytes left in the arena."""
    fs = fs_tier(tmp_path / "fs", faults=[{"point": "load_reply", "action": action, "count": -1}])
    with Rig([fs], num_slots=8) as rig:
        k1, k2 = keys_for(2)
        rig.store([k1, k2])
        assert rig.tm.host.remove([k1, k2]) == [k1, k2]
        _fill_free_rows(rig, SENTINEL)
        verdicts = _settle(rig, [k1, k2])
        assert verdicts[1] is MISS, "the unconfirmed key was published"
        for key, verdict in zip([k1, k2], verdicts):
            if verdict is HIT:
                (row,) = rig.read([key])
                assert np.array_equal(row, payload(key)), "a HIT served bytes never stored there"
        assert rig.tm.lookup(k2, "req") is MISS  # and stays a miss (failed-load verdict)
        failed = rig.tm.stats.failed
        assert failed.get(("fs", "load", "bad_reply"), 0) >= 1, failed
        assert rig.tm.stats.promotion_failures["fs"] >= 1
        assert rig.fs.counters.get("malformed_replies", 0) >= 1
        if action == "reply_bad_code" and rig.tm.stats.promotion_failures["fs"] == 1:
            assert verdicts[0] is HIT  # K1 shared K2's task: only the key with the unknown code
            # failed (when the two promotions went in separate tasks, K1's own reply was mangled)


def test_c24_a_reply_for_a_task_never_sent_is_dropped_and_counted(tmp_path):
    """A stray reply (a task id the engine never sent) is dropped and counted; the real reply
    that follows is applied as usual."""
    fs = fs_tier(
        tmp_path / "fs", faults=[{"point": "load_reply", "action": "reply_stray", "count": -1}]
    )
    with Rig([fs], num_slots=8) as rig:
        k1, k2 = keys_for(2)
        rig.store([k1, k2])
        rig.tm.host.remove([k1, k2])
        _fill_free_rows(rig, SENTINEL)
        assert _settle(rig, [k1, k2]) == [HIT, HIT]
        for key, row in zip([k1, k2], rig.read([k1, k2])):
            assert np.array_equal(row, payload(key))
        assert rig.fs.counters.get("unknown_replies", 0) >= 1
        assert rig.tm.stats.failed == {}


def test_c24_a_short_probe_reply_does_not_leave_a_key_probing_forever(tmp_path):
    """A probe reply without a verdict for a key makes that key a (short-lived) miss instead of
    leaving it 'being probed', which answered RETRY forever."""
    fs = fs_tier(
        tmp_path / "fs",
        max_bytes="unbounded",  # no ledger answers for the stored chunks
        faults=[{"point": "probe_reply", "action": "reply_short", "count": 1}],
    )
    with Rig([fs], num_slots=8) as rig:
        keys = keys_for(2)
        rig.store(keys)
        rig.tm.host.remove(keys)
        rig.fs.verdicts.present.clear()  # forget the store's verdicts: the next lookups probe
        # The first key's probe task is mangled: it settles as a miss (the second key waited for
        # that probe, then was probed on its own).
        assert _settle(rig, keys) == [MISS, HIT]
        assert not rig.fs._probing
        assert rig.fs.counters.get("malformed_replies", 0) == 1


def test_c26_reset_while_a_tier_load_is_in_flight_never_reuses_its_slot(tmp_path):
    """A reset returns at once while a promotion from fs is paused mid-load; the slot it loads
    into is quarantined, so the chunks stored after the reset all read back their own bytes,
    before and after the late load lands."""
    gate = tmp_path / "gate"
    k1, *fresh = keys_for(5)
    fs = fs_tier(
        tmp_path / "fs",
        faults=[
            {"point": "read_payload", "action": "wait_file", "arg": str(gate), "key_hex": k1.hex()}
        ],
    )
    with Rig([fs], num_slots=4) as rig:
        rig.store([k1])
        rig.tm.host.remove([k1])
        wait_until(
            lambda: rig.tm.lookup(k1, "req") is PENDING, what="a promotion of K1", step=rig.tm.step
        )
        wait_paused(gate, step=rig.tm.step)  # the worker is inside the load, before the payload
        rig.tm.reset_cache()
        assert rig.tm.has_pending_work(), "reset waited for the paused load"
        plan = rig.tm.prepare_store(fresh)
        assert plan is not None
        for s in plan.slots:
            rig.arena.rows[s] = 0x22
        rig.tm.complete_store(plan.keys, True)
        stored = list(plan.keys)
        gate.touch()  # the late load lands
        assert rig.tm.wait_idle(120)
        for _key, row in zip(stored, rig.read(stored)):
            assert (row == 0x22).all(), "a late load overwrote a chunk stored after the reset"
        assert len(stored) == 3  # one slot was still being loaded into: quarantined
        assert sum(rig.tm.host.quarantined) == 0
        assert rig.tm.stats.reset_discarded_promotions == 1
        rest = [k for k in fresh if k not in stored]
        plan = rig.tm.prepare_store(rest)  # the quarantined slot is free again
        assert plan is not None and list(plan.keys) == rest
        for s in plan.slots:
            rig.arena.rows[s] = 0x22
        rig.tm.complete_store(plan.keys, True)
        assert rig.tm.wait_idle(120)
        assert [rig.tm.lookup(k, "req") for k in fresh] == [HIT] * 4
        for row in rig.read(fresh):
            assert (row == 0x22).all()


def test_c26_reset_keeps_slots_of_unfinished_accelerator_copies_and_tier_stores(tmp_path):
    """Slots being read by an accelerator copy (pinned by a holder) or by a tier store are not
    reused after a reset until those transfers complete."""
    gate = tmp_path / "gate"
    fs = fs_tier(
        tmp_path / "fs",
        faults=[{"point": "before_read_slot", "action": "wait_file", "arg": str(gate)}],
    )
    with Rig([fs], num_slots=4) as rig:
        a, b, *fresh = keys_for(6)
        rig.store([a, b], wait=False)  # write-through to fs paused: both slots pinned by it
        wait_paused(gate, step=rig.tm.step)
        rig.tm.prepare_load([a], "r1")  # and `a` also by an accelerator copy
        rig.tm.reset_cache()
        assert sum(rig.tm.host.quarantined) == 2
        plan = rig.tm.prepare_store(fresh)
        assert plan is not None and len(plan.keys) == 2
        gate.touch()
        assert rig.tm.wait_idle(120)
        assert sum(rig.tm.host.quarantined) == 1  # `b` freed; `a` still held by r1
        rig.tm.complete_load([a], "r1")
        assert sum(rig.tm.host.quarantined) == 0
        assert rig.tm.host.num_used == 2 and rig.tm.host.num_pinned == 0


def test_c27_events_queued_at_a_reset_are_published_and_the_reset_too(tmp_path):
    """Store K1..K4 (published), store K5 (evicting K1) without a step, reset, step: a subscriber
    that applies every event in order ends with nothing on CPU, and every removal matches an
    earlier store on the same medium."""
    from kvoffload.events import EventBatch

    cfg = {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    with Rig([], num_slots=4, kv_events=cfg) as rig:
        keys = keys_for(5)
        for k in keys[:4]:
            rig.store([k])
        rig.tm.step()
        rig.store([keys[4]])  # evicts K1; no step before the reset
        rig.tm.reset_cache()
        rig.tm.step()
        pub = rig.tm.publisher
        pub.flush()
        batches = replay(pub.replay_endpoint)
    held: dict[str, set] = {}
    stored_ever: list = []
    for _, body in batches:
        for ev in msgspec.msgpack.decode(body, type=EventBatch).events:
            kind = ev["type"] if isinstance(ev, dict) else type(ev).__name__
            if kind == "AllBlocksCleared":  # every medium (a run opens with one, CASES C54)
                for on in held.values():
                    on.clear()
                continue
            medium = ev["medium"] if isinstance(ev, dict) else ev.medium
            hashes = ev["block_hashes"] if isinstance(ev, dict) else ev.block_hashes
            on = held.setdefault(medium, set())
            if kind == "BlockStored":
                on.update(hashes)
                stored_ever.extend(hashes)
            elif kind == "BlockRemoved":
                assert set(hashes) <= on, "a removal of a chunk never stored on that medium"
                on.difference_update(hashes)
    assert held.get("CPU", set()) == set()
    assert set(stored_ever) == set(keys), "a stored chunk was never published"


def test_c28_a_duplicated_completion_never_releases_another_requests_pin(tmp_path):
    """A and B both load K; A's completion arrives twice. K stays pinned until B completes, the
    extra completion is counted, and filling the host tier never evicts K meanwhile."""
    with Rig([], num_slots=4) as rig:
        k, *fresh = keys_for(8)
        rig.store([k])
        slot_a = rig.tm.prepare_load([k], "A")
        slot_b = rig.tm.prepare_load([k], "B")
        assert slot_a == slot_b
        rig.tm.complete_load([k], "A")
        rig.tm.complete_load([k], "A")  # the duplicate
        for i in range(0, len(fresh), 3):  # needs every slot: everything evictable goes
            plan = rig.tm.prepare_store(fresh[i : i + 3])
            if plan is not None:
                for s in plan.slots:
                    assert s != slot_a[0], "K's slot handed out while B still copies it"
                    rig.arena.rows[s] = 0x33
                rig.tm.complete_store(plan.keys, True)
        assert rig.tm.lookup(k, "B") is HIT
        assert np.array_equal(rig.arena.rows[slot_a[0]], payload(k))
        assert rig.tm.stats.unheld_completions == 1
        assert rig.tm.host.refs[slot_a[0]] == 1
        rig.tm.complete_load([k], "B")
        assert rig.tm.host.refs[slot_a[0]] == 0
        assert rig.tm.pins_held() == {}
        rig.tm.complete_load([k], "C")  # a holder that never held a pin
        assert rig.tm.stats.unheld_completions == 2


def test_pins_are_exactly_the_live_holders(tmp_path):
    """The host tier's ref counts equal the pins the manager's holders and tier stores hold."""
    gate = tmp_path / "gate"
    fs = fs_tier(
        tmp_path / "fs",
        faults=[{"point": "before_read_slot", "action": "wait_file", "arg": str(gate)}],
    )
    with Rig([fs], num_slots=8) as rig:
        keys = keys_for(3)
        rig.store(keys, wait=False)
        wait_paused(gate, step=rig.tm.step)
        rig.tm.prepare_load(keys[:2], "r1")
        rig.tm.prepare_load(keys[1:], "r2")
        held = rig.tm.pins_held()
        refs = {s: rig.tm.host.refs[s] for s in range(8) if rig.tm.host.refs[s]}
        assert held == refs and held[rig.tm.host.slot_of(keys[1])] == 3
        gate.touch()
        assert rig.tm.wait_idle(120)
        rig.tm.complete_load(keys[:2], "r1")
        rig.tm.complete_load(keys[1:], "r2")
        assert rig.tm.pins_held() == {} and rig.tm.host.num_pinned == 0
        assert rig.tm.host.num_evictable == 3
        assert ROW == rig.row_bytes


@pytest.mark.parametrize("success", [True, False])
def test_a_stale_store_completion_never_ends_another_requests_write(success):
    """s0 stores K and completes; K is reset away and s2 reserves it again; s0's completion
    arrives a second time. It must neither publish s2's slot before s2's copy ended (a lookup would
    load bytes never written) nor free it under s2; it is counted. (Found by the tier model.)"""
    with Rig([], num_slots=4) as rig:
        (k,) = keys_for(1)
        plan = rig.tm.prepare_store([k], "s0")
        rig.arena.rows[plan.slots[0]] = payload(k)
        rig.tm.complete_store([k], True, "s0")
        rig.tm.reset_cache()
        plan = rig.tm.prepare_store([k], "s2")
        assert plan is not None and plan.keys == [k]
        rig.tm.complete_store([k], success, "s0")  # the duplicate of s0's completion
        assert rig.tm.lookup(k, "r") is PENDING, "another request's completion ended s2's write"
        assert rig.tm.stats.stale_store_completions == 1
        rig.arena.rows[plan.slots[0]] = 0x44
        rig.tm.complete_store([k], True, "s2")
        assert rig.tm.lookup(k, "r") is HIT
        assert (rig.read([k])[0] == 0x44).all()


def test_a_promotion_never_evicts_a_chunk_the_engine_was_told_hit_in_the_same_step():
    """The scheduler looks a request's chunks up, then prepare_loads them later in the same step;
    a promotion started by another lookup in between must not evict one of them (vLLM would get a
    KeyError from prepare_load). Here both host slots were told HIT: the promotion misses."""
    with Rig([{"type": "memory", "max_bytes": 1 << 20}], num_slots=2) as rig:
        k1, k2, k3 = keys_for(3, seed=41)
        rig.store([k3])
        rig.store([k1, k2])  # the host tier holds k1, k2; k3 is in the memory tier only
        rig.tm.step()
        assert rig.tm.lookup(k1, "r1") is HIT and rig.tm.lookup(k2, "r1") is HIT
        assert rig.tm.lookup(k3, "r2") is MISS  # no slot it may take this step
        rig.tm.prepare_load([k1, k2], "r1")  # a KeyError had k1 or k2 been evicted
        rig.tm.complete_load([k1, k2], "r1")
        rig.tm.step()  # a new step: k1 and k2 may be evicted now
        assert _settle(rig, [k3], "r3") == [HIT]
