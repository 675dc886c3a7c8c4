"""Attacks on a warm restart's take-over of a kept host arena (issue 27 item 1; DESIGN.md "Warm
restart" and "Host arena (ipc)"): another local user squatting the kept name or claiming the
segment, a forged or malformed slot table, an impersonated keeper, a reused owner pid, claimants
that die in the middle of a claim or race for one segment.

Real processes: the engine (tests/warm_owner.py) and its keeper (the arena's janitor), claimants
(tests/warm_peer.py), the co-tenant (tests/cotenant.py: a second local user, so those tests need
root and skip without it). What an attacker of this user writes into a segment is written here
with the slot table's own format (ipc/slot_table.py): a forger computes the same checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import xxhash
from cotenant import COTENANT, CotenantProcess, as_cotenant, cotenant
from helpers import ROW, TESTS_DIR, Rig, keepers, keys_for, patience, payload, wait_until
from warm_peer import gone

from integration.test_arena_cotenant import squatter
from integration.test_warm_restart import (
    KEEP_S,
    TORN,
    N,
    keeper_waits_for_a_mapping,
    kill,
    killed_engine,
    peer,
    started_engine,
    state,
)
from kvoffload.ipc import arena as arena_mod
from kvoffload.ipc import janitor
from kvoffload.ipc import slot_table as stm
from kvoffload.ipc.arena import (
    HEADER_BYTES,
    SHM_DIR,
    Arena,
    ArenaBusyError,
    ArenaForeignError,
    sweep_report,
)
from kvoffload.ipc.childenv import child_environment
from kvoffload.ipc.slot_table import OUTCOMES, SlotTable, table_bytes

SLOTS = 16


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


@pytest.fixture
def name():
    """A fixed arena name for the test; afterwards nothing of it is left: the segment (a kept one
    a failing test left, or one a helper made) is removed and its keepers have exited."""
    n = f"kvoffload_wattack_{os.getpid()}_{time.monotonic_ns()}"
    yield n
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path(n))
    wait_until(lambda: not keepers(n), patience(60), "the keepers' exit")


def kept_arena(name: str) -> None:
    """A SIGKILLed engine's arena under ``name``, kept by its keeper (N chunks stored whole and
    sealed, TORN half written)."""
    killed_engine(name)
    wait_until(lambda: state(name) == "kept", patience(60), "the keeper's take-over")


def keeper_pid(name: str) -> int:
    """The keeper pid the segment's header names (0: none yet)."""
    fd = os.open(path(name), os.O_RDONLY)
    try:
        return arena_mod._WARM.unpack(os.pread(fd, arena_mod._WARM.size, arena_mod._WARM_OFFSET))[1]
    finally:
        os.close(fd)


def cold(rig: Rig) -> bool:
    """The successor started with an empty host tier and adopted nothing."""
    return rig.tm.warm_restart == dict.fromkeys(OUTCOMES, 0) and len(rig.tm.host) == 0


# -- squatting the kept name (another local user) ----------------------------------------------


@pytest.mark.parametrize("mode", [0o666, 0o600], ids=["0666", "0600"])
def test_c44_a_squatter_on_the_name_a_keeper_let_go_is_refused_and_reads_nothing(name, mode):
    """The keeper removes a kept arena nobody claimed at its deadline; a co-tenant creates a
    segment under the name at once (a header naming a ready arena of the successor's shape, its
    lock held). The successor's start fails naming the segment and its owner; the squatter reads
    nothing the engine wrote."""
    uid = cotenant().pw_uid
    killed_engine(name, keep_s=1.0)
    wait_until(lambda: not os.path.exists(path(name)), patience(60), "the keeper's removal")
    with squatter(name, mode=mode, slots=SLOTS, row=ROW, engine="") as read_back:
        with pytest.raises(ArenaForeignError) as err:
            Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S)
        msg = str(err.value)
        assert f"{SHM_DIR}/{name}" in msg and "pick another arena_name" in msg
        assert f"owner uid {uid} ({COTENANT})" in msg and f"mode {mode:04o}" in msg
        assert read_back() == bytes(SLOTS * ROW)


