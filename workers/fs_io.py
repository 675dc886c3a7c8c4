"""Filesystem tier I/O, run inside tier worker processes: arena slot ↔ one file per chunk.

::

    <root_dir>/<namespace id>/config.json          namespace fields (written by the engine at start)
    <root_dir>/<namespace id>/<hh>/<hh>/<key hex>.kv   header page + payload (see chunkfile.py)

- Stores write a temporary file in the chunk's own directory, named apart from every other writer's
  (PID plus a random tag: PIDs repeat across containers), then ``rename`` it over the final name:
  readers see the whole chunk or nothing, and two instances writing the same chunk at once are both
  safe (the last rename wins; the bytes are the same). A chunk already on disk is not rewritten.
- Private by default (CASES C43): directories are created ``dir_mode`` (0700) and files
  ``file_mode`` (0600) exactly, whatever the umask (a ``fchmod`` where the umask would take bits
  away); a root shared with a group on purpose gets 2770 / 0660.
- Nothing inside the root is reached through a symbolic link (CASES C43): every operation opens
  the root (the engine resolved it once, so the operator's own link is fine), then the namespace
  and both shard directories one at a time with ``O_DIRECTORY | O_NOFOLLOW``, and touches the chunk
  or temporary file only relative to that last descriptor (``dir_fd``; ``O_NOFOLLOW`` on files),
  so nothing is checked by name and then used by name. A symbolic link met on the way is removed
  (unlinking a link follows nothing) and counted as ``symlinks_removed``; a store that meets one
  fails that key as ``UNSAFE_PATH``, a load is a miss (``UNSAFE_PATH``), a probe answers
  ``MISSING``. A chunk path that holds anything but a regular file is refused the same way.
- Transfers bypass the page cache (O_DIRECT) as configured. A filesystem that refuses it with
  EINVAL, at the open (some create the file first, CASES C31) or at the first aligned read or
  write, gets that transfer redone with buffered I/O, and so does every later one of this worker;
  logged once per worker with the filesystem, counted as ``direct_io_fallbacks``, never a failure.
- Loads check the file's size first (a file of any other size than header plus row is corrupt and
  is never read: CASES C45), read the header and the payload straight into the arena slot and
  verify both. Verified corruption (wrong size, wrong header, bad checksum) removes the file;
  transient errors (EIO, EINTR, ...) leave it alone. With an integrity key, a chunk whose MAC is
  missing or wrong is ``FORGED`` and removed; with an encryption key, so is one whose AES-GCM tag
  fails under a good checksum (the checksum covers the seal record too: damage there is corrupt).
- Scans list the namespace's chunks for capacity accounting and remove orphaned temporary files.
  A temporary file is an orphan when it was last written more than ``stale_temp_age_s`` ago (default
  one hour, at least 10x the job deadline): a live writer renames or removes its file within its job
  deadline, so an older one has no writer left. Age is the only test (CASES C29): the writer's PID
  in the name means nothing to an instance in another PID namespace (container) or on another host
  sharing the directory, where that PID may be free or belong to an unrelated process.
"""

from __future__ import annotations

import copy
import errno
import itertools
import mmap
import os
import secrets
import stat
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import psutil

from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import counters
from kvoffload.workers.chunkio import OK_EMPTY, OK_PRESENT, IOOutcome
from kvoffload.workers.chunkseal import TAG_BYTES, Sealer, unseal
from kvoffload.workers.faults import Faults
from kvoffload.workers.ioconfig import STALE_TEMP_AGE_S, FsIOConfig

_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How every directory inside a root is opened: never through a symbolic link (one opened this way
fails with ENOTDIR)."""
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at a chunk path opens at once (and is refused), never blocks the read.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
PRIVATE_MODES = (0o700, 0o600)
"""(directories, files) of a root private to the engine's user (the default)."""
GROUP_MODES = (0o2770, 0o660)
"""(directories, files) of a root shared with a group (``share_with_group``): setgid directories,
so what is created below keeps the root's group."""
IO_CONFIG = FsIOConfig
"""This module's I/O config (tag ``fs``): what :func:`make_io` takes."""


class UnsafePath(Exception):
    """Something other than the tier's own directory or regular file at a path inside a root: a
    symbolic link (removed, not followed) or a special file. The message names the path (relative
    to the root) and what was found there."""


