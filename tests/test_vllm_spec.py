"""The vLLM plug-in without an engine: spec construction, config errors, the KV copy path."""

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")  # the vllm extra; always installed by tox / .ci/run

from helpers import NO_FLOOR, arena_name  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.vllm import KVOffloadSpec  # noqa: E402
from kvoffload.vllm.worker import KVOffloadWorker  # noqa: E402

PAGE = 4096 * 3


def offloading_config(extra, *, bpb=2 * PAGE, bpc=1, model="org/model", dtype="bfloat16", tp=1):
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=bpb,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-test",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=0,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="NHD",
    )


EXTRA = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}


def test_vllm_factory_loads_the_out_of_tree_spec():
    cls = OffloadingSpecFactory.get_spec_cls(EXTRA)
    assert cls is KVOffloadSpec


def test_spec_sizes_rows_and_names_the_arena():
    spec = KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 10 * 2 * PAGE}, bpc=2))
    assert spec.row_bytes == 4 * PAGE and spec.num_slots == 5
    assert spec.arena_name == "kvoffload_engine-test"
    ns = spec.namespace()
    assert ns.kv_dtype == "bfloat16" and ns.tokens_per_chunk == 32 and ns.tp_size == 1
    assert "NHD" in ns.layout


def test_spec_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        KVOffloadSpec(offloading_config({**EXTRA}))
    with pytest.raises(ConfigError, match="did you mean 'eviction_policy'"):
        KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 1 << 20, "evict": 1}))
    with pytest.raises(ConfigError, match="cannot hold one chunk"):
        KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 100}))


def test_spec_tolerates_vllm_033_arguments():
    KVOffloadSpec(
        offloading_config({**EXTRA, "cpu_bytes_to_use": 1 << 20}), lock=object(), config_info={}
    )
    with pytest.raises(TypeError):
        KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 1 << 20}), bogus=1)


def test_c05_nondeterministic_block_hashes_with_a_shared_tier_fail_at_start(monkeypatch, tmp_path):
    import kvoffload.vllm.spec as kv

    monkeypatch.setattr(
        kv,
        "nondeterministic_block_hashes",
        lambda: "prefix_caching_hash_algo='xxhash' without PYTHONHASHSEED",
    )
    spec = KVOffloadSpec(
        offloading_config(
            {
                **EXTRA,
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path)}],
            }
        )
    )
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        spec.get_manager()


def test_manager_round_trip_through_vllm_types(tmp_path):
    extra = {
        **EXTRA,
        "cpu_bytes_to_use": 4 * 2 * PAGE,
        "arena_name": arena_name(),
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(tmp_path),
                "read_workers": 1,
                "write_workers": 1,
                **NO_FLOOR,
            }
        ],
    }
    spec = KVOffloadSpec(offloading_config(extra))
    mgr = spec.get_manager()
    try:
        ctx = ReqContext(req_id="r1")
        keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(6)]
        out = mgr.prepare_store(keys[:4], ctx)
        assert isinstance(out.store_spec, CPULoadStoreSpec) and len(out.keys_to_store) == 4
        mgr.complete_store(out.keys_to_store, ctx)
        assert mgr.lookup(keys[0], ctx) is LookupResult.HIT
        spec_load = mgr.prepare_load(keys[:2], ctx)
        assert list(spec_load.block_ids) == list(out.store_spec.block_ids[:2])
        mgr.complete_load(keys[:2], ctx)
        assert mgr.tm.wait_idle(120)
        out2 = mgr.prepare_store(keys[4:6], ctx)
        assert len(out2.evicted_keys) == 2
        mgr.complete_store(out2.keys_to_store, ctx)
        evicted = out2.evicted_keys[0]
        import time

        deadline = time.monotonic() + 20
        res = mgr.lookup(evicted, ctx)
        while res is not LookupResult.HIT and time.monotonic() < deadline:
            mgr.on_schedule_end(None)
            time.sleep(0.01)
            res = mgr.lookup(evicted, ctx)
        assert res is LookupResult.HIT
        assert mgr.get_load_source(evicted, ctx).value == "disk"
    finally:
        mgr.shutdown()


