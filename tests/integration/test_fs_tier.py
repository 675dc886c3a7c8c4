"""Filesystem tier with real worker processes and real files: round trips, integrity, liveness."""

import logging
import os
import signal
import stat
import time

import numpy as np
import psutil
import pytest
import xxhash
from helpers import (
    HIT,
    MISS,
    PENDING,
    RETRY,
    ROW,
    TESTS_DIR,
    Rig,
    failed_chunks,
    fs_tier,
    keys_for,
    namespace,
    payload,
    peak_rss_bytes,
    wait_paused,
    wait_until,
)

from kvoffload.ipc import messages as m
from kvoffload.ipc.channels import WorkerChannels
from kvoffload.workers import chunkfile as cf
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name, shard_dirs
from kvoffload.workers.fs_io import STALE_TEMP_AGE_S


def chunk_path(rig: Rig, root, key: bytes) -> str:
    return os.path.join(str(root), rig.ns.id(), relative_name(key))


def test_round_trip_host_fs_host_is_bit_exact(tmp_path):
    with Rig([fs_tier(tmp_path)], num_slots=8) as rig:
        keys = keys_for(8)
        rig.store(keys)
        rig.evict_all()
        assert all(rig.tm.host.lookup(k) is MISS for k in keys)
        assert rig.resolve(keys) == [HIT] * 8
        for k, row in zip(keys, rig.read(keys)):
            assert np.array_equal(row, payload(k))
        assert rig.tm.stats.loads_from["fs"] == 8
        files = [chunk_path(rig, tmp_path, k) for k in keys]
        assert all(os.path.getsize(f) == HEADER_BYTES + ROW for f in files)
        assert os.path.exists(os.path.join(tmp_path, rig.ns.id(), "config.json"))


def test_lookup_never_blocks_retry_while_probing(tmp_path):
    with Rig([fs_tier(tmp_path)], num_slots=4) as a:
        keys = keys_for(2)
        a.store(keys)
    with Rig([fs_tier(tmp_path)], num_slots=4) as b:  # a fresh instance knows nothing yet
        first = [b.tm.lookup(k, "r") for k in keys]
        assert first == [PENDING, PENDING] or all(r.name in ("RETRY", "HIT_PENDING") for r in first)
        assert b.resolve(keys) == [HIT, HIT]


def _lookups_until_settled(rig: Rig, keys: list[bytes]) -> list:
    """The end of the scheduler step of a request's first lookups of ``keys`` (which submits
    their promotions, one job), then its lookups repeated with no scheduler step in between
    until none is HIT_PENDING; the last answers."""
    rig.tm.step()
    last: list = []

    def settled() -> bool:
        last[:] = [rig.tm.lookup(k, "r") for k in keys]
        return PENDING not in last

    wait_until(settled, what="the promotions to land without a scheduler step")
    return last


def test_a_promotion_that_landed_is_a_hit_at_its_requests_next_lookup_without_a_step(tmp_path):
    """Chunks promoted from the fs tier for a request answer HIT at the request's next lookup
    once they have landed (the lookup applies the finished promotion), not one scheduler step
    later: the steps between a reload's last fs read and its accelerator copy
    (docs/profiles/ttft.md). The bytes are the ones stored, each chunk read from the fs tier
    once."""
    with Rig([fs_tier(tmp_path)], num_slots=8) as rig:
        keys = keys_for(4)
        rig.store(keys)
        rig.evict_all()
        assert [rig.tm.lookup(k, "r") for k in keys] == [PENDING] * 4
        assert _lookups_until_settled(rig, keys) == [HIT] * 4
        for k, row in zip(keys, rig.read(keys)):
            assert np.array_equal(row, payload(k))
        assert rig.tm.stats.promotions["fs"] == 4
        assert rig.tm.stats.promotion_failures["fs"] == 0


def test_a_requests_chunks_looked_up_one_by_one_go_out_as_one_promotion_job(tmp_path):
    """vLLM looks a request's chunks up one by one within a scheduler step; a lookup applies
    finished jobs but submits no promotion, so the request's found prefix goes out as one job at
    the step's end however much time passes between its lookups (a poll between two of them split
    it into jobs of a chunk, each judged alone behind the tier's queue: BENCHMARKS.md §6)."""
    with Rig([fs_tier(tmp_path)], num_slots=8) as rig:
        rig.tm._poll_interval = 0.0  # every lookup polls
        keys = keys_for(4)
        rig.store(keys)
        rig.evict_all()
        assert [rig.tm.lookup(k, "r") for k in keys] == [PENDING] * 4  # a poll before each
        assert not rig.tm._jobs  # nothing submitted yet
        rig.tm.step()
        (job,) = rig.tm._jobs.values()
        assert job.meta.is_promotion and job.meta.keys == keys
        assert _lookups_until_settled(rig, keys) == [HIT] * 4


def test_a_poll_between_an_engines_lookups_submits_peers_promotions_only(tmp_path):
    """The p2p node thread polls while promotions for peers are in flight, between the engine's
    lookups: it submits those (no request waits on the engine's step for them) and leaves the
    engine's request's queued promotions for its step's end, one job."""
    with Rig([fs_tier(tmp_path)], num_slots=8) as rig:
        rig.tm._poll_interval = 3600.0  # only the polls below
        keys = keys_for(5)
        rig.store(keys)
        rig.evict_all()
        assert [rig.tm.lookup(k, "r") for k in keys[:2]] == [PENDING] * 2
        assert rig.tm.promote_for_peer(0, keys[4])
        rig.tm.submit_promotions(peers_only=True)  # as the node thread does
        rig.tm.poll(submit=False)
        (peer_job,) = rig.tm._jobs.values()
        assert peer_job.meta.keys == [keys[4]] and peer_job.meta.req_id != "r"
        assert [rig.tm.lookup(k, "r") for k in keys[2:4]] == [PENDING] * 2
        rig.tm.step()
        jobs = [j.meta for j in rig.tm._jobs.values() if j.meta.req_id == "r"]
        assert [m.keys for m in jobs] == [keys[:4]]
        rig.tm._poll_interval = 0.0  # the lookups below apply what lands
        assert _lookups_until_settled(rig, keys[:4]) == [HIT] * 4


