"""Filesystem tier I/O, run inside tier worker processes: arena slot ↔ one file per chunk.

::

    <root_dir>/<namespace id>/config.json          namespace fields (written by the engine at start)
    <root_dir>/<namespace id>/<hh>/<hh>/<key hex>.kv   header page + payload (see chunkfile.py)

- Stores write a temporary file in the chunk's own directory, named apart from every other writer's
  (PID plus a random tag: PIDs repeat across containers), then ``rename`` it over the final name:
  readers see the whole chunk or nothing, and two instances writing the same chunk at once are both
  safe (the last rename wins; the bytes are the same). A chunk already on disk is not rewritten.
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
import threading
import time
from collections.abc import Iterator

import msgspec

from kvoffload.ipc import messages as m
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import counters
from kvoffload.workers.faults import Faults

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
STALE_TEMP_AGE_S = 3600.0
"""Default age (seconds since its last write) past which a temporary file is an orphan: 120x the
default job deadline, with room for a writer stalled in fsync on a network filesystem and for clock
skew between the hosts that share one (a file's mtime comes from the file server's clock)."""


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


class FsIOConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a worker needs to do filesystem-tier I/O.

    Attributes:
        root_dir: the tier's root directory.
        namespace_id: hex id of the namespace (its directory name).
        row_bytes: payload bytes per chunk (one arena row).
        fsync: fsync each chunk file and its directory before the chunk counts as stored.
        direct_io: which transfers bypass the page cache with O_DIRECT (where the filesystem
            supports it; otherwise they fall back to buffered I/O): ``none``, ``writes``, ``reads``
            or ``both``.
        stale_temp_age_s: scans remove temporary files last written longer ago than this
            (seconds); see :func:`stale_temp_age_s`.
    """

    root_dir: str
    namespace_id: str
    row_bytes: int
    fsync: bool = False
    direct_io: str = "both"
    stale_temp_age_s: float = STALE_TEMP_AGE_S


class FsIO:
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

    def _scratch(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = mmap.mmap(-1, cf.HEADER_BYTES)
        return buf

    def path(self, key: bytes) -> str:
        return os.path.join(self.ns_dir, cf.relative_name(key))

    # -- store ---------------------------------------------------------------------------------

    def store(self, key: bytes, src: memoryview) -> tuple[int, int, str]:
        """Write one chunk. Returns ``(code, bytes written, detail)``."""
        final = self.path(key)
        if os.path.exists(final):
            counters.count("store_already_present")
            return m.OK, 0, ""
        tmp = None
        try:
            self.faults.hit("before_read_slot", key)
            header = cf.build_header(self.ns_bytes, key, src)
            d = os.path.dirname(final)
            if d not in self._dirs:
                os.makedirs(d, exist_ok=True)
                self._dirs.add(d)
            tmp = os.path.join(
                d, f".{key.hex()}.{self._tmp_tag}.{next(self._tmp_counter)}{cf.TMP_SUFFIX}")
            fd = self._open_for_write(tmp)
            try:
                hbuf = self._scratch()
                hbuf[:] = header  # aligned copy: O_DIRECT needs aligned buffers
                _write_all(fd, [hbuf, src])
                if self.cfg.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.faults.hit("before_publish", key)
            os.rename(tmp, final)
            tmp = None
            if self.cfg.fsync:
                dfd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            return m.OK, self.file_bytes, ""
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            code = m.NO_SPACE if e.errno in _NO_SPACE_ERRNOS else m.IO_ERROR
            if e.errno == errno.ENOENT:
                self._dirs.discard(os.path.dirname(final))
            return code, 0, f"store {key.hex()[:16]}: {e}"

    # -- load ----------------------------------------------------------------------------------

    def load(self, key: bytes, dst: memoryview) -> tuple[int, int, str]:
        """Read one chunk into ``dst`` (an arena row). Returns ``(code, bytes read, detail)``."""
        path = self.path(key)
        try:
            fd = self._open_for_read(path)
        except FileNotFoundError:
            return m.MISSING, 0, f"{key.hex()[:16]}: missing"
        except OSError as e:
            return m.IO_ERROR, 0, f"open {key.hex()[:16]}: {e}"
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes:
                self._remove_corrupt(path, fd)
                return m.CORRUPT, 0, f"{key.hex()[:16]}: size {size}, expected {self.file_bytes}"
            hbuf = self._scratch()
            n = os.preadv(fd, [hbuf], 0)
            if n != cf.HEADER_BYTES:
                self._remove_corrupt(path, fd)
                return m.CORRUPT, 0, f"{key.hex()[:16]}: short header"
            try:
                checksum = cf.parse_header(hbuf[:], self.ns_bytes, key, self.cfg.row_bytes)
            except cf.ChunkFormatError as e:
                self._remove_corrupt(path, fd)
                return m.CORRUPT, 0, f"{key.hex()[:16]}: {e}"
            self.faults.hit("after_metadata_before_read", key)
            self.faults.hit("read_payload", key)
            n = _read_all(fd, dst, cf.HEADER_BYTES)
            if n != self.cfg.row_bytes:
                self._remove_corrupt(path, fd)
                return m.CORRUPT, 0, f"{key.hex()[:16]}: short payload ({n} bytes)"
            if cf.payload_checksum(dst) != checksum:
                self._remove_corrupt(path, fd)
                return m.CORRUPT, 0, f"{key.hex()[:16]}: checksum mismatch"
            return m.OK, self.file_bytes, ""
        except OSError as e:
            return m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}"
        finally:
            os.close(fd)

    def _open_for_read(self, path: str) -> int:
        if self._direct_reads:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_reads = False  # this filesystem refuses O_DIRECT
        return os.open(path, os.O_RDONLY)

    def _open_for_write(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self._direct_writes:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct_writes = False  # this filesystem refuses O_DIRECT
        return os.open(path, flags, 0o644)

    @staticmethod
    def _remove_corrupt(path: str, fd: int) -> None:
        """Unlink ``path`` if it is still the file we verified (a writer may have replaced it)."""
        counters.count("corrupt_removed")
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
        except OSError:
            pass

    # -- probe / delete / scan ---------------------------------------------------------------

    def probe(self, key: bytes) -> int:
        self.faults.hit("probe_key", key)
        try:
            os.stat(self.path(key))
            return m.OK
        except FileNotFoundError:
            return m.MISSING
        except OSError:
            return m.IO_ERROR

    def delete(self, key: bytes) -> int:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            counters.count_errno("eviction_errors", e)  # kvoffload_tier_eviction_errors_total
            return m.IO_ERROR
        return m.OK

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
                counters.count("stale_temp_removed")
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


def _read_all(fd: int, dst: memoryview, offset: int) -> int:
    view = memoryview(dst).cast("B")
    total = 0
    while total < view.nbytes:
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def make_io(config: dict, faults: Faults) -> FsIO:
    """Entry point the worker calls with the tier's ``io_config``."""
    return FsIO(msgspec.convert(config, FsIOConfig), faults)
