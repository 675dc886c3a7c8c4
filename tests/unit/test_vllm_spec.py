"""The vLLM plug-in's spec, in process: vLLM's factory finds it, it sizes the rows and names the
arena, config errors name the key, and it takes vLLM 0.33's arguments. Specs made by vLLM's own
connector from a real engine config, the manager and the KV copy path on a real arena are
tests/integration/test_vllm_spec.py, which shares this file's ``offloading_config``."""

import pytest
from helpers import vllm_or_skip

vllm = vllm_or_skip()  # the vllm extra; always installed by tox / .ci/run

from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvoffload.config import ConfigError  # noqa: E402
from kvoffload.vllm import KVOffloadSpec  # noqa: E402

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


def test_a_host_tier_below_one_chunk_names_only_levers_that_exist():
    """The minimum is one chunk's bytes; a smaller chunk is named only when chunks hold several
    blocks, under the key the config used (kvoffload's blocks_per_chunk, vLLM's block_size)."""
    with pytest.raises(ConfigError) as one_block:
        KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 100}))
    assert str(one_block.value) == (
        "kv_connector_extra_config.cpu_bytes_to_use: 100 bytes cannot hold one chunk (16 tokens "
        "of every KV layer: 24576 bytes); set it to at least 24576"
    )
    with pytest.raises(ConfigError) as two_blocks:
        KVOffloadSpec(
            offloading_config({**EXTRA, "cpu_bytes_to_use": 100, "blocks_per_chunk": 2}, bpc=2)
        )
    assert str(two_blocks.value).endswith(
        "(32 tokens of every KV layer: 49152 bytes); set it to at least 49152; or make chunks "
        "smaller: blocks_per_chunk (now 2) at 1 makes a chunk of 24576 bytes"
    )
    with pytest.raises(ConfigError) as in_tokens:
        KVOffloadSpec(
            offloading_config({**EXTRA, "cpu_bytes_to_use": 100, "block_size": 32}, bpc=2)
        )
    assert str(in_tokens.value).endswith(
        "; or make chunks smaller: block_size (now 32) at 16 makes a chunk of 24576 bytes"
    )


def test_spec_tolerates_vllm_033_arguments():
    KVOffloadSpec(
        offloading_config({**EXTRA, "cpu_bytes_to_use": 1 << 20}), lock=object(), config_info={}
    )
    with pytest.raises(TypeError):
        KVOffloadSpec(offloading_config({**EXTRA, "cpu_bytes_to_use": 1 << 20}), bogus=1)