def test_a_promotion_that_failed_is_a_miss_at_its_requests_next_lookup_never_a_hit(tmp_path):
    """A lookup that applies a finished promotion whose read failed (EIO on one chunk) answers
    MISS for that chunk (its slot is freed, the fs tier's verdict is the failed load), never HIT;
    the other chunks of the request are HITs with the bytes stored."""
    keys = keys_for(4)
    bad = keys[2]
    fault = {
        "point": "read_payload",
        "action": "raise",
        "arg": 5,
        "key_hex": bad.hex(),
        "count": -1,
    }
    with Rig([fs_tier(tmp_path, faults=[fault])], num_slots=8) as rig:
        rig.store(keys)
        rig.evict_all()
        assert [rig.tm.lookup(k, "r") for k in keys] == [PENDING] * 4
        assert _lookups_until_settled(rig, keys) == [HIT, HIT, MISS, HIT]
        good = [k for k in keys if k != bad]
        for k, row in zip(good, rig.read(good)):
            assert np.array_equal(row, payload(k))
        assert rig.tm.host.lookup(bad) is MISS
        assert rig.tm.stats.promotion_failures["fs"] == 1


def test_c06_same_length_corruption_is_a_miss_and_the_file_is_removed(tmp_path):
    with Rig([fs_tier(tmp_path)], num_slots=4) as rig:
        k = keys_for(1)[0]
        rig.store([k])
        rig.evict_all()
        path = chunk_path(rig, tmp_path, k)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + ROW // 2)
            b = f.read(1)
            f.seek(HEADER_BYTES + ROW // 2)
            f.write(bytes([b[0] ^ 0xFF]))
        assert os.path.getsize(path) == size
        assert rig.resolve([k]) == [MISS]
        assert not os.path.exists(path)
        assert rig.fs.counters["checksum_failures"] == 1
        assert rig.tm.stats.promotion_failures["fs"] == 1
        assert rig.resolve([k]) == [MISS]


@pytest.mark.parametrize("damage", ["truncate", "header", "empty"])
def test_damaged_files_are_misses_never_wrong_bytes(tmp_path, damage):
    with Rig([fs_tier(tmp_path)], num_slots=4) as rig:
        k = keys_for(1)[0]
        rig.store([k])
        rig.evict_all()
        path = chunk_path(rig, tmp_path, k)
        if damage == "truncate":
            os.truncate(path, HEADER_BYTES + ROW // 2)
        elif damage == "header":
            with open(path, "r+b") as f:
                f.write(b"XXXXXXXX")
        else:
            os.truncate(path, 0)
        assert rig.resolve([k]) == [MISS]
        assert not os.path.exists(path)


def test_c08_file_deleted_outside_the_library_is_a_clean_miss(tmp_path):
    fb = HEADER_BYTES + ROW
    with Rig([fs_tier(tmp_path, max_bytes=8 * fb)], num_slots=4) as rig:
        k1, k2, k3 = keys_for(3)
        rig.store([k1, k2, k3])
        rig.evict_all()
        assert {k1, k2, k3} <= set(rig.fs.capacity.index)
        os.unlink(chunk_path(rig, tmp_path, k2))
        pids = rig.fs.worker_pids()
        res = rig.resolve([k1, k2, k3])  # no exception reaches the caller
        # K3 is loaded (it has its own file) or skipped by the prefix rule; K2 is a miss
        assert res[0] is HIT and res[1] is MISS and res[2] in (HIT, MISS)
        assert np.array_equal(rig.read([k1])[0], payload(k1))
        if res[2] is HIT:
            assert np.array_equal(rig.read([k3])[0], payload(k3))
        # K2's load failed once, for the reason "missing", and its index entry was dropped
        assert rig.tm.stats.failed == {("fs", "load", "missing"): 1}
        assert rig.tm.stats.promotion_failures["fs"] == 1
        assert k2 not in rig.fs.capacity.index and k1 in rig.fs.capacity.index
        assert rig.fs.capacity.used_bytes == sum(os.path.getsize(f) for f in _files(tmp_path))
        assert rig.resolve([k2]) == [MISS]  # and it stays a miss
        # the coordinator and the same worker processes are alive; later jobs succeed
        assert rig.fs.worker_pids() == pids
        assert all(psutil.pid_exists(p) for ps in pids.values() for p in ps)
        assert rig.fs.counters.get("worker_restarts", 0) == 0
        k4 = keys_for(1, seed=7)[0]
        rig.store([k4])
        assert rig.tm.stats.cascade_failures["fs"] == 0 and rig.tm.stats.cascaded["fs"] == 3 + 4 + 1
        assert os.path.exists(chunk_path(rig, tmp_path, k4))


@pytest.mark.parametrize("variant", ["truncate", "eio"])
def test_c07_failed_load_does_not_livelock_the_request(tmp_path, variant):
    keys = keys_for(4)
    k3 = keys[2]
    faults = []
    if variant == "eio":
        faults = [
            {"point": "read_payload", "action": "raise", "arg": 5, "key_hex": k3.hex(), "count": -1}
        ]
    with Rig([fs_tier(tmp_path, faults=faults)], num_slots=4) as rig:
        rig.store(keys)
        rig.evict_all()
        # 1. the tier's positive lookup verdicts are cached (the stores made them present)
        assert [rig.fs.lookup(k) for k in keys] == [HIT] * 4
        rig.evict_all(seed=98)
        path = chunk_path(rig, tmp_path, k3)
        if variant == "truncate":
            os.truncate(path, HEADER_BYTES + ROW // 2)
        for _ in range(100):  # 3. drive the coordinator for 100 steps
            res = [rig.tm.lookup(k, "r") for k in keys]
            rig.tm.step()
            time.sleep(0.002)
        res = rig.resolve(keys)
        assert res[0] is HIT and res[1] is HIT and res[2] is MISS
        usable = next(i for i, r in enumerate(res) if r is not HIT)
        assert usable == 2  # the longest usable prefix is K1..K2
        assert rig.tm.stats.promotion_failures["fs"] == 1  # exactly one read attempt for K3
        assert rig.fs.counters["load_failures"] == 1
        if variant == "eio":
            assert os.path.exists(path), "a transient EIO must not delete a valid file"
        else:
            assert not os.path.exists(path)


def test_c10_eviction_racing_a_load_gives_whole_bytes_or_clean_miss(tmp_path):
    gate = tmp_path / "go"
    k = keys_for(1)[0]
    fault = {
        "point": "after_metadata_before_read",
        "action": "wait_file",
        "arg": str(gate),
        "count": 1,
    }
    with Rig([fs_tier(tmp_path / "root", faults=[fault])], num_slots=4) as rig:
        rig.store([k])
        rig.evict_all()
        assert (
            rig.tm.lookup(k, "r") is PENDING
        )  # promotion starts; the worker pauses after metadata
        rig.tm.step()
        wait_paused(gate, step=rig.tm.poll)
        path = chunk_path(rig, tmp_path / "root", k)
        rig.fs.remove([k])  # explicit removal while the load is paused
        wait_until(
            lambda: not os.path.exists(path), what="the chunk file deleted", step=rig.tm.poll
        )
        gate.touch()
        res = rig.resolve([k])
        if res == [HIT]:
            assert np.array_equal(rig.read([k])[0], payload(k))
        else:
            assert res == [MISS]
        assert rig.tm.host.num_pinned == 0


def test_c10_thousand_randomized_load_remove_races(tmp_path):
    rng = np.random.default_rng(1)
    with Rig([fs_tier(tmp_path, max_bytes=64 * (HEADER_BYTES + ROW))], num_slots=4) as rig:
        k = keys_for(1)[0]
        full, clean = 0, 0
        for _ in range(1000):
            if rig.tm.host.lookup(k) is not MISS:
                rig.tm.host.remove([k])
            rig.store([k], wait=False)
            rig.tm.wait_idle(120)
            rig.tm.host.remove([k])
            assert rig.tm.lookup(k, "r") in (PENDING, MISS)
            rig.tm.step()
            if rng.random() < 0.5:
                time.sleep(rng.random() * 0.002)
            rig.fs.remove([k])
            res = rig.resolve([k])
            if res == [HIT]:
                assert np.array_equal(rig.read([k])[0], payload(k))
                full += 1
            else:
                assert res == [MISS]
                clean += 1
            rig.fs.verdicts.absent.clear()
            assert rig.tm.host.num_pinned == 0
            assert rig.tm.wait_idle(120)
            # never an index entry whose file is missing
            assert (k in rig.fs.capacity.index) <= os.path.exists(chunk_path(rig, tmp_path, k))
        # every failed promotion is one counted cleanly (a miss), every other load was whole
        assert rig.tm.stats.promotions["fs"] == full
        assert rig.tm.stats.promotion_failures["fs"] <= clean
        assert rig.fs.capacity.used_bytes == sum(os.path.getsize(f) for f in _files(tmp_path))


def test_c16_dropped_load_turns_pending_into_miss_after_the_deadline(tmp_path):
    k = keys_for(1)[0]
    faults = [{"point": "load", "action": "drop", "key_hex": k.hex(), "count": 1}]
    with Rig([fs_tier(tmp_path, job_timeout_s=1.0, faults=faults)], num_slots=2) as rig:
        rig.store([k])
        rig.evict_all()
        t0 = time.monotonic()
        assert rig.tm.lookup(k, "r2") is PENDING

        def settled():
            rig.tm.step()
            return rig.tm.lookup(k, "r2") is not PENDING

        wait_until(settled, what="the pending lookup to settle")
        assert rig.tm.lookup(k, "r2") is MISS
        assert time.monotonic() - t0 >= 1.0  # not given up before the job timeout
        assert rig.fs.counters["pending_deadline_expired"] == 1
        assert (
            rig.tm.host.num_writing == 0 and rig.tm.host.lookup(k) is MISS
        )  # reservation released
        assert rig.tm.host.allocate(keys_for(1, seed=3)) is not None  # the slot is reusable


def test_c16_dropped_store_releases_its_reservation_after_the_deadline(tmp_path):
    """The store of K to the fs tier is dropped by its worker (no reply, ever) and its request is
    aborted. The host copy stays readable meanwhile (a tier store never makes a chunk pending);
    after the job deadline the store fails, the host pin and the tier's capacity reservation are
    released, nothing is published or counted, and K is a plain miss once the host evicts it."""
    k = keys_for(1)[0]
    fb = HEADER_BYTES + ROW
    faults = [{"point": "store", "action": "drop", "key_hex": k.hex(), "count": 1}]
    with Rig(
        [fs_tier(tmp_path, job_timeout_s=1.0, max_bytes=4 * fb, faults=faults)], num_slots=2
    ) as rig:
        rig.wait_workers_ready()
        t0 = time.monotonic()
        rig.store([k], wait=False)
        assert rig.tm.host.num_pinned == 1 and list(rig.fs.capacity.reserved) == [k]
        rig.tm.on_request_finished("")  # the request that started the store is aborted
        assert rig.tm.lookup(k, "r2") is HIT  # R2 never waits on the tier store
        assert rig.tm.wait_idle(120)
        assert time.monotonic() - t0 >= 1.0  # failed by the deadline, not before
        assert rig.fs.counters["job_timeouts"] == 1 and rig.tm.stats.cascade_failures["fs"] == 1
        assert rig.tm.stats.failed == {("fs", "store", "timeout"): 1}
        # the orphaned reservations are released; nothing half-accounted is left
        assert (
            rig.tm.host.num_pinned == 0
            and not rig.fs.capacity.reserved
            and rig.fs.capacity.used_bytes == 0
        )
        assert k not in rig.fs.verdicts.present and k not in rig.fs.capacity.index
        assert not os.path.exists(chunk_path(rig, tmp_path, k)) and not _files(tmp_path)
        assert rig.store(keys_for(2, seed=3)) == [k]  # its host slot is reusable
        assert rig.resolve([k]) == [MISS]
        assert rig.fs.capacity.used_bytes == 2 * fb and rig.fs.counters.get("evictions", 0) == 0
        assert rig.fs.counters.get("pending_deadline_expired", 0) == 0  # no load expired


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_c17_worker_that_dies_or_goes_silent_fails_or_reruns_its_jobs(tmp_path, how):
    gate = tmp_path / "gate"
    fault = {"point": "before_read_slot", "action": "wait_file", "arg": str(gate), "count": -1}
    # A killed worker is noticed by its exit, long before this job timeout; a stopped (silent) one
    # only by the timeout, which also bounds the re-runs on a replacement that may get little CPU.
    timeout_s = 120.0 if how == "kill" else 10.0
    cfg = fs_tier(
        tmp_path / "root",
        write_workers=2,
        read_workers=2,
        job_timeout_s=timeout_s,
        chunks_per_task=1,
        faults=[fault],
    )
    with Rig([cfg], num_slots=32) as rig:
        rig.wait_workers_ready()
        keys = keys_for(8)
        rig.store(keys, wait=False)  # 8 store tasks across the 2 writers, all paused

        def holder():
            """A writer paused holding store tasks (which one depends on how they were spread)."""
            paused = set(wait_paused(gate, step=rig.tm.poll))
            return next(
                (
                    w.proc.pid
                    for w in rig.fs._writers.workers.values()
                    if w.inflight and w.proc.pid in paused
                ),
                None,
            )

        victim = wait_until(holder, what="a writer paused holding tasks", step=rig.tm.poll)
        writers = rig.fs._writers
        held = next(w for w in writers.workers.values() if w.proc.pid == victim)
        victim_wid, victim_tasks = held.wid, list(held.inflight)
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        if how == "kill":
            # Its tasks are re-run by the other writers (paused at the gate too). A late reply
            # from the dead worker (as a revived one would send) must be ignored, not taken as
            # the answer of the re-run, whose worker has not even read the slot yet.
            def rerun_in_flight():
                held = [t for w in writers.workers.values() for t in w.inflight]
                return victim_wid not in writers._by_wid and set(victim_tasks) <= set(held)

            wait_until(rerun_in_flight, what="the dead writer's tasks re-run", step=rig.tm.poll)
            before = (
                writers.inflight_count,
                rig.tm.host.num_pinned,
                rig.tm.stats.cascaded["fs"],
                rig.tm.stats.cascade_failures["fs"],
                len(rig.tm._jobs),
            )
            late = WorkerChannels(rig.fs._chans.endpoints["stores"], b"late")
            late.say_hello(m.encode(m.Hello(victim_wid, os.getpid())))
            for tid in victim_tasks:
                late.send_result(
                    m.encode(
                        m.TaskResult(
                            tid, victim_wid, [m.OK], nbytes=ROW, counters={"late_replies": 1}
                        )
                    )
                )
            wait_until(
                lambda: rig.fs.counters.get("late_replies") == len(victim_tasks),
                what="the late replies received",
                step=rig.tm.poll,
            )
            late.close()
            assert (
                writers.inflight_count,
                rig.tm.host.num_pinned,
                rig.tm.stats.cascaded["fs"],
                rig.tm.stats.cascade_failures["fs"],
                len(rig.tm._jobs),
            ) == before
        gate.touch()  # let the surviving worker (and re-runs) proceed
        assert rig.tm.wait_idle(300)
        # a dead worker is noticed by its exit (no job timed out); a silent one by the job timeout
        if how == "kill":
            assert rig.fs.counters.get("job_timeouts", 0) == 0
        else:
            assert rig.fs.counters["job_timeouts"] >= 1 and time.monotonic() - t0 >= timeout_s
        new_writers = rig.fs.worker_pids()["stores"]
        assert victim not in new_writers and len(new_writers) == 2
        assert all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in new_writers)
        assert rig.tm.host.num_pinned == 0
        stats = rig.tm.stats
        assert stats.cascaded["fs"] + stats.cascade_failures["fs"] == 8
        if how == "stop":
            with pytest.raises(psutil.NoSuchProcess):
                psutil.Process(victim).status()  # the silent worker was killed, never revived
        failed_keys = [k for k in keys if k not in rig.fs.verdicts.present]
        assert len(failed_keys) == stats.cascade_failures["fs"]  # a failed store is never published
        if how == "stop":
            assert failed_keys  # the timed-out task failed...
        for k in failed_keys:
            assert not os.path.exists(chunk_path(rig, tmp_path / "root", k))  # ...and wrote nothing
        rig.evict_all()
        res = rig.resolve(keys)
        assert [k for k, r in zip(keys, res) if r is MISS] == failed_keys
        stored = [k for k, r in zip(keys, res) if r is HIT]
        for k, row in zip(stored, rig.read(stored)):
            assert np.array_equal(row, payload(k))  # no half-written chunk is ever loadable
        assert rig.tm.stats.promotion_failures["fs"] == 0  # no load of an unpublished chunk
        assert rig.fs._readers.inflight_count == 0
        assert not rig.tm._jobs and not rig.fs._job_count  # request-state maps back to empty


def test_c22_store_source_slot_is_not_reused_while_the_writer_reads_it(tmp_path):
    gate = tmp_path / "gate"
    k1 = keys_for(1)[0]
    fault = {
        "point": "before_read_slot",
        "action": "wait_file",
        "arg": str(gate),
        "key_hex": k1.hex(),
    }
    with Rig([fs_tier(tmp_path / "root", faults=[fault])], num_slots=1) as rig:
        rig.store([k1], fill=0x11, wait=False)
        wait_paused(gate, step=rig.tm.poll)  # the writer holds slot X, before reading it
        # Free slot X (only slot): the store job pins it, so no room is made for K2.
        k2 = keys_for(1, seed=2)[0]
        assert rig.tm.prepare_store([k2]) is None
        assert rig.tm.host.remove([k1]) == []
        gate.touch()
        assert rig.tm.wait_idle(120)
        plan = rig.tm.prepare_store([k2])
        assert plan is not None
        rig.arena.rows[plan.slots[0]] = 0x22
        rig.tm.complete_store(plan.keys, True)
        assert rig.tm.wait_idle(120)
        with open(chunk_path(rig, tmp_path / "root", k1), "rb") as f:
            data = f.read()[HEADER_BYTES:]
        assert data == bytes([0x11]) * ROW


def test_c06_hung_read_fails_within_the_deadline_and_other_loads_complete(tmp_path):
    keys = keys_for(4)
    hung = keys[0]
    fault = {"point": "read_payload", "action": "sleep", "arg": 60, "key_hex": hung.hex()}
    timeout_s = 10.0
    with Rig(
        [fs_tier(tmp_path, read_workers=2, job_timeout_s=timeout_s, faults=[fault])], num_slots=8
    ) as rig:
        rig.store(keys)
        rig.evict_all()
        rig.wait_workers_ready()
        t0 = time.monotonic()
        assert rig.tm.lookup(hung, "a") is PENDING
        rig.tm.step()
        others = rig.resolve(keys[1:], timeout_s=120)
        # not starved by the hung call: served by the other reader before the hung task's deadline
        assert others == [HIT] * 3 and rig.fs.counters.get("job_timeouts", 0) == 0
        res = rig.resolve([hung], timeout_s=120)
        assert res == [MISS] and time.monotonic() - t0 >= timeout_s  # failed by its deadline
        assert rig.fs.counters["job_timeouts"] == 1


def test_c13_repeated_puts_of_a_resident_chunk_are_not_double_counted(tmp_path):
    fb = HEADER_BYTES + ROW
    a, b, c = keys_for(3)

    def check(rig):  # after every operation: accounted == Σ resident entries == Σ files on disk
        on_disk = sum(os.path.getsize(f) for f in _files(tmp_path))
        assert rig.fs.capacity.used_bytes == sum(rig.fs.capacity.index.values()) == on_disk

    # The host tier with room for 2 chunks: put a, put a again, put b; nothing evicted.
    with Rig([], num_slots=2) as host:
        assert host.store([a]) == []
        assert host.tm.prepare_store([a]).keys == []  # resident: no slot reserved again
        assert host.store([b]) == []
        assert host.tm.host.num_used == 2 and host.resolve([a, b]) == [HIT, HIT]
    # The fs tier with a budget of 2 chunk files.
    with Rig([fs_tier(tmp_path, max_bytes=2 * fb)], num_slots=8) as rig:
        rig.store([a])
        check(rig)
        path_a = chunk_path(rig, tmp_path, a)
        st = os.stat(path_a)
        rig.tm.host.remove([a])
        rig.store([a])  # put a again
        check(rig)
        rig.store([b])
        check(rig)
        assert rig.fs.capacity.used_bytes == 2 * fb
        assert rig.fs.counters.get("evictions", 0) == 0
    # Another engine on the root knows a and b only from its start-up scan: its puts of them reach
    # the workers, which must neither rewrite the files nor let the tier count them twice.
    with Rig([fs_tier(tmp_path, max_bytes=2 * fb)], num_slots=8) as other:
        wait_until(
            lambda: other.fs.counters.get("adopted_chunks") == 2,
            what="a and b adopted from the scan",
            step=other.tm.poll,
        )
        check(other)
        other.store([a])
        check(other)
        other.store([b])
        check(other)
        assert other.fs.counters["store_already_present"] == 2  # the workers saw the files
        st2 = os.stat(path_a)
        assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)  # a not rewritten
        assert other.fs.capacity.used_bytes == 2 * fb and other.fs.counters.get("evictions", 0) == 0
        # variant: remove a through the public API, then put c
        other.fs.remove([a])
        assert other.fs.capacity.used_bytes == fb
        wait_until(lambda: not os.path.exists(path_a), what="a's delete", step=other.tm.poll)
        check(other)
        other.store([c])
        check(other)
        assert other.fs.capacity.used_bytes == 2 * fb and other.fs.counters.get("evictions", 0) == 0


def _files(root) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names if n.endswith(".kv"))
    return out


