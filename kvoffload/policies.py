"""Host-tier eviction policies over arena slots: ``lru`` and ``arc``.

Every chunk has a *rank*; of the evictable chunks (ready, no pins) the lowest rank goes first. The
built-in policies keep the evictable slots in lazily invalidated min-heaps of ranks (as vLLM's
``LRUCachePolicy`` does): a rank change or a slot becoming evictable pushes an entry, an entry whose
slot's rank or evictability has changed since is skipped when popped, and the heap is rebuilt from
the evictable set once it holds twice as many entries. A pin removes a slot from the evictable set
and keeps its rank, so a transfer out of a chunk (a write-through, a peer's read) never moves it in
the eviction order; only a use does. Every operation is O(log n); a full tier whose slots are all
pinned answers "nothing to evict" from a count, without scanning (CASES C23).

Ranks follow prefixes (CASES C47). A request reads and stores its prefix head to tail, and a prefix
is usable only up to its first missing chunk: ranked by time of use, a prefix's head would be its
least recently used chunk and go first, leaving a tail that can never be served. So, as in vLLM
0.33: a request takes one rank when it first places chunks, shared by all its batches while it runs, and
each of its chunks is ordered within it by its position in the request (the order the request first
placed them: head first), the tail lowest; when the request finishes, every chunk it ranked that is
still stored (since ranked by another request or not) is ranked afresh, tail first, head last (the
most recently used). A use outside any request ranks its chunks afresh,
tail first. No walk over a request's chunks per eviction: one walk per finished request.

Protocol (called by :class:`~kvoffload.host.HostTier`):
    prepare(keys)         these new keys are about to be admitted (before any eviction for them)
    admit(slot, key)      a new chunk took the slot (still being written: not evictable)
    rank_prefix(slots, request, use)
                          a batch of chunks (prefix order, head first) was stored (``use`` False,
                          once ready) or used (a hit, a load, a peer's read: ``use`` True), for
                          ``request`` ("" for none)
    make_evictable(slot)  the slot became ready and unpinned (after rank_prefix for a new chunk)
    make_pinned(slot)     the slot got its first pin: not evictable until it has none
    access(slot)          the chunk was used outside any batch
    request_finished(request)
                          the request is done (its chunks are ranked afresh)
    remove(slot)          the chunk left without eviction (failed write, explicit removal)
    evict(n, protected)   pick n evictable slots, never one in ``protected``; None if impossible
                          (``protected`` is a set for out-of-tree policies; the built-in ones get
                          a container read by ``slot in protected`` alone)

The host tier tells a store batch's new chunks in one ``admit_many(slots, keys)`` and the slots
that became evictable together in one ``make_evictable_many(slots)``; their defaults call ``admit``
and ``make_evictable`` per slot, in order (LRU does the batch in one loop: per chunk, the engine
thread pays for no Python call of its own; a subclass of it that overrides ``admit`` or
``make_evictable`` is told each slot, as the defaults do; ARC keeps the defaults).

Out-of-tree policies subclass :class:`EvictionPolicy` and are named by ``module.path:ClassName``.
What they are told: every call above. :meth:`EvictionPolicy.rank_prefix` calls :meth:`access`
once per slot for a use, tail first, and nothing for a store, whose slots
:class:`~kvoffload.host.HostTier` then makes evictable tail first: a policy ordered by recency
keeps a batch's head longest without knowing about requests; one that wants the order across a
request's batches overrides ``rank_prefix`` and ``request_finished``, as LRU and ARC do.
"""

from __future__ import annotations

import heapq
import importlib
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from typing_extensions import override

MAX_REQUESTS = 65536
"""Requests in flight whose rank and chunks a built-in policy keeps (the oldest are forgotten past
it: a request whose end is never reported cannot grow the table; a forgotten one's chunks keep
their ranks and are not ranked afresh when it ends)."""


class _Request:
    __slots__ = ("token", "rank", "next_pos", "slots")

    def __init__(self, token: int, rank: int):
        self.token = token  # tags the slots this request ranked (PrefixRanks.placed_by)
        self.rank = rank
        self.next_pos = 0
        # (slot, its chunk's generation) in the order first ranked: head first
        self.slots: list[tuple[int, int]] = []


