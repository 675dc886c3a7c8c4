"""kvoffload's fs and obj tiers inside vLLM's own ``TieringOffloadingSpec`` (kvoffload.vllm.tiers).

vLLM builds the tiers itself (``SecondaryTierFactory`` with ``module_path``) under its real
``TieringOffloadingManager`` and CPU primary tier (a shared-memory region in /dev/shm); the tests drive
vLLM's own request cycle (on_new_request, prepare_store / complete_store, lookup, on_schedule_end,
prepare_load) so the adapters see vLLM's own ``TransferJob`` s. The engine itself never runs: these
run on vLLM 0.33's GPU wheel on a CPU machine (tox -e vllm033).
"""

import dataclasses
import os
import time

import numpy as np
import pytest
from helpers import vllm_or_skip

vllm = vllm_or_skip()
try:
    import kvoffload.vllm.tiers as adapters
except ImportError as e:  # vLLM without the 0.33 secondary-tier API
    pytest.skip(f"vLLM {vllm.__version__}: {e}", allow_module_level=True)

from s3 import ACCESS, SECRET, new_bucket, start_moto  # noqa: E402
from unit.test_vllm_spec import PAGE, offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.workers.chunkfile import HEADER_BYTES  # noqa: E402

MODULE = "kvoffload.vllm.tiers"
ROW = 2 * PAGE  # vLLM's primary row for offloading_config(bpb=2 * PAGE)
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_engines = iter(range(10**6))


def fs_entry(root, **extra):
    return {
        "type": "KVOffloadFsTier",
        "module_path": MODULE,
        "root_dir": str(root),
        "read_workers": 1,
        "write_workers": 1,
        "job_timeout_s": 10.0,
        "min_free_fraction": 0.0,  # helpers.NO_FLOOR: not this disk's free space
        **extra,
    }


def tiering_manager(tier_entry, num_chunks=8):
    """vLLM's own TieringOffloadingSpec and manager with ``tier_entry`` as its secondary tier; each
    call is a new engine (own primary region) with the same model, so they share chunks."""
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * ROW,
        "secondary_tiers": [tier_entry],
    }
    config = dataclasses.replace(
        offloading_config(extra), engine_id=f"kvoffload-test-{os.getpid()}-{next(_engines)}"
    )
    spec = TieringOffloadingSpec(config)
    return spec.get_manager()


def primary_rows(mgr):
    return np.asarray(mgr.primary_tier.get_kv_memoryview()).view(np.uint8).reshape(-1, ROW)


def chunk(key: bytes) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(
        0, 256, ROW, dtype=np.uint8
    )


def keys(n, seed=0):
    return [bytes([seed, i]) * 16 + b"\0\0\0\0" for i in range(n)]


def settle(mgr, timeout_s=30.0):
    """Scheduler steps until no job or probe is in flight (vLLM's has_pending_work)."""
    deadline = time.monotonic() + timeout_s
    mgr.on_schedule_end(STEP)
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "tier jobs did not finish"
        time.sleep(0.005)
        mgr.on_schedule_end(STEP)


def resolve(mgr, key, ctx, timeout_s=30.0):
    """vLLM's lookup cycle: look up once per step until the answer is HIT or MISS."""
    deadline = time.monotonic() + timeout_s
    while True:
        res = mgr.lookup(key, ctx)
        if res in (LookupResult.HIT, LookupResult.MISS) or time.monotonic() > deadline:
            return res
        mgr.on_schedule_end(STEP)
        time.sleep(0.005)


def store_to_files(root, ks):
    """Store ``ks`` through a TieringOffloadingManager with an fs adapter on ``root``, then shut it
    down: the chunks live on only in the files."""
    writer = tiering_manager(fs_entry(root))
    try:
        store(writer, ks)
    finally:
        writer.shutdown()