def test_c21_capacity_setting_is_enforced(tmp_path):
    fb = HEADER_BYTES + ROW
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=4) as rig:
        keys = keys_for(30)
        for i in range(0, 30, 3):
            rig.store(keys[i : i + 3])
            rig.tm.wait_idle(120)
        assert rig.tm.wait_idle(120)
        assert rig.tm.stats.cascaded["fs"] == 30 and rig.fs.counters.get("evictions", 0) == 20
        assert rig.fs.capacity.used_bytes == 10 * fb  # a cap implies eviction
        wait_until(
            lambda: sum(os.path.getsize(f) for f in _files(tmp_path)) <= 10 * fb,
            what="evicted chunks deleted",
            step=rig.tm.poll,
        )
        assert len(_files(tmp_path)) == 10


def test_c14_chunks_from_earlier_runs_are_adopted_and_counted(tmp_path):
    fb = HEADER_BYTES + ROW
    ns_a_dir = None
    # An orphaned temp file of a killed writer (last written long ago) is removed at start.
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=4) as run1:
        first = keys_for(8)
        run1.store(first[:4])
        run1.store(first[4:])
        ns_a_dir = os.path.join(tmp_path, run1.ns.id())
        ns = run1.ns
    orphan = os.path.join(ns_a_dir, "00", "00", f".deadbeef.{2**22 - 3}.0.tmp")
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    with open(orphan, "wb") as f:
        f.write(b"x" * 100)
    long_ago = time.time() - 2 * STALE_TEMP_AGE_S
    os.utime(orphan, (long_ago, long_ago))
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=4, ns=ns) as run2:
        wait_until(
            lambda: run2.fs.counters.get("adopted_chunks") == 8,
            what="the earlier run's 8 chunks adopted",
            step=run2.tm.poll,
        )
        for i in range(0, 10, 2):
            run2.store(keys_for(10, seed=1)[i : i + 2])
        assert run2.tm.wait_idle(120)
        assert run2.fs.counters.get("evictions", 0) == 8  # 8 adopted + 10 new, capped at 10
        wait_until(
            lambda: sum(os.path.getsize(f) for f in _files(ns_a_dir)) <= 10 * fb,
            what="chunks past the cap deleted",
            step=run2.tm.poll,
        )
        assert run2.fs.capacity.used_bytes == sum(os.path.getsize(f) for f in _files(ns_a_dir))
        assert not os.path.exists(orphan)
    other = namespace(model="another/model")
    with Rig([fs_tier(tmp_path, max_bytes=10 * fb)], num_slots=4, ns=other) as run3:
        for i in range(0, 10, 2):
            run3.store(keys_for(10, seed=2)[i : i + 2])
        ns_b_dir = os.path.join(tmp_path, other.id())
        assert sum(os.path.getsize(f) for f in _files(ns_b_dir)) <= 10 * fb  # per namespace
    assert sum(os.path.getsize(f) for f in _files(ns_a_dir)) <= 10 * fb