def test_c44_a_symlink_planted_on_the_kept_name_is_refused_and_nothing_is_written_through_it(
    name, tmp_path
):
    """A co-tenant plants a symbolic link under the name once the keeper let it go, pointing
    at a file of the engine's user: the successor refuses it naming the link, and neither
    follows it nor writes the file."""
    uid = cotenant().pw_uid
    target = tmp_path / "victims-file"
    target.write_bytes(b"\x11" * 4096)
    killed_engine(name, keep_s=1.0)
    wait_until(lambda: not os.path.exists(path(name)), patience(60), "the keeper's removal")
    as_cotenant(os.symlink, str(target), path(name))
    try:
        with pytest.raises(ArenaForeignError) as err:
            Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S)
        msg = str(err.value)
        assert f"{SHM_DIR}/{name}" in msg and f"owner uid {uid} ({COTENANT})" in msg
        assert "symbolic links" in msg  # ELOOP: opened without following it
        assert target.read_bytes() == b"\x11" * 4096
        assert os.path.islink(path(name))
    finally:
        os.unlink(path(name))


def _replace_and_claim(name: str) -> dict[str, str]:
    """The co-tenant's attempts on a kept arena: remove it, rename a segment of its own over it,
    claim it as a successor would. What each raised."""
    own = path(name + ".own")
    os.close(os.open(own, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    out: dict[str, str] = {}
    try:
        for what, step in (
            ("unlink", lambda: os.unlink(path(name))),
            ("rename", lambda: os.rename(own, path(name))),
            ("claim", lambda: Arena.create(name, SLOTS, ROW, table=True, keep_s=KEEP_S)),
        ):
            try:
                step()
                out[what] = "done"
            except Exception as e:
                out[what] = f"{type(e).__name__}: {e}"
    finally:
        os.unlink(own)
    return out


def test_c44_another_user_can_neither_remove_replace_nor_claim_a_kept_arena(name):
    """While the keeper holds a kept arena, a co-tenant tries to remove it, to rename its own
    segment over it and to claim it as a successor: each is refused (/dev/shm is sticky; the
    claim names the segment and its owner), the arena stays kept, and this user's successor
    adopts every chunk."""
    uid = cotenant().pw_uid
    kept_arena(name)
    got = as_cotenant(_replace_and_claim, name)
    assert got["unlink"].startswith("PermissionError") and got["rename"].startswith(
        "PermissionError"
    ), got
    assert got["claim"].startswith("ArenaForeignError") and f"{SHM_DIR}/{name}" in got["claim"]
    assert "owner uid 0 (root)" in got["claim"] and "permission denied" in got["claim"]
    assert state(name) == "kept" and os.stat(path(name)).st_uid == os.geteuid()
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted and rig.tm.warm_restart["adopted"] == N, rig.tm.warm_restart
    assert os.getuid() == 0 != uid


def test_c44_a_squatter_that_takes_the_name_while_a_successor_claims_it_is_refused(
    name, monkeypatch
):
    """The successor has opened the kept segment to claim it when the keeper's deadline comes
    (the segment is unlinked: here by hand, as the keeper does) and a co-tenant creates a
    segment under the name: the claim takes nothing, and the start fails naming the co-tenant's
    segment (not as 'in use by a live process'); the co-tenant reads nothing."""
    uid = cotenant().pw_uid
    kept_arena(name)
    held = contextlib.ExitStack()
    squatted: list = []
    real = arena_mod._read_header

    def read_header(fd: int):
        if not squatted and sys._getframe(1).f_code.co_name == "_take_kept":
            os.unlink(path(name))  # the keeper's deadline
            wait_until(lambda: not keepers(name), patience(60), "the keeper's exit")
            squatted.append(
                held.enter_context(squatter(name, 0o666, slots=SLOTS, row=ROW, engine=""))
            )
        return real(fd)

    monkeypatch.setattr(arena_mod, "_read_header", read_header)
    with held:
        with pytest.raises(ArenaForeignError) as err:
            Arena.create(name, SLOTS, ROW, table=True, keep_s=KEEP_S)
        monkeypatch.undo()
        assert squatted, "the claim never read the kept segment's header"
        msg = str(err.value)
        assert f"{SHM_DIR}/{name}" in msg and f"owner uid {uid} ({COTENANT})" in msg
        assert squatted[0]() == bytes(SLOTS * ROW)


def test_c44_a_keeper_never_takes_over_another_users_segment_under_its_arenas_name():
    """The keeper opens its arena's name again when the owner dies; had the name been
    removed and a co-tenant's segment put there, with the arena's nonce in its header (the
    nonce is on the keeper's command line, which every user can read), the keeper would lock
    it, mark it and wait for claims on it: it leaves it alone instead."""
    name = f"kvtest_wattack_keeper_{os.getpid()}_{time.monotonic_ns()}"
    nonce = os.urandom(16)
    with squatter(name, hold_lock=False, nonce=nonce, slots=4, row=ROW, engine=""):
        fd = arena_mod._open_segment(name)  # what the keeper's open by name finds
        try:
            table = SlotTable(bytearray(table_bytes(4)), np.zeros((4, ROW), np.uint8))
            assert janitor._take_over(name, nonce, fd, table) is False
            header = arena_mod._read_header(fd)
            assert header is not None and header[2] == arena_mod._STATE_READY  # not KEEPING
            assert not arena_mod._owner_alive(fd)  # not locked by the keeper
        finally:
            os.close(fd)


# -- a forged or malformed slot table (a process of this user that is not a keeper) -------------


class Forger:
    """A process of the engine's user that is not a keeper, writing a kept segment directly
    (mapped by name, as any such process can) with the slot table's format."""

    def __init__(self, name: str):
        self.fd = os.open(path(name), os.O_RDWR)
        self.mm = mmap.mmap(self.fd, os.fstat(self.fd).st_size)
        _, _, _, _, _, slots, row, _, _ = arena_mod._read_header(self.fd)
        self.rows = np.frombuffer(
            self.mm, np.uint8, count=slots * row, offset=HEADER_BYTES
        ).reshape(slots, row)
        self.table = memoryview(self.mm)[HEADER_BYTES + slots * row :]

    def close(self) -> None:
        del self.rows
        self.table.release()
        self.mm.close()
        os.close(self.fd)

    def at(self, slot: int) -> int:
        return stm.TABLE_HEADER_BYTES + slot * stm.ENTRY_BYTES

    def entry(self, slot: int) -> tuple[int, int, bytes, int]:
        """(seq, state, key, stamp) as written (no check)."""
        seq, st, klen, _, stamp, key = stm._ENTRY.unpack_from(self.table, self.at(slot))
        return seq, st, key[:klen], stamp

    def free_slots(self) -> list[int]:
        return [s for s in range(len(self.rows)) if self.entry(s)[1] != stm._READY]

    def ready_slots(self) -> dict[bytes, int]:
        return {e[2]: s for s in range(len(self.rows)) if (e := self.entry(s))[1] == stm._READY}

    def write(
        self,
        slot: int,
        seq: int,
        state: int,
        key: bytes,
        stamp: int,
        key_len: int | None = None,
        seal_seq: int | None = None,
        digest: int | None = None,
    ) -> None:
        """An entry with a consistent entry check, sealed with a consistent seal check
        (``seal_seq``: the entry's seq unless given; ``digest``: the row's unless given)."""
        at = self.at(slot)
        raw = stm._ENTRY.pack(seq, state, len(key) if key_len is None else key_len, 0, stamp, key)
        check = xxhash.xxh3_64_intdigest(raw)
        self.table[at : at + stm._CHECK_AT] = raw
        struct.pack_into("<Q", self.table, at + stm._CHECK_AT, check)
        if digest is None:
            digest = xxhash.xxh3_64_intdigest(self.rows[slot])
        seal = stm._SEAL.pack(seq if seal_seq is None else seal_seq, 0, digest)
        self.table[at + stm._SEAL_AT : at + stm._SEAL_CHECK_AT] = seal
        seal_check = xxhash.xxh3_64_intdigest(seal + struct.pack("<Q", check))
        struct.pack_into("<Q", self.table, at + stm._SEAL_CHECK_AT, seal_check)


@contextlib.contextmanager
def forger(name: str):
    f = Forger(name)
    try:
        yield f
    finally:
        f.close()


def test_a_malformed_slot_table_adopts_only_whole_sealed_chunks_and_counts_every_other_entry(
    name,
):
    """Into a kept arena's table a process of this user that is not a keeper writes entries
    whose checks all hold but whose content is not what an engine writes: a key longer than an
    entry holds, an odd (changing) seq, a seal of another seq, a seal whose digest is not the
    row's, a second copy of a stored chunk's key, a key of 3 bytes and an empty one, a state no
    engine writes; and it gives a stored chunk the largest stamp and seq there are (resealed:
    its row is the engine's). The successor adopts exactly the stored chunks whose key is in one
    slot, with their bytes, counts every other READY entry by reason, does not crash, and goes
    on storing (stamps and seqs past the huge ones)."""
    kept_arena(name)
    keys = keys_for(N + TORN, seed=5)
    with forger(name) as f:
        ready = f.ready_slots()
        assert set(ready) == set(keys[:N])
        free = f.free_slots()
        huge = ready[keys[1]]
        f.write(huge, 0xFFFFFFFE, stm._READY, keys[1], 2**64 - 1)
        f.write(free[0], 2, stm._READY, b"k" * 64, 1, key_len=65)  # torn
        f.write(free[1], 3, stm._READY, keys[N], 1)  # torn: odd seq
        f.write(free[2], 4, stm._READY, keys[N + 1], 1, seal_seq=2)  # unsealed
        f.write(free[3], 0xFFFFFFFE, stm._READY, b"d" * 20, 1, digest=12345)  # digest
        f.write(free[4], 2, stm._READY, keys[0], 7)  # duplicate (with the real one)
        f.write(free[5], 2, stm._READY, b"abc", 1)  # key: too short to name a chunk
        f.write(free[6], 2, stm._READY, b"", 1)  # key: empty
        f.write(free[7], 2, 7, b"s" * 20, 1)  # a state nobody writes: not a chunk
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted
        expected = {
            **dict.fromkeys(OUTCOMES, 0),
            "adopted": N - 1,
            "dropped_torn": 2,
            "dropped_unsealed": 1,
            "dropped_digest": 1,
            "dropped_duplicate": 2,
            "dropped_key": 2,
        }
        assert rig.tm.warm_restart == expected
        adopted = [k for k in keys[:N] if rig.tm.host.is_present(k)]
        assert adopted == keys[1:N]
        assert len(rig.tm.host) == N - 1  # nothing under a forged key
        for k, row in zip(adopted, rig.read(adopted)):
            assert np.array_equal(row, payload(k, rig.row_bytes))
        more = keys_for(3, seed=9)
        rig.store(more)  # publishes after the huge stamp and seq without overflowing
        assert all(rig.tm.host.is_present(k) for k in more)
        table = rig.arena.slot_table()
        assert table is not None
        held = {slot: k for k, slot in rig.tm.host.index.items()}
        for slot in range(SLOTS):  # every entry intact; READY exactly for what the tier holds
            entry = table._entry(slot)
            assert entry is not None, slot
            assert (entry[1] == stm._READY) == (slot in held) and entry[2] == held.get(slot, b"")
        for k in more:
            entry = table._entry(rig.tm.host.index[k])
            assert entry is not None and entry[3] <= 2**62 + len(more)


def test_a_slot_table_header_claiming_more_slots_than_the_arena_adopts_nothing(name):
    """The table's header (its check recomputed) claims one slot more than the arena holds: the
    whole table is dropped (`dropped_table`, every READY entry), nothing is adopted and the
    successor starts with an empty host tier it goes on using."""
    kept_arena(name)
    with forger(name) as f:
        head = stm._TABLE.pack(stm._MAGIC, stm._VERSION, SLOTS + 1, ROW, b"")
        ns = bytes(f.table[len(head) - 64 : len(head)])
        head = stm._TABLE.pack(stm._MAGIC, stm._VERSION, SLOTS + 1, ROW, ns)
        f.table[: len(head)] = head
        struct.pack_into("<Q", f.table, len(head), xxhash.xxh3_64_intdigest(head))
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted
        assert rig.tm.warm_restart == {**dict.fromkeys(OUTCOMES, 0), "dropped_table": N}
        assert len(rig.tm.host) == 0
        rig.store(keys_for(2, seed=9))


@pytest.mark.parametrize("slots", [SLOTS * 2, 2**62], ids=["twice", "huge"])
def test_an_arena_header_claiming_more_slots_than_its_segment_holds_is_reclaimed(name, slots):
    """The kept arena's header claims more slots than the segment's bytes hold (and a table for
    them); a successor of that very shape neither maps past the segment's end nor crashes: the
    segment is removed and the successor starts cold on a new one."""
    kept_arena(name)
    old = os.stat(path(name)).st_ino
    with forger(name) as f:
        struct.pack_into("<Q", f.mm, 32, slots)  # the header's num_slots
        struct.pack_into("<Q", f.mm, arena_mod._WARM_OFFSET, min(table_bytes(slots), 2**64 - 1))
    with Rig(name=name, num_slots=min(slots, SLOTS * 2), warm_restart_s=KEEP_S) as rig:
        assert not rig.arena.adopted and cold(rig)
        assert os.stat(path(name)).st_ino != old


# -- an impersonated keeper, a reused owner pid --------------------------------------------------


def _dead_engines_segment(name: str) -> Arena:
    """An engine's warm-restart arena with no keeper: the caller writes its keeper pid, then
    closes it keeping the segment (its lock drops, as at the engine's death)."""
    return Arena.create(name, SLOTS, ROW, table=True, keep_s=KEEP_S, janitor=False)


def _set_keeper(arena: Arena, pid: int) -> None:
    mm = arena._mmap
    assert mm is not None
    tbytes = arena_mod._WARM.unpack_from(mm, arena_mod._WARM_OFFSET)[0]
    arena_mod._WARM.pack_into(mm, arena_mod._WARM_OFFSET, tbytes, pid, 0, 0.0)


def _lookalike(conn) -> None:
    """The co-tenant's process with a keeper's command line (``kvoffload.ipc.janitor`` and the
    arena's nonce, which it can read on the real keeper's): given the nonce, it sends its pid,
    then it ends when told. (Forked before the segment exists: it inherits no descriptor of it.)"""
    nonce_hex = conn.recv()
    proc = subprocess.Popen(
        ["/usr/bin/python3", "-c", "import time; time.sleep(600)", "kvoffload.ipc.janitor"]
        + [nonce_hex]
    )
    try:
        conn.send(proc.pid)
        conn.recv()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "impostor", ["unrelated", "another_arenas_keeper", "another_users_lookalike"]
)
def test_a_dead_engines_arena_whose_keeper_pid_names_another_live_process_is_not_kept(
    name, impostor
):
    """The keeper pid in a dead engine's header names a live process that is not its keeper
    (the real one died and its pid was reused): an unrelated process of this user, the keeper
    of another arena (its command line says kvoffload.ipc.janitor), a co-tenant's process whose
    command line copies the keeper's, nonce included. Nothing keeps the segment, so a sweep
    removes it, and a successor starts cold at once instead of waiting for a keeper."""
    if impostor == "another_users_lookalike":
        cotenant()
    with contextlib.ExitStack() as stack:
        pid = 0
        if impostor == "unrelated":
            proc = subprocess.Popen(["sleep", "600"])
            stack.callback(lambda: (proc.kill(), proc.wait()))
            pid = proc.pid
        elif impostor == "another_arenas_keeper":
            other = Arena.create(name + "_other", 4, ROW, table=True, keep_s=KEEP_S)
            stack.callback(
                wait_until, lambda: not keepers(other.name), patience(60), "its keeper's exit"
            )
            stack.callback(other.close, keep=False)
            wait_until(lambda: other.keeper_pid() != 0, patience(60), "the other keeper")
            pid = other.keeper_pid()
            assert "kvoffload.ipc.janitor" in psutil.Process(pid).cmdline()
        for successor in (False, True):
            with contextlib.ExitStack() as each:
                if impostor == "another_users_lookalike":
                    lookalike = each.enter_context(CotenantProcess(_lookalike))
                dead = _dead_engines_segment(name)
                if impostor == "another_users_lookalike":
                    lookalike.send(dead.nonce.hex())
                    pid = lookalike.recv()
                    each.callback(lookalike.send, "done")
                    # its command line is readable a moment after its pid is (empty while the
                    # process is still being exec'd, seen under a contended CPU)
                    wait_until(
                        lambda d=dead, p=pid: d.nonce.hex() in psutil.Process(p).cmdline() or None,
                        patience(60),
                        "the lookalike's command line",
                    )
                _set_keeper(dead, pid)
                dead.close(keep=True)
                if not successor:
                    assert sweep_report(name).removed == [name]
                    continue
                with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
                    assert not rig.arena.adopted and cold(rig)
                    assert rig.arena.nonce != dead.nonce


def test_c56_a_sweep_looking_at_a_stale_arena_as_the_successor_starts_does_not_fail_it(
    name, monkeypatch
):
    """A dead engine's arena left KEEPING with no keeper (stale) while another process's sweep
    (every engine start sweeps) holds its owner lock for a moment, just as the successor looks
    at it: the successor looks again and starts cold, instead of failing as 'in use by a live
    process'."""
    dead = _dead_engines_segment(name)
    mm = dead._mmap
    assert mm is not None
    struct.pack_into("<I", mm, 12, arena_mod._STATE_KEEPING)
    dead.close(keep=True)
    real = arena_mod._remove_if_stale
    probed: list[bool] = []

    def probed_meanwhile(n: str, patience_s: float = 0.0):
        if probed:
            return real(n, patience_s)
        fd = os.open(path(n), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the sweep's look, as it happens
            probed.append(True)
            return real(n, patience_s)
        finally:
            os.close(fd)  # the look ends

    monkeypatch.setattr(arena_mod, "_remove_if_stale", probed_meanwhile)
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert probed and not rig.arena.adopted and cold(rig)
        assert rig.arena.nonce != dead.nonce


def _start_keeper(arena: Arena, watched: psutil.Process) -> int:
    """The real keeper (the janitor with a keep time) of ``arena``, watching ``watched`` as its
    engine process; returns the keeper's pid once it is up."""
    subprocess.run(
        [sys.executable, "-m", "kvoffload.ipc.janitor", arena.name, arena.nonce.hex()]
        + [str(watched.pid), repr(watched.create_time()), repr(KEEP_S)],
        env=child_environment(),
        stdin=subprocess.DEVNULL,
        close_fds=True,
        check=True,
    )
    wait_until(lambda: arena.keeper_pid() != 0, patience(60), "the keeper's start")
    return arena.keeper_pid()


def test_c56_a_claimant_waits_for_the_keeper_when_the_dead_owners_pid_was_reused(name):
    """The keeper holds the owner's lock of an engine that died, a moment before it writes
    KEEPING (the lock here held by the test for it), and the owner's pid now names another
    process, started after the segment was made (a reused pid): a claimant waits for the
    keeper, as for any dead engine, instead of taking the segment for a live engine's and
    failing the start. With the pid of a process that did own it (started before it), the
    claimant leaves it alone: a live engine's."""
    with contextlib.ExitStack() as stack:
        watched = subprocess.Popen(["sleep", "600"])
        stack.callback(lambda: (watched.kill(), watched.wait()))
        reused = subprocess.Popen(["sleep", "600"])
        stack.callback(lambda: (reused.kill(), reused.wait()))
        arena = Arena.create(name, SLOTS, ROW, table=True, keep_s=KEEP_S, janitor=False)
        stack.callback(arena.close, keep=False)
        _start_keeper(arena, psutil.Process(watched.pid))
        mm = arena._mmap
        assert mm is not None
        # the engine ran for an hour before it died: the pid's new process started after that
        struct.pack_into("<QQ", mm, 16, reused.pid, time.time_ns() - 3600 * 10**9)
        with pytest.raises(ArenaBusyError, match="did not take it over"):
            Arena._claim(name, SLOTS, ROW, "", KEEP_S, janitor=False, wait_s=0.5)
        struct.pack_into("<QQ", mm, 16, os.getpid(), time.time_ns())
        assert Arena._claim(name, SLOTS, ROW, "", KEEP_S, janitor=False, wait_s=0.5) is None


# -- claimants that die mid-claim, claimants that race ------------------------------------------


def _claim_of_a_dead_process(name: str) -> None:
    """Write a claim, as ``Arena.create`` does, of a process that has exited since."""
    proc = subprocess.Popen(["true"])
    born = psutil.Process(proc.pid).create_time()
    proc.wait()
    fd = os.open(path(name), os.O_RDWR)
    try:
        os.pwrite(fd, arena_mod._CLAIM.pack(proc.pid, born), arena_mod._CLAIM_OFFSET)
    finally:
        os.close(fd)


def test_c56_a_claim_of_a_claimant_that_died_before_the_hand_over_is_ignored(name):
    """A claimant wrote its claim and died before the keeper let go: the keeper keeps the
    segment for the next claimant, which adopts every chunk."""
    kept_arena(name)
    (keeper,) = keepers(name)
    _claim_of_a_dead_process(name)
    assert state(name) == "kept" and keepers(name) == [keeper]
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted and rig.tm.warm_restart["adopted"] == N


def test_c56_a_claimant_that_dies_after_the_keeper_let_go_leaves_the_arena_to_the_next(name):
    """The keeper let go for a claimant (it exited), which died before it took the segment's
    lock: nobody holds the kept segment, and nothing writes it. The next claimant takes it and
    adopts every chunk, instead of failing its start as if a live process had the arena."""
    kept_arena(name)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "warm_peer.py"), "claim-then-die", name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "handed over"
    finally:
        kill(proc)
        assert proc.stdin is not None
        proc.stdin.close()
    assert not keepers(name) and state(name) == "kept"
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted and rig.tm.warm_restart["adopted"] == N, rig.tm.warm_restart


def test_c56_a_claimant_killed_before_it_adopted_leaves_the_chunks_to_the_next(name):
    """A claimant (vLLM's model runner) took the kept segment over and was SIGKILLed before any
    process of its engine adopted the table: its own keeper keeps the segment, and the next
    successor adopts every chunk."""
    kept_arena(name)
    old = keeper_pid(name)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TESTS_DIR, "warm_peer.py"), "claim", name, str(SLOTS)]
        + [str(KEEP_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed 1"
        wait_until(lambda: keeper_pid(name) not in (0, old), patience(60), "its keeper's start")
    finally:
        kill(proc)
        assert proc.stdin is not None
        proc.stdin.close()
    wait_until(lambda: state(name) == "kept", patience(60), "its keeper's take-over")
    with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
        assert rig.arena.adopted and rig.tm.warm_restart["adopted"] == N, rig.tm.warm_restart


def test_c56_a_keeper_killed_while_taking_over_leaves_nothing_to_adopt_and_the_successor_starts_cold(
    name,
):
    """The keeper is SIGKILLed while it waits for the dead engine's last process (a tier worker
    that still maps the arena) to let go: that process could still write the segment, so
    nobody may adopt it. A successor starts at once, cold, on a new segment (not refused as if
    a live process had the arena)."""
    owner = started_engine(name)
    try:
        with peer("attach", name) as said:
            assert said == "attached"
            kill(owner)
            wait_until(lambda: keeper_waits_for_a_mapping(name), patience(60), "the keeper")
            (keeper,) = keepers(name)
            k = psutil.Process(keeper)
            k.send_signal(signal.SIGKILL)
            wait_until(lambda: gone(k), patience(60), "the keeper's death")
            assert state(name) == "keeping"
            old = os.stat(path(name)).st_ino
            with Rig(name=name, num_slots=SLOTS, warm_restart_s=KEEP_S) as rig:
                assert not rig.arena.adopted and cold(rig)
                assert os.stat(path(name)).st_ino != old
    finally:
        kill(owner)


def test_c56_two_successors_racing_for_one_kept_arena_exactly_one_adopts(name):
    """Two claimants released together against one kept arena: exactly one takes it over and
    adopts; the other's start is refused as busy, taking nothing."""
    kept_arena(name)
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(TESTS_DIR, "warm_peer.py"), "race", name, str(SLOTS)]
            + [str(KEEP_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=TESTS_DIR,
        )
        for _ in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        said = sorted(p.stdout.readline().strip() for p in procs if p.stdout is not None)
        assert said == ["claimed 1", "refused ArenaBusyError"], said
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()  # the winner unmaps and removes the arena
        for p in procs:
            try:
                p.wait(patience(60))
            except subprocess.TimeoutExpired:
                kill(p)
            if p.stdout is not None:
                p.stdout.close()
    wait_until(lambda: not os.path.exists(path(name)), patience(60), "the winner's removal")
