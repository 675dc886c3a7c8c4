"""Hybrid models (issue 14), in process: KV-cache groups of several kinds (full attention, sliding
window, Mamba state, MLA) as vLLM describes them, their row geometry, their namespace, the hit
length every group can serve, the start-up log's lines and the window scans' choices. The copies of
their blocks to and from arena rows, vLLM's own offloading scheduler and the promotions through real
tiers are tests/integration/test_hybrid.py."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import vllm_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.hybrid import (  # noqa: E402
    FULL_ATTENTION,
    MAMBA,
    SLIDING_WINDOW,
    GroupLayout,
    WindowScans,
    chunks_per_request,
    describe_groups,
    hit_step,
    hit_tokens,
    row_geometry,
)
from kvoffload.vllm import KVOffloadSpec  # noqa: E402
from kvoffload.vllm.hybrid import config_names_window  # noqa: E402

EXTRA = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}
BLOCK = 16  # tokens per block
BF16 = torch.bfloat16


def full(heads=2, head=64):
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype=BF16)


def sliding(window=64, heads=2, head=64, extra_retained=0):
    return SlidingWindowSpec(
        block_size=BLOCK,
        num_kv_heads=heads,
        head_size=head,
        dtype=BF16,
        sliding_window=window,
        extra_retained_tokens=extra_retained,
    )


ATTN_PAGE = full().page_size_bytes  # 2 heads x 16 tokens x (64 + 64) x 2 bytes


def mamba(conv=(3, 64), ssm=(2, 16, 32)):
    # vLLM's hybrid allocator pads a Mamba state page to the attention page size; prefix caching
    # (which offloading a hybrid model needs) puts Mamba groups in "align" mode, a state kept at
    # each block boundary (MambaModelConfig.verify_and_update_config, vLLM 0.32 and 0.33)
    return MambaSpec(
        BLOCK,
        shapes=(conv, ssm),
        dtypes=(BF16, torch.float32),
        page_size_padded=ATTN_PAGE,
        mamba_cache_mode="align",
    )


def mla():
    return MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=BF16)


def kv_cache_config(*specs_and_layers):
    """A KVCacheConfig of groups ``(spec, num_layers)``, layers named ``g<i>.l<j>``."""
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"g{i}.l{j}" for j in range(n)], spec)
            for i, (spec, n) in enumerate(specs_and_layers)
        ],
    )


def window_field(spec, tokens_per_chunk: int) -> dict:
    """The group config's window as vLLM's ``build_offloading_config`` fills it: from 0.33 on
    ``OffloadingGroupConfig`` carries ``sliding_window_size_in_chunks`` (its scheduler reads it;
    a config built without it makes every group need the whole prefix); 0.32 has no such field."""
    if not config_names_window(OffloadingGroupConfig(tokens_per_block=1, layer_names=(),
                                                     group_id=0)):  # fmt: skip
        return {}
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_sliding_window_size_in_chunks,
    )
    from vllm.v1.kv_cache_interface import iter_layer_specs

    window = get_sliding_window_size_in_chunks(next(iter(iter_layer_specs(spec))), tokens_per_chunk)
    return {"sliding_window_size_in_chunks": window}


def offloading_config(kvc: KVCacheConfig, extra, *, bpc=1, tp=1, replicated=False, rank=0):
    groups = tuple(
        OffloadingGroupConfig(
            tokens_per_block=g.kv_cache_spec.block_size,
            layer_names=tuple(g.layer_names),
            group_id=i,
            **window_field(g.kv_cache_spec, g.kv_cache_spec.block_size * bpc),
        )
        for i, g in enumerate(kvc.kv_cache_groups)
    )
    block_bytes = max(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in kvc.kv_cache_groups
    )
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id="engine-hybrid",
        model=OffloadingModelConfig(name="org/hybrid", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=bpc),
        parallel=OffloadingParallelConfig(
            rank=rank,
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
        replicated_layout=replicated,
        kv_cache_layout="NHD",
    )


def connector_spec(kvc: KVCacheConfig, extra=None, **kw) -> KVOffloadSpec:
    """The spec as vLLM's OffloadingConnector makes it: through vLLM's factory, while the
    connector holds the engine's KVCacheConfig."""
    extra = {**EXTRA, "cpu_bytes_to_use": 1 << 22, **(extra or {})}
    config = offloading_config(kvc, extra, **kw)

    def connector_init(vllm_config, kv_cache_config):  # OffloadingConnector.__init__'s locals
        return OffloadingSpecFactory.create_spec(vllm_config)

    spec = connector_init(config, kvc)
    assert isinstance(spec, KVOffloadSpec)
    return spec


