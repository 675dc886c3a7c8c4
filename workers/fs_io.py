"""Filesystem tier I/O, run inside tier worker processes: arena slot ↔ one file per chunk.

::

    <root_dir>/<namespace id>/config.json          namespace fields (written by the engine at start)
    <root_dir>/<namespace id>/<hh>/<hh>/<key hex>.kv   header page + payload (see chunkfile.py)

- Stores write a temporary file in the chunk's own directory, named apart from every other writer's
  (PID plus a random tag: PIDs repeat across containers), then ``rename`` it over the final name:
  readers see the whole chunk or nothing, and two instances writing the same chunk at once are both
  safe (the last rename wins; the bytes are the same). A chunk already on disk is not rewritten.
- Transfers bypass the page cache (O_DIRECT) as configured. A filesystem that refuses it with
  EINVAL, at the open (some create the file first, CASES C31) or at the first aligned read or
  write, gets that transfer redone with buffered I/O, and so does every later one of this worker;
  logged once per worker with the filesystem, counted as ``direct_io_fallbacks``, never a failure.
- Loads read the header, check it, read the payload straight into the arena slot and verify its
  checksum. Verified corruption (short file, wrong header, bad checksum) removes the file; transient
  errors (EIO, EINTR, ...) leave it alone.
- Scans list the namespace's chunks for capacity accounting and remove orphaned temporary files.
  A temporary file is an orphan when it was last written more than ``stale_temp_age_s`` ago (default
  one hour, at least 10x the job deadline): a live writer renames or removes its file within its job
  deadline, so an older one has no writer left. Age is the only test (CASES C29): the writer's PID
  in the name means nothing to an instance in another PID namespace (container) or on another host
  sharing the directory, where that PID may be free or belong to an unrelated process.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import secrets
import sys
import threading
import time
from collections.abc import Iterator

import psutil

from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import counters
from kvoffload.workers.chunkio import OK_EMPTY, IOOutcome
from kvoffload.workers.faults import Faults
from kvoffload.workers.ioconfig import STALE_TEMP_AGE_S, FsIOConfig

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
IO_CONFIG = FsIOConfig
"""This module's I/O config (tag ``fs``): what :func:`make_io` takes."""


def stale_temp_age_s(job_timeout_s: float) -> float:
    """The orphan age (seconds) for a tier whose jobs time out after ``job_timeout_s`` seconds:
    :data:`STALE_TEMP_AGE_S`, or 10x the job deadline when that is longer."""
    return max(STALE_TEMP_AGE_S, 10.0 * job_timeout_s)


