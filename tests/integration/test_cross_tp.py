"""Engines of different tensor-parallel sizes share chunks through the canonical layout (CASES C35).

Each engine is built the way vLLM builds it, in one process here: a scheduler-side spec (the
tiering manager, tier workers) and one spec per TP rank (the KV copier), all over one arena. The
ranks' KV tensors are real tensors in vLLM's split-KV NHD page layout, holding their share of the
heads of one "model" whose full KV is known; their canonical mappings are derived by vLLM's own
code from vLLM's own ``FullAttentionSpec``.
"""

import os

import pytest
import torch
from helpers import vllm_or_skip

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from helpers import NO_FLOOR, arena_name, keys_for, wait_until  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import (  # noqa: E402
    _layer_mapping,
    _RankContext,
    _verify_tiling,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
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

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.vllm import KVOffloadSpec  # noqa: E402
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name  # noqa: E402

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
HEADS, HEAD_SIZE, BLOCK = 4, 32, 16  # total KV heads; bf16
NUM_BLOCKS = 16
CHUNKS = 8
FULL_LAYER_PAGE = 2 * BLOCK * HEADS * HEAD_SIZE * 2  # K and V, bytes: 8 KiB per layer and block
EXTRA = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}


def full_kv(seed: int) -> list[torch.Tensor]:
    """The model's whole KV cache, every head: per layer ``(NUM_BLOCKS, 2, BLOCK, HEADS,
    HEAD_SIZE)`` bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn((NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_SIZE), generator=gen).to(torch.bfloat16)
        for _ in LAYERS
    ]


def canonical_row(kv: list[torch.Tensor], block: int) -> bytes:
    """The canonical bytes of one block: each layer's page with every head, layers in order."""
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in kv)