# -- layouts from vLLM's specs ------------------------------------------------------------------


def test_groups_take_kind_window_bytes_and_shape_from_vllm_specs():
    kvc = kv_cache_config((full(), 2), (sliding(window=64), 4), (mamba(), 4), (mla(), 3))
    spec = connector_spec(kvc, bpc=2)  # 32 tokens per chunk
    by_kind = {g.kind: g for g in spec.group_layouts}
    assert [g.kind for g in spec.group_layouts] == [
        "full_attention",
        "sliding_window",
        "mamba",
        "mla_attention",
    ]
    assert by_kind["full_attention"].window_chunks is None
    assert by_kind["mla_attention"].window_chunks is None
    # a 64-token window over 32-token chunks: the two chunks before the hit's end
    assert by_kind["sliding_window"].window_chunks == 2
    assert by_kind["sliding_window"].reach_tokens == 63  # sliding_window - 1 (+ extra retained)
    assert {g.reach_tokens for g in spec.group_layouts if g.kind != "sliding_window"} == {None}
    assert by_kind["mamba"].window_chunks == 1 and by_kind["mamba"].is_state
    assert by_kind["full_attention"].block_bytes == 2 * ATTN_PAGE
    assert by_kind["sliding_window"].block_bytes == 4 * ATTN_PAGE
    assert by_kind["mamba"].block_bytes == 4 * ATTN_PAGE  # padded state pages
    assert by_kind["mla_attention"].block_bytes == 3 * mla().page_size_bytes
    assert by_kind["mla_attention"].replicated and not by_kind["full_attention"].replicated
    assert "sliding_window=64" in by_kind["sliding_window"].shape
    assert "shapes=3,64x2,16,32" in by_kind["mamba"].shape
    assert all(g.tokens_per_chunk == 32 for g in spec.group_layouts)


def test_a_spec_made_outside_a_connector_keeps_whole_prefix_groups():
    """Without the engine's KVCacheConfig a group's kind is unknown; its window is the one the
    group config names (vLLM 0.33: 64 tokens over 16-token chunks), else the whole prefix."""
    kvc = kv_cache_config((full(), 2), (sliding(), 2))
    config = offloading_config(kvc, {**EXTRA, "cpu_bytes_to_use": 1 << 22})
    spec = KVOffloadSpec(config)
    window = 4 if config_names_window(config.groups[1]) else None
    assert [(g.kind, g.window_chunks) for g in spec.group_layouts] == [
        ("unknown", None),
        ("unknown", window),
    ]
    assert {g.block_bytes for g in spec.group_layouts} == {spec.config.worker_kv_bytes_per_block}


# -- row geometry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bpc", [1, 3])
def test_every_group_fills_one_fixed_row_padded_where_it_needs_less(bpc):
    kvc = kv_cache_config((full(), 2), (sliding(), 6), (mamba(), 6), (mla(), 1))
    spec = connector_spec(kvc, bpc=bpc)
    rows = {r.kind: r for r in spec.group_rows}
    assert {r.payload_bytes + r.padding_bytes for r in spec.group_rows} == {spec.row_bytes}
    assert spec.row_bytes % 4096 == 0
    assert rows["sliding_window"].payload_bytes == 6 * ATTN_PAGE * bpc
    assert rows["full_attention"].padding_bytes == spec.row_bytes - 2 * ATTN_PAGE * bpc
    assert rows["mla_attention"].payload_bytes == mla().page_size_bytes * bpc


def test_row_geometry_counts_rank_copies_and_refuses_a_chunk_larger_than_a_row():
    g = GroupLayout(group_id=0, kind=FULL_ATTENTION, tokens_per_chunk=16, num_layers=2,
                    block_bytes=1000)  # fmt: skip
    (row,) = row_geometry([g], 8192, 2, 4)
    assert (row.payload_bytes, row.padding_bytes, row.copies) == (8000, 192, 4)
    with pytest.raises(ValueError, match="KV group 0 .full_attention.: a chunk of 10000 bytes"):
        row_geometry([g], 8192, 2, 5)