def temp_tag() -> str:
    """``<pid>-<8 random hex digits>``: the part of a temporary file's name that keeps one writer's
    names apart from every other's. The PID alone does not: writers in two containers (PID
    namespaces) sharing a root often have the same PID, and would open the same temporary file."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def is_temp_name(name: str) -> bool:
    """True for the name of a temporary file of the fs tier: a chunk being written
    (``.<key hex>.<tag>.<n>.tmp``), a namespace ``config.json.<tag>.tmp`` or a
    ``.write-test.<tag>.tmp`` probe (``<tag>``: :func:`temp_tag`)."""
    return name.endswith(cf.TMP_SUFFIX)


def remove_if_stale(path: str, mtime: float, now: float, older_than_s: float) -> bool:
    """Unlink the temporary file ``path`` if it was last written (``mtime``, seconds since the
    epoch) more than ``older_than_s`` seconds before ``now``. Returns True if this call removed it
    (False when it is younger, or already gone: its writer renamed it, or another sweep won)."""
    if now - mtime <= older_than_s:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def filesystem_of(path: str) -> str:
    """``"<fstype> on <mount point> (<device>)"`` for the filesystem holding ``path``, for log
    lines; ``"filesystem unknown"`` when the mount table cannot tell."""
    real = os.path.realpath(path)
    try:
        parts = psutil.disk_partitions(all=True)
    except (OSError, psutil.Error):
        parts = []
    best = None
    for p in parts:
        mp = p.mountpoint.rstrip("/") or "/"
        if (real == mp or real.startswith(mp + "/") or mp == "/") and (
            best is None or len(mp) > len(best.mountpoint.rstrip("/") or "/")
        ):
            best = p
    if best is None:
        return "filesystem unknown"
    return f"{best.fstype} on {best.mountpoint} ({best.device})"


def namespace_files(ns_dir: str) -> Iterator[os.DirEntry]:
    """Every file of one namespace directory, streamed (``os.scandir``; nothing is collected): its
    own files (``config.json``, temporary files), then those of each shard directory ``<hh>/<hh>/``.
    A file may be gone by the time the caller stats it.

    Raises:
        FileNotFoundError: ``ns_dir`` does not exist.
        PermissionError: a directory cannot be listed.
    """
    yield from _files_below(ns_dir, shard_levels=2, missing_ok=False)


def _files_below(path: str, shard_levels: int, missing_ok: bool = True) -> Iterator[os.DirEntry]:
    """The files in ``path`` and, ``shard_levels`` directories deep, below it; a shard directory
    removed meanwhile is skipped (``missing_ok``)."""
    try:
        entries = os.scandir(path)
    except FileNotFoundError:
        if missing_ok:
            return
        raise
    with entries:
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                yield e
            elif shard_levels > 0:
                yield from _files_below(e.path, shard_levels - 1)


class FsIO:
    """:class:`~kvoffload.workers.chunkio.ChunkIO` over one file per chunk (module docstring)."""

    def __init__(self, config: FsIOConfig, faults: Faults):
        self.cfg = config
        self.faults = faults
        self.ns_bytes = bytes.fromhex(config.namespace_id)
        self.ns_dir = os.path.join(config.root_dir, config.namespace_id)
        self.file_bytes = cf.HEADER_BYTES + config.row_bytes
        self._dirs: set[str] = set()
        self._tmp_counter = itertools.count()
        self._tmp_tag = temp_tag()
        # Page-aligned scratch for headers (O_DIRECT needs aligned buffers), one per I/O thread.
        self._local = threading.local()
        self._direct_reads = config.direct_io in ("reads", "both")
        self._direct_writes = config.direct_io in ("writes", "both")
        self._fallback_lock = threading.Lock()

    def _scratch(self) -> tuple[memoryview, memoryview]:
        """This thread's page-aligned scratch: the header page, and one page more that a load
        reads past a chunk file's end into (a longer file fills it)."""
        pages = getattr(self._local, "pages", None)
        if pages is None:
            buf = mmap.mmap(-1, 2 * cf.HEADER_BYTES)
            view = memoryview(buf)
            pages = self._local.pages = (view[: cf.HEADER_BYTES], view[cf.HEADER_BYTES :])
        return pages

    def path(self, key: bytes) -> str:
        """The chunk file of ``key`` (under the namespace directory, fanned out by key prefix)."""
        return os.path.join(self.ns_dir, cf.relative_name(key))

    # -- store ---------------------------------------------------------------------------------

    def store(self, key: bytes, src: memoryview) -> IOOutcome:
        """Write one chunk; ``nbytes``: file bytes written (0 when it was already there)."""
        final = self.path(key)
        if os.path.exists(final):
            counters.count(names.STORE_ALREADY_PRESENT)
            return OK_EMPTY
        if self.cfg.min_free_bytes and self._below_floor():
            counters.count(names.BELOW_FREE_FLOOR)
            return IOOutcome(
                m.NO_SPACE,
                0,
                (
                    f"store {key.hex()[:16]}: free space on "
                    f"{self.cfg.root_dir} below the tier's floor "
                    f"({self.cfg.min_free_bytes} bytes)"
                ),
            )
        tmp = None
        try:
            self.faults.hit("before_read_slot", key)
            header = cf.build_header(self.ns_bytes, key, src)
            d = os.path.dirname(final)
            if d not in self._dirs:
                try:  # the leaf alone first: its parent usually exists (one syscall, not two)
                    os.mkdir(d)
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    os.makedirs(d, exist_ok=True)
                self._dirs.add(d)
            tmp = os.path.join(
                d, f".{key.hex()}.{self._tmp_tag}.{next(self._tmp_counter)}{cf.TMP_SUFFIX}"
            )
            self._write_new_file(tmp, key, header, src)
            self.faults.hit("before_publish", key)
            os.rename(tmp, final)
            tmp = None
            if self.cfg.fsync:
                dfd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return IOOutcome(m.OK, self.file_bytes)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            code = m.NO_SPACE if e.errno in _NO_SPACE_ERRNOS else m.IO_ERROR
            if e.errno == errno.ENOENT:
                self._dirs.discard(os.path.dirname(final))
            return IOOutcome(code, 0, f"store {key.hex()[:16]}: {e}")

    def _write_new_file(self, tmp: str, key: bytes, header: bytes, src: memoryview) -> None:
        """Create ``tmp`` (O_EXCL) holding ``header`` + ``src``, through O_DIRECT while the
        filesystem takes it. A filesystem that refuses O_DIRECT with EINVAL, at the open (some
        create the file first: CASES C31) or at the first aligned write, gets the chunk written
        again with buffered I/O, from a fresh file under the same name: the name is this writer's
        own (:func:`temp_tag`), so removing what the refused attempt left is safe."""
        hbuf = self._scratch()[0]
        hbuf[:] = header  # aligned copy: O_DIRECT needs aligned buffers
        direct = self._direct_writes
        while True:
            try:
                fd = (
                    self._open_direct_write(tmp, key)
                    if direct
                    else os.open(tmp, _WRITE_FLAGS, 0o644)
                )
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self._direct_refused("writes", "the open", e, leftover=tmp)
                direct = False
                continue
            try:
                if direct:
                    self.faults.hit("direct_write", key)
                _write_all(fd, [hbuf, src])
                if self.cfg.fsync:
                    os.fsync(fd)
                return
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                os.close(fd)
                fd = -1
                self._direct_refused("writes", "an aligned write", e, leftover=tmp)
                direct = False
            finally:
                if fd >= 0:
                    os.close(fd)

    def _open_direct_write(self, tmp: str, key: bytes) -> int:
        fd = os.open(tmp, _WRITE_FLAGS | os.O_DIRECT, 0o644)
        try:
            self.faults.hit("direct_open_created", key)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _direct_refused(
        self, transfers: str, where: str, exc: OSError, leftover: str | None = None
    ) -> None:
        """The filesystem refused O_DIRECT ``transfers`` (``reads`` / ``writes``) at ``where``:
        remove the refused attempt's file ``leftover`` (ours) and use buffered I/O from now on,
        logged once per worker with the filesystem and counted as ``direct_io_fallbacks``."""
        if leftover is not None:
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        with self._fallback_lock:
            attr = f"_direct_{transfers}"
            first = getattr(self, attr)
            setattr(self, attr, False)
        if first:
            counters.count(names.DIRECT_IO_FALLBACKS)
            print(
                f"kvoffload fs tier worker (pid {os.getpid()}): {self.cfg.root_dir} "
                f"({filesystem_of(self.cfg.root_dir)}) refuses O_DIRECT {transfers} "
                f"({where} failed: {exc}); using buffered {transfers}",
                file=sys.stderr,
                flush=True,
            )

    def _below_floor(self) -> bool:
        """True when writing one more chunk file would leave less than ``min_free_bytes`` free
        (``f_bavail``: what an unprivileged writer may still use) on the tier's filesystem."""
        try:
            st = os.statvfs(self.ns_dir)
        except OSError:
            return False  # the write itself will tell
        return st.f_bavail * st.f_frsize - self.file_bytes < self.cfg.min_free_bytes

    # -- load ----------------------------------------------------------------------------------

    def load(self, key: bytes, dst: memoryview) -> IOOutcome:
        """Read one chunk into ``dst`` (an arena row), verified; ``nbytes``: file bytes read."""
        path = self.path(key)
        direct = self._direct_reads
        while True:
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError:
                return IOOutcome(m.MISSING, 0, f"{key.hex()[:16]}: missing")
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._direct_refused("reads", "the open", e)
                    direct = False
                    continue
                return IOOutcome(m.IO_ERROR, 0, f"open {key.hex()[:16]}: {e}")
            try:
                if direct:
                    self.faults.hit("direct_read", key)
                return self._read_chunk(fd, path, key, dst)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._direct_refused("reads", "an aligned read", e)
                    direct = False
                    continue
                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}")
            finally:
                os.close(fd)

    def _read_chunk(self, fd: int, path: str, key: bytes, dst: memoryview) -> IOOutcome:
        """Header and payload in one read (one I/O: the header page lands in this thread's
        scratch, the payload straight in the arena row), one page past the end to see a longer
        file, then the header and the payload checksum verified."""
        self.faults.hit("after_metadata_before_read", key)
        self.faults.hit("read_payload", key)
        head, tail = self._scratch()
        n = os.preadv(fd, [head, memoryview(dst).cast("B"), tail], 0)
        if n != self.file_bytes:
            size = os.fstat(fd).st_size
            if size == self.file_bytes:  # a short read of a whole file: not the file's fault
                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {n} of {size} bytes")
            self._remove_corrupt(path, fd)
            return IOOutcome(
                m.CORRUPT, 0, f"{key.hex()[:16]}: size {size}, expected {self.file_bytes}"
            )
        try:
            checksum = cf.parse_header(head.tobytes(), self.ns_bytes, key, self.cfg.row_bytes)
        except cf.ChunkFormatError as e:
            self._remove_corrupt(path, fd)
            return IOOutcome(m.CORRUPT, 0, f"{key.hex()[:16]}: {e}")
        if cf.payload_checksum(dst) != checksum:
            self._remove_corrupt(path, fd)
            return IOOutcome(m.CORRUPT, 0, f"{key.hex()[:16]}: checksum mismatch")
        return IOOutcome(m.OK, self.file_bytes)

    @staticmethod
    def _remove_corrupt(path: str, fd: int) -> None:
        """Unlink ``path`` if it is still the file we verified (a writer may have replaced it)."""
        counters.count(names.CORRUPT_REMOVED)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass

    # -- probe / delete / scan ---------------------------------------------------------------

    def probe(self, key: bytes) -> IOOutcome:
        """``OK`` when ``key``'s chunk file exists, ``MISSING`` when not (ChunkIO)."""
        self.faults.hit("probe_key", key)
        try:
            os.stat(self.path(key))
            return OK_EMPTY
        except FileNotFoundError:
            return IOOutcome(m.MISSING)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"probe {key.hex()[:16]}: {e}")

    def delete(self, key: bytes) -> IOOutcome:
        """Remove one chunk file (a missing file is not an error). A removal that failed (EPERM
        on an immutable file, EBUSY on a network filesystem, EROFS after a read-only remount...)
        answers ``IO_ERROR`` with its errno as ``status``, so the tier keeps counting the file
        that is still there (CASES C32)."""
        try:
            self.faults.hit("unlink", key)
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"delete {key.hex()[:16]}: {e}", e.errno or 0)
        return OK_EMPTY

    def scan(self) -> list[tuple[bytes, int, float]]:
        """``(key, bytes, mtime)`` of every chunk of the namespace; removes orphaned temporary files
        on the way (counted as ``stale_temp_removed``)."""
        entries: list[tuple[bytes, int, float]] = []
        now = time.time()
        try:
            for f in namespace_files(self.ns_dir):
                self._scan_file(f, now, entries)
        except FileNotFoundError:
            pass
        return entries

    def _scan_file(self, f: os.DirEntry, now: float, entries: list) -> None:
        name = f.name
        try:
            st = f.stat(follow_symlinks=False)
        except OSError:
            return
        if is_temp_name(name):
            if remove_if_stale(f.path, st.st_mtime, now, self.cfg.stale_temp_age_s):
                counters.count(names.STALE_TEMP_REMOVED)
            return
        key = cf.key_from_name(name)
        if key is not None:
            entries.append((key, st.st_size, st.st_mtime))


def _write_all(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    offset = 0
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def make_io(config: FsIOConfig, faults: Faults) -> FsIO:  # a chunkio.MakeIO
    """Entry point the worker calls with the tier's I/O config (decoded from
    ``WorkerSpec.io_config``)."""
    return FsIO(config, faults)
