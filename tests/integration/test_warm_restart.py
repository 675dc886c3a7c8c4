"""Warm restart (issue 27 item 1): the host arena outlives a SIGKILLed engine in its keeper, and
a successor with the same arena name and namespace adopts the chunks that were complete, sealed
and unchanged. Real processes: the engine (tests/warm_owner.py), its keeper (the arena's
janitor), other processes of an engine (tests/warm_peer.py: a model runner's claim, a tier
worker's attach), and this test as the successor."""

import contextlib
import io
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import (
    HIT,
    ROW,
    TESTS_DIR,
    Rig,
    arena_name,
    keepers,
    keys_for,
    namespace,
    patience,
    payload,
    wait_until,
)

from kvoffload import metrics
from kvoffload.ipc.arena import (
    SHM_DIR,
    Arena,
    ArenaBusyError,
    ArenaError,
    list_arenas,
    published_chunks,
)
from kvoffload.ipc.slot_table import OUTCOMES
from kvoffload.tenants import tenant_id, tenant_key
from kvoffload.tools.cli import main

N, TORN = 5, 2
KEEP_S = 120.0


def started_engine(
    name: str, slots: int = 16, keep_s: float = KEEP_S, salt: str = ""
) -> subprocess.Popen:
    """tests/warm_owner.py under ``name``, once it has stored N chunks and is half way through
    writing TORN more."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "warm_owner.py"), name, str(slots), str(keep_s)]
        + [str(N), str(TORN), salt],
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stored", "the engine did not store"
    except BaseException:
        kill(proc)
        raise
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def killed_engine(name: str, slots: int = 16, keep_s: float = KEEP_S, salt: str = "") -> None:
    """Run tests/warm_owner.py under ``name`` until it has stored N chunks and is half way through
    writing TORN more, then SIGKILL it."""
    kill(started_engine(name, slots, keep_s, salt))


@contextlib.contextmanager
def peer(*args: str) -> Iterator[str]:
    """tests/warm_peer.py with ``args`` (another process of an engine mapping its arena) while
    the block runs; yields the line it says once it holds the arena. Afterwards it unmaps the
    arena and exits."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "warm_peer.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        yield proc.stdout.readline().strip()
    finally:
        proc.stdin.close()  # it unmaps (and, owning it, removes) the arena and exits
        try:
            proc.wait(patience(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def state(name: str) -> str:
    """The segment's state as its header says: ready, keeping, kept ('' when gone)."""
    return next((a.state for a in list_arenas(name) if a.name == name), "")


def keeper_waits_for_a_mapping(name: str) -> bool:
    """The segment's keeper is blocked in the kernel asking the mapped lock exclusively: a waiter
    (``->``) for an OFD write lock on the segment's inode in /proc/locks."""
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if parts[1:3] == ["->", "OFDLCK"] and "WRITE" in parts and inode in parts:
                return True
    return False


def scrape() -> dict:
    """The standalone metrics endpoint's samples: (name, labels) -> value."""
    from prometheus_client import generate_latest

    from kvoffload.testing.tier_contract import samples

    return samples(generate_latest(metrics.registry()).decode())


def warm_metric(rig: Rig, outcome: str) -> float:
    labels = (("instance", rig.tm.instance), ("outcome", outcome))
    return scrape().get(("kvoffload_warm_restart_chunks_total", labels), 0)


def kept(name: str) -> bool:
    return any(a.name == name for a in list_arenas(name))


@pytest.fixture
def name():
    n = arena_name()
    yield n
    # a kept segment left by a failing test: its keeper exits once the name is gone
    if os.path.exists(os.path.join(SHM_DIR, n)):
        os.unlink(os.path.join(SHM_DIR, n))
    wait_until(lambda: not keepers(n), patience(60), "the keepers' exit")


def test_a_successor_adopts_the_chunks_a_killed_engine_stored_whole_and_nothing_half_written(name):
    killed_engine(name)
    keys = keys_for(N + TORN, seed=5)
    with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted
        assert rig.tm.warm_restart is not None
        assert rig.tm.warm_restart["adopted"] == N, rig.tm.warm_restart
        assert not any(v for k, v in rig.tm.warm_restart.items() if k != "adopted")
        assert warm_metric(rig, "adopted") == N  # what the operator sees
        assert [rig.tm.lookup(k, "req") for k in keys[:N]] == [HIT] * N
        assert not any(rig.tm.host.is_present(k) for k in keys[N:])  # never completed
        for k, row in zip(keys[:N], rig.read(keys[:N])):
            assert np.array_equal(row, payload(k, rig.row_bytes)), "an adopted chunk's bytes differ"
        # the successor goes on: its own stores are mirrored for the next one
        more = keys_for(3, seed=9)
        rig.store(more)
        assert all(rig.tm.host.is_present(k) for k in more)


def test_published_chunks_counts_the_complete_chunks_without_holding_up_the_keeper(name):
    """What the end-to-end tests and ``kvoffload bench warm`` read to know a store landed: the
    READY entries, read without a mapping, so a look while the keeper waits for the dead engine's
    last mapping does not hold the take-over up."""
    owner = started_engine(name)
    try:
        assert published_chunks(name) == N  # the half-written ones are not listed
    finally:
        kill(owner)
    wait_until(lambda: published_chunks(name) == N and state(name) == "kept", patience(60), "kept")
    with pytest.raises(ArenaError, match="No such file"):
        published_chunks(name + "_none")
    with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S) as rig:
        assert rig.tm.warm_restart["adopted"] == N
        assert published_chunks(name) == N  # mirrored by the successor


def test_another_namespace_adopts_nothing_and_takes_the_arena_over_empty(name):
    killed_engine(name, salt="tenant-a")
    with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S, ns=namespace(cache_salt="b")) as rig:
        assert rig.arena.adopted and rig.tm.warm_restart == {
            **dict.fromkeys(OUTCOMES, 0),
            "dropped_namespace": N,  # the chunks it found, each dropped
        }
        assert warm_metric(rig, "dropped_namespace") == N and warm_metric(rig, "adopted") == 0
        assert len(rig.tm.host) == 0
        assert not any(rig.tm.host.is_present(k) for k in keys_for(N, seed=5))