def test_the_spec_refuses_a_group_larger_than_the_worker_block():
    kvc = kv_cache_config((full(), 2), (sliding(), 2))
    extra = {**EXTRA, "cpu_bytes_to_use": 1 << 22}
    config = offloading_config(kvc, extra)
    small = OffloadingConfig(**{**config.__dict__, "worker_kv_bytes_per_block": ATTN_PAGE})

    def connector_init(vllm_config, kv_cache_config):
        return OffloadingSpecFactory.create_spec(vllm_config)

    with pytest.raises(ConfigError, match="KV group 0 .full_attention.*does not fit a row"):
        connector_init(small, kvc)


def test_host_capacity_counts_a_row_per_group_and_only_a_window_of_windowed_groups():
    groups = [
        GroupLayout(group_id=0, kind=FULL_ATTENTION, tokens_per_chunk=32, num_layers=1,
                    block_bytes=1),
        GroupLayout(group_id=1, kind=SLIDING_WINDOW, tokens_per_chunk=32, num_layers=1,
                    block_bytes=1, window_chunks=2),
        GroupLayout(group_id=2, kind=MAMBA, tokens_per_chunk=32, num_layers=1, block_bytes=1,
                    window_chunks=1),
    ]  # fmt: skip
    assert chunks_per_request(groups, 320) == 10 + 2 + 1
    assert chunks_per_request(groups[:1], 33) == 2


# -- namespace ------------------------------------------------------------------------------------


def test_namespace_changes_with_any_group_kind_or_shape():
    base = [(full(), 2), (sliding(window=64), 2)]
    variants = {
        "base": base,
        "window size": [(full(), 2), (sliding(window=128), 2)],
        "window group as full": [(full(), 2), (full(), 2)],
        "heads": [(full(heads=4), 2), (sliding(window=64), 2)],
        "head size": [(full(), 2), (sliding(window=64, head=32), 2)],
        "layers": [(full(), 2), (sliding(window=64), 3)],
        "mamba state": [(full(), 2), (mamba(), 2)],
        "mamba shape": [(full(), 2), (mamba(ssm=(2, 16, 16)), 2)],
        "group order": [(sliding(window=64), 2), (full(), 2)],
        "one group": [(full(), 2)],
    }
    ids = {}
    for name, groups in variants.items():
        kvc = kv_cache_config(*groups)
        # the same worker block for all, so only the groups differ
        extra = {**EXTRA, "cpu_bytes_to_use": 1 << 22}
        config = offloading_config(kvc, extra)
        config = OffloadingConfig(**{**config.__dict__, "worker_kv_bytes_per_block": 8 * ATTN_PAGE})

        def connector_init(vllm_config, kv_cache_config):
            return OffloadingSpecFactory.create_spec(vllm_config)

        ids[name] = connector_init(config, kvc).namespace().id()
    assert len(set(ids.values())) == len(ids), ids
    again = connector_spec(kv_cache_config(*base))
    same = OffloadingConfig(**{**again.config.__dict__, "worker_kv_bytes_per_block": 8 * ATTN_PAGE})

    def connector_init(vllm_config, kv_cache_config):
        return OffloadingSpecFactory.create_spec(vllm_config)

    assert connector_init(same, kv_cache_config(*base)).namespace().id() == ids["base"]
    ns_groups = connector_init(same, kv_cache_config(*base)).namespace().groups
    assert [(g.kind, g.window_chunks) for g in ns_groups] == [
        ("full_attention", None),
        ("sliding_window", 4),
    ]


# -- hit length -----------------------------------------------------------------------------------


def layout(i, kind, tpc, window=None, reach=None):
    return GroupLayout(
        group_id=i,
        kind=kind,
        tokens_per_chunk=tpc,
        num_layers=1,
        block_bytes=1,
        window_chunks=window,
        reach_tokens=reach,
    )


