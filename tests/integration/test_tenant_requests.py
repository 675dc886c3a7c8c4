"""Tenants in the tiering manager (kvoffload.tenants, DESIGN.md "Tenants"): a request keeps its
tenant while it runs, a salt-less request id has none, and every exit names the engine's keys
(review of the tenants merge, items 1 and 2)."""

import os

from helpers import HIT, MISS, ROW, Rig, fs_tier, keys_for, wait_until

from kvoffload.tenants import tenant_id, tenant_key
from kvoffload.workers.chunkfile import HEADER_BYTES


def test_a_live_request_keeps_its_tenant_however_many_requests_come_and_go(monkeypatch):
    """Review 1: a running request's tenant was dropped after 65,536 later arrivals (patched to
    4 here): its completions then named other keys, its slots stayed WRITING and a later
    request of its tenant waited on them forever."""
    import kvoffload.tiering as tiering

    monkeypatch.setattr(tiering, "_MAX_COUNTED_REQUESTS", 4)
    keys = keys_for(3, seed=7)
    with Rig(num_slots=16) as rig:
        tm = rig.tm
        tm.set_cache_salt("long", "salt-long")
        plan = tm.prepare_store(keys, "long")
        assert plan is not None and plan.keys == keys
        for i in range(12):  # more arrivals than the bound, live ones and finished ones
            tm.set_cache_salt(f"r{i}", f"salt-{i}")
            if i % 2:
                tm.on_request_finished(f"r{i}")
        assert tm.tenant_of_request("long") == tenant_id("salt-long")
        tm.complete_store(plan.keys, True, "long")
        assert tm.stats.stale_store_completions == 0
        assert not tm._writes
        assert [tm.lookup(k, "long") for k in keys] == [HIT] * 3
        tm.prepare_load(keys, "long")
        tm.complete_load(keys, "long")
        assert tm.pins_held() == {}
        tm.on_request_finished("long")
        tm.set_cache_salt("again", "salt-long")  # its tenant's next request finds them ready
        assert [tm.lookup(k, "again") for k in keys] == [HIT] * 3
        assert [tm.lookup(k, "unsalted") for k in keys] == [MISS] * 3


def test_a_finished_requests_tenant_serves_its_late_completions_then_is_forgotten(monkeypatch):
    import kvoffload.tiering as tiering

    monkeypatch.setattr(tiering, "_MAX_COUNTED_REQUESTS", 4)
    keys = keys_for(2, seed=8)
    with Rig(num_slots=16) as rig:
        tm = rig.tm
        tm.set_cache_salt("a", "salt-a")
        plan = tm.prepare_store(keys, "a")
        tm.on_request_finished("a")  # finished before its store completed (a late completion)
        tm.complete_store(plan.keys, True, "a")
        assert tm.stats.stale_store_completions == 0
        for i in range(5):  # more finished requests than kept: "a" is forgotten
            tm.set_cache_salt(f"r{i}", f"salt-{i}")
            tm.on_request_finished(f"r{i}")
        assert tm.tenant_of_request("a") == ""
        assert len(tm._tenants) == 4


def test_set_cache_salt_without_a_salt_clears_a_reused_request_ids_tenant():
    keys = keys_for(2, seed=9)
    with Rig(num_slots=16) as rig:
        tm = rig.tm
        tm.set_cache_salt("r", "salt-a")
        rig.store(keys, request="r")
        tm.on_request_finished("r")
        for salt in (None, ""):
            tm.set_cache_salt("r", "salt-a")
            tm.set_cache_salt("r", salt)  # the id again, now unsalted: not salt-a's
            assert tm.tenant_of_request("r") == ""
            assert [tm.lookup(k, "r") for k in keys] == [MISS] * 2


