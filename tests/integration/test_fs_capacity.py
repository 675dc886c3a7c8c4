"""The fs tier's capacity with real workers and real files: failed removals (C32), a full disk (C33),
the default bound and free-space floor, and lookups that settle whatever the TTLs (C36). The
settings' refusals, parsed in process, are in tests/unit/test_fs_capacity.py."""

import contextlib
import logging
import os
import subprocess
import time

import numpy as np
import pytest
from helpers import (
    HIT,
    MISS,
    PENDING,
    RETRY,
    Rig,
    fs_tier,
    keys_for,
    payload,
    serve_prefix,
    wait_paused,
    wait_until,
)
from unit.test_fs_capacity import FB, _refused

from kvoffload.workers.chunkfile import relative_name

EPERM, EBUSY, EROFS, EIO, ENOSPC = 1, 16, 30, 5, 28


def chunk_path(rig: Rig, root, key: bytes) -> str:
    return os.path.join(str(root), rig.ns.id(), relative_name(key))


def chunk_files(root) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        out.extend(os.path.join(d, n) for n in names if n.endswith(".kv"))
    return out


def disk_bytes(root) -> int:
    return sum(os.path.getsize(f) for f in chunk_files(root))


def temp_files(root) -> list[str]:
    return [
        os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".tmp")
    ]


def eviction_errors(rig: Rig, errno_name: str) -> float:
    return rig.tm.refresh_metrics().get("kvoffload_tier_eviction_errors", "fs", errno_name)


def no_space_failures(rig: Rig) -> int:
    return rig.tm.stats.failed.get(("fs", "store", "no_space"), 0)


def _chattr(flag: str, *paths: str) -> bool:
    return subprocess.run(["chattr", flag, *paths], capture_output=True).returncode == 0


def _immutable_files_work(directory) -> str | None:
    """None when ``chattr +i`` makes a file in ``directory`` undeletable here, else why not."""
    probe = os.path.join(str(directory), "chattr-probe")
    with open(probe, "wb"):
        pass
    try:
        if not _chattr("+i", probe):
            return "chattr +i is not permitted here (needs root and a filesystem with attributes)"
        try:
            os.unlink(probe)
        except PermissionError:
            return None
        return "chattr +i did not stop an unlink on this filesystem"
    finally:
        _chattr("-i", probe)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


def test_c47_the_fs_tier_evicts_a_prefix_tail_first_and_a_prefix_read_back_keeps_its_head(
    tmp_path,
):
    """CASES C47 in a capped fs tier: a host tier of 8 chunks, an fs tier of 12, two conversations
    of 8-chunk prefixes in turn. Each store evicts from the other conversation's tail; a
    conversation that comes back reads its head from the fs tier and stores its tail again. Every
    prefix the fs tier holds is usable from its head, on disk as in its ledger (``xxxx----``, never
    ``----xxxx``: plain LRU evicted the head, written first, so nothing was found again)."""
    with Rig([fs_tier(tmp_path, max_bytes=12 * FB)], num_slots=8) as rig:
        prefixes = [keys_for(8, seed=470 + i) for i in range(2)]
        found = []
        for turn in range(3):
            for i, keys in enumerate(prefixes):
                found.append(serve_prefix(rig, f"t{turn}-c{i}", keys, 3))
                for p in prefixes:
                    on_disk = "".join(
                        "x" if os.path.exists(chunk_path(rig, tmp_path, k)) else "-" for k in p
                    )
                    counted = "".join("x" if k in rig.fs.capacity.index else "-" for k in p)
                    assert on_disk == counted, (on_disk, counted)
                    assert "-x" not in on_disk, f"turn {turn}, conversation {i}: fs holds {on_disk}"
        assert found == [0, 0] + [4] * 4, found
        assert rig.tm.stats.promotions["fs"] == 16


