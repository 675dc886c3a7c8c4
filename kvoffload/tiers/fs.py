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
         writer: free space above the floor? ── no / ENOSPC ─▶ NO_SPACE ─▶ effective cap lowered
               │ yes                                                   to what the disk holds
               ▼
         chunk file written, counted                     delete failed (EPERM, EBUSY, EROFS...)
                                                         ─▶ the file stays counted, retried later

Whatever the cap, a writer refuses (``no_space``) a store that would leave less than
``min_free_fraction`` of the filesystem free, and a full disk (ENOSPC, quota) fails the store the
same way; the tier then lowers its effective cap to the bytes it holds, evicts its own least
recently used chunks to make room, and raises the cap again as a background sample of the free space
shows room (CASES C33). A chunk file whose removal fails stays in the index and in the accounting
(it is still on disk), counted by errno in ``kvoffload_tier_eviction_errors``, and is retried when it
next comes up for eviction; the next least recently used chunk is evicted instead (CASES C32).
A store that fails once a worker has it may still have published its file (the worker died or timed
out after the rename): that file is removed, so the disk holds what is counted.
While some removal has failed or the disk is full, space is reused only once a removal is confirmed:
a store that finds no such room is refused at once (``no_space``) with a logged reason, and the tier
evicts ahead for the next one. The bytes on disk thus exceed the cap by at most the files that
could not be removed, and the accounting equals the disk once deletes have answered.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Annotated, Any, Literal

import msgspec

from kvoffload.config import Positive
from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.metrics import Gauge
from kvoffload.tiers.base import TierEvent
from kvoffload.tiers.process import ProcessTierConfig, ProcessTierManager
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import fs_io

log = logging.getLogger("kvoffload.tiers")

