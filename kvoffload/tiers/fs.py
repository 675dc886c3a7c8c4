"""The filesystem tier (``type: "fs"``): one file per chunk under ``root_dir``, I/O in worker processes.

Layout, format and atomicity are described in :mod:`kvoffload.workers.fs_io` and
:mod:`kvoffload.workers.chunkfile`. Several engines may share one ``root_dir`` (local disk, NFS,
Lustre...): chunk names depend only on the namespace and the chunk key, so they share chunks, and
writes are atomic renames, so no reader sees a torn file.

Capacity: the tier keeps an LRU index of the namespace's files (the files found at start are
adopted, oldest first, and counted) and deletes the least recently used chunks to stay within its
cap of file bytes, headers included: ``max_bytes``, or by default half the filesystem's free space
at start (plus this namespace's chunks found there), logged with the figure. ``max_bytes:
"unbounded"`` keeps no index and deletes nothing but corrupt files. The cap applies per namespace, as
seen by this instance: chunks that another instance writes into the same directory after this one
started are not counted here.

::

    store ─▶ admission: room under the cap? ── no ─▶ evict LRU chunks (delete tasks) ─┐
               │ yes                                                                 │
               ▼                                                                     ▼
         writer: free space above the floor? ── no / ENOSPC ─▶ NO_SPACE, with the free space
               │ yes                                             statvfs shows just after
               ▼                                                            │
         chunk file written, counted       room there for the failed stores? ── yes ─▶ nothing
                                                       │ no                  evicted (C52)
                                                       ▼
                                effective cap lowered to what the disk holds;
                                LRU chunks evicted for the shortage only (C33)

    delete failed (EPERM, EBUSY, EROFS...) ─▶ the file stays counted, retried later

Permissions and links (CASES C43): the root (when the tier creates it), the namespace and shard
directories are created 0700 and chunk files and ``config.json`` 0600, whatever the umask, so no
other local user reads a chunk or even its name. ``share_with_group`` widens that to 2770 / 0660
for a group that shares the root on purpose (create the root with that group: ``chgrp <group>``;
the setgid directories keep it below): every member can then read every chunk, and write them,
so a member can forge chunks unless the tier has an integrity key. ``root_dir`` is resolved once
at start (the operator's own link is fine); inside it nothing is followed: a namespace directory
that is a symbolic link refuses the start, and the workers reach every file one directory at a
time with ``O_NOFOLLOW`` (:mod:`kvoffload.workers.fs_io`).

Integrity key (``integrity_key_env``): every chunk is written with a keyed MAC and one without a
valid MAC is a miss, counted as ``forged`` and removed. The key's id is part of the namespace
(:class:`~kvoffload.namespace.KeyedNamespace`), so keyed and unkeyed instances, or instances with
different keys, never share a directory. Without a key, anyone who can write the root can forge
chunks (the checksums are unkeyed).

Whatever the cap, a writer refuses (``no_space``) a store that would leave less than
``min_free_fraction`` of the filesystem free, and a full disk (ENOSPC, quota) fails the store the
same way; the writer then reports the free space it sees (``statvfs``; none for a quota or a
filesystem out of inodes, which ``statvfs`` does not show). When the room above the floor holds
the failed chunks and the stores in flight, the error was not a full disk: nothing is evicted and
the cap stays (``no_space_with_room``; CASES C52, where five transient ENOSPC emptied the tier).
Otherwise the tier lowers its effective cap to the bytes it holds plus that room, evicts its own
least recently used chunks for the shortage only (never more than the failed stores need), and
raises the cap again as a background sample of the free space shows room (CASES C33). A chunk file
whose removal fails stays in the index and in the accounting (it is still on disk), counted by
errno in ``kvoffload_tier_eviction_errors``, and is retried when it next comes up for eviction; the
next least recently used chunk is evicted instead (CASES C32).
A store that fails once a worker has it may still have published its file (the worker died or timed
out after the rename): that file is removed, so the disk holds what is counted.
While some removal has failed or the disk is full, space is reused only once a removal is confirmed:
a store that finds no such room is refused at once (``no_space``) with a logged reason, and the tier
evicts ahead for the next one. The bytes on disk thus exceed the cap by at most the files that
could not be removed, and the accounting equals the disk once deletes have answered.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from typing_extensions import override

from kvoffload.config import Bytes
from kvoffload.namespace import for_encryption_key, for_integrity_key
from kvoffload.tiers.process import (
    ProcessTierConfig,
    ProcessTierManager,
    encryption_key_env_problems,
    integrity_key_env_problems,
)
from kvoffload.validation import raise_problems
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import fs_io

log = logging.getLogger("kvoffload.tiers")

_SCAN_TIMEOUT_S = 600.0
DEFAULT_FREE_FRACTION = 0.5
"""Without ``max_bytes``, the cap is this fraction of the filesystem's free space at start (plus
the namespace's own chunks found there, so restarts do not creep towards a full disk)."""
_DISK_SAMPLE_S = 1.0  # free-space sampling period while the disk limits the tier (seconds)


