"""Capacity accounting of a worker-backed tier: an index of the chunks it stores, counted in bytes
against a cap and ranked for eviction, and the bookkeeping of the deletes that enforce it. No I/O: the tier that
holds a :class:`Capacity` (:class:`~kvoffload.tiers.process.ProcessTierManager`, for the fs tier
and for the obj tier with ``max_bytes``) sends the delete tasks it queues and reports their answers.

::

    admit(keys) ── room under the cap? ── no ─▶ evict lowest-ranked (delete queue) ─▶ room? ── no ─▶
        │ yes                                                                        NO_SPACE
        ▼
    reserved (being written) ── stores_done ─▶ index (ranked, counted in used_bytes)
                                                │ evicted / removed
                                                ▼
                           unconfirmed (its delete not answered: still stored, no longer counted)
                                                │ deletes_answered
                  ┌─────────────────────────────┼───────────────────────────┐
                 OK: gone          no answer: asked again after     failed: counted again, as the
                                   0.05 s, doubling to 5 s, until    most recently used; retried
                                   one answers (due_retries)         when next evicted (C32)

Eviction order follows prefixes, as the host tier's (:mod:`kvoffload.policies`, CASES C47): the
chunks of a store or load job are ranked as its request's (``request``: shared rank, the tail of
the prefix lowest) until :meth:`Capacity.request_finished` ranks them afresh, tail first; a job of
no request ranks its chunks afresh, tail first; chunks found at start rank below everything this
instance stored. The lowest-ranked chunk neither loading nor protected goes first, from a lazily
invalidated min-heap (:class:`~kvoffload.policies.RankHeap`): no walk over the index per eviction.

Whose bytes: ``unit_bytes`` per chunk written (payload plus header); chunks found at start
(:meth:`Capacity.adopt`) count their listed size. ``used_bytes`` counts the index; chunks being
written are reserved (``unit_bytes`` each) on top of it; chunks whose delete has not answered are
``unconfirmed_bytes``. While some removal has failed, or the cap is lowered (:meth:`lower_cap`: the
medium is full), space is reused only once a removal is confirmed (:meth:`cautious`): a store that
finds no such room is refused at once and the ledger evicts ahead (``headroom``) for the next one.

Per-tenant quotas (:meth:`Capacity.limit_tenants`, :mod:`kvoffload.quotas`): each counted chunk
of a tenant counts for it, and a chunk admitted for a tenant at its quota first evicts that
tenant's own lowest-ranked chunk (``tenant_quota_evictions``), or is refused (``TENANT_QUOTA``,
``tenant_quota_refusals``) when none may go. A tenant's bytes are those counted plus those
reserved for its writes; chunks evicted whose delete has not answered count for nobody.

Counters go to ``count`` (the tier's :meth:`~kvoffload.tiers.base.SecondaryTierManager.count`);
an evicted chunk's present verdict is dropped through ``forget``. The clock is injected (``clock``:
monotonic seconds). Not thread-safe: the engine thread drives it.
"""

from __future__ import annotations

import errno as errno_mod
import os
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence

from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.policies import PrefixRanks, RankHeap
from kvoffload.quotas import TenantQuotas

EVICTED_MEMORY = 65536
"""Evictions remembered to spot probes that saw a chunk just before it was deleted."""
NO_ANSWER = (m.WORKER_DIED, m.TIMEOUT, m.BAD_REPLY)
"""A delete's verdicts that say nothing about whether the chunk is gone."""
RETRY_FIRST_S = 0.05
"""Seconds before a delete that got no answer is sent again; doubled at each further try."""
RETRY_MAX_S = 5.0
"""The longest wait between two tries of the same unanswered delete (seconds)."""
MEDIUM_FULL = "the medium is full"
"""How :meth:`Capacity.why_no_room` names a full medium unless the tier names its own."""


class _Unless:
    """The ids :meth:`Capacity.evict_one` must skip: those of keys in ``protect``, and of keys whose
    removal failed unless ``retry`` (a container of ids for :meth:`RankHeap.pop`)."""

    __slots__ = ("keys", "protect", "undeletable")

    def __init__(self, keys: list, protect: Collection[bytes], undeletable: Collection[bytes]):
        self.keys, self.protect, self.undeletable = keys, protect, undeletable

    def __contains__(self, ident: object) -> bool:
        k = self.keys[ident]  # type: ignore[call-overload]
        return k in self.protect or k in self.undeletable


