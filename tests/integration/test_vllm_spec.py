"""The vLLM plug-in without an engine: specs made by vLLM's own connector from a real engine config,
the manager through vLLM's types, the KV copy path, on real arenas. The spec alone, in process
(construction, config errors), is tests/unit/test_vllm_spec.py."""

import numpy as np
import pytest
import torch
from helpers import vllm_or_skip

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from helpers import NO_FLOOR, arena_name, fs_tier  # noqa: E402
from unit.test_vllm_spec import EXTRA, PAGE, offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.vllm import KVOffloadSpec  # noqa: E402
from kvoffload.vllm.worker import KVOffloadWorker  # noqa: E402

# -- specs made by vLLM's own connector, from a real engine config -----------------------------------
#
# vLLM's OffloadingConnector makes one spec in the scheduler process (the engine core, where vLLM
# sets no current config) and one per model-runner rank (where it does). Both must read the
# engine's model config: its max_model_len, revision and KV-head count.

#: A GQA model: 2 KV heads (of 4 attention heads), 16-dim heads, 2 layers.
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 4096,
}
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A model directory vLLM's ``ModelConfig`` reads (a config, no weights: no engine runs)."""
    import json

    path = tmp_path_factory.mktemp("tiny-model")
    (path / "config.json").write_text(json.dumps(TINY_MODEL))
    return str(path)


def engine_config(model_dir, extra, *, tp=1, revision="r1", max_model_len=3000, hash_algo=None):
    """vLLM's ``VllmConfig`` of an engine serving ``model_dir`` with kvoffload's spec (``extra``
    its ``kv_connector_extra_config``), built with pytest's environment kept (building one runs
    vLLM-CPU's platform hook, which sets process-wide variables, see tests/unit/test_hybrid.py's
    ``cpu_vllm_config``). The device is named: vLLM 0.33's GPU wheel cannot infer one here."""
    import os

    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
    )

    cache = {"prefix_caching_hash_algo": hash_algo} if hash_algo else {}
    saved = dict(os.environ)
    try:
        return VllmConfig(
            model_config=ModelConfig(
                model=model_dir,
                skip_tokenizer_init=True,
                revision=revision,
                max_model_len=max_model_len,
                dtype="float32",
            ),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=True, **cache),
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={**EXTRA, **extra},
            ),
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


def engine_kv_cache_config(vllm_config):
    """The KVCacheConfig vLLM gives one rank of that engine: one full-attention group, the
    rank's share of the KV heads (at least one: ranks beyond the head count hold replicas)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    tp = vllm_config.parallel_config.tensor_parallel_size
    heads = max(1, TINY_MODEL["num_key_value_heads"] // tp)
    attn = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=16, dtype=torch.float32)
    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), attn)]
    )


def scheduler_manager(vllm_config):
    """The scheduler's manager (:class:`~kvoffload.vllm.manager.KVOffloadManager`), made by
    vLLM's connector in the engine core, where vLLM sets no current config. The caller shuts it
    down."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    kvc = engine_kv_cache_config(vllm_config)
    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, kvc)
    return connector.connector_scheduler.manager


