"""The filesystem tier (``type: "fs"``): one file per chunk under ``root_dir``, I/O in worker processes.

Layout, format and atomicity are described in :mod:`kvoffload.workers.fs_io` and
:mod:`kvoffload.workers.chunkfile`. Several engines may share one ``root_dir`` (local disk, NFS,
Lustre...): chunk names depend only on the namespace and the chunk key, so they share chunks, and
writes are atomic renames, so no reader sees a torn file.

Capacity: with ``max_bytes`` set, the tier keeps an LRU index of the namespace's files (the files
found at start are adopted, oldest first, and counted) and deletes the least recently used chunks
to stay within ``max_bytes`` of file bytes, headers included. The cap applies per namespace, as seen
by this instance: chunks that another instance writes into the same directory after this one started
are not counted here. A store that fails once a worker has it may still have published its file (the
worker died or timed out after the rename): that file is removed, so the disk holds what is counted.
Without ``max_bytes`` the tier never deletes anything but corrupt files.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any, Literal

from kvoffload.config import Positive
from kvoffload.ipc import messages as m
from kvoffload.tiers.process import ProcessTierConfig, ProcessTierManager
from kvoffload.tiers.base import TierEvent
from kvoffload.workers import chunkfile as cf
from kvoffload.workers import fs_io

_SCAN_TIMEOUT_S = 600.0
# Evictions remembered to spot probes that saw a file just before it was deleted.
_EVICTED_MEMORY = 65536


class FsTierConfig(ProcessTierConfig, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "fs", "root_dir": ..., ...}`` (plus :class:`ProcessTierConfig`'s fields).

    Attributes:
        root_dir: directory holding the tier (created if missing; must be writable).
        max_bytes: cap on this namespace's file bytes; LRU chunks are deleted to stay under it.
            None (default): no cap.
        fsync: fsync every chunk file and directory before reporting it stored.
        direct_io: transfers that bypass the page cache with O_DIRECT: ``both`` (default: chunks
            stream between the arena and the disk without page-cache copies or dirty-page
            throttling; the host tier is the cache), ``writes``, ``reads`` or ``none``. Falls back
            to buffered I/O where the filesystem refuses O_DIRECT (tmpfs).
    """

    root_dir: str
    max_bytes: Positive | None = None
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


