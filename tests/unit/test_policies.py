"""Host tier slot table and LRU / ARC eviction, in process. With a tiering manager on a real arena:
tests/integration/test_policies.py."""

import pytest
from helpers import keys_for
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.host import READY, WRITING, HostTier
from kvoffload.policies import ARCPolicy, LRUPolicy, make_policy
from kvoffload.tiers.base import LookupResult


def tier(n, policy="lru"):
    return HostTier(n, make_policy(policy, n))


def put(host, keys):
    plan = host.allocate(keys)
    assert plan is not None
    host.complete_write(plan.keys, True)
    return plan


def test_states_and_pins():
    h = tier(2)
    k = keys_for(3)
    plan = h.allocate(k[:1])
    assert h.lookup(k[0]) is LookupResult.HIT_PENDING and h.state[plan.slots[0]] == WRITING
    h.complete_write(k[:1], True)
    assert h.lookup(k[0]) is LookupResult.HIT and h.num_evictable == 1
    h.pin(k[:1])
    assert h.num_pinned == 1 and h.num_evictable == 0
    put(h, k[1:2])
    assert h.allocate(k[2:3]).evicted == [k[1]]  # the pinned chunk is never chosen
    h.unpin(k[:1])
    assert h.num_pinned == 0
    with pytest.raises(KeyError):
        h.pin(k[2:3])  # still WRITING


def test_failed_write_frees_slot():
    h = tier(1)
    k = keys_for(2)
    h.allocate(k[:1])
    h.complete_write(k[:1], False)
    assert h.lookup(k[0]) is LookupResult.MISS and h.num_used == 0
    assert h.allocate(k[1:2]) is not None


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_c11_store_batch_never_evicts_its_own_keys(policy):
    k2, k3, k4, kx, ky = keys_for(5)
    h = tier(3, policy)
    for k in (k2, kx, ky):
        put(h, [k])
    if policy == "arc":
        h.access([kx])
        h.access([kx])
    plan = h.allocate([k2, k3, k4])
    assert plan is not None
    h.complete_write(plan.keys, True)
    assert sorted(plan.evicted) == sorted([kx, ky])
    for k in (k2, k3, k4):
        assert h.lookup(k) is LookupResult.HIT
    # Not enough unprotected room: "no space", nothing evicted.
    h.pin([k3])
    assert h.allocate([k2, k4, *keys_for(2, seed=5)]) is None
    for k in (k2, k3, k4):
        assert h.lookup(k) is LookupResult.HIT


def test_c23_full_tier_with_everything_pinned_answers_at_once():
    n = 200_000
    h = HostTier(n, LRUPolicy(n), record_events=False)
    keys = [i.to_bytes(8, "big") for i in range(n)]
    for start in range(0, n, 10_000):
        put(h, keys[start : start + 10_000])
    h.pin(keys)
    calls = 0
    real_evict = h.policy.evict

    def counting_evict(*a, **kw):
        nonlocal calls
        calls += 1
        return real_evict(*a, **kw)

    h.policy.evict = counting_evict
    new = b"new-chunk"
    for _ in range(1000):
        assert h.allocate([new]) is None
    # O(1): the refusal comes from the pinned count alone (its cost per call is in `bench engine`)
    assert calls == 0, "a full, fully pinned tier must not even ask the policy"
    h.unpin([keys[123]])
    plan = h.allocate([new])
    assert plan.evicted == [keys[123]]


def test_lru_order():
    h = tier(3)
    a, b, c, d = keys_for(4)
    for k in (a, b, c):
        put(h, [k])
    h.access([a])
    assert h.allocate([d]).evicted == [b]


def test_arc_moves_repeated_chunks_to_frequent_list_and_adapts():
    n = 4
    pol = ARCPolicy(n)
    h = HostTier(n, pol)
    ks = keys_for(12)
    for k in ks[:4]:
        put(h, [k])
    h.access([ks[0]])
    assert pol.t2_size == 1 and pol.t1_size == 3
    # Scan of one-time chunks evicts from T1, not the frequent chunk.
    for k in ks[4:8]:
        plan = put(h, [k])
        assert ks[0] not in plan.evicted
    assert h.lookup(ks[0]) is LookupResult.HIT
    # A ghost hit in B1 raises the recency target p.
    p0 = pol.p
    ghost = next(k for k in ks[1:4] if k in pol.b1)
    put(h, [ghost])
    assert pol.p > p0