class PrefixRanks:
    """The ranks of slots ``0..n-1``, ``(major, minor)``, lower evicted first (module docstring):
    a request's chunks ``(its rank, -position)``, anything else ``(clock, 0)``."""

    __slots__ = ("major", "minor", "placed_by", "gen", "clock", "tokens", "requests", "done")

    def __init__(self, n: int):
        self.major = array("q", bytes(8 * n))
        self.minor = array("q", bytes(8 * n))
        self.placed_by = array("q", bytes(8 * n))  # token of the last request that saw it (0: none)
        self.gen = array("q", bytes(8 * n))  # chunks the slot has held
        self.clock = 0
        self.tokens = 0
        self.requests: OrderedDict[str, _Request] = OrderedDict()
        # requests that finished (the last MAX_REQUESTS): a store or promotion of theirs that
        # completes after the finish (vLLM ends a request before its last store's copy ends)
        # does not bring them back
        self.done: OrderedDict[str, None] = OrderedDict()

    def grow(self, n: int) -> None:
        """Make room for slots up to ``n - 1`` (new ones unranked); never shrinks."""
        more = n - len(self.gen)
        if more > 0:
            zeros = bytes(8 * more)
            for a in (self.major, self.minor, self.placed_by, self.gen):
                a.frombytes(zeros)

    def admitted(self, slots: Sequence[int]) -> None:
        """New chunks took ``slots``: no rank yet (the lowest), no request has ranked them."""
        major, minor, placed_by, gen = self.major, self.minor, self.placed_by, self.gen
        for slot in slots:
            major[slot] = 0
            minor[slot] = 0
            placed_by[slot] = 0
            gen[slot] += 1

    def fresh(self, slots: Sequence[int]) -> None:
        """Rank ``slots`` (head first) as used now, tail first: the head highest."""
        major, minor, placed_by = self.major, self.minor, self.placed_by
        clock = self.clock
        for slot in reversed(slots):
            clock += 1
            major[slot] = clock
            minor[slot] = 0
            placed_by[slot] = 0
        self.clock = clock

    def of_request(self, request: str, slots: Sequence[int], use: bool = False) -> list[int]:
        """Rank ``slots`` (head first) as ``request``'s: its rank, ordered by position (a slot
        it ranked before keeps its position), where that raises a slot's rank. Returns the slots
        whose rank changed."""
        req = self.requests.get(request)
        if req is None and request in self.done:
            # late: a store's chunks keep the rank its finish gave them, and one unranked yet
            # (a promotion landing after the finish) is ranked as used now; a use is one now
            late = list(slots) if use else [s for s in slots if self.major[s] == 0]
            self.fresh(late)
            return late
        if req is None:
            self.tokens += 1
            self.clock += 1
            req = _Request(self.tokens, self.clock)
            if len(self.requests) >= MAX_REQUESTS:
                self.requests.popitem(last=False)
            self.requests[request] = req
        major, minor, placed_by, gen = self.major, self.minor, self.placed_by, self.gen
        token, rank, pos = req.token, req.rank, req.next_pos
        mine = req.slots
        changed = []
        for slot in slots:
            if placed_by[slot] == token:
                continue  # seen by this request already: its position stays
            placed_by[slot] = token
            mine.append((slot, gen[slot]))
            # a rank only rises: an older request does not move a chunk a newer one (or a use
            # since) ranked above it
            if major[slot] < rank or (major[slot] == rank and minor[slot] < -pos):
                major[slot] = rank
                minor[slot] = -pos
                changed.append(slot)
            pos += 1
        req.next_pos = pos
        if len(mine) > 2 * len(gen):  # a request that never finishes: keep its live slots only
            mine[:] = [e for e in dict.fromkeys(mine) if gen[e[0]] == e[1]]
        return changed

    def rank(self, request: str, slots: Sequence[int], use: bool) -> Sequence[int]:
        """Rank a batch (head first): as ``request``'s (:meth:`of_request`), or, for none, as
        used now (:meth:`fresh`). Returns the slots whose rank changed."""
        if request:
            return self.of_request(request, slots, use)
        self.fresh(slots)
        return slots

    def finished(self, request: str) -> list[int]:
        """``request`` is done: every chunk it ranked that is still stored is ranked afresh,
        tail first (its head the most recent). Returns their slots. A request that ranked
        nothing yet is recorded as done all the same: a store of it that completes later (a
        secondary tier hears of a request only then) does not bring it back."""
        req = self.requests.pop(request, None)
        if len(self.done) >= MAX_REQUESTS:
            self.done.popitem(last=False)
        self.done[request] = None
        if req is None:
            return []
        gen = self.gen
        mine = [s for s, g in req.slots if gen[s] == g]
        self.fresh(mine)
        return mine


