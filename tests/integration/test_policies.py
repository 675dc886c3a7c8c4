"""Host tier slot table and eviction with a tiering manager on a real arena: a request aborted after
its lookups leaves nothing pinned (C12), and a store batch that does not fit keeps its longest
prefix. The slot table and the LRU / ARC policies alone are tests/unit/test_policies.py."""

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
