"""The host-tier access the p2p tier's serving side uses (TieringManager.serve_lookup, lease,
release, admit, commit), and the manager's lock with two threads driving it.

Real arena, real TieringManager, real fs tier worker processes where a tier is needed.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import numpy as np
from helpers import HIT, PENDING, Rig, fs_tier, keys_for, payload, wait_until

from kvoffload.host import FREE, READY, WRITING
from kvoffload.ipc import peer_messages as pm
from kvoffload.tiers.base import LookupResult


def refs_of(tm) -> dict[int, int]:
    """The host tier's ref counts, by slot (pinned slots only)."""
    return {s: r for s, r in enumerate(tm.host.refs) if r}


def assert_consistent(tm) -> None:
    """The slot table agrees with itself and with the holders' bookkeeping."""
    host = tm.host
    assert tm.pins_held() == refs_of(tm)
    for k, s in host.index.items():
        assert host.keys[s] == k
        assert not host.quarantined[s]
    free = host._free
    assert len(set(free)) == len(free)
    for s in free:
        assert host.keys[s] is None and host.state[s] == FREE and not host.refs[s]
    assert host.num_writing == sum(1 for st in host.state if st == WRITING)
    assert host.num_pinned == sum(1 for r in host.refs if r)


_WIRE = {
    LookupResult.MISS: pm.MISS,
    LookupResult.HIT: pm.READY,
    LookupResult.HIT_PENDING: pm.PENDING,
}


def served(tm, keys, requester: str = "peer-a", max_promotions=None) -> list[int]:
    """The states a ``LookupReply`` carries for ``tm.serve_lookup``'s verdicts."""
    return [_WIRE[r] for r in tm.serve_lookup(keys, requester, max_promotions)]


def test_serve_lookup_answers_ready_pending_and_miss_counted_apart_from_own_lookups():
    with Rig(num_slots=8) as rig:
        tm = rig.tm
        ready, writing, absent = keys_for(3, seed=1)
        rig.store([ready])
        plan = tm.prepare_store([writing])
        assert plan is not None and plan.keys == [writing]
        before = tm.stats.snapshot()

        assert served(tm, [ready, writing, absent, ready]) == [pm.READY, pm.PENDING, pm.MISS, 1]

        after = tm.stats.snapshot()
        assert (after["peer_lookups"], after["peer_hits"], after["peer_pending"]) == (4, 2, 1)
        # the instance's own lookup counters and loads did not move
        for name in ("host_queries", "host_hits", "tier_queries", "tier_hits", "loads_from"):
            assert after[name] == before[name], name
        tm.complete_store([writing], True)
        assert served(tm, [writing]) == [pm.READY]


def test_c18_a_chunk_moved_to_the_fs_tier_is_still_served_to_peers(tmp_path):
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        k1, *others = keys_for(5, seed=2)
        rig.store([k1])
        for k in others:  # 4 more chunks through a 4-slot host tier: k1 lives on in fs only
            rig.store([k])
        assert k1 not in tm.host.index
        before = tm.stats.snapshot()

        first = served(tm, [k1])
        assert first == [pm.PENDING]  # the fs tier is probed or the promotion has started

        def landed():
            state = served(tm, [k1])[0]
            assert state != pm.MISS, "a chunk the fs tier holds was answered MISS"
            return state == pm.READY

        # the engine is idle: only the serving side polls, as the node thread does
        wait_until(landed, what="k1 promoted for the peer", step=tm.poll)
        assert tm.serving_promotions() == 0
        holder = "lease-1"
        (slot,) = tm.lease([k1], holder)
        assert slot >= 0
        assert np.array_equal(rig.arena.rows[slot], payload(k1, rig.row_bytes))
        tm.release(holder)
        after = tm.stats.snapshot()
        assert after["peer_promotions"] == 1
        assert after["promotions"]["fs"] == before["promotions"]["fs"] + 1
        for name in ("host_queries", "tier_queries", "tier_hits", "loads_from"):
            assert after[name] == before[name], name
        assert tm.source_of(k1, "") == "host"  # no request's load
        assert_consistent(tm)


def test_serve_lookup_has_at_most_max_promotions_in_flight(tmp_path):
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        keys = keys_for(6, seed=15)
        for k in keys:
            rig.store([k])
        a, b = keys[:2]  # in the fs tier only
        assert a not in tm.host.index and b not in tm.host.index

        def both_ready():
            states = served(tm, [a, b], "peer-a", max_promotions=1)
            assert pm.MISS not in states
            assert tm.serving_promotions() <= 1
            return states == [pm.READY, pm.READY]

        wait_until(both_ready, what="a and b promoted one at a time", step=tm.poll)
        assert tm.stats.peer_promotions == 2
        assert_consistent(tm)


