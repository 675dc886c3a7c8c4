"""Hybrid models (issue 14) with an arena and a real vLLM scheduler: the start-up log, the copies of
every group's blocks to and from arena rows (an MLA latent once per TP rank), vLLM's own offloading
scheduler hitting what every group can serve, and the promotions of windowed groups through real
tiers. The groups' layouts, row geometry, namespace and hit length, in process, are
tests/unit/test_hybrid.py, whose vLLM spec builders this file shares."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers import vllm_or_skip
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from helpers import arena_name, fs_tier, wait_until  # noqa: E402
from unit.test_hybrid import (  # noqa: E402
    ATTN_PAGE,
    BF16,
    BLOCK,
    connector_spec,
    cpu_vllm_config,
    full,
    kv_cache_config,
    mamba,
    mla,
    sliding,
)
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from kvoffload.hybrid import hit_tokens  # noqa: E402
from kvoffload.ipc.arena import Arena  # noqa: E402
from kvoffload.tiers.base import LookupResult as KVLookup  # noqa: E402
from kvoffload.vllm.worker import KVOffloadWorker  # noqa: E402

# -- the start-up log and the copies ----------------------------------------------------------------


def test_the_start_log_names_every_offloaded_group_and_how():
    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    kvc = kv_cache_config((full(), 2), (sliding(window=64), 2), (mamba(), 2))
    spec = connector_spec(kvc, {"arena_name": arena_name()}, bpc=2)
    logger = logging.getLogger("kvoffload")
    caught = Records()
    level = logger.level
    logger.addHandler(caught)
    logger.setLevel(logging.INFO)
    try:
        spec.get_manager().shutdown()
    finally:
        logger.removeHandler(caught)
        logger.setLevel(level)
    groups = [line for line in caught.lines if "KV group" in line]
    assert len(groups) == 3, caught.lines
    assert "full_attention" in groups[0] and "every chunk of the prefix" in groups[0]
    assert "sliding_window" in groups[1] and "only the 2 chunk(s)" in groups[1]
    assert "mamba" in groups[2] and "state at each chunk boundary" in groups[2]
    assert all(f"+ {spec.row_bytes - 2 * 2 * ATTN_PAGE} padding" in g for g in groups)


def test_blocks_of_every_group_go_to_their_own_rows_and_come_back_bit_exact():
    """Two layers' tensors shared by three groups, as vLLM's hybrid allocator aliases them: the
    full-attention group uses both, the window group one, the Mamba group one with a state
    smaller than the page. Each group's chunk takes a whole row; what it does not use stays
    zero."""
    num_blocks, page, state = 16, 8192, 4480
    gen = torch.Generator().manual_seed(3)
    device = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, generator=gen)
              for _ in range(2)]  # fmt: skip
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(t, page) for t in device],
        group_data_refs=[
            [CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)],  # full attention
            [CanonicalKVCacheRef(1, page)],  # sliding window
            [CanonicalKVCacheRef(0, state)],  # Mamba state (unpadded bytes only)
        ],
    )
    row_bytes = 2 * page
    with Arena.create(arena_name(), 8, row_bytes) as arena:
        worker = KVOffloadWorker(kv, arena, row_bytes, 0, 1)
        original = [t.clone() for t in device]
        src = GPULoadStoreSpec([1, 2, 5, 7], [2, 1, 1], [0, 3, 4])
        assert worker.submit_store(1, src, CPULoadStoreSpec([0, 1, 2, 3]))
        (res,) = worker.get_finished()
        assert res.success and res.transfer_size == 2 * 2 * page + page + state
        rows = arena.rows
        np.testing.assert_array_equal(rows[2][:page], 0)  # the window group's unused area
        np.testing.assert_array_equal(rows[3][state:], 0)  # padding after the Mamba state
        for t in device:
            t.zero_()
        dst = GPULoadStoreSpec([9, 10, 11, 12], [2, 1, 1], [0, 3, 4])
        assert worker.submit_load(2, CPULoadStoreSpec([0, 1, 2, 3]), dst)
        assert worker.get_finished()[0].success
        for t, o in zip(device, original):
            assert torch.equal(t[[9, 10]], o[[1, 2]])
        assert torch.equal(device[1][11], original[1][5])
        assert torch.equal(device[0][11], torch.zeros(page, dtype=torch.int8))
        assert torch.equal(device[0][12, :state], original[0][7, :state])
        worker.shutdown()


def test_an_mla_latent_takes_one_copy_in_a_row_for_every_tp_rank():
    """TP=2 with an MLA group (vLLM's ``replicated_layout``: every rank holds the same latent,
    here of the real shape: blocks x 16 tokens x 576, bf16): a row holds one copy, not one per
    rank; rank 1 reloads what rank 0 stored, bit-exact, from the same place in the row."""
    from kvoffload.ipc.arena import round_up_to_page

    layers, num_blocks = 2, 8
    kvc = kv_cache_config((mla(), layers))
    page = mla().page_size_bytes  # 16 x 576 x 2 bytes
    assert page == 16 * 576 * 2
    per_rank = connector_spec(kvc, {"arena_name": arena_name()}, tp=2)
    assert per_rank.row_bytes == round_up_to_page(2 * layers * page)  # one area per rank
    name = arena_name()
    ranks = [
        connector_spec(kvc, {"arena_name": name}, tp=2, replicated=True, rank=r) for r in (0, 1)
    ]
    assert all(s.row_bytes == round_up_to_page(layers * page) for s in ranks)  # one copy
    assert ranks[0].namespace().id() != per_rank.namespace().id()
    gen = torch.Generator().manual_seed(5)
    latent = [torch.randn(num_blocks, 16, 576, generator=gen).to(BF16) for _ in range(layers)]

    def caches(tensors):
        return CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
            group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(layers)]],
        )

    manager = ranks[0].get_manager()  # the scheduler side: makes the arena
    workers = []
    try:
        replica = [t.clone() for t in latent]  # rank 1's copy of the same latent
        workers = [ranks[0].get_worker(caches(latent)), ranks[1].get_worker(caches(replica))]
        assert workers[0].submit_store(1, GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([2]))
        (res,) = workers[0].get_finished()
        assert res.success and res.transfer_size == layers * page
        for t in replica:
            t.zero_()
        assert workers[1].submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([6], [1], [0]))
        assert workers[1].get_finished()[0].success
        for mine, theirs in zip(replica, latent):
            assert torch.equal(mine[6], theirs[3])
            assert not mine[[0, 1, 2, 3, 4, 5, 7]].any()
    finally:
        for w in workers:
            w.shutdown()
        manager.shutdown()


# -- agreement with vLLM's own offloading scheduler ----------------------------------------------


@pytest.fixture(scope="module", params=["with_mamba", "without_mamba", "extra_retained"])
def vllm_scheduler(request):
    """vLLM's ``OffloadingConnectorScheduler`` over our manager (a real host tier), for a model with
    a full-attention, a sliding-window (64 tokens = 4 chunks) and (``with_mamba``) a Mamba group,
    16 tokens per chunk. Without a Mamba group vLLM may end a hit inside the prompt's last chunk
    (:func:`kvoffload.hybrid.ends_inside_chunk`). ``extra_retained``: the window retains 17 more
    tokens (``extra_retained_tokens``, what multi-module speculative decoding sets): 5 chunks
    at a boundary, 6 for a hit ending inside a chunk."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    vllm_config = cpu_vllm_config()
    groups = [(full(), 2), (sliding(window=64), 2), (mamba(), 2)]
    if request.param == "extra_retained":
        groups[1] = (sliding(window=64, extra_retained=17), 2)
    kvc = kv_cache_config(*groups[: 3 if request.param == "with_mamba" else 2])
    spec = connector_spec(kvc, {"arena_name": arena_name()})
    init_none_hash(sha256)
    sched = OffloadingConnectorScheduler(spec, vllm_config, kvc)
    yield spec, sched
    spec.get_manager().shutdown()


