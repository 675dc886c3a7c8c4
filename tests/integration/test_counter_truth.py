"""Counters against ground truth: what the metrics endpoint says each tier moved or holds, compared
with what is on disk, in the bucket or in the arena (CASES C50; docs/observability.md).

Every figure is read through the real exposition (``kvoffload.metrics.serve`` scraped over HTTP),
never from the manager's attributes, and compared with the storage itself: chunk files listed and
sized under the fs root, objects listed in a moto bucket.
"""

from __future__ import annotations

import os

import pytest
from helpers import HIT, Rig, fs_tier, keys_for
from s3 import client, new_bucket, obj_tier, start_moto

from kvoffload import metrics
from kvoffload.testing.tier_contract import scrape
from kvoffload.workers.chunkfile import HEADER_BYTES, SUFFIX


@pytest.fixture
def endpoint():
    port = metrics.serve(0)
    yield f"http://127.0.0.1:{port}/metrics"
    metrics.stop_serving()


@pytest.fixture
def moto():
    srv, url = start_moto()
    yield url
    srv.stop()


class Readings:
    """One scrape of the endpoint, read for one manager (``instance`` label)."""

    def __init__(self, url: str, instance: str):
        self.samples = scrape(url)
        self.instance = instance

    def __call__(self, name: str, **labels: str) -> float:
        want = tuple(sorted({"instance": self.instance, **labels}.items()))
        return self.samples.get((name, want), 0.0)

    def moved(self, tier: str, direction: str) -> tuple[float, float]:
        """``(bytes, chunks)`` the tier moved in ``direction``."""
        return (
            self("kvoffload_tier_transfer_bytes_total", tier=tier, direction=direction),
            self("kvoffload_tier_transfer_chunks_total", tier=tier, direction=direction),
        )

    def deduplicated(self, tier: str) -> dict[str, float]:
        name = "kvoffload_tier_deduplicated_chunks_total"
        return {r: self(name, tier=tier, reason=r) for r in ("known_present", "found_present")}