def test_two_managers_on_one_root_share_chunks(tmp_path):
    with Rig([fs_tier(tmp_path)], num_slots=8) as a, Rig([fs_tier(tmp_path)], num_slots=8) as b:
        keys = keys_for(6)
        a.store(keys)
        assert b.resolve(keys) == [HIT] * 6
        for k, row in zip(keys, b.read(keys)):
            assert np.array_equal(row, payload(k))


def test_two_managers_writing_and_reading_the_same_chunks_never_see_a_torn_file(tmp_path):
    with (
        Rig([fs_tier(tmp_path, write_workers=2)], num_slots=64) as a,
        Rig([fs_tier(tmp_path, write_workers=2, negative_ttl_s=0)], num_slots=64) as b,
    ):
        keys = keys_for(48)
        for i in range(0, 48, 8):
            a.store(keys[i : i + 8], wait=False)
            b.store(keys[i : i + 8], wait=False)
        c_res = []
        with Rig([fs_tier(tmp_path, negative_ttl_s=0)], num_slots=64) as c:
            for _ in range(3):
                res = c.resolve(keys, timeout_s=120)
                hits = [k for k, r in zip(keys, res) if r is HIT]
                for k, row in zip(hits, c.read(hits)):
                    assert np.array_equal(row, payload(k))
                c_res.append(len(hits))
                c.tm._load_source.clear()
        a.tm.wait_idle(120)
        b.tm.wait_idle(120)
        assert a.tm.stats.cascade_failures["fs"] == 0 and b.tm.stats.cascade_failures["fs"] == 0