_REQUESTS = iter(range(1 << 30))


@settings(max_examples=60, deadline=None)
@example(prompt=8 * BLOCK, computed_chunks=0, stored=[[True] * 13] * 3)  # ends inside chunk 7
# ends inside chunk 7 with the window group's chunk 2 missing: served by a 5-chunk window, not by
# the 6 chunks a retaining window needs there
@example(prompt=8 * BLOCK, computed_chunks=0, stored=[[True] * 13, [i != 2 for i in range(13)],
                                                      [True] * 13])  # fmt: skip
@given(
    # prompts ending on a chunk boundary too: vLLM's hit may then end inside the last chunk
    prompt=st.one_of(st.integers(20, 200), st.integers(2, 12).map(lambda k: k * BLOCK)),
    computed_chunks=st.integers(0, 4),
    stored=st.lists(
        st.lists(st.integers(0, 7).map(bool), min_size=13, max_size=13), min_size=3, max_size=3
    ),
)
def test_vllm_scheduler_hits_what_every_group_can_serve(vllm_scheduler, prompt, computed_chunks,
                                                        stored):  # fmt: skip
    """Chunks of each group stored at random in our host tier: vLLM's scheduler, asking our manager
    chunk by chunk, finds the hit :func:`hit_tokens` states."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.request import Request, RequestStatus

    spec, sched = vllm_scheduler
    n = next(_REQUESTS)
    tokens = [(n * 7919 + i) % 30000 for i in range(prompt)]  # a prefix no earlier example had
    req = Request(f"r{n}", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))  # fmt: skip
    mgr = spec.get_manager()
    keys = [
        make_offload_key(h, g.group_id)
        for g in spec.group_layouts
        for i, h in enumerate(req.block_hashes)
        if stored[g.group_id][i]
    ]
    ctx = ReqContext(req_id=f"store{n}")
    out = mgr.prepare_store(keys, ctx)
    assert len(out.keys_to_store) == len(keys)
    mgr.complete_store(out.keys_to_store, ctx)
    sched.on_new_request(req)
    computed = min(computed_chunks * BLOCK, len(req.block_hashes) * BLOCK)
    hit, _ = sched.get_num_new_matched_tokens(req, computed)
    # the step ends as the engine ends it for a request aborted before it was scheduled: the
    # connector hears of its finish and builds the step's metadata (where vLLM 0.33 releases the
    # manager lock that its lookup took)
    req.status = RequestStatus.FINISHED_ABORTED
    sched.request_finished(req)
    step = SchedulerOutput.make_empty()
    step.finished_req_ids = {req.request_id}
    sched.build_connector_meta(step)
    want = hit_tokens(
        spec.group_layouts, lambda g, i: stored[g.group_id][i], computed, min(prompt - 1, len(req.block_hashes) * BLOCK),
        last_chunk_whole=prompt % BLOCK == 0,
    )  # fmt: skip
    event(f"hit {'0' if not want else '< 64' if want < 64 else '>= 64'} tokens")
    event(f"hit inside a chunk: {bool(want % BLOCK)}")
    assert hit == want, (hit, want)


# -- promotions of windowed groups ---------------------------------------------------------------


PATIENCE_S = 120.0  # upper bound for a stuck run, never a measure of speed


def _window_engines(tmp_path, **tier_opts):
    """Ours and another engine of a full-attention + sliding-window model (window 4 chunks),
    sharing an fs tier; vLLM's scheduler for ours. Returns ``(ours, other, scheduler factory)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    vllm_config = cpu_vllm_config()
    kvc = kv_cache_config((full(), 2), (sliding(window=64), 2))
    tier = fs_tier(tmp_path / "fs", **tier_opts)
    ours = connector_spec(kvc, {"arena_name": arena_name(), "secondary_tiers": [tier]})
    other = connector_spec(kvc, {"arena_name": arena_name(), "secondary_tiers": [tier]})
    assert [g.window_chunks for g in ours.group_layouts] == [None, 4]
    init_none_hash(sha256)
    return ours, other, lambda: OffloadingConnectorScheduler(ours, vllm_config, kvc)