def test_serve_lookup_never_asks_a_peer_tier():
    tier = {"type": "PeerMediumTier", "module_path": "custom_tier", "max_bytes": 64 * 16384}
    with Rig([tier], num_slots=4) as rig:
        tm = rig.tm
        k1, *others = keys_for(5, seed=3)
        for k in [k1, *others]:
            rig.store([k])
        assert k1 not in tm.host.index
        assert served(tm, [k1]) == [pm.MISS]  # held only by the peer-medium tier
        assert tm.stats.peer_promotions == 0 and tm.serving_promotions() == 0
        assert tm.lookup(k1, "req") is PENDING  # the instance itself does use that tier


def test_leases_pin_per_holder_and_release_drops_only_their_own_pins():
    with Rig(num_slots=8) as rig:
        tm = rig.tm
        a, b, writing, absent = keys_for(4, seed=4)
        rig.store([a, b])
        assert tm.prepare_store([writing]) is not None
        assert tm.lookup(a, "req") is HIT
        tm.prepare_load([a], "req")  # an accelerator copy holds a pin too

        s1 = tm.lease([a, b, writing, absent, a], "lease-1")
        s2 = tm.lease([a], "lease-2")
        slot_a, slot_b = tm.host.index[a], tm.host.index[b]
        assert s1 == [slot_a, slot_b, -1, -1, slot_a]
        assert s2 == [slot_a]
        assert tm.pins_held() == refs_of(tm) == {slot_a: 4, slot_b: 1}
        assert tm.stats.peer_leased == 4

        # leased chunks survive a store that needs every other slot
        fresh = keys_for(8, seed=5)
        rig.store(fresh)
        assert tm.host.index.get(a) == slot_a and tm.host.index.get(b) == slot_b

        held = Counter(tm.pins_held())
        tm.release("lease-1")
        assert tm.pins_held() == refs_of(tm) == {slot_a: 2}
        assert held - Counter(tm.pins_held()) == {slot_a: 2, slot_b: 1}  # lease-1's, and only those
        tm.release("lease-1")  # twice: nothing more is dropped
        assert tm.stats.stale_peer_completions == 1
        assert refs_of(tm) == {slot_a: 2}
        tm.release("lease-2")
        tm.complete_load([a], "req")
        assert refs_of(tm) == {} and tm.pins_held() == {}
        assert tm.lease([absent], "lease-3") == [-1]
        assert tm.pins_held() == {}
        tm.release("lease-3")  # it took no pin: its holder is unknown
        assert tm.stats.stale_peer_completions == 2
        tm.complete_store([writing], True)
        assert_consistent(tm)


def test_admit_reserves_writes_that_only_their_holder_commits():
    with Rig(num_slots=8) as rig:
        tm = rig.tm
        present, k1, k2, k3 = keys_for(4, seed=6)
        rig.store([present])
        slots = tm.admit([present, k1, k2, k1, k3], "push-1")
        assert slots[0] == -1 and slots[3] == -1  # present; repeated
        s1, s2, s3 = slots[1], slots[2], slots[4]
        assert min(s1, s2, s3) >= 0 and len({s1, s2, s3}) == 3
        assert all(tm.host.state[s] == WRITING for s in (s1, s2, s3))
        assert tm.lookup(k1, "req") is PENDING
        assert served(tm, [k1]) == [pm.PENDING]
        plan = tm.prepare_store([k1, k2])  # the engine does not write over a pull
        assert plan is not None and plan.keys == []
        assert tm.admit([k1], "push-2") == [-1]

        rig.arena.rows[s1] = payload(k1, rig.row_bytes)
        assert tm.commit([k1], "push-2", True) == []  # another holder's write: ignored
        assert tm.stats.stale_peer_completions == 1
        assert tm.host.state[s1] == WRITING
        assert tm.commit([k1], "push-1", True) == [k1]
        assert tm.lookup(k1, "req") is HIT
        assert np.array_equal(rig.read([k1])[0], payload(k1, rig.row_bytes))
        assert tm.commit([k2, k3], "push-1", False) == []
        assert k2 not in tm.host.index and k3 not in tm.host.index
        assert tm.commit([k1], "push-1", True) == []  # a second commit: stale
        assert tm.stats.peer_committed == 1 and tm.stats.peer_commit_failures == 2
        assert_consistent(tm)


def test_admit_gives_the_first_keys_the_room_there_is():
    with Rig(num_slots=4) as rig:
        tm = rig.tm
        held = keys_for(3, seed=7)
        rig.store(held)
        tm.lease(held[:2], "lease-1")  # 2 pinned, 1 evictable, 1 free
        pushed = keys_for(4, seed=8)
        slots = tm.admit([held[2], *pushed], "push-1")
        # held[2] is present (and protected); of the rest, 1 free + 0 evictable = 1 fits
        assert slots[0] == -1
        assert slots[1] >= 0 and slots[2:] == [-1, -1, -1]
        assert held[2] in tm.host.index
        tm.commit(pushed[:1], "push-1", False)
        tm.release("lease-1")
        assert_consistent(tm)