class RankHeap:
    """Evictable slots (of ``0..n-1``) by rank, lowest first: a lazily invalidated min-heap over
    ``ranks``. At most one entry per slot carries its current rank (``queued``): a slot made
    evictable again with its rank unchanged (a pin released) pushes nothing."""

    __slots__ = ("ranks", "members", "heap", "queued")

    def __init__(self, ranks: PrefixRanks, n: int):
        self.ranks = ranks
        self.members: set[int] = set()
        self.heap: list[tuple[int, int, int]] = []
        self.queued = bytearray(n)  # 1: the heap holds an entry with the slot's current rank

    def add(self, slots: Iterable[int]) -> None:
        """``slots`` may be popped from now on (with their current ranks)."""
        members, queued = self.members, self.queued
        new = []
        for slot in slots:
            if slot not in members:
                members.add(slot)
                if not queued[slot]:
                    new.append(slot)
        if new:
            self._push(new)

    def discard(self, slot: int) -> None:
        """``slot`` may not be popped until :meth:`add` (its entry is skipped when popped)."""
        self.members.discard(slot)

    def grow(self, n: int) -> None:
        """Make room for slots up to ``n - 1`` (with :meth:`PrefixRanks.grow`)."""
        if n > len(self.queued):
            self.queued.extend(bytes(n - len(self.queued)))

    def reranked(self, slots: Iterable[int]) -> None:
        """``slots``' ranks changed (their entries are stale)."""
        members, queued = self.members, self.queued
        mine = []
        for slot in slots:
            queued[slot] = 0
            if slot in members:
                mine.append(slot)
        if mine:
            self._push(mine)

    def _push(self, slots: list[int]) -> None:
        """An entry with its current rank for each of ``slots`` (members without one); the heap
        rebuilt instead once stale entries outnumber the members."""
        heap, members, queued = self.heap, self.members, self.queued
        major, minor = self.ranks.major, self.ranks.minor
        for slot in slots:
            if queued[slot]:
                continue  # a rebuild gave it one
            if len(heap) >= 2 * len(members) + 64:
                self._rebuild()
                queued = self.queued
            else:
                heapq.heappush(heap, (major[slot], minor[slot], slot))
                queued[slot] = 1

    def _rebuild(self) -> None:
        """The heap anew from the members, one entry each (the stale ones dropped)."""
        heap, members = self.heap, self.members
        major, minor = self.ranks.major, self.ranks.minor
        heap[:] = [(major[s], minor[s], s) for s in members]
        heapq.heapify(heap)
        queued = self.queued = bytearray(len(self.queued))
        for s in members:
            queued[s] = 1

    def pop(self, protected: Container[int], deferred: list[tuple[int, int, int]]) -> int:
        """Take the lowest-ranked member outside ``protected`` (-1: none); entries of protected
        members are put in ``deferred`` (the caller pushes them back)."""
        heap, members, queued = self.heap, self.members, self.queued
        major, minor = self.ranks.major, self.ranks.minor
        while heap:
            e = heapq.heappop(heap)
            slot = e[2]
            if major[slot] != e[0] or minor[slot] != e[1]:
                continue  # an older rank's
            if slot not in members:
                queued[slot] = 0  # its current entry, gone: pushed again if it comes back
                continue
            if slot in protected:
                deferred.append(e)
                continue
            queued[slot] = 0
            members.discard(slot)
            return slot
        return -1

    def restore(self, taken: Sequence[int], deferred: Sequence[tuple[int, int, int]]) -> None:
        """Undo :meth:`pop`: ``taken`` are members again, ``deferred`` entries back."""
        self.add(taken)
        for e in deferred:
            heapq.heappush(self.heap, e)

    def any_outside(self, protected: Container[int]) -> bool:
        """Whether some member is not in ``protected`` (O(members))."""
        return any(slot not in protected for slot in self.members)

    def __len__(self) -> int:
        return len(self.members)