@pytest.mark.parametrize("how", ["fault", "chattr"])
def test_c32_undeletable_chunk_file_stays_counted_and_the_next_lru_is_evicted(tmp_path, how):
    k1, k2, k3, k4, k5, k6, k7, k8 = keys_for(8)
    root = tmp_path / "fs"
    root.mkdir()
    faults = []
    if how == "chattr":
        why = _immutable_files_work(root)
        if why:
            pytest.skip(why)
    else:  # a real fault point on the worker's unlink: K1 always EPERM; K3, K4 fail from step 2 on
        faults = [
            {"point": "unlink", "action": "raise", "arg": EPERM, "key_hex": k1.hex(), "count": -1},
            {"point": "unlink", "action": "raise", "arg": EBUSY, "key_hex": k3.hex(), "count": -1},
            {"point": "unlink", "action": "raise", "arg": EROFS, "key_hex": k4.hex(), "count": -1},
        ]
    cfg = fs_tier(root, max_bytes=3 * FB, faults=faults)
    with Rig([cfg], num_slots=16) as rig, contextlib.ExitStack() as undo:
        if how == "chattr":
            undo.callback(lambda: _chattr("-i", *chunk_files(root)))
        fs = rig.fs
        for k in (k1, k2, k3):
            rig.store([k])
        if how == "chattr":
            assert _chattr("+i", chunk_path(rig, root, k1))
        # 1. K4 needs room: K1 (least recently used) cannot be removed, so K2 goes instead.
        rig.store([k4])
        assert rig.tm.stats.cascaded["fs"] == 4 and no_space_failures(rig) == 0
        on_disk = {k for k in (k1, k2, k3, k4) if os.path.exists(chunk_path(rig, root, k))}
        assert on_disk == {k1, k3, k4}
        assert eviction_errors(rig, "EPERM") == 1
        assert fs.capacity.used_bytes == disk_bytes(root) == 3 * FB  # K1 is still counted
        # 2. Every removal fails: K5 is refused at once, with a reason, and nothing spins.
        if how == "chattr":
            assert _chattr("+i", *chunk_files(root))
        cascaded = rig.tm.stats.cascaded["fs"]
        written = fs.counters.get("bytes_written", 0)
        rig.store([k5])
        assert rig.tm.stats.cascaded["fs"] == cascaded
        assert no_space_failures(rig) == 1
        assert fs.counters["store_refused_no_room"] == 1
        assert fs.counters.get("bytes_written", 0) == written  # refused, not written and failed
        assert not os.path.exists(chunk_path(rig, root, k5))
        deletes = fs.counters["deletes"]
        for _ in range(20):  # idle steps send no more deletes (wait_idle returned: none in flight)
            rig.tm.step()
        assert fs.counters["deletes"] == deletes and not fs.has_pending_work()
        errors = {e: eviction_errors(rig, e) for e in ("EPERM", "EBUSY", "EROFS")}
        if how == "fault":
            assert errors == {"EPERM": 1, "EBUSY": 1, "EROFS": 1}
        else:
            assert errors["EPERM"] == 3
        assert fs.capacity.used_bytes == disk_bytes(root) == 3 * FB  # never over the cap here
        # 3. K1 is retried later: when it next comes up for eviction.
        if how == "fault":
            rig.store([k6])  # K1 is the least recently used again: retried, fails again
            assert eviction_errors(rig, "EPERM") == 2
            assert os.path.exists(chunk_path(rig, root, k1))
        else:
            assert _chattr("-i", *chunk_files(root))
            fresh = iter((k6, k7, k8, *keys_for(8, seed=3)))
            wait_until(
                lambda: not os.path.exists(chunk_path(rig, root, k1)),
                what="K1 removed once removals work again",
                step=lambda: rig.store([next(fresh)]),
            )
            before = rig.tm.stats.cascaded["fs"]
            rig.store([next(fresh)])
            assert rig.tm.stats.cascaded["fs"] == before + 1  # stores succeed again
        assert rig.tm.wait_idle(120)
        assert fs.capacity.used_bytes == disk_bytes(root) <= 3 * FB
        assert not temp_files(root)


