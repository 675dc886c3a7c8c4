"""Engine side of a tier whose I/O runs in worker processes (the fs tier; the obj tier reuses it).

::

    lookup(key) ─▶ verdict cache ── known ──▶ HIT / MISS
                        └─ unknown ─▶ queue an existence probe, answer RETRY
    flush() ──────▶ ProbeTask batches ─────────▶ reader workers ─┐
    submit_load ──▶ LoadTask(s) ───────────────▶ reader workers ─┤ results socket
    submit_store ─▶ StoreTask(s) ──────────────▶ writer workers ─┤
    get_finished_jobs() ◀── drain results, check worker health ◀─┘

Nothing here blocks: tasks are encoded and handed to ZMQ, results are drained with non-blocking reads,
and worker health is checked by ``poll()`` on the child processes at most every 20 ms. A job is split
into tasks of ``chunks_per_task`` chunks spread over the workers; its one :class:`JobResult` comes when
the last task answers. Verdicts: a probe or a successful store makes a key present; a probe that finds
nothing makes it absent for ``negative_ttl_s``; a failed load makes it absent for ``failed_load_ttl_s``,
so a request never spins on a chunk that cannot be read (CASES C07). However short those lifetimes
(0 included), a request told RETRY while a probe was out, or whose load of the key failed, is owed
the verdict: its next lookup of that key answers MISS, so it waits at most one probe round trip
(bounded by ``job_timeout_s``), never a probe after probe (CASES C36).
"""

from __future__ import annotations

import logging
import os
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import zmq

from kvoffload.config import Positive, apply_aliases
from kvoffload.ipc import messages as m
from kvoffload.ipc.channels import LOADS, STORES, TierChannels
from kvoffload.logs import RateLimitedLog
from kvoffload.tiers.base import (
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    TierEvent,
)
from kvoffload.tiers.breaker import HALF_OPEN, OPEN, STATES, CircuitBreaker
from kvoffload.workerpool import PoolTask, WorkerPool

log = logging.getLogger("kvoffload.tiers")

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
_CHECK_INTERVAL_S = 0.02
_PROBE_BATCH = 256
_OWED_MAX = 65536  # keys with a MISS owed to a request that may never ask again (aborted)
_MAX_SECONDS = 86400.0  # a day: every duration setting is finite (inf would disable what it bounds)
Seconds = Annotated[float, msgspec.Meta(gt=0, le=_MAX_SECONDS)]
TTLSeconds = Annotated[float, msgspec.Meta(ge=0, le=_MAX_SECONDS)]


class ProcessTierConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Settings shared by worker-backed tiers.

    Attributes:
        read_workers: reader processes (loads and existence probes).
        write_workers: writer processes (stores, deletes, scans).
        job_timeout_s: a task unanswered this long kills its worker and fails (seconds, at most
            86400: every duration setting is finite).
        max_inflight_per_worker: tasks queued inside one worker at a time.
        chunks_per_task: chunks per task a job is split into; None (default) sizes tasks to about
            8 MiB (between 1 and 64 chunks), so small chunks do not pay one message each.
        max_pending_store_chunks: chunks of stores in flight beyond which new stores are dropped
            (and counted) instead of pinning more host slots.
        negative_ttl_s: how long a "not found" probe verdict is trusted (seconds, 0 to 86400; 0:
            not kept, though the requests that waited for the probe still get its MISS).
        failed_load_ttl_s: how long a key whose load failed answers MISS (seconds, 0 to 86400;
            with 0, the request whose load failed still gets one MISS).
        lookup_cache_entries: bound on remembered "present" verdicts.
        io_threads: chunks of one task each worker moves at once (threads inside the worker).
        worker_nice: niceness added to worker processes (0-19).
        breaker_failures: consecutive failed tasks (transport errors, 5xx, timeouts, dead workers)
            that open the circuit breaker (:mod:`kvoffload.tiers.breaker`): lookups then answer
            MISS and stores are dropped (and counted) for ``breaker_cooldown_s``, after which it is
            half-open: ``breaker_trial_requests`` requests try the tier again. None disables the
            breaker.
        breaker_cooldown_s: how long the breaker stays open (seconds; doubles while the tier keeps
            failing, up to 16 times).
        breaker_trial_requests: requests (a lookup that needs the tier, a store job) let through
            at once while the breaker is half-open; the others are refused as while open until
            a trial answers (success closes the breaker, failure reopens it).
        read_io_threads, write_io_threads: chunks the reader / writer workers move at once, in
            total (vLLM's ``n_read_threads`` / ``n_write_threads``); each worker of that side runs
            ``ceil(total / workers)`` I/O threads. None (default): ``io_threads`` per worker.
        locality: ``LOCAL`` or ``REMOTE`` (vLLM's key): where this tier's storage is, relative
            to this instance, as reported in KV events; None: the tier type's own (fs local,
            obj remote).
        enable_kv_events, backpressure: vLLM's keys, accepted and not acted on (see
            :data:`kvoffload.config.VLLM_ONLY_TIER_KEYS`).
        faults: fault injection for tests (see ``Fault``).
    """

    vllm_aliases: ClassVar[dict[str, str]] = {
        "n_read_threads": "read_io_threads",
        "n_write_threads": "write_io_threads",
    }

    read_workers: Positive = 2
    write_workers: Positive = 2
    job_timeout_s: Seconds = 30.0
    max_inflight_per_worker: Positive = 8
    chunks_per_task: Positive | None = None
    max_pending_store_chunks: Positive = 4096
    negative_ttl_s: TTLSeconds = 2.0
    failed_load_ttl_s: TTLSeconds = 60.0
    lookup_cache_entries: Positive = 1_000_000
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    worker_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    breaker_failures: Positive | None = None
    breaker_cooldown_s: Seconds = 5.0
    breaker_trial_requests: Positive = 2
    read_io_threads: Positive | None = None
    write_io_threads: Positive | None = None
    locality: Literal["LOCAL", "REMOTE"] | None = None
    enable_kv_events: bool = False
    backpressure: dict[str, Any] | None = None
    faults: list[m.Fault] = []

    @classmethod
    def from_vllm_keys(cls, body: dict[str, Any], where: str) -> tuple[dict, dict[str, str]]:
        """Rename vLLM 0.33's key names for this tier to ours (``n_read_threads`` ->
        ``read_io_threads``, ...).

        Returns:
            ``(body with our names, our name -> the name as written)``.

        Raises:
            ConfigError: a setting given under both names.
        """
        renamed: dict[str, str] = {}
        body = dict(body)
        apply_aliases(body, cls.vllm_aliases, where, renamed)
        return body, renamed

    def io_threads_for(self, total: int | None, workers: int) -> int:
        """I/O threads per worker of one side: ``ceil(total / workers)``, or ``io_threads``."""
        return self.io_threads if total is None else -(-total // workers)

    def check_io_threads(self, read_workers: int, write_workers: int) -> None:
        """Raises ValueError (``"<key>: <why>"``) when a side needs over 64 threads a worker."""
        for key, total, workers, wkey in (
            ("read_io_threads", self.read_io_threads, read_workers, "read_workers"),
            ("write_io_threads", self.write_io_threads, write_workers, "write_workers"),
        ):
            if total is not None and self.io_threads_for(total, workers) > 64:
                raise ValueError(
                    f"{key}: {total} threads over {workers} {wkey} is more than 64 "
                    f"a worker; raise {wkey}"
                )


class _Job:
    __slots__ = ("meta", "pending", "failed", "status", "nbytes", "t0", "is_load")

    def __init__(self, meta: JobMetadata, is_load: bool):
        self.meta = meta
        self.pending = 0
        self.failed: dict[bytes, int] = {}
        self.status: dict[bytes, int] = {}
        self.nbytes = 0
        self.t0 = time.monotonic()
        self.is_load = is_load


class _TaskRec:
    __slots__ = ("kind", "job", "keys", "t0")

    def __init__(self, kind: str, job: _Job | None, keys: list[bytes]):
        self.kind = kind
        self.job = job
        self.keys = keys
        self.t0 = time.monotonic()


def summarize(codes: Iterable[int]) -> str:
    counts: dict[str, int] = {}
    for c in codes:
        name = m.CODE_NAMES.get(c, str(c))
        counts[name] = counts.get(name, 0) + 1
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


class ProcessTierManager(SecondaryTierManager):
    """Base for tiers whose I/O runs in :mod:`kvoffload.workers` processes.

    Subclasses set ``io_module`` (the worker-side module with ``make_io``) and implement
    :meth:`io_config`; they may override the ``_admit_store`` / ``_on_*`` hooks for capacity
    accounting.
    """

    config_class: ClassVar[type[msgspec.Struct]] = ProcessTierConfig
    io_module: ClassVar[str]
    shared = True

    def __init__(
        self,
        *,
        name: str,
        arena_view: memoryview,
        namespace: Any,
        config: ProcessTierConfig,
        arena: Any,
    ):
        super().__init__(name=name, arena_view=arena_view, namespace=namespace, config=config)
        if config.locality is not None:
            self.locality = config.locality
        self.arena = arena
        self.row_bytes = arena_view.strides[0]
        cfg = config
        self.chunks_per_task = cfg.chunks_per_task or max(1, min(64, (8 << 20) // self.row_bytes))
        self._present: OrderedDict[bytes, None] = OrderedDict()
        self._absent: dict[bytes, float] = {}
        self._probing: set[bytes] = set()
        self._waiting: dict[bytes, set[str]] = {}  # key probing -> requests told RETRY meanwhile
        self._owed: OrderedDict[bytes, set[str]] = OrderedDict()  # key -> requests owed a MISS
        self._probe_queue: list[bytes] = []
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []
        self._task_ids = 0
        self._job_count = 0
        self._pending_store_chunks = 0
        self._last_check = 0.0
        self._closed = False
        self._bad_reply_log = RateLimitedLog(log)
        self.breaker: CircuitBreaker | None = (
            CircuitBreaker(
                cfg.breaker_failures,
                cfg.breaker_cooldown_s,
                cfg.breaker_trial_requests,
                trial_timeout_s=cfg.job_timeout_s,
            )
            if cfg.breaker_failures is not None
            else None
        )
        self._ctx: zmq.Context | None = None
        self._pools: tuple[WorkerPool, ...] = ()

    def start(self) -> None:
        """Open the tier's sockets and start its worker processes. Subclasses call it last in
        their constructor, once their own checks passed (nothing is left to clean up before)."""
        cfg = self.config
        self._ctx = zmq.Context(1)
        self._chans = TierChannels(self._ctx, self.name)
        common = dict(
            channels=self._chans,
            task_timeout_s=cfg.job_timeout_s,
            max_inflight=cfg.max_inflight_per_worker,
            on_event=self._on_pool_event,
        )
        self._readers = WorkerPool(
            tier_name=self.name,
            kind=LOADS,
            count=cfg.read_workers,
            make_spec=lambda wid, ident: self._spec(wid, ident, LOADS),
            **common,
        )
        self._writers = WorkerPool(
            tier_name=self.name,
            kind=STORES,
            count=cfg.write_workers,
            make_spec=lambda wid, ident: self._spec(wid, ident, STORES),
            **common,
        )
        self._pools = (self._readers, self._writers)
        for pool in self._pools:
            pool.start()

    # -- subclass interface ---------------------------------------------------------------------

    @abstractmethod
    def io_config(self) -> dict:
        """The ``io_config`` dict handed to worker processes."""

    def _admit_store(self, keys: list[bytes]) -> tuple[list[int], dict[bytes, int]]:
        """Which positions of ``keys`` to write; the rest fail with the returned codes."""
        return list(range(len(keys))), {}

    def _on_stores_done(
        self, keys: list[bytes], failed: dict[bytes, int], removed: Collection[bytes] = ()
    ) -> None:
        """A store job finished: ``failed`` maps the keys that failed to their codes."""

    def _on_loads_done(self, keys: list[bytes], failed: dict[bytes, int]) -> None:
        """A load job finished: ``failed`` maps the keys that failed to their codes."""

    def _on_deletes_done(self, keys: list[bytes], codes: list[int], status: list[int]) -> None:
        """A delete task answered: ``codes[i]`` is ``keys[i]``'s outcome (``OK``: removed or
        already gone), ``status[i]`` the errno of a failed removal where known (may be empty)."""

    def _removals_since(self, t: float) -> bool:
        """True when this tier removed any chunk after monotonic time ``t``."""
        return False

    def _removed_since(self, key: bytes, t: float) -> bool:
        """True when this tier removed ``key`` after monotonic time ``t`` (a probe sent before
        then may have seen the file that is now gone)."""
        return False

    def _on_scan(self, entries: list[tuple[bytes, int, float]]) -> None:
        pass

    # -- plumbing ---------------------------------------------------------------------------------

    def _spec(self, wid: int, identity: bytes, kind: str) -> m.WorkerSpec:
        return m.WorkerSpec(
            tier_name=self.name,
            worker_id=wid,
            identity=identity,
            kind=kind,
            arena_name=self.arena.name,
            arena_nonce=self.arena.nonce,
            jobs_endpoint=self._chans.endpoints[kind],
            results_endpoint=self._chans.endpoints["results"],
            parent_pid=os.getpid(),
            nice=self.config.worker_nice,
            io_threads=self._io_threads(kind),
            io_module=self.io_module,
            io_config=self.io_config(),
            faults=list(self.config.faults),
        )

    def _io_threads(self, kind: str) -> int:
        c = self.config
        if kind == LOADS:
            return c.io_threads_for(c.read_io_threads, c.read_workers)
        return c.io_threads_for(c.write_io_threads, c.write_workers)

    def _on_pool_event(self, what: str) -> None:
        self.count({"restart": "worker_restarts", "timeout": "job_timeouts"}[what])

    def _next_task_id(self) -> int:
        self._task_ids += 1
        return self._task_ids

    def _send(
        self,
        pool: WorkerPool,
        kind: str,
        job: _Job | None,
        keys: list[bytes],
        msg: msgspec.Struct,
        timeout_s: float | None = None,
    ) -> None:
        pool.submit(PoolTask(msg.task_id, m.encode(msg), _TaskRec(kind, job, keys), timeout_s))

    def worker_pids(self) -> dict[str, list[int]]:
        """PIDs of the live worker processes, by kind."""
        return {LOADS: self._readers.pids(), STORES: self._writers.pids()}

    def workers_ready(self) -> bool:
        return not any(pool.awaiting_hello for pool in self._pools)

    def mark_present(self, keys: Iterable[bytes]) -> None:
        """Record ``keys`` as held by this tier in its engine-side index without storing them
        (their lookups answer HIT). For benchmarks that size the index without writing chunks."""
        self._mark_present_many(keys)

    # -- verdicts -------------------------------------------------------------------------------

    def _mark_present(self, key: bytes) -> None:
        self._mark_present_many((key,))

    def _mark_present_many(self, keys) -> None:
        present, absent = self._present, self._absent
        for key in keys:
            if key in present:
                present.move_to_end(key)
            else:
                present[key] = None
            if absent:
                absent.pop(key, None)
        while len(present) > self.config.lookup_cache_entries:
            present.popitem(last=False)

    def _mark_absent(self, key: bytes, ttl: float) -> None:
        self._present.pop(key, None)
        if ttl > 0:
            absent = self._absent
            if len(absent) >= self.config.lookup_cache_entries:
                now = time.monotonic()
                for k in [k for k, exp in absent.items() if exp <= now]:
                    del absent[k]
                if len(absent) >= self.config.lookup_cache_entries:
                    absent.clear()
            absent[key] = time.monotonic() + ttl

    # -- circuit breaker --------------------------------------------------------------------------

    def report_metrics(self, metrics) -> None:
        name = self.name
        for pool, direction in ((self._readers, "load"), (self._writers, "store")):
            metrics.set("kvoffload_tier_queue_depth", len(pool.queue), name, direction)
        metrics.set("kvoffload_tier_inflight_jobs", self._job_count, name)
        metrics.set(
            "kvoffload_tier_workers_alive",
            sum(w.proc.poll() is None for p in self._pools for w in list(p.workers.values())),
            name,
        )
        state = self.breaker_state
        metrics.set("kvoffload_tier_breaker_open", 1 if state == OPEN else 0, name)
        for s in STATES:
            metrics.set("kvoffload_tier_breaker_state", 1 if s == state else 0, name, s)

    @property
    def breaker_state(self) -> str:
        """``closed``, ``open`` or ``half_open`` (the cooldown passed; a few trial requests go
        through). ``closed`` when the tier has no breaker."""
        return self.breaker.state if self.breaker is not None else "closed"

    def _on_task_codes(self, rec: _TaskRec, codes: list[int], status: list[int]) -> None:
        """Feed the breaker the answer to a probe, store or load task ``rec``."""
        br = self.breaker
        if br is None or not codes:
            return
        failed = all(
            c in (m.TIMEOUT, m.WORKER_DIED, m.BAD_REPLY)
            or (c == m.IO_ERROR and (i >= len(status) or status[i] == 0 or status[i] >= 500))
            for i, c in enumerate(codes)
        )
        change = br.record(not failed, rec.t0)
        if change == "closed":
            self.count("breaker_closes")
            log.info("kvoffload tier %s: a task succeeded; breaker closed", self.name)
        elif change == "opened":
            self.count("breaker_opens")
            log.warning(
                "kvoffload tier %s: %s; breaker open for %.1f s (lookups miss, stores are "
                "dropped), then %d trial request(s) go through",
                self.name,
                "a trial request failed"
                if br.open_count > 1
                else f"{br.consecutive_failures} failed tasks in a row",
                br.reopens_at - br.clock(),
                br.trial_requests,
            )

    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        br = self.breaker
        if br is not None and br.tripped:
            return self._lookup_tripped(key, br)
        if key in self._present:
            return _HIT
        exp = self._absent.get(key)
        if exp is not None:
            if time.monotonic() < exp:
                return _MISS
            del self._absent[key]
        owed = self._owed.get(key)
        if owed is not None and req_id in owed:
            owed.discard(req_id)
            if not owed:
                del self._owed[key]
            return _MISS
        waiting = self._waiting.get(key)
        if waiting is None:
            self._waiting[key] = {req_id}
        else:
            waiting.add(req_id)
        if key not in self._probing:
            self._probe(key)
        return _RETRY

    def _owe_miss(self, key: bytes, req_ids: Iterable[str]) -> None:
        """The next lookup of ``key`` by each of ``req_ids`` answers MISS, whatever the TTLs."""
        owed = self._owed.get(key)
        if owed is None:
            self._owed[key] = set(req_ids)
            if len(self._owed) > _OWED_MAX:
                self._owed.popitem(last=False)
        else:
            owed.update(req_ids)

    def _lookup_tripped(self, key: bytes, br: CircuitBreaker) -> LookupResult:
        """Lookup while the breaker is open or half-open: MISS, unless this lookup is one of the
        half-open trials. A trial asks the tier (a probe), even for a key it is known to hold: the
        probe's answer is what closes or reopens the breaker, and it is always sent."""
        if key in self._probing:
            if br.state == HALF_OPEN:
                return _RETRY  # a probe is out: its answer settles the key
            self.count("breaker_misses")  # a probe sent before the breaker opened
            return _MISS
        exp = self._absent.get(key)
        if exp is not None and time.monotonic() < exp:
            return _MISS
        if not br.admit():
            self.count("breaker_misses")
            return _MISS
        self._absent.pop(key, None)
        self._probe(key)
        return _RETRY

    def _probe(self, key: bytes) -> None:
        self._probing.add(key)
        self._probe_queue.append(key)
        if len(self._probe_queue) >= _PROBE_BATCH:
            self.flush()

    def flush(self) -> None:
        queue = self._probe_queue
        while queue:
            batch, queue[:] = queue[:_PROBE_BATCH], queue[_PROBE_BATCH:]
            tid = self._next_task_id()
            self._send(self._readers, "probe", None, batch, m.ProbeTask(tid, batch))

    # -- jobs -----------------------------------------------------------------------------------

    def store_refusal(self, num_chunks: int) -> str | None:
        full = self._pending_store_chunks + num_chunks > self.config.max_pending_store_chunks
        br = self.breaker
        if br is not None and br.tripped and (full or not br.admit()):
            self.count("breaker_dropped_stores", num_chunks)
            return "breaker_open"
        return "queue_full" if full else None

    def accepts_store(self, num_chunks: int) -> bool:
        return self.store_refusal(num_chunks) is None

    def submit_store(self, job: JobMetadata) -> None:
        rec_job = _Job(job, is_load=False)
        keys = job.keys
        todo = [i for i, k in enumerate(keys) if k not in self._present]
        if len(todo) < len(keys):
            for k in keys:
                if k in self._present:
                    self._present.move_to_end(k)
        if todo:
            sub_keys = [keys[i] for i in todo]
            admitted, rejected = self._admit_store(sub_keys)
            for k, code in rejected.items():
                rec_job.failed[k] = code
            todo = [todo[i] for i in admitted]
        if not todo and self.breaker is not None and self.breaker.tripped:
            self.breaker.release()  # a trial store with nothing to write
        self._dispatch(rec_job, todo, self._writers, m.StoreTask, "store")

    def submit_load(self, job: JobMetadata) -> None:
        self._dispatch(
            _Job(job, is_load=True), list(range(len(job.keys))), self._readers, m.LoadTask, "load"
        )

    def _dispatch(
        self, job: _Job, positions: list[int], pool: WorkerPool, task_type, kind: str
    ) -> None:
        self._job_count += 1
        keys, slots = job.meta.keys, job.meta.slots
        step = self.chunks_per_task
        for start in range(0, len(positions), step):
            part = positions[start : start + step]
            tkeys = [keys[i] for i in part]
            tid = self._next_task_id()
            job.pending += 1
            if kind == "store":
                self._pending_store_chunks += len(tkeys)
            self._send(pool, kind, job, tkeys, task_type(tid, [int(slots[i]) for i in part], tkeys))
        if job.pending == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._job_count -= 1
        meta = job.meta
        failed = job.failed
        ok_keys = [k for k in meta.keys if k not in failed] if failed else meta.keys
        if not job.is_load and self._removals_since(job.t0):
            # Removed by this tier (evicted) while the job ran: a write that found the old file
            # and skipped may be followed by the delete. Stored for the engine, not present here.
            gone = {k for k in ok_keys if self._removed_since(k, job.t0)}
            self._mark_present_many(k for k in ok_keys if k not in gone)
        else:
            gone = ()
            self._mark_present_many(ok_keys)
        if job.is_load:
            self._on_loads_done(meta.keys, failed)
            for k in failed:
                self._mark_absent(k, self.config.failed_load_ttl_s)
                self._owe_miss(k, (meta.req_id,))
            self.count("load_chunks", len(ok_keys))
            if failed:
                self.count("load_failures", len(failed))
        else:
            self._on_stores_done(meta.keys, failed, gone)
            if ok_keys and self.record_events:
                self._events.append(TierEvent(list(ok_keys), False))
            self.count("store_chunks", len(ok_keys))
            if failed:
                self.count("store_failures", len(failed))
        for code in failed.values():
            if code == m.CORRUPT:
                self.count("checksum_failures")
        for status in job.status.values():
            self.count(f"failures_http_{status}")
        if failed:
            ok_keys = [k for k in meta.keys if k not in failed]
            result = JobResult(
                job_id=meta.job_id,
                success=False,
                successful_keys=ok_keys,
                reason=summarize(failed.values()),
                failed={k: m.CODE_NAMES.get(c, str(c)) for k, c in failed.items()},
                transfer_bytes=job.nbytes,
                transfer_seconds=time.monotonic() - job.t0,
                status=dict(job.status),
            )
        else:
            result = JobResult(
                job_id=meta.job_id,
                success=True,
                transfer_bytes=job.nbytes,
                transfer_seconds=time.monotonic() - job.t0,
            )
        self.count("bytes_read" if job.is_load else "bytes_written", job.nbytes)
        self._finished.append(result)

    def _apply(self, rec: _TaskRec, codes: list[int], nbytes: int, status: list[int]) -> None:
        if rec.kind in ("probe", "store", "load"):
            self._on_task_codes(rec, codes, status)
        if rec.kind == "probe":
            neg = self.config.negative_ttl_s
            for key, code in zip(rec.keys, codes):
                self._probing.discard(key)
                waiting = self._waiting.pop(key, None)
                if code == m.OK and not self._removed_since(key, rec.t0):
                    self._mark_present(key)
                    continue
                if code == m.OK:
                    self.count("stale_probes")  # evicted while the probe was out: a miss
                    self._mark_absent(key, min(neg, 1.0))
                else:
                    self._mark_absent(key, neg if code == m.MISSING else min(neg, 1.0))
                if waiting:
                    self._owe_miss(key, waiting)
            self.count("probes", len(rec.keys))
            self.metrics.observe(
                "kvoffload_lookup_latency_seconds", time.monotonic() - rec.t0, self.name
            )
            return
        if rec.kind in ("store", "load"):
            job = rec.job
            if any(codes):
                for i, (key, code) in enumerate(zip(rec.keys, codes)):
                    if code != m.OK:
                        job.failed[key] = code
                        if i < len(status) and status[i]:
                            job.status[key] = status[i]
            job.nbytes += nbytes
            if rec.kind == "store":
                self._pending_store_chunks -= len(rec.keys)
            job.pending -= 1
            if job.pending == 0:
                self._finish(job)
            return
        if rec.kind == "delete":
            self.count("deletes", len(rec.keys))
            self._on_deletes_done(rec.keys, codes, status)
            return
        if rec.kind == "scan":
            return

    def get_finished_jobs(self) -> list[JobResult]:
        chans = self._chans
        if chans.results_pending():
            for data in chans.recv_results():
                try:
                    res = m.decode_reply(data)
                except msgspec.DecodeError:
                    continue
                if not isinstance(res, m.TaskResult):
                    continue
                self._on_result(res)
        for pool in self._pools:
            if pool.awaiting_hello:
                for identity, _ in chans.recv_hellos(pool.kind):
                    pool.on_hello(identity)
        now = time.monotonic()
        if now - self._last_check >= _CHECK_INTERVAL_S:
            self._last_check = now
            for pool in self._pools:
                if pool.workers or pool.queue:
                    for task, code in pool.check(now):
                        rec = task.owner
                        if rec.kind == "load" and code == m.TIMEOUT:
                            self.count("pending_deadline_expired")
                        self._apply(rec, [code] * len(rec.keys), 0, [])
        if not self._finished:
            return []
        out, self._finished = self._finished, []
        return out

    def _on_result(self, res: m.TaskResult) -> None:
        # Task ids are unique per tier: find the pool that holds it.
        if res.counters:
            for name, n in res.counters.items():
                self.count(name, n)
        for pool in self._pools:
            task = pool.take(res.task_id, res.worker_id) if pool.inflight_count else None
            if task is not None:
                rec = task.owner
                if rec.kind == "scan":
                    self._on_scan(res.entries)
                self._apply(rec, self._checked_codes(rec, res), res.nbytes, res.status)
                return
        # A task this tier never sent, already answered, or held by a worker since replaced:
        # nothing waits for it and nothing may act on it (CASES C24, C17).
        self.count("unknown_replies")
        self._log_bad_reply(
            f"a reply for task {res.task_id} from worker {res.worker_id}, "
            f"which holds no such task; dropped"
        )

    def _checked_codes(self, rec: _TaskRec, res: m.TaskResult) -> list[int]:
        """The reply's per-key codes, validated against the task it answers (CASES C24).

        A worker must answer every key of its task with a known code. A reply with fewer or more
        codes than the task has keys cannot be matched to them: every key of the task fails
        (``bad_reply``). A code that is not a known outcome fails its key alone. So a key is
        a success only when the reply positively confirmed it.
        """
        codes = res.codes
        n = len(rec.keys)
        if rec.kind == "scan":
            return codes
        if len(codes) != n:
            self.count("malformed_replies")
            self._log_bad_reply(
                f"a reply to {rec.kind} task {res.task_id} carries {len(codes)} "
                f"verdict(s) for {n} key(s); all of them fail"
            )
            return [m.BAD_REPLY] * n
        known = m.CODE_NAMES
        if all(c in known for c in codes):
            return codes
        self.count("malformed_replies")
        self._log_bad_reply(
            f"a reply to {rec.kind} task {res.task_id} carries unknown verdict "
            f"code(s) {sorted({c for c in codes if c not in known})}; those keys fail"
        )
        return [c if c in known else m.BAD_REPLY for c in codes]

    def _log_bad_reply(self, what: str) -> None:
        self._bad_reply_log.log(
            logging.WARNING,
            "bad_reply",
            "kvoffload tier %s: %s (counted in tier events unknown_replies / "
            "malformed_replies; logged at most once a minute)",
            self.name,
            what,
        )

    def has_pending_work(self) -> bool:
        return bool(
            self._probe_queue
            or self._probing
            or self._job_count
            or self._readers.busy()
            or self._writers.busy()
        )

    def touch(self, keys: Iterable[bytes]) -> None:
        present = self._present
        for k in keys:
            if k in present:
                present.move_to_end(k)

    def take_events(self) -> list[TierEvent]:
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def wait(self, timeout_s: float) -> bool:
        return self._chans.wait_results(timeout_s)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.get_finished_jobs()
        except Exception:
            pass
        for pool in self._pools:
            for task in pool.shutdown():
                rec = task.owner
                self._apply(rec, [m.CANCELLED] * len(rec.keys), 0, [])
        if self._ctx is not None:
            self._chans.close()
            self._ctx.term()
