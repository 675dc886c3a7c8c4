"""The host arena: one POSIX shared-memory segment per engine, divided into fixed-size slots.

::

    /dev/shm/<name>
    ┌──────────── header page (4096 bytes) ────────────┐┌── slot 0 ──┐┌── slot 1 ──┐ ... ┌── slot N-1 ──┐
    │ magic, version, state, owner pid, nonce, shape   ││ row_bytes  ││ row_bytes  │     │  row_bytes   │
    └──────────────────────────────────────────────────┘└────────────┘└────────────┘     └──────────────┘

The engine process that creates the segment is its *owner*. It reserves every byte up front with
``posix_fallocate`` (a /dev/shm too small for the arena fails at creation with :class:`ArenaSpaceError`,
never with SIGBUS on a later write) and holds an exclusive ``flock`` on the segment for as long as it
lives. The kernel drops that lock when the owner dies, however it dies, so "unlocked" means "owner dead":
:func:`sweep` and the next :meth:`Arena.create` with the same name remove such segments. Tier workers and
accelerator workers :meth:`Arena.attach` by name and check the header's nonce, so they never mistake a
stale segment that happens to carry the same name for the live one.

/dev/shm is shared by every user of the host (CASES C44). A segment is *ours* only when the opened
file (``fstat`` of the descriptor, never a second look by name) is a regular file of this process's
effective uid; sweeping touches (locks, unlinks) only ours and skips the rest, each logged once per
name. Attaching asks more: ours, mode 0600 exactly (how :meth:`Arena.create` makes it), a ready
header of this version with a live owner lock, and the nonce (tier workers) or the engine id
(:meth:`Arena.open_or_create`) the caller expects; anything else is refused with
:class:`ArenaForeignError`, naming the segment's owner uid and mode, and nothing is mapped.

Views (:attr:`Arena.rows`, :meth:`Arena.torch_rows`, :meth:`Arena.memoryview`) are zero-copy and keep the
mapping alive: they are built with ``np.frombuffer`` on the ``mmap`` object (``torch.frombuffer`` does
not keep an mmap alive). This module imports nothing of the project outside :mod:`kvoffload.ipc`, and no
torch.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import posix_ipc

from kvoffload.ipc.childenv import child_environment

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvoffload"
HEADER_BYTES = 4096
#: Accelerator-transfer counters in the header page: one row per TP rank, float64
#: ``(load bytes, load seconds, store bytes, store seconds)``, each row written by one rank only.
DEVICE_STATS_OFFSET = 1024
DEVICE_STATS_RANKS = 64
DEVICE_STATS_FIELDS = 4
PAGE_BYTES = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap module does not name it

_MAGIC = b"KVOARENA"
_VERSION = 1
_STATE_INIT = 0
_STATE_READY = 1
# magic, version, state, owner pid, created (ns), num_slots, row_bytes, nonce, engine id
_HEADER = struct.Struct("<8sIIQQQQ16s128s")
# A segment that never reached the ready state is presumed abandoned after this long (seconds).
_STALE_INIT_AGE_S = 30.0
_NAME_RE = re.compile(r"[^A-Za-z0-9_.-]")
#: The only mode an attachable segment may have: what :meth:`Arena.create` gives it.
ARENA_MODE = 0o600

log = logging.getLogger("kvoffload.ipc.arena")


class ArenaError(RuntimeError):
    """A host arena could not be created or attached."""


class ArenaSpaceError(ArenaError):
    """/dev/shm has too little free space for the requested arena."""


class ArenaBusyError(ArenaError):
    """The arena name is held by a live owner."""


class ArenaForeignError(ArenaError):
    """A segment of the arena's name exists that this process cannot prove its own engine's
    (another user's, not mode 0600, not a kvoffload arena, or another engine's): never attached,
    never removed. The message names the segment, its owner uid and mode, and what to do."""


@dataclass(frozen=True)
class ArenaInfo:
    """The header of an arena segment, as read from /dev/shm."""

    name: str
    owner_pid: int
    created_ns: int
    num_slots: int
    row_bytes: int
    nonce: bytes
    engine_id: str
    ready: bool
    size_bytes: int
    owner_alive: bool = False
    uid: int = -1
    """Owner uid of the segment file (-1: not known)."""
    mode: int = 0
    """Permission bits of the segment file (``0o600`` for kvoffload's)."""
    ours: bool = True
    """False for a segment of another user (or not a regular file): its header is not read, and
    sweeping leaves it alone."""


@dataclass(frozen=True)
class SkippedSegment:
    """A segment :func:`sweep` left alone because it may not touch it.

    Attributes:
        name: its /dev/shm name.
        uid: its owner uid (-1 when it could not even be looked at).
        mode: its permission bits.
        reason: why, in words (``"owned by uid 1001 (alice)"``, ``"permission denied"``...).
    """

    name: str
    uid: int
    mode: int
    reason: str


@dataclass
class SweepReport:
    """What one :func:`sweep_report` did: the segments it removed and those it skipped."""

    removed: list[str] = field(default_factory=list)
    skipped: list[SkippedSegment] = field(default_factory=list)


def default_name(engine_id: str) -> str:
    """Deterministic arena name for an engine: ``kvoffload_<engine id>``.

    The engine id is reduced to ``[A-Za-z0-9_.-]`` and 100 characters, so the name is a valid
    /dev/shm file name. Every process of one engine derives the same name.
    """
    safe = _NAME_RE.sub("_", engine_id)[:100] or "engine"
    return f"{NAME_PREFIX}_{safe}"


def round_up_to_page(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of the page size (bytes)."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


def _posix_name(name: str) -> str:
    if "/" in name or not name or len(name) > 200:
        raise ArenaError(f"invalid arena name {name!r}: 1-200 characters, no '/'")
    return "/" + name


def _read_header(fd: int) -> tuple[bytes, int, int, int, int, int, int, bytes, str] | None:
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) < _HEADER.size:
        return None
    magic, version, state, pid, created, num_slots, row_bytes, nonce, engine = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION:
        return None
    return (
        magic,
        version,
        state,
        pid,
        created,
        num_slots,
        row_bytes,
        nonce,
        engine.rstrip(b"\0").decode("utf-8", "replace"),
    )


def _owner_alive(fd: int) -> bool:
    """True when some process holds the owner lock on this segment."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _same_inode(name: str, fd: int) -> bool:
    try:
        return os.stat(os.path.join(SHM_DIR, name)).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _user(uid: int) -> str:
    """``uid`` with its user name where this host knows it: ``1001 (alice)``."""
    import pwd

    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def _open_segment(name: str) -> int:
    """Open segment ``name`` read-write as ``shm_open`` does (no symlink followed), without
    blocking (a FIFO planted under the name cannot hang us). Returns the descriptor.

    Raises:
        FileNotFoundError: no such segment.
        OSError: any other refusal (EACCES for another user's 0600 segment, ELOOP for a link).
        ArenaError: an invalid name.
    """
    _posix_name(name)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    return os.open(os.path.join(SHM_DIR, name), flags)


def _not_ours(st: os.stat_result) -> str | None:
    """Why a segment whose ``fstat`` is ``st`` is not this user's to touch; None when it is."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {_user(st.st_uid)}"
    return None


def _unopenable(name: str, err: OSError) -> SkippedSegment:
    """A segment that could not be opened: what a look by name (only to report it) tells."""
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return SkippedSegment(name, -1, 0, os.strerror(err.errno or 0).lower())
    why = os.strerror(err.errno or 0).lower()
    if st.st_uid != os.geteuid():
        why = f"owned by uid {_user(st.st_uid)}; {why}"
    elif stat.S_ISLNK(st.st_mode):
        why = "a symbolic link"
    return SkippedSegment(name, st.st_uid, stat.S_IMODE(st.st_mode), why)


def _foreign_error(name: str, uid: int, mode: int, why: str) -> ArenaForeignError:
    me = os.geteuid()
    if uid == me:
        remedy = (
            f"pick another arena_name, or remove it (`rm {SHM_DIR}/{name}`) once no engine of "
            "yours uses it"
        )
    else:
        owner = "its owner" if uid < 0 else f"its owner (uid {_user(uid)})"
        remedy = (
            f"pick another arena_name (this host's /dev/shm is shared by every user), or have "
            f"{owner} remove it (`kvoffload sweep` once its engine is stopped, or `rm "
            f"{SHM_DIR}/{name}`)"
        )
    return ArenaForeignError(
        f"arena {name!r}: {SHM_DIR}/{name} exists but is not this engine's to attach ({why}; "
        f"owner uid {_user(uid) if uid >= 0 else '?'}, mode {mode:04o}; this process runs as uid "
        f"{_user(me)}, and kvoffload creates its arenas mode {ARENA_MODE:04o}); {remedy}"
    )


def _check_attachable(name: str, fd: int) -> None:
    """Refuse (:class:`ArenaForeignError`) a segment, by its open descriptor, that is not this
    user's or not mode 0600."""
    st = os.fstat(fd)
    why = _not_ours(st)
    if why is None and stat.S_IMODE(st.st_mode) != ARENA_MODE:
        why = f"mode {stat.S_IMODE(st.st_mode):04o}: readable or writable by others"
    if why is not None:
        raise _foreign_error(name, st.st_uid, stat.S_IMODE(st.st_mode), why)


def _refuse_foreign(name: str) -> None:
    """Raise :class:`ArenaForeignError` when segment ``name`` exists and may not be attached
    (checked on its opened descriptor); return when it is ours, or gone."""
    try:
        fd = _open_segment(name)
    except FileNotFoundError:
        return
    except OSError as e:
        skipped = _unopenable(name, e)
        raise _foreign_error(name, skipped.uid, skipped.mode, skipped.reason) from None
    try:
        _check_attachable(name, fd)
    finally:
        os.close(fd)


def _header_engine_id(engine_id: str) -> str:
    """``engine_id`` as a header records it (128 bytes of UTF-8 at most) and reads it back."""
    return engine_id.encode("utf-8")[:128].rstrip(b"\0").decode("utf-8", "replace")


_reported_lock = threading.Lock()
_reported: set[str] = set()


def _report_skipped(skipped: SkippedSegment) -> None:
    """Log a segment that sweeping skipped, once per name in this process (every engine start
    sweeps; a co-tenant's segment stays there)."""
    with _reported_lock:
        if skipped.name in _reported:
            return
        _reported.add(skipped.name)
    log.warning(
        "kvoffload: %s/%s is not ours to remove (%s, mode %04o); left alone. Its owner removes it "
        "(`kvoffload sweep` as that user); `kvoffload sweep --list` shows it",
        SHM_DIR,
        skipped.name,
        skipped.reason,
        skipped.mode,
    )


def _remove_if_stale(name: str) -> bool | SkippedSegment:
    """Unlink arena segment ``name`` if it is ours and its owner is dead.

    Returns True if it was removed, False if it stays (a live owner, a segment still being
    created, gone meanwhile), or a :class:`SkippedSegment` for one this process may not touch.
    """
    try:
        fd = _open_segment(name)
    except FileNotFoundError:
        return False
    except ArenaError:
        return SkippedSegment(name, -1, 0, "not a valid segment name")
    except OSError as e:
        return _unopenable(name, e)
    try:
        st = os.fstat(fd)
        why = _not_ours(st)
        if why is not None:
            return SkippedSegment(name, st.st_uid, stat.S_IMODE(st.st_mode), why)
        if _owner_alive(fd):
            return False
        header = _read_header(fd)
        if header is None or header[2] != _STATE_READY:
            # A creator between shm_open and flock looks unlocked for a few microseconds: only a
            # segment that stayed unready for a long time is abandoned.
            age = time.time() - st.st_mtime
            if age < _STALE_INIT_AGE_S:
                return False
        # Hold the lock while unlinking so a concurrent sweeper cannot race us onto a new segment.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_inode(name, fd):
            return False
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(_posix_name(name))
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            return SkippedSegment(name, -1, 0, os.strerror(e.errno).lower())
        return False
    except posix_ipc.PermissionsError:
        return SkippedSegment(name, -1, 0, "permission denied")
    finally:
        os.close(fd)


def _headerless(name: str, size: int, uid: int, mode: int, ours: bool, alive: bool) -> ArenaInfo:
    """An :class:`ArenaInfo` without a header: not read (another user's) or not an arena's."""
    return ArenaInfo(
        name=name,
        owner_pid=0,
        created_ns=0,
        num_slots=0,
        row_bytes=0,
        nonce=b"",
        engine_id="",
        ready=False,
        size_bytes=size,
        owner_alive=alive,
        uid=uid,
        mode=mode,
        ours=ours,
    )


def list_arenas(prefix: str = NAME_PREFIX) -> list[ArenaInfo]:
    """Headers of every arena segment in /dev/shm whose name starts with ``prefix``.

    Another user's segment (or one that cannot be opened) is listed with ``ours`` False, its
    owner uid, mode and size, and no header: it is not read or locked.
    """
    out: list[ArenaInfo] = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.startswith(prefix):
            continue
        try:
            fd = _open_segment(name)
        except (FileNotFoundError, ArenaError):
            continue
        except OSError as e:
            skipped = _unopenable(name, e)
            try:  # its size is in the directory entry, readable without opening it
                size = os.lstat(os.path.join(SHM_DIR, name)).st_size
            except OSError:
                size = 0
            out.append(_headerless(name, size, skipped.uid, skipped.mode, False, False))
            continue
        try:
            st = os.fstat(fd)
            mode = stat.S_IMODE(st.st_mode)
            if _not_ours(st) is not None:
                out.append(_headerless(name, st.st_size, st.st_uid, mode, False, False))
                continue
            header = _read_header(fd)
            alive = _owner_alive(fd)
        finally:
            os.close(fd)
        if header is None:
            out.append(_headerless(name, st.st_size, st.st_uid, mode, True, alive))
            continue
        _, _, state, pid, created, num_slots, row_bytes, nonce, engine = header
        out.append(
            ArenaInfo(
                name=name,
                owner_pid=pid,
                created_ns=created,
                num_slots=num_slots,
                row_bytes=row_bytes,
                nonce=nonce,
                engine_id=engine,
                ready=state == _STATE_READY,
                size_bytes=st.st_size,
                owner_alive=alive,
                uid=st.st_uid,
                mode=mode,
            )
        )
    return out


def sweep_report(prefix: str = NAME_PREFIX) -> SweepReport:
    """Remove every arena segment under ``prefix`` that is ours and whose owner process is dead;
    skip (and log, once per name in this process) those this process may not touch.

    Liveness is the owner's ``flock``, which the kernel releases when the owner dies (SIGKILL
    included), so a live instance's segment is never touched and PID reuse cannot fool it.
    Another user's segment, or one that cannot be opened, locked or unlinked, is skipped, never
    an error: an engine's start is not stopped by what a co-tenant left in /dev/shm (CASES C44).
    """
    report = SweepReport()
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return report
    for name in names:
        if not name.startswith(prefix):
            continue
        done = _remove_if_stale(name)
        if isinstance(done, SkippedSegment):
            report.skipped.append(done)
            _report_skipped(done)
        elif done:
            report.removed.append(name)
    return report


def sweep(prefix: str = NAME_PREFIX) -> list[str]:
    """Remove every arena segment under ``prefix`` whose owner process is dead, as
    :func:`sweep_report` does (skipping, with a log line, those not ours).

    Returns:
        The names removed.
    """
    return sweep_report(prefix).removed


class Arena:
    """A mapped host arena: ``num_slots`` rows of ``row_bytes`` (a page multiple) after a header page.

    Use :meth:`create` in the owning engine process and :meth:`attach` everywhere else. ``close()``
    unmaps (and, for the owner, unlinks the name); views handed out earlier keep their pages mapped
    until they are garbage-collected.
    """

    def __init__(
        self,
        name: str,
        shm_fd: int,
        mm: mmap.mmap,
        num_slots: int,
        row_bytes: int,
        nonce: bytes,
        owner: bool,
    ):
        self.name = name
        self.num_slots = num_slots
        self.row_bytes = row_bytes
        self.nonce = nonce
        self.owner = owner
        self._fd: int | None = shm_fd if owner else None
        self._mmap: mmap.mmap | None = mm
        self.rows: np.ndarray = np.frombuffer(
            mm, dtype=np.uint8, count=num_slots * row_bytes, offset=HEADER_BYTES
        ).reshape(num_slots, row_bytes)
        """Zero-copy ``(num_slots, row_bytes)`` uint8 view of the slots; keeps the mapping alive."""
        self.device_stats: np.ndarray = np.frombuffer(
            mm,
            dtype=np.float64,
            count=DEVICE_STATS_RANKS * DEVICE_STATS_FIELDS,
            offset=DEVICE_STATS_OFFSET,
        ).reshape(DEVICE_STATS_RANKS, DEVICE_STATS_FIELDS)
        """``(64, 4)`` float64 view in the header page: per TP rank, accelerator <-> host
        ``(load bytes, load seconds, store bytes, store seconds)``. A rank adds to its own row only;
        the scheduler reads the column sums for ``kvoffload_device_transfer_*``."""

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        name: str,
        num_slots: int,
        row_bytes: int,
        engine_id: str = "",
        size_hint_key: str = "cpu_bytes_to_use",
        janitor: bool = True,
    ) -> Arena:
        """Create and own a new arena, reserving ``HEADER_BYTES + num_slots * row_bytes`` bytes.

        A segment of the same name whose owner is dead is removed first; one whose owner lives
        raises :class:`ArenaBusyError`.

        Args:
            name: /dev/shm file name (no slash).
            num_slots: number of slots (rows), > 0.
            row_bytes: bytes per slot, a positive multiple of the page size.
            engine_id: recorded in the header for ``kvoffload sweep --list``.
            size_hint_key: the configuration key to name when /dev/shm is too small.
            janitor: start a detached janitor process (``kvoffload.ipc.janitor``) that removes
                the segment if this process dies without closing it, SIGKILL included.

        Raises:
            ArenaSpaceError: /dev/shm cannot hold the arena (checked before any byte is written).
            ArenaBusyError: ``name`` belongs to a live owner.
            ArenaForeignError: ``name`` exists and is not this user's (or not mode 0600).
            ArenaError: invalid shape or name.
        """
        if num_slots <= 0:
            raise ArenaError(f"arena {name!r}: num_slots must be > 0, got {num_slots}")
        if row_bytes <= 0 or row_bytes % PAGE_BYTES:
            raise ArenaError(
                f"arena {name!r}: row_bytes must be a positive multiple of {PAGE_BYTES}, got {row_bytes}"
            )
        total = HEADER_BYTES + num_slots * row_bytes
        pname = _posix_name(name)
        _remove_if_stale(name)
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
        if total > free:
            raise ArenaSpaceError(
                f"{size_hint_key}: the host arena needs {total / 2**30:.2f} GiB but {SHM_DIR} has "
                f"{free / 2**30:.2f} GiB free; lower {size_hint_key} or enlarge {SHM_DIR}"
            )
        try:
            shm = posix_ipc.SharedMemory(pname, posix_ipc.O_CREX, mode=ARENA_MODE)
        except posix_ipc.ExistentialError:
            _refuse_foreign(name)
            info = next((a for a in list_arenas(name) if a.name == name), None)
            pid = info.owner_pid if info else "?"
            raise ArenaBusyError(
                f"arena {name!r} is in use by a live process (pid {pid}); choose another arena_name "
                f"or stop that engine"
            ) from None
        fd = shm.fd
        try:
            os.fchmod(fd, ARENA_MODE)  # exactly 0600 whatever the umask: what attachers require
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ArenaSpaceError(
                        f"{size_hint_key}: could not reserve {total / 2**30:.2f} GiB in {SHM_DIR} "
                        f"({os.strerror(e.errno)}); lower {size_hint_key} or enlarge {SHM_DIR}"
                    ) from None
                raise
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            nonce = secrets.token_bytes(16)
            header = _HEADER.pack(
                _MAGIC,
                _VERSION,
                _STATE_INIT,
                os.getpid(),
                time.time_ns(),
                num_slots,
                row_bytes,
                nonce,
                engine_id.encode("utf-8")[:128],
            )
            mm[: _HEADER.size] = header
            # Publish readiness last: attachers wait for it.
            mm[8:16] = struct.pack("<II", _VERSION, _STATE_READY)
        except BaseException:
            with contextlib.suppress(Exception):
                posix_ipc.unlink_shared_memory(pname)
            os.close(fd)
            raise
        arena = cls(name, fd, mm, num_slots, row_bytes, nonce, owner=True)
        ref = weakref.ref(arena)

        def _close_at_exit() -> None:
            a = ref()
            if a is not None:
                a.close()

        atexit.register(_close_at_exit)
        if janitor:
            _spawn_janitor(name, nonce)
        return arena

    @classmethod
    def attach(
        cls,
        name: str,
        nonce: bytes | None = None,
        timeout_s: float = 30.0,
        engine_id: str | None = None,
    ) -> Arena:
        """Map an existing arena by name, only if it is provably this engine's (CASES C44).

        The segment is checked on the opened descriptor (no second look by name): this process's
        uid, mode 0600, a ready header of this version, a live owner lock, and the ``nonce`` or
        ``engine_id`` given.

        Args:
            name: the arena's /dev/shm file name.
            nonce: when given, the header must carry this nonce (guards against a stale segment
                that reuses the name).
            timeout_s: how long to wait for a segment that is still being initialized (seconds).
            engine_id: when given (and not empty), the header must name this engine: another
                engine of this user that uses the same ``arena_name`` is not attached.

        Raises:
            ArenaForeignError: another user's segment, one not mode 0600, or another engine's
                (the message names its owner uid and mode, and what to do).
            ArenaError: missing segment, bad header, nonce mismatch or a dead owner.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = _open_segment(name)
            except FileNotFoundError:
                raise ArenaError(f"arena {name!r} does not exist in {SHM_DIR}") from None
            except OSError as e:
                skipped = _unopenable(name, e)
                raise _foreign_error(name, skipped.uid, skipped.mode, skipped.reason) from None
            try:
                _check_attachable(name, fd)
                header = _read_header(fd)
                if header is not None and header[2] == _STATE_READY:
                    _, _, _, pid, _, num_slots, row_bytes, hnonce, hengine = header
                    if nonce is not None and hnonce != nonce:
                        raise ArenaError(
                            f"arena {name!r} was recreated (nonce mismatch); not attaching"
                        )
                    if engine_id and hengine != _header_engine_id(engine_id):
                        raise ArenaForeignError(
                            f"arena {name!r} belongs to engine {hengine!r} (pid {pid}), not to "
                            f"this engine ({engine_id!r}): two engines use one arena_name; give "
                            f"each engine its own (or leave arena_name unset: it is derived from "
                            f"the engine id)"
                        )
                    if not _owner_alive(fd):
                        raise ArenaError(
                            f"arena {name!r}: its owner (pid {pid}) is dead; not attaching"
                        )
                    total = HEADER_BYTES + num_slots * row_bytes
                    if os.fstat(fd).st_size < total:
                        raise ArenaError(f"arena {name!r} is truncated")
                    mm = mmap.mmap(
                        fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
                    )
                    return cls(name, fd, mm, num_slots, row_bytes, hnonce, owner=False)
            finally:
                os.close(fd)
            if time.monotonic() > deadline:
                raise ArenaError(f"arena {name!r} did not become ready within {timeout_s:.0f} s")
            time.sleep(0.005)

    @classmethod
    def open_or_create(
        cls,
        name: str,
        num_slots: int,
        row_bytes: int,
        engine_id: str = "",
        size_hint_key: str = "cpu_bytes_to_use",
    ) -> Arena:
        """Attach to ``name`` if a live owner of this engine has it, else create it (the caller
        becomes owner).

        Used where several processes of one engine race to open the engine's arena and any of them
        may come first (vLLM: the model runner creates it, the scheduler attaches). The shape must
        match the existing segment, and its header must name ``engine_id`` (when not empty).

        Raises:
            ArenaForeignError: a segment of that name that is not this engine's (another user's,
                not mode 0600, another engine's): the start fails, nothing is mapped.
            ArenaError: shape mismatch, or the errors of :meth:`create` / :meth:`attach`.
        """
        for _ in range(50):
            try:
                arena = cls.create(name, num_slots, row_bytes, engine_id, size_hint_key)
                return arena
            except ArenaBusyError:
                pass
            try:
                arena = cls.attach(name, engine_id=engine_id or None)
            except ArenaForeignError:
                raise
            except ArenaError:
                time.sleep(0.01)  # the owner died or unlinked between our two calls: retry
                continue
            if (arena.num_slots, arena.row_bytes) != (num_slots, row_bytes):
                shape = (arena.num_slots, arena.row_bytes)
                arena.close()
                raise ArenaError(
                    f"arena {name!r} exists with shape {shape}, expected {(num_slots, row_bytes)}"
                )
            return arena
        raise ArenaError(f"arena {name!r}: could not create or attach")

    # -- views --------------------------------------------------------------------------------

    def memoryview(self) -> memoryview:
        """Zero-copy 2-D memoryview ``(num_slots, row_bytes)`` of the slots; ``strides[0]`` is the
        row size in bytes."""
        return memoryview(self.rows)  # type: ignore[arg-type]  # ndarray exports the buffer protocol

    def populate(self, step_bytes: int = 64 << 20) -> bool:
        """Map every slot's pages writable in this process now (``MADV_POPULATE_WRITE``, Linux
        5.14+), ``step_bytes`` at a time, instead of one page fault per 4 KiB page on first use:
        a process that reads files into the slots (a tier's reader) otherwise takes a fault per
        page the first time its I/O lands in each row. Returns False where the kernel refuses
        (older kernels: EINVAL) or the arena was closed meanwhile; nothing else changes then."""
        total = self.num_slots * self.row_bytes
        done = 0
        while done < total:
            mm = self._mmap
            if mm is None:
                return False
            n = min(step_bytes, total - done)
            try:
                mm.madvise(_MADV_POPULATE_WRITE, HEADER_BYTES + done, n)
            except (OSError, ValueError):
                return False
            done += n
        return True

    def torch_rows(self):
        """Zero-copy ``(num_slots, row_bytes)`` int8 torch tensor of the slots (imports torch)."""
        import torch

        return torch.from_numpy(self.rows.view(np.int8))

    def base_address(self) -> int:
        """Virtual address of slot 0 in this process."""
        return self.rows.ctypes.data

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap; the owner also unlinks the name and releases its lock. Idempotent."""
        if self.owner and self._fd is not None:
            if _same_inode(self.name, self._fd):
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory(_posix_name(self.name))
        mm, self._mmap = self._mmap, None
        self.rows = np.empty((0, self.row_bytes), dtype=np.uint8)
        self.device_stats = np.zeros((DEVICE_STATS_RANKS, DEVICE_STATS_FIELDS))
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views still exported: the mapping goes when the last one is collected
        if self._fd is not None:
            os.close(self._fd)  # drops the owner lock
            self._fd = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (the mapping is gone; views must not be used)."""
        return self._mmap is None

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return f"Arena({self.name!r}, {self.num_slots} x {self.row_bytes} B, {role})"


def unlink_if_orphaned(name: str, nonce: bytes, wait_s: float = 0.0) -> bool:
    """Called by a tier worker whose engine process died: unlink ``name`` once no owner holds it,
    if it is still the arena with ``nonce`` and ours (another user's segment that took the name
    is left alone).

    The owner may be another process of the same engine (vLLM's model runner creates the arena, the
    scheduler spawns the tier workers) that dies a moment later, so this waits up to ``wait_s``
    seconds for the owner to go. Returns True if the segment was removed.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = _open_segment(name)
        except (OSError, ArenaError):
            return False  # gone, or not ours to open
        try:
            if _not_ours(os.fstat(fd)) is not None:
                return False
            header = _read_header(fd)
            if header is None or header[7] != nonce:
                return False
            alive = _owner_alive(fd)
        except OSError:
            return False
        finally:
            os.close(fd)
        if not alive:
            return _remove_if_stale(name) is True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _spawn_janitor(name: str, nonce: bytes) -> None:
    """Start the detached process that unlinks arena ``name`` once this process (its owner) is
    gone. Returns when the janitor has detached (its first process exits at once). It gets only
    :data:`kvoffload.ipc.childenv.BASE_ENV` of this process's environment: no secret."""
    import subprocess
    import sys

    import psutil

    me = psutil.Process()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kvoffload.ipc.janitor",
            name,
            nonce.hex(),
            str(me.pid),
            repr(me.create_time()),
        ],
        env=child_environment(),
        stdin=subprocess.DEVNULL,
        close_fds=True,
        check=False,
    )