class Engine:
    """One engine of TP size ``tp`` sharing the fs root ``root``."""

    def __init__(self, tp: int, root, *, canonical: bool = True, attn_spec=None, tmp=None):
        self.tp = tp
        heads = HEADS // tp
        self.spec = attn_spec or FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16
        )
        self.page = self.spec.real_page_size_bytes
        extra = {
            **EXTRA,
            "cpu_bytes_to_use": 2 * CHUNKS * HEADS // heads * self.page * len(LAYERS),
            "arena_name": arena_name(),
            "canonical_layout": canonical,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(root),
                    "read_workers": 1,
                    "write_workers": 1,
                    **NO_FLOOR,
                }
            ],
        }
        self.specs = [KVOffloadSpec(self._config(extra, rank, canonical)) for rank in range(tp)]
        self.scheduler = KVOffloadSpec(self._config(extra, 0, canonical))
        self.manager = None
        self.workers = []
        self.device: list[list[torch.Tensor]] = []  # per rank, per layer

    def _config(self, extra, rank: int, canonical: bool) -> OffloadingConfig:
        return OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=LAYERS, group_id=0),),
            worker_kv_bytes_per_block=self.page * len(LAYERS),
            enable_kv_cache_events=False,
            extra_config=extra,
            engine_id=f"engine-tp{self.tp}",
            model=OffloadingModelConfig(name="org/gqa-model", dtype="bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=rank,
                world_size=self.tp,
                tp_size=self.tp,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=0,
                is_parallelism_agnostic=True,
            ),
            canonical_layout=canonical,
            kv_cache_layout="NHD",
        )

    def mappings(self, layer_tensors_by_rank):
        """vLLM's canonical mapping of every (rank, layer), tiling checked by vLLM."""
        out = [[None] * len(LAYERS) for _ in range(self.tp)]
        for li, name in enumerate(LAYERS):
            per_rank = [
                _layer_mapping(
                    self.spec,
                    layer_tensors_by_rank[r][li],
                    NUM_BLOCKS,
                    _RankContext(
                        tp_size=self.tp,
                        dcp_size=1,
                        pcp_size=1,
                        interleave=1,
                        total_kv_heads=HEADS,
                        rank=r,
                    ),
                )
                for r in range(self.tp)
            ]
            if all(m is not None for m in per_rank):
                _verify_tiling(name, per_rank)
            for r in range(self.tp):
                out[r][li] = per_rank[r]
        return out

    def start(self):
        self.manager = self.scheduler.get_manager()
        heads = HEADS // self.tp
        self.device = [
            [
                torch.zeros((NUM_BLOCKS, 2, BLOCK, heads, HEAD_SIZE), dtype=torch.bfloat16)
                for _ in LAYERS
            ]
            for _ in range(self.tp)
        ]
        maps = self.mappings(self.device)
        for r, spec in enumerate(self.specs):
            kv = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(t, self.page) for t in self.device[r]],
                group_data_refs=[
                    [CanonicalKVCacheRef(li, self.page, maps[r][li]) for li in range(len(LAYERS))]
                ],
            )
            self.workers.append(spec.get_worker(kv))
        return self

    def shard(self, kv: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
        heads = HEADS // self.tp
        return [t[:, :, :, rank * heads : (rank + 1) * heads] for t in kv]

    def store(self, keys, kv, req="store"):
        """Every rank copies its heads of blocks 0..len(keys)-1 out; the chunks go to fs."""
        for r in range(self.tp):
            for dev, src in zip(self.device[r], self.shard(kv, r)):
                dev.copy_(src)
        ctx = ReqContext(req_id=req)
        out = self.manager.prepare_store(keys, ctx)
        assert list(out.keys_to_store) == list(keys)
        blocks = list(range(len(keys)))
        for r, w in enumerate(self.workers):
            assert w.submit_store(
                100 + r, GPULoadStoreSpec(blocks, [len(blocks)], [0]), out.store_spec
            )
            assert all(res.success for res in w.get_finished())
        self.manager.complete_store(keys, ctx)
        assert self.manager.tm.wait_idle(120)
        assert self.manager.tm.stats.cascaded["fs"] == len(keys)

    def resolve(self, keys, req):
        ctx = ReqContext(req_id=req)

        def settled():
            res = [self.manager.lookup(k, ctx) for k in keys]
            return (
                None
                if any(x in (LookupResult.RETRY, LookupResult.HIT_PENDING) for x in res)
                else res
            )

        return wait_until(
            settled, what="lookups to settle", step=lambda: self.manager.on_schedule_end(None)
        )

    def load(self, keys, req="load"):
        """Look ``keys`` up until they settle, then every rank loads them into zeroed blocks;
        returns the host rows that were loaded from."""
        assert self.resolve(keys, req) == [LookupResult.HIT] * len(keys)
        ctx = ReqContext(req_id=req)
        for dev in self.device:
            for t in dev:
                t.zero_()
        spec = self.manager.prepare_load(keys, ctx)
        rows = [bytes(self.manager.tm.arena.rows[s]) for s in spec.block_ids]
        blocks = list(range(len(keys)))
        for r, w in enumerate(self.workers):
            assert w.submit_load(200 + r, spec, GPULoadStoreSpec(blocks, [len(blocks)], [0]))
            assert all(res.success for res in w.get_finished())
        self.manager.complete_load(keys, ctx)
        return rows

    def close(self):
        for w in self.workers:
            w.shutdown()
        if self.manager is not None:
            self.manager.shutdown()
        for spec in self.specs:
            if spec._arena is not None:
                spec._arena.close()


def chunk_files(root) -> dict[str, int]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".kv"):
                out[f] = os.path.getsize(os.path.join(dirpath, f))
    return out