def test_another_shape_removes_the_kept_segment_and_starts_anew(name):
    killed_engine(name)
    with Rig(name=name, num_slots=32, warm_restart_s=KEEP_S) as rig:
        assert not rig.arena.adopted and rig.tm.warm_restart["adopted"] == 0
        assert rig.arena.num_slots == 32


def test_a_kept_segment_nobody_claims_is_removed_at_its_deadline(name):
    killed_engine(name, keep_s=1.0)
    # (its keeper took it; a sweep meanwhile would have left it: its keeper lives)
    wait_until(lambda: not os.path.exists(os.path.join(SHM_DIR, name)), patience(60), "removal")
    assert not kept(name)


def test_a_successor_closing_normally_leaves_nothing_and_a_sweep_leaves_a_kept_segment(name):
    from kvoffload.ipc.arena import sweep

    killed_engine(name)
    wait_until(lambda: state(name) == "kept", patience(60), "the keeper's take-over")
    assert name not in sweep()  # its keeper holds it
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        main.main(["sweep", "--list"], prog_name="kvoffload", standalone_mode=False)
    line = next(x for x in listing.getvalue().splitlines() if x.startswith(name))
    assert "(dead; kept for a warm restart)" in line and "not initialized" not in line
    with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S) as rig:
        assert rig.tm.warm_restart["adopted"] == N
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_a_kept_segment_removed_by_hand_ends_its_keeper(name):
    killed_engine(name)
    wait_until(
        lambda: any(a.name == name and not a.ready for a in list_arenas(name)),
        patience(60),
        "the keeper's take-over",
    )
    assert keepers(name)
    os.unlink(os.path.join(SHM_DIR, name))
    wait_until(lambda: not keepers(name), patience(60), "the keeper's exit")