def test_an_unanswered_delete_is_sent_again_until_it_answers(tmp_path):
    """The worker running K1's delete is SIGKILLed three times in a row (each replacement pauses
    on the same delete): no answer says whether the file is gone, so the tier neither counts nor
    forgets it; it sends the delete again after a growing wait, and once a worker answers, the
    accounting equals the bytes on disk (the tier-model soak found a bounded retry giving up)."""
    import signal

    k1, k2 = keys_for(2)
    root = tmp_path / "fs"
    root.mkdir()
    gate = tmp_path / "delete-gate"
    fault = {"point": "delete", "action": "wait_file", "arg": str(gate), "key_hex": k1.hex()}
    with Rig([fs_tier(root, max_bytes=FB, faults=[fault])], num_slots=8) as rig:
        fs = rig.fs
        rig.store([k1])
        rig.store([k2], wait=False)  # K2's write evicts K1: its delete pauses in a worker
        for n in range(1, 4):
            pids = wait_paused(gate, count=n, step=rig.tm.poll)
            os.kill(pids[-1], signal.SIGKILL)
        wait_paused(gate, count=4, step=rig.tm.poll)  # a fourth worker got it again
        assert fs.has_pending_work() and fs.capacity.used_bytes <= FB
        gate.touch()
        assert rig.tm.wait_idle(120)
        # (the pool re-runs a dead worker's task once by itself; the tier asks again after that)
        assert fs.counters["worker_restarts"] >= 3 and fs.counters["delete_retries"] >= 1
        assert not os.path.exists(chunk_path(rig, root, k1))
        assert fs.capacity.used_bytes == disk_bytes(root) <= FB  # K2 written, or refused for room
        assert not any(k.startswith("eviction_errors") for k in fs.counters)


def _fill_leaving(directory, room: int) -> str:
    """Write a file of another tenant into ``directory`` so that ``room`` bytes stay free."""
    st = os.statvfs(directory)
    size = st.f_bavail * st.f_frsize - room
    path = os.path.join(str(directory), "other-tenant.bin")
    with open(path, "wb") as f:
        f.write(b"\xab" * size)
    return path


@contextlib.contextmanager
def small_tmpfs(size_bytes: int):
    from kvoffload.tools.stress_faults import FaultError
    from kvoffload.tools.stress_faults import small_tmpfs as mount

    try:
        with mount(size_bytes) as path:
            yield path
    except FaultError as e:
        pytest.skip(f"needs a small tmpfs of its own (root, mount permitted): {e}")