def chunk_files(root) -> dict[str, os.stat_result]:
    """Every chunk file under the fs root: path -> its ``lstat``."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if n.endswith(SUFFIX):
                p = os.path.join(d, n)
                out[p] = os.lstat(p)
    return out


def written(files: dict[str, os.stat_result]) -> set[tuple[int, int]]:
    """Identities of the files (inode, mtime): a rewrite (a new file renamed in) changes both."""
    return {(st.st_ino, st.st_mtime_ns) for st in files.values()}


def test_c50_stores_of_chunks_already_stored_write_no_bytes_and_are_counted_apart(
    tmp_path, endpoint
):
    """The same 8 chunks stored through two instances sharing one fs root, then again through the
    first after its host tier evicted them: 8 chunk files written once. The byte counters add up
    to the bytes of the files written (16 chunks offered, 8 written), the chunk counters to the
    files; the 8 the second instance found on disk and the 8 the first knew it held are counted
    as deduplicated, by reason, and wrote nothing (the files are the same inodes)."""
    root = tmp_path / "shared"
    keys = keys_for(8, seed=50)
    with Rig([fs_tier(root)], num_slots=16) as a, Rig([fs_tier(root)], num_slots=16) as b:
        a.store(keys)
        files = chunk_files(root)
        assert len(files) == 8
        disk = sum(st.st_size for st in files.values())
        assert disk == 8 * (HEADER_BYTES + a.row_bytes)
        b.store(keys)  # another instance: its tier finds every file there
        assert written(chunk_files(root)) == written(files)

        ra, rb = Readings(endpoint, a.tm.instance), Readings(endpoint, b.tm.instance)
        assert ra.moved("fs", "store") == (disk, 8)
        assert rb.moved("fs", "store") == (0, 0)
        assert ra.deduplicated("fs") == {"known_present": 0, "found_present": 0}
        assert rb.deduplicated("fs") == {"known_present": 0, "found_present": 8}
        # the workers' own byte counts agree with the chunk files, instance by instance
        bytes_written = "kvoffload_tier_events_total"
        assert ra(bytes_written, tier="fs", event="bytes_written") == disk
        assert rb(bytes_written, tier="fs", event="bytes_written") == 0
        assert rb(bytes_written, tier="fs", event="store_already_present") == 8

        # one instance, after its host tier evicted them: its tier knows it holds them
        a.evict_all(seed=51)  # 16 fresh chunks push the 8 out of the host tier, to disk too
        assert not any(a.tm.host.is_present(k) for k in keys)
        files = chunk_files(root)
        assert len(files) == 24
        disk = sum(st.st_size for st in files.values())
        a.store(keys)
        assert written(chunk_files(root)) == written(files)
        ra = Readings(endpoint, a.tm.instance)
        assert ra.moved("fs", "store") == (disk, 24)
        assert ra.deduplicated("fs") == {"known_present": 8, "found_present": 0}

        # what was stored is served: the 8 chunks, loaded back by the second instance, move
        # their files' bytes
        b.tm.host.remove(keys)
        assert b.resolve(keys) == [HIT] * 8
        rb = Readings(endpoint, b.tm.instance)
        assert rb.moved("fs", "load") == (8 * (HEADER_BYTES + b.row_bytes), 8)


def test_c50_the_memory_tier_counts_a_chunk_it_holds_as_deduplicated(endpoint):
    """The memory tier copies nothing for a chunk it holds: bytes and chunks count the 4 rows
    copied once; the second store of them is deduplicated (known_present)."""
    keys = keys_for(4, seed=52)
    mem = {"type": "memory", "max_bytes": 64 * 16384}
    with Rig([mem], num_slots=8) as rig:
        rig.store(keys)
        rig.tm.host.remove(keys)
        rig.store(keys)
        r = Readings(endpoint, rig.tm.instance)
        assert r.moved("memory", "store") == (4 * rig.row_bytes, 4)
        assert r.deduplicated("memory") == {"known_present": 4, "found_present": 0}


def _objects(url: str, bucket: str) -> dict[str, int]:
    """Chunk objects in the bucket: name -> size (the namespace's config.json left out)."""
    out = {}
    for page in client(url).get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            if obj["Key"].endswith(SUFFIX):
                out[obj["Key"]] = int(obj["Size"])
    return out


def test_obj_tier_byte_counters_match_the_objects_in_the_bucket(moto, endpoint):
    """6 chunks stored to an obj tier: the store bytes are the bytes of the 6 objects the bucket
    lists; loaded back after the host tier dropped them, the load bytes are those objects' bytes
    again; stored again, nothing is sent (known_present) and the counters stay."""
    bucket = new_bucket(moto)
    keys = keys_for(6, seed=53)
    with Rig([obj_tier(moto, bucket)], num_slots=8) as rig:
        rig.store(keys)
        objects = _objects(moto, bucket)
        assert len(objects) == 6
        in_bucket = sum(objects.values())
        r = Readings(endpoint, rig.tm.instance)
        assert r.moved("obj", "store") == (in_bucket, 6)
        rig.tm.host.remove(keys)
        assert rig.resolve(keys) == [HIT] * 6
        rig.tm.host.remove(keys)
        rig.store(keys)
        r = Readings(endpoint, rig.tm.instance)
        assert r.moved("obj", "load") == (in_bucket, 6)
        assert r.moved("obj", "store") == (in_bucket, 6)
        assert r.deduplicated("obj") == {"known_present": 6, "found_present": 0}


def test_fs_tier_used_bytes_and_evictions_match_the_chunk_files_on_disk(tmp_path, endpoint):
    """A capped fs tier (4 chunk files) takes 10 chunks: once its deletes are answered, its used
    bytes are the bytes of the chunk files on disk, its evictions the chunks no longer there, and
    its store bytes the bytes of every file it wrote (10)."""
    root = tmp_path / "capped"
    file_bytes = HEADER_BYTES + 16384
    with Rig([fs_tier(root, max_bytes=4 * file_bytes)], num_slots=16) as rig:
        keys = keys_for(10, seed=54)
        for i in range(0, 10, 2):
            rig.store(keys[i : i + 2])
        files = chunk_files(root)
        r = Readings(endpoint, rig.tm.instance)
        assert r("kvoffload_tier_used_bytes", tier="fs") == sum(st.st_size for st in files.values())
        assert r("kvoffload_tier_evictions_total", tier="fs") == 10 - len(files) > 0
        assert r.moved("fs", "store") == (10 * file_bytes, 10)


def test_host_gauges_match_the_arena_and_the_slots_in_flight(tmp_path, endpoint):
    """The host tier's gauges against the arena: its slots and row bytes; slots used, the chunks
    the host tier serves; slots pinned, the slots of the store jobs a paused writer holds."""
    gate = tmp_path / "go"
    pause = [{"point": "store", "action": "wait_file", "arg": str(gate)}]
    with Rig([fs_tier(tmp_path / "fs", faults=pause)], num_slots=12) as rig:
        keys = keys_for(5, seed=55)
        rig.store(keys, wait=False)
        in_flight = {s for _, _, job in rig.tm.jobs_in_flight() for s in job.slots}
        r = Readings(endpoint, rig.tm.instance)
        assert r("kvoffload_host_slots") == rig.arena.num_slots == 12
        assert r("kvoffload_host_slot_bytes") == rig.arena.row_bytes
        assert r("kvoffload_host_slots_used") == sum(rig.tm.host.is_present(k) for k in keys) == 5
        assert r("kvoffload_host_slots_pinned") == len(in_flight) == 5
        gate.touch()
        assert rig.tm.wait_idle(120)
        r = Readings(endpoint, rig.tm.instance)
        assert r("kvoffload_host_slots_pinned") == 0
        assert r("kvoffload_host_usage_ratio") == pytest.approx(5 / 12)