def test_exits_name_the_engine_keys_however_many_tenant_keys_were_looked_up(monkeypatch):
    """Review 2: the tenant keys' engine keys were an LRU of 65,536 that lookups (misses
    included) filled: an evicted tenant's chunk then reached vLLM under its tenant key, in a
    store plan's evicted_keys and in take_events. The map is now swept of what nothing holds
    only (its threshold patched to 8 here so that sweeps run)."""
    import kvoffload.tiering as tiering

    monkeypatch.setattr(tiering, "_ENGINE_KEYS_SWEEP_MIN", 8)
    a_keys = keys_for(3, seed=1)
    with Rig(num_slots=4) as rig:
        tm = rig.tm
        tm._sweep_at = 8
        tm.set_cache_salt("a", "salt-a")
        rig.store(a_keys, request="a")
        stored = [k for _n, ev in tm.take_events() if not ev.removed for k in ev.keys]
        assert stored == a_keys
        tm.set_cache_salt("b", "salt-b")
        for k in keys_for(50, seed=2):  # another tenant's misses, swept step by step
            tm.lookup(k, "b")
            tm.step()
        assert len(tm._engine_keys) < 50  # the sweep ran: what no one holds is gone
        evicted = rig.store(keys_for(4, seed=3), request="u")  # evicts a's chunks
        assert sorted(evicted) == sorted(a_keys)
        removed = [k for _n, ev in tm.take_events() if ev.removed for k in ev.keys]
        assert sorted(removed) == sorted(a_keys)
        tm.step()
        assert all(e[0] in a_keys or e[1] == tenant_id("salt-b") for e in tm._engine_keys.values())


def _events(tm) -> tuple[list[bytes], list[bytes]]:
    """The keys of the stored and of the removed events taken now (every tier)."""
    stored, removed = [], []
    for _name, ev in tm.take_events():
        (removed if ev.removed else stored).extend(ev.keys)
    return stored, removed


def test_a_bounded_tiers_evictions_name_the_engine_keys_long_after_the_store(monkeypatch, tmp_path):
    """Review 2: a bounded fs tier holds far more chunks than the host tier; its eviction of a
    tenant's chunk, many sweeps after the store, still names the engine's key."""
    import kvoffload.tiering as tiering

    monkeypatch.setattr(tiering, "_ENGINE_KEYS_SWEEP_MIN", 8)
    fb = HEADER_BYTES + ROW
    a_keys = keys_for(3, seed=1)
    with Rig([fs_tier(tmp_path, max_bytes=3 * fb)], num_slots=4) as rig:
        tm = rig.tm
        tm._sweep_at = 8
        tm.set_cache_salt("a", "salt-a")
        rig.store(a_keys, request="a")
        tm.set_cache_salt("b", "salt-b")
        for k in keys_for(40, seed=2):
            tm.lookup(k, "b")
            tm.step()
        _events(tm)
        for i in range(0, 4, 2):  # unsalted stores push a's chunks out of the host and the fs tier
            rig.store(keys_for(4, seed=3)[i : i + 2])
        wait_until(
            lambda: rig.fs.counters.get("evictions", 0) >= 3,
            what="a's chunks evicted",
            step=tm.poll,
        )
        tm.step()
        _stored, removed = _events(tm)
        tenant_keys = {tenant_key(k, tenant_id("salt-a")) for k in a_keys}
        assert not tenant_keys & set(removed)
        assert removed.count(a_keys[0]) == 2  # host and fs


def test_a_start_scans_tenant_chunks_get_no_event_rather_than_a_wrong_hash(tmp_path):
    """Review 2: a bounded tier's start scan finds a tenant's chunks by their tenant keys; their
    engine keys are known to nobody here: no stored or removed event names them (unsalted
    chunks are announced and removed as before)."""
    fb = HEADER_BYTES + ROW
    a_keys, plain = keys_for(3, seed=1), keys_for(2, seed=5)
    tenant_keys = {tenant_key(k, tenant_id("salt-a")) for k in a_keys}
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=8) as run1:
        run1.tm.set_cache_salt("a", "salt-a")
        run1.store(a_keys, request="a")
        run1.store(plain)
        ns = run1.ns
    with Rig([fs_tier(tmp_path, max_bytes=5 * fb)], num_slots=4, ns=ns) as run2:
        tm = run2.tm
        wait_until(
            lambda: run2.fs.counters.get("adopted_chunks") == 5,
            what="the earlier run's 5 chunks adopted",
            step=tm.poll,
        )
        tm.step()
        stored, removed = _events(tm)
        assert sorted(stored) == sorted(plain)
        for i in range(0, 6, 2):  # evicts every adopted chunk
            run2.store(keys_for(6, seed=3)[i : i + 2])
        wait_until(
            lambda: run2.fs.counters.get("evictions", 0) >= 5, what="adopted evicted", step=tm.poll
        )
        tm.step()
        stored, removed = _events(tm)
        assert not tenant_keys & set(stored + removed)
        assert set(plain) <= set(removed)