def test_worker_processes_import_no_torch_run_at_lower_priority_and_exit_with_the_engine(tmp_path):
    import subprocess
    import sys
    import textwrap

    with Rig([fs_tier(tmp_path)], num_slots=2) as rig:
        rig.store(keys_for(1))
        rig.wait_workers_ready()
        me = psutil.Process()
        for pid in (p for ps in rig.fs.worker_pids().values() for p in ps):
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            assert "libtorch" not in maps and "torch/_C" not in maps
            assert psutil.Process(pid).nice() > me.nice()
            assert psutil.Process(pid).memory_info().rss < 200 * 2**20
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {TESTS_DIR!r})
        from helpers import Rig, fs_tier, keys_for
        rig = Rig([fs_tier({str(tmp_path)!r})], num_slots=2, name=sys.argv[1])
        rig.store(keys_for(1))
        print(" ".join(str(p) for ps in rig.fs.worker_pids().values() for p in ps), flush=True)
        time.sleep(600)
    """)
    name = f"kvoffload_test_orphan_{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-c", script, name], stdout=subprocess.PIPE)
    pids = [int(x) for x in p.stdout.readline().split()]
    assert os.path.exists(f"/dev/shm/{name}")
    p.kill()
    p.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (
        any(psutil.pid_exists(x) for x in pids) or os.path.exists(f"/dev/shm/{name}")
    ):
        time.sleep(0.05)
    assert not any(
        psutil.pid_exists(x) and psutil.Process(x).status() != psutil.STATUS_ZOMBIE for x in pids
    )
    assert not os.path.exists(f"/dev/shm/{name}"), "orphaned arena left behind"


def test_tasks_queued_behind_a_hung_task_are_rerun_not_failed(tmp_path):
    keys = keys_for(3)
    hung = keys[0]
    gate = tmp_path / "never"  # the hung read waits for a file nobody creates
    fault = {
        "point": "read_payload",
        "action": "wait_file",
        "arg": str(gate),
        "key_hex": hung.hex(),
    }
    # One reader: the other loads queue behind the hung one in the same worker.
    # The deadline kills the hung task; the re-runs behind it must finish well within it, even on
    # a machine where the replacement worker gets little CPU.
    with Rig(
        [fs_tier(tmp_path / "root", read_workers=1, job_timeout_s=10.0, faults=[fault])],
        num_slots=8,
    ) as rig:
        rig.store(keys)
        rig.evict_all()
        rig.wait_workers_ready()
        assert rig.tm.lookup(hung, "a") is PENDING
        rig.tm.step()
        wait_paused(gate, step=rig.tm.poll)  # the reader is stuck in the hung read
        res = rig.resolve(keys[1:], timeout_s=120)
        assert res == [HIT, HIT]  # re-run on the replacement worker, not failed with the hung one
        assert rig.resolve([hung], timeout_s=120) == [MISS]
        assert rig.fs.counters["job_timeouts"] == 1


def test_c10_a_chunk_evicted_from_a_capped_tier_is_a_miss_while_its_delete_is_pending(tmp_path):
    """An evicted chunk's file lives on until a writer deletes it. A probe answered in that window,
    or a store of the same chunk that finds the old file and skips, must not make the tier believe
    it holds the chunk: the delete then removes it and the load would find nothing."""
    gate = tmp_path / "deletes-may-run"
    fb = ROW + 4096
    cfg = fs_tier(
        tmp_path / "fs",
        max_bytes=2 * fb,
        write_workers=2,
        faults=[{"point": "delete", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    with Rig([cfg], num_slots=8) as rig:
        rig.wait_workers_ready()  # the blocked delete and the store of k3 go to different writers
        k1, k2, k3 = keys_for(3)
        rig.store([k1])
        rig.store([k2])
        rig.store([k3], wait=False)  # evicts k1 from the tier; its delete waits at the gate
        wait_until(lambda: rig.tm.stats.cascaded["fs"] >= 3, what="three stores", step=rig.tm.step)
        assert rig.tm.stats.cascaded["fs"] == 3
        assert rig.fs.counters["evictions"] == 1
        rig.tm.host.remove([k1])
        assert rig.resolve([k1]) == [MISS]  # the probe still saw the file
        assert rig.fs.counters["stale_probes"] >= 1
        rig.store([k1], wait=False)  # a store while the delete is pending is refused, not "skipped"
        rig.tm.step()
        gate.touch()
        assert rig.tm.wait_idle(120)
        assert rig.fs.counters.get("store_skipped_deleting", 0) == 1
        rig.tm.host.remove([k1])
        assert rig.resolve([k1]) == [MISS]
        assert rig.tm.stats.promotion_failures["fs"] == 0  # no load went looking for a deleted file


def test_a_slow_tier_pins_at_most_tier_pin_fraction_of_the_host_tier(tmp_path):
    gate = tmp_path / "stores-may-run"
    cfg = fs_tier(
        tmp_path / "fs",
        faults=[{"point": "store", "action": "wait_file", "arg": str(gate), "count": -1}],
    )
    with Rig([cfg], num_slots=8, tier_pin_fraction=0.5) as rig:
        keys = keys_for(6)
        for k in keys:
            rig.store([k], wait=False)
        assert rig.tm.host.num_pinned == 4  # the tier holds half the host tier, no more
        assert rig.tm.stats.dropped_stores["fs"] == 2
        gate.touch()
        assert rig.tm.wait_idle(120)
        assert rig.tm.host.num_pinned == 0 and rig.tm.stats.cascaded["fs"] == 4


@pytest.mark.slow
def test_c23_lookup_among_100k_chunk_files_fanned_out_over_directories(tmp_path):
    """CASES C23 step 4: 100,000 chunk files published under one root are fanned out over shard
    directories (no directory holds more than about 10k entries), and lookups among them still
    find what is there. The other 99,999 files are sparse (right size, no payload): lookups only
    check that a chunk exists; the one chunk loaded was stored through the tier."""
    n = 100_000
    with Rig([fs_tier(tmp_path, read_workers=2)], num_slots=8) as rig:
        keys = keys_for(n, seed=5)
        real = keys[-1]
        rig.store([real])
        ns_dir = os.path.join(tmp_path, rig.ns.id())
        made = set()
        for k in keys[:-1]:
            path = chunk_path(rig, tmp_path, k)
            d = os.path.dirname(path)
            if d not in made:
                os.makedirs(d, exist_ok=True)
                made.add(d)
            with open(path, "wb") as f:
                f.truncate(HEADER_BYTES + ROW)
        per_dir = {}
        for d, dirs, names in os.walk(ns_dir):
            per_dir[d] = len(dirs) + len(names)
        files = _files(ns_dir)
        assert len(files) == n
        assert max(per_dir.values()) <= 10_000, max(per_dir.values())
        assert len(per_dir) > n // 10_000  # spread over many directories, not a few
        # 10,000 tier lookups of published chunks (existence probes, no loads) and 100 of absent ones
        sample = keys[:: n // 10_000][:10_000]
        absent = keys_for(100, seed=6)

        def answered():
            v = [rig.fs.lookup(k) for k in sample + absent]
            return None if RETRY in v else v

        res = wait_until(answered, what="every probe answered", step=rig.tm.poll, interval_s=0.05)
        assert res == [HIT] * len(sample) + [MISS] * len(absent)
        # and the chunk stored through the tier loads bit-exact from among them
        rig.evict_all()
        assert rig.resolve([real]) == [HIT]
        assert np.array_equal(rig.read([real])[0], payload(real))


def test_a_task_behind_a_paused_one_in_the_same_worker_is_not_held_up(tmp_path):
    """A worker starts store and load tasks as they arrive: with its only writer paused inside one
    store (before its rename), a store sent after it is written, published and answered, with no
    deadline passing (a worker running one task at a time would answer it only after the gate)."""
    gate = tmp_path / "gate"
    k1, k2 = keys_for(2)
    fault = {
        "point": "before_publish",
        "action": "wait_file",
        "arg": str(gate),
        "key_hex": k1.hex(),
    }
    root = tmp_path / "root"
    cfg = fs_tier(root, write_workers=1, chunks_per_task=1, job_timeout_s=600.0, faults=[fault])
    with Rig([cfg], num_slots=4) as rig:
        rig.wait_workers_ready()
        rig.store([k1], wait=False)
        wait_paused(gate, step=rig.tm.poll)
        rig.store([k2], wait=False)
        wait_until(
            lambda: rig.tm.stats.cascaded["fs"] == 1,
            what="the second store answered while the first is paused",
            step=rig.tm.poll,
        )
        assert os.path.exists(chunk_path(rig, root, k2))
        assert not os.path.exists(chunk_path(rig, root, k1))
        gate.touch()
        assert rig.tm.wait_idle(120)
        assert rig.tm.stats.cascaded["fs"] == 2
        assert os.path.exists(chunk_path(rig, root, k1))
        assert rig.fs.counters.get("job_timeouts", 0) == 0


# -- CASES C43: private files, no link followed, keyed integrity (one user here; the second local
# user of the case is in tests/integration/test_cotenant_fs.py) ----------------------------------------------

INTEGRITY_ENV = "KVOFFLOAD_TEST_INTEGRITY_KEY"


def _modes_below(root) -> tuple[set[int], set[int]]:
    """The permission bits (setgid included) of every directory (``root`` too) and of every file
    below ``root``."""
    dirs, files = set(), set()
    for d, _, names in os.walk(root):
        dirs.add(stat.S_IMODE(os.stat(d).st_mode))
        files.update(stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) for n in names)
    return dirs, files


@pytest.mark.parametrize("umask", [0o000, 0o077])
@pytest.mark.parametrize("share", [False, True], ids=["private", "share_with_group"])
def test_c43_directories_and_files_get_the_tiers_modes_whatever_the_umask(tmp_path, share, umask):
    root = tmp_path / "root"  # the tier creates it
    old = os.umask(umask)  # the workers are spawned under it too
    try:
        with Rig([fs_tier(root, share_with_group=share)], num_slots=4) as rig:
            rig.store(keys_for(4))
            assert rig.fs.counters["store_chunks"] == 4
    finally:
        os.umask(old)
    dirs, files = _modes_below(root)
    assert dirs == ({0o2770} if share else {0o700})  # root, namespace, both shard levels
    assert files == ({0o660} if share else {0o600})  # chunk files and config.json
    assert len(_files(root)) == 4


def test_c43_a_symlinked_shard_directory_gets_no_store_and_is_removed(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    k, other = keys_for(2)
    with Rig([fs_tier(root)], num_slots=4) as rig:
        a, _ = shard_dirs(k)
        link = root / rig.ns.id() / a
        link.symlink_to(outside, target_is_directory=True)
        rig.store([k])
        assert failed_chunks(rig, "store") == {"unsafe_path": 1}
        assert list(outside.iterdir()) == []  # nothing written through the link
        assert not link.is_symlink()
        assert rig.fs.counters["symlinks_removed"] == 1
        rig.tm.host.remove([k])  # the next offer of the chunk goes into the root
        rig.store([k, other])
        assert os.path.isfile(chunk_path(rig, root, k)) and list(outside.iterdir()) == []
        rig.evict_all()
        assert rig.resolve([k, other]) == [HIT, HIT]


def test_c43_a_symlink_at_a_chunk_path_is_never_read_through(tmp_path):
    """A link at a chunk's name to a valid copy of that chunk outside the root: a load (the
    tier believes it holds the chunk) and a probe (a fresh instance) are misses, the link is
    removed, the copy outside is left as it was."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    k1, k2 = keys_for(2)
    with Rig([fs_tier(root)], num_slots=4) as rig:
        rig.store([k1, k2])
        rig.evict_all()
        for k in (k1, k2):
            path = chunk_path(rig, root, k)
            copy = outside / os.path.basename(path)
            os.rename(path, copy)
            os.symlink(copy, path)
        assert rig.resolve([k1]) == [MISS]  # loaded (known present): refused, not followed
        assert failed_chunks(rig, "load") == {"unsafe_path": 1}
        assert not os.path.lexists(chunk_path(rig, root, k1))
    with Rig([fs_tier(root)], num_slots=4) as fresh:
        assert fresh.resolve([k2]) == [MISS]  # probed: a link is not a chunk
        assert not os.path.lexists(chunk_path(fresh, root, k2))
        assert fresh.fs.counters["symlinks_removed"] == 1
    assert sorted(p.name for p in outside.iterdir()) == sorted(f"{k.hex()}.kv" for k in (k1, k2))
    assert all(os.path.getsize(p) == HEADER_BYTES + ROW for p in outside.iterdir())


