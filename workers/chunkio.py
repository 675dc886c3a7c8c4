"""The worker-side I/O contract: what a tier's I/O module gives the worker loop, and what it answers.

::

    worker loop (main.py) ──store(key, arena row) / load(key, arena row)──▶ ChunkIO ◀──▶ storage
                          ──probe(key) / delete(key) / scan()─────────────▶
                          ◀──────────────── IOOutcome(code, nbytes, detail, status) per key

A tier names its I/O module (``io_module``, e.g. ``kvoffload.workers.fs_io``); the worker imports it
and calls its ``make_io(config, faults)`` (see :class:`MakeIO`) with the tier's I/O config, decoded as
the module's ``IO_CONFIG`` struct (:mod:`kvoffload.workers.ioconfig`); it returns a :class:`ChunkIO`.
Every per-key call answers one :class:`IOOutcome`; the worker loop turns them into the task's
:class:`~kvoffload.ipc.messages.TaskResult`. An I/O module reports the failures it understands as
codes (``MISSING``, ``CORRUPT``, ``IO_ERROR``, ...); anything it raises is contained by the worker
loop: an ``OSError`` fails that key with ``IO_ERROR``, any other exception with ``ERROR`` (CASES C25),
and an answer that is not a valid :class:`IOOutcome` with ``ERROR`` too.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from kvoffload.ipc import messages as m
from kvoffload.workers.faults import Faults

WORKER_CODES = frozenset(
    {
        m.OK,
        m.MISSING,
        m.CORRUPT,
        m.IO_ERROR,
        m.NO_SPACE,
        m.REJECTED,
        m.ERROR,
        m.FORGED,
        m.UNSAFE_PATH,
    }
)
"""Codes an I/O module may answer (``TIMEOUT``, ``WORKER_DIED``, ``CANCELLED`` are the engine's)."""


class IOOutcome(msgspec.Struct, frozen=True, gc=False):
    """The outcome of one I/O call for one key.

    Attributes:
        code: one of :data:`WORKER_CODES` (:mod:`kvoffload.ipc.messages` ``OK``, ``MISSING``, ...).
        nbytes: bytes moved to or from storage, header included (bytes; 0 on failure).
        detail: why it failed, for logs and the job's reason (empty on success).
        status: the storage protocol's status where there is one (an HTTP status), else 0.
        free_bytes: ``NO_SPACE`` only: the bytes the medium had free for this writer just after
            the failure (fs: ``statvfs`` ``f_bavail * f_frsize``), so the engine frees only what a
            real shortage needs (CASES C52); 0 when the shortage does not show there (a quota,
            no inode left); -1 (default) when not measured (the engine then takes the medium
            as full).
        present: a store answered ``OK`` without writing: the chunk was already stored (by
            another instance sharing the medium, or earlier), so ``nbytes`` is 0 (answer
            :data:`OK_PRESENT`). The engine counts such stores apart from chunks written
            (``kvoffload_tier_deduplicated_chunks_total{reason="found_present"}``, CASES C50).
    """

    code: int
    nbytes: int = 0
    detail: str = ""
    status: int = 0
    free_bytes: int = -1
    present: bool = False

    def problem(self) -> str | None:
        """What makes this outcome invalid (a wrong type, an unknown code), or None when valid.
        msgspec does not check types at construction, so the worker loop checks an I/O module's
        answers before they go on the wire."""
        if type(self.code) is not int or self.code not in WORKER_CODES:
            return f"code {self.code!r} is not one of {sorted(WORKER_CODES)}"
        if type(self.nbytes) is not int or self.nbytes < 0:
            return f"nbytes {self.nbytes!r} is not a byte count"
        if not isinstance(self.detail, str):
            return f"detail {self.detail!r} is not a string"
        if type(self.status) is not int:
            return f"status {self.status!r} is not an integer"
        if type(self.free_bytes) is not int or self.free_bytes < -1:
            return f"free_bytes {self.free_bytes!r} is not a byte count (or -1: not measured)"
        if type(self.present) is not bool:
            return f"present {self.present!r} is not a bool"
        if self.present and (self.code != m.OK or self.nbytes):
            return "present (nothing written) goes only with code OK and nbytes 0"
        return None


OK_EMPTY = IOOutcome(m.OK)
"""Success that moved no bytes (a probe that found the chunk, a delete)."""
OK_PRESENT = IOOutcome(m.OK, present=True)
"""A store that found the chunk already stored and wrote nothing (counted apart from chunks
written, CASES C50)."""


@runtime_checkable
class ChunkIO(Protocol):
    """One tier's I/O inside a worker process. Methods may be called from several I/O threads at
    once (``WorkerSpec.io_threads``); rows are arena rows, ``(row_bytes,)`` uint8 memoryviews."""

    def store(self, key: bytes, src: memoryview) -> IOOutcome:
        """Copy arena row ``src`` to storage under chunk ``key`` (atomically: whole or nothing).
        ``nbytes``: bytes written (header included); a chunk already stored and not written
        again answers :data:`OK_PRESENT`."""
        ...

    def load(self, key: bytes, dst: memoryview) -> IOOutcome:
        """Copy chunk ``key`` into arena row ``dst``, verified (``CORRUPT`` when it is not the
        chunk stored under ``key``, ``FORGED`` when the tier has an integrity key and the chunk
        was not written with it; the bad copy is removed). ``nbytes``: bytes read."""
        ...

    def probe(self, key: bytes) -> IOOutcome:
        """Whether chunk ``key`` exists: ``OK`` present, ``MISSING`` absent."""
        ...

    def delete(self, key: bytes) -> IOOutcome:
        """Remove chunk ``key`` (eviction); an absent chunk is ``OK``."""
        ...

    def scan(self) -> list[tuple[bytes, int, float]]:
        """``(key, stored bytes, mtime seconds since the epoch)`` of every chunk of the namespace;
        removes orphaned temporary files on the way."""
        ...


# Optional, for tenants (kvoffload.tenants): an I/O module that keeps tenants apart gives its
# ChunkIO two more methods. ``for_tenant(tenant_id: str) -> ChunkIO``: the same I/O for that
# tenant's chunks (fs and obj: below ``<namespace>/t-<tenant id>/``; ValueError for a string that
# is no tenant id), which the worker uses for a task naming a tenant; ``tenant_ids() -> list[str]``:
# the tenants holding chunks of the namespace, whose chunks a scan then lists too. A module
# without ``for_tenant`` fails a tenant's tasks with ``ERROR``: never the namespace's own storage.


class MakeIO(Protocol):
    """The ``make_io`` entry point of an I/O module."""

    def __call__(self, config: Any, faults: Faults) -> ChunkIO:
        """Build the module's :class:`ChunkIO` from the tier's I/O config: an instance of the
        module's ``IO_CONFIG`` (a tagged :class:`~kvoffload.workers.ioconfig.IOConfig` struct,
        decoded by the worker from ``WorkerSpec.io_config``)."""
        ...