class FsTierConfig(ProcessTierConfig, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "fs", "root_dir": ..., ...}`` (plus :class:`ProcessTierConfig`'s fields).

    Attributes:
        root_dir: directory holding the tier (created if missing; must be writable).
        max_bytes: cap on this namespace's file bytes (bytes); LRU chunks are deleted to stay under
            it. None (default): half the filesystem's free space at start, plus the bytes of this
            namespace's chunks already there (logged at start). ``"unbounded"``: no cap, no
            index; the tier deletes nothing but corrupt files (the free-space floor still holds).
        min_free_fraction: free-space floor, as a fraction of the filesystem's size (0 to <1,
            default 0.05): a store that would leave less free is refused (``no_space``) and the
            tier evicts its own chunks instead of writing. 0: no floor.
        fsync: fsync every chunk file and directory before reporting it stored.
        direct_io: transfers that bypass the page cache with O_DIRECT: ``both`` (default: chunks
            stream between the arena and the disk without page-cache copies or dirty-page
            throttling; the host tier is the cache), ``writes``, ``reads`` or ``none``. Falls back
            to buffered I/O where the filesystem refuses O_DIRECT (tmpfs).
        share_with_group: create directories 2770 (setgid: they keep the root's group) and files
            0660 instead of 0700 / 0600, for a group that shares the root on purpose. Every member
            of the group can then read and write every chunk (and forge one, unless
            ``integrity_key_env`` is set).
        integrity_key_env: name of an environment variable holding an integrity key (at least 16
            bytes; never the key itself here). Chunks are written with a keyed MAC (HMAC-SHA256)
            and a chunk whose MAC is missing or wrong is a miss (``forged``) and removed. The
            key's id is part of the namespace. None: no MAC; anyone who can write the root can
            forge chunks.
        encryption_key_env: name of an environment variable holding an encryption master key
            (at least 16 bytes; never the key itself here). Chunks are stored AES-256-GCM
            encrypted by the workers, each under a key of its own derived from it (HKDF of the
            master key, namespace, tenant and a random per-write salt), a random nonce per write and the namespace, tenant and chunk key bound as associated
            data; a chunk whose tag does not verify is a miss (``forged``, counted
            ``decrypt_failures``) and removed. The key's id is part of the namespace. None:
            chunks are stored as they are.
    """

    unset_means: ClassVar[dict[str, str]] = {
        **ProcessTierConfig.unset_means,
        "max_bytes": f"auto: {DEFAULT_FREE_FRACTION:.0%} of the free space on root_dir's "
        "filesystem at start, plus this namespace's chunks there",
        "integrity_key_env": "off: chunks carry no keyed MAC; anyone who can write root_dir can "
        "forge them",
        "encryption_key_env": "off: chunks are stored as they are; anyone who can read root_dir "
        "reads them",
    }

    root_dir: str
    max_bytes: Bytes | Literal["unbounded"] | None = None
    min_free_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.05
    fsync: bool = False
    direct_io: Literal["none", "writes", "reads", "both"] = "both"
    share_with_group: bool = False
    integrity_key_env: str | None = None
    encryption_key_env: str | None = None

    def validate(self) -> None:
        """Checks of the settings themselves.

        Raises:
            Problems: each ``"<key>: <why>"``.
        """
        problems = self.io_thread_problems(self.read_workers, self.write_workers)
        problems += self.breaker_problems()
        if not self.root_dir:
            problems.append("root_dir: must be a directory path")
        elif "\0" in self.root_dir:
            problems.append(
                f"root_dir: {self.root_dir!r} holds a NUL character, which no path can: remove it"
            )
        problems += integrity_key_env_problems(self.integrity_key_env)
        problems += encryption_key_env_problems(self.encryption_key_env)
        problems += self.tenant_quota_problems(
            'max_bytes is "unbounded": set max_bytes (or leave it unset for the default bound)'
            if self.max_bytes == "unbounded"
            else None
        )
        raise_problems(problems)

    def check_on_this_machine(self) -> list[str]:
        """Checks of ``root_dir`` against this machine's filesystems, made when the configuration
        is parsed at engine start (the tier re-checks by writing a file when it starts) and by
        ``kvoffload check`` (unless ``--syntax-only``).

        Returns:
            ``"root_dir: <why>"`` problems: a path that is not a directory, a read-only or pseudo
            filesystem, a directory this user cannot write; empty when none.
        """
        if not self.root_dir or "\0" in self.root_dir:
            return []  # validate() says so
        path = os.path.abspath(self.root_dir)
        if os.path.exists(path) and not os.path.isdir(path):
            return [f"root_dir: {self.root_dir!r} exists and is not a directory"]
        probe = _existing_ancestor(path)
        if not os.path.isdir(probe):  # a file where a directory of the path must be made
            return [f"root_dir: {probe!r} is not a directory (in {self.root_dir!r})"]
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return [f"root_dir: {probe!r} is on a read-only filesystem"]
        if not os.access(probe, os.W_OK | os.X_OK):
            if probe == path:
                return [f"root_dir: {probe!r} is not writable by this user"]
            return [
                f"root_dir: {self.root_dir!r} does not exist and cannot be made: {probe!r}, "
                "where it would be created, is not writable by this user (make it, writable, "
                "before the engine starts; a config for another machine: kvoffload check "
                "--syntax-only)"
            ]
        if os.path.realpath(probe).startswith(("/proc", "/sys")):
            return [f"root_dir: {self.root_dir!r} is on a pseudo filesystem"]
        return []

    def free_space_now(self) -> tuple[int, int] | None:
        """``(bytes free, the free-space floor in bytes)`` of the filesystem that holds (or will
        hold) ``root_dir``, now; None when no part of the path can be looked at. For
        ``kvoffload check``: a disk already past the floor makes a tier that stores nothing."""
        try:
            st = os.statvfs(_existing_ancestor(os.path.abspath(self.root_dir)))
        except OSError:
            return None
        return st.f_bavail * st.f_frsize, int(self.min_free_fraction * st.f_blocks * st.f_frsize)


def _existing_ancestor(path: str) -> str:
    """``path`` (absolute) or its nearest ancestor that exists: where its filesystem is."""
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


class _FreeSpaceSampler:
    """A daemon thread that samples the free space of ``path`` (``statvfs``: ``f_bavail`` bytes)
    every :data:`_DISK_SAMPLE_S` while :meth:`want` is on, so the engine never blocks on a slow
    filesystem. :attr:`latest` is ``(bytes available, monotonic time)`` or None."""

    def __init__(self, path: str):
        self.path = path
        self.latest: tuple[int, float] | None = None
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvoffload-fs-free-space", daemon=True
        )
        self._thread.start()

    def want(self, on: bool) -> None:
        (self._wanted.set if on else self._wanted.clear)()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wanted.wait()
            if self._stop.is_set():
                return
            try:
                st = os.statvfs(self.path)
                self.latest = (st.f_bavail * st.f_frsize, time.monotonic())
            except OSError:
                pass
            self._stop.wait(_DISK_SAMPLE_S)

    def close(self) -> None:
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout=5.0)


class FsTier(ProcessTierManager):
    """Filesystem secondary tier; see the module docstring. Capacity accounting is the
    :class:`~kvoffload.tiers.capacity.Capacity` every worker-backed tier holds; this class adds the
    default bound, chunks found at start, and a full disk (a lowered cap, raised again by a
    background free-space sample)."""

    config_class = FsTierConfig
    config: FsTierConfig
    io_module = "kvoffload.workers.fs_io"
    medium = "STORAGE"
    shared = True

    @classmethod
    @override
    def purge_storage(
        cls, name: str, config: Any, *, tenant: str | None, namespace: str | None
    ) -> Any:
        from kvoffload.tiers.purging import purge_fs

        return purge_fs(name, config.root_dir, tenant=tenant, namespace=namespace)

    def __init__(
        self, *, name: str, arena_view: memoryview, namespace: Any, config: FsTierConfig, arena: Any
    ):
        namespace = for_encryption_key(
            for_integrity_key(namespace, config.integrity_key_env), config.encryption_key_env
        )
        super().__init__(
            name=name, arena_view=arena_view, namespace=namespace, config=config, arena=arena
        )
        self.ns_id = namespace.id()
        # Resolved once: the operator may make root_dir a link; nothing inside it is followed.
        self.root = os.path.realpath(config.root_dir)
        self.ns_dir = os.path.join(self.root, self.ns_id)
        self.dir_mode, self.file_mode = fs_io.modes(config.share_with_group)
        self.file_bytes = cf.HEADER_BYTES + self.row_bytes
        if isinstance(config.max_bytes, int) and config.max_bytes < self.file_bytes:
            raise ValueError(
                f"max_bytes: {config.max_bytes} is smaller than one chunk file "
                f"({self.file_bytes} bytes)"
            )
        self._write_namespace_config()
        st = os.statvfs(self.root)
        self.min_free_bytes = int(config.min_free_fraction * st.f_blocks * st.f_frsize)
        free_now = st.f_bavail * st.f_frsize
        if free_now < self.min_free_bytes:
            # Said at start, not first at the first store: a tier on a disk already past its floor
            # stores nothing until room is made (its own chunks evicted, or space freed).
            log.warning(
                "kvoffload tier %s: %s has %d bytes free, below the free-space floor of %d bytes "
                "(min_free_fraction %g of %d bytes): this tier stores nothing until space is "
                "freed there; lower min_free_fraction (0: no floor) to use it",
                name,
                config.root_dir,
                free_now,
                self.min_free_bytes,
                config.min_free_fraction,
                st.f_blocks * st.f_frsize,
            )
        # Capacity (bytes): none for "unbounded"; without max_bytes, a share of the free space.
        self._default_free: int | None = None
        max_bytes: int | None
        if config.max_bytes == "unbounded":
            max_bytes = None
        elif config.max_bytes is None:
            self._default_free = st.f_bavail * st.f_frsize
            max_bytes = int(DEFAULT_FREE_FRACTION * self._default_free)
            if max_bytes < self.file_bytes:
                raise ValueError(
                    f"root_dir: {config.root_dir!r} has {self._default_free} bytes free, and the "
                    f"default cap ({DEFAULT_FREE_FRACTION:.0%} of the free space) is smaller than "
                    f"one chunk file ({self.file_bytes} bytes); free some space or set max_bytes"
                )
            log.info(
                "kvoffload tier %s: max_bytes not set: capped at %d bytes (%.0f%% of the %d "
                "bytes free on %s at start, plus this namespace's chunks found there); set "
                'max_bytes to choose, or "unbounded"',
                name,
                max_bytes,
                100 * DEFAULT_FREE_FRACTION,
                self._default_free,
                config.root_dir,
            )
        else:
            max_bytes = config.max_bytes
        full_why = (
            f"the filesystem of {config.root_dir} is full (free space below "
            f"{self.min_free_bytes} bytes, or ENOSPC)"
        )
        if max_bytes is not None:
            self.bound_capacity(max_bytes, self.file_bytes, full_why)
        self._sampler: _FreeSpaceSampler | None = None
        self._sample_seen: tuple[int, float] | None = None
        self.start()
        # Remove orphaned temporary files (by age only: CASES C29); with a cap, also adopt chunks.
        self._scan_at_start(_SCAN_TIMEOUT_S, list_entries=self.capacity.bounded)

    @override
    def io_config(self) -> fs_io.FsIOConfig:
        c = self.config
        return fs_io.FsIOConfig(
            root_dir=self.root,
            namespace_id=self.ns_id,
            row_bytes=self.row_bytes,
            fsync=c.fsync,
            direct_io=c.direct_io,
            stale_temp_age_s=fs_io.stale_temp_age_s(c.job_timeout_s),
            min_free_bytes=self.min_free_bytes,
            dir_mode=self.dir_mode,
            file_mode=self.file_mode,
            integrity_key_env=c.integrity_key_env,
            encryption_key_env=c.encryption_key_env,
        )

    def _write_namespace_config(self) -> None:
        """Create the root (``dir_mode``, when missing) and the namespace directory, write its
        ``config.json`` (``file_mode``) unless one is there, and check that files can be created.

        Raises:
            ValueError: naming ``root_dir``: not usable, or the namespace directory is a
                symbolic link or not a directory.
        """
        root = self.root
        try:
            os.makedirs(os.path.dirname(root), exist_ok=True)
            try:
                os.mkdir(root, self.dir_mode & 0o777)
                created = True
            except FileExistsError:
                created = False
            root_fd = os.open(root, fs_io.DIR_FLAGS)
            try:
                if created:
                    os.fchmod(root_fd, self.dir_mode)
                ns_fd = fs_io.open_dir(
                    root_fd,
                    self.ns_id,
                    where=self.ns_dir,
                    create_mode=self.dir_mode,
                    remove_links=False,
                )
            finally:
                os.close(root_fd)
            try:
                self._warn_if_open(ns_fd)
                self._write_config_json(ns_fd)
            finally:
                os.close(ns_fd)
        except fs_io.UnsafePath as e:
            raise ValueError(
                f"root_dir: {e}: the fs tier follows no link inside its root "
                f"({self.config.root_dir!r}); remove it, or make root_dir itself the link"
            ) from None
        except OSError as e:
            raise ValueError(f"root_dir: {self.config.root_dir!r} is not usable: {e}") from None

    def _write_config_json(self, ns_fd: int) -> None:
        """``config.json`` in the open namespace directory ``ns_fd`` unless a regular file is
        there (a temporary file renamed over it: a link there is replaced, never followed), then
        a probe that files can be created."""
        tag = fs_io.temp_tag()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            present = stat.S_ISREG(
                os.stat("config.json", dir_fd=ns_fd, follow_symlinks=False).st_mode
            )
        except FileNotFoundError:
            present = False
        if not present:
            tmp = f"config.json.{tag}{cf.TMP_SUFFIX}"
            fd = os.open(tmp, flags, self.file_mode, dir_fd=ns_fd)
            try:
                os.fchmod(fd, self.file_mode)
                fs_io.write_all(fd, [self.namespace.to_json()])
            finally:
                os.close(fd)
            os.rename(tmp, "config.json", src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
        probe = f".write-test.{tag}{cf.TMP_SUFFIX}"
        os.close(os.open(probe, flags, self.file_mode, dir_fd=ns_fd))
        os.unlink(probe, dir_fd=ns_fd)

    def _warn_if_open(self, ns_fd: int) -> None:
        """Warn when the namespace directory (made by an earlier version, by hand, or by another
        user before this tier started) lets more users in than this tier's setting: others may
        then read its chunks, or (another owner) write them."""
        st = os.fstat(ns_fd)
        mode = st.st_mode & 0o777
        extra = mode & ~self.dir_mode & 0o777
        other_owner = st.st_uid != os.geteuid() and not self.config.share_with_group
        if not extra and not other_owner:
            return
        log.warning(
            "kvoffload tier %s: %s is mode %03o and owned by uid %d, more open than this "
            "tier's %03o (share_with_group: %s): other users may list or read its chunks%s; "
            "tighten it (chown, chmod -R %s) unless that is meant",
            self.name,
            self.ns_dir,
            mode,
            st.st_uid,
            self.dir_mode & 0o777,
            self.config.share_with_group,
            " and write (forge) them" if other_owner else "",
            "g-w,o-rwx" if self.config.share_with_group else "go-rwx",
        )

    # -- capacity: the default bound, chunks found at start, a full disk ------------------------

    def _medium_full(self, chunks: int, free_bytes: int = -1) -> None:
        """Writes of ``chunks`` chunks found the filesystem full (ENOSPC, a quota, the free-space
        floor), and a worker measured ``free_bytes`` free just after (-1: not measured, taken
        as none). The room above the floor is checked against what these chunks and the stores
        still in flight need (CASES C52): with room for them the error was not a full disk, so
        nothing is evicted and the cap stays (counted as ``no_space_with_room``). Otherwise
        the cap becomes what the disk holds (the bytes counted now plus that room), the tier
        evicts ahead only the shortage, and a background sample of the free space raises the
        cap again when room comes back (CASES C33)."""
        cap = self.capacity
        room = max(0, free_bytes - self.min_free_bytes)
        if free_bytes >= 0 and room >= chunks * self.file_bytes + cap.reserved_bytes():
            self.count("no_space_with_room", chunks)
            self._warn(
                f"{chunks} store(s) failed with no_space while {self.config.root_dir} had "
                f"{free_bytes} bytes free (room for them above the floor of "
                f"{self.min_free_bytes} bytes): not a full disk; nothing evicted"
            )
            return
        self.count("disk_full_stores", chunks)
        lowered = cap.lower_cap(chunks, room)
        if self._sampler is None:
            self._sampler = _FreeSpaceSampler(self.root)
            self.resources.on_close(self._sampler.close)
        self._sampler.want(True)
        self._warn(
            f"the filesystem of {self.config.root_dir} is full (ENOSPC, a quota or below the "
            f"free-space floor of {self.min_free_bytes} bytes): cap lowered to {lowered} "
            f"bytes; evicting this tier's least recently used chunks to make room for "
            f"{chunks} chunk(s)"
        )
        self._enforce_cap()

    @override
    def _refresh_capacity(self) -> None:
        """Raise the lowered cap to what the last free-space sample allows (never lower it: only a
        failed write does, so a sample taken before our own writes cannot undercut them)."""
        if self.capacity.lowered_cap is None:
            return
        sampler = self._sampler
        sample = sampler.latest if sampler is not None else None
        if sampler is None or sample is None or sample is self._sample_seen:
            return
        self._sample_seen = sample
        # Files being written or deleted when the sample was taken may be on disk uncounted, never
        # counted twice: this errs low (more eviction), never towards another ENOSPC.
        if self.capacity.raise_cap(max(0, sample[0] - self.min_free_bytes)):
            sampler.want(False)
            log.info(
                "kvoffload tier %s: room on %s again: cap back to %d bytes",
                self.name,
                self.config.root_dir,
                self.capacity.max_bytes,
            )

    def _on_scan(self, entries: list[tuple[bytes, int, float]], tenants: list[str]) -> None:
        cap = self.capacity
        if not cap.bounded:
            return
        fresh = self._adopt(entries, tenants)
        # found there, whether still counted or evicted at once for a tenant's quota
        adopted_bytes = sum(size for k, size, _ in entries if k in fresh)
        if self._default_free is not None and adopted_bytes:
            cap.max_bytes = int(DEFAULT_FREE_FRACTION * (self._default_free + adopted_bytes))
            log.info(
                "kvoffload tier %s: %d bytes of chunks found at start: default cap %d bytes",
                self.name,
                adopted_bytes,
                cap.max_bytes,
            )
        self._enforce_cap(unannounced=fresh)
        self._announce_adopted(fresh)