def test_c43_scans_count_no_chunk_behind_or_at_a_symlink(tmp_path):
    fb = HEADER_BYTES + ROW
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "ff").mkdir(parents=True)
    keys = keys_for(3)
    with Rig([fs_tier(root, max_bytes=10 * fb)], num_slots=4) as rig:
        rig.store(keys)
        ns = rig.ns
        ns_dir = root / ns.id()
    real = chunk_path(rig, root, keys[0])
    for n, k in enumerate(keys_for(3, seed=7)):  # chunk files outside, as a co-tenant plants them
        target = outside / "ff" / f"{k.hex()}.kv"
        target.write_bytes(open(real, "rb").read())
        if n == 0:
            os.symlink(target, os.path.join(os.path.dirname(real), f"{k.hex()}.kv"))  # named as one
    os.symlink(outside, ns_dir / "zz")  # a link where a shard directory would be
    with Rig([fs_tier(root, max_bytes=10 * fb)], num_slots=4, ns=ns) as again:
        wait_until(
            lambda: again.fs.counters.get("adopted_chunks") is not None,
            what="the start scan",
            step=again.tm.poll,
        )
        assert again.fs.counters["adopted_chunks"] == 3
        assert again.fs.capacity.used_bytes == 3 * fb


def test_c43_a_namespace_directory_that_is_a_symlink_stops_the_start(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    ns = namespace()
    (root / ns.id()).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match=r"root_dir: .*symbolic link"):
        Rig([fs_tier(root)], num_slots=4, ns=ns)
    assert list(outside.iterdir()) == []