def test_c33_disk_full_before_the_cap_evicts_own_lru_chunks_and_stores_go_on(tmp_path):
    with small_tmpfs(1 << 20) as mnt:
        root = os.path.join(mnt, "fs")
        cfg = fs_tier(root, max_bytes=100 * FB, min_free_fraction=0)
        with Rig([cfg], num_slots=8) as rig:
            fs = rig.fs
            ballast = _fill_leaving(mnt, 5 * FB + FB // 2)  # room for five chunk files
            keys = keys_for(17)
            outcomes = []
            for k in keys[:15]:
                before = rig.tm.stats.cascaded["fs"]
                rig.store([k])
                outcomes.append(rig.tm.stats.cascaded["fs"] - before)
            assert outcomes[:5] == [1] * 5
            assert 1 <= no_space_failures(rig) == outcomes.count(0) <= 2
            assert outcomes[-8:] == [1] * 8  # later stores succeed while the disk stays full
            assert fs.counters["disk_full_stores"] == no_space_failures(rig)
            assert fs.counters["evictions"] >= 8
            assert not temp_files(root)
            assert fs.capacity.used_bytes == disk_bytes(root) <= 6 * FB
            assert all(os.path.exists(chunk_path(rig, root, k)) for k in keys[13:15])
            # Space comes back outside the tier: both stores succeed, and the cap rises again.
            os.unlink(ballast)
            failures = no_space_failures(rig)
            rig.store([keys[15]])
            rig.store([keys[16]])
            assert rig.tm.stats.cascaded["fs"] == sum(outcomes) + 2
            assert no_space_failures(rig) == failures
            wait_until(
                lambda: fs.capacity.capacity_bytes > 20 * FB,
                what="the cap raised again",
                step=rig.tm.step,
            )
            assert fs.capacity.used_bytes == disk_bytes(root)
            assert not temp_files(root)


def test_c52_a_burst_of_enospc_on_a_disk_with_room_evicts_nothing_and_every_chunk_is_served(
    tmp_path,
):
    """An fs tier holding 20 chunks; its writer then fails five stores with ENOSPC (a fault
    injected in the worker's write, while ``statvfs`` shows the disk has room for them): the tier
    evicts nothing and keeps its cap, the stores after the burst are written, and the 20 chunks
    are still on disk, found by lookups and loaded with their own bytes."""
    root = tmp_path / "fs"
    held, burst, after = keys_for(20, seed=1), keys_for(5, seed=2), keys_for(5, seed=3)
    faults = [
        {"point": "before_read_slot", "action": "raise", "arg": ENOSPC, "key_hex": k.hex()}
        for k in burst
    ]
    cap = 100 * FB
    with Rig([fs_tier(root, max_bytes=cap, faults=faults)], num_slots=32) as rig:
        tm, fs = rig.tm, rig.fs
        for i in range(0, 20, 4):
            rig.store(held[i : i + 4])
        assert tm.stats.cascaded["fs"] == 20 and fs.capacity.used_bytes == disk_bytes(root)
        st = os.statvfs(root)
        assert st.f_bavail * st.f_frsize > 100 * FB, "the premise: a disk with room"
        for k in burst:
            rig.store([k])
        assert no_space_failures(rig) == 5 and tm.stats.cascaded["fs"] == 20
        assert fs.counters["no_space_with_room"] == 5
        assert fs.counters.get("disk_full_stores", 0) == 0  # the disk was never full
        for k in after:
            rig.store([k])
        assert tm.stats.cascaded["fs"] == 25 and no_space_failures(rig) == 5
        assert fs.counters.get("evictions", 0) == 0
        assert fs.capacity.capacity_bytes == cap and not fs.capacity.cautious()
        assert all(os.path.exists(chunk_path(rig, root, k)) for k in held + after)
        assert fs.capacity.used_bytes == disk_bytes(root) == 25 * FB
        tm.host.remove(held)  # only the fs tier holds them now
        assert rig.resolve(held) == [HIT] * 20  # promoted from the fs tier
        for k, row in zip(held, rig.read(held)):
            assert np.array_equal(row, payload(k))
        assert tm.stats.promotion_failures.get("fs", 0) == 0
        assert not temp_files(root)


def test_fs_tier_without_max_bytes_is_bounded_by_half_the_free_space_and_logs_it(caplog):
    with small_tmpfs(2 << 20) as mnt, caplog.at_level(logging.INFO, logger="kvoffload.tiers"):
        root = os.path.join(mnt, "fs")
        with Rig([fs_tier(root)], num_slots=8) as rig:
            st = os.statvfs(mnt)
            free = st.f_bavail * st.f_frsize
            assert rig.fs.capacity.max_bytes == rig.fs.capacity.capacity_bytes
            assert abs(rig.fs.capacity.max_bytes - free // 2) <= FB  # half the free space at start
            assert f"capped at {rig.fs.capacity.max_bytes} bytes" in caplog.text
            keys = keys_for(80)  # 80 chunk files would be 1.6 MiB: more than the bound
            for i in range(0, 80, 4):
                rig.store(keys[i : i + 4])
            assert rig.tm.stats.cascaded["fs"] == 80 and no_space_failures(rig) == 0
            assert rig.fs.capacity.used_bytes == disk_bytes(root) <= rig.fs.capacity.max_bytes
            assert rig.fs.counters["evictions"] > 0


def test_free_space_floor_makes_the_tier_evict_instead_of_writing():
    with small_tmpfs(1 << 20) as mnt:
        root = os.path.join(mnt, "fs")
        with Rig([fs_tier(root, min_free_fraction=0.7)], num_slots=8) as rig:
            floor = rig.fs.min_free_bytes
            assert floor == int(0.7 * (1 << 20))
            keys = keys_for(30)
            outcomes = []
            for k in keys:
                before = rig.tm.stats.cascaded["fs"]
                rig.store([k])
                outcomes.append(rig.tm.stats.cascaded["fs"] - before)
                st = os.statvfs(mnt)
                assert st.f_bavail * st.f_frsize >= floor  # never written below the floor
            assert rig.fs.counters["below_free_floor"] >= 1
            assert outcomes[-10:] == [1] * 10  # the tier makes room among its own chunks
            assert rig.fs.capacity.used_bytes == disk_bytes(root)


def test_a_disk_already_past_the_default_floor_is_named_at_start_and_stores_nothing(caplog):
    """The default floor (``min_free_fraction`` 0.05) on a disk already fuller than that: the tier
    says so when it starts (CI's disk once sat at 2 % free, and the first word of it was a warning
    at the first store), and no store writes below the floor."""
    with small_tmpfs(1 << 20) as mnt, caplog.at_level(logging.WARNING, logger="kvoffload.tiers"):
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as f:  # leave ~2 % free: under the default 5 % floor
            f.write(b"\0" * (1000 << 10))
        root = os.path.join(mnt, "fs")
        tier = {"type": "fs", "root_dir": root, "max_bytes": 10 * FB}  # no min_free_fraction
        with Rig([tier], num_slots=8) as rig:
            assert rig.fs.config.min_free_fraction == 0.05  # the default, not the tests' 0
            assert rig.fs.min_free_bytes == int(0.05 * (1 << 20))
            assert "below the free-space floor" in caplog.text and root in caplog.text
            assert "lower min_free_fraction" in caplog.text
            rig.store(keys_for(2))
            assert rig.tm.stats.cascaded["fs"] == 0 and no_space_failures(rig) == 2
            assert not chunk_files(root)


def test_unbounded_fs_tier_deletes_nothing_and_stops_at_the_floor():
    with small_tmpfs(1 << 20) as mnt:
        root = os.path.join(mnt, "fs")
        with Rig([fs_tier(root, max_bytes="unbounded", min_free_fraction=0.5)], num_slots=8) as rig:
            assert rig.fs.capacity.capacity_bytes is None
            for k in keys_for(40):
                rig.store([k])
            st = os.statvfs(mnt)
            assert st.f_bavail * st.f_frsize >= rig.fs.min_free_bytes
            assert no_space_failures(rig) > 0 and rig.fs.counters.get("evictions", 0) == 0
            assert len(chunk_files(root)) == rig.tm.stats.cascaded["fs"]


def test_c36_zero_negative_ttl_lookup_answers_miss_once_the_probe_answered(tmp_path):
    with Rig([fs_tier(tmp_path, negative_ttl_s=0)], num_slots=4) as rig:
        fs = rig.fs
        absent = keys_for(1, seed=5)[0]
        answers: list = []
        answered_at_retry = None  # probe answers counted when the current RETRY run began
        violations = []
        t_end = time.monotonic() + 3.0
        give_up = time.monotonic() + 120.0
        while time.monotonic() < give_up and not violations:
            answered = fs.counters.get("probes", 0)
            r = rig.tm.lookup(absent, "req")
            answers.append(r)
            if r is RETRY:
                if answered_at_retry is None:
                    answered_at_retry = answered
                elif answered > answered_at_retry:
                    violations.append(len(answers))  # the probe answered; still RETRY
            else:
                answered_at_retry = None
            if time.monotonic() >= t_end and answers.count(MISS) >= 3:
                break
            rig.tm.step()
            time.sleep(0.002)
        assert not violations, f"RETRY after the probe answered, at lookups {violations[:5]}"
        assert answers.count(MISS) >= 3 and set(answers) <= {RETRY, MISS}


def test_c36_zero_failed_load_ttl_the_request_gets_miss_after_its_load_failed(tmp_path):
    k = keys_for(1)[0]
    fault = {
        "point": "read_payload",
        "action": "raise",
        "arg": EIO,
        "key_hex": k.hex(),
        "count": -1,
    }
    with Rig([fs_tier(tmp_path, failed_load_ttl_s=0, faults=[fault])], num_slots=4) as rig:
        rig.store([k])
        rig.evict_all()
        fs = rig.fs
        answers = []

        def settled():
            failures = fs.counters.get("load_failures", 0)
            r = rig.tm.lookup(k, "req")
            answers.append((failures, r))
            return r is MISS

        wait_until(
            settled,
            what="a MISS for the request whose load failed",
            step=rig.tm.step,
            interval_s=0.002,
        )
        # From the first lookup that came after the failed load on, the answer was MISS.
        first_after = next(i for i, (f, _) in enumerate(answers) if f > 0)
        assert answers[first_after][1] is MISS
        assert {r for _, r in answers[:first_after]} <= {HIT, PENDING, RETRY}
        assert rig.tm.stats.promotion_failures["fs"] == 1


def test_a_root_dir_on_a_read_only_filesystem_is_named_so():
    """A read-only mount is "read-only", not "not writable" (root may write any directory's
    mode bits, so the mount is the reason)."""
    with small_tmpfs(1 << 20) as mnt:
        r = subprocess.run(["mount", "-o", "remount,ro", mnt], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here: {r.stderr.strip()}")
        msg = _refused(mnt, "root_dir", os.path.join(mnt, "kv"))
        assert "read-only filesystem" in msg, msg