def test_a_peers_promotion_of_a_scanned_tenant_chunk_reads_its_tenant_directory(tmp_path):
    """Review 4: a peer's promotion was grouped by the manager's knowledge only: a tenant's chunk
    a bounded tier found by its scan was looked for in the namespace's own directory, missed,
    and the tier stopped counting a chunk that still existed."""
    fb = HEADER_BYTES + ROW
    a_keys = keys_for(2, seed=1)
    tkeys = [tenant_key(k, tenant_id("salt-a")) for k in a_keys]
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=8) as run1:
        run1.tm.set_cache_salt("a", "salt-a")
        run1.store(a_keys, request="a")
        ns = run1.ns
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=8, ns=ns) as run2:
        tm = run2.tm
        wait_until(
            lambda: run2.fs.counters.get("adopted_chunks") == 2, what="adopted", step=tm.poll
        )
        assert all(tm.promote_for_peer(0, k) for k in tkeys)
        tm.step()
        assert tm.wait_idle(120)
        assert all(tm.host.lookup(k) == HIT for k in tkeys)  # landed
        assert all(k in run2.fs.capacity.index for k in tkeys)  # still counted
        assert run2.fs.counters.get("load_failures", 0) == 0


def test_a_bounded_tier_forgets_the_tenant_of_a_chunk_it_stops_counting(tmp_path):
    """Review 5: the tenant of a chunk a bounded tier stopped counting (gone behind its back,
    found missing by a load) was kept for ever."""
    fb = HEADER_BYTES + ROW
    a_keys = keys_for(2, seed=1)
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=2) as rig:
        tm = rig.tm
        tm.set_cache_salt("a", "salt-a")
        rig.store(a_keys, request="a")
        assert len(rig.fs._key_tenants) == 2
        rig.evict_all()
        for root, _dirs, files in os.walk(tmp_path):  # another instance removed them
            if os.path.basename(root).startswith("t-") or "/t-" in root:
                for f in files:
                    os.unlink(os.path.join(root, f))
        tm.on_request_finished("a")
        tm.set_cache_salt("b", "salt-a")
        deadline_lookups = [tm.lookup(k, "b") for k in a_keys]
        assert HIT not in deadline_lookups
        tm.step()
        assert tm.wait_idle(120)
        wait_until(lambda: not rig.fs._key_tenants, what="the tenants forgotten", step=tm.poll)


def test_a_running_requests_tenant_keys_are_computed_once_and_dropped_when_it_finishes(
    monkeypatch,
):
    """Review 8: every call hashed every key again (about 3 µs each: a long prompt's deferred
    lookups repeat it every step). Counted by wrapping the real tenant_key."""
    import kvoffload.tiering as tiering

    calls = []
    real = tiering.tenant_key

    def counted(key, tenant):
        calls.append(key)
        return real(key, tenant)

    monkeypatch.setattr(tiering, "tenant_key", counted)
    keys = keys_for(4, seed=11)
    with Rig(num_slots=16) as rig:
        tm = rig.tm
        tm.set_cache_salt("r", "salt-r")
        for _ in range(5):
            assert [tm.lookup(k, "r") for k in keys] == [MISS] * 4
            tm.step()
        rig.store(keys, request="r")
        assert [tm.lookup(k, "r") for k in keys] == [HIT] * 4
        assert sorted(calls) == sorted(keys)  # once each
        tm.on_request_finished("r")
        assert not tm._req_tenant_keys
        tm.complete_load(keys, "r")  # a late call after it finished keeps nothing
        assert not tm._req_tenant_keys
        tm.set_cache_salt("r2", "salt-r")
        assert [tm.lookup(k, "r2") for k in keys] == [HIT] * 4  # another request: its own
