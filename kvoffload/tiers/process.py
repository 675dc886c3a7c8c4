"""Engine side of a tier whose I/O runs in worker processes (the fs and obj tiers; out-of-tree tiers
that name an ``io_module``): jobs split into tasks, tasks sent to workers, results gathered.

::

    lookup(key) ─▶ verdicts (verdicts.py), the ledger (capacity.py) ── known ──▶ HIT / MISS
                        └─ unknown ─▶ queue an existence probe, answer RETRY
    lookup_for_load(key, req) ─▶ known ──▶ HIT / MISS
                        └─ unknown ─▶ speculation.py: expected ──▶ HIT (loaded unasked)
                                          deferred (req's probe out) ──▶ RETRY
                                          else ──▶ probe, RETRY
    flush() ──────▶ ProbeTask batches ─────────▶ reader workers ─┐
    submit_load ──▶ LoadTask(s) ───────────────▶ reader workers ─┤ results socket
    submit_store ─▶ capacity.admit ─▶ StoreTask(s) ─▶ writer workers ─┤
      (evictions ─▶ DeleteTask(s) ─────────────▶ writer workers ─┤)
    get_finished_jobs() ◀── drain results, check worker health ◀─┘

The pieces, one module each: :mod:`.verdicts` (what the tier believes it holds: present / absent
verdicts, owed misses), :mod:`.capacity` (bytes counted against ``max_bytes``, LRU eviction, the
bookkeeping of deletes), :mod:`.speculation` (which chunks of a request are loaded without a probe,
and which wait for the request's one probe), :mod:`.breaker` (the circuit breaker),
:mod:`.workerpool` (the worker processes of one direction) and :mod:`.resources` (sockets, pools
and threads, closed by ``shutdown()`` or, for a tier dropped without one, by
``weakref.finalize``).

Nothing here blocks: tasks are encoded and sent without waiting (``ipc/channels.py`` queues what
the kernel will not take yet), results are drained with non-blocking reads (only while tasks are in
flight, else at the health checks' pace: an idle step reads no socket), and worker health is
checked at most every 20 ms (each worker's :class:`~kvoffload.supervisor.Supervisor` looks at its exit descriptor, a pidfd, and reaps a worker
that has exited). A job is split into tasks of ``chunks_per_task`` chunks spread over the workers;
its one :class:`JobResult` comes when the last task answers. Verdicts: a probe or a successful store
makes a key present, and so does the ledger counting it (a capped tier's chunks, those its start
scan found included); a probe that finds nothing makes it absent for ``negative_ttl_s``; a failed
load makes it absent for ``failed_load_ttl_s`` (``negative_ttl_s`` for an expected chunk that was
not there: what a probe would have found), so a request never spins on a chunk that cannot be read
(CASES C07). However short those lifetimes (0 included), a request told RETRY while a probe was
out, or whose load of the key failed, is owed the verdict: its next lookup of that key answers MISS,
so it waits at most one probe round trip (bounded by ``job_timeout_s``), never a probe after probe
(CASES C36); a chunk that waited for its request's first probe (its scout) instead of a probe of
its own waits at most two.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import time
import weakref
from abc import abstractmethod
from collections.abc import Collection, Iterable
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from typing_extensions import override

from kvoffload.config import Bytes, Positive, apply_aliases
from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.ipc.channels import LOADS, STORES
from kvoffload.ipc.ratelimit import RateLimitedLog
from kvoffload.metrics import Gauge, MetricSet
from kvoffload.quotas import TenantQuotas
from kvoffload.tiers.base import (
    FOUND_PRESENT,
    KNOWN_PRESENT,
    SPECULATIVE_MISS,
    JobMetadata,
    JobResult,
    LookupResult,
    SecondaryTierManager,
    TierEvent,
)
from kvoffload.tiers.breaker import HALF_OPEN, MAX_COOLDOWN_FACTOR, OPEN, STATES, CircuitBreaker
from kvoffload.tiers.capacity import MEDIUM_FULL, Capacity
from kvoffload.tiers.resources import TierResources, weak_callback
from kvoffload.tiers.speculation import Speculation
from kvoffload.tiers.verdicts import VerdictCache
from kvoffload.tiers.workerpool import PoolTask, WorkerPool
from kvoffload.validation import ConfigIssue, RenamedWithErrors, tenant_quota_problems
from kvoffload.workers.ioconfig import IOConfig, encode_io_config

log = logging.getLogger("kvoffload.tiers")

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
_CHECK_INTERVAL_S = 0.02
_PROBE_BATCH = 256
_DELETE_BATCH = 256
_WARN_EVERY_S = 10.0  # at most one capacity warning per tier in this many seconds
_MAX_SECONDS = 86400.0  # a day: every duration setting is finite (inf would disable what it bounds)
Seconds = Annotated[float, msgspec.Meta(gt=0, le=_MAX_SECONDS)]
TTLSeconds = Annotated[float, msgspec.Meta(ge=0, le=_MAX_SECONDS)]


class TaskKind(str, enum.Enum):
    """What a task asks a worker to do. The values are the wire tags of the task structs of
    :mod:`kvoffload.ipc.messages` (``TASK_TYPES[kind]``)."""

    LOAD = "load"
    STORE = "store"
    PROBE = "probe"
    DELETE = "delete"
    SCAN = "scan"


#: The task struct sent for each kind (its msgspec tag is the kind's value).
TASK_TYPES: dict[
    TaskKind, type[m.StoreTask | m.LoadTask | m.ProbeTask | m.DeleteTask | m.ScanTask]
] = {
    TaskKind.LOAD: m.LoadTask,
    TaskKind.STORE: m.StoreTask,
    TaskKind.PROBE: m.ProbeTask,
    TaskKind.DELETE: m.DeleteTask,
    TaskKind.SCAN: m.ScanTask,
}
_JOB_KINDS = (TaskKind.LOAD, TaskKind.STORE)
_VERDICT_KINDS = (TaskKind.PROBE, TaskKind.LOAD, TaskKind.STORE)  # answers that feed the breaker


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def integrity_key_env_problems(
    value: str | None, setting: str = "integrity_key_env", what: str = "the integrity key"
) -> list[str]:
    """``["<setting>: <why>"]`` when ``value`` is not the name of an environment variable (a key
    pasted in by mistake, say); the value is never repeated, since it may be the key."""
    if value is None or _ENV_NAME.fullmatch(value):
        return []
    return [
        f"{setting}: must name the environment variable that holds {what} "
        "(letters, digits and _, not starting with a digit), never hold the key itself"
    ]


def encryption_key_env_problems(value: str | None) -> list[str]:
    """:func:`integrity_key_env_problems` of ``encryption_key_env``."""
    return integrity_key_env_problems(value, "encryption_key_env", "the encryption master key")


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
        max_speculative_chunks: chunks of one request loaded without an existence probe once
            the first chunk it waited for a probe of was found (:mod:`kvoffload.tiers
            .speculation`: the reload of a prefix this tier has no record of, written by another
            instance or before a restart, costs one probe and one load); one that is not there
            is a clean miss (``speculative_miss``). 0: every chunk the tier has no record of is
            probed first, one probe each.
        io_threads: chunks each worker moves at once, of one task or of several (threads inside
            the worker; store and load tasks start as they arrive).
        worker_nice: niceness added to worker processes (0-19).
        breaker_failures: consecutive failed tasks (transport errors, 5xx, timeouts, dead workers)
            that open the circuit breaker (:mod:`kvoffload.tiers.breaker`): lookups then answer
            MISS and stores are dropped (and counted) for ``breaker_cooldown_s``, after which it is
            half-open: ``breaker_trial_requests`` requests try the tier again. None disables the
            breaker.
        breaker_cooldown_s: how long the breaker stays open the first time (seconds); doubled
            each time a trial fails, up to ``breaker_max_cooldown_s``.
        breaker_max_cooldown_s: the longest the breaker stays open (seconds, at least
            ``breaker_cooldown_s``; equal: no back-off), however long the outage: the bound of
            recovery (CASES C51). Once the endpoint answers again the tier serves within it, plus
            the time a trial request takes to answer (at most ``job_timeout_s``). None (default):
            4 × ``breaker_cooldown_s`` (20 s with its default).
        breaker_trial_requests: requests (a lookup that needs the tier, a store job) let through
            at once while the breaker is half-open; the others are refused as while open until
            a trial answers (success closes the breaker, failure reopens it).
        read_io_threads, write_io_threads: chunks the reader / writer workers move at once, in
            total (vLLM's ``n_read_threads`` / ``n_write_threads``); each worker of that side runs
            ``ceil(total / workers)`` I/O threads. None (default): ``io_threads`` per worker.
        locality: ``LOCAL`` or ``REMOTE`` (vLLM's key): where this tier's storage is, relative
            to this instance, as reported in KV events; None: the tier type's own (fs local,
            obj remote).
        tenant_quota_bytes: the most bytes (headers included) one tenant (a request's
            ``cache_salt``, DESIGN.md "Tenants") may hold in this tier; a store past it evicts
            that tenant's own oldest chunks here first, and what they cannot make room for is
            refused (``tenant_quota``). Needs the tier's capacity ledger (its ``max_bytes``
            bound: the fs tier's default bound counts; obj needs ``max_bytes``). Unsalted
            requests are no tenant: no quota applies to them. None (default): no quota.
        tenant_quotas: a tenant's own quota in this tier (bytes), by tenant id (``kvoffload
            tenant-id`` prints a salt's), in place of ``tenant_quota_bytes``.
        enable_kv_events, backpressure: vLLM's keys, accepted and not acted on (see
            :data:`kvoffload.config.VLLM_ONLY_TIER_KEYS`).
        faults: fault injection for tests (see ``Fault``).
    """

    vllm_aliases: ClassVar[dict[str, str]] = {
        "n_read_threads": "read_io_threads",
        "n_write_threads": "write_io_threads",
    }
    # What a field left None means, where the tier decides it only at run time or it is off
    # (``kvoffload check`` prints these words; see SecondaryTierManager.effective_config).
    unset_means: ClassVar[dict[str, str]] = {
        "chunks_per_task": "auto: about 8 MiB a task (1 to 64 chunks), from the chunk size",
        "breaker_failures": "off: no circuit breaker",
        "read_io_threads": "auto: read_workers x io_threads",
        "write_io_threads": "auto: write_workers x io_threads",
        "locality": "auto: the tier type's own",
        "backpressure": "none (vLLM's key; no effect here)",
        "tenant_quota_bytes": "off: no per-tenant quota in this tier (unless tenant_quotas "
        "names the tenant)",
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
    max_speculative_chunks: Annotated[int, msgspec.Meta(ge=0)] = 4096
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    worker_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    breaker_failures: Positive | None = None
    breaker_cooldown_s: Seconds = 5.0
    breaker_max_cooldown_s: Seconds | None = None
    breaker_trial_requests: Positive = 2
    read_io_threads: Positive | None = None
    write_io_threads: Positive | None = None
    locality: Literal["LOCAL", "REMOTE"] | None = None
    tenant_quota_bytes: Bytes | None = None
    tenant_quotas: dict[str, Bytes] = {}
    enable_kv_events: bool = False
    backpressure: dict[str, Any] | None = None
    faults: list[m.Fault] = []

    @property
    def has_tenant_quotas(self) -> bool:
        """Whether some tenant has a quota in this tier."""
        return self.tenant_quota_bytes is not None or bool(self.tenant_quotas)

    def tenant_quota_problems(self, bound: str | None) -> list[str]:
        """``"<key>: <why and the fix>"`` for the per-tenant quota settings: an override not
        keyed by a tenant id, and a quota on a tier without a capacity ledger (``bound``: why it
        has none and how to give it one, None: it has one)."""
        problems = tenant_quota_problems("tenant_quotas", self.tenant_quotas)
        if bound is not None and self.has_tenant_quotas:
            key = "tenant_quota_bytes" if self.tenant_quota_bytes is not None else "tenant_quotas"
            problems.append(
                f"{key}: a per-tenant quota needs the tier's capacity ledger, which counts each "
                f"tenant's bytes; {bound}"
            )
        return problems

    @classmethod
    def from_vllm_keys(cls, body: dict[str, Any], where: str) -> tuple[dict, dict[str, str]]:
        """Rename vLLM 0.33's key names for this tier to ours (``n_read_threads`` ->
        ``read_io_threads``, ...).

        Returns:
            ``(body with our names, our name -> the name as written)``.

        Raises:
            RenamedWithErrors: a setting given under both names (the other keys renamed).
        """
        renamed: dict[str, str] = {}
        issues: list[ConfigIssue] = []
        body = dict(body)
        apply_aliases(body, cls.vllm_aliases, where, renamed, issues=issues)
        if issues:
            raise RenamedWithErrors(issues, body, renamed)
        return body, renamed

    def io_threads_for(self, total: int | None, workers: int) -> int:
        """I/O threads per worker of one side: ``ceil(total / workers)``, or ``io_threads``."""
        return self.io_threads if total is None else -(-total // workers)

    def breaker_problems(self) -> list[str]:
        """``["breaker_max_cooldown_s: <why and the fix>"]`` when the cap of the breaker's
        back-off is below its first cooldown; else empty."""
        cap, first = self.breaker_max_cooldown_s, self.breaker_cooldown_s
        if cap is None or cap >= first:
            return []
        return [
            f"breaker_max_cooldown_s: {cap:g} s is below breaker_cooldown_s ({first:g} s), the "
            f"first cooldown; set it to at least {first:g} (equal: no back-off), or lower "
            f"breaker_cooldown_s"
        ]

    def io_thread_problems(self, read_workers: int, write_workers: int) -> list[str]:
        """``"<key>: <why>"`` for each side that needs over 64 threads a worker."""
        problems = []
        for key, total, workers, wkey in (
            ("read_io_threads", self.read_io_threads, read_workers, "read_workers"),
            ("write_io_threads", self.write_io_threads, write_workers, "write_workers"),
        ):
            if total is not None and self.io_threads_for(total, workers) > 64:
                problems.append(
                    f"{key}: {total} threads over {workers} {wkey} is more than 64 "
                    f"a worker; raise {wkey}"
                )
        return problems


class _Job:
    __slots__ = (
        "meta",
        "pending",
        "failed",
        "status",
        "nbytes",
        "t0",
        "is_load",
        "free_bytes",
        "known",
        "found",
        "expected",
        "done_at",
    )

    def __init__(self, meta: JobMetadata, is_load: bool):
        self.meta = meta
        self.pending = 0
        self.failed: dict[bytes, int] = {}
        self.status: dict[bytes, int] = {}
        self.nbytes = 0
        self.t0 = time.monotonic()
        self.done_at = 0.0  # the latest done_at its tasks reported (-1.0: one did not say)
        self.is_load = is_load
        #: Stores: the least free space (bytes) a worker measured after a NO_SPACE; None: no
        #: NO_SPACE yet; -1: one was not measured (the medium is then taken as full).
        self.free_bytes: int | None = None
        #: Stores: chunks not written because the tier's index held them (no task sent) /
        #: because a worker found them already stored (CASES C50).
        self.known = 0
        self.found = 0
        #: Loads: the chunks loaded on expectation, never probed (:mod:`.speculation`).
        self.expected: Collection[bytes] = ()


class _TaskRec:
    """The engine's record of one task: its kind, the job it belongs to (loads and stores), its
    keys, and (a probe) whether its pool had nothing else queued or in flight when it was sent."""

    __slots__ = ("kind", "job", "keys", "t0", "alone")

    def __init__(self, kind: TaskKind, job: _Job | None, keys: list[bytes], alone: bool = False):
        self.kind = kind
        self.job = job
        self.keys = keys
        self.t0 = time.monotonic()
        self.alone = alone


def _deduplicated(job: _Job) -> dict[str, int]:
    """A store job's chunks the tier already held and did not write, by reason
    (:attr:`JobResult.deduplicated`); empty for a load or when every chunk was written."""
    if not (job.known or job.found):
        return {}
    out = {}
    if job.known:
        out[KNOWN_PRESENT] = job.known
    if job.found:
        out[FOUND_PRESENT] = job.found
    return out


def _least_free(was: int | None, free_bytes: int) -> int:
    """The free space (bytes) a store job's ``NO_SPACE`` answers show, given what the earlier ones
    showed (``was``; None: none yet) and this one's: the least measured, or -1 once one of them was
    not measured (the medium is then taken as full)."""
    if was is None:
        return free_bytes
    return -1 if -1 in (was, free_bytes) else min(was, free_bytes)


def summarize(names: Iterable[str]) -> str:
    """``"corrupt=1 missing=2"``: how many of ``names`` (per-key failure reasons) are each."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


def _failure(job: _Job, key: bytes, code: int) -> str:
    """The reason ``key`` of ``job`` failed with ``code`` (:data:`kvoffload.reasons.FAILED`): its
    code's name, or :data:`SPECULATIVE_MISS` for a chunk loaded on expectation and not found."""
    if code == m.MISSING and key in job.expected:
        return SPECULATIVE_MISS
    return m.CODE_NAMES.get(code, str(code))


class ProcessTierManager(SecondaryTierManager):
    """Base for tiers whose I/O runs in :mod:`kvoffload.workers` processes.

    Subclasses set ``io_module`` (the worker-side module with ``make_io``), implement
    :meth:`io_config`, call :meth:`bound_capacity` for a byte cap, and call :meth:`start` last in
    their constructor. They may override the hooks of a medium that fills before the cap
    (:meth:`_medium_full`, :meth:`_refresh_capacity`) and :meth:`_on_scan`. The byte accounting
    is read from :attr:`capacity` itself (``capacity.used_bytes``, ``capacity.capacity_bytes``,
    ``capacity.max_bytes``).

    Attributes:
        verdicts: what the tier believes it holds (:class:`~kvoffload.tiers.verdicts.VerdictCache`).
        capacity: its byte accounting (:class:`~kvoffload.tiers.capacity.Capacity`; unbounded
            unless :meth:`bound_capacity` was called).
        breaker: its circuit breaker, or None.
    """

    config_class: ClassVar[type[msgspec.Struct]] = ProcessTierConfig
    config: ProcessTierConfig
    io_module: ClassVar[str]
    shared = True
    metric_definitions = (
        Gauge(
            "kvoffload_tier_used_bytes",
            "Bytes of chunks a capacity-bounded tier counts as its own (headers included).",
            ("tier",),
        ),
        Gauge(
            "kvoffload_tier_capacity_bytes",
            "A capacity-bounded tier's cap in bytes now: max_bytes (or the default bound), "
            "lowered while its medium is full.",
            ("tier",),
        ),
    )

    def __init__(
        self,
        *,
        name: str,
        arena_view: memoryview,
        namespace: Any,
        config: ProcessTierConfig,
        arena: Any,
    ):
        config = self.effective_config(config)  # locality and I/O thread totals filled in
        super().__init__(name=name, arena_view=arena_view, namespace=namespace, config=config)
        self.locality = config.locality or self.locality
        strides = arena_view.strides
        if arena_view.ndim != 2 or not strides:
            raise ValueError(
                f"arena_view: expected a 2-D memoryview (slots, row bytes), got {arena_view.ndim}-D"
            )
        self.arena = arena
        self.row_bytes: int = strides[0]
        cfg = config
        self.chunks_per_task = cfg.chunks_per_task or max(1, min(64, (8 << 20) // self.row_bytes))
        self.verdicts = VerdictCache(cfg.lookup_cache_entries)
        self.speculation = Speculation(cfg.max_speculative_chunks)
        self.capacity = Capacity(
            None, self.row_bytes, count=self.count, forget=self.verdicts.forget
        )
        self._probing: set[bytes] = set()
        self._probe_queue: list[bytes] = []
        #: The tenant of each tenant's chunk this bounded tier counts (stored, or found by its
        #: scan), for the deletes its evictions send (:meth:`_tenant`); dropped when removed.
        self._key_tenants: dict[bytes, str] = {}
        # those it stopped counting since the events were last taken, and before that: their
        # events, recorded before, are taken (and translated) with the tenant still known
        self._gone_tenants: dict[bytes, str] = {}
        self._gone_taken: dict[bytes, str] = {}
        self._finished: list[JobResult] = []
        self._events: list[TierEvent] = []
        self._task_ids = 0
        self._job_count = 0
        self._pending_store_chunks = 0
        self._last_check = 0.0
        self._closed = False
        self._warned_at = -_WARN_EVERY_S
        self._bad_reply_log = RateLimitedLog(log)
        self.breaker: CircuitBreaker | None = (
            CircuitBreaker(
                cfg.breaker_failures,
                cfg.breaker_cooldown_s,
                cfg.breaker_trial_requests,
                trial_timeout_s=cfg.job_timeout_s,
                max_cooldown_s=cfg.breaker_max_cooldown_s,
            )
            if cfg.breaker_failures is not None
            else None
        )
        self._resources: TierResources | None = None
        self._finalizer: weakref.finalize | None = None
        self._pools: tuple[WorkerPool, ...] = ()

    def bound_capacity(self, max_bytes: int, unit_bytes: int, full_why: str = MEDIUM_FULL) -> None:
        """Count stored chunks (``unit_bytes`` each, payload plus header) against ``max_bytes``
        and evict the lowest-ranked by deleting them through the writer workers. Call it
        before :meth:`start`. ``full_why``: how a refusal while the medium is full explains
        itself (see :class:`~kvoffload.tiers.capacity.Capacity`).

        Raises:
            ValueError: ``"max_bytes: ..."`` when the cap is smaller than one chunk.
        """
        self.capacity = Capacity(
            max_bytes,
            unit_bytes,
            count=self.count,
            forget=self.verdicts.forget,
            full_why=full_why,
        )

    def start(self) -> None:
        """Open the tier's sockets and start its worker processes, all owned by one
        :class:`~kvoffload.tiers.resources.TierResources` that ``shutdown()`` closes, or a
        ``weakref.finalize`` when the tier is dropped without it. Subclasses call it last in their
        constructor, once their own checks passed (nothing is left to clean up before)."""
        cfg = self.config
        if cfg.has_tenant_quotas:  # before any process starts: nothing to undo
            self.capacity.limit_tenants(cfg.tenant_quota_bytes, cfg.tenant_quotas, self._tenant)
        res = TierResources(self.name)
        self._resources = res
        self._finalizer = weakref.finalize(self, res.close)
        self._chans = res.channels
        # another local user's connection to the workers' sockets (refused there), counted here
        res.channels.on_refused = weak_callback(self._worker_connection_refused)
        # The pools must not refer to the tier (the finalizer would keep it alive): they get
        # the worker specs made now, and reach the tier's counters through a weak reference.
        specs = {kind: self._spec(0, b"", kind) for kind in (LOADS, STORES)}
        on_event = weak_callback(self._on_pool_event)
        io = self.io_config()
        env_allow = type(io).worker_env  # e.g. an obj worker's credentials
        # The integrity key is withheld from every child (its variable is a tier's *_env key)
        # but these workers', which compute the chunks' MACs.
        env_set = {
            name: os.environ[name]
            for name in (
                getattr(io, "integrity_key_env", None),
                getattr(io, "encryption_key_env", None),  # they encrypt and decrypt chunks
            )
            if name and name in os.environ
        }

        def pool(kind: str, count: int) -> WorkerPool:
            base = specs[kind]
            return res.add_pool(
                WorkerPool(
                    tier_name=self.name,
                    kind=kind,
                    count=count,
                    channels=res.channels,
                    make_spec=lambda wid, ident: msgspec.structs.replace(
                        base, worker_id=wid, identity=ident
                    ),
                    task_timeout_s=cfg.job_timeout_s,
                    max_inflight=cfg.max_inflight_per_worker,
                    on_event=on_event,
                    env_allow=env_allow,
                    env_set=env_set,
                )
            )

        self._readers = pool(LOADS, cfg.read_workers)
        self._writers = pool(STORES, cfg.write_workers)
        self._pools = res.pools
        for p in self._pools:
            p.start()

    @property
    def resources(self) -> TierResources:
        """The tier's sockets and worker processes.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self._resources is None:
            raise RuntimeError(f"tier {self.name}: not started")
        return self._resources

    # -- subclass interface ---------------------------------------------------------------------

    @abstractmethod
    def io_config(self) -> IOConfig:
        """The I/O config handed to worker processes: an instance of ``io_module``'s
        ``IO_CONFIG`` (:mod:`kvoffload.workers.ioconfig`)."""

    def _admit_store(
        self, keys: list[bytes], tenant: str = ""
    ) -> tuple[list[int], dict[bytes, int]]:
        """Which positions of ``keys`` (``tenant``'s chunks, "" for none) to write; the rest
        fail with the returned codes. With a cap, room is made by evicting its lowest-ranked
        chunks (with a tenant quota, that tenant's own first)."""
        cap = self.capacity
        self._refresh_capacity()
        admitted, rejected = cap.admit(keys, tenant)
        if cap.bounded:
            refused = sum(1 for c in rejected.values() if c == m.NO_SPACE)
            if refused:
                self._warn(
                    f"store of {refused} chunk(s) refused (no_space): no room under the cap "
                    f"({cap.capacity_bytes} bytes) {cap.why_no_room()}"
                )
            over = sum(1 for c in rejected.values() if c == m.TENANT_QUOTA)
            if over and cap.quotas is not None:
                self._warn(
                    f"store of {over} chunk(s) of tenant {tenant} refused (tenant_quota): it "
                    f"holds {cap.tenant_bytes(tenant)} bytes of its quota of "
                    f"{cap.quotas.limit(tenant)} (every chunk of it here is being loaded or "
                    "part of this store)"
                )
            self._enforce_cap()
        return admitted, rejected

    def _on_stores_done(
        self,
        keys: list[bytes],
        failed: dict[bytes, int],
        removed: Collection[bytes] = (),
        request: str = "",
        free_bytes: int = -1,
    ) -> None:
        """A store job of ``request`` ("" for none) finished: ``failed`` maps the keys that failed
        to their codes; ``removed``: keys this tier removed while it ran (stored, not counted);
        ``free_bytes``: the least free space a worker measured after a ``NO_SPACE`` (bytes; -1:
        none)."""
        unconfirmed, full = self.capacity.stores_done(keys, failed, removed, request)
        if unconfirmed:
            self._remove_unconfirmed_stores(unconfirmed)
        if self._key_tenants and (failed or removed):
            self._forget_tenants(keys)  # not stored, or removed while it ran: not counted
        if full:
            self._medium_full(full, free_bytes)

    def _medium_full(self, chunks: int, free_bytes: int = -1) -> None:
        """Writes of ``chunks`` chunks found the medium full (``NO_SPACE`` from a worker) before
        the cap; ``free_bytes``: what the medium showed free just after (bytes; 0: the shortage
        does not show there; -1: not measured). The fs tier lowers its cap as far as the real
        shortage needs (CASES C33, C52); others do nothing."""

    def _refresh_capacity(self) -> None:
        """Before a store is admitted and at each :meth:`flush`: a tier whose medium filled
        may raise its lowered cap again (the fs tier, from its free-space sample); others do
        nothing."""

    def _remove_unconfirmed_stores(self, keys: list[bytes]) -> None:
        """A write sent to a worker that failed may still have published its chunk (the worker
        died or timed out after the rename or upload, a verdict we do not know): remove what is
        not counted, so what is stored stays what the cap accounts. No event: the chunk was never
        reported stored."""
        self.capacity.unconfirmed_stores(keys)
        for tenant, part in self._by_tenant(keys):
            self._send(
                self._writers,
                TaskKind.DELETE,
                None,
                part,
                m.DeleteTask(self._next_task_id(), part, tenant),
            )

    def _on_deletes_done(self, keys: list[bytes], codes: list[int], status: list[int]) -> None:
        """A delete task answered: ``codes[i]`` is ``keys[i]``'s outcome (``OK``: removed or
        already gone), ``status[i]`` the errno of a failed removal where known (may be empty).
        Deletes with no answer are sent again after a wait (:meth:`flush`); chunks whose
        removal failed stay counted (CASES C32)."""
        kept = self.capacity.deletes_answered(keys, codes, status)
        if self._key_tenants:
            self._forget_tenants(keys)
        if kept:
            if self.record_events:
                self._events.append(TierEvent(kept, False))
            self._warn(
                f"{len(kept)} chunk(s) could not be removed "
                f"({self.capacity.last_removal_error}); they stay counted and are retried later"
            )
            self._enforce_cap()

    def _on_scan(self, entries: list[tuple[bytes, int, float]], tenants: list[str]) -> None:
        """A scan listed ``(key, bytes, mtime)`` of the chunks stored (``tenants``: the tenant
        of each, or empty when none is a tenant's): a bounded tier counts them (oldest first),
        evicts down to its cap and announces those it keeps."""
        fresh = self._adopt(entries, tenants)
        self._enforce_cap(unannounced=fresh)
        self._announce_adopted(fresh)

    def _adopt(self, entries: list[tuple[bytes, int, float]], tenants: list[str]) -> set[bytes]:
        """Count the chunks a scan listed (:meth:`Capacity.adopt`; ``tenants``: the tenant of
        each, or empty when none is a tenant's); returns the keys newly counted (not stored by
        this instance since it started: never announced by it)."""
        if tenants and len(tenants) == len(entries):
            kt = self._key_tenants
            for (k, _, _), t in zip(entries, tenants):
                if t:
                    kt[k] = t
        index = self.capacity.index
        known = {k for k, _, _ in entries if k in index}
        self.capacity.adopt(entries)
        fresh = {k for k, _, _ in entries if k in index and k not in known}
        self.capacity.enforce_quotas()  # what earlier runs left a tenant past its quota
        return fresh

    def _announce_adopted(self, fresh: set[bytes]) -> None:
        """A stored event for the adopted chunks still counted (CASES C54: after a restart,
        what this tier still serves is announced again). Those the cap evicted at once were
        never announced and get no removal either (C55)."""
        if fresh and self.record_events:
            index = self.capacity.index
            kept = [k for k in fresh if k in index]
            if kept:
                self._events.append(TierEvent(kept, False))

    def _enforce_cap(self, unannounced: Collection[bytes] = ()) -> None:
        """Evict until the counted bytes fit under the cap; send the deletes (``unannounced``:
        chunks this instance never announced, whose eviction is not published)."""
        self.capacity.enforce()
        self._flush_deletes(unannounced)

    def _flush_deletes(self, unannounced: Collection[bytes] = ()) -> None:
        keys = self.capacity.take_deletes()
        if keys and self.record_events:
            told = [k for k in keys if k not in unannounced] if unannounced else list(keys)
            if told:
                self._events.append(TierEvent(told, True))
        keys += self.capacity.due_retries()  # removal events were published at the first try
        for tenant, part in self._by_tenant(keys):
            for start in range(0, len(part), _DELETE_BATCH):
                batch = part[start : start + _DELETE_BATCH]
                tid = self._next_task_id()
                self._send(
                    self._writers, TaskKind.DELETE, None, batch, m.DeleteTask(tid, batch, tenant)
                )

    @override
    def tenant_quotas(self) -> TenantQuotas | None:
        return self.capacity.quotas

    @override
    def held_tenant(self, key: bytes) -> str:
        kt = self._key_tenants
        t = kt.get(key) if kt else None
        if t is None and self._gone_taken:
            t = self._gone_taken.get(key)
        return t or ""

    @override
    def holds_tenants(self) -> bool:
        return bool(self._key_tenants or self._gone_tenants or self._gone_taken)

    def _forget_tenants(self, keys: Iterable[bytes]) -> None:
        """Drop the tenants of those of ``keys`` this tier no longer counts (kept in
        :attr:`_gone_tenants` until the events are taken twice more)."""
        kt, held, gone = self._key_tenants, self.capacity.index, self._gone_tenants
        for k in keys:
            if k not in held:
                t = kt.pop(k, None)
                if t is not None:
                    gone[k] = t

    def _tenant(self, key: bytes) -> str:
        """The tenant of chunk ``key`` ("" for none): from this tier's own count, else the
        tiering manager's knowledge (:meth:`~kvoffload.tiers.base.SecondaryTierManager
        .tenant_of`)."""
        kt = self._key_tenants
        t = kt.get(key) if kt else None
        if t is None and (self._gone_tenants or self._gone_taken):
            # no longer counted, a delete of it may still be sent again
            t = self._gone_tenants.get(key) or self._gone_taken.get(key)
        return self.tenant_of(key) if t is None else t

    def _by_tenant(self, keys: list[bytes]) -> list[tuple[str, list[bytes]]]:
        """``keys`` grouped by tenant (:meth:`_tenant`), in order within each group: one task
        goes to one tenant's directory."""
        if not keys:
            return []
        groups: dict[str, list[bytes]] = {}
        for k in keys:
            t = self._tenant(k)
            g = groups.get(t)
            if g is None:
                groups[t] = [k]
            else:
                g.append(k)
        return list(groups.items())

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("kvoffload tier %s: %s", self.name, msg)

    def _scan_at_start(self, timeout_s: float, list_entries: bool) -> None:
        """Send one scan task (orphan cleanup; with ``list_entries``, chunks to adopt)."""
        tid = self._next_task_id()
        self._send(
            self._writers,
            TaskKind.SCAN,
            None,
            [],
            m.ScanTask(tid, list_entries=list_entries),
            timeout_s=timeout_s,
        )

    def remove(self, keys: list[bytes]) -> None:
        """Delete chunks from the tier (explicit removal); in-flight loads of them still finish with
        the whole chunk or a clean miss. A chunk whose removal fails stays counted."""
        self.capacity.remove(keys)
        for k in keys:
            self.verdicts.mark_absent(k, self.config.negative_ttl_s)
        self._flush_deletes()

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
            parent_pid=os.getpid(),
            nice=self.config.worker_nice,
            io_threads=self._io_threads(kind),
            io_module=self.io_module,
            io_config=encode_io_config(self.io_config()),
            faults=list(self.config.faults),
        )

    @classmethod
    @override
    def effective_config(cls, config: Any) -> Any:
        """``config`` with ``locality`` (None: the tier class's own), the total
        ``read_io_threads`` / ``write_io_threads`` (None: ``io_threads`` per worker, so workers x
        ``io_threads``) and ``breaker_max_cooldown_s`` (None: 4 x ``breaker_cooldown_s``, at
        most a day) filled in; the workers run ``ceil(total / workers)`` threads each either
        way. ``chunks_per_task`` stays None: it depends on the chunk size."""
        c: ProcessTierConfig = config
        return msgspec.structs.replace(
            c,
            locality=c.locality or cls.locality,
            read_io_threads=c.read_io_threads or c.read_workers * c.io_threads,
            write_io_threads=c.write_io_threads or c.write_workers * c.io_threads,
            breaker_max_cooldown_s=c.breaker_max_cooldown_s
            or min(_MAX_SECONDS, MAX_COOLDOWN_FACTOR * c.breaker_cooldown_s),
        )

    def _io_threads(self, kind: str) -> int:
        c = self.config
        if kind == LOADS:
            return c.io_threads_for(c.read_io_threads, c.read_workers)
        return c.io_threads_for(c.write_io_threads, c.write_workers)

    def _worker_connection_refused(self, why: str) -> None:
        """The tier's worker sockets refused a connection (``other_user``: another local user's
        process; ``bad_frame``, ``duplicate``: not one of our workers): counted."""
        self.count(f"refused_worker_connections_{why}")

    def _on_pool_event(self, what: str) -> None:
        self.count({"restart": names.WORKER_RESTARTS, "timeout": names.JOB_TIMEOUTS}[what])

    def _next_task_id(self) -> int:
        self._task_ids += 1
        return self._task_ids

    def _send(
        self,
        pool: WorkerPool,
        kind: TaskKind,
        job: _Job | None,
        keys: list[bytes],
        msg: m.StoreTask | m.LoadTask | m.ProbeTask | m.DeleteTask | m.ScanTask,
        timeout_s: float | None = None,
        alone: bool = False,
    ) -> None:
        rec = _TaskRec(kind, job, keys, alone)
        pool.submit(PoolTask(msg.task_id, m.encode(msg), rec, timeout_s))

    def worker_pids(self) -> dict[str, list[int]]:
        """PIDs of the live worker processes, by kind."""
        return {LOADS: self._readers.pids(), STORES: self._writers.pids()}

    @override
    def workers_ready(self) -> bool:
        return not any(pool.awaiting_hello for pool in self._pools)

    def mark_present(self, keys: Iterable[bytes]) -> None:
        """Record ``keys`` as held by this tier in its engine-side index without storing them
        (their lookups answer HIT). For benchmarks that size the index without writing chunks."""
        self._mark_present_many(keys)

    # -- verdicts -------------------------------------------------------------------------------

    def _mark_present_many(self, keys: Iterable[bytes]) -> None:
        self.verdicts.mark_present(keys)

    # -- circuit breaker --------------------------------------------------------------------------

    @override
    def report_metrics(self, metrics: MetricSet) -> None:
        name = self.name
        for pool, direction in ((self._readers, "load"), (self._writers, "store")):
            metrics.set("kvoffload_tier_queue_depth", len(pool.queue), name, direction)
        metrics.set("kvoffload_tier_inflight_jobs", self._job_count, name)
        metrics.set(
            "kvoffload_tier_workers_alive",
            sum(p.alive() for p in self._pools),
            name,
        )
        state = self.breaker_state
        metrics.set("kvoffload_tier_breaker_open", 1 if state == OPEN else 0, name)
        for s in STATES:
            metrics.set("kvoffload_tier_breaker_state", 1 if s == state else 0, name, s)
        cap = self.capacity.capacity_bytes
        if cap is not None:
            metrics.set("kvoffload_tier_used_bytes", self.capacity.used_bytes, name)
            metrics.set("kvoffload_tier_capacity_bytes", cap, name)

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

    def _verdict(self, key: bytes, req_id: str) -> bool | None:
        """What the tier knows of ``key`` for ``req_id``'s lookup: True (a present verdict, or
        its ledger counts it: stored here, or found by the start scan of a capped tier), False
        (absent, or a miss owed to the request, which this pays), None (unknown)."""
        verdict = self.verdicts.verdict(key, req_id)
        if verdict is None and key in self.capacity.index:
            return True
        return verdict

    @override
    def lookup(self, key: bytes, req_id: str = "") -> LookupResult:
        br = self.breaker
        if br is not None and br.tripped:
            return self._lookup_tripped(key, br)
        verdict = self._verdict(key, req_id)
        if verdict is not None:
            return _HIT if verdict else _MISS
        self._probe_for(key, req_id)
        return _RETRY

    @override
    def lookup_for_load(self, key: bytes, req_id: str = "") -> LookupResult:
        """:meth:`lookup`, and for a chunk the tier knows nothing of: HIT when the request
        expects it (its load is then the only round trip; a missing file is a clean miss), RETRY
        without a probe while the request's first probe is out (:mod:`.speculation`)."""
        br = self.breaker
        if br is not None and br.tripped:
            return self._lookup_tripped(key, br)
        verdict = self._verdict(key, req_id)
        spec = self.speculation
        if verdict is not None:
            spec.answered(req_id, key, verdict)
            return _HIT if verdict else _MISS
        scout = spec.open_scout(req_id)
        if scout is not None and scout not in self._probing:
            if self._on_record(scout):
                spec.answered(req_id, scout, True)  # found since the request asked
            elif self.verdicts.absent_for(scout, req_id):
                # not there, answered since the request asked (a lookup polled it in the
                # middle of the request's lookups): its prefix ends at the scout, before this
                # chunk (asked in prefix order), so no probe for this one; the scout's own
                # verdict is paid when the request asks it again
                return _MISS
        if spec.expects(req_id, key):
            return _HIT
        if spec.defers(req_id, key, self._probing):
            return _RETRY
        self._probe_for(key, req_id)
        spec.probed(req_id, key)
        return _RETRY

    def _probe_for(self, key: bytes, req_id: str) -> None:
        """``req_id`` waits for a probe of ``key`` (queued unless one is out) and is owed its
        verdict."""
        self.verdicts.wait(key, req_id)
        if key not in self._probing:
            self._probe(key)

    @override
    def known_present(self, key: bytes) -> bool:
        br = self.breaker
        return (br is None or not br.tripped) and self._on_record(key)

    def _on_record(self, key: bytes) -> bool:
        """Whether a present verdict or the ledger says the tier holds ``key``."""
        return self.verdicts.is_present(key) or key in self.capacity.index

    def _lookup_tripped(self, key: bytes, br: CircuitBreaker) -> LookupResult:
        """Lookup while the breaker is open or half-open: MISS, unless this lookup is one of the
        half-open trials. A trial asks the tier (a probe), even for a key it is known to hold: the
        probe's answer is what closes or reopens the breaker, and it is always sent."""
        if key in self._probing:
            if br.state == HALF_OPEN:
                return _RETRY  # a probe is out: its answer settles the key
            self.count("breaker_misses")  # a probe sent before the breaker opened
            return _MISS
        if self.verdicts.is_absent(key):
            return _MISS
        if not br.admit():
            self.count("breaker_misses")
            return _MISS
        self._probe(key)
        return _RETRY

    def _probe(self, key: bytes) -> None:
        self._probing.add(key)
        self._probe_queue.append(key)
        if len(self._probe_queue) >= _PROBE_BATCH:
            self.flush()

    @override
    def flush(self) -> None:
        self._refresh_capacity()
        queue = self._probe_queue
        if queue:
            self._probe_queue = []
            for tenant, part in self._by_tenant(queue):
                while part:
                    batch, part = part[:_PROBE_BATCH], part[_PROBE_BATCH:]
                    tid = self._next_task_id()
                    alone = not self._readers.busy()  # its round trip holds no queue
                    self._send(
                        self._readers,
                        TaskKind.PROBE,
                        None,
                        batch,
                        m.ProbeTask(tid, batch, tenant),
                        alone=alone,
                    )
        self._flush_deletes()

    # -- jobs -----------------------------------------------------------------------------------

    @override
    def store_refusal(self, num_chunks: int) -> str | None:
        full = self._pending_store_chunks + num_chunks > self.config.max_pending_store_chunks
        br = self.breaker
        if br is not None and br.tripped and (full or not br.admit()):
            self.count("breaker_dropped_stores", num_chunks)
            return "breaker_open"
        return "queue_full" if full else None

    @override
    def submit_store(self, job: JobMetadata) -> None:
        rec_job = _Job(job, is_load=False)
        keys = job.keys
        present = self.verdicts.present
        todo = [i for i, k in enumerate(keys) if k not in present]
        if len(todo) < len(keys):
            self.verdicts.touch(keys)
            rec_job.known = len(keys) - len(todo)
        if todo:
            sub_keys = [keys[i] for i in todo]
            admitted, rejected = self._admit_store(sub_keys, job.tenant)
            for k, code in rejected.items():
                rec_job.failed[k] = code
            todo = [todo[i] for i in admitted]
            if job.tenant and self.capacity.bounded:
                kt = self._key_tenants
                for i in todo:
                    kt[keys[i]] = job.tenant
        if not todo and self.breaker is not None and self.breaker.tripped:
            self.breaker.release()  # a trial store with nothing to write
        self._dispatch(rec_job, todo, self._writers, TaskKind.STORE)

    @override
    def submit_load(self, job: JobMetadata) -> None:
        self.capacity.loads_started(job.keys)
        rec = _Job(job, is_load=True)
        expected = self.speculation.expected_keys(job.req_id, job.keys)
        if expected:
            # still unknown: one found (a probe, a store) since is no longer a guess
            rec.expected = {k for k in expected if not self._on_record(k)}
            self.count("speculative_loads", len(rec.expected))
        self._dispatch(rec, list(range(len(job.keys))), self._readers, TaskKind.LOAD)

    def _dispatch(self, job: _Job, positions: list[int], pool: WorkerPool, kind: TaskKind) -> None:
        self._job_count += 1
        keys, slots = job.meta.keys, job.meta.slots
        task_type = m.StoreTask if kind is TaskKind.STORE else m.LoadTask
        step = self.chunks_per_task
        for start in range(0, len(positions), step):
            part = positions[start : start + step]
            tkeys = [keys[i] for i in part]
            tid = self._next_task_id()
            job.pending += 1
            if kind is TaskKind.STORE:
                self._pending_store_chunks += len(tkeys)
            task = task_type(tid, [int(slots[i]) for i in part], tkeys, job.meta.tenant)
            self._send(pool, kind, job, tkeys, task)
        if job.pending == 0:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        self._job_count -= 1
        meta = job.meta
        failed = job.failed
        ok_keys = [k for k in meta.keys if k not in failed] if failed else meta.keys
        reasons = {k: _failure(job, k, c) for k, c in failed.items()}
        gone: Collection[bytes] = ()
        cap = self.capacity
        if not job.is_load and cap.removals_since(job.t0):
            # Removed by this tier (evicted) while the job ran: a write that found the old file
            # and skipped may be followed by the delete. Stored for the engine, not present here.
            gone = {k for k in ok_keys if cap.removed_since(k, job.t0)}
            self.verdicts.mark_present(k for k in ok_keys if k not in gone)
        else:
            self.verdicts.mark_present(ok_keys)
        if job.is_load:
            vanished = cap.loads_done(meta.keys, failed, meta.request)
            if vanished and self._key_tenants:
                self._forget_tenants(vanished)
            if vanished and self.record_events:
                # announced here (stored or adopted), gone now (another instance on a shared
                # root removed it): say so, as no other instance will (CASES C55)
                self._events.append(TierEvent(vanished, True))
            ttl = self.config.failed_load_ttl_s
            # a chunk expected and not there: what a probe would have found
            guessed = self.config.negative_ttl_s
            for k, why in reasons.items():
                self.verdicts.mark_absent(k, guessed if why == SPECULATIVE_MISS else ttl)
                self.verdicts.owe_miss(k, (meta.req_id,))
            self.count("load_chunks", len(ok_keys))
            if failed:
                self.count("load_failures", len(failed))
                self.speculation.load_failed(meta.req_id)
        else:
            free = -1 if job.free_bytes is None else job.free_bytes
            self._on_stores_done(meta.keys, failed, gone, meta.request, free)
            if ok_keys and self.record_events:
                self._events.append(TierEvent(list(ok_keys), False))
            self.count("store_chunks", len(ok_keys) - job.known - job.found)
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
                reason=summarize(reasons.values()),
                failed=reasons,
                transfer_bytes=job.nbytes,
                transfer_seconds=time.monotonic() - job.t0,
                status=dict(job.status),
                deduplicated=_deduplicated(job),
                done_at=max(job.done_at, 0.0),
            )
        else:
            result = JobResult(
                job_id=meta.job_id,
                success=True,
                transfer_bytes=job.nbytes,
                transfer_seconds=time.monotonic() - job.t0,
                deduplicated=_deduplicated(job),
                done_at=max(job.done_at, 0.0),
            )
        self.count("bytes_read" if job.is_load else "bytes_written", job.nbytes)
        self._finished.append(result)

    def _apply(
        self,
        rec: _TaskRec,
        codes: list[int],
        nbytes: int,
        status: list[int],
        free_bytes: int = -1,
        present: int = 0,
    ) -> None:
        kind = rec.kind
        if kind in _VERDICT_KINDS:
            self._on_task_codes(rec, codes, status)
        if kind is TaskKind.PROBE:
            self._probe_answered(rec, codes)
        elif kind in _JOB_KINDS:
            job = rec.job
            if job is None:
                raise AssertionError(f"a {kind.value} task without its job")
            if any(codes):
                for i, (key, code) in enumerate(zip(rec.keys, codes)):
                    if code != m.OK:
                        job.failed[key] = code
                        if i < len(status) and status[i]:
                            job.status[key] = status[i]
            job.nbytes += nbytes
            if kind is TaskKind.STORE:
                self._pending_store_chunks -= len(rec.keys)
                if m.NO_SPACE in codes:
                    job.free_bytes = _least_free(job.free_bytes, free_bytes)
                if present:  # never more than the task's keys that succeeded
                    job.found += min(present, codes.count(m.OK))
            job.pending -= 1
            if job.pending == 0:
                self._finish(job)
        elif kind is TaskKind.DELETE:
            self.count("deletes", len(rec.keys))
            self._on_deletes_done(rec.keys, codes, status)

    def _probe_answered(self, rec: _TaskRec, codes: list[int]) -> None:
        neg = self.config.negative_ttl_s
        for key, code in zip(rec.keys, codes):
            self._probing.discard(key)
            if code == m.OK and not self.capacity.removed_since(key, rec.t0):
                self.verdicts.settle(key, True)
                continue
            if code == m.OK:
                self.count("stale_probes")  # evicted while the probe was out: a miss
                self.verdicts.settle(key, False, min(neg, 1.0))
            else:
                self.verdicts.settle(key, False, neg if code == m.MISSING else min(neg, 1.0))
                if code == m.MISSING and self.capacity.counted_before(key, rec.t0):
                    # counted before the probe went out (one stored since: the worker may have
                    # looked before it was written, review of C55)
                    self._vanished(key)
        self.count("probes", len(rec.keys))
        seconds = time.monotonic() - rec.t0
        if rec.alone and all(c in (m.OK, m.MISSING) for c in codes):
            # a sample of what a lookup costs: answered, and sent to readers with nothing
            # queued (a queue is added by the tiering manager from the loads outstanding; a
            # timeout or a dead worker says how long it waited, not what a lookup costs)
            self.lookup_answered(seconds)
        self.metrics.observe("kvoffload_lookup_latency_seconds", seconds, self.name)

    def _vanished(self, key: bytes) -> None:
        """A lookup found a chunk this tier counts missing: another instance sharing the medium
        removed it. It is no longer counted (as a load finding it missing does) and its removal
        is published: this instance announced it, and no other will say it is gone (CASES
        C55)."""
        cap = self.capacity
        if key in cap.loading:
            return  # the load's own answer says it
        cap.gone(key)
        if self._key_tenants:
            self._forget_tenants((key,))
        if self.record_events:
            self._events.append(TierEvent([key], True))

    @override
    def get_finished_jobs(self) -> list[JobResult]:
        chans = self._chans
        now = time.monotonic()
        check = now - self._last_check >= _CHECK_INTERVAL_S
        # Results answer tasks in flight; with none, the socket is read only at the health
        # checks' pace (a stray or late reply waits that long to be counted)
        pools = self._pools
        busy = check or any(pool.inflight_count for pool in pools)
        for data in chans.recv_results() if busy else ():
            try:
                res = m.decode_reply(data)
            except msgspec.DecodeError:
                continue
            if not isinstance(res, m.TaskResult):
                continue
            self._on_result(res)
        for pool in pools:
            if pool.awaiting_hello:
                for identity, _ in chans.recv_hellos(pool.kind):
                    pool.on_hello(identity)
        if check:
            self._last_check = now
            for pool in pools:
                if pool.workers or pool.queue:
                    for task, code in pool.check(now):
                        rec = task.owner
                        if rec.kind is TaskKind.LOAD and code == m.TIMEOUT:
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
                if rec.kind is TaskKind.SCAN:
                    self._on_scan(res.entries, res.tenants)
                codes = self._checked_codes(rec, res)
                job = rec.job
                if job is not None and job.done_at >= 0.0:
                    if res.done_at > 0.0:  # a worker's claim, bounded by the job's life
                        at = min(max(res.done_at, job.t0), time.monotonic())
                        job.done_at = max(job.done_at, at)
                    else:
                        job.done_at = -1.0  # a task that did not say: the job's end is not known
                self._apply(rec, codes, res.nbytes, res.status, res.free_bytes, res.present)
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
        if rec.kind is TaskKind.SCAN:
            return codes
        if len(codes) != n:
            self.count("malformed_replies")
            self._log_bad_reply(
                f"a reply to {rec.kind.value} task {res.task_id} carries {len(codes)} "
                f"verdict(s) for {n} key(s); all of them fail"
            )
            return [m.BAD_REPLY] * n
        known = m.CODE_NAMES
        if all(c in known for c in codes):
            return codes
        self.count("malformed_replies")
        self._log_bad_reply(
            f"a reply to {rec.kind.value} task {res.task_id} carries unknown verdict "
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

    @override
    def has_pending_work(self) -> bool:
        return bool(
            self._probe_queue
            or self._probing
            or self._job_count
            or self.capacity.retry_at  # unanswered deletes waiting to be sent again
            or self._readers.busy()
            or self._writers.busy()
        )

    @override
    def touch(self, keys: Iterable[bytes]) -> None:
        self.verdicts.touch(keys)

    @override
    def request_finished(self, req_id: str) -> None:
        self.speculation.finished(req_id)
        if self.capacity.bounded:
            self.capacity.request_finished(req_id)

    @override
    def take_events(self) -> list[TierEvent]:
        if self._gone_tenants or self._gone_taken:
            # gone before the last take: their events are out; since: with these
            self._gone_taken, self._gone_tenants = self._gone_tenants, {}
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    @override
    def wait(self, timeout_s: float) -> bool:
        return self._chans.wait_results(timeout_s)

    def shutdown(self) -> None:
        """Fail the tasks no worker answered (``CANCELLED``), stop the workers and close the
        sockets (:meth:`TierResources.close`). Idempotent."""
        if self._closed:
            return
        self._closed = True
        res, fin = self._resources, self._finalizer
        if res is None or fin is None:
            return
        try:
            self.get_finished_jobs()
        except Exception:
            pass
        fin.detach()
        for task in res.close():
            rec = task.owner
            self._apply(rec, [m.CANCELLED] * len(rec.keys), 0, [])
