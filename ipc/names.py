"""Names that cross a process or module boundary, each defined once here.

- The environment variable that hands a tier worker its spec (:data:`WORKER_SPEC_ENV`), and its
  task marker (:data:`WORKER_MARKER_FD_ENV`): set by the engine's worker pool, read by
  ``kvoffload.workers.main``; the p2p peer worker's
  (:data:`PEER_WORKER_SPEC_ENV`), read by ``kvoffload.workers.p2p_worker``.
- The default topics of the KV-events PUB socket (:data:`EVENTS_TOPIC`, :data:`MOVEMENTS_TOPIC`):
  defaults of ``kv_events.topic`` / ``kv_events.movements_topic``, and what ``kvoffload top``
  subscribes to unless told otherwise.
- Tier counter names that one side counts and another reads: worker-side counts travel in
  ``TaskResult.counters`` and are added to the tier's counters; the engine exports every tier
  counter as ``kvoffload_tier_events_total{tier, event}``, except those with a metric of their own
  (``worker_restarts``, ``evictions``) and the families in :data:`TIER_COUNTER_FAMILIES`.

Imports nothing (``kvoffload.ipc`` is the bottom layer: engine, workers and tools all import it).
"""

from __future__ import annotations

WORKER_SPEC_ENV = "KVOFFLOAD_WORKER"
"""Environment variable holding a tier worker's ``WorkerSpec`` as JSON."""
WORKER_MARKER_FD_ENV = "KVOFFLOAD_WORKER_MARKER_FD"
"""Environment variable holding the descriptor number of a tier worker's task marker: a memfd of
``8 * (1 + io_threads)`` bytes the engine's worker pool creates and passes to the worker. Slot 0
belongs to the worker's loop, slot ``1 + i`` to its I/O thread ``i``; each stores there (signed
64-bit, native byte order) the id of the task it is running, -1 when none (0: never written)."""
PEER_WORKER_SPEC_ENV = "KVOFFLOAD_PEER_WORKER"
"""Environment variable holding the p2p peer worker's ``PeerWorkerSpec`` as JSON."""

EVENTS_TOPIC = "kv-events"
"""Default topic of vLLM-format ``KVEventBatch`` messages."""
MOVEMENTS_TOPIC = "kvoffload-movements"
"""Default topic of chunk-movement batches (``kvoffload.events.MovementBatch``)."""

# -- tier counters counted by the engine side (SecondaryTierManager.count) ------------------------
WORKER_RESTARTS = "worker_restarts"
"""Workers replaced after dying or hanging (metric ``kvoffload_tier_worker_restarts``)."""
JOB_TIMEOUTS = "job_timeouts"
"""Tasks that ran past ``job_timeout_s`` (their worker is killed)."""
EVICTIONS = "evictions"
"""Chunks evicted by a capacity-bounded tier (metric ``kvoffload_tier_evictions``)."""
EVICTION_ERRORS = "eviction_errors"
"""Family: chunk removals that failed, counted as ``eviction_errors.<errno name>``."""

# -- tier counters counted inside worker processes (kvoffload.workers.counters) -------------------
TASK_ERRORS = "task_errors"
"""Unexpected errors a worker contained, each failing its key with ``ERROR`` (CASES C25)."""
RETRIES = "retries"
"""Request retries made by the object store client (botocore's ``RetryAttempts``)."""
CORRUPT_REMOVED = "corrupt_removed"
"""Chunks found corrupt on load and removed."""
FORGED_REMOVED = "forged_removed"
"""Chunks whose integrity MAC was missing or wrong on load (the tier has a key), removed."""
DECRYPT_FAILURES = "decrypt_failures"
"""Chunks whose AES-GCM tag did not verify on load (the tier encrypts: ``encryption_key_env``):
changed on the medium, or moved from another tenant's, key's or namespace's place; a miss,
removed and counted among ``forged_removed`` too."""
SYMLINKS_REMOVED = "symlinks_removed"
"""Symbolic links an fs worker met inside its root, where a shard directory, a chunk file or a
temporary file belongs, and removed without following them (CASES C43)."""
STALE_TEMP_REMOVED = "stale_temp_removed"
"""Orphaned temporary files removed by a scan (CASES C29)."""
DIRECT_IO_FALLBACKS = "direct_io_fallbacks"
"""Transfers redone with buffered I/O after the filesystem refused O_DIRECT (CASES C31)."""
STORE_ALREADY_PRESENT = "store_already_present"
"""Stores that found the chunk file already there (not rewritten)."""
BELOW_FREE_FLOOR = "below_free_floor"
"""Stores refused because they would leave less than the free-space floor."""

TIER_COUNTER_FAMILIES: dict[str, str] = {EVICTION_ERRORS: "kvoffload_tier_eviction_errors"}
"""A tier's counters named ``<family>.<value>`` (counted engine side with ``count`` or in a worker
with ``kvoffload.workers.counters.count``) for a family listed here are exported as that metric,
with ``value`` as its second label, instead of as a ``kvoffload_tier_events_total`` event:
``eviction_errors.EACCES`` -> ``kvoffload_tier_eviction_errors_total{tier, errno="EACCES"}``
(workers count those with ``kvoffload.workers.counters.count_errno``)."""