def worker_spec(vllm_config) -> KVOffloadSpec:
    """A model-runner rank's spec, made by vLLM's connector under the engine's current config (as
    vLLM's worker does)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    kvc = engine_kv_cache_config(vllm_config)
    with set_current_vllm_config(vllm_config):
        connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kvc)
    return connector.connector_worker.spec


def test_c35_scheduler_and_model_runner_size_canonical_rows_alike_past_the_kv_heads(tiny_model):
    """TP 4 over 2 KV heads, canonical layout: a canonical page holds 2 head shards (ranks 2
    and 3 hold replicas). The scheduler, where vLLM sets no current config, used to size its
    rows for 4 shards (it could not see the head count) while the model runner sized them for
    2, so the scheduler could not attach the arena the model runner had made and the engine did
    not start. Both read the engine's config now: the scheduler attaches it, with one
    namespace."""
    vc = engine_config(
        tiny_model, {"cpu_bytes_to_use": 1 << 22, "arena_name": arena_name(), "canonical_layout": True},
        tp=4,
    )  # fmt: skip
    runner = worker_spec(vc)
    page = 2 * 16 * 1 * 16 * 4  # K and V, 16 tokens, a rank's 1 head of 16 float32s, per layer
    assert runner.canonical_copies == 2 and runner.row_bytes == 2 * len(LAYERS) * page
    arena = runner._open_arena()  # what get_worker does first: the model runner starts first
    try:
        manager = scheduler_manager(vc)
        try:
            assert manager.tm.arena.row_bytes == runner.row_bytes
            assert manager.tm.namespace == runner.namespace()
            assert manager.tm.namespace.groups[0].page_bytes == 2 * len(LAYERS) * page
        finally:
            manager.shutdown()
    finally:
        arena.close()


def test_c02_the_scheduler_namespace_carries_vllms_model_revision(tiny_model):
    """``--revision`` reaches the namespace in the scheduler, where chunks are named: two
    revisions of one model never share a chunk (CASES C02); the same revision again does."""
    ids = []
    for revision in ("r1", "r2", "r1"):
        vc = engine_config(
            tiny_model, {"cpu_bytes_to_use": 1 << 22, "arena_name": arena_name()}, revision=revision
        )
        manager = scheduler_manager(vc)
        try:
            assert manager.tm.namespace.revision == revision
            ids.append(manager.tm.namespace.id())
        finally:
            manager.shutdown()
    assert ids[0] != ids[1] and ids[0] == ids[2]


def test_c05_nondeterministic_block_hashes_with_a_shared_tier_fail_at_start(
    tiny_model, monkeypatch, tmp_path
):
    """An engine hashing blocks with xxhash and no PYTHONHASHSEED: each process seeds the hash
    chain at random, so a shared tier would never hit again; the scheduler refuses to start
    (CASES C05). With a seed it starts."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    extra = {
        "cpu_bytes_to_use": 1 << 22,
        "arena_name": arena_name(),
        "secondary_tiers": [fs_tier(tmp_path)],
    }
    vc = engine_config(tiny_model, extra, hash_algo="xxhash")
    try:
        with monkeypatch.context() as env:
            env.delenv("PYTHONHASHSEED", raising=False)
            with pytest.raises(
                ConfigError, match="prefix_caching_hash_algo='xxhash'.*PYTHONHASHSEED"
            ):
                scheduler_manager(vc)
            env.setenv("PYTHONHASHSEED", "0")
            scheduler_manager(vc).shutdown()
    finally:
        # vLLM's scheduler seeded this process's hash chain for xxhash (and the seed "0"): seed it
        # again as the engine's default algorithm under the environment as it was, or later tests
        # of this process (vLLM 0.33's p2p tier compares seeds with a spawned peer) see "0".
        init_none_hash(sha256)


def test_a_host_tier_smaller_than_one_request_is_warned_in_the_scheduler(tiny_model, caplog):
    """The scheduler warns at start when the host tier holds fewer tokens than max_model_len,
    naming both figures and the cpu_bytes_to_use that holds one request (vLLM 0.32 and 0.33:
    the scheduler's max_model_len comes from the engine's config, not vLLM's unset global)."""
    import logging

    row = 2 * len(LAYERS) * 16 * 2 * 16 * 4  # K and V of 2 heads, 16 tokens, 2 layers; float32
    vc = engine_config(
        tiny_model, {"cpu_bytes_to_use": 100 * row, "arena_name": arena_name()}, max_model_len=3000
    )
    logger = logging.getLogger("kvoffload")
    logger.addHandler(caplog.handler)  # kvoffload's logger does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            manager = scheduler_manager(vc)
    finally:
        logger.removeHandler(caplog.handler)
    try:
        warnings = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
        # 3000 tokens are 188 chunks of 16 tokens; 100 chunks hold 1,595 of them
        assert warnings == [
            f"kvoffload: the host tier holds 1595 tokens (cpu_bytes_to_use {100 * row}: 100 "
            f"chunks of {row} bytes), fewer than max_model_len 3000: every offloaded chunk "
            f"passes through it, so a longer request is offloaded and reloaded only up to its "
            f"first 1595 tokens; set cpu_bytes_to_use to at least {188 * row} (188 chunks) to "
            f"hold one request"
        ]
        assert manager.tm.request_chunks == 188  # the host tier's refusals name that size too
    finally:
        manager.shutdown()


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
