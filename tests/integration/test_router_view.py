"""Routers see what the engine can serve (CASES C53-C55): a router-style index
(``tests/router_index.py``, llm-d's indexer rules) consumes kvoffload's KV events through real
ZMQ sockets, and after every scenario it agrees with the engine's own lookups chunk for chunk.
Real arenas, real tier worker processes, real files; the restart is a SIGKILLed process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import numpy as np
import psutil
from helpers import TESTS_DIR, Rig, arena_name, fs_tier, namespace, replay, wait_until
from pipe_commands import PipeClient
from router_index import RouterIndex, Subscription

from kvoffload.events import ChunkEventInfo, KVEventBatch
from kvoffload.namespace import chunk_keys
from kvoffload.tiers.base import LookupResult
from kvoffload.tools.ports import free_port

BLOCK = 16  # tokens per engine block
BPC = 4  # blocks per chunk
CHUNK = BLOCK * BPC  # tokens per chunk
ROW = 4096
CHUNK_FILE = ROW + 4096  # an fs chunk file: payload and header (upper bound)


def _events_cfg():
    return {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}


def prompt(chunks: int, seed: int):
    """A prompt of ``chunks`` chunks: ``(block hashes, [(chunk key, ChunkEventInfo)])``, the
    chunk key being the hash of the chunk's last block (as vLLM's offload key)."""
    tokens = np.arange(seed * 1_000_000, seed * 1_000_000 + chunks * CHUNK)
    hashes = chunk_keys(tokens, BLOCK)
    out = []
    for i in range(chunks):
        first = i * BPC
        info = ChunkEventInfo(
            block_hashes=hashes[first : first + BPC],
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[i * CHUNK : (i + 1) * CHUNK].tolist(),
            block_size=BLOCK,
        )
        out.append((hashes[first + BPC - 1], info))
    return hashes, out


def _store(rig: Rig, chunks) -> None:
    tm = rig.tm
    keys = [k for k, _ in chunks]
    plan = tm.prepare_store(keys, "req", dict(chunks))
    assert plan is not None and list(plan.keys) == keys
    for s in plan.slots:
        rig.arena.rows[s] = 7
    tm.complete_store(plan.keys, True, "req")
    assert tm.wait_idle(120), "tier jobs did not finish"
    tm.step()
    assert tm.publisher.flush()


def _tier_serves(rig: Rig, keys) -> set[bytes]:
    """The keys the fs tier's own lookup settles as HIT."""
    fs = rig.fs
    res = wait_until(
        lambda: (r := [fs.lookup(k) for k in keys]) and LookupResult.RETRY not in r and r,
        what="the fs tier's verdicts",
        step=rig.tm.step,
    )
    return {k for k, r in zip(keys, res) if r is LookupResult.HIT}


def engine_serves(rig: Rig, keys) -> dict[str, set[bytes]]:
    """Per medium, the chunk keys the engine would serve from it."""
    return {"cpu": {k for k in keys if k in rig.tm.host.index}, "storage": _tier_serves(rig, keys)}


