"""Host arena: creation with reserved space, attach by name, zero-copy views, owner liveness, sweep."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import torch
from helpers import TESTS_DIR, arena_name, wait_until

from kvoffload.ipc.arena import (
    Arena,
    ArenaBusyError,
    ArenaError,
    ArenaSpaceError,
    list_arenas,
    sweep,
)


def test_create_attach_share_bytes():
    name = arena_name()
    with Arena.create(name, 4, 8192, engine_id="e1") as owner:
        other = Arena.attach(name, nonce=owner.nonce)
        try:
            owner.rows[2, :5] = [1, 2, 3, 4, 5]
            assert list(other.rows[2, :5]) == [1, 2, 3, 4, 5]
            t = other.torch_rows()
            assert t.shape == (4, 8192) and t.dtype == torch.int8
            t[3, 0] = 7
            assert owner.rows[3, 0] == 7
            mv = owner.memoryview()
            assert mv.shape == (4, 8192) and mv.strides[0] == 8192
        finally:
            other.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_views_keep_mapping_alive_after_close():
    arena = Arena.create(arena_name(), 2, 4096)
    view = arena.torch_rows()
    arr = arena.rows
    arena.close()
    view[1, 10] = 3  # would segfault if the mapping were gone
    assert arr[1, 10] == 3


def test_too_small_dev_shm_is_a_clear_error_naming_the_key():
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    rows = free // 4096 + 1024
    with pytest.raises(ArenaSpaceError, match="cpu_bytes_to_use"):
        Arena.create(arena_name(), rows, 4096)


def test_bad_shape_rejected():
    with pytest.raises(ArenaError, match="row_bytes"):
        Arena.create(arena_name(), 4, 1000)
    with pytest.raises(ArenaError, match="num_slots"):
        Arena.create(arena_name(), 0, 4096)


def test_live_owner_name_is_busy_and_attach_checks_nonce():
    name = arena_name()
    with Arena.create(name, 2, 4096):
        with pytest.raises(ArenaBusyError, match="live process"):
            Arena.create(name, 2, 4096)
        with pytest.raises(ArenaError, match="nonce"):
            Arena.attach(name, nonce=b"x" * 16)
        assert name not in sweep()
        assert os.path.exists(f"/dev/shm/{name}")


_OWNER = textwrap.dedent("""
    import sys, time
    from kvoffload.ipc.arena import Arena
    a = Arena.create(sys.argv[1], 16384, 4096, janitor=sys.argv[2] == "1")   # 64 MiB
    a.rows[:, 0] = 0xAB
    print("ready", flush=True)
    time.sleep(600)
""")


def _start_owner(name: str, janitor: bool = False) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _OWNER, name, "1" if janitor else "0"],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert p.stdout.readline().strip() == b"ready"
    return p


def test_c15_shm_segment_of_sigkilled_owner_is_removed_by_its_janitor():
    # A name outside the package's prefix: the start-up sweeps of other engines on this machine
    # (tests running beside this one) never take it, so only its janitor can have removed it.
    name = f"kvtest-janitor-{os.getpid()}-{time.monotonic_ns()}"
    p = _start_owner(name, janitor=True)
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the owner's whole process group
        p.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/dev/shm/{name}"), "the janitor left the segment behind"
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            assert sweep(prefix=name) == [name]


_INSTANCE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[3])
    from helpers import ROW, fs_tier, keys_for, namespace, payload
    from kvoffload.config import parse_config
    from kvoffload.ipc.arena import Arena
    from kvoffload.tiering import TieringManager
    # no janitor: it would outlive the SIGKILL (own session) and clean up for the next start
    arena = Arena.create(sys.argv[1], 4096, ROW, janitor=False)   # 64 MiB
    cfg = parse_config({"cpu_bytes_to_use": 4096 * ROW,
                        "secondary_tiers": [fs_tier(sys.argv[2])]})
    tm = TieringManager(arena, namespace(), cfg)
    plan = tm.prepare_store(keys_for(4))
    for k, slot in zip(plan.keys, plan.slots):
        arena.rows[slot] = payload(k)
    tm.complete_store(plan.keys, True)
    assert tm.wait_idle(120)
    print(" ".join(str(p) for ps in tm.tiers[0].worker_pids().values() for p in ps), flush=True)
    time.sleep(600)
""")