def _window_request(req_id: str, seed: int):
    """A 12-chunk (and 8-token) request: ``(request, its full-attention keys, its window keys)``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    tokens = [(seed + (seed + 2) * i) % 30000 for i in range(12 * BLOCK + 8)]
    req = Request(req_id, tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BLOCK, sha256))  # fmt: skip
    full_keys = [make_offload_key(h, 0) for h in req.block_hashes]
    win = [make_offload_key(h, 1) for h in req.block_hashes]
    assert len(win) == 12
    return req, full_keys, win


def _store_through(spec, keys) -> None:
    """Store ``keys`` in ``spec``'s host tier and (write-through) its fs tier."""
    tm = spec.get_manager().tm
    plan = tm.prepare_store(keys)
    assert plan is not None and list(plan.keys) == keys
    tm.complete_store(plan.keys, True)
    assert tm.wait_idle(PATIENCE_S), "the fs tier's store job did not end"


def test_a_window_group_promotes_only_the_window_its_hit_ends_with(tmp_path):
    """A 12-chunk prompt of a full-attention and a sliding-window group (window 4 chunks): the
    full-attention chunks in the host tier, the window group's only in a shared fs tier, chunks 2,
    5, 8 and 11 written there by another engine (ours has no verdict for them: its first lookups
    are RETRY while the tier looks). vLLM's scheduler, asking our manager step by step, scans on
    past each RETRY; every chunk it finds is in the tier, yet only chunks 8-11, the window the hit
    ends with, are promoted (before WindowScans: 0, 1, 3, 4, 6, 7, 9 and 10 at the first step),
    and the hit is the one every group can serve."""
    from vllm.v1.core.sched.output import SchedulerOutput

    ours, other, scheduler = _window_engines(tmp_path)
    try:
        req, full_keys, win = _window_request("windowed", 5)
        theirs = [win[i] for i in (2, 5, 8, 11)]
        known = [k for k in win if k not in theirs]
        _store_through(other, theirs)
        _store_through(ours, full_keys + known)
        tm = ours.get_manager().tm
        assert tm.host.remove(known) == known  # the window group's chunks: only in the fs tier

        sched = scheduler()
        sched.on_new_request(req)
        promoted: set[int] = set()

        def step():
            hit, _ = sched.get_num_new_matched_tokens(req, 0)
            sched.build_connector_meta(SchedulerOutput.make_empty())  # the step ends
            promoted.update(i for i, k in enumerate(win) if k in tm.host.index)
            return None if hit is None else (hit,)

        (hit,) = wait_until(step, PATIENCE_S, "vLLM's lookup to settle")
        assert promoted == {8, 9, 10, 11}
        want = hit_tokens(ours.group_layouts, lambda g, i: True, 0, req.num_tokens - 1)
        assert hit == want == 12 * BLOCK
    finally:
        for spec in (ours, other):
            spec.get_manager().shutdown()