def test_c43_root_dir_may_itself_be_a_symlink(tmp_path):
    real = tmp_path / "disk" / "kv"
    real.mkdir(parents=True)
    (tmp_path / "kv").symlink_to(real, target_is_directory=True)
    with Rig([fs_tier(tmp_path / "kv")], num_slots=4) as rig:
        keys = keys_for(2)
        rig.store(keys)
        rig.evict_all()
        assert rig.resolve(keys) == [HIT, HIT]
        assert all(os.path.isfile(real / rig.ns.id() / relative_name(k)) for k in keys)


def _forged_chunk(ns_id: str, key: bytes, body, mac_secret: bytes | None = None) -> bytes:
    """A well-formed chunk file of ``key`` in namespace ``ns_id`` (a directory name, on disk for
    anyone to read), as anyone who can write the root builds it: unkeyed, or keyed with a key
    that is not the tier's."""
    mac = None if mac_secret is None else cf.mac_key(mac_secret)
    return cf.build_header(bytes.fromhex(ns_id), key, body, mac) + body.tobytes()


def test_c43_with_an_integrity_key_a_chunk_written_without_it_is_a_forged_miss_and_removed(
    tmp_path, monkeypatch
):
    secret = "correct horse battery staple 0123"
    monkeypatch.setenv(INTEGRITY_ENV, secret)
    fb = HEADER_BYTES + ROW
    keys = keys_for(4)
    evil = np.full(ROW, 0x66, dtype=np.uint8)
    keyed = fs_tier(tmp_path, integrity_key_env=INTEGRITY_ENV, max_bytes=10 * fb)
    with Rig([keyed], num_slots=4) as rig:
        ns_id = rig.fs.ns_id
        assert ns_id != rig.ns.id()  # the key's id is part of the namespace
        rig.store(keys)
        rig.evict_all()
        counted = rig.fs.capacity.used_bytes
        paths = [os.path.join(tmp_path, ns_id, relative_name(k)) for k in keys]
        with open(paths[0], "wb") as f:  # unkeyed, valid checksums
            f.write(_forged_chunk(ns_id, keys[0], evil))
        with open(paths[1], "wb") as f:  # keyed, with another key
            f.write(_forged_chunk(ns_id, keys[1], evil, b"not the tier's key, but long"))
        with open(paths[2], "r+b") as f:  # the tier's own chunk, flags cleared
            head = bytearray(f.read(HEADER_BYTES))
            head[12:16] = bytes(4)
            fixed = bytes(head[:48])
            head[48:56] = xxhash.xxh3_64_intdigest(fixed).to_bytes(8, "little")
            f.seek(0)
            f.write(head)
        assert rig.resolve(keys) == [MISS, MISS, MISS, HIT]
        assert failed_chunks(rig, "load") == {"forged": 3}
        assert not any(os.path.exists(p) for p in paths[:3])
        assert rig.fs.counters["forged_removed"] == 3
        assert rig.fs.capacity.used_bytes == counted - 3 * fb  # removed: no longer counted
        (row,) = rig.read([keys[3]])
        assert np.array_equal(row, payload(keys[3]))
        assert rig.resolve(keys[:3]) == [MISS] * 3
    with Rig([fs_tier(tmp_path)], num_slots=4) as plain:  # no key: another namespace
        assert plain.resolve([keys[3]]) == [MISS]
    from kvoffload.tools.tier_inspect import inspect_fs

    by_id = {ns.id: ns for ns in inspect_fs(str(tmp_path)).namespaces}
    assert by_id[ns_id].problem is None  # config.json hashes to the keyed namespace's id
    assert by_id[ns_id].identity["integrity_key_id"] == cf.key_id(secret.encode())


