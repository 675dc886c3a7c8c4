"""Host tier slot table and eviction with a tiering manager on a real arena: a request aborted after
its lookups leaves nothing pinned (C12), and a store batch that does not fit keeps its longest
prefix. The slot table and the LRU / ARC policies alone are tests/unit/test_policies.py."""

import pytest
from helpers import PENDING, keys_for


def test_c12_aborted_requests_leave_nothing_pinned_and_nothing_behind(tmp_path):
    """Lookups never pin (a pin is taken by a load and dropped when it completes), so a request
    aborted after its lookups holds nothing; its bookkeeping goes when it finishes, also when a
    promotion of its chunks was in flight."""
    from helpers import HIT, RETRY, Rig, fs_tier, wait_until

    with Rig([fs_tier(tmp_path)], num_slots=4) as rig:
        tm = rig.tm
        first = keys_for(4)
        rig.store(first)
        for i in range(10_000):  # lookup / abort cycles: no load, no explicit unpin
            req = f"r{i}"
            assert [tm.lookup(k, req) for k in first] == [HIT] * 4
            tm.on_request_finished(req)
            assert tm.host.num_pinned == 0
        assert tm.refresh_metrics().get("kvoffload_host_slots_pinned") == 0
        # the new stores succeed by evicting K1..K4
        plan = tm.prepare_store(keys_for(4, seed=1))
        assert plan is not None and sorted(plan.evicted) == sorted(first)
        tm.complete_store(plan.keys)
        assert tm.wait_idle(120)
        # requests aborted while their chunk is promoted from the fs tier
        for i, k in enumerate(first * 5):
            req = f"p{i}"
            verdict = wait_until(
                lambda k=k, req=req: (r := tm.lookup(k, req)) is not RETRY and r,
                what="the fs tier's verdict",
                step=tm.step,
            )
            assert verdict in (HIT, PENDING)
            tm.on_request_finished(req)  # aborted: no load
            assert tm.wait_idle(120) and tm.host.lookup(k) is HIT
            assert tm.host.remove([k]) == [k]  # unpinned: removable at once
        assert tm.stats.promotions["fs"] == 20
        assert (
            tm.host.num_pinned == 0 and tm.refresh_metrics().get("kvoffload_host_slots_pinned") == 0
        )
        assert (
            not tm._load_source and not tm._promotions and not tm._jobs
        )  # nothing kept per request
        assert not tm.holds.chunks and not tm.holds.requests()


def test_store_batch_that_does_not_fit_keeps_its_longest_prefix(tmp_path):
    from helpers import Rig

    with Rig([], num_slots=4) as rig:
        keys = keys_for(10)
        plan = rig.tm.prepare_store(keys)
        assert plan is not None and plan.keys == keys[:4]
        rig.tm.complete_store(plan.keys)
        rig.tm.host.pin(keys[:1])  # one slot pinned: only 3 fit now
        plan = rig.tm.prepare_store(keys_for(10, seed=1))
        assert plan.keys == keys_for(10, seed=1)[:3]
        assert rig.tm.stats.store_truncations == 2
        # Nothing can be freed at all: refused.
        rig.tm.complete_store(plan.keys)
        rig.tm.host.pin(plan.keys)
        assert rig.tm.prepare_store(keys_for(2, seed=2)) is None
        assert rig.tm.stats.store_rejections == 1


def _one_request(rig, rid: str, keys: list, batch: int) -> int:
    """One request as vLLM makes it: look up its prefix, load the host hits, store the rest
    ``batch`` chunks a step, finish. Returns the chunks it found."""
    from helpers import HIT, store_steps

    tm = rig.tm
    hits = []
    for k in keys:
        if tm.lookup(k, rid) is not HIT:
            break
        hits.append(k)
    if hits:
        tm.touch(hits, rid)
        tm.prepare_load(hits, rid)
        tm.complete_load(hits, rid)
    store_steps(rig, rid, keys[len(hits) :], batch)
    tm.on_request_finished(rid)
    return len(hits)


def _layout(host, keys: list) -> str:
    """``x`` for a chunk the host tier holds, ``-`` for one it does not, head first."""
    return "".join("x" if host.slot_of(k) is not None else "-" for k in keys)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_c47_a_prefix_tail_is_evicted_before_its_head(policy):
    """CASES C47: a host tier of 12 chunks; two conversations of 8-chunk prefixes come back in
    turn, each storing what it misses 3 chunks a step. Every store evicts from the other
    conversation, its tail first: each prefix the tier holds is usable from its head
    (``xxxx----``, never ``----xxxx``), and every conversation that comes back finds its head
    (4 chunks: the other took 8 of the 12 slots)."""
    from helpers import Rig

    with Rig([], num_slots=12, policy=policy) as rig:
        prefixes = [keys_for(8, seed=470 + i) for i in range(2)]
        found = []
        for turn in range(4):
            for i, keys in enumerate(prefixes):
                found.append(_one_request(rig, f"t{turn}-c{i}", keys, 3))
                for p in prefixes:
                    layout = _layout(rig.tm.host, p)
                    assert "-x" not in layout, f"turn {turn}, conversation {i}: host holds {layout}"
        assert found == [0, 0] + [4] * 6, found


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_c47_a_write_through_does_not_move_chunks_in_the_eviction_order(tmp_path, policy):
    """CASES C47 with an fs tier: every stored chunk is pinned while it is written through and
    unpinned when that ends, in any order; a pin is not a use, so the prefix order holds."""
    from helpers import Rig, fs_tier

    with Rig([fs_tier(tmp_path)], num_slots=12, policy=policy) as rig:
        prefixes = [keys_for(8, seed=480 + i) for i in range(3)]
        for turn in range(3):
            for i, keys in enumerate(prefixes):
                _one_request(rig, f"t{turn}-c{i}", keys, 3)
                assert rig.tm.wait_idle(120)
                for p in prefixes:
                    layout = _layout(rig.tm.host, p)
                    assert "-x" not in layout, f"turn {turn}, conversation {i}: host holds {layout}"


def test_c47_a_peers_leases_take_no_place_among_the_engines_requests():
    """CASES C47: a lease ranks what a peer reads as used now, not as a request of the policy's:
    however many leases a peer holds, the table of the engine's running requests (bounded, its
    oldest forgotten) holds only the engine's."""
    from helpers import Rig

    with Rig([], num_slots=8) as rig:
        tm = rig.tm
        _one_request(rig, "engine", keys_for(4, seed=490), 2)
        keys = keys_for(4, seed=491)
        plan = tm.prepare_store(keys, "r1")
        tm.complete_store(plan.keys, True, "r1")  # r1 runs on
        for i in range(20):  # leases held at once
            assert tm.lease(keys[:2], f"lease:{i}") != [-1, -1]
        assert list(tm.host.policy.ranks.requests) == ["r1"]
        for i in range(20):
            tm.release(f"lease:{i}")
        assert tm.host.num_pinned == 0