def store(mgr, ks):
    ctx = ReqContext(req_id="writer")
    mgr.on_new_request(ctx)
    out = mgr.prepare_store(ks, ctx)
    rows = primary_rows(mgr)
    for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
        rows[cid] = chunk(k)
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    settle(mgr)


def load_and_check(mgr, ks):
    ctx = ReqContext(req_id="reader")
    mgr.on_new_request(ctx)
    try:
        assert [resolve(mgr, k, ctx) for k in ks] == [LookupResult.HIT] * len(ks)
        spec = mgr.prepare_load(ks, ctx)
        rows = primary_rows(mgr)
        for k, cid in zip(ks, spec.chunk_ids):
            assert np.array_equal(rows[cid], chunk(k)), "loaded bytes differ"
        mgr.complete_load(ks, ctx)
    finally:
        mgr.on_request_finished(ctx)


def test_vllm_builds_the_fs_tier_from_module_path(tmp_path):
    mgr = tiering_manager(fs_entry(tmp_path, locality="REMOTE"))
    try:
        (tier,) = mgr.secondary_tiers
        assert isinstance(tier, adapters.KVOffloadFsTier)
        assert tier.medium.name == "STORAGE" and tier.locality.value == "REMOTE"
        assert tier.tier.row_bytes == ROW
    finally:
        mgr.shutdown()


def test_fs_store_lookup_load_round_trip_is_byte_exact(tmp_path):
    ks = keys(5)
    store_to_files(tmp_path, ks)
    files = [f for f in tmp_path.rglob("*.kv")]
    assert len(files) == 5 and all(f.stat().st_size == HEADER_BYTES + ROW for f in files)
    reader = tiering_manager(fs_entry(tmp_path))  # a fresh primary tier: every chunk from files
    try:
        ctx = ReqContext(req_id="probe")
        reader.on_new_request(ctx)
        assert reader.lookup(ks[0], ctx) is LookupResult.RETRY  # the existence probe is async
        reader.on_request_finished(ctx)
        load_and_check(reader, ks)
        assert resolve(reader, keys(1, seed=9)[0], ReqContext(req_id="x")) is LookupResult.MISS
    finally:
        reader.shutdown()


def test_a_corrupt_chunk_file_is_a_miss_and_is_removed(tmp_path):
    ks = keys(2)
    store_to_files(tmp_path, ks)
    victim = sorted(tmp_path.rglob("*.kv"))[0]
    data = bytearray(victim.read_bytes())
    data[HEADER_BYTES + 100] ^= 0xFF  # same length, one payload byte flipped
    victim.write_bytes(bytes(data))
    reader = tiering_manager(fs_entry(tmp_path))
    try:
        ctx = ReqContext(req_id="reader")
        reader.on_new_request(ctx)
        results = {}
        deadline = time.monotonic() + 30
        # The probe sees a file (HIT), the promotion's checksum check fails, then it is a MISS.
        while len(results) < 2 and time.monotonic() < deadline:
            for k in ks:
                r = reader.lookup(k, ctx)
                if r in (LookupResult.HIT, LookupResult.MISS):
                    results[k] = r
            reader.on_schedule_end(STEP)
            time.sleep(0.005)
        assert sorted(r.name for r in results.values()) == ["HIT", "MISS"]
        (good,) = [k for k, r in results.items() if r is LookupResult.HIT]
        spec = reader.prepare_load([good], ctx)
        assert np.array_equal(primary_rows(reader)[spec.chunk_ids[0]], chunk(good))
        reader.complete_load([good], ctx)
        reader.on_request_finished(ctx)
        settle(reader)
        assert not victim.exists()
        assert reader.secondary_tiers[0].tier.counters.get("checksum_failures") == 1
    finally:
        reader.shutdown()


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def test_obj_round_trip_against_s3_on_loopback_with_vllms_store_config(moto):
    bucket = new_bucket(moto)
    entry = {
        "type": "KVOffloadObjTier",
        "module_path": MODULE,
        "store_config": {
            "bucket": bucket,
            "endpoint_override": moto.removeprefix("http://"),
            "scheme": "http",
            "access_key": ACCESS,
            "secret_key": SECRET,
            "region": "us-east-1",
        },
        "prefix": "vllm-tiering",
        "io_threads": 2,
        "io_workers": 1,
        "addressing_style": "path",
        "job_timeout_s": 10.0,
    }
    ks = keys(4, seed=3)
    writer = tiering_manager(entry)
    try:
        store(writer, ks)
    finally:
        writer.shutdown()
    reader = tiering_manager(entry)
    try:
        load_and_check(reader, ks)
    finally:
        reader.shutdown()