def assert_agrees(
    index: RouterIndex, pod: str, hashes, serves: dict[str, set[bytes]], others=None
) -> None:
    """The router credits ``pod``, on each medium, exactly the chunks the engine serves from
    it: chunk for chunk along the prompt (every prefix ending on a chunk boundary, and every one
    ending inside a chunk), and no entry beyond them (and ``others``, medium -> chunks of other
    prompts the engine serves from it)."""
    keys = [hashes[i * BPC + BPC - 1] for i in range(len(hashes) // BPC)]
    for medium in ("cpu", "storage"):
        have = serves[medium]
        run = 0  # chunks of the prompt the engine serves from this medium, from the first
        while run < len(keys) and keys[run] in have:
            run += 1
        for end in range(1, len(hashes) + 1):  # prefixes of 1..n blocks
            credited = index.lookup(pod, hashes[:end]).get(medium, 0)
            whole = min(end // BPC, run) * BPC
            assert credited == whole, (medium, end, credited, whole)
        assert index.hashes(pod, medium) == have | (others or {}).get(medium, set()), medium


def test_c53_chunk_events_credit_whole_chunks_only_as_the_engine_serves_them(tmp_path):
    """blocks_per_chunk 4: one chunk stored (host and fs tier). Its events, applied by the
    router-style index, credit a prefix ending on block 3 of 4 with nothing on either offload
    medium, and the whole chunk on both: what the engine's lookups serve. Two more chunks and an
    eviction from the host tier later, the index still agrees chunk for chunk."""
    hashes, chunks = prompt(3, seed=53)
    ns = namespace(tokens_per_chunk=CHUNK, row_bytes=ROW)
    with Rig(
        [fs_tier(tmp_path / "fs")], num_slots=2, row_bytes=ROW, ns=ns, kv_events=_events_cfg()
    ) as rig:
        pub = rig.tm.publisher
        index = RouterIndex(BLOCK)
        sub = Subscription(index, "pod-a", pub.endpoint, pub.replay_endpoint)
        try:
            _store(rig, chunks[:1])
            k0 = chunks[0][0]
            sub.until(lambda: index.hashes("pod-a", "storage") == {k0}, "the chunk's events")
            assert index.lookup("pod-a", hashes[:3]) == {}  # block 3 of 4: nothing on any medium
            assert index.lookup("pod-a", hashes[:4]) == {"cpu": 4, "storage": 4}
            assert index.lookup("pod-a", hashes[:7]) == {"cpu": 4, "storage": 4}
            assert_agrees(index, "pod-a", hashes[:4], engine_serves(rig, [k0]))

            _store(rig, chunks[1:])  # the third chunk evicts the first from the host tier
            keys = [k for k, _ in chunks]
            sub.until(lambda: index.hashes("pod-a", "storage") == set(keys), "the events")
            sub.until(lambda: k0 not in index.hashes("pod-a", "cpu"), "the host eviction")
            serves = engine_serves(rig, keys)
            assert k0 not in serves["cpu"] and serves["storage"] == set(keys)
            assert_agrees(index, "pod-a", hashes, serves)
            assert index.counts["skipped"] == 0 and sub.gaps == sub.holes == 0
        finally:
            sub.close()


class _Instance(PipeClient):
    """``tests/events_instance.py`` in its own process."""

    patience_s = 120.0

    def __init__(self, name: str):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(TESTS_DIR, "events_instance.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )


def _wire(chunks) -> list[dict]:
    return [
        {
            "key": k.hex(),
            "hashes": [h.hex() for h in info.block_hashes],
            "parent": None if info.parent_block_hash is None else info.parent_block_hash.hex(),
            "tokens": info.token_ids,
            "block_size": info.block_size,
        }
        for k, info in chunks
    ]


def test_c54_after_a_sigkill_and_restart_in_place_the_router_sees_what_the_instance_serves(
    tmp_path,
):
    """An instance (its own process, fs tier, KV events on fixed ports) stores 3 chunks of a
    prompt and is SIGKILLed; another starts on the same fs root and endpoints and stores the
    prompt's fourth chunk. The router-style subscriber tells the restart from a gap (the
    sequence goes back, and the new run opens with AllBlocksCleared): its view drops the host
    tier's chunks, which died with the process, and credits the fs tier's, which the new
    instance adopted and announced again: what the new instance serves, chunk for chunk."""
    hashes, chunks = prompt(4, seed=54)
    keys = [k for k, _ in chunks]
    pub_port, replay_port = free_port(), free_port()
    events = {
        "endpoint": f"tcp://127.0.0.1:{pub_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    tier = fs_tier(tmp_path / "fs", max_bytes=16 * CHUNK_FILE)
    init = dict(tiers=[tier], num_slots=8, row_bytes=ROW, tokens_per_chunk=CHUNK, kv_events=events)
    names = [arena_name(), arena_name()]
    index = RouterIndex(BLOCK)
    sub = None
    first = second = None
    pids: list[int] = []
    try:
        first = _Instance("the first run")
        info = first.ok("init", name=names[0], **init)
        pids += info["worker_pids"]
        sub = Subscription(index, "pod-a", info["endpoint"], info["replay_endpoint"])
        first.ok("store", chunks=_wire(chunks[:3]))
        sub.until(
            lambda: index.hashes("pod-a", "storage") == set(keys[:3]), "the first run's events"
        )
        assert index.hashes("pod-a", "cpu") == set(keys[:3])
        old_seq = sub.last_live if sub.last_live is not None else sub.expected

        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        first.stop_process()
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), what="its workers exit")
        if os.path.exists(f"/dev/shm/{names[0]}"):  # the killed process could not remove it
            os.unlink(f"/dev/shm/{names[0]}")

        second = _Instance("the restarted run")
        info = second.ok("init", name=names[1], **init)
        pids += info["worker_pids"]
        # A subscriber hears of the new run at the first batch that reaches it (a PUB socket
        # drops what it sends before the SUB has reconnected): the new run stores a chunk.
        second.ok("store", chunks=_wire(chunks[3:]))
        sub.until(
            lambda: sub.restarts >= 1 and index.hashes("pod-a", "storage") == set(keys),
            "the restart seen and the adopted chunks announced again",
            step=lambda: second.ok("step"),
        )
        assert sub.expected is not None and sub.expected - 1 < old_seq  # the sequence went back
        serves = second.ok("serves", keys=[k.hex() for k in keys])
        serves = {m: {bytes.fromhex(k) for k in ks} for m, ks in serves.items()}
        # the host tier's chunks died with the process; the fs tier's were adopted
        assert serves == {"cpu": {keys[3]}, "storage": set(keys)}
        assert_agrees(index, "pod-a", hashes, serves)
        assert index.counts["cleared"] >= 2 and sub.holes == 0
    finally:
        if sub is not None:
            sub.close()
        for inst in (first, second):
            if inst is not None:
                inst.stop_process()
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), what="workers exit")
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_c55_on_a_shared_root_removals_come_from_the_instances_that_announced_the_chunks(
    tmp_path,
):
    """B stores 4 chunks on an fs root it shares with A. A starts with room for one chunk: its
    scan at start adopts the 4 and evicts 3 at once, announcing neither them nor their removal;
    it announces the one it keeps, and when its own store evicts that one, its removal. B's
    lookups then find all 4 gone (a promotion's load fails, lookups miss): B announces their
    removal. The router's index per pod ends with no stale entry and agrees with each
    instance's lookups chunk for chunk."""
    hashes, chunks = prompt(4, seed=55)
    keys = [k for k, _ in chunks]
    _, own = prompt(1, seed=56)
    root = tmp_path / "shared"
    ns = namespace(tokens_per_chunk=CHUNK, row_bytes=ROW)
    index = RouterIndex(BLOCK)
    subs: list[Subscription] = []
    b_tier = fs_tier(root, max_bytes=16 * CHUNK_FILE)
    with Rig([b_tier], num_slots=4, row_bytes=ROW, ns=ns, kv_events=_events_cfg()) as b:
        try:
            pb = b.tm.publisher
            subs.append(Subscription(index, "pod-b", pb.endpoint, pb.replay_endpoint))
            _store(b, chunks)
            subs[0].until(lambda: index.hashes("pod-b", "storage") == set(keys), "B's events")
            b.tm.host.remove(keys)  # B's host tier lets them go; the shared fs tier keeps them
            b.tm.step()
            subs[0].until(lambda: not index.hashes("pod-b", "cpu"), "B's host removals")
            one_chunk = os.path.getsize(_chunk_files(root, keys[:1])[0])
            a_tier = fs_tier(root, max_bytes=one_chunk)
            with Rig([a_tier], num_slots=4, row_bytes=ROW, ns=ns, kv_events=_events_cfg()) as a:
                pa = a.tm.publisher
                subs.append(Subscription(index, "pod-a", pa.endpoint, pa.replay_endpoint))
                kept = wait_until(
                    lambda: len(_chunk_files(root, keys)) == 1 and set(a.fs.capacity.index),
                    what="A's scan at start adopting the chunks and evicting all but one",
                    step=a.tm.step,
                )
                assert len(kept) == 1 and kept <= set(keys)
                subs[1].until(lambda: index.hashes("pod-a", "storage") == kept, "A's announcement")
                _store(a, own)  # A's own chunk: its cap evicts the one it kept
                wait_until(
                    lambda: not _chunk_files(root, keys), what="A's eviction", step=a.tm.step
                )
                a.tm.step()
                assert pa.flush()
                own_key = own[0][0]
                subs[1].until(lambda: index.hashes("pod-a", "storage") == {own_key}, "A's removal")
                # what A said of B's chunks: the one it kept, stored then removed; of the others,
                # nothing
                dec = msgspec.msgpack.Decoder(KVEventBatch)
                said = [
                    (type(ev).__name__, h)
                    for _, body in replay(pa.replay_endpoint)
                    for ev in dec.decode(body).events
                    if getattr(ev, "medium", None) == "STORAGE"
                    for h in ev.block_hashes
                    if h in set(keys)
                ]
                (k,) = kept
                assert said == [("BlockStored", k), ("BlockRemoved", k)], said
                assert index.hashes("pod-b", "storage") == set(keys)  # stale until B learns

                # B's lookups find them gone: a promotion's load fails, later lookups miss
                res = b.resolve(keys)
                assert all(r is LookupResult.MISS for r in res), res
                b.tm.step()
                assert pb.flush()
                subs[0].until(lambda: not index.hashes("pod-b", "storage"), "B's removals")
                mine = engine_serves(a, [own_key])
                assert mine == {"cpu": {own_key}, "storage": {own_key}}
                assert_agrees(index, "pod-a", hashes, engine_serves(a, keys), others=mine)
            assert_agrees(index, "pod-b", hashes, engine_serves(b, keys))
            assert all(s.holes == 0 for s in subs)
        finally:
            for s in subs:
                s.close()


def _chunk_files(root, keys) -> list[str]:
    """The chunk files of ``keys`` under the fs ``root`` (named by the key's hex)."""
    names = {k.hex() for k in keys}
    return [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.split(".", 1)[0] in names
    ]