class Capacity:
    """Byte accounting of one tier's chunks against a cap, evicted in prefix order (C47).

    Args:
        max_bytes: the cap (bytes, >= ``unit_bytes``); None: unbounded (no index, nothing counted
            nor evicted; explicit removals are still tracked until their deletes answer).
        unit_bytes: bytes of one stored chunk (payload plus header).
        count: ``(counter, n)``: the tier's counters (``evictions``, ``eviction_errors.<errno>``...).
        forget: called with each chunk evicted (the tier drops its present verdict).
        clock: monotonic seconds (``time.monotonic``; tests pass a fake).
        full_why: what :meth:`why_no_room` says while the cap is lowered (the medium is full),
            before "; evicting to make room" (the fs tier names its filesystem and floor).

    Raises:
        ValueError: ``"max_bytes: ..."`` when the cap is smaller than one chunk.
    """

    def __init__(
        self,
        max_bytes: int | None,
        unit_bytes: int,
        *,
        count: Callable[[str, float], None],
        forget: Callable[[bytes], None],
        clock: Callable[[], float] = time.monotonic,
        full_why: str = MEDIUM_FULL,
    ):
        if max_bytes is not None and max_bytes < unit_bytes:
            raise ValueError(
                f"max_bytes: {max_bytes} is smaller than one chunk ({unit_bytes} bytes)"
            )
        self.max_bytes = max_bytes
        self.unit_bytes = unit_bytes
        self.count = count
        self.forget = forget
        self.clock = clock
        self.full_why = full_why
        #: Chunks counted against the cap -> their bytes (:meth:`eviction_order` for the order).
        self.index: dict[bytes, int] = {}
        #: Eviction ranks (module docstring) of the chunks in :attr:`index`, by id: ``_ids`` maps
        #: a counted key to its id, ``_keys`` an id to its key (None: free, in ``_free``).
        self.ranks = PrefixRanks(0)
        self._heap = RankHeap(self.ranks, 0)
        self._ids: dict[bytes, int] = {}
        self._keys: list[bytes | None] = []
        self._free: list[int] = []
        self._counted_at = array("d")  # by id: when its key was counted (``clock`` seconds)
        self._adopted = 0
        #: Bytes of the chunks in :attr:`index`.
        self.used_bytes = 0
        #: Chunks admitted for writing, their store not finished -> bytes reserved.
        self.reserved: dict[bytes, int] = {}
        #: Chunks being loaded (never evicted meanwhile) -> loads in flight.
        self.loading: dict[bytes, int] = {}
        #: Chunks evicted or removed, their delete not yet sent.
        self.delete_queue: list[bytes] = []
        #: Chunks whose delete is queued or running -> deletes in flight.
        self.deleting: dict[bytes, int] = {}
        #: Recent evictions (monotonic seconds), oldest first.
        self.evicted_at: OrderedDict[bytes, float] = OrderedDict()
        #: Chunks whose delete has not answered: still stored, no longer in ``used_bytes``.
        self.unconfirmed: dict[bytes, int] = {}
        self.unconfirmed_bytes = 0
        #: Chunks in the index whose last removal failed.
        self.undeletable: set[bytes] = set()
        #: Deletes sent again after no answer, per chunk (reset when one answers).
        self.delete_retries: dict[bytes, int] = {}
        #: Unanswered deletes waiting to be sent again -> when (monotonic seconds).
        self.retry_at: dict[bytes, float] = {}
        self.last_removal_error = ""
        #: Chunks refused at admission whose job has not finished -> refusals.
        self.refused: dict[bytes, int] = {}
        #: The cap lowered to what the full medium holds (None: not lowered).
        self.lowered_cap: int | None = None
        #: Bytes evicted ahead while space is reused only once confirmed.
        self.headroom = 0
        #: Per-tenant quotas (:meth:`limit_tenants`), None: none (the default).
        self.quotas: TenantQuotas | None = None
        self._tenant_of: Callable[[bytes], str] = lambda key: ""
        self._reserved_for: dict[bytes, str] = {}  # a reserved chunk -> its tenant (quotas)
        self._pending: dict[str, int] = {}  # a tenant -> bytes reserved for its writes

    def limit_tenants(
        self, default: int | None, overrides: dict[str, int], tenant_of: Callable[[bytes], str]
    ) -> TenantQuotas:
        """Hold each tenant to its quota from now on (call before the first store).

        Args:
            default: every tenant's quota (bytes), None: only ``overrides``.
            overrides: tenant id -> its quota (bytes).
            tenant_of: the tenant of a chunk being counted ("" for none: not counted).

        Raises:
            ValueError: the ledger is unbounded (``max_bytes``), or a quota is smaller than one
                chunk; the message names the setting and the fix.
        """
        if not self.bounded:
            raise ValueError(
                "tenant_quota_bytes: a per-tenant quota needs the tier's capacity ledger "
                "(max_bytes): set max_bytes"
            )
        self.quotas = TenantQuotas(
            default,
            overrides,
            lambda: self.ranks,
            unit=(self.unit_bytes, "chunk", "tenant_quota"),
        )
        self._tenant_of = tenant_of
        return self.quotas

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes ``tenant`` holds against its quota: counted plus reserved for its writes."""
        q = self.quotas
        if q is None:
            return 0
        return q.held.get(tenant, 0) + self._pending.get(tenant, 0)

    # -- the cap --------------------------------------------------------------------------------

    @property
    def bounded(self) -> bool:
        """True when the tier has a cap (``max_bytes``), so chunks are counted and evicted."""
        return self.max_bytes is not None

    @property
    def capacity_bytes(self) -> int | None:
        """The cap now (bytes): ``max_bytes``, or lower while the medium is full; None when
        unbounded."""
        cap, lowered = self.max_bytes, self.lowered_cap
        if cap is None or lowered is None:
            return cap
        return min(cap, lowered)

    def cautious(self) -> bool:
        """Reuse space only once its removal is confirmed (some removal failed, or the cap is
        lowered)."""
        return bool(self.undeletable) or self.lowered_cap is not None

    def reserved_bytes(self) -> int:
        """Bytes reserved for chunks being written (``unit_bytes`` each)."""
        return len(self.reserved) * self.unit_bytes

    def lower_cap(self, chunks: int, room: int = 0) -> int:
        """Writes of ``chunks`` chunks found the medium full while it had ``room`` bytes free for
        this tier (less than they need; 0: none, or not known): the cap becomes the bytes counted
        now plus that room (never raised by this), and the ledger evicts ahead so that as many
        chunks would fit: the shortage, ``chunks * unit_bytes - room``, never more (CASES C52),
        and never below half of what it holds. Returns the lowered cap (bytes)."""
        held, room = self.used_bytes, max(0, room)
        cap = held + room
        self.lowered_cap = cap if self.lowered_cap is None else min(self.lowered_cap, cap)
        self.headroom = max(self.headroom, min(chunks * self.unit_bytes, room + held // 2))
        return self.lowered_cap

    def raise_cap(self, room: int) -> bool:
        """The medium has ``room`` bytes free for this tier (a sample): raise the lowered cap to
        ``used_bytes + room`` (never lower it: only a failed write does). True when that lifts it
        back to ``max_bytes`` (no longer lowered)."""
        if self.lowered_cap is None or self.max_bytes is None:
            return False
        allowed = self.used_bytes + room
        if allowed > self.lowered_cap:
            self.lowered_cap = allowed
        if self.lowered_cap >= self.max_bytes:
            self.lowered_cap = None
            return True
        return False

    # -- admission and eviction -----------------------------------------------------------------

    def admit(self, keys: list[bytes], tenant: str = "") -> tuple[list[int], dict[bytes, int]]:
        """Reserve room for a store of ``keys`` (``tenant``'s chunks, "" for none), evicting the
        lowest-ranked chunks (never one loading or of this store). Returns the positions to write
        and the keys refused with their codes: ``REJECTED`` for a chunk whose delete is pending (a
        writer would find the old copy, skip the write, and the delete would remove the chunk
        counted as stored), ``TENANT_QUOTA`` when the tenant is at its quota and none of its own
        chunks may be evicted, ``NO_SPACE`` when no room can be made; every new chunk after a
        refused one with the same code (``keys`` are a prefix: nothing past a hole could be
        served, C48). Counts ``store_skipped_deleting``, ``store_refused_no_room``,
        ``store_refused_after_hole``, ``tenant_quota_evictions`` and ``tenant_quota_refusals``.
        Unbounded: every position, nothing reserved."""
        cap = self.capacity_bytes
        if cap is None:
            return list(range(len(keys))), {}
        index = self.index
        protect = set(keys)
        quotas = self.quotas
        limited = quotas is not None and quotas.limit(tenant) is not None
        admitted: list[int] = []
        rejected: dict[bytes, int] = {}
        hole = after = 0  # the code of the first chunk refused; new chunks refused after it
        ahead = sum(k not in index and k not in self.reserved for k in keys) if limited else 0
        for i, k in enumerate(keys):
            if k in index:
                admitted.append(i)  # the worker sees the chunk and skips the write (ranked then)
                continue
            if k in self.reserved:
                admitted.append(i)  # an earlier job is writing it; the worker skips or rewrites it
                continue
            if hole:
                # past a chunk refused: the prefix is not usable beyond it (C48)
                rejected[k] = hole
                self.refused[k] = self.refused.get(k, 0) + 1
                after += 1
                continue
            if k in self.deleting:
                # Evicted, its delete not yet done: a writer would find the old copy, skip the
                # write, and the delete would then remove the chunk we count as stored.
                rejected[k] = hole = m.REJECTED
                self.refused[k] = self.refused.get(k, 0) + 1
                self.count("store_skipped_deleting", 1)
                continue
            if limited:
                ahead -= 1
            if limited and not self._tenant_room(tenant, protect, ahead):
                rejected[k] = hole = m.TENANT_QUOTA
                self.refused[k] = self.refused.get(k, 0) + 1
                continue
            if not self.make_room(protect):
                rejected[k] = hole = m.NO_SPACE
                self.refused[k] = self.refused.get(k, 0) + 1
                continue
            self.reserved[k] = self.unit_bytes
            if limited:
                self._reserved_for[k] = tenant
                self._pending[tenant] = self._pending.get(tenant, 0) + self.unit_bytes
            admitted.append(i)
        if after:
            self.count("store_refused_after_hole", after)
        if hole == m.TENANT_QUOTA:
            assert quotas is not None
            quotas.refusals += 1 + after
            self.count("tenant_quota_refusals", 1 + after)
        if hole == m.NO_SPACE:
            self.count("store_refused_no_room", 1)
            if self.cautious():  # evict ahead for them all, so the next store finds room
                self.headroom = max(self.headroom, min((1 + after) * self.unit_bytes, cap // 2))
        return admitted, rejected

    def _tenant_room(self, tenant: str, protect: set[bytes], ahead: int = 0) -> bool:
        """Evict ``tenant``'s own lowest-ranked chunks (never one loading or of this store)
        until one more of its chunks fits under its quota; True when it fits. Once it must
        evict, it makes room for the ``ahead`` new chunks of the store after this one too, in
        one :meth:`~kvoffload.quotas.TenantQuotas.victims` call: each call walks past the
        tenant's chunks that may not go (loading, of this store), so one call per chunk cost a
        store O(chunks x those)."""
        quotas = self.quotas
        assert quotas is not None
        limit = quotas.limit(tenant)
        assert limit is not None
        unit, keys, members = self.unit_bytes, self._keys, self._heap.members
        if self.tenant_bytes(tenant) + unit <= limit:
            return True

        def may_evict(ident: int) -> bool:
            return ident in members and keys[ident] not in protect

        want = -(-(self.tenant_bytes(tenant) + (1 + ahead) * unit - limit) // unit)
        self._evict_for_quota(quotas.victims(tenant, want, may_evict))
        return self.tenant_bytes(tenant) + unit <= limit

    def enforce_quotas(self) -> None:
        """Evict each tenant's own lowest-ranked chunks (never one loading) until it is within
        its quota (after a start scan counted what earlier runs stored)."""
        quotas = self.quotas
        if quotas is None:
            return
        members = self._heap.members
        for tenant in [t for t in quotas.held if quotas.over(t, self._pending.get(t, 0)) > 0]:
            over = quotas.over(tenant, self._pending.get(tenant, 0))
            short = -(-over // self.unit_bytes)
            self._evict_for_quota(quotas.victims(tenant, short, members.__contains__))

    def _evict_for_quota(self, idents: list[int]) -> None:
        """Evict a tenant's own chunks ``idents`` for its quota, counted as such."""
        assert self.quotas is not None
        for ident in idents:
            self._heap.discard(ident)
            self._evict(ident)
        self.quotas.evictions += len(idents)
        if idents:
            self.count("tenant_quota_evictions", len(idents))

    def make_room(self, protect: set[bytes]) -> bool:
        """Evict the lowest-ranked chunks until one more fits under the cap; True when it fits.
        While cautious, room whose removal is not yet confirmed does not count."""
        cap = self.capacity_bytes
        if cap is None:
            return True
        unit = self.unit_bytes
        while self.used_bytes + self.reserved_bytes() + unit > cap:
            if not self.evict_one(protect, retry=True):
                break
        pending = self.unconfirmed_bytes if self.cautious() else 0
        return self.used_bytes + pending + self.reserved_bytes() + unit <= cap

    def why_no_room(self) -> str:
        """Why :meth:`admit` found no room (for the tier's warning)."""
        if self.undeletable:
            return (
                f"{len(self.undeletable)} chunk(s) could not be removed "
                f"({self.last_removal_error}); space is reused once a removal succeeds"
            )
        if self.lowered_cap is not None:
            return f"{self.full_why}; evicting to make room"
        return "every chunk is in use (loading) or part of this store"

    def evict_one(self, protect: Collection[bytes], retry: bool = False) -> bool:
        """Evict the lowest-ranked chunk not loading nor in ``protect`` (queued for deletion);
        chunks whose removal failed are tried again only with ``retry`` (a store needs room), never
        in a loop. False when there is none."""
        undeletable = () if retry else self.undeletable
        skip = _Unless(self._keys, protect, undeletable) if protect or undeletable else ()
        deferred: list[tuple[int, int, int]] = []
        ident = self._heap.pop(skip, deferred)
        if deferred:
            self._heap.restore((), deferred)
        if ident < 0:
            return False
        self._evict(ident)
        return True

    def _evict(self, ident: int) -> None:
        """Evict counted chunk ``ident`` (out of the heap already): no longer counted, its
        delete queued."""
        k = self._keys[ident]
        assert k is not None
        nbytes = self._uncount(k)
        self.unconfirmed[k] = self.unconfirmed.get(k, 0) + nbytes
        self.unconfirmed_bytes += nbytes
        self.forget(k)
        self.delete_queue.append(k)
        self._remember_eviction(k, self.clock())
        self.count(names.EVICTIONS, 1)

    def enforce(self) -> None:
        """Evict (never retrying a failed removal) until the counted bytes fit under the cap, less
        the headroom kept while space is reused only once confirmed."""
        cap = self.capacity_bytes
        if cap is None:
            return
        if self.cautious():
            target = cap - self.headroom
        else:
            self.headroom = 0
            target = cap
        while self.used_bytes + self.reserved_bytes() > target:
            if not self.evict_one(protect=()):
                break

    def remove(self, keys: Iterable[bytes]) -> None:
        """Explicit removal of ``keys``: no longer counted, queued for deletion (a removal that
        fails keeps the chunk counted)."""
        index = self.index
        for k in keys:
            if k in index:
                nbytes = self._uncount(k)
                self.unconfirmed[k] = self.unconfirmed.get(k, 0) + nbytes
                self.unconfirmed_bytes += nbytes
            self.delete_queue.append(k)

    # -- the ranks ------------------------------------------------------------------------------

    def _count(self, key: bytes, nbytes: int) -> int:
        """Count ``key`` (``nbytes``) in the index, unranked and not yet evictable (the caller
        ranks it, then :meth:`_evictable`). Returns its id."""
        self.index[key] = nbytes
        self.used_bytes += nbytes
        if self._free:
            ident = self._free.pop()
        else:
            ident = len(self._keys)
            self._keys.append(None)
            if ident >= len(self.ranks.gen):
                n = max(64, 2 * ident)
                self.ranks.grow(n)
                self._heap.grow(n)
                self._counted_at.frombytes(bytes(8 * (n - len(self._counted_at))))
        self._counted_at[ident] = self.clock()
        self._keys[ident] = key
        self._ids[key] = ident
        self.ranks.admitted((ident,))
        self._heap.reranked((ident,))  # an entry of the id's previous key is not its
        if self.quotas is not None:  # at the lowest rank it will have (ranks only rise)
            tenant = self._tenant_of(key)
            if tenant:
                self.quotas.count(ident, tenant, nbytes)
        return ident

    def counted_before(self, key: bytes, t: float) -> bool:
        """True when ``key`` is counted and was counted before monotonic time ``t`` (what a
        worker saw of it after ``t`` is about this copy)."""
        ident = self._ids.get(key)
        return ident is not None and self._counted_at[ident] < t

    def _uncount(self, key: bytes) -> int:
        """Stop counting ``key`` (in the index); returns its bytes."""
        nbytes = self.index.pop(key)
        self.used_bytes -= nbytes
        ident = self._ids.pop(key)
        self._heap.discard(ident)
        if self.quotas is not None:
            self.quotas.uncount(ident)
        self._keys[ident] = None
        self._free.append(ident)
        return nbytes

    def _evictable(self, idents: Iterable[int]) -> None:
        """Counted chunks (by id) that may be evicted now, unless loading."""
        keys, loading = self._keys, self.loading
        self._heap.add([ident for ident in idents if keys[ident] not in loading])

    def _rank(self, keys: Sequence[bytes], request: str, use: bool) -> None:
        """Rank the counted ones of ``keys`` (prefix order, head first) as ``request``'s, or as
        used now for none (:meth:`PrefixRanks.rank`); ``use``: read, not stored."""
        ids = self._ids
        batch = [ids[k] for k in keys if k in ids]
        if batch:
            self._heap.reranked(self.ranks.rank(request, batch, use))

    def request_finished(self, request: str) -> None:
        """``request`` is done: the chunks its jobs ranked are ranked afresh, tail first."""
        self._heap.reranked(self.ranks.finished(request))

    def eviction_order(self) -> list[bytes]:
        """The counted chunks, the next to be evicted first (loading ones included); for tests and
        diagnostics: O(n log n)."""
        major, minor, ids = self.ranks.major, self.ranks.minor, self._ids
        return sorted(self.index, key=lambda k: (major[ids[k]], minor[ids[k]]))

    def _remember_eviction(self, key: bytes, now: float) -> None:
        evicted = self.evicted_at
        evicted[key] = now
        evicted.move_to_end(key)
        while len(evicted) > EVICTED_MEMORY:
            evicted.popitem(last=False)

    # -- deletes --------------------------------------------------------------------------------

    def take_deletes(self) -> list[bytes]:
        """The queued deletes, now counted as in flight (the caller sends them)."""
        keys, self.delete_queue = self.delete_queue, []
        deleting = self.deleting
        for k in keys:
            deleting[k] = deleting.get(k, 0) + 1
        return keys

    def removals_since(self, t: float) -> bool:
        """True when a chunk was removed (or its delete is in flight) after monotonic time ``t``."""
        if self.deleting:
            return True
        evicted = self.evicted_at
        return bool(evicted) and next(reversed(evicted.values())) >= t

    def removed_since(self, key: bytes, t: float) -> bool:
        """True when ``key`` was removed after monotonic time ``t``, or its delete is queued or
        running (whatever a worker saw of it then is going away)."""
        if key in self.deleting:
            return True
        at = self.evicted_at.get(key)
        return at is not None and at >= t

    def deletes_answered(
        self, keys: list[bytes], codes: list[int], status: list[int]
    ) -> list[bytes]:
        """A delete task answered: ``codes[i]`` is ``keys[i]``'s outcome (``OK``: removed or
        already gone), ``status[i]`` the errno of a failed removal where known (may be empty).

        A delete that got no answer (a worker died, timed out or answered nonsense) says nothing
        about whether the chunk is gone: it stays in flight and unconfirmed, and is sent again
        after a wait (:data:`RETRY_FIRST_S`, doubling up to :data:`RETRY_MAX_S`) by
        :meth:`due_retries`, for as long as it takes: counting a chunk that may be gone, or
        forgetting one that may be stored, would make the ledger disagree with the medium.

        Returns:
            Chunks whose removal failed, counted again as the most recently used (retried when
            next evicted; CASES C32). Failed removals are counted by errno
            (``eviction_errors.<name>``).
        """
        deleting = self.deleting
        index = self.index
        kept: list[bytes] = []
        retry: list[tuple[bytes, int]] = []
        for i, (k, code) in enumerate(zip(keys, codes)):
            n = deleting.get(k, 0) - 1
            if n > 0:
                deleting[k] = n
            else:
                deleting.pop(k, None)
            nbytes = self.unconfirmed.pop(k, None)
            if nbytes is not None:
                self.unconfirmed_bytes -= nbytes
            if code == m.OK:
                self.undeletable.discard(k)
                self.delete_retries.pop(k, None)
                continue
            if code in NO_ANSWER and nbytes is not None and k not in index:
                # The chunk may be gone or still there: ask again rather than guess.
                retry.append((k, nbytes))
                continue
            self.delete_retries.pop(k, None)
            err = status[i] if i < len(status) else 0
            why = (
                errno_mod.errorcode.get(err, str(err)) if err else m.CODE_NAMES.get(code, str(code))
            )
            self.count(
                f"{names.EVICTION_ERRORS}.{why}", 1
            )  # kvoffload_tier_eviction_errors{tier, errno}
            self.last_removal_error = f"{why}: {os.strerror(err)}" if err else why
            if code == m.CANCELLED or nbytes is None or k in index:
                continue
            # Still stored: keep counting it, as the most recently used (retried when it comes up
            # for eviction again); the chunk is intact, so it stays loadable.
            ident = self._count(k, nbytes)
            self.ranks.fresh((ident,))
            self._evictable((ident,))
            self.undeletable.add(k)
            kept.append(k)
        now = self.clock()
        for k, nbytes in retry:
            deleting[k] = deleting.get(k, 0) + 1
            self.unconfirmed[k] = self.unconfirmed.get(k, 0) + nbytes
            self.unconfirmed_bytes += nbytes
            tries = self.delete_retries.get(k, 0) + 1
            self.delete_retries[k] = tries
            self.retry_at[k] = now + min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** min(tries - 1, 20))
        return kept

    def due_retries(self) -> list[bytes]:
        """Unanswered deletes whose wait is over, to send again now (already counted in flight)."""
        retry_at = self.retry_at
        if not retry_at:
            return []
        now = self.clock()
        due = [k for k, t in retry_at.items() if t <= now]
        for k in due:
            del retry_at[k]
        if due:
            self.count("delete_retries", len(due))
        return due

    # -- jobs -----------------------------------------------------------------------------------

    def stores_done(
        self,
        keys: list[bytes],
        failed: dict[bytes, int],
        removed: Collection[bytes] = (),
        request: str = "",
    ) -> tuple[list[bytes], int]:
        """A store job of ``keys`` (prefix order) finished for ``request`` ("" for none):
        ``failed`` maps key -> code; ``removed``: keys removed while it ran, stored but not
        counted. The counted keys of the job, those it found stored included, are ranked as the
        request's.

        Returns:
            ``(unconfirmed, full)``: keys whose write failed once a worker had it (it may still
            have published the chunk: the caller removes it, :meth:`unconfirmed_stores`), and how
            many writes found the medium full (``NO_SPACE`` from a worker). Unbounded: nothing.
        """
        if not self.bounded:
            return [], 0
        index = self.index
        full = 0
        unconfirmed: list[bytes] = []
        new: list[int] = []
        for key in keys:
            code = failed.get(key)
            if code in (m.NO_SPACE, m.REJECTED, m.TENANT_QUOTA) and key in self.refused:
                n = self.refused.pop(key) - 1  # refused at admission, never written
                if n:
                    self.refused[key] = n
                continue
            nbytes = self.reserved.pop(key, None)
            if self._reserved_for and nbytes is not None:
                t = self._reserved_for.pop(key, None)
                if t is not None:
                    left = self._pending[t] - nbytes
                    if left:
                        self._pending[t] = left
                    else:
                        del self._pending[t]
            if code is None:
                if key not in index and key not in removed:
                    new.append(self._count(key, nbytes or self.unit_bytes))
            elif code == m.NO_SPACE and nbytes is not None:
                full += 1  # the writer found the medium full (ENOSPC, quota, the free-space floor)
            elif nbytes is not None and key not in index:
                unconfirmed.append(key)
        self._rank(keys, request, False)
        self._evictable(new)
        return unconfirmed, full

    def unconfirmed_stores(self, keys: list[bytes]) -> None:
        """Writes of ``keys`` failed after a worker had them: until the caller's delete answers,
        each counts as unconfirmed (as an evicted chunk); a removal that fails keeps it counted
        (CASES C32). Counts ``unconfirmed_store_removals``."""
        deleting, now, unit = self.deleting, self.clock(), self.unit_bytes
        for k in keys:
            deleting[k] = deleting.get(k, 0) + 1
            self.unconfirmed[k] = self.unconfirmed.get(k, 0) + unit
            self.unconfirmed_bytes += unit
            self._remember_eviction(k, now)
        self.count("unconfirmed_store_removals", len(keys))

    def loads_started(self, keys: Iterable[bytes]) -> None:
        """Loads of ``keys`` were sent: they are not evicted until :meth:`loads_done`."""
        if not self.bounded:
            return
        loading, ids, discard = self.loading, self._ids, self._heap.discard
        for k in keys:
            n = loading.get(k, 0)
            loading[k] = n + 1
            if not n and k in ids:
                discard(ids[k])

    def loads_done(
        self, keys: list[bytes], failed: dict[bytes, int], request: str = ""
    ) -> list[bytes]:
        """A load job of ``keys`` (prefix order) finished for ``request`` ("" for none): the
        chunks read are ranked as used by it (a successful read does not prove a chunk is still
        there, so only chunks already counted); a chunk found missing, corrupt or forged (and
        removed by the worker), or out of reach behind a symbolic link (removed), is no longer
        counted. Returns those it stopped counting."""
        if not self.bounded:
            return []
        index, loading, ids = self.index, self.loading, self._ids
        ended: list[int] = []
        gone: list[bytes] = []
        for key in keys:
            n = loading.get(key, 0) - 1
            if n > 0:
                loading[key] = n
            else:
                loading.pop(key, None)
            if key not in index:
                continue
            if failed.get(key, m.OK) in (m.MISSING, m.CORRUPT, m.FORGED, m.UNSAFE_PATH):
                self.gone(key)
                gone.append(key)
            elif n <= 0:
                ended.append(ids[key])  # no other load of it in flight
        self._rank([k for k in keys if k not in failed] if failed else keys, request, True)
        self._evictable(ended)
        return gone

    def gone(self, key: bytes) -> None:
        """``key``, counted, is no longer on the medium (a load or a probe found it missing, or
        the worker removed it as corrupt): it is no longer counted."""
        self._uncount(key)
        self.undeletable.discard(key)

    def adopt(self, entries: list[tuple[bytes, int, float]]) -> int:
        """Count chunks found stored at start (``(key, bytes, mtime)``), ranked below anything
        this instance stored, the oldest lowest; an entry whose size is not ``unit_bytes`` is
        not a chunk this tier wrote and is left uncounted (``scan_odd_sizes``). Returns the bytes
        adopted; counts ``adopted_chunks``. Unbounded: nothing is counted."""
        if not self.bounded:
            return 0
        index, major, minor = self.index, self.ranks.major, self.ranks.minor
        adopted = 0
        adopted_bytes = 0
        new: list[int] = []
        unit, odd = self.unit_bytes, 0
        for key, size, _mtime in sorted(entries, key=lambda e: e[2]):
            if size != unit:
                # not a chunk of this namespace's size (planted, or a sparse file claiming any
                # size): its claimed size would skew the cap; a load of it fails as corrupt
                odd += 1
                continue
            if key in index or key in self.reserved or key in self.unconfirmed:
                continue  # counted already, being written, or being deleted
            if key in self.deleting:
                continue  # its removal is in flight: the listing may predate it
            ident = self._count(key, size)
            self._adopted += 1
            major[ident], minor[ident] = 0, self._adopted  # below every rank a use gives (>= 1)
            new.append(ident)
            adopted += 1
            adopted_bytes += size
        self._evictable(new)
        self.count("adopted_chunks", adopted)
        if odd:
            self.count("scan_odd_sizes", odd)
        return adopted_bytes