def test_c43_an_integrity_key_that_is_missing_short_or_pasted_in_is_refused_never_shown(
    tmp_path, monkeypatch, caplog
):
    from kvoffload.config import ConfigError, describe, parse_config

    secret = "this-is-the-secret-key-itself-0123"
    keyed = fs_tier(tmp_path, integrity_key_env=INTEGRITY_ENV)
    monkeypatch.delenv(INTEGRITY_ENV, raising=False)
    with pytest.raises(ValueError, match=f"integrity_key_env: .*{INTEGRITY_ENV} is not set"):
        Rig([keyed], num_slots=4)
    monkeypatch.setenv(INTEGRITY_ENV, "tiny")
    with pytest.raises(ValueError, match=f"integrity_key_env: the key in {INTEGRITY_ENV} is 4 "):
        Rig([keyed], num_slots=4)
    pasted = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [{**keyed, "integrity_key_env": secret}],
    }
    with pytest.raises(ConfigError, match="integrity_key_env: must name the environment") as e:
        parse_config(pasted)
    assert secret not in str(e.value)
    monkeypatch.setenv(INTEGRITY_ENV, secret)
    with caplog.at_level(logging.DEBUG), Rig([keyed], num_slots=4) as rig:
        rig.store(keys_for(1))
        assert rig.fs.counters["store_chunks"] == 1
        shown = describe(rig.config)
    assert INTEGRITY_ENV in shown and secret not in shown
    assert secret not in caplog.text


# -- CASES C45: sizes from storage are untrusted ----------------------------------------------


def test_c45_a_chunk_file_longer_than_its_header_says_is_corrupt_and_not_read(tmp_path):
    """A chunk file truncated up to 1 GiB (sparse) is a corrupt miss, deleted, and the reader
    never reads it whole: its peak RSS grows by far less than the file (bound 32 MiB, loose
    enough for a first error path's allocations, 1/32 of what reading the file would cost).
    The reader serves one good load first, so its start-up allocations are behind it."""
    with Rig([fs_tier(tmp_path, read_workers=1)], num_slots=4) as rig:
        good, k = keys_for(2)
        rig.store([good, k])
        rig.evict_all()
        assert rig.resolve([good]) == [HIT]  # the reader has served a load already
        path = chunk_path(rig, tmp_path, k)
        os.truncate(path, 1 << 30)  # 1 GiB (sparse): far longer than header plus row
        (reader,) = rig.fs.worker_pids()["loads"]
        before = peak_rss_bytes(reader)
        assert rig.resolve([k]) == [MISS]
        assert failed_chunks(rig, "load") == {"corrupt": 1}
        assert not os.path.exists(path)
        assert rig.fs.worker_pids()["loads"] == [reader]
        assert peak_rss_bytes(reader) - before < 32 << 20