def test_jobs_wait_for_staging_rows_and_a_job_larger_than_staging_fails(tmp_path):
    mgr = tiering_manager(fs_entry(tmp_path))  # only for vLLM's spec and a primary view
    view = mgr.primary_tier.get_kv_memoryview()
    tier = SecondaryTierFactory.create_secondary_tier(
        fs_entry(tmp_path, staging_bytes=2 * ROW), view, mgr_spec(mgr)
    )
    try:
        rows = primary_rows(mgr)
        ks = keys(4, seed=5)
        for i, k in enumerate(ks):
            rows[i] = chunk(k)
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, ks[:2], np.array([0, 1], np.int32), False, ctx))
        tier.submit_store(TransferJob(2, ks[2:], np.array([2, 3], np.int32), False, ctx))
        tier.submit_store(
            TransferJob(3, keys(3, seed=6), np.array([4, 5, 6], np.int32), False, ctx)
        )
        done = {}
        deadline = time.monotonic() + 30
        while len(done) < 3 and time.monotonic() < deadline:
            done.update((r.job_id, r.success) for r in tier.get_finished_jobs())
            time.sleep(0.005)
        assert done == {1: True, 2: True, 3: False}
        rows[:4] = 0
        tier.submit_load(TransferJob(4, ks, np.array([7, 6, 5, 4], np.int32), True, ctx))
        assert [r.job_id for r in tier.get_finished_jobs()] == [4]  # larger than staging: refused
        tier.submit_load(TransferJob(5, ks[:2], np.array([7, 6], np.int32), True, ctx))
        tier.submit_load(TransferJob(6, ks[2:], np.array([5, 4], np.int32), True, ctx))
        tier.drain_jobs()
        assert sorted((r.job_id, r.success) for r in tier.get_finished_jobs()) == [
            (5, True),
            (6, True),
        ]
        for k, cid in zip(ks, [7, 6, 5, 4]):
            assert np.array_equal(rows[cid], chunk(k))
    finally:
        tier.shutdown()
        mgr.shutdown()


def test_stores_beyond_the_tiers_backlog_limit_fail_at_once(tmp_path):
    mgr = tiering_manager(fs_entry(tmp_path))
    tier = SecondaryTierFactory.create_secondary_tier(
        fs_entry(tmp_path / "capped", max_pending_store_chunks=2),
        mgr.primary_tier.get_kv_memoryview(),
        mgr_spec(mgr),
    )
    try:
        ctx = ReqContext(req_id="r")
        tier.submit_store(TransferJob(1, keys(3), np.array([0, 1, 2], np.int32), False, ctx))
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(1, False)]
        tier.submit_store(TransferJob(2, keys(2), np.array([0, 1], np.int32), False, ctx))
        tier.drain_jobs()
        assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(2, True)]
    finally:
        tier.shutdown()
        mgr.shutdown()


def mgr_spec(mgr):
    return mgr.secondary_tiers[0]._offloading_spec


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"n_read_thread'.*did you mean 'n_read_threads'"):
        tiering_manager(fs_entry(tmp_path, n_read_thread=4))
    with pytest.raises(ConfigError, match="staging_bytes"):
        tiering_manager(fs_entry(tmp_path, staging_bytes="1GB"))