def test_c35_canonical_layout_is_shared_across_tensor_parallel_sizes(tmp_path):
    root = tmp_path / "fs"
    one, two = Engine(1, root), Engine(2, root)
    # Equal row size and namespace, whichever side of the TP split (scheduler and every rank).
    assert {s.row_bytes for s in [one.scheduler, *one.specs, two.scheduler, *two.specs]} == {
        FULL_LAYER_PAGE * len(LAYERS)
    }
    ns = one.scheduler.namespace()
    assert two.scheduler.namespace() == ns and two.specs[1].namespace() == ns
    assert ns.tp_size is None and ns.groups[0].page_bytes == FULL_LAYER_PAGE * len(LAYERS)

    kv_a, kv_b = full_kv(1), full_kv(2)
    keys_a, keys_b = keys_for(CHUNKS, seed=1), keys_for(CHUNKS, seed=2)
    # TP1 stores 8 chunks; TP2 (both ranks) loads them.
    engine = one.start()
    try:
        engine.store(keys_a, kv_a)
    finally:
        engine.close()
    files_a = chunk_files(root)
    assert len(files_a) == CHUNKS
    engine = two.start()
    try:
        rows = engine.load(keys_a)
        for b, row in enumerate(rows):
            assert row[: FULL_LAYER_PAGE * len(LAYERS)] == canonical_row(kv_a, b)
        for r in range(2):  # each rank got exactly its own heads
            for dev, want in zip(engine.device[r], engine.shard(kv_a, r)):
                assert torch.equal(dev[:CHUNKS], want[:CHUNKS])
        # The other way round: TP2 stores (each rank writes its own heads), TP1 loads.
        engine.store(keys_b, kv_b)
    finally:
        engine.close()
    files = chunk_files(root)
    assert len(files) == 2 * CHUNKS
    assert set(files.values()) == {HEADER_BYTES + FULL_LAYER_PAGE * len(LAYERS)}  # no TP in it
    nsdir = root / ns.id()
    for b, k in enumerate(keys_b):  # TP2's files hold the canonical payload
        assert (nsdir / relative_name(k)).read_bytes()[HEADER_BYTES:] == canonical_row(kv_b, b)
    engine = Engine(1, root).start()
    try:
        rows = engine.load(keys_b)
        for b, row in enumerate(rows):
            assert row == canonical_row(kv_b, b)
        for dev, want in zip(engine.device[0], kv_b):
            assert torch.equal(dev[:CHUNKS], want[:CHUNKS])
        assert engine.manager.tm.stats.promotions["fs"] == CHUNKS
    finally:
        engine.close()

    # Without the canonical layout the TP sizes do not share: a clean miss, no error.
    direct_root = tmp_path / "direct"
    engine = Engine(1, direct_root, canonical=False).start()
    try:
        engine.store(keys_a, kv_a)
    finally:
        engine.close()
    engine = Engine(2, direct_root, canonical=False).start()
    try:
        assert engine.scheduler.namespace().tp_size == 2
        assert engine.resolve(keys_a, "direct") == [LookupResult.MISS] * CHUNKS
        assert engine.manager.tm.stats.promotions["fs"] == 0
        assert sum(engine.manager.tm.stats.failed.values()) == 0
    finally:
        engine.close()


def test_c35_a_layout_the_engine_cannot_honour_fails_at_start_with_a_config_error(tmp_path):
    # A page vLLM cannot certify for the canonical layout (its mapping is None): a config error
    # naming canonical_layout when the worker starts, before any copy; never a tensor error.
    engine = Engine(2, tmp_path / "fs")
    try:
        engine.manager = engine.scheduler.get_manager()
        heads = HEADS // 2
        dev = [
            torch.zeros((NUM_BLOCKS, 2, BLOCK, heads, HEAD_SIZE), dtype=torch.bfloat16)
            for _ in LAYERS
        ]
        kv = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, engine.page) for t in dev],
            group_data_refs=[
                [CanonicalKVCacheRef(li, engine.page, None) for li in range(len(LAYERS))]
            ],
        )
        with pytest.raises(ConfigError, match="canonical_layout.*could not certify"):
            engine.specs[0].get_worker(kv)
        # Replicated KV heads (TP4 over 2 heads) sized as if each rank had its own heads (no model
        # config in this process to say otherwise): the mismatch is named, not a tensor error.
        four = Engine(
            4,
            tmp_path / "fs4",
            attn_spec=FullAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16
            ),
        )
        try:
            four_dev = [
                [
                    torch.zeros((NUM_BLOCKS, 2, BLOCK, 1, HEAD_SIZE), dtype=torch.bfloat16)
                    for _ in LAYERS
                ]
                for _ in range(4)
            ]
            maps = [
                [
                    _layer_mapping(
                        four.spec,
                        four_dev[r][li],
                        NUM_BLOCKS,
                        _RankContext(
                            tp_size=4,
                            dcp_size=1,
                            pcp_size=1,
                            interleave=1,
                            total_kv_heads=2,
                            rank=r,
                        ),
                    )
                    for li in range(len(LAYERS))
                ]
                for r in range(4)
            ]
            assert maps[0][0].canonical_page_size_bytes == 2 * four.page  # two head shards
            kv4 = CanonicalKVCaches(
                tensors=[CanonicalKVCacheTensor(t, four.page) for t in four_dev[0]],
                group_data_refs=[
                    [CanonicalKVCacheRef(li, four.page, maps[0][li]) for li in range(len(LAYERS))]
                ],
            )
            with pytest.raises(ConfigError, match="canonical_layout.*not 4 x"):
                four.specs[0].get_worker(kv4)
        finally:
            four.close()
    finally:
        engine.close()