class EvictionPolicy(ABC):
    """Base class; see the module docstring for the protocol."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots

    def prepare(self, keys: list[bytes]) -> None:
        """Called with the keys of a store batch before room is made for them."""

    @abstractmethod
    def admit(self, slot: int, key: bytes) -> None:
        """A new chunk ``key`` took ``slot`` (0 <= slot < num_slots); it is still being written, so
        not evictable until :meth:`make_evictable`."""

    def admit_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """:meth:`admit` of each ``(slots[i], keys[i])``, in order: a store batch's new chunks
        (the host tier calls this one; LRU does the batch in one loop)."""
        for slot, key in zip(slots, keys):
            self.admit(slot, key)

    def rank_prefix(self, slots: Sequence[int], request: str, use: bool) -> None:
        """A batch of chunks in ``slots`` (prefix order: head first) was stored (``use`` False:
        they are ready, and those unpinned are made evictable next) or used (``use`` True), for
        ``request`` ("" when none). Default: :meth:`access` per slot, tail first, for a use."""
        if use:
            for slot in reversed(slots):
                self.access(slot)

    def request_finished(self, request: str) -> None:
        """``request`` is done. Default: nothing."""

    @abstractmethod
    def make_evictable(self, slot: int) -> None:
        """``slot`` became ready and unpinned: it may be chosen by :meth:`evict` from now on."""

    def make_evictable_many(self, slots: Sequence[int]) -> None:
        """:meth:`make_evictable` of each of ``slots``, in order (the host tier calls this one,
        a batch's tail first)."""
        for slot in slots:
            self.make_evictable(slot)

    @abstractmethod
    def make_pinned(self, slot: int) -> None:
        """``slot`` got its first pin (a transfer reads it): never evict it until it is evictable
        again."""

    @abstractmethod
    def access(self, slot: int) -> None:
        """The chunk in ``slot`` was used (a hit outside any batch): refresh its place."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """The chunk left ``slot`` without an eviction (a failed write, an explicit removal):
        forget it."""

    @abstractmethod
    def evict(self, n: int, protected: Container[int], keys: list) -> list[int] | None:
        """Choose ``n`` evictable slots outside ``protected`` (``keys[slot]`` gives a slot's key).
        Out-of-tree policies get a set; the built-in LRU and ARC a container that supports
        ``in`` only (a view over the tiering manager's holds, never copied).
        Returns None, evicting nothing, when that many cannot be found."""

    def has_victim(self, protected: Container[int]) -> bool | None:
        """Whether :meth:`evict` would find one slot outside ``protected``, changing nothing;
        None when the policy cannot tell (the caller then counts the protected slots itself).
        Asked before a promotion, with the slots told HIT and held for requests as
        ``protected``, of the built-in policies only."""
        return None

    @abstractmethod
    def clear(self) -> None:
        """Forget every slot (the host tier was reset)."""


class LRUPolicy(EvictionPolicy):
    """Lowest rank first (:class:`PrefixRanks`: least recently used, a request's tail before its
    head)."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.ranks = PrefixRanks(num_slots)
        self._heap = RankHeap(self.ranks, num_slots)

    @override
    def admit(self, slot: int, key: bytes) -> None:
        self.ranks.admitted((slot,))
        self._heap.reranked((slot,))  # an entry of the slot's previous chunk is not its

    @override
    def admit_many(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        if type(self).admit is not LRUPolicy.admit:  # a subclass's own admit is told each one
            super().admit_many(slots, keys)
            return
        self.ranks.admitted(slots)
        self._heap.reranked(slots)

    @override
    def rank_prefix(self, slots: Sequence[int], request: str, use: bool) -> None:
        self._heap.reranked(self.ranks.rank(request, slots, use))

    @override
    def request_finished(self, request: str) -> None:
        self._heap.reranked(self.ranks.finished(request))

    @override
    def make_evictable(self, slot: int) -> None:
        self._heap.add((slot,))

    @override
    def make_evictable_many(self, slots: Sequence[int]) -> None:
        if type(self).make_evictable is not LRUPolicy.make_evictable:  # as admit_many
            super().make_evictable_many(slots)
            return
        self._heap.add(slots)

    @override
    def make_pinned(self, slot: int) -> None:
        self._heap.discard(slot)

    @override
    def access(self, slot: int) -> None:
        self.ranks.fresh((slot,))
        self._heap.reranked((slot,))

    @override
    def remove(self, slot: int) -> None:
        self._heap.discard(slot)

    @override
    def evict(self, n: int, protected: Container[int], keys: list) -> list[int] | None:
        heap = self._heap
        if n > len(heap):
            return None
        out: list[int] = []
        deferred: list[tuple[int, int, int]] = []
        while len(out) < n:
            slot = heap.pop(protected, deferred)
            if slot < 0:
                heap.restore(out, deferred)
                return None
            out.append(slot)
        heap.restore((), deferred)
        return out

    @override
    def has_victim(self, protected: Container[int]) -> bool:
        return self._heap.any_outside(protected)

    @override
    def clear(self) -> None:
        type(self).__init__(self, self.num_slots)


_T1, _T2 = 0, 1


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over slots.

    T1 holds chunks seen once recently, T2 chunks seen at least twice; ghost lists B1/B2 remember the
    keys recently evicted from each. A new key found in B1 grows the target size ``p`` of T1, one
    found in B2 shrinks it; eviction takes T1's lowest-ranked evictable chunk while T1 exceeds
    ``p``, else T2's (falling back to the other list when one has nothing evictable). Within each
    list, chunks are ordered by :class:`PrefixRanks` (recency, a request's tail before its head).

    One departure from the paper, for prefixes (CASES C47): a request's head is typically in T2
    (used again) and its newly stored tail in T1, so evicting T2's candidate could leave a tail no
    request can reach; when T1's candidate ranks lower than T2's, T1's goes first.
    """

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.c = num_slots
        self.p = 0.0
        self.ranks = PrefixRanks(num_slots)
        self._heaps = (RankHeap(self.ranks, num_slots), RankHeap(self.ranks, num_slots))
        self._member = bytearray(num_slots)  # 0 none, 1 T1, 2 T2
        self._sizes = [0, 0]  # members, evictable or not
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self._ghost_hits: set[bytes] = set()

    @override
    def prepare(self, keys: list[bytes]) -> None:
        # Ghost hits adapt p before REPLACE runs, as in the paper's cases II and III.
        self._ghost_hits.clear()
        for key in keys:
            if key in self.b1:
                self.p = min(self.c, self.p + max(1.0, len(self.b2) / len(self.b1)))
                del self.b1[key]
                self._ghost_hits.add(key)
            elif key in self.b2:
                self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
                del self.b2[key]
                self._ghost_hits.add(key)

    @override
    def admit(self, slot: int, key: bytes) -> None:
        lst = _T2 if key in self._ghost_hits else _T1
        self._member[slot] = lst + 1
        self._sizes[lst] += 1
        self.ranks.admitted((slot,))
        self._reranked((slot,))

    def _reranked(self, slots: Sequence[int]) -> None:
        """``slots``' ranks changed: entries of them in either list's heap are stale."""
        t1, t2 = self._heaps
        t1.reranked(slots)
        t2.reranked(slots)

    def _used_again(self, slot: int) -> None:
        """A member of T1 seen again moves to T2 (evictable or not)."""
        if self._member[slot] - 1 == _T1:
            self._sizes[_T1] -= 1
            self._sizes[_T2] += 1
            self._member[slot] = _T2 + 1
            t1, t2 = self._heaps
            if slot in t1.members:
                t1.discard(slot)
                t2.add((slot,))

    @override
    def rank_prefix(self, slots: Sequence[int], request: str, use: bool) -> None:
        member = self._member
        slots = [s for s in slots if member[s]]
        if use:
            for slot in slots:
                self._used_again(slot)
        self._reranked(self.ranks.rank(request, slots, use))

    @override
    def request_finished(self, request: str) -> None:
        self._reranked(self.ranks.finished(request))

    @override
    def make_evictable(self, slot: int) -> None:
        if self._member[slot]:
            self._heaps[self._member[slot] - 1].add((slot,))

    @override
    def make_pinned(self, slot: int) -> None:
        if self._member[slot]:
            self._heaps[self._member[slot] - 1].discard(slot)

    @override
    def access(self, slot: int) -> None:
        if not self._member[slot]:
            return
        self._used_again(slot)
        self.ranks.fresh((slot,))
        self._reranked((slot,))

    @override
    def remove(self, slot: int) -> None:
        lst = self._member[slot] - 1
        if lst >= 0:
            self._heaps[lst].discard(slot)
            self._sizes[lst] -= 1
            self._member[slot] = 0

    @override
    def evict(self, n: int, protected: Container[int], keys: list) -> list[int] | None:
        heaps = self._heaps
        if n > len(heaps[_T1]) + len(heaps[_T2]):
            return None
        chosen: list[list[int]] = [[], []]
        deferred: list[list[tuple[int, int, int]]] = [[], []]
        t1 = self._sizes[_T1]
        major, minor = self.ranks.major, self.ranks.minor
        for _ in range(n):
            first = _T1 if t1 > self.p else _T2
            lst = first
            slot = heaps[lst].pop(protected, deferred[lst])
            if slot >= 0:
                # a prefix's tail before its head (C47): a request's head is in T2 (used
                # again), its new tail in T1, so T2's candidate yields to a lower-ranked one
                # of T1; T1's yields to a lower-ranked one of T2 of the same request (a tail
                # its store found stored, counted as used)
                o = 1 - lst
                other = heaps[o].pop(protected, deferred[o])
                if other >= 0:
                    mine, theirs = (major[slot], minor[slot]), (major[other], minor[other])
                    if theirs < mine and (lst == _T2 or theirs[0] == mine[0]):
                        heaps[lst].restore((slot,), ())
                        slot, lst = other, o
                    else:
                        heaps[o].restore((other,), ())
            if slot < 0:
                lst = 1 - first
                slot = heaps[lst].pop(protected, deferred[lst])
            if slot < 0:
                for i in (_T1, _T2):
                    heaps[i].restore(chosen[i], deferred[i])
                return None
            chosen[lst].append(slot)
            if lst == _T1:
                t1 -= 1
        out: list[int] = []
        for lst in (_T1, _T2):
            heaps[lst].restore((), deferred[lst])
            ghost = self.b1 if lst == _T1 else self.b2
            for slot in chosen[lst]:
                self._sizes[lst] -= 1
                self._member[slot] = 0
                ghost[keys[slot]] = None
                out.append(slot)
        self._trim_ghosts()
        return out

    @override
    def has_victim(self, protected: Container[int]) -> bool:
        t1, t2 = self._heaps
        return t1.any_outside(protected) or t2.any_outside(protected)

    def _trim_ghosts(self) -> None:
        c = self.c
        while self.b1 and len(self.b1) + self._sizes[_T1] > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.b1) + len(self.b2) + self._sizes[_T1] + self._sizes[_T2] > 2 * c:
            self.b2.popitem(last=False)

    @override
    def clear(self) -> None:
        type(self).__init__(self, self.num_slots)

    @property
    def t1_size(self) -> int:
        """Chunks in ARC's recency list T1 (seen once since they entered), evictable or pinned."""
        return self._sizes[_T1]

    @property
    def t2_size(self) -> int:
        """Chunks in ARC's frequency list T2 (used at least twice: hit after entering, or readmitted
        while remembered in a ghost list)."""
        return self._sizes[_T2]


BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, num_slots: int, module_path: str | None = None) -> EvictionPolicy:
    """Build a policy by name (``lru``, ``arc``) or an out-of-tree ``EvictionPolicy`` subclass named
    ``name`` in module ``module_path``.

    Raises:
        ValueError: unknown name, or the class is not an ``EvictionPolicy``.
    """
    if module_path is None:
        cls = BUILTIN_POLICIES.get(name)
        if cls is None:
            raise ValueError(
                f"eviction_policy: unknown policy {name!r}; allowed: {sorted(BUILTIN_POLICIES)} "
                f"or a class name with cache_policy_module_path"
            )
    else:
        mod = importlib.import_module(module_path)
        cls = getattr(mod, name, None)
        if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
            raise ValueError(
                f"eviction_policy: {module_path}.{name} is not an EvictionPolicy subclass"
            )
    return cls(num_slots)
