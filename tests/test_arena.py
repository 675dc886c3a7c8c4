"""Host arena: creation with reserved space, attach by name, zero-copy views, owner liveness, sweep."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from kvoffload.ipc.arena import (
    Arena,
    ArenaBusyError,
    ArenaError,
    ArenaSpaceError,
    list_arenas,
    sweep,
)

from helpers import arena_name


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
        assert sweep() == [] or name not in sweep()
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
    p = subprocess.Popen([sys.executable, "-c", _OWNER, name, "1" if janitor else "0"],
                         stdout=subprocess.PIPE, start_new_session=True)
    assert p.stdout.readline().strip() == b"ready"
    return p


def test_c15_shm_segment_of_sigkilled_owner_is_removed_by_its_janitor():
    name = arena_name()
    p = _start_owner(name, janitor=True)
    os.killpg(p.pid, signal.SIGKILL)  # the owner's whole process group
    p.wait()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/{name}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_c15_shm_segment_of_sigkilled_owner_is_reclaimed():
    # Without a janitor (killed too, e.g. with the whole cgroup) the next start must cope.
    # 1-2: fixed name, owner SIGKILLed with its whole process group, next start reclaims the name.
    name = arena_name()
    p = _start_owner(name)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.exists(f"/dev/shm/{name}")  # the leak the case describes...
    a = Arena.create(name, 16384, 4096)  # ...is reclaimed by the next start with the same name
    try:
        assert (a.rows[:, 0] == 0).all(), "attached to stale contents"
    finally:
        a.close()
    # 3: five runs with random names, then a sweep at the next start leaves nothing behind.
    names = [arena_name() for _ in range(5)]
    for n in names:
        p = _start_owner(n)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    live = Arena.create(arena_name(), 1, 4096)  # a live instance must survive the sweep
    try:
        removed = sweep()
        # gone (this sweep, or another engine's start-up sweep on the same machine, removed them)
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names), removed
        assert live.name not in removed and os.path.exists(f"/dev/shm/{live.name}")
    finally:
        live.close()
    assert not any(n.startswith("kvoffload_test") for n in os.listdir("/dev/shm")
                   if any(n == x for x in names + [name, live.name]))


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