def _start_instance(name: str, root) -> tuple[subprocess.Popen, list[int]]:
    """An engine (arena of 64 MiB, fs tier with its worker processes, 4 chunks stored) in a
    process group of its own; returns it and its workers' pids."""
    p = subprocess.Popen(
        [sys.executable, "-c", _INSTANCE, name, str(root), TESTS_DIR],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    workers = [int(x) for x in p.stdout.readline().split()]
    if len(workers) != 2:  # one reader, one writer
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise AssertionError(f"the instance did not start: {workers}")
    return p, workers


def _kill_group(p: subprocess.Popen, workers: list[int]) -> None:
    """SIGKILL the instance's whole process group: coordinator and tier workers."""
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(gone(w) for w in workers), what="the workers killed with it")


def test_c15_instance_killed_with_its_workers_leaves_no_segment_behind(tmp_path):
    from helpers import HIT, MISS, Rig, fs_tier, keys_for

    # Names outside the package's prefix, so that only what this test runs can remove them (not
    # the start-up sweep of another engine on this machine); sweep(prefix) is the same code path.
    prefix = f"kvtest-c15-{os.getpid()}-{time.monotonic_ns()}"
    try:
        # 1-2: fixed name N, the instance and its workers SIGKILLed; the next start with N reclaims it
        name = f"{prefix}-fixed"
        p, workers = _start_instance(name, tmp_path / "fs")
        _kill_group(p, workers)
        assert os.path.exists(f"/dev/shm/{name}")  # the leak the case describes...
        with Rig([fs_tier(tmp_path / "fs")], num_slots=4096, name=name) as second:  # ...reclaimed
            assert second.arena.owner and not second.arena.rows.any(), "attached to stale contents"
            keys = keys_for(4)
            assert [second.tm.host.lookup(k) for k in keys] == [MISS] * 4  # no stale slot table
            assert second.resolve(keys) == [HIT] * 4  # the fs tier's copies are still good
            # 3: five instances with random names, each SIGKILLed with its workers
            names = [f"{prefix}-{i}" for i in range(5)]
            for n in names:
                p, workers = _start_instance(n, tmp_path / "fs")
                _kill_group(p, workers)
            assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
            removed = sweep(prefix=prefix)  # what the next start (or `kvoffload sweep`) does
            assert sorted(removed) == sorted(names)
            assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
            # a live instance's segment is never taken
            assert os.path.exists(f"/dev/shm/{name}")
        # the final clean shutdown: no segment of these instances is left
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names + [name])
    finally:
        sweep(prefix=prefix)  # whatever a failed run left (dead owners only)


def test_list_arenas_reports_owner():
    with Arena.create(arena_name(), 2, 4096, engine_id="engine-7") as a:
        info = {i.name: i for i in list_arenas()}[a.name]
        assert info.owner_pid == os.getpid() and info.engine_id == "engine-7" and info.ready
        assert info.num_slots == 2 and info.row_bytes == 4096


def test_open_or_create_attaches_to_live_owner():
    name = arena_name()
    with Arena.create(name, 3, 4096) as owner:
        other = Arena.open_or_create(name, 3, 4096)
        try:
            assert not other.owner and other.nonce == owner.nonce
            with pytest.raises(ArenaError, match="shape"):
                Arena.open_or_create(name, 4, 4096)
        finally:
            other.close()


def test_frombuffer_views_are_zero_copy():
    with Arena.create(arena_name(), 2, 4096) as a:
        assert a.rows.ctypes.data == a.base_address()
        assert np.shares_memory(a.rows, np.asarray(a.memoryview()))
        time.sleep(0)