def test_a_window_run_that_can_never_serve_is_given_up_through_vllms_scheduler(tmp_path):
    """vLLM's scheduler defers a request while any chunk of its window scan is RETRY. Here the
    window group's chunks 9 and 10 (window 4 chunks) are in a shared fs tier only, between chunks
    missing everywhere: a run no hit can end with, so :class:`WindowScans` never promotes it and,
    unbounded, the request would wait forever although chunks 0-3 in the host tier serve a hit.
    After ``max_retry_steps`` steps those chunks are answered MISS: the hit the host tier serves
    is taken (64 tokens), nothing of the run is promoted, and the give-ups are counted. (The
    absent chunks' MISS verdicts are in before the first step and kept, ``negative_ttl_s``: while
    a probe is out they are RETRY, and a run of them with chunks 9 and 10 would be a window.)"""
    from vllm.v1.core.sched.output import SchedulerOutput

    ours, other, scheduler = _window_engines(tmp_path, negative_ttl_s=3600)
    try:
        req, full_keys, win = _window_request("stranded", 11)
        stranded = [win[9], win[10]]
        _store_through(other, stranded)
        _store_through(ours, full_keys + win[:4])
        tm = ours.get_manager().tm
        scans = ours.get_manager()._scans
        assert scans is not None and not any(k in tm.host.index for k in stranded)
        for k in (win[i] for i in (4, 5, 6, 7, 8, 11)):  # absent everywhere: MISS, and kept
            wait_until(
                lambda k=k: tm.lookup(k, "warm-up", promote=False) is KVLookup.MISS,
                PATIENCE_S,
                "the fs tier's verdict on an absent chunk",
            )

        sched = scheduler()
        sched.on_new_request(req)
        steps = 0
        hit = None
        while hit is None and steps <= 2 * scans.max_retry_steps:
            hit, _ = sched.get_num_new_matched_tokens(req, 0)
            sched.build_connector_meta(SchedulerOutput.make_empty())  # the step ends
            steps += 1
        assert hit is not None, f"still deferred after {steps} steps"
        assert steps == scans.max_retry_steps + 1  # deferred exactly until the give-up
        stored = {0: set(range(12)), 1: {0, 1, 2, 3}}
        want = hit_tokens(
            ours.group_layouts, lambda g, i: i in stored[g.group_id], 0, req.num_tokens - 1
        )
        assert hit == want == 4 * BLOCK
        assert not any(k in tm.host.index for k in stranded)  # the run was never promoted
        assert tm.stats.window_retry_giveups >= len(stranded)
    finally:
        for spec in (ours, other):
            spec.get_manager().shutdown()