@pytest.mark.parametrize("bpc", [1, 2])
@pytest.mark.parametrize("one_allocation", [False, True])
def test_cpu_worker_copies_blocks_to_arena_rows_and_back_bit_exact(bpc, one_allocation):
    num_blocks = 16
    pages = [PAGE, PAGE]
    gen = torch.Generator().manual_seed(0)
    if one_allocation:  # vLLM-CPU's layout: all layers in one buffer, layer-major
        buf = torch.randint(
            -128, 127, (len(pages) * num_blocks * PAGE,), dtype=torch.int8, generator=gen
        )
        device = [
            buf[i * num_blocks * PAGE : (i + 1) * num_blocks * PAGE].view(num_blocks, PAGE)
            for i in range(len(pages))
        ]
    else:
        device = [
            torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=gen)
            for p in pages
        ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, p) for t, p in zip(device, pages)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )
    row_bytes = sum(pages) * bpc
    with Arena.create(arena_name(), 8, row_bytes) as arena:
        worker = KVOffloadWorker(kv, arena, row_bytes, 0, bpc)
        assert (worker._copier.uniform is not None) == one_allocation
        original = [t.clone() for t in device]
        # Store blocks 3..7 (5 blocks) starting at logical block index 1 (unaligned when bpc=2).
        blocks = [3, 4, 5, 6, 7]
        n_chunks = -(-(len(blocks) + (1 % bpc)) // bpc)
        slots = list(range(2, 2 + n_chunks))
        assert worker.submit_store(1, GPULoadStoreSpec(blocks, [5], [1]), CPULoadStoreSpec(slots))
        res = worker.get_finished()
        assert res[0].success and res[0].transfer_size == 5 * sum(pages)
        for t in device:
            t[blocks] = 0
        assert worker.submit_load(
            2, CPULoadStoreSpec(slots), GPULoadStoreSpec([9, 10, 11, 12, 13], [5], [1])
        )
        assert worker.get_finished()[0].success
        for t, o in zip(device, original):
            assert torch.equal(t[[9, 10, 11, 12, 13]], o[blocks])
        worker.shutdown()
        np.testing.assert_array_equal(arena.rows[0], 0)  # untouched slots stay untouched


def test_c21_the_resolved_config_is_logged_once_at_start(tmp_path):
    """The effective configuration, tier defaults included, is logged once when the engine starts
    (CASES C21)."""
    import json
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.records = []

        def emit(self, record):
            self.records.append(record)

    extra = {
        **EXTRA,
        "cpu_bytes_to_use": 4 * 2 * PAGE,
        "arena_name": arena_name(),
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(tmp_path),
                "read_workers": 1,
                "write_workers": 1,
                **NO_FLOOR,
            }
        ],
    }
    spec = KVOffloadSpec(offloading_config(extra))
    logger = logging.getLogger("kvoffload")  # its own stderr handler; it does not propagate
    caught = Records()
    level = logger.level
    logger.addHandler(caught)
    logger.setLevel(logging.INFO)
    try:
        mgr = spec.get_manager()
        try:
            assert spec.get_manager() is mgr  # asked again: nothing started or logged again
        finally:
            mgr.shutdown()
    finally:
        logger.removeHandler(caught)
        logger.setLevel(level)
    resolved = []
    for r in caught.records:
        text = r.getMessage()
        if text.startswith("kvoffload: {"):
            resolved.append(json.loads(text[len("kvoffload: ") :]))
    assert len(resolved) == 1, [r.getMessage() for r in caught.records]
    cfg = resolved[0]
    assert cfg["cpu_bytes_to_use"] == 4 * 2 * PAGE and cfg["eviction_policy"] == "lru"
    (tier,) = cfg["secondary_tiers"]
    assert tier["type"] == "fs" and tier["root_dir"] == str(tmp_path)
    assert tier["read_workers"] == 1 and tier["write_workers"] == 1
    # defaults the user did not write are there too
    assert tier["job_timeout_s"] == 30.0 and tier["max_bytes"] is None and tier["fsync"] is False