def served(groups, present, computed, end):
    """Brute force, in tokens: every chunk that holds a token a group attends to at ``end`` and
    the engine has not computed is present (full: all of ``[computed, end)``; a window of ``w``
    chunks: the part of it inside ``[end - w * tpc, end)``)."""
    if any(end % g.tokens_per_chunk for g in groups):
        return False
    if end - computed < max(g.tokens_per_chunk for g in groups):
        return False
    for g in groups:
        lo = (
            computed
            if g.window_chunks is None
            else max(computed, end - g.window_chunks * g.tokens_per_chunk)
        )
        for tok in range(lo, end):
            if not present(g, tok // g.tokens_per_chunk):
                return False
    return True  # fmt: skip


def served_inside(groups, present, computed, end):
    """Brute force, in tokens, for a hit ending at ``end`` inside a chunk (the chunk holding it is
    loaded whole): every chunk holding a token a group needs and the engine has not computed is
    present. Full attention: all of ``[computed, ceil)``; a window of ``w`` chunks: ``[ceil - w
    * tpc, ceil)``, and where it has a reach of ``r`` tokens (vLLM: ``sliding_window - 1 +
    extra_retained_tokens``) also ``[end - r, ceil)``; ``ceil`` is the group's next boundary."""
    if end - computed < max(g.tokens_per_chunk for g in groups):
        return False
    for g in groups:
        tpc = g.tokens_per_chunk
        ceil = -(-end // tpc) * tpc
        if g.window_chunks is None:
            lo = computed
        else:
            lo = ceil - g.window_chunks * tpc
            if g.reach_tokens is not None:
                lo = min(lo, end - g.reach_tokens)
            lo = max(computed, lo)
        if not all(present(g, tok // tpc) for tok in range(lo, ceil)):
            return False
    return True


@st.composite
def hybrid_cases(draw):
    tpcs = draw(st.lists(st.sampled_from([16, 32, 48]), min_size=1, max_size=3))
    groups = []
    for i, tpc in enumerate(tpcs):
        kind = draw(st.sampled_from([FULL_ATTENTION, SLIDING_WINDOW, MAMBA]))
        window = {FULL_ATTENTION: None, MAMBA: 1}.get(kind, draw(st.integers(1, 4)))
        reach = None
        if kind == SLIDING_WINDOW and draw(st.booleans()):  # a sliding window, as vLLM sizes it
            sw, extra = draw(st.integers(1, 4 * tpc)), draw(st.sampled_from([0, 0, 1, 17, 40]))
            reach = sw - 1 + extra
            window = max(-(-sw // tpc), -(-reach // tpc))
        groups.append(layout(i, kind, tpc, window, reach))
    max_tokens = draw(st.integers(0, 400))
    computed = draw(st.integers(0, max_tokens))
    stored = {
        g.group_id: draw(st.lists(st.booleans(), min_size=max_tokens // g.tokens_per_chunk + 1,
                                  max_size=max_tokens // g.tokens_per_chunk + 1))
        for g in groups
    }  # fmt: skip
    return groups, stored, computed, max_tokens


@settings(max_examples=300, deadline=None)
@given(hybrid_cases(), st.booleans())
def test_hit_is_the_longest_prefix_every_group_can_serve(case, whole):
    """Against a brute force; with ``whole`` (the chunk holding ``max_tokens`` is whole) a hit
    of windowed groups without a Mamba group may end at ``max_tokens`` itself, as vLLM's does,
    where every group serves the boundary after it."""
    groups, stored, computed, max_tokens = case

    def present(g, i):
        return stored[g.group_id][i]

    hit = hit_tokens(groups, present, computed, max_tokens, whole)
    step = hit_step(groups)
    best = max(
        (e for e in range(step, max_tokens + 1, step) if served(groups, present, computed, e)),
        default=computed,
    )
    inside = (
        whole
        and max_tokens % step
        and any(g.window_chunks for g in groups)
        and all(g.kind != MAMBA for g in groups)
        and served_inside(groups, present, computed, max_tokens)
    )  # fmt: skip
    assert hit == (max_tokens if inside else best) - computed
    if hit:  # what a load of the hit reads is all present
        for g in groups:
            end = -(-(computed + hit) // g.tokens_per_chunk) * g.tokens_per_chunk
            assert all(present(g, i) for i in g.load_chunks(computed, end))


@settings(max_examples=200, deadline=None)
@given(hybrid_cases(), st.data())
def test_storing_more_chunks_never_shortens_a_hit(case, data):
    groups, stored, computed, max_tokens = case
    before = hit_tokens(groups, lambda g, i: stored[g.group_id][i], computed, max_tokens)
    g = data.draw(st.sampled_from(groups))
    i = data.draw(st.integers(0, len(stored[g.group_id]) - 1))
    stored[g.group_id][i] = True
    assert hit_tokens(groups, lambda g, i: stored[g.group_id][i], computed, max_tokens) >= before


def test_a_mamba_state_is_never_loaded_without_its_kv_nor_kv_without_its_state():
    groups = [layout(0, FULL_ATTENTION, 16), layout(1, MAMBA, 16, 1)]
    kv = [True] * 10
    state = [False, False, True, False, True, False, False, False, False, False]

    def present(g, i):
        return (kv if g.kind == FULL_ATTENTION else state)[i]

    # states at token 48 (chunk 2) and 80 (chunk 4): the hit ends at the last boundary with both
    assert hit_tokens(groups, present, 0, 160) == 80
    kv[3] = False  # KV of tokens 48..63 gone: the state at 80 is useless without it
    assert hit_tokens(groups, present, 0, 160) == 48
    assert list(groups[1].load_chunks(0, 48)) == [2] and list(groups[0].load_chunks(0, 48)) == [
        0,
        1,
        2,
    ]


def test_a_sliding_window_reloads_only_its_window():
    groups = [layout(0, SLIDING_WINDOW, 16, 2)]
    stored = [False] * 6 + [True, True]  # only the last two chunks: enough for the window
    assert hit_tokens(groups, lambda g, i: stored[i], 0, 130) == 128
    assert list(groups[0].load_chunks(0, 128)) == [6, 7]
    with_full = [layout(0, FULL_ATTENTION, 16), *groups]
    assert hit_tokens(with_full, lambda g, i: g.kind == FULL_ATTENTION or stored[i], 0, 130) == 128
    # the window group's last chunk missing: the longest hit ends where its window is whole
    stored[7] = False
    assert hit_tokens(with_full, lambda g, i: g.kind == FULL_ATTENTION or stored[i], 0, 130) == 0
    stored[4] = stored[5] = True
    assert hit_tokens(with_full, lambda g, i: g.kind == FULL_ATTENTION or stored[i], 0, 130) == 112


def test_groups_with_different_chunk_sizes_hit_on_a_common_boundary():
    groups = [layout(0, FULL_ATTENTION, 16), layout(1, FULL_ATTENTION, 48)]
    assert hit_step(groups) == math.lcm(16, 48)
    assert hit_tokens(groups, lambda g, i: True, 0, 100) == 96
    assert hit_tokens(groups, lambda g, i: not (g.group_id == 0 and i == 4), 0, 100) == 48


# -- the start-up log ----------------------------------------------------------------------------


def test_groups_offloaded_alike_share_one_log_line():
    kvc = kv_cache_config(*[(sliding(), 1)] * 5, (full(), 1))
    spec = connector_spec(kvc)
    lines = describe_groups(spec.group_layouts, spec.group_rows)
    assert len(lines) == 2, lines
    assert lines[0].startswith("KV groups 0-4 (sliding_window, 1 layers")
    assert lines[1].startswith("KV group 5 (full_attention, 1 layers")


# -- agreement with vLLM's own offloading scheduler ----------------------------------------------


def cpu_vllm_config():
    """vLLM's ``VllmConfig`` for the scheduler tests (block size ``BLOCK``, prefix caching on), with
    pytest's environment as it was. The device is named: vLLM 0.33's GPU wheel cannot infer one on
    a machine without a GPU. Building it runs vLLM-CPU's platform hook, which sets process-wide
    variables for the engine it expects to follow (``LD_PRELOAD`` of torch's libgomp,
    ``LD_LIBRARY_PATH``, ``VLLM_*``, OpenMP and inductor threads, ``vllm/platforms/cpu.py``); left
    in place, every process a later test starts would inherit them (a peer worker would map
    torch's libgomp, tests/integration/test_p2p_transport.py's torch-free check failed on it)."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig

    saved = dict(os.environ)
    try:
        return VllmConfig(
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            device_config=DeviceConfig(device="cpu"),
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_building_vllms_config_leaves_the_environment_of_later_processes_alone():
    """The scheduler tests' config leaves ``os.environ`` as it was, so the processes later tests
    start (tier and peer workers, vLLM servers) get pytest's environment, not vLLM-CPU's."""
    before = dict(os.environ)
    assert cpu_vllm_config().cache_config.block_size == BLOCK
    assert dict(os.environ) == before


# -- promotions of windowed groups ---------------------------------------------------------------


@pytest.mark.parametrize(
    "answers, chosen",
    [
        # no answer yet: the rightmost window
        ("RRRRRRRR", [0, 1, 2, 3]),
        # vLLM looked past four hits: it needs a wider window (a partial rightmost chunk)
        ("HHHHRR", [4]),
        # a run of only hits that vLLM looked past cannot serve; nor can a run shorter than the
        # window; the next run that can: its rightmost window
        ("HHHHMRRRRR", [5, 6, 7, 8]),
        ("RMPRRRRR", [3, 4, 5]),
        ("RRRMRR", [4, 5]),
        # a run shorter than the window that does not reach the first chunk cannot serve
        ("RRRMRRM", []),
        # the prefix shorter than the window (one chunk in a tier: vLLM asks for it forever
        # until it is promoted)
        ("R", [0]),
    ],
)
def test_a_scan_promotes_the_window_the_hit_can_end_with(answers, chosen):
    """:class:`WindowScans` (window 4 chunks) over one scan of vLLM's, right to left (H: HIT,
    P: HIT_PENDING, R: RETRY, M: MISS): the chunks answered RETRY it promotes at the step's end."""
    names = {"H": "HIT", "P": "HIT_PENDING", "R": "RETRY", "M": "MISS"}
    scans = WindowScans([layout(0, FULL_ATTENTION, 16), layout(1, SLIDING_WINDOW, 16, window=4)])
    assert scans.tracks(1) and not scans.tracks(0)
    assert scans.tracks(1, 48) and not scans.tracks(1, 47)  # a partial-tail key: not windowed
    n = len(answers)
    for i, a in enumerate(answers):
        scans.record("r", 1, bytes([i]), (n - i) * 16, names[a])
    assert scans.chosen() == [("r", bytes([i])) for i in chosen]
    assert scans.chosen() == []  # a step's scans are forgotten once chosen


def test_a_chunk_retried_unchosen_for_max_retry_steps_is_given_up():
    """A scan whose run can never serve (shorter than the window, not reaching the first chunk):
    its RETRY chunks are never chosen, so after ``max_retry_steps`` steps they are exhausted (the
    manager answers MISS: a recompute, not a request that waits forever); a chosen chunk never
    is; a finished request's counts are dropped."""
    scans = WindowScans([layout(1, SLIDING_WINDOW, 16, window=4)], max_retry_steps=3)
    names = {"R": "RETRY", "M": "MISS"}
    answers = "RRRMRRM"  # chunks 6..0: runs of 3 and 2, neither a whole window
    keys = [bytes([i]) for i in range(len(answers))]

    def step(req: str) -> list:
        for i, a in enumerate(answers):
            scans.record(req, 1, keys[i], (len(answers) - i) * 16, names[a])
        return scans.chosen()

    for _ in range(3):
        assert not any(scans.exhausted("r", k) for k in keys)
        assert step("r") == []
    assert [scans.exhausted("r", k) for k in keys] == [a == "R" for a in answers]
    assert not scans.exhausted("other", keys[0])
    scans.forget("r")
    assert not any(scans.exhausted("r", k) for k in keys)
    # a chunk chosen in a step is not counted: a whole window is promoted, never given up
    for _ in range(5):
        scans.record("q", 1, keys[0], 64, "RETRY")
        for i in range(1, 4):
            scans.record("q", 1, keys[i], 64 - 16 * i, "RETRY")
        assert len(scans.chosen()) == 4
    assert not any(scans.exhausted("q", k) for k in keys[:4])
    with pytest.raises(ValueError, match="max_retry_steps"):
        WindowScans([], max_retry_steps=0)
