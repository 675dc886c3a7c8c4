"""Promotion holds (config ``promotion_hold_steps``, docs/profiles/thrash.md): a chunk promoted from
a secondary tier for a request stays in the host tier until that request has loaded it; requests
that asked later wait (RETRY) instead of evicting it, for a bounded number of steps; the oldest
request never waits; a store evicts held chunks only when nothing else makes room; the holds of a
request that stops asking lapse. Real fs tier with worker processes; no timings."""

from __future__ import annotations

import pytest
from helpers import HIT, MISS, PENDING, RETRY, Rig, fs_tier, keys_for, vllm_or_skip

from kvoffload.policies import LRUPolicy


def _only_in_fs(rig: Rig, keys: list[bytes]) -> None:
    """Store ``keys`` (written through to the fs tier), then drop them from the host tier."""
    for i in range(0, len(keys), 2):
        rig.store(keys[i : i + 2])
        assert rig.tm.host.remove(keys[i : i + 2]) == keys[i : i + 2]


def _landed(rig: Rig) -> None:
    """Until every promotion in flight has landed (applied by polls, no scheduler step)."""
    assert rig.tm.wait_idle(120), "tier jobs did not finish"


def _promoted_for_a(rig: Rig, a: list[bytes]) -> None:
    """Request ``a`` looks up its chunks (each promoted and held for it), a step hands the
    promotions to the fs tier, and they land."""
    assert [rig.tm.lookup(k, "a") for k in a] == [PENDING] * len(a)
    rig.tm.step()
    _landed(rig)


def test_a_chunk_promoted_for_a_request_is_kept_until_it_loads_and_later_requests_wait(tmp_path):
    """Host tier of 4 slots (holds may take 2: tier_pin_fraction 0.5 leaves them). Request a's
    two chunks are promoted and held; b, asking later, is told RETRY (not MISS: its chunks are in
    the fs tier) and evicts nothing of a's; once a has loaded its chunks, b's are promoted. Every
    chunk is loaded from the fs tier once."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        a, b = keys_for(2, seed=1), keys_for(2, seed=2)
        _only_in_fs(rig, a + b)
        assert [tm.lookup(k, "a") for k in a] == [PENDING, PENDING]
        assert [tm.lookup(k, "b") for k in b] == [RETRY, RETRY]
        tm.step()
        _landed(rig)
        assert [tm.lookup(k, "a") for k in a] == [HIT, HIT]
        assert [tm.lookup(k, "b") for k in b] == [RETRY, RETRY]
        assert tm.stats.promotion_waits == 4
        ms = tm.refresh_metrics()  # what Prometheus is shown
        assert ms.get("kvoffload_promotion_waits") == 4
        assert ms.get("kvoffload_promotion_holds") == 2
        tm.step()
        tm.prepare_load(a, "a")  # a is scheduled: the accelerator copies its chunks
        assert [tm.lookup(k, "b") for k in b] == [RETRY, RETRY]  # still a's until copied
        tm.complete_load(a, "a")
        assert [tm.lookup(k, "b") for k in b] == [PENDING, PENDING]
        tm.step()
        _landed(rig)
        assert [tm.lookup(k, "b") for k in b] == [HIT, HIT]
        assert [tm.lookup(k, "a") for k in a] == [HIT, HIT]  # nothing of a's was evicted
        assert tm.stats.promotions["fs"] == 4  # each chunk loaded from the fs tier once
        assert tm.stats.evicted_holds == tm.stats.promotion_alloc_failures == 0
        ms = tm.refresh_metrics()
        assert ms.get("kvoffload_promotion_holds") == 2  # b's, until b loads them
        assert ms.get("kvoffload_promotion_hold_losses", "evicted") == 0


def test_the_oldest_request_never_waits_and_a_wait_is_bounded(tmp_path):
    """The request that asked first goes on promoting past the holds' share (unheld), so it is
    never told to wait for itself; a later request waits at most ``promotion_hold_steps`` steps,
    then gets MISS (it recomputes), even while the holder keeps asking (CASES C36's rule: no
    request waits forever)."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4, promotion_hold_steps=3) as rig:
        tm = rig.tm
        a, b = keys_for(3, seed=1), keys_for(1, seed=2)
        _only_in_fs(rig, a + b)
        assert [tm.lookup(k, "a") for k in a] == [PENDING] * 3  # 2 held, the third unheld
        verdicts = []
        for _ in range(6):
            verdicts.append(tm.lookup(b[0], "b"))
            tm.step()
            assert [tm.lookup(k, "a") for k in a[:2]] != [MISS, MISS]  # a's holds live on
        assert verdicts[:4] == [RETRY] * 4 and verdicts[4:] == [MISS, MISS]
        assert tm.stats.promotion_alloc_failures == 2


