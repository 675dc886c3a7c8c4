"""Arena janitor: removes a host arena from /dev/shm once the process that created it is gone.

::

    arena owner ──spawn──▶ janitor ──fork──▶ janitor' (detached: own session, parent exits)
                                                │ every 0.5 s: is the owner alive? is the arena still there?
                                                ▼ owner gone
                                 unlink the arena once no process holds its owner lock; exit

Engines such as vLLM kill their whole process tree with SIGKILL on shutdown (tier workers and the
model runner that owns the arena included), so nothing inside the engine's tree is sure to outlive
it. The janitor detaches (double fork, new session) to escape both process-tree and process-group
kills. It exits on its own when the arena is closed normally (the name is gone or belongs to a newer
arena). Imports nothing but :mod:`kvoffload.ipc`.

With a keep time (a warm restart: the arena has a slot table), the janitor is the arena's
*keeper*::

    owner alive ──▶ seal new READY entries, 256 rows a pass (nice 19)
    owner gone  ──▶ its flock (sweeps see the segment held) ──▶ KEEPING
                ──▶ the mapped lock, exclusive: every process of the old engine has unmapped it
                ──▶ final seal (FINAL_SEAL_S at most) ──▶ KEPT ──▶ a claimant of this user: let go
                                                               └─▶ keep time over: unlink

The take-over, from the owner's death to KEPT, lasts at most
:data:`~kvoffload.ipc.arena.HANDOVER_S`; a process of the old engine that still maps the segment
then could still write it, so the keeper unlinks it instead. A claimant is
:meth:`kvoffload.ipc.arena.Arena.create` with ``table`` (DESIGN.md "Warm restart").

Usage: ``python -m kvoffload.ipc.janitor <arena name> <nonce hex> <owner pid> <owner start time>
[<keep seconds>]``
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvoffload.ipc.slot_table import SlotTable

_POLL_S = 0.5
_OWNER_WAIT_S = 60.0
_SEAL_POLL_S = 0.1  # a keeper's pause between two passes over the slot table
#: Rows a keeper hashes in one pass before it looks at its owner (or its final seal's bound)
#: again.
_SEALS_PER_PASS = 256


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - create_time) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _arena_present(name: str, nonce: bytes) -> bool:
    from kvoffload.ipc.arena import list_arenas

    return any(a.name == name and a.nonce == nonce for a in list_arenas(name))


def watch(name: str, nonce: bytes, pid: int, create_time: float) -> int:
    """Wait (polling every ``_POLL_S`` seconds) until the arena's owner process ``pid`` (started at
    ``create_time``, psutil seconds since the epoch, so a reused pid is not mistaken for it) is
    gone, then unlink segment ``name`` if it is still the one with ``nonce`` and nobody took it
    over. Returns the exit status (0)."""
    from kvoffload.ipc.arena import unlink_if_orphaned

    while _alive(pid, create_time):
        time.sleep(_POLL_S)
        if not _arena_present(name, nonce):
            return 0
    unlink_if_orphaned(name, nonce, wait_s=_OWNER_WAIT_S)
    return 0


def keep(name: str, nonce: bytes, pid: int, create_time: float, keep_s: float) -> int:
    """The keeper's life (module docstring): seal while the owner ``pid`` lives, then take the
    segment over (:func:`_take_over`), hold it up to ``keep_s`` seconds for a claimant, then
    unlink it. Returns the exit status (0)."""
    import psutil

    from kvoffload.ipc import arena as am

    try:
        arena = am.Arena.attach(name, nonce=nonce, timeout_s=5.0, keeper=True)
    except am.ArenaError:
        return watch(name, nonce, pid, create_time)  # gone, or its owner died first: no keeping
    table = arena.slot_table()
    if table is None:
        arena.close()
        return watch(name, nonce, pid, create_time)
    mm = arena._mmap
    assert mm is not None
    am._WARM.pack_into(mm, am._WARM_OFFSET, arena.table_bytes, os.getpid(), 0, 0.0)
    while _alive(pid, create_time):
        if not table.seal_pending(_SEALS_PER_PASS):
            time.sleep(_SEAL_POLL_S)
        if not _arena_present(name, nonce):
            arena.close()
            return 0
    try:
        fd = am._open_segment(name)
    except (OSError, am.ArenaError):
        arena.close()
        return 0
    try:
        if not _take_over(name, nonce, fd, table):
            return 0
        os.pwrite(fd, am._WARM.pack(arena.table_bytes, os.getpid(), 0, 0.0), am._WARM_OFFSET)
        os.pwrite(fd, am.struct.pack("<II", am._VERSION, am._STATE_KEPT), 8)
        me = os.geteuid()
        deadline = time.monotonic() + keep_s
        while time.monotonic() < deadline and am._same_inode(name, fd):  # removed by hand: done
            cpid, ctime = am._CLAIM.unpack(os.pread(fd, am._CLAIM.size, am._CLAIM_OFFSET))
            if cpid and _alive(cpid, ctime):
                try:
                    claimant = psutil.Process(cpid).uids().effective
                except psutil.Error:
                    claimant = -1
                if claimant == me:
                    return 0  # closing the descriptor lets the claimant take the lock
            time.sleep(0.05)
        if am._same_inode(name, fd):
            with contextlib.suppress(Exception):
                am.posix_ipc.unlink_shared_memory(am._posix_name(name))
        return 0
    finally:
        arena.close(keep=True)
        os.close(fd)


def _take_over(name: str, nonce: bytes, fd: int, table: SlotTable) -> bool:
    """Make the dead engine's segment (open as ``fd``) nobody's but this keeper's, within
    :data:`~kvoffload.ipc.arena.HANDOVER_S`: its owner's lock (the owner's last process gone),
    KEEPING at once (a claimant waits), every other process's mapped lock (the old scheduler,
    tier workers, other ranks: none can write a row or an entry after this), then the final seal
    of ``table`` (:data:`~kvoffload.ipc.arena.FINAL_SEAL_S` at most, :data:`_SEALS_PER_PASS`
    rows a pass). Returns True when the segment is ready to be marked kept; False when it is not
    this keeper's to keep (gone, another user's or another arena under the name, its owner's
    lock never dropped) or when a process of the old engine still maps it at the bound: the
    segment is unlinked then, since nothing in it can be trusted."""
    import fcntl

    from kvoffload.ipc import arena as am

    try:
        if am._not_ours(os.fstat(fd)) is not None:
            return False  # the name is another user's now: never written, locked or removed
    except OSError:
        return False
    deadline = time.monotonic() + am.HANDOVER_S
    locks_by = deadline - am.FINAL_SEAL_S
    while True:  # the owner's lock drops with its last process
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > locks_by:
                return False  # a sweep removes it once the lock drops
            time.sleep(0.05)
    header = am._read_header(fd)
    if header is None or header[7] != nonce or not am._same_inode(name, fd):
        return False  # not the arena it kept any more
    os.pwrite(fd, am.struct.pack("<II", am._VERSION, am._STATE_KEEPING), 8)
    if not am._mapped_lock(fd, exclusive=True, wait_s=max(0.0, locks_by - time.monotonic())):
        if am._same_inode(name, fd):  # a process of the old engine may still write it
            with contextlib.suppress(Exception):
                am.posix_ipc.unlink_shared_memory(am._posix_name(name))
        return False
    final_seal(table, time.monotonic() + am.FINAL_SEAL_S)
    return True


def final_seal(
    table: SlotTable, seal_by: float, clock: Callable[[], float] = time.monotonic
) -> int:
    """Seal ``table``'s READY entries still unsealed, :data:`_SEALS_PER_PASS` rows a pass, until
    none is left or ``clock()`` reaches ``seal_by`` (:data:`~kvoffload.ipc.arena.FINAL_SEAL_S`
    after the old engine's last process let go): what is left then is dropped as ``unsealed``.
    Returns the entries sealed.

    Nothing writes the segment by then: a READY entry, stable and intact, names a row whose
    bytes all landed before it was published, and a slot is retracted before it is given to
    another write, so the row hashed now is that chunk, whole (DESIGN.md "Warm restart")."""
    sealed = 0
    while clock() < seal_by:
        n = table.seal_pending(_SEALS_PER_PASS)
        if not n:
            break
        sealed += n
    return sealed


def main(argv: list[str]) -> int:
    """``python -m kvoffload.ipc.janitor NAME NONCE_HEX PID CREATE_TIME [KEEP_S]``: fork once
    (so the spawner returns at once), then :func:`watch` (or :func:`keep`, with a keep time).
    Returns the exit status."""
    name, nonce_hex, pid, create_time = argv[0], argv[1], int(argv[2]), float(argv[3])
    keep_s = float(argv[4]) if len(argv) > 4 else 0.0
    # Detach before any heavy import, so the spawner returns at once.
    if os.fork() > 0:
        os._exit(0)  # the spawner reaps this parent; the child is re-parented away from the engine
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    try:
        os.nice(19)
    except OSError:
        pass
    if keep_s > 0:
        return keep(name, bytes.fromhex(nonce_hex), pid, create_time, keep_s)
    return watch(name, bytes.fromhex(nonce_hex), pid, create_time)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