def test_the_tiering_manager_adopts_what_another_process_of_its_engine_claimed(name):
    """vLLM: a model runner opens the arena first and so claims the kept segment; the scheduler
    attaches and builds the tiering manager, which owns the host tier's index: it adopts, once."""
    killed_engine(name)
    keys = keys_for(N, seed=5)
    with peer("claim", name, "16", str(KEEP_S)) as said:
        assert said == "claimed 1"
        with Rig(arena=Arena.attach(name), num_slots=16) as rig:
            assert not rig.arena.adopted  # another process's claim
            assert rig.tm.warm_restart is not None
            assert rig.tm.warm_restart["adopted"] == N, rig.tm.warm_restart
            assert [rig.tm.lookup(k, "req") for k in keys] == [HIT] * N
            for k, row in zip(keys, rig.read(keys)):
                assert np.array_equal(row, payload(k, rig.row_bytes))
            assert not rig.arena.take_adoption()  # consumed: nobody adopts the table twice
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_the_keeper_waits_for_every_process_of_the_dead_engine_and_a_claimant_waits_for_it(name):
    """A tier worker (or the scheduler, another rank) that still maps the arena when its owner is
    SIGKILLed could still write it: the keeper does not keep the segment while it lives, and a
    claimant meanwhile waits for the keeper instead of taking the segment for a live engine's.
    Once that process is gone the hand-over proceeds."""
    owner = started_engine(name)
    try:
        with peer("attach", name) as said:
            assert said == "attached"
            kill(owner)
            wait_until(
                lambda: keeper_waits_for_a_mapping(name),
                patience(60),
                "the keeper waiting for the engine's last process",
            )
            assert state(name) == "keeping"  # its owner's lock taken; not kept
            with pytest.raises(ArenaBusyError, match="did not take it over"):
                Arena._claim(name, 16, ROW, "", KEEP_S, janitor=False, wait_s=0.5)
            assert state(name) == "keeping" and keeper_waits_for_a_mapping(name)
        with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S) as rig:
            assert rig.arena.adopted and rig.tm.warm_restart["adopted"] == N
    finally:
        kill(owner)