def test_holds_lapse_when_their_request_stops_asking(tmp_path):
    """A request that does not look its held chunks up for ``promotion_hold_steps`` steps (it was
    aborted without a finish, or went elsewhere) loses its holds: the next request promotes."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4, promotion_hold_steps=2) as rig:
        tm = rig.tm
        a, b = keys_for(2, seed=1), keys_for(2, seed=2)
        _only_in_fs(rig, a + b)
        _promoted_for_a(rig, a)
        assert [tm.lookup(k, "b") for k in b] == [RETRY, RETRY]
        for _ in range(3):
            tm.step()
        assert tm.stats.expired_holds == 2
        assert tm.refresh_metrics().get("kvoffload_promotion_hold_losses", "expired") == 2
        assert [tm.lookup(k, "b") for k in b] == [PENDING, PENDING]


def test_a_finished_request_leaves_no_holds(tmp_path):
    """A request that finishes (or is aborted) before loading its promoted chunks gives their
    holds up at once; nothing is kept for it."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        a, b = keys_for(2, seed=1), keys_for(2, seed=2)
        _only_in_fs(rig, a + b)
        assert [tm.lookup(k, "a") for k in a] == [PENDING, PENDING]
        assert [tm.lookup(k, "b") for k in b] == [RETRY, RETRY]
        tm.on_request_finished("a")
        tm.on_request_finished("b")
        assert not tm.holds.chunks and not tm.holds.slots and not tm.holds.requests()
        assert [tm.lookup(k, "b") for k in b] == [PENDING, PENDING]


def test_a_store_evicts_held_chunks_only_when_nothing_else_makes_room(tmp_path):
    """CASES C37's rule kept with holds: the host tier always takes new chunks. A store evicts
    unheld chunks first (the least recently used one is a held chunk here), held ones only when
    every other slot is pinned; those holds end (counted) and their chunk is promoted again when
    asked."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        a = keys_for(2, seed=1)
        _only_in_fs(rig, a)
        _promoted_for_a(rig, a)
        old = keys_for(2, seed=3)
        rig.store(old)  # the two free slots; a's chunks are the least recently used
        new = keys_for(2, seed=4)
        plan = tm.prepare_store(new, "w")
        assert plan is not None and sorted(plan.evicted) == sorted(old)
        tm.complete_store(plan.keys, True, "w")
        assert tm.wait_idle(120)
        assert [tm.lookup(k, "a") for k in a] == [HIT, HIT]
        tm.prepare_load(new, "x")  # pinned by an accelerator copy: only a's chunks are evictable
        plan = tm.prepare_store(keys_for(2, seed=5), "w")
        assert plan is not None and sorted(plan.evicted) == sorted(a)
        assert tm.stats.evicted_holds == 2
        assert tm.refresh_metrics().get("kvoffload_promotion_hold_losses", "evicted") == 2
        tm.complete_store(plan.keys, True, "w")
        tm.complete_load(new, "x")
        assert tm.wait_idle(120)
        assert [tm.lookup(k, "a") for k in a] == [PENDING, PENDING]  # promoted again


def test_a_store_of_chunks_the_fs_tier_holds_does_not_evict_held_chunks(tmp_path):
    """A request's recomputed tail is offered for store again although the fs tier already holds
    it (only its prefix was loaded). Where taking it would evict chunks promoted for a waiting
    request, the host tier leaves it to the fs tier (refused, reason ``in_tier``) and keeps the
    held chunks; a tail the fs tier does not hold is still taken (CASES C37: the host tier always
    takes new chunks)."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        tm = rig.tm
        a, tail = keys_for(2, seed=1), keys_for(2, seed=5)
        _only_in_fs(rig, a + tail)
        _promoted_for_a(rig, a)
        new = keys_for(2, seed=4)
        rig.store(new)
        tm.prepare_load(new, "x")  # pinned by an accelerator copy: only a's chunks are evictable
        plan = tm.prepare_store(tail, "w")
        assert plan is not None and plan.keys == [] and plan.evicted == []
        assert [tm.lookup(k, "a") for k in a] == [HIT, HIT]  # nothing of a's was evicted
        assert tm.stats.evicted_holds == 0
        assert tm.refresh_metrics().get("kvoffload_refused_chunks", "host", "store", "in_tier") == 2
        fresh = keys_for(2, seed=6)  # not in the fs tier: taken, evicting a's held chunks
        plan = tm.prepare_store(fresh, "w")
        assert plan is not None and plan.keys == fresh and sorted(plan.evicted) == sorted(a)
        assert tm.stats.evicted_holds == 2
        tm.complete_store(plan.keys, True, "w")
        tm.complete_load(new, "x")
        assert tm.wait_idle(120)
        assert [tm.lookup(k, "t") for k in tail] == [PENDING, PENDING]  # still served by fs