_SCAN_TIMEOUT_S = 600.0
# Evictions remembered to spot probes that saw a file just before it was deleted.
_EVICTED_MEMORY = 65536
_NO_ANSWER = (m.WORKER_DIED, m.TIMEOUT, m.BAD_REPLY)  # a delete's verdict that says nothing
_DELETE_RETRIES = 10  # deletes sent again after no answer, before the file is kept counted
DEFAULT_FREE_FRACTION = 0.5
"""Without ``max_bytes``, the cap is this fraction of the filesystem's free space at start (plus
the namespace's own chunks found there, so restarts do not creep towards a full disk)."""
_DISK_SAMPLE_S = 1.0  # free-space sampling period while the disk limits the tier (seconds)
_WARN_EVERY_S = 10.0  # at most one refusal warning per tier in this many seconds


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
    """

    root_dir: str
    max_bytes: Positive | Literal["unbounded"] | None = None
    min_free_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.05
    fsync: bool = False
    direct_io: Literal["none", "writes", "reads", "both"] = "both"

    def validate(self) -> None:
        """Static checks of ``root_dir`` (the tier re-checks by writing a file at start).

        Raises:
            ValueError: ``"<key>: <why>"``.
        """
        if not self.root_dir:
            raise ValueError("root_dir: must be a directory path")
        self.check_io_threads(self.read_workers, self.write_workers)
        path = os.path.abspath(self.root_dir)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"root_dir: {self.root_dir!r} exists and is not a directory")
        probe = path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"root_dir: {probe!r} is not writable")
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            raise ValueError(f"root_dir: {probe!r} is on a read-only filesystem")
        if os.path.realpath(probe).startswith(("/proc", "/sys")):
            raise ValueError(f"root_dir: {self.root_dir!r} is on a pseudo filesystem")


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
    """Filesystem secondary tier; see the module docstring."""

    config_class = FsTierConfig
    io_module = "kvoffload.workers.fs_io"
    medium = "STORAGE"
    shared = True
    metric_definitions = (
        Gauge(
            "kvoffload_tier_used_bytes",
            "Bytes of chunk files a capacity-bounded tier counts as its own (headers included).",
            ("tier",),
        ),
        Gauge(
            "kvoffload_tier_capacity_bytes",
            "A capacity-bounded tier's cap in bytes now: max_bytes (or the default bound), "
            "lowered while the filesystem is full.",
            ("tier",),
        ),
    )

    def __init__(
        self, *, name: str, arena_view: memoryview, namespace: Any, config: FsTierConfig, arena: Any
    ):
        super().__init__(
            name=name, arena_view=arena_view, namespace=namespace, config=config, arena=arena
        )
        self.ns_id = namespace.id()
        self.ns_dir = os.path.join(config.root_dir, self.ns_id)
        self.file_bytes = cf.HEADER_BYTES + self.row_bytes
        if isinstance(config.max_bytes, int) and config.max_bytes < self.file_bytes:
            raise ValueError(
                f"max_bytes: {config.max_bytes} is smaller than one chunk file "
                f"({self.file_bytes} bytes)"
            )
        self._write_namespace_config()
        st = os.statvfs(self.ns_dir)
        self.min_free_bytes = int(config.min_free_fraction * st.f_blocks * st.f_frsize)
        # Capacity (bytes): None for "unbounded"; without max_bytes, a share of the free space.
        self._default_free: int | None = None
        if config.max_bytes == "unbounded":
            self.max_bytes: int | None = None
        elif config.max_bytes is None:
            self._default_free = st.f_bavail * st.f_frsize
            self.max_bytes = int(DEFAULT_FREE_FRACTION * self._default_free)
            if self.max_bytes < self.file_bytes:
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
                self.max_bytes,
                100 * DEFAULT_FREE_FRACTION,
                self._default_free,
                config.root_dir,
            )
        else:
            self.max_bytes = config.max_bytes
        # LRU of the chunk files counted against the cap -> their bytes (None when unbounded).
        self._index: OrderedDict[bytes, int] | None = (
            OrderedDict() if self.max_bytes is not None else None
        )
        self.used_bytes = 0
        self._reserved: dict[bytes, int] = {}
        self._loading: dict[bytes, int] = {}
        self._delete_queue: list[bytes] = []
        self._deleting: dict[bytes, int] = {}  # evicted keys whose delete task has not answered
        self._evicted_at: OrderedDict[bytes, float] = (
            OrderedDict()
        )  # recent evictions (monotonic s)
        # Files whose delete has not answered: still on disk, their bytes no longer in used_bytes.
        self._unconfirmed: dict[bytes, int] = {}
        self._unconfirmed_bytes = 0
        self._undeletable: set[bytes] = set()  # in the index; their last removal failed
        self._delete_retries: dict[bytes, int] = {}  # deletes sent again after no answer
        self._last_removal_error = ""
        self._refused: dict[bytes, int] = {}  # keys refused at admission, their job not finished
        self._disk_cap: int | None = None  # the cap lowered to what the full disk holds
        self._headroom = 0  # bytes evicted ahead while space is reused only once confirmed
        self._sampler: _FreeSpaceSampler | None = None
        self._sample_seen: tuple[int, float] | None = None
        self._warned_at = -_WARN_EVERY_S
        self.start()
        # Remove orphaned temporary files (by age only: CASES C29); with a cap, also adopt chunks.
        tid = self._next_task_id()
        self._send(
            self._writers,
            "scan",
            None,
            [],
            m.ScanTask(tid, list_entries=self._index is not None),
            timeout_s=_SCAN_TIMEOUT_S,
        )

    def io_config(self) -> fs_io.FsIOConfig:
        c = self.config
        return fs_io.FsIOConfig(
            root_dir=c.root_dir,
            namespace_id=self.ns_id,
            row_bytes=self.row_bytes,
            fsync=c.fsync,
            direct_io=c.direct_io,
            stale_temp_age_s=fs_io.stale_temp_age_s(c.job_timeout_s),
            min_free_bytes=self.min_free_bytes,
        )

    def _write_namespace_config(self) -> None:
        try:
            os.makedirs(self.ns_dir, exist_ok=True)
            path = os.path.join(self.ns_dir, "config.json")
            tag = fs_io.temp_tag()
            if not os.path.exists(path):
                tmp = f"{path}.{tag}{cf.TMP_SUFFIX}"
                with open(tmp, "wb") as f:
                    f.write(self.namespace.to_json())
                os.rename(tmp, path)
            probe = os.path.join(self.ns_dir, f".write-test.{tag}{cf.TMP_SUFFIX}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as e:
            raise ValueError(f"root_dir: {self.config.root_dir!r} is not usable: {e}") from None

    # -- capacity -------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int | None:
        """The cap now (bytes): ``max_bytes`` or the default bound, lowered while the filesystem is
        full; None when unbounded."""
        if self.max_bytes is None:
            return None
        return self.max_bytes if self._disk_cap is None else min(self.max_bytes, self._disk_cap)

    def _cautious(self) -> bool:
        """Reuse space only once its removal is confirmed (some removal failed, or the disk is
        full)."""
        return bool(self._undeletable) or self._disk_cap is not None

    def _admit_store(self, keys: list[bytes]) -> tuple[list[int], dict[bytes, int]]:
        index = self._index
        if index is None:
            return list(range(len(keys))), {}
        if self._disk_cap is not None:
            self._apply_free_space_sample()
        fb = self.file_bytes
        protect = set(keys)
        admitted: list[int] = []
        rejected: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if k in index:
                index.move_to_end(k)
                admitted.append(i)  # the worker sees the file and skips the write
                continue
            if k in self._reserved:
                admitted.append(i)  # an earlier job is writing it; the worker skips or rewrites it
                continue
            if k in self._deleting:
                # Evicted, its delete not yet done: a writer would find the old file, skip the
                # write, and the delete would then remove the chunk we count as stored.
                rejected[k] = m.REJECTED
                self._refused[k] = self._refused.get(k, 0) + 1
                self.count("store_skipped_deleting")
                continue
            if not self._make_room(protect):
                rejected[k] = m.NO_SPACE
                self._refused[k] = self._refused.get(k, 0) + 1
                continue
            self._reserved[k] = fb
            admitted.append(i)
        refused = sum(1 for c in rejected.values() if c == m.NO_SPACE)
        if refused:
            self.count("store_refused_no_room", refused)
            self._warn(
                f"store of {refused} chunk(s) refused (no_space): no room under the cap "
                f"({self.capacity_bytes} bytes) {self._why_no_room()}"
            )
            if self._cautious():  # evict ahead for as much, so the next store finds room
                self._headroom = max(self._headroom, min(refused * fb, self.capacity_bytes // 2))
        self._enforce_cap()
        return admitted, rejected

    def _make_room(self, protect: set[bytes]) -> bool:
        """Evict least recently used chunks until one more chunk file fits under the cap; True
        when it fits. While cautious, room whose removal is not yet confirmed does not count."""
        cap = self.capacity_bytes
        fb = self.file_bytes
        while self.used_bytes + self._reserved_bytes() + fb > cap:
            if not self._evict_one(protect, retry=True):
                break
        pending = self._unconfirmed_bytes if self._cautious() else 0
        return self.used_bytes + pending + self._reserved_bytes() + fb <= cap

    def _why_no_room(self) -> str:
        if self._undeletable:
            return (
                f"{len(self._undeletable)} chunk file(s) could not be removed "
                f"({self._last_removal_error}); space is reused once a removal succeeds"
            )
        if self._disk_cap is not None:
            return (
                f"the filesystem of {self.config.root_dir} is full (free space below "
                f"{self.min_free_bytes} bytes, or ENOSPC); evicting to make room"
            )
        return "every chunk is in use (loading) or part of this store"

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("kvoffload tier %s: %s", self.name, msg)

    def _reserved_bytes(self) -> int:
        return len(self._reserved) * self.file_bytes

    def _evict_one(self, protect: set[bytes], retry: bool = False) -> bool:
        """Evict the least recently used chunk not loading nor in ``protect``; chunks whose removal
        failed are tried again only with ``retry`` (a store needs room), never in a loop."""
        index = self._index
        undeletable = self._undeletable
        for k in index:
            if k in self._loading or k in protect or (not retry and k in undeletable):
                continue
            nbytes = index.pop(k)
            self.used_bytes -= nbytes
            self._unconfirmed[k] = self._unconfirmed.get(k, 0) + nbytes
            self._unconfirmed_bytes += nbytes
            self._present.pop(k, None)
            self._delete_queue.append(k)
            evicted = self._evicted_at
            evicted[k] = time.monotonic()
            evicted.move_to_end(k)
            if len(evicted) > _EVICTED_MEMORY:
                evicted.popitem(last=False)
            self.count(names.EVICTIONS)
            return True
        return False

    def _flush_deletes(self) -> None:
        if not self._delete_queue:
            return
        keys, self._delete_queue = self._delete_queue, []
        if self.record_events:
            self._events.append(TierEvent(list(keys), True))
        deleting = self._deleting
        for k in keys:
            deleting[k] = deleting.get(k, 0) + 1
        for start in range(0, len(keys), 256):
            batch = keys[start : start + 256]
            tid = self._next_task_id()
            self._send(self._writers, "delete", None, batch, m.DeleteTask(tid, batch))

    def _removals_since(self, t: float) -> bool:
        if self._deleting:
            return True
        evicted = self._evicted_at
        return bool(evicted) and next(reversed(evicted.values())) >= t

    def _removed_since(self, key: bytes, t: float) -> bool:
        if key in self._deleting:
            return True  # its delete is queued or running: whatever a worker saw is going away
        at = self._evicted_at.get(key)
        return at is not None and at >= t

    def _on_deletes_done(self, keys: list[bytes], codes: list[int], status: list[int]) -> None:
        deleting = self._deleting
        index = self._index
        kept: list[bytes] = []
        retry: list[tuple[bytes, int]] = []
        for i, (k, code) in enumerate(zip(keys, codes)):
            n = deleting.get(k, 0) - 1
            if n > 0:
                deleting[k] = n
            else:
                deleting.pop(k, None)
            nbytes = self._unconfirmed.pop(k, None)
            if nbytes is not None:
                self._unconfirmed_bytes -= nbytes
            if code == m.OK:
                self._undeletable.discard(k)
                self._delete_retries.pop(k, None)
                continue
            if code in _NO_ANSWER and nbytes is not None and index is not None and k not in index:
                # The delete got no answer (its worker died, timed out or answered nonsense): the
                # file may be gone or still there. Ask again rather than guess, a few times.
                tries = self._delete_retries.get(k, 0) + 1
                if tries <= _DELETE_RETRIES:
                    self._delete_retries[k] = tries
                    retry.append((k, nbytes))
                    continue
            self._delete_retries.pop(k, None)
            err = status[i] if i < len(status) else 0
            why = (
                errno_mod.errorcode.get(err, str(err)) if err else m.CODE_NAMES.get(code, str(code))
            )
            self.count(
                f"{names.EVICTION_ERRORS}.{why}"
            )  # kvoffload_tier_eviction_errors{tier, errno}
            self._last_removal_error = f"{why}: {os.strerror(err)}" if err else why
            if code == m.CANCELLED or index is None or nbytes is None or k in index:
                continue
            # Still on disk: keep counting it, as the most recently used (retried when it comes
            # up for eviction again); the chunk is intact, so it stays loadable.
            index[k] = nbytes
            self.used_bytes += nbytes
            self._undeletable.add(k)
            kept.append(k)
        if retry:
            for k, nbytes in retry:
                deleting[k] = deleting.get(k, 0) + 1
                self._unconfirmed[k] = self._unconfirmed.get(k, 0) + nbytes
                self._unconfirmed_bytes += nbytes
            self.count("delete_retries", len(retry))
            rkeys = [k for k, _ in retry]
            self._send(
                self._writers, "delete", None, rkeys, m.DeleteTask(self._next_task_id(), rkeys)
            )
        if kept:
            if self.record_events:
                self._events.append(TierEvent(kept, False))
            self._warn(
                f"{len(kept)} chunk file(s) could not be removed "
                f"({self._last_removal_error}); they stay counted and are retried later"
            )
            self._enforce_cap()

    def _on_stores_done(self, keys: list[bytes], failed: dict[bytes, int], removed=()) -> None:
        index = self._index
        if index is None:
            return
        full = 0
        unconfirmed: list[bytes] = []
        for key in keys:
            code = failed.get(key)
            if code in (m.NO_SPACE, m.REJECTED) and key in self._refused:
                n = self._refused.pop(key) - 1  # refused at admission, never written
                if n:
                    self._refused[key] = n
                continue
            nbytes = self._reserved.pop(key, None)
            if code is None:
                if key not in index and key not in removed:
                    index[key] = nbytes or self.file_bytes
                    self.used_bytes += index[key]
            elif code == m.NO_SPACE and nbytes is not None:
                full += 1  # the writer found the disk full (ENOSPC, quota, the free-space floor)
            elif nbytes is not None and key not in index:
                unconfirmed.append(key)
        if unconfirmed:
            self._remove_unconfirmed_stores(unconfirmed)
        if full:
            self._disk_full(full)

    def _remove_unconfirmed_stores(self, keys: list[bytes]) -> None:
        """A write sent to a worker that failed may still have published its file (the worker
        died or timed out after the rename, a verdict we do not know): remove what is not counted,
        so the bytes on disk stay what the cap accounts. Until the delete answers the file counts
        as unconfirmed (as an evicted one); a removal that fails keeps it counted (CASES C32). No
        event: the chunk was never reported stored."""
        deleting, evicted, now = self._deleting, self._evicted_at, time.monotonic()
        fb = self.file_bytes
        for k in keys:
            deleting[k] = deleting.get(k, 0) + 1
            self._unconfirmed[k] = self._unconfirmed.get(k, 0) + fb
            self._unconfirmed_bytes += fb
            evicted[k] = now
            evicted.move_to_end(k)
        while len(evicted) > _EVICTED_MEMORY:
            evicted.popitem(last=False)
        self.count("unconfirmed_store_removals", len(keys))
        tid = self._next_task_id()
        self._send(self._writers, "delete", None, keys, m.DeleteTask(tid, keys))

    def _disk_full(self, chunks: int) -> None:
        """Writes of ``chunks`` chunks found the filesystem full: the cap becomes what the disk
        holds (the bytes counted now), the tier evicts ahead for as many chunks, and a background
        sample of the free space raises the cap again when room comes back (CASES C33)."""
        self.count("disk_full_stores", chunks)
        held = self.used_bytes
        self._disk_cap = held if self._disk_cap is None else min(self._disk_cap, held)
        self._headroom = max(self._headroom, min(chunks * self.file_bytes, held // 2))
        if self._sampler is None:
            self._sampler = _FreeSpaceSampler(self.ns_dir)
        self._sampler.want(True)
        self._warn(
            f"the filesystem of {self.config.root_dir} is full (ENOSPC or below the "
            f"free-space floor of {self.min_free_bytes} bytes): cap lowered to {held} "
            f"bytes; evicting this tier's least recently used chunks to make room"
        )
        self._enforce_cap()

    def _apply_free_space_sample(self) -> None:
        """Raise the lowered cap to what the last free-space sample allows (never lower it: only a
        failed write does, so a sample taken before our own writes cannot undercut them)."""
        sample = self._sampler.latest if self._sampler is not None else None
        if sample is None or sample is self._sample_seen:
            return
        self._sample_seen = sample
        room = max(0, sample[0] - self.min_free_bytes)
        # Files being written or deleted when the sample was taken may be on disk uncounted, never
        # counted twice: this errs low (more eviction), never towards another ENOSPC.
        allowed = self.used_bytes + room
        if allowed > self._disk_cap:
            self._disk_cap = allowed
        if self._disk_cap >= self.max_bytes:
            self._disk_cap = None
            self._sampler.want(False)
            log.info(
                "kvoffload tier %s: room on %s again: cap back to %d bytes",
                self.name,
                self.config.root_dir,
                self.max_bytes,
            )

    def _on_loads_done(self, keys: list[bytes], failed: dict[bytes, int]) -> None:
        index = self._index
        if index is None:
            return
        for key in keys:
            n = self._loading.get(key, 0) - 1
            if n > 0:
                self._loading[key] = n
            else:
                self._loading.pop(key, None)
            code = failed.get(key, m.OK)
            if code == m.OK:
                # A successful read does not prove the file is still there (it may have been
                # removed while open), so only refresh keys already counted.
                if key in index:
                    index.move_to_end(key)
            elif code in (m.MISSING, m.CORRUPT) and key in index:
                self.used_bytes -= index.pop(key)
                self._undeletable.discard(key)

    def submit_load(self, job) -> None:
        if self._index is not None:
            for k in job.keys:
                self._loading[k] = self._loading.get(k, 0) + 1
        super().submit_load(job)

    def _on_scan(self, entries: list[tuple[bytes, int, float]]) -> None:
        index = self._index
        if index is None:
            return
        adopted = 0
        adopted_bytes = 0
        for key, size, _mtime in sorted(entries, key=lambda e: e[2], reverse=True):
            if key in index or key in self._reserved or key in self._unconfirmed:
                continue  # counted already, being written, or being deleted
            index[key] = size
            index.move_to_end(key, last=False)  # older than anything this instance wrote
            self.used_bytes += size
            adopted += 1
            adopted_bytes += size
        self.count("adopted_chunks", adopted)
        if self._default_free is not None and adopted_bytes:
            self.max_bytes = int(DEFAULT_FREE_FRACTION * (self._default_free + adopted_bytes))
            log.info(
                "kvoffload tier %s: %d bytes of chunks found at start: default cap %d bytes",
                self.name,
                adopted_bytes,
                self.max_bytes,
            )
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Evict (never retrying a failed removal) until the counted bytes fit under the cap, less
        the headroom kept while space is reused only once confirmed; send the deletes."""
        if self._index is not None:
            if self._cautious():
                target = self.capacity_bytes - self._headroom
            else:
                self._headroom = 0
                target = self.capacity_bytes
            while self.used_bytes + self._reserved_bytes() > target:
                if not self._evict_one(protect=set()):
                    break
        self._flush_deletes()

    def remove(self, keys: list[bytes]) -> None:
        """Delete chunks from the tier (explicit removal); in-flight loads of them still finish with
        the whole chunk or a clean miss. A file whose removal fails stays counted."""
        index = self._index
        for k in keys:
            if index is not None and k in index:
                nbytes = index.pop(k)
                self.used_bytes -= nbytes
                self._unconfirmed[k] = self._unconfirmed.get(k, 0) + nbytes
                self._unconfirmed_bytes += nbytes
            self._present.pop(k, None)
            self._mark_absent(k, self.config.negative_ttl_s)
            self._delete_queue.append(k)
        self._flush_deletes()

    @property
    def accounted_bytes(self) -> int:
        """Bytes of chunk files this tier counts against its cap (0 when unbounded); files whose
        delete has not answered yet are no longer counted."""
        return self.used_bytes

    def report_metrics(self, metrics) -> None:
        super().report_metrics(metrics)
        cap = self.capacity_bytes
        if cap is not None:
            metrics.set("kvoffload_tier_used_bytes", self.used_bytes, self.name)
            metrics.set("kvoffload_tier_capacity_bytes", cap, self.name)

    def flush(self) -> None:
        super().flush()
        if self._disk_cap is not None:
            self._apply_free_space_sample()
        self._flush_deletes()

    def shutdown(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
        super().shutdown()