def modes(share_with_group: bool) -> tuple[int, int]:
    """``(directory mode, file mode)`` the fs tier creates with: :data:`PRIVATE_MODES`, or
    :data:`GROUP_MODES` for a root shared with a group."""
    return GROUP_MODES if share_with_group else PRIVATE_MODES


def current_umask() -> int:
    """This process's umask, read without changing it (``/proc/self/status``; Linux >= 4.7),
    else by setting it and back (only before threads start)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def open_dir(
    parent_fd: int,
    name: str,
    *,
    where: str,
    create_mode: int | None = None,
    remove_links: bool = True,
) -> int:
    """Open directory ``name`` in directory ``parent_fd`` without following a symbolic link
    (:data:`DIR_FLAGS`); returns its descriptor (the caller closes it).

    Args:
        where: the directory's path relative to the root, for messages.
        create_mode: create the directory when it is missing, with exactly these permission bits
            (setgid included; a ``fchmod`` after ``mkdir``, so the umask cannot narrow them and
            the mode needs no second look by name); None: a missing directory raises.
        remove_links: remove a symbolic link found at ``name`` (counted as ``symlinks_removed``).

    Raises:
        FileNotFoundError: missing (and not created).
        UnsafePath: a symbolic link or anything else than a directory is there.
        OSError: the open or the creation failed otherwise.
    """
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if create_mode is None:
            raise
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _refuse(parent_fd, name, where, "directory", remove_links)
    try:
        os.mkdir(name, create_mode & 0o777, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        created = False  # made by another writer meanwhile (or something else is there)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        _refuse(parent_fd, name, where, "directory", remove_links)
    if created:
        try:
            os.fchmod(fd, create_mode)
        except BaseException:
            os.close(fd)
            raise
    return fd


def _refuse(parent_fd: int, name: str, where: str, belongs: str, remove_links: bool) -> NoReturn:
    """Raise :class:`UnsafePath` for what is at ``name`` in ``parent_fd`` instead of the tier's
    ``belongs`` (``directory``, ``chunk file``); a symbolic link is removed first when
    ``remove_links``."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise UnsafePath(f"{where}: replaced while it was opened") from None
    if not stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{where} is not a {belongs} (mode {stat.filemode(st.st_mode)})")
    if remove_links:
        try:
            os.unlink(name, dir_fd=parent_fd)
            counters.count(names.SYMLINKS_REMOVED)
        except OSError:
            pass
        raise UnsafePath(f"{where} was a symbolic link where a {belongs} belongs (removed)")
    raise UnsafePath(f"{where} is a symbolic link where a {belongs} belongs")


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


class NsFile:
    """One entry of a namespace directory (:func:`namespace_files`), named relative to its open
    directory, so it is looked at and removed without a path walk (nothing followed).

    Attributes:
        name: the file's name.
        path: its path (the namespace directory's path joined with its place below it), for
            messages and reports only.
        dir_fd: its directory, open while the iteration is at this entry.
    """

    __slots__ = ("_entry", "dir_fd", "path")

    def __init__(self, entry: os.DirEntry, dir_fd: int, path: str):
        self._entry = entry
        self.dir_fd = dir_fd
        self.path = path

    @property
    def name(self) -> str:
        """The file's name in its directory."""
        return self._entry.name

    def stat(self, follow_symlinks: bool = False) -> os.stat_result:
        """Its ``lstat`` (a symbolic link is never followed, whatever ``follow_symlinks`` says)."""
        return os.stat(self._entry.name, dir_fd=self.dir_fd, follow_symlinks=False)

    def unlink(self) -> None:
        """Remove it (a symbolic link itself, never what it points to)."""
        os.unlink(self._entry.name, dir_fd=self.dir_fd)


def remove_if_stale(f: NsFile, mtime: float, now: float, older_than_s: float) -> bool:
    """Unlink the temporary file ``f`` if it was last written (``mtime``, seconds since the
    epoch) more than ``older_than_s`` seconds before ``now``. Returns True if this call removed it
    (False when it is younger, or already gone: its writer renamed it, or another sweep won)."""
    if now - mtime <= older_than_s:
        return False
    try:
        f.unlink()
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


