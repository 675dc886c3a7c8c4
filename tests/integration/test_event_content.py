"""What KV events say: a stored chunk's parent hash and token ids (C34), the tier's locality, and
the data-parallel rank's own endpoints and stamp (C30). Real arenas, real tier workers, real ZMQ
sockets; vLLM's own decoder, block hasher and block pool where vLLM is installed."""

from __future__ import annotations

import importlib.util
import os

import msgspec
import numpy as np
import pytest
from helpers import Rig, arena_name, fs_tier, payload, replay

from kvoffload.config import ConfigError
from kvoffload.namespace import chunk_keys
from kvoffload.tools.ports import free_port

BLOCK = 16  # tokens per block (and per chunk: blocks_per_chunk 1)


def _events_cfg(**extra):
    return {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0", **extra}


def _decoder():
    """vLLM's own decoder where vLLM is installed, else kvoffload's structs (the same schema)."""
    try:
        from vllm.distributed.kv_events import KVEventBatch
    except ImportError:
        from kvoffload.events import KVEventBatch
    return msgspec.msgpack.Decoder(KVEventBatch)


def _engine_events(endpoint: str) -> list:
    dec = _decoder()
    return [ev for _, body in replay(endpoint) for ev in dec.decode(body).events]


def per_block(events, medium: str, described_only: bool = False) -> dict:
    """``block hash -> (parent hash, token ids, block size)`` from the ``BlockStored`` events of
    ``medium``; an event of n blocks contributes n entries, chained as the engine chains them
    (an event without token ids, the plain form, gives empty ones). A block stored again must
    be described the same way; ``described_only`` skips plain events (a chunk promoted back)."""
    out = {}
    for ev in events:
        if type(ev).__name__ != "BlockStored" or ev.medium != medium:
            continue
        if described_only and not ev.token_ids:
            continue
        bs = ev.block_size
        assert bs > 0 and len(ev.token_ids) in (0, bs * len(ev.block_hashes)), ev
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            entry = (parent, list(ev.token_ids[i * bs : (i + 1) * bs]), bs)
            assert out.setdefault(h, entry) == entry, f"{medium}: block described two ways"
            parent = h
    return out


def _store(tm, arena, keys, info=None):
    plan = tm.prepare_store(list(keys), "req", *([info] if info is not None else []))
    assert plan is not None and list(plan.keys) == list(keys)
    for k, s in zip(plan.keys, plan.slots):
        arena.rows[s] = payload(k, arena.row_bytes)
    tm.complete_store(plan.keys, True, "req")
    assert tm.wait_idle(120), "tier jobs did not finish"
    tm.step()


# -- C34: parent hash and token ids ---------------------------------------------------------------


def test_c34_stored_block_events_carry_parent_hash_and_token_ids(tmp_path):
    """K1 → K2 → K3 (K2, K3 in a later batch) through a standalone manager with an fs tier: the
    host (CPU) and fs (STORAGE) BlockStored of each chunk carry its hash, its parent (none for K1),
    its token ids and the block size, exactly as given; a chunk stored without them still gets
    its event."""
    from kvoffload.events import ChunkEventInfo

    tokens = np.arange(1000, 1000 + 4 * BLOCK)
    keys = chunk_keys(tokens, BLOCK)
    k1, k2, k3, k4 = keys
    info = {
        k: ChunkEventInfo(
            block_hashes=[k],
            parent_block_hash=keys[i - 1] if i else None,
            token_ids=tokens[i * BLOCK : (i + 1) * BLOCK].tolist(),
            block_size=BLOCK,
            group_idx=0,
        )
        for i, k in enumerate(keys[:3])
    }
    with Rig([fs_tier(tmp_path / "fs")], num_slots=8, kv_events=_events_cfg()) as rig:
        _store(rig.tm, rig.arena, [k1], info)
        _store(rig.tm, rig.arena, [k2, k3], info)
        _store(rig.tm, rig.arena, [k4])  # no info: the plain event
        rig.tm.publisher.flush()
        events = _engine_events(rig.tm.publisher.replay_endpoint)
    want = {k: (info[k].parent_block_hash, info[k].token_ids, BLOCK) for k in (k1, k2, k3)}
    for medium in ("CPU", "STORAGE"):
        got = per_block(events, medium)
        assert {k: got[k] for k in (k1, k2, k3)} == want, medium
        assert got[k1][0] is None and got[k2][0] == k1 and got[k3][0] == k2
        assert k4 in got  # stored, without parent or tokens
    stored = [ev for ev in events if type(ev).__name__ == "BlockStored"]
    assert {(ev.medium, ev.ownership, ev.locality) for ev in stored} == {
        ("CPU", None, "LOCAL"),
        ("STORAGE", "fs", "LOCAL"),
    }


vllm_only = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM (the vllm extra)"
)


