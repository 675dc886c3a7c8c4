"""The in-memory reference tier (``type: "memory"``): chunks copied into engine-process bytes objects.

The smallest correct :class:`~kvoffload.tiers.base.SecondaryTierManager` and the model for new tiers:
it copies bytes out of pinned host slots on store and into reserved slots on load, keeps an LRU within
``max_bytes``, and reports every job through :meth:`get_finished_jobs`. Its copies run in the calling
thread, so it suits tests and small caches, not production-sized tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
import numpy as np
from typing_extensions import override

from kvoffload.config import Bytes
from kvoffload.tiers.base import (
    KNOWN_PRESENT,
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    TierEvent,
)


class MemoryTierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``{"type": "memory", "max_bytes": ...}``.

    Attributes:
        max_bytes: capacity in payload bytes; least recently used chunks are dropped beyond it.
    """

    max_bytes: Bytes


class MemoryTier(SecondaryTierManager):
    """In-memory reference tier; see the module docstring."""

    config_class = MemoryTierConfig
    config: MemoryTierConfig
    medium = "CPU"
    shared = False

    def __init__(
        self,
        *,
        name: str,
        arena_view: memoryview,
        namespace: Any,
        config: MemoryTierConfig,
        arena: Any = None,
    ):
        super().__init__(name=name, arena_view=arena_view, namespace=namespace, config=config)
        self._rows = np.asarray(arena_view)
        self._chunks: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []

    @override
    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        return LookupResult.HIT if key in self._chunks else LookupResult.MISS

    @override
    def known_present(self, key: bytes) -> bool:
        return key in self._chunks

    @override
    def submit_store(self, job: JobMetadata) -> None:
        stored, evicted, nbytes = [], [], 0
        for key, slot in zip(job.keys, job.slots):
            if key in self._chunks:
                self._chunks.move_to_end(key)
                continue
            data = self._rows[slot].tobytes()
            self._chunks[key] = data
            self._bytes += len(data)
            nbytes += len(data)
            stored.append(key)
            while self._bytes > self.config.max_bytes and self._chunks:
                old, old_data = self._chunks.popitem(last=False)
                self._bytes -= len(old_data)
                evicted.append(old)
        if self.record_events:
            if stored:
                self._events.append(TierEvent(stored, False))
            if evicted:
                self._events.append(TierEvent(evicted, True))
        self.count("store_chunks", len(stored))
        known = len(job.keys) - len(stored)
        self._finished.append(
            JobResult(
                job_id=job.job_id,
                success=True,
                transfer_bytes=nbytes,
                deduplicated={KNOWN_PRESENT: known} if known else {},
            )
        )

    @override
    def submit_load(self, job: JobMetadata) -> None:
        ok, failed, nbytes = [], {}, 0
        for key, slot in zip(job.keys, job.slots):
            data = self._chunks.get(key)
            if data is None:
                failed[key] = "missing"
                continue
            self._rows[slot] = np.frombuffer(data, dtype=np.uint8)
            self._chunks.move_to_end(key)
            nbytes += len(data)
            ok.append(key)
        self.count("load_chunks", len(ok))
        if failed:
            self._finished.append(
                JobResult(
                    job_id=job.job_id,
                    success=False,
                    successful_keys=ok,
                    reason=f"missing={len(failed)}",
                    failed=failed,
                    transfer_bytes=nbytes,
                )
            )
        else:
            self._finished.append(JobResult(job_id=job.job_id, success=True, transfer_bytes=nbytes))

    @override
    def get_finished_jobs(self) -> list[JobResult]:
        out, self._finished = self._finished, []
        return out

    @override
    def touch(self, keys) -> None:
        for k in keys:
            if k in self._chunks:
                self._chunks.move_to_end(k)

    @override
    def take_events(self) -> list[TierEvent]:
        out, self._events = self._events, []
        return out

    def lose(self, key: bytes) -> bool:
        """Drop ``key``'s chunk as if its storage had lost it: no event, no eviction counted (fault
        injection for tests and the tier contract suite). Returns whether it was stored."""
        data = self._chunks.pop(key, None)
        if data is None:
            return False
        self._bytes -= len(data)
        return True

    @override
    def shutdown(self) -> None:
        self._chunks.clear()
        self._bytes = 0
