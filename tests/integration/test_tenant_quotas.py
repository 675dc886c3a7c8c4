"""Per-tenant byte quotas through the tiering manager (DESIGN.md "Tenants"): the host tier, an fs
tier with real worker processes (its files on disk, its start scan), an obj tier against moto on
loopback, and the metrics a scrape exports."""

import glob
import os

import pytest
from helpers import HIT, MISS, ROW, Rig, fs_tier, keys_for, wait_until
from s3 import new_bucket, obj_tier, start_moto

from kvoffload.config import ConfigError
from kvoffload.metrics import OTHER_TENANTS
from kvoffload.tenants import tenant_id
from kvoffload.workers.chunkfile import HEADER_BYTES

FB = HEADER_BYTES + ROW  # one chunk file or object
A, B = tenant_id("salt-a"), tenant_id("salt-b")


def tenant_files(root, tenant: str) -> list[str]:
    return glob.glob(os.path.join(str(root), "*", f"t-{tenant}", "**", "*.kv"), recursive=True)


def salted(rig: Rig, req: str, salt: str, keys: list[bytes]) -> list[bytes]:
    """Store ``keys`` for a request of ``salt`` and finish it; returns the host's evictions."""
    rig.tm.set_cache_salt(req, salt)
    evicted = rig.store(keys, request=req)
    rig.tm.on_request_finished(req)
    return evicted


def test_host_quota_one_tenant_evicts_only_its_own_and_a_pinned_tenant_is_refused():
    with Rig(num_slots=16, host_tenant_quota_bytes=4 * ROW) as rig:
        tm = rig.tm
        b_keys = keys_for(4, seed=2)
        salted(rig, "b", "salt-b", b_keys)
        a_keys = keys_for(12, seed=1)
        for i in range(0, 12, 2):
            salted(rig, f"a{i}", "salt-a", a_keys[i : i + 2])
        tm.set_cache_salt("rb", "salt-b")
        assert [tm.lookup(k, "rb") for k in b_keys] == [HIT] * 4  # the other tenant's survive
        tm.set_cache_salt("ra", "salt-a")
        assert [tm.lookup(k, "ra") for k in a_keys] == [MISS] * 8 + [HIT] * 4
        assert tm.host.quotas.held == {A: 4 * ROW, B: 4 * ROW}
        assert tm.host.num_used == 8  # room was left: the quota evicted, not the tier
        # every chunk of A pinned (being loaded): its next store is refused and counted
        tm.prepare_load(a_keys[8:], "ra")
        tm.set_cache_salt("a-more", "salt-a")
        plan = tm.prepare_store(keys_for(2, seed=3), "a-more")
        assert plan is not None and plan.keys == [] and plan.slots == []
        assert tm.stats.refused[("host", "store", "tenant_quota")] == 2
        tm.complete_load(a_keys[8:], "ra")
        scraped = tm.refresh_metrics()
        assert scraped.get("kvoffload_tenant_bytes", "host", A) == 4 * ROW
        assert scraped.get("kvoffload_tenant_bytes", "host", B) == 4 * ROW
        assert scraped.get("kvoffload_tenant_bytes", "host", OTHER_TENANTS) == 0
        assert scraped.get("kvoffload_tenant_quota_evictions", "host") == 8
        assert scraped.get("kvoffload_tenant_quota_refusals", "host") == 2
        assert scraped.get("kvoffload_refused_chunks", "host", "store", "tenant_quota") == 2
        tm.host.quotas.check()


def test_host_quota_events_name_the_engine_keys_of_a_tenants_evicted_chunks():
    with Rig(num_slots=16, host_tenant_quota_bytes=2 * ROW) as rig:
        tm = rig.tm
        a_keys = keys_for(4, seed=5)
        salted(rig, "a1", "salt-a", a_keys[:2])
        tm.take_events()
        evicted = salted(rig, "a2", "salt-a", a_keys[2:])
        assert sorted(evicted) == sorted(a_keys[:2])  # the store plan names engine keys
        removed = [k for _n, ev in tm.take_events() if ev.removed for k in ev.keys]
        assert sorted(removed) == sorted(a_keys[:2])


def test_without_quotas_the_host_tier_counts_no_tenant_and_exports_no_series():
    with Rig(num_slots=8) as rig:
        salted(rig, "a", "salt-a", keys_for(4, seed=1))
        assert rig.tm.host.quotas is None
        scraped = rig.tm.refresh_metrics()
        assert scraped.values["kvoffload_tenant_bytes"] == {}