def _vllm_request(req_id: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=64),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _offloading_config(extra, *, dp_index=0, events=False, bpb=2 * 4096 * 3):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("l0", "l1"), group_id=0),
        ),
        worker_kv_bytes_per_block=bpb,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"engine-test-{os.getpid()}-dp{dp_index}",
        model=OffloadingModelConfig(name="org/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp_index,
            data_parallel_size=2,
            data_parallel_rank_local=dp_index,
            is_parallelism_agnostic=False,
        ),
        kv_cache_layout="NHD",
    )


EXTRA = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.vllm"}


@vllm_only
def test_c34_plugin_events_equal_vllm_gpu_events_for_the_same_blocks(tmp_path):
    """Through the vLLM plug-in: a real vLLM ``Request`` (vLLM's sha256 block hasher) stores K1,
    then grows and stores K2, K3. vLLM's own block pool caches the same blocks and publishes its
    GPU ``BlockStored``; kvoffload's CPU and STORAGE events carry the same hashes, parents, token
    ids and block size, block for block."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvoffload.vllm import KVOffloadSpec

    extra = {
        **EXTRA,
        "cpu_bytes_to_use": 8 * 2 * 4096 * 3,
        "arena_name": arena_name(),
        "secondary_tiers": [fs_tier(tmp_path / "fs")],
        "kv_events": _events_cfg(),
    }
    spec = KVOffloadSpec(_offloading_config(extra))
    mgr = spec.get_manager()
    try:

        def on_new_request(request):  # as vLLM's OffloadingConnectorScheduler.on_new_request
            ctx = ReqContext(req_id=request.request_id)
            mgr.on_new_request(ctx)
            return ctx

        def offload(ctx, request, first, last):  # as its store path: key positions, store
            keys = []
            for i in range(first, last):
                key = make_offload_key(request.block_hashes[i], 0)
                ctx.set_offload_key_position(key, (i + 1) * BLOCK)
                keys.append(key)
            out = mgr.prepare_store(keys, ctx)
            assert list(out.keys_to_store) == keys
            mgr.complete_store(out.keys_to_store, ctx)
            assert mgr.tm.wait_idle(120)
            mgr.on_schedule_end(None)

        request = _vllm_request("req-c34", list(range(5000, 5000 + BLOCK + 5)))
        ctx = on_new_request(request)
        gpu = BlockPool(
            num_gpu_blocks=8,
            enable_caching=True,
            hash_block_size=BLOCK,
            enable_kv_cache_events=True,
        )
        blocks = gpu.get_new_blocks(3)
        gpu.cache_full_blocks(request, blocks, 0, 1, BLOCK, 0)
        offload(ctx, request, 0, 1)  # K1
        request.append_output_token_ids(list(range(7000, 7000 + 2 * BLOCK)))  # the request grows
        assert len(request.block_hashes) == 3
        gpu.cache_full_blocks(request, blocks, 1, 3, BLOCK, 0)
        offload(ctx, request, 1, 3)  # K2, K3 in a later batch
        mgr.tm.publisher.flush()
        ours = _engine_events(mgr.tm.publisher.replay_endpoint)
    finally:
        mgr.shutdown()
    theirs = per_block(gpu.take_events(), "GPU")
    assert len(theirs) == 3 and next(iter(theirs.values()))[0] is None
    for medium in ("CPU", "STORAGE"):
        assert per_block(ours, medium) == theirs, medium


# -- locality ---------------------------------------------------------------------------------------


def test_object_store_events_are_remote_in_both_publishers(tmp_path):
    """An obj tier is REMOTE: in kvoffload's BlockStored / BlockRemoved and movements, and in the
    events the plug-in hands vLLM's own publisher (``take_events``); the host tier and an fs tier
    stay LOCAL."""
    from s3 import new_bucket, obj_tier, start_moto

    srv, endpoint = start_moto()
    try:
        tiers = [fs_tier(tmp_path / "fs"), obj_tier(endpoint, new_bucket(endpoint))]
        with Rig(tiers, num_slots=2, kv_events=_events_cfg()) as rig:
            keys = chunk_keys(np.arange(3 * BLOCK), BLOCK)
            for k in keys:  # the third store evicts the first from the host tier
                _store(rig.tm, rig.arena, [k])
            pub = rig.tm.publisher
            pub.flush()
            events = _engine_events(pub.replay_endpoint)
            moves = [
                mv
                for _, body in replay(pub.replay_endpoint, 0, b"kvoffload-movements")
                for mv in msgspec.msgpack.decode(body)["events"]
            ]
            taken = _plugin_events(rig.tm)
    finally:
        srv.stop()
    seen = {
        (type(ev).__name__, ev.medium, ev.ownership, ev.locality)
        for ev in events
        if type(ev).__name__ != "AllBlocksCleared"  # the run's opening batch (C54)
    }
    assert {
        ("BlockStored", "CPU", None, "LOCAL"),
        ("BlockStored", "STORAGE", "fs", "LOCAL"),
        ("BlockStored", "STORAGE", "obj", "REMOTE"),
        ("BlockRemoved", "CPU", None, "LOCAL"),
    } <= seen, seen
    assert all(loc == ("REMOTE" if owner == "obj" else "LOCAL") for _, _, owner, loc in seen)
    assert {(m["src"], m["dst"], m["locality"]) for m in moves} >= {
        ("device", "host", "local"),
        ("host", "fs", "local"),
        ("host", "obj", "remote"),
    }
    assert all(m["locality"] == "remote" for m in moves if "obj" in (m["src"], m["dst"]))
    if taken is not None:
        assert taken == {(None, "LOCAL"), ("fs", "LOCAL"), ("obj", "REMOTE")}, taken


def _plugin_events(tm):
    """(ownership, locality) of the events the vLLM plug-in hands vLLM for ``tm``'s events since
    the start, or None without vLLM."""
    try:
        from kvoffload.vllm import KVOffloadManager
    except ImportError:
        return None
    mgr = KVOffloadManager(tm)
    return {(ev.ownership, ev.locality.value) for ev in mgr.take_events()}


# -- C30: data-parallel ranks -----------------------------------------------------------------------


def _segments(names) -> set[str]:
    """Which of the arenas ``names`` exist in /dev/shm."""
    return set(names) & set(os.listdir("/dev/shm"))


@vllm_only
def test_c30_a_second_data_parallel_rank_starts_with_kv_events_on(tmp_path):
    """Two specs from one ``kv_connector_extra_config`` (events on fixed TCP ports), DP ranks 0 and
    1: both start; rank r binds port + r (vLLM's rule) and stamps r on every batch of both topics.
    A third rank whose port is taken fails with a config error naming the endpoint, and leaves no
    shared-memory segment behind."""
    import zmq
    from vllm.v1.kv_offload.base import ReqContext

    from kvoffload.events import MovementBatch
    from kvoffload.vllm import KVOffloadSpec

    pub = free_port(consecutive=3)
    rep = free_port(consecutive=3)
    extra = {
        **EXTRA,
        "cpu_bytes_to_use": 4 * 2 * 4096 * 3,
        "secondary_tiers": [fs_tier(tmp_path / "fs")],
        "kv_events": {
            "endpoint": f"tcp://127.0.0.1:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep}",
        },
    }
    specs = [KVOffloadSpec(_offloading_config(dict(extra), dp_index=r)) for r in (0, 1, 2)]
    managers = []
    blocker_ctx = zmq.Context()
    blocker = blocker_ctx.socket(zmq.PUB)
    try:
        for spec in specs[:2]:
            managers.append(spec.get_manager())
        for r, mgr in enumerate(managers):
            assert mgr.tm.publisher.endpoint == f"tcp://127.0.0.1:{pub + r}"
            assert mgr.tm.publisher.replay_endpoint == f"tcp://127.0.0.1:{rep + r}"
            keys = [bytes([r, i]) * 16 + b"\0\0\0\0" for i in range(2)]
            ctx = ReqContext(req_id=f"r{r}")
            out = mgr.prepare_store(keys, ctx)
            mgr.complete_store(out.keys_to_store, ctx)
            assert mgr.tm.wait_idle(120)
            mgr.on_schedule_end(None)
            mgr.tm.publisher.flush()
        for r in (0, 1):  # each rank's replay endpoint answers with its own batches
            engine = replay(f"tcp://127.0.0.1:{rep + r}")
            moves = replay(f"tcp://127.0.0.1:{rep + r}", 0, b"kvoffload-movements")
            assert engine and moves
            for _, body in engine:
                assert msgspec.msgpack.decode(body)[2] == r  # [ts, events, data_parallel_rank]
                assert _decoder().decode(body).data_parallel_rank == r
            for _, body in moves:
                assert msgspec.msgpack.decode(body, type=MovementBatch).data_parallel_rank == r
        blocker.bind(f"tcp://127.0.0.1:{pub + 2}")  # rank 2's port is taken
        with pytest.raises(ConfigError, match="kv_events.endpoint.*data-parallel rank 2"):
            specs[2].get_manager()
        names = [s.arena_name for s in specs]
        assert len(set(names)) == 3 and _segments(names) == set(names[:2])
    finally:
        blocker.close(linger=0)
        blocker_ctx.term()
        for mgr in managers:
            mgr.shutdown()
    assert _segments(names) == set()


def test_c30_rank_offsets_follow_vllm_publisher():
    """kvoffload's endpoint rule is vLLM's (``ZmqEventPublisher.offset_endpoint_port``)."""
    from kvoffload.events import offset_endpoint

    cases = [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 3, "tcp://*:5560"),
        ("tcp://127.0.0.1:0", 2, "tcp://127.0.0.1:0"),
        ("inproc://cache", 1, "inproc://cache_dp1"),
        (None, 1, None),
    ]
    for endpoint, rank, want in cases:
        assert offset_endpoint(endpoint, rank) == want
    with pytest.raises(ValueError, match="ipc:///tmp/x"):
        offset_endpoint("ipc:///tmp/x", 1)
    try:
        from vllm.distributed.kv_events import ZmqEventPublisher
    except ImportError:
        return
    for endpoint, rank, want in cases:
        assert ZmqEventPublisher.offset_endpoint_port(endpoint, rank) == want


def test_kv_events_bind_loopback_by_default_and_all_interfaces_when_asked():
    """kvoffload's events socket binds loopback unless the config says otherwise (a
    ``BlockStored`` carries the token ids and block hashes of users' prompts); a config that binds
    all interfaces still publishes, and a client on this host gets its batches."""
    from kvoffload.config import parse_config
    from kvoffload.events import EventPublisher, Movement, decode_movement_batch
    from kvoffload.ipc.names import MOVEMENTS_TOPIC

    default = parse_config({"cpu_bytes_to_use": 1 << 20, "kv_events": {}}).kv_events
    assert default is not None and default.endpoint == "tcp://127.0.0.1:5557"
    assert default.replay_endpoint is None
    everywhere = parse_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "kv_events": {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"},
        }
    ).kv_events
    assert everywhere is not None
    pub = EventPublisher(everywhere, instance="all")
    try:
        assert pub.endpoint.startswith("tcp://0.0.0.0:")
        moved = [Movement(key=b"\x03" * 16, src="host", dst="fs", locality="local", nbytes=4096)]
        pub.publish([], moved)
        assert pub.flush()
        port = pub.replay_endpoint.rpartition(":")[2]
        ((_, body),) = replay(f"tcp://127.0.0.1:{port}", 0, MOVEMENTS_TOPIC.encode())
    finally:
        pub.close()
    assert decode_movement_batch(body).events == moved


def test_published_movements_decode_with_the_one_movement_schema():
    """What the publisher sends on the movements topic decodes with ``decode_movement_message``
    (the schema the publisher encodes with); a payload of another shape is refused, naming the
    field."""
    from kvoffload.config import KVEventsConfig
    from kvoffload.events import (
        EventPublisher,
        Movement,
        decode_movement_batch,
        decode_movement_message,
    )
    from kvoffload.ipc.names import MOVEMENTS_TOPIC

    config = KVEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    assert config.movements_topic == MOVEMENTS_TOPIC
    pub = EventPublisher(config, instance="m0", data_parallel_rank=0)
    try:
        moved = [
            Movement(key=b"\x01" * 16, src="host", dst="fs", locality="local", nbytes=4096),
            Movement(key=b"\x02" * 16, src="fs", dst="none", locality="local", nbytes=0),
        ]
        pub.publish([], moved)
        assert pub.flush()
        ((seq, body),) = replay(pub.replay_endpoint, 0, MOVEMENTS_TOPIC.encode())
    finally:
        pub.close()
    topic, seq_out, batch = decode_movement_message(
        [MOVEMENTS_TOPIC.encode(), seq.to_bytes(8, "big"), body]
    )
    assert (topic, seq_out) == (MOVEMENTS_TOPIC.encode(), pub.first_seq)
    assert batch.instance == "m0" and batch.data_parallel_rank == 0 and batch.events == moved
    assert decode_movement_batch(body) == batch
    broken = msgspec.msgpack.encode({"ts": 1.0, "instance": "m0", "events": [{"key": b"k"}]})
    with pytest.raises(msgspec.DecodeError, match=r"src.*\$\.events\[0\]"):
        decode_movement_batch(broken)
    with pytest.raises(ValueError, match="8-byte seq"):
        decode_movement_message([MOVEMENTS_TOPIC.encode(), b"\x00", body])


def test_a_replay_longer_than_a_zmq_high_water_mark_has_no_gap():
    """A replay sends every buffered batch at once: 5,000 of them (five times ZMQ's default send
    high-water mark, where a ROUTER drops silently) all reach the client, in order, then the end
    marker."""
    from kvoffload.config import KVEventsConfig
    from kvoffload.events import EventPublisher, Movement
    from kvoffload.ipc.names import MOVEMENTS_TOPIC

    n = 5000
    config = KVEventsConfig(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=2 * n
    )
    pub = EventPublisher(config, instance="m0", data_parallel_rank=0)
    try:
        moved = [Movement(key=b"\x01" * 16, src="host", dst="fs", locality="local", nbytes=4096)]
        for _ in range(n):
            pub.publish([], moved)
        assert pub.flush()
        got = replay(pub.replay_endpoint, 0, MOVEMENTS_TOPIC.encode())
    finally:
        pub.close()
    assert [seq for seq, _ in got] == [pub.first_seq + i for i in range(n)]