def namespace_files(ns_dir: str, tenants: bool = False) -> Iterator[NsFile]:
    """Every file of one namespace directory, streamed (``os.scandir``; nothing is collected): its
    own files (``config.json``, temporary files), then those of each shard directory ``<hh>/<hh>/``;
    with ``tenants``, also those of each tenant directory's (``t-<tenant id>/<hh>/<hh>/``).
    Directories are opened with ``O_NOFOLLOW`` and listed by descriptor: a symbolic link is listed
    as a file, never entered. A file may be gone by the time the caller stats it.

    Raises:
        FileNotFoundError: ``ns_dir`` does not exist.
        NotADirectoryError: ``ns_dir`` is a symbolic link or not a directory.
        PermissionError: a directory cannot be listed.
    """
    fd = os.open(ns_dir, DIR_FLAGS)
    try:
        yield from _files_below(fd, ns_dir, shard_levels=2, tenants=tenants)
    finally:
        os.close(fd)


def _files_below(
    dir_fd: int, path: str, shard_levels: int, tenants: bool = False
) -> Iterator[NsFile]:
    """The files in directory ``dir_fd`` (at ``path``) and, ``shard_levels`` directories deep,
    below it (``tenants``: a tenant directory here holds shard directories of its own); a shard
    directory removed or replaced meanwhile is skipped."""
    with os.scandir(dir_fd) as entries:
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                yield NsFile(e, dir_fd, os.path.join(path, e.name))
            elif shard_levels > 0:
                levels = shard_levels - 1
                if tenants and cf.tenant_from_dir(e.name) is not None:
                    levels = shard_levels
                try:
                    sub = os.open(e.name, DIR_FLAGS, dir_fd=dir_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                try:
                    yield from _files_below(sub, os.path.join(path, e.name), levels)
                finally:
                    os.close(sub)


class FsIO:
    """:class:`~kvoffload.workers.chunkio.ChunkIO` over one file per chunk (module docstring)."""

    def __init__(self, config: FsIOConfig, faults: Faults):
        self.cfg = config
        self.faults = faults
        self.ns_bytes = bytes.fromhex(config.namespace_id)
        self.root = config.root_dir  # resolved by the engine: no link of its own to follow
        self.ns_dir = os.path.join(config.root_dir, config.namespace_id)
        #: The directories from the root to the chunks' shard directories: the namespace's, and
        #: for a tenant's I/O (:meth:`for_tenant`) the tenant's below it.
        self._ns_parts: tuple[str, ...] = (config.namespace_id,)
        self.file_bytes = cf.HEADER_BYTES + config.row_bytes
        self._tmp_counter = itertools.count()
        self._tmp_tag = temp_tag()
        # The umask only ever takes bits away: fchmod new files only when it would.
        self._fchmod_files = config.file_mode & ~current_umask() != config.file_mode
        self._mac_key = (
            None
            if config.integrity_key_env is None
            else cf.mac_key(cf.secret_from_env(config.integrity_key_env))
        )
        self._sealer = (
            None
            if config.encryption_key_env is None
            else Sealer(
                cf.secret_from_env(config.encryption_key_env, "encryption_key_env"),
                config.namespace_id,
            )
        )
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

    def _sealed(self) -> memoryview:
        """This thread's page-aligned scratch for a sealed chunk: the row's ciphertext, then its
        tag (``row_bytes + TAG_BYTES`` bytes, in whole pages)."""
        buf = getattr(self._local, "sealed", None)
        if buf is None:
            size = -(-(self.cfg.row_bytes + TAG_BYTES) // cf.HEADER_BYTES) * cf.HEADER_BYTES
            buf = self._local.sealed = memoryview(mmap.mmap(-1, size))
        return buf

    def path(self, key: bytes) -> str:
        """The chunk file of ``key`` (under the namespace directory, fanned out by key prefix), for
        messages: the file is reached through :meth:`_chunk_dir`, never by this path."""
        return os.path.join(self.ns_dir, cf.relative_name(key))

    def _chunk_dir(self, key: bytes, create: bool) -> int:
        """The open directory of ``key``'s chunk file, reached from the root one directory at a
        time without following a link (:func:`open_dir`); with ``create``, missing directories are
        made (``dir_mode``). The caller closes it.

        Raises:
            FileNotFoundError: a directory is missing (and not created).
            UnsafePath: a symbolic link (removed) or something else than a directory on the way.
            OSError: otherwise.
        """
        a, b = cf.shard_dirs(key)
        mode = self.cfg.dir_mode if create else None
        fd = os.open(self.root, DIR_FLAGS)
        try:
            where = ""
            for name in (*self._ns_parts, a, b):
                where = f"{where}/{name}" if where else name
                sub = open_dir(fd, name, where=where, create_mode=mode)
                os.close(fd)
                fd = sub
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _unsafe(what: str, key: bytes, e: UnsafePath) -> IOOutcome:
        return IOOutcome(m.UNSAFE_PATH, 0, f"{what} {key.hex()[:16]}: {e} (nothing followed)")

    @staticmethod
    def _chunk_name(key: bytes) -> str:
        return f"{key.hex()}{cf.SUFFIX}"

    # -- store ---------------------------------------------------------------------------------

    def store(self, key: bytes, src: memoryview) -> IOOutcome:
        """Write one chunk; ``nbytes``: file bytes written (0 when it was already there)."""
        try:
            d = self._chunk_dir(key, create=True)
        except UnsafePath as e:
            return self._unsafe("store", key, e)
        except OSError as e:
            if e.errno in _NO_SPACE_ERRNOS:
                return self._no_space(e.errno, f"store {key.hex()[:16]}: {e}")
            return IOOutcome(m.IO_ERROR, 0, f"store {key.hex()[:16]}: {e}")
        try:
            return self._store_in(d, key, src)
        finally:
            os.close(d)

    def _no_space(self, err: int | None, detail: str) -> IOOutcome:
        """``NO_SPACE`` for a store that found no room (``err``: its errno; None: the free-space
        floor), with the bytes the filesystem shows free now, once the store's temporary file is
        gone (``f_bavail``: what an unprivileged writer may use), so the engine frees only what a
        real shortage needs and nothing for a transient error (CASES C52). 0 where the shortage
        does not show in ``statvfs``: a quota (EDQUOT), no inode left; -1 when ``statvfs``
        fails."""
        free = 0
        if err != errno.EDQUOT:
            try:
                st = os.statvfs(self.root)
            except OSError:
                free = -1
            else:
                out_of_inodes = st.f_files > 0 and st.f_favail == 0  # f_files 0: no inode limit
                free = 0 if out_of_inodes else st.f_bavail * st.f_frsize
        return IOOutcome(m.NO_SPACE, 0, detail, free_bytes=free)

    def _store_in(self, d: int, key: bytes, src: memoryview) -> IOOutcome:
        """:meth:`store` in the chunk's open directory ``d``."""
        final = self._chunk_name(key)
        try:
            found = os.stat(final, dir_fd=d, follow_symlinks=False).st_mode
        except FileNotFoundError:
            found = None
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"store {key.hex()[:16]}: {e}")
        if found is not None:
            if stat.S_ISREG(found):
                counters.count(names.STORE_ALREADY_PRESENT)
                return OK_PRESENT
            try:
                _refuse(d, final, self.path(key), "chunk file", remove_links=True)
            except UnsafePath as e:
                return self._unsafe("store", key, e)
        if self.cfg.min_free_bytes and self._below_floor():
            counters.count(names.BELOW_FREE_FLOOR)
            return self._no_space(
                None,
                f"store {key.hex()[:16]}: free space on {self.cfg.root_dir} below the tier's "
                f"floor ({self.cfg.min_free_bytes} bytes)",
            )
        tmp = None
        try:
            self.faults.hit("before_read_slot", key)
            payload: memoryview = src
            seal: bytes | None = None
            if self._sealer is not None:  # encrypted from the row into this thread's scratch
                out = self._sealed()
                seal = self._sealer.seal(key, src, out)
                payload = out[: self.cfg.row_bytes]
            header = cf.build_header(self.ns_bytes, key, payload, self._mac_key, seal)
            tmp = f".{key.hex()}.{self._tmp_tag}.{next(self._tmp_counter)}{cf.TMP_SUFFIX}"
            self._write_new_file(d, tmp, key, header, payload)
            self.faults.hit("before_publish", key)
            os.rename(tmp, final, src_dir_fd=d, dst_dir_fd=d)
            tmp = None
            if self.cfg.fsync:
                os.fsync(d)
            return IOOutcome(m.OK, self.file_bytes)
        except OSError as e:
            if tmp is not None:
                try:
                    os.unlink(tmp, dir_fd=d)
                except OSError:
                    pass
            if e.errno in _NO_SPACE_ERRNOS:
                return self._no_space(e.errno, f"store {key.hex()[:16]}: {e}")
            return IOOutcome(m.IO_ERROR, 0, f"store {key.hex()[:16]}: {e}")

    def _write_new_file(self, d: int, tmp: str, key: bytes, header: bytes, src: memoryview) -> None:
        """Create ``tmp`` (O_EXCL, O_NOFOLLOW, in directory ``d``, ``file_mode``) holding
        ``header`` + ``src``, through O_DIRECT while the filesystem takes it. A filesystem that
        refuses O_DIRECT with EINVAL, at the open (some create the file first: CASES C31) or at
        the first aligned write, gets the chunk written again with buffered I/O, from a fresh file
        under the same name: the name is this writer's own (:func:`temp_tag`), so removing what
        the refused attempt left is safe."""
        hbuf = self._scratch()[0]
        hbuf[:] = header  # aligned copy: O_DIRECT needs aligned buffers
        direct = self._direct_writes
        mode = self.cfg.file_mode
        while True:
            try:
                fd = (
                    self._open_direct_write(d, tmp, key)
                    if direct
                    else os.open(tmp, _WRITE_FLAGS, mode, dir_fd=d)
                )
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                self._direct_refused("writes", "the open", e, leftover=(d, tmp))
                direct = False
                continue
            try:
                if self._fchmod_files:
                    os.fchmod(fd, mode)
                if direct:
                    self.faults.hit("direct_write", key)
                write_all(fd, [hbuf, src])
                if self.cfg.fsync:
                    os.fsync(fd)
                return
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                os.close(fd)
                fd = -1
                self._direct_refused("writes", "an aligned write", e, leftover=(d, tmp))
                direct = False
            finally:
                if fd >= 0:
                    os.close(fd)

    def _open_direct_write(self, d: int, tmp: str, key: bytes) -> int:
        fd = os.open(tmp, _WRITE_FLAGS | os.O_DIRECT, self.cfg.file_mode, dir_fd=d)
        try:
            self.faults.hit("direct_open_created", key)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _direct_refused(
        self, transfers: str, where: str, exc: OSError, leftover: tuple[int, str] | None = None
    ) -> None:
        """The filesystem refused O_DIRECT ``transfers`` (``reads`` / ``writes``) at ``where``:
        remove the refused attempt's file ``leftover`` (ours: its directory and name) and use
        buffered I/O from now on, logged once per worker with the filesystem and counted as
        ``direct_io_fallbacks``."""
        if leftover is not None:
            try:
                os.unlink(leftover[1], dir_fd=leftover[0])
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
            st = os.statvfs(self.root)
        except OSError:
            return False  # the write itself will tell
        return st.f_bavail * st.f_frsize - self.file_bytes < self.cfg.min_free_bytes

    # -- load ----------------------------------------------------------------------------------

    def load(self, key: bytes, dst: memoryview) -> IOOutcome:
        """Read one chunk into ``dst`` (an arena row), verified; ``nbytes``: file bytes read."""
        try:
            d = self._chunk_dir(key, create=False)
        except FileNotFoundError:
            return IOOutcome(m.MISSING, 0, f"{key.hex()[:16]}: missing")
        except UnsafePath as e:
            return self._unsafe("load", key, e)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"open {key.hex()[:16]}: {e}")
        try:
            return self._load_in(d, key, dst)
        finally:
            os.close(d)

    def _load_in(self, d: int, key: bytes, dst: memoryview) -> IOOutcome:
        """:meth:`load` from the chunk's open directory ``d``."""
        name = self._chunk_name(key)
        direct = self._direct_reads
        while True:
            try:
                fd = os.open(name, _READ_FLAGS | (os.O_DIRECT if direct else 0), dir_fd=d)
            except FileNotFoundError:
                return IOOutcome(m.MISSING, 0, f"{key.hex()[:16]}: missing")
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._direct_refused("reads", "the open", e)
                    direct = False
                    continue
                if e.errno == errno.ELOOP:
                    try:
                        _refuse(d, name, self.path(key), "chunk file", remove_links=True)
                    except UnsafePath as u:
                        return self._unsafe("load", key, u)
                return IOOutcome(m.IO_ERROR, 0, f"open {key.hex()[:16]}: {e}")
            try:
                if direct:
                    self.faults.hit("direct_read", key)
                return self._read_chunk(fd, d, name, key, dst)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    self._direct_refused("reads", "an aligned read", e)
                    direct = False
                    continue
                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {e}")
            finally:
                os.close(fd)

    def _read_chunk(self, fd: int, d: int, name: str, key: bytes, dst: memoryview) -> IOOutcome:
        """Header and payload in one read (one I/O: the header page lands in this thread's
        scratch, the payload straight in the arena row), one page past the end to see a longer
        file, then the header, the payload checksum and (keyed) the MAC verified. A file that is
        not a regular file, or not exactly header plus row long, is never read (CASES C45)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return IOOutcome(
                m.UNSAFE_PATH,
                0,
                f"load {key.hex()[:16]}: {self.path(key)} is not a regular file "
                f"(mode {stat.filemode(st.st_mode)}); not read",
            )
        if st.st_size != self.file_bytes:
            self._remove_bad(d, name, fd)
            return IOOutcome(
                m.CORRUPT, 0, f"{key.hex()[:16]}: size {st.st_size}, expected {self.file_bytes}"
            )
        self.faults.hit("after_metadata_before_read", key)
        self.faults.hit("read_payload", key)
        head, tail = self._scratch()
        sealer = self._sealer
        row = self.cfg.row_bytes
        sealed = self._sealed() if sealer is not None else None
        # an encrypted chunk's ciphertext lands in the scratch, decrypted into the row below
        into = memoryview(dst).cast("B") if sealed is None else sealed[:row]
        n = os.preadv(fd, [head, into, tail], 0)
        if n != self.file_bytes:
            size = os.fstat(fd).st_size
            if size == self.file_bytes:  # a short read of a whole file: not the file's fault
                return IOOutcome(m.IO_ERROR, 0, f"read {key.hex()[:16]}: {n} of {size} bytes")
            self._remove_bad(d, name, fd)
            return IOOutcome(
                m.CORRUPT, 0, f"{key.hex()[:16]}: size {size}, expected {self.file_bytes}"
            )
        try:
            checksum = cf.parse_header(head.tobytes(), self.ns_bytes, key, self.cfg.row_bytes)
        except cf.ChunkFormatError as e:
            self._remove_bad(d, name, fd)
            return IOOutcome(m.CORRUPT, 0, f"{key.hex()[:16]}: {e}")
        if cf.record_checksum(head, into) != checksum:
            self._remove_bad(d, name, fd)
            return IOOutcome(m.CORRUPT, 0, f"{key.hex()[:16]}: checksum mismatch")
        if self._mac_key is not None:
            why = cf.mac_problem(head, into, self._mac_key)
            if why is not None:
                self._remove_bad(d, name, fd, names.FORGED_REMOVED)
                return IOOutcome(m.FORGED, 0, f"{key.hex()[:16]}: {why}")
        failed = unseal(sealer, head, key, sealed, dst)
        if failed is not None:
            if not failed.forged:  # an encrypted chunk this tier cannot read: not served
                self._remove_bad(d, name, fd)
                return IOOutcome(m.CORRUPT, 0, f"{key.hex()[:16]}: {failed.why}")
            self._remove_bad(d, name, fd, names.FORGED_REMOVED)
            counters.count(names.DECRYPT_FAILURES)
            return IOOutcome(m.FORGED, 0, f"{key.hex()[:16]}: {failed.why}")
        return IOOutcome(m.OK, self.file_bytes)

    @staticmethod
    def _remove_bad(d: int, name: str, fd: int, counter: str = names.CORRUPT_REMOVED) -> None:
        """Unlink ``name`` in directory ``d`` if it is still the file we verified (a writer may
        have replaced it); counted under ``counter``."""
        counters.count(counter)
        try:
            if os.stat(name, dir_fd=d, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(name, dir_fd=d)
        except OSError:
            pass

    # -- probe / delete / scan ---------------------------------------------------------------

    def probe(self, key: bytes) -> IOOutcome:
        """``OK`` when ``key``'s chunk file exists, ``MISSING`` when not (ChunkIO); a symbolic
        link on the way or at the chunk's name is removed and answers ``MISSING``."""
        self.faults.hit("probe_key", key)
        name = self._chunk_name(key)
        try:
            d = self._chunk_dir(key, create=False)
        except (FileNotFoundError, UnsafePath):
            return IOOutcome(m.MISSING)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"probe {key.hex()[:16]}: {e}")
        try:
            found = os.stat(name, dir_fd=d, follow_symlinks=False).st_mode
            if stat.S_ISREG(found):
                return OK_EMPTY
            if stat.S_ISLNK(found):
                _refuse(d, name, self.path(key), "chunk file", remove_links=True)
            return IOOutcome(m.MISSING)
        except (FileNotFoundError, UnsafePath):
            return IOOutcome(m.MISSING)
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"probe {key.hex()[:16]}: {e}")
        finally:
            os.close(d)

    def delete(self, key: bytes) -> IOOutcome:
        """Remove one chunk file (a missing file is not an error). A removal that failed (EPERM
        on an immutable file, EBUSY on a network filesystem, EROFS after a read-only remount...)
        answers ``IO_ERROR`` with its errno as ``status``, so the tier keeps counting the file
        that is still there (CASES C32). A symbolic link on the way is removed: none of the tier's
        files can be behind it, so the chunk is gone."""
        try:
            self.faults.hit("unlink", key)
            d = self._chunk_dir(key, create=False)
        except (FileNotFoundError, UnsafePath):
            return OK_EMPTY
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"delete {key.hex()[:16]}: {e}", e.errno or 0)
        try:
            os.unlink(self._chunk_name(key), dir_fd=d)
        except FileNotFoundError:
            pass
        except OSError as e:
            return IOOutcome(m.IO_ERROR, 0, f"delete {key.hex()[:16]}: {e}", e.errno or 0)
        finally:
            os.close(d)
        return OK_EMPTY

    def scan(self) -> list[tuple[bytes, int, float]]:
        """``(key, bytes, mtime)`` of every chunk file of the namespace (regular files only);
        removes orphaned temporary files on the way (counted as ``stale_temp_removed``)."""
        entries: list[tuple[bytes, int, float]] = []
        now = time.time()
        try:
            for f in namespace_files(self.ns_dir):
                self._scan_file(f, now, entries)
        except (FileNotFoundError, NotADirectoryError):
            pass
        return entries

    def for_tenant(self, tenant: str) -> FsIO:
        """This I/O for tenant ``tenant``'s chunks (a tenant id): the same files, in
        ``<namespace>/t-<tenant id>/`` (``chunkfile.tenant_dir``).

        Raises:
            ValueError: ``tenant`` is not a tenant id.
        """
        sub = copy.copy(self)
        name = cf.tenant_dir(tenant)
        sub._ns_parts = (*self._ns_parts[:1], name)
        if self._sealer is not None:  # the tenant's own key
            sub._sealer = self._sealer.for_tenant(tenant)
        sub.ns_dir = os.path.join(self.root, self.cfg.namespace_id, name)
        return sub

    def tenant_ids(self) -> list[str]:
        """The tenants with a directory in the namespace (their ids), for a scan."""
        try:
            fd = os.open(os.path.join(self.root, self.cfg.namespace_id), DIR_FLAGS)
        except OSError:
            return []
        try:
            with os.scandir(fd) as entries:
                return [
                    t
                    for e in entries
                    if e.is_dir(follow_symlinks=False)
                    and (t := cf.tenant_from_dir(e.name)) is not None
                ]
        finally:
            os.close(fd)

    def _scan_file(self, f: NsFile, now: float, entries: list) -> None:
        name = f.name
        try:
            st = f.stat()
        except OSError:
            return
        if is_temp_name(name):
            if remove_if_stale(f, st.st_mtime, now, self.cfg.stale_temp_age_s):
                counters.count(names.STALE_TEMP_REMOVED)
            return
        key = cf.key_from_name(name)
        if key is not None and stat.S_ISREG(st.st_mode):
            entries.append((key, st.st_size, st.st_mtime))


def write_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` (bytes-like, in order) at the start of ``fd``, whatever short writes
    ``pwritev`` makes."""
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