def test_adopted_tenant_chunks_get_no_event_until_a_request_names_them(name):
    """Review 2: a warm restart adopts a predecessor's tenant keys, whose engine keys nobody here
    knows: their events named the tenant key. Now a chunk adopted under a key of a tenant key's
    length has no event until a request of its tenant names it; then its removal names the
    engine's key."""
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "warm_owner.py"), name, "16", str(KEEP_S)]
        + [str(N), str(TORN), "", "salt-a"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "stored", "the engine did not store"
    finally:
        kill(proc)
    keys = keys_for(N, seed=5)
    tkeys = {tenant_key(k, tenant_id("salt-a")) for k in keys}
    with Rig(name=name, num_slots=16, warm_restart_s=KEEP_S) as rig:
        tm = rig.tm
        assert tm.warm_restart is not None and tm.warm_restart["adopted"] == N
        assert not [k for _n, ev in tm.take_events() for k in ev.keys]  # nothing named yet
        tm.set_cache_salt("again", "salt-a")
        assert [tm.lookup(k, "again") for k in keys] == [HIT] * N
        rig.evict_all()
        removed = [k for _n, ev in tm.take_events() if ev.removed for k in ev.keys]
        assert sorted(removed) == sorted(keys)
        assert not tkeys & set(removed)


def test_purge_removes_a_kept_arena_and_leaves_a_running_engines(name):
    """``kvoffload purge`` erased a tenant from the persistent tiers but not from an arena kept
    for a warm restart, whose successor then served the tenant's chunks again. Now a kept arena
    is removed whole (its slot table names no tenant), taken from its keeper as a successor
    takes it, so no successor adopts it; a running engine's host tier is its own, left alone;
    a namespace purge removes only a kept arena of that namespace."""
    from kvoffload.tools.purge import purge

    config = {"cpu_bytes_to_use": 1 << 20, "arena_name": name, "warm_restart_s": KEEP_S}
    owner = started_engine(name, salt="tenant-a")
    try:
        got = purge(config, salt="tenant-a")
        assert got.host_arena is not None and got.host_arena.outcome == "live"
        assert not got.failed() and state(name) == "ready"
    finally:
        kill(owner)
    wait_until(lambda: state(name) == "kept", patience(60), "the keeper's take-over")
    other = namespace(cache_salt="b").id()
    assert purge(config, namespace=other).host_arena.outcome == "other_namespace"
    assert state(name) == "kept" and keepers(name)  # still kept for its successor
    got = purge(config, namespace=namespace(cache_salt="tenant-a").id())
    assert got.host_arena.outcome == "removed" and not got.failed()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    wait_until(lambda: not keepers(name), patience(60), "the keeper's exit")
    assert purge(config, salt="tenant-a").host_arena.outcome == "absent"
    with Rig(
        name=name, num_slots=16, warm_restart_s=KEEP_S, ns=namespace(cache_salt="tenant-a")
    ) as rig:
        assert not rig.arena.adopted and len(rig.tm.host) == 0
    # a salt purge removes a kept arena whatever its namespace
    killed_engine(name, salt="tenant-a")
    wait_until(lambda: state(name) == "kept", patience(60), "the keeper's take-over")
    assert purge(config, salt="tenant-b").host_arena.outcome == "removed"
    assert not os.path.exists(os.path.join(SHM_DIR, name))


def test_purge_says_claimed_when_a_successor_takes_the_kept_arena_between_its_claim_and_lock(
    name, monkeypatch
):
    """Review: a successor already waiting could take the kept arena after the purge's claim
    made the keeper let go, and adopt the tenant's chunks; the purge called it 'live' and exited
    0. Here the successor's claim lands while the purge waits for the lock: the purge reports
    ``claimed``, a failure."""
    from kvoffload.ipc import arena as arena_mod
    from kvoffload.tools.purge import purge

    killed_engine(name, salt="tenant-a")
    wait_until(lambda: state(name) == "kept", patience(60), "the keeper's take-over")
    real_sleep = arena_mod.time.sleep
    successor = contextlib.ExitStack()
    said: list[str] = []

    def sleep(s: float) -> None:
        if not said and sys._getframe(1).f_code.co_name == "_take_kept":
            said.append(successor.enter_context(peer("claim", name, "16", str(KEEP_S))))
        real_sleep(s)

    monkeypatch.setattr(arena_mod.time, "sleep", sleep)
    with successor:
        got = purge(
            {"cpu_bytes_to_use": 1 << 20, "arena_name": name, "warm_restart_s": KEEP_S},
            salt="tenant-a",
        )
        monkeypatch.undo()
        assert said == ["claimed 1"], said
        assert got.host_arena is not None and got.host_arena.outcome == "claimed", got
        assert got.failed()
        assert state(name) == "ready"  # the successor's


def test_purge_reports_what_squats_the_arenas_name_without_a_traceback(name, tmp_path):
    """Review: a FIFO (or a file whose header lies about its shape) under the arena's name made
    the purge's look raise OSError / OverflowError past its report; each is now the host
    arena's error (exit 1), the tiers' reports kept."""
    from kvoffload.tools.purge import purge

    config = {
        "cpu_bytes_to_use": 1 << 20,
        "arena_name": name,
        "warm_restart_s": KEEP_S,
        "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}],
    }
    os.mkfifo(os.path.join(SHM_DIR, name), 0o600)
    for ns in (None, namespace().id()):
        got = purge(config, salt="tenant-a") if ns is None else purge(config, namespace=ns)
        assert got.host_arena is not None and got.host_arena.outcome == "error", got
        assert "not a regular file" in got.host_arena.error and got.failed()
        assert [t.type for t in got.tiers] == ["fs"] and not got.tiers[0].errors


def test_purge_calls_an_arena_whose_owner_died_before_it_was_ready_stale_not_live(name):
    """Fresh user's attack (helper): a segment left in state INIT by an owner that died, no
    lock held, was reported ``live`` ("held by a running engine", exit 0) where ``kvoffload
    sweep --list`` calls it an owner dead; it is ``stale``, and left for the sweep."""
    from kvoffload.ipc import arena as arena_mod
    from kvoffload.tools.purge import purge

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no process has now
    header = arena_mod._HEADER.pack(
        arena_mod._MAGIC,
        arena_mod._VERSION,
        arena_mod._STATE_INIT,
        gone.pid,
        0,
        16,
        ROW,
        bytes(16),
        b"",
    )
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, arena_mod.HEADER_BYTES)
        os.pwrite(fd, header, 0)
    finally:
        os.close(fd)
    got = purge(
        {"cpu_bytes_to_use": 1 << 20, "arena_name": name, "warm_restart_s": KEEP_S}, salt="tenant-a"
    )
    assert got.host_arena is not None and got.host_arena.outcome == "stale", got
    assert not got.failed() and os.path.exists(path)