class FsTier(ProcessTierManager):
    """Filesystem secondary tier; see the module docstring."""

    config_class = FsTierConfig
    io_module = "kvoffload.workers.fs_io"
    medium = "STORAGE"
    shared = True

    def __init__(self, *, name: str, arena_view: memoryview, namespace: Any,
                 config: FsTierConfig, arena: Any):
        super().__init__(name=name, arena_view=arena_view, namespace=namespace, config=config,
                         arena=arena)
        self.ns_id = namespace.id()
        self.ns_dir = os.path.join(config.root_dir, self.ns_id)
        self.file_bytes = cf.HEADER_BYTES + self.row_bytes
        if config.max_bytes is not None and config.max_bytes < self.file_bytes:
            raise ValueError(
                f"max_bytes: {config.max_bytes} is smaller than one chunk file "
                f"({self.file_bytes} bytes)"
            )
        self._write_namespace_config()
        # Capacity accounting (only with max_bytes): LRU of known files -> stored bytes.
        self._index: OrderedDict[bytes, int] | None = (
            OrderedDict() if config.max_bytes is not None else None
        )
        self.used_bytes = 0
        self._reserved: dict[bytes, int] = {}
        self._loading: dict[bytes, int] = {}
        self._delete_queue: list[bytes] = []
        self._deleting: dict[bytes, int] = {}  # evicted keys whose delete task has not answered
        self._evicted_at: OrderedDict[bytes, float] = OrderedDict()  # recent evictions (monotonic s)
        self.start()
        # Remove orphaned temporary files (by age only: CASES C29); with a cap, also adopt chunks.
        tid = self._next_task_id()
        self._send(self._writers, "scan", None, [],
                   m.ScanTask(tid, list_entries=self._index is not None), timeout_s=_SCAN_TIMEOUT_S)

    def io_config(self) -> dict:
        c = self.config
        return {"root_dir": c.root_dir, "namespace_id": self.ns_id, "row_bytes": self.row_bytes,
                "fsync": c.fsync, "direct_io": c.direct_io,
                "stale_temp_age_s": fs_io.stale_temp_age_s(c.job_timeout_s)}

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

    # -- capacity hooks -------------------------------------------------------------------------

    def _admit_store(self, keys: list[bytes]) -> tuple[list[int], dict[bytes, int]]:
        index = self._index
        if index is None:
            return list(range(len(keys))), {}
        cap = self.config.max_bytes
        fb = self.file_bytes
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
                self.count("store_skipped_deleting")
                continue
            while self.used_bytes + self._reserved_bytes() + fb > cap:
                if not self._evict_one(protect=set(keys)):
                    break
            if self.used_bytes + self._reserved_bytes() + fb > cap:
                rejected[k] = m.NO_SPACE
                continue
            self._reserved[k] = fb
            admitted.append(i)
        self._flush_deletes()
        return admitted, rejected

    def _reserved_bytes(self) -> int:
        return len(self._reserved) * self.file_bytes

    def _evict_one(self, protect: set[bytes]) -> bool:
        index = self._index
        for k in index:
            if k in self._loading or k in protect:
                continue
            self.used_bytes -= index.pop(k)
            self._present.pop(k, None)
            self._delete_queue.append(k)
            evicted = self._evicted_at
            evicted[k] = time.monotonic()
            evicted.move_to_end(k)
            if len(evicted) > _EVICTED_MEMORY:
                evicted.popitem(last=False)
            self.count("evictions")
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
            batch = keys[start:start + 256]
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

    def _on_deletes_done(self, keys: list[bytes]) -> None:
        deleting = self._deleting
        for k in keys:
            n = deleting.get(k, 0) - 1
            if n > 0:
                deleting[k] = n
            else:
                deleting.pop(k, None)

    def _on_stores_done(self, keys: list[bytes], failed: dict[bytes, int],
                        removed=()) -> None:
        index = self._index
        if index is None:
            return
        unconfirmed = []
        for key in keys:
            fb = self._reserved.pop(key, None)
            if key not in failed:
                if key not in index and key not in removed:
                    index[key] = fb or self.file_bytes
                    self.used_bytes += index[key]
            elif fb is not None and key not in index:
                unconfirmed.append(key)
        if unconfirmed:
            # A write sent to a worker that failed may still have published its file (the worker
            # died or timed out after the rename, a verdict we do not know): remove what is not
            # counted, so the bytes on disk stay what the cap accounts (no event: never stored).
            deleting, evicted, now = self._deleting, self._evicted_at, time.monotonic()
            for k in unconfirmed:
                deleting[k] = deleting.get(k, 0) + 1
                evicted[k] = now
                evicted.move_to_end(k)
            while len(evicted) > _EVICTED_MEMORY:
                evicted.popitem(last=False)
            self.count("unconfirmed_store_removals", len(unconfirmed))
            tid = self._next_task_id()
            self._send(self._writers, "delete", None, unconfirmed, m.DeleteTask(tid, unconfirmed))

    def submit_load(self, job) -> None:
        if self._index is not None:
            for k in job.keys:
                self._loading[k] = self._loading.get(k, 0) + 1
        super().submit_load(job)

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

    def _on_scan(self, entries: list[tuple[bytes, int, float]]) -> None:
        index = self._index
        if index is None:
            return
        adopted = 0
        for key, size, _mtime in sorted(entries, key=lambda e: e[2], reverse=True):
            if key in index or key in self._reserved:
                continue
            index[key] = size
            index.move_to_end(key, last=False)  # older than anything this instance wrote
            self.used_bytes += size
            adopted += 1
        self.count("adopted_chunks", adopted)
        self._enforce_cap()

    def _enforce_cap(self) -> None:
        cap = self.config.max_bytes
        while self.used_bytes + self._reserved_bytes() > cap:
            if not self._evict_one(protect=set()):
                break
        self._flush_deletes()

    def remove(self, keys: list[bytes]) -> None:
        """Delete chunks from the tier (explicit removal); in-flight loads of them still finish with
        the whole chunk or a clean miss."""
        for k in keys:
            if self._index is not None and k in self._index:
                self.used_bytes -= self._index.pop(k)
            self._present.pop(k, None)
            self._mark_absent(k, self.config.negative_ttl_s)
            self._delete_queue.append(k)
        self._flush_deletes()

    @property
    def accounted_bytes(self) -> int:
        """Bytes this tier counts against ``max_bytes`` (0 without a cap)."""
        return self.used_bytes

    def flush(self) -> None:
        super().flush()
        self._flush_deletes()