def test_without_holds_a_promotion_with_no_room_is_a_miss(tmp_path):
    """``promotion_hold_steps: 0``: the behaviour before holds. A promoted chunk is evictable at
    once and a request that finds no room is told MISS (it recomputes), never RETRY."""
    with Rig([fs_tier(tmp_path / "fs")], num_slots=2, promotion_hold_steps=0) as rig:
        tm = rig.tm
        a, b = keys_for(2, seed=1), keys_for(2, seed=2)
        _only_in_fs(rig, a + b)
        assert [tm.lookup(k, "a") for k in a] == [PENDING, PENDING]
        assert tm.lookup(b[0], "b") is MISS
        tm.step()
        _landed(rig)
        assert [tm.lookup(k, "b") for k in b] == [PENDING, PENDING]  # a's chunks evicted
        assert tm.stats.promotion_waits == 0


class _ScanCounting(dict):
    """A dict that counts the passes over it (iteration, keys, values, items)."""

    scans = 0

    def __iter__(self):
        self.scans += 1
        return super().__iter__()

    def keys(self):
        self.scans += 1
        return super().keys()

    def values(self):
        self.scans += 1
        return super().values()

    def items(self):
        self.scans += 1
        return super().items()


class SetOpsLRU(LRUPolicy):
    """An out-of-tree policy written to the protocol as it always read: ``protected`` is a set
    (set operations on it). Out-of-tree, a subclass included: it gets a set, and the tiering
    manager counts the protected slots itself."""

    def evict(self, n, protected, keys):
        assert isinstance(protected, set), type(protected)
        return super().evict(n, protected | set(), keys)


@pytest.mark.parametrize("policy", ["lru", "arc", "SetOpsLRU"])
def test_a_promotion_costs_the_same_however_many_chunks_are_held(tmp_path, policy):
    """Promotions into a full host tier while many chunks are held (a long prompt's, promoted
    and not loaded yet) read the holds by slot only: no promotion passes over them. (Each used
    to build the set of protected slots from every hold and count the evictable ones in it, so
    a prompt of n chunks cost O(n^2); an out-of-tree policy, which gets a set, still costs that.) What a promotion may evict is unchanged: a younger request's promotions evict
    other chunks, never those held for the older request, and its own chunks land."""
    module = (
        {"cache_policy_module_path": "integration.test_promotion_holds"}
        if "SetOps" in policy
        else {}
    )
    with Rig(
        [fs_tier(tmp_path / "fs")], num_slots=64, tier_pin_fraction=0.1, policy=policy, **module
    ) as rig:
        tm = rig.tm
        a, b = keys_for(40, seed=1), keys_for(12, seed=2)
        _only_in_fs(rig, a + b)
        for i in range(0, 64, 8):  # the host tier full of other chunks
            rig.store(keys_for(8, seed=100 + i))
        assert tm.wait_idle(120)
        assert tm.host.num_used == tm.host.num_slots
        held = tm.holds.slots = _ScanCounting(tm.holds.slots)
        assert [tm.lookup(k, "a") for k in a] == [PENDING] * len(a)
        assert [tm.lookup(k, "b") for k in b] == [PENDING] * len(b)
        assert (held.scans > 0) if "SetOps" in policy else (held.scans == 0)
        assert len(held) == len(a) + len(b)
        tm.step()
        _landed(rig)
        assert [tm.lookup(k, "a") for k in a] == [HIT] * len(a)  # none evicted by b's
        assert [tm.lookup(k, "b") for k in b] == [HIT] * len(b)
        assert tm.stats.promotions["fs"] == len(a) + len(b)
        assert tm.stats.evicted_holds == tm.stats.promotion_alloc_failures == 0


@pytest.mark.parametrize("case", ["16x(6+2/turn) chunks, host 24, device 24"])
def test_requests_past_the_host_tier_load_each_chunk_from_the_fs_tier_about_once(tmp_path, case):
    """``kvoffload bench thrash``'s model of vLLM's scheduler over the vLLM plug-in's manager
    (every step waits for its tier jobs, so the counts do not depend on the machine's speed):
    16 conversations whose prompts each fit the 24-slot host tier but not all together. Without
    holds the host and fs tiers evict each other's chunks (well over one fs load per chunk
    served, most prompts recomputed); with them, at most 1.1 fs loads per chunk served and most
    of every prompt is served. Every row loaded holds its chunk's bytes."""
    vllm_or_skip()
    from kvoffload.tools.bench.thrash import CASES, run_case

    without = run_case(tmp_path, hold_steps=0, step_s=0, settle=True, **CASES[case])
    held = run_case(tmp_path, step_s=0, settle=True, **CASES[case])
    for r in (without, held):
        assert r["finished"] and r["wrong_rows"] == 0
    assert without["fs_loads"] > 2 * without["served_chunks"]
    assert held["fs_loads"] <= 1.1 * held["served_chunks"]
    assert held["cached_share"] >= 0.8 > without["cached_share"]