def test_reset_with_leases_and_admissions_outstanding_quarantines_their_slots():
    with Rig(num_slots=4) as rig:
        tm = rig.tm
        leased, other = keys_for(2, seed=9)
        rig.store([leased, other])
        (ls,) = tm.lease([leased], "lease-1")
        (pushed,) = keys_for(1, seed=10)
        (ps,) = tm.admit([pushed], "push-1")
        assert ls >= 0 and ps >= 0

        tm.reset_cache()
        assert len(tm.host.index) == 0
        assert tm.host.quarantined[ls] and tm.host.quarantined[ps]
        assert tm.pins_held() == refs_of(tm) == {ls: 1}
        assert tm.busy_slots() >= {ls, ps}
        assert tm.admit([pushed], "push-2") == [-1]  # its quarantined write still holds the key
        # every free slot is used by new chunks: none lands in a quarantined slot
        fresh = keys_for(2, seed=11)
        plan = tm.prepare_store(fresh)
        assert plan is not None and not {ls, ps} & set(plan.slots)
        tm.complete_store(plan.keys, True)
        assert tm.prepare_store(keys_for(1, seed=12)) is not None  # evicts one of fresh

        assert tm.commit([pushed], "push-1", True) == []  # forgotten by the reset: not published
        assert pushed not in tm.host.index and not tm.host.quarantined[ps]
        tm.release("lease-1")
        assert not tm.host.quarantined[ls] and sum(tm.host.quarantined) == 0
        assert tm.pins_held() == refs_of(tm) == {}
        assert_consistent(tm)


def test_engine_and_serving_threads_drive_the_manager_at_once_and_end_consistent(tmp_path):
    """The engine thread stores, looks up, loads and steps; a second thread (the p2p node's
    role) serves lookups, leases, admits and commits pushes, and polls for its promotions. Bytes a
    holder sees under its pin are the chunk's own, and the bookkeeping ends consistent."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=48) as rig:
        tm, rows, nbytes = rig.tm, rig.arena.rows, rig.row_bytes
        universe = keys_for(160, seed=13)
        pushed = keys_for(32, seed=14)
        errors: list[BaseException] = []
        rig.wait_workers_ready()
        for i in range(0, len(universe), 4):  # most of them end up in the fs tier only
            rig.store(universe[i : i + 4])

        def check(key, slot):
            if not np.array_equal(rows[slot], payload(key, nbytes)):
                raise AssertionError(f"slot {slot} does not hold {key.hex()[:12]} under its pin")

        def engine(rng: random.Random) -> None:
            for i in range(1500):
                keys = rng.sample(universe, rng.randint(1, 4))
                op = rng.random()
                if op < 0.4:
                    plan = tm.prepare_store(keys, f"s{i}")
                    if plan is not None:
                        for k, s in zip(plan.keys, plan.slots):
                            rows[s] = payload(k, nbytes)
                        tm.complete_store(plan.keys, True, f"s{i}")
                elif op < 0.8:
                    req = f"r{i % 5}"  # a few requests, asking again and again
                    hits = [k for k in keys if tm.lookup(k, req) is HIT]
                    if hits:
                        slots = tm.prepare_load(hits, req)
                        for k, s in zip(hits, slots):
                            check(k, s)
                        tm.complete_load(hits, req)
                else:
                    tm.step()

        def serving(rng: random.Random) -> None:
            for i in range(1500):
                keys = rng.sample(universe, rng.randint(1, 4))
                op = rng.random()
                if op < 0.4:
                    tm.serve_lookup(keys, "peer")
                elif op < 0.8:
                    holder = f"lease-{i}"
                    keys += rng.sample(pushed, 2)
                    slots = tm.lease(keys, holder)
                    for k, s in zip(keys, slots):
                        if s >= 0:
                            check(k, s)
                    if any(s >= 0 for s in slots):  # a lease that pinned nothing has no holder
                        tm.release(holder)
                else:
                    holder = f"push-{i}"
                    offer = rng.sample(pushed, rng.randint(1, 3))
                    slots = tm.admit(offer, holder)
                    got = [(k, s) for k, s in zip(offer, slots) if s >= 0]
                    for k, s in got:
                        rows[s] = payload(k, nbytes)  # the pull's bytes
                    tm.commit([k for k, _ in got], holder, rng.random() < 0.8)
                if tm.serving_promotions():
                    tm.poll()

        def run(fn, seed):
            try:
                fn(random.Random(seed))
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=run, args=(engine, 1)),
            threading.Thread(target=run, args=(serving, 2)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
            assert not t.is_alive(), "a thread did not finish"
        assert not errors, errors
        assert tm.wait_idle(120)
        assert tm.serving_promotions() == 0
        # how much of each kind happened depends on the interleaving; only that both threads ran
        assert tm.stats.peer_lookups > 0 and tm.stats.host_queries > 0
        assert tm.pins_held() == refs_of(tm) == {}
        assert_consistent(tm)
        for k, s in tm.host.index.items():  # every chunk held is its own bytes
            if tm.host.state[s] == READY:
                check(k, s)