def test_fs_quota_evicts_the_tenants_own_files_and_a_restart_scan_counts_them(tmp_path):
    tiers = [fs_tier(tmp_path, max_bytes=40 * FB, tenant_quota_bytes=3 * FB)]
    with Rig(tiers, num_slots=32) as rig:
        b_keys = keys_for(3, seed=2)
        salted(rig, "b", "salt-b", b_keys)
        a_keys = keys_for(9, seed=1)
        for i in range(0, 9, 3):
            salted(rig, f"a{i}", "salt-a", a_keys[i : i + 3])
        fs = rig.fs
        wait_until(
            lambda: len(tenant_files(tmp_path, A)) == 3,
            what="A's oldest files deleted",
            step=rig.tm.poll,
        )
        assert len(tenant_files(tmp_path, B)) == 3  # the other tenant's files survive
        assert fs.capacity.quotas.held == {A: 3 * FB, B: 3 * FB}
        assert fs.counters["tenant_quota_evictions"] == 6 and fs.counters["evictions"] == 6
        # A's newest are the ones kept: reloaded from the fs tier after the host lost them
        rig.tm.host.remove([k for k in rig.tm.host.index])
        rig.tm.set_cache_salt("req", "salt-a")  # resolve looks up for request "req"
        assert rig.resolve(a_keys[6:]) == [HIT] * 3
        scraped = rig.tm.refresh_metrics()
        assert scraped.get("kvoffload_tenant_bytes", "fs", A) == 3 * FB
        assert scraped.get("kvoffload_tenant_quota_evictions", "fs") == 6
        ns = rig.ns
    # a restart with a lower quota for A: its start scan counts A's files and evicts down to it
    tiers = [fs_tier(tmp_path, max_bytes=40 * FB, tenant_quotas={A: FB})]
    with Rig(tiers, num_slots=8, ns=ns) as again:
        wait_until(
            lambda: len(tenant_files(tmp_path, A)) == 1,
            what="A's files past its new quota deleted",
            step=again.tm.poll,
        )
        quotas = again.fs.capacity.quotas
        assert quotas.held == {A: FB, B: 3 * FB}  # B has no quota here: counted, not limited
        assert len(tenant_files(tmp_path, B)) == 3
        quotas.check()


def test_fs_quota_refuses_a_tenant_whose_chunks_are_all_loading(tmp_path):
    tiers = [fs_tier(tmp_path, max_bytes=40 * FB, tenant_quota_bytes=2 * FB)]
    with Rig(tiers, num_slots=32) as rig:
        tm, fs = rig.tm, rig.fs
        a_keys = keys_for(4, seed=1)
        salted(rig, "a1", "salt-a", a_keys[:2])
        tenant_keys = [k for k in fs.capacity.index]
        fs.capacity.loads_started(tenant_keys)  # as a load job in flight does
        salted(rig, "a2", "salt-a", a_keys[2:])
        assert fs.counters["tenant_quota_refusals"] == 2
        assert tm.stats.failed.get(("fs", "store", "tenant_quota")) == 2
        fs.capacity.loads_done(tenant_keys, {})
        assert len(tenant_files(tmp_path, A)) == 2 and fs.capacity.quotas.held == {A: 2 * FB}


def test_a_quota_on_a_tier_without_its_capacity_ledger_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"tenant_quota_bytes: .*capacity ledger.*max_bytes"):
        Rig([fs_tier(tmp_path, max_bytes="unbounded", tenant_quota_bytes=FB)])
    with pytest.raises(ValueError, match=r"tenant_quota_bytes: .*smaller than one chunk"):
        Rig([fs_tier(tmp_path, max_bytes=10 * FB, tenant_quota_bytes=FB - 1)])
    with pytest.raises(ValueError, match=r"host_tenant_quota_bytes: .*smaller than one host slot"):
        Rig(num_slots=4, host_tenant_quota_bytes=ROW - 1)


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def test_obj_quota_evicts_the_tenants_own_objects(moto):
    bucket = new_bucket(moto)
    tiers = [obj_tier(moto, bucket, max_bytes=40 * FB, tenant_quota_bytes=2 * FB)]
    with Rig(tiers, num_slots=32) as rig:
        salted(rig, "b", "salt-b", keys_for(2, seed=2))
        a_keys = keys_for(6, seed=1)
        for i in range(0, 6, 2):
            salted(rig, f"a{i}", "salt-a", a_keys[i : i + 2])
        obj = rig.fs
        assert obj.capacity.quotas.held == {A: 2 * FB, B: 2 * FB}
        assert obj.counters["tenant_quota_evictions"] == 4
        rig.tm.host.remove([k for k in rig.tm.host.index])
        rig.tm.set_cache_salt("req", "salt-a")  # resolve looks up for request "req"
        assert rig.resolve(a_keys[4:]) == [HIT] * 2
        rig.tm.on_request_finished("req")
        rig.tm.set_cache_salt("req", "salt-b")
        assert rig.resolve(keys_for(2, seed=2)) == [HIT] * 2


def test_under_vllm_the_named_tenants_bytes_reach_its_stats_and_no_other_tenants():
    """vLLM's ``get_stats`` path (its own ``OffloadingConnectorStats`` aggregates what the
    manager hands it): the tenant a quota override names has its bytes there; a tenant only the
    default quota limits does not (vLLM's exporter never drops a label set), though it is on
    kvoffload's own endpoint."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    with Rig(num_slots=16, host_tenant_quota_bytes=4 * ROW, host_tenant_quotas={A: 6 * ROW}) as rig:
        salted(rig, "a", "salt-a", keys_for(5, seed=1))
        salted(rig, "b", "salt-b", keys_for(3, seed=2))
        own = rig.tm.refresh_metrics()
        assert own.get("kvoffload_tenant_bytes", "host", B) == 3 * ROW
        got = OffloadingConnectorStats(data=rig.tm.take_metric_stats())
        assert got.data["data"]["kvoffload_tenant_bytes"] == {("host", A): 5 * ROW}