class Model:
    """Reference model: key -> (state, pins)."""


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "fail", "pin", "unpin", "access", "remove", "finish"]),
            st.lists(st.integers(0, 11), min_size=1, max_size=4),
            st.sampled_from(["", "a", "b"]),  # the request (none, or one of two)
        ),
        max_size=120,
    ),
    st.sampled_from(["lru", "arc"]),
)
def test_host_tier_invariants_under_random_operations(ops, policy):
    n = 5
    h = tier(n, policy)
    pool = keys_for(12)
    pins: dict[bytes, int] = {}
    for op, idxs, req in ops:
        ks = list(dict.fromkeys(pool[i] for i in idxs))
        if op in ("store", "fail"):
            before_pinned = {k for k, c in pins.items() if c}
            plan = h.allocate(ks)
            if plan is not None:
                assert not set(plan.evicted) & set(ks)
                assert not set(plan.evicted) & before_pinned
                if req:
                    h.order(ks, req)
                h.complete_write(plan.keys, op == "store", req)
        elif op == "pin":
            ready = [k for k in ks if h.lookup(k) is LookupResult.HIT]
            h.pin(ready)
            for k in ready:
                pins[k] = pins.get(k, 0) + 1
        elif op == "unpin":
            for k in ks:
                if pins.get(k):
                    h.unpin([k])
                    pins[k] -= 1
        elif op == "access":
            h.access(ks, req)
        elif op == "remove":
            for k in h.remove(ks):
                assert not pins.get(k)
        elif op == "finish":
            h.request_finished(req)
        # invariants
        ready_unpinned = sum(
            1 for k, s in h.index.items() if h.state[s] == READY and h.refs[s] == 0
        )
        assert h.num_evictable == ready_unpinned
        assert h.num_pinned == sum(1 for s in h.index.values() if h.refs[s] > 0)
        assert len(h.index) == h.num_used <= n
        for k, c in pins.items():
            if c:
                assert k in h.index
        # the policy's evictable slots are exactly those, each with an entry of its current rank
        pol = h.policy
        heaps = [pol._heap] if policy == "lru" else list(pol._heaps)
        evictable = {s for s in h.index.values() if h.state[s] == READY and h.refs[s] == 0}
        assert set().union(*(hp.members for hp in heaps)) == evictable
        for hp in heaps:
            major, minor = hp.ranks.major, hp.ranks.minor
            assert hp.members <= {s for a, b, s in hp.heap if (major[s], minor[s]) == (a, b)}


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_c47_a_pin_keeps_a_chunks_rank_and_a_request_ranks_its_tail_lowest(policy):
    """CASES C47, in the slot table: a request stores its prefix in two batches; a pin (a
    write-through, a peer's read) released in any order does not move a chunk; while the request
    runs and after it finished, eviction takes its tail first."""
    h = tier(8, policy)
    k = keys_for(8)

    def store(keys, req):
        plan = h.allocate(keys)
        h.order(keys, req)
        h.complete_write(plan.keys, True, req)

    store(k[:4], "a")
    slots = h.pin(k[:4])  # written through, done in another order
    h.unpin_slots([slots[1], slots[3], slots[0], slots[2]])
    store(k[4:6], "a")
    store(k[6:8], "")  # no request's: ranked as used now, above the running request's
    assert h.allocate(keys_for(2, seed=1)).evicted == [k[5], k[4]]  # "a" runs
    h.request_finished("a")  # ranked afresh, its head the most recent
    assert h.allocate(keys_for(2, seed=2)).evicted == [k[7], k[6]]
    assert h.allocate(keys_for(3, seed=3)).evicted == [k[3], k[2], k[1]]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_c47_a_store_that_completes_after_its_request_finished_keeps_the_order(policy):
    """CASES C47: vLLM reports a request finished before its last store's copy ends; that late
    completion neither brings the request back (its rank frozen for good) nor ranks the tail
    above the head."""
    h = tier(6, policy)
    k = keys_for(6)
    plan = h.allocate(k[:4])
    h.order(k[:4], "r")
    h.complete_write(plan.keys, True, "r")
    plan = h.allocate(k)  # the last step's store
    h.order(k, "r")
    h.request_finished("r")
    h.complete_write(plan.keys, True, "r")  # its copy ends a step later
    assert h.allocate(keys_for(1, seed=1)).evicted == [k[5]]
    assert not h.policy.ranks.requests


def test_c47_arc_evicts_a_tail_counted_as_used_before_its_new_head():
    """CASES C47 in ARC: a request's store finds the tail of its prefix stored (counted as used:
    T2) and stores the head again (new: T1); while ARC evicts from T1, the tail, ranked lower by
    the same request, still goes before the head."""
    h = tier(4, "arc")
    k0, k1, k2 = keys_for(3)

    def store(keys, req):
        plan = h.allocate(keys)
        if req:
            h.order(keys, req)
            written = set(plan.keys)
            h.access([x for x in keys if x not in written and h.lookup(x) is LookupResult.HIT], req)
        h.complete_write(plan.keys, True, req)

    store([k0, k1, k2], "r")
    h.request_finished("r")
    h.pin([k2])  # a write-through reads the tail while the head is evicted
    for u in keys_for(6, seed=2):
        store([u], "")
    h.unpin([k2])
    h.access([k0], "s")
    store([k0, k1, k2], "s")
    victims = h.allocate(keys_for(1, seed=3)).evicted + h.allocate(keys_for(1, seed=4)).evicted
    assert k2 in victims and k1 not in victims, victims


def test_a_subclass_of_lru_is_told_each_slot_through_the_hooks_it_overrides():
    """The host tier tells a batch in one call (``admit_many``, ``make_evictable_many``); an
    out-of-tree subclass of LRU that overrides the per-slot ``admit`` or ``make_evictable`` (here:
    one slot kept from eviction for good) is still told each slot through them, in order."""

    class Sticky(LRUPolicy):
        keep: set[int] = set()
        admitted: list[int] = []

        def admit(self, slot: int, key: bytes) -> None:
            self.admitted.append(slot)
            super().admit(slot, key)

        def make_evictable(self, slot: int) -> None:
            if slot not in self.keep:
                super().make_evictable(slot)

    policy = Sticky(4)
    h = HostTier(4, policy)
    k = keys_for(8)
    plan = put(h, k[:4])
    assert policy.admitted == plan.slots  # each slot, in order
    policy.keep.add(plan.slots[0])
    h.pin(k[:1])
    h.unpin(k[:1])  # evictable again: not to Sticky
    h.access(k[1:4])  # k[0] the least recently used
    put(h, k[4:7])
    assert h.lookup(k[0]) is LookupResult.HIT  # kept; the other three made room
    assert all(h.lookup(key) is LookupResult.MISS for key in k[1:4])
