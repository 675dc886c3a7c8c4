"""Promotion holds: which host slots a promotion, an admission or a store may not evict.

::

    lookup HIT ──────────▶ hit_slots (until the step ends: the engine may load them this step)
    promotion for req ───▶ claim(req): its rank (older requests first), whether its chunk is held
         │  room ─▶ promoted(): held for req until its complete_load (loaded), its finish
         │          (forget), or promotion_hold_steps steps without a lookup by it (next_step)
         └ no room ─▶ wait(): RETRY while older requests' held chunks fill the host tier (at most
                     promotion_hold_steps steps), else MISS
    store ───────────────▶ store_protect(): held slots are evicted only when nothing else makes room

A chunk promoted from a secondary tier for a request stays in the host tier until that request
loads it, so requests past the host tier's size do not evict each other's promoted chunks before
they are loaded (docs/profiles/thrash.md). Requests are ranked by their first promotion: a
promotion never evicts a chunk held for its own or an older request, so no two requests wait for
each other. Holds take at most ``cap`` slots (what one tier's in-flight stores may leave,
``tier_pin_fraction``), so write-through keeps room without evicting held chunks (CASES C37).

The :class:`~kvoffload.tiering.TieringManager` owns one and calls it under its lock; it touches
the host tier only to read it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from kvoffload.host import READY, HostTier
from kvoffload.stats import Stats

NO_RANK = 1 << 62
"""The rank of a promotion no request waits for (a peer's): younger than every request's."""


class _Protected:
    """The slots a promotion for a request of ``rank`` must not evict (those told HIT since the
    last step, those held for this or older requests; every held slot for rank
    :data:`NO_RANK`), as a view over the holds' own tables: ``slot in p`` costs two dict
    lookups, where building the set would cost one step per held slot, once per promoted
    chunk. Iterating it (counting, or a set for an out-of-tree policy) takes that step."""

    __slots__ = ("hit", "held", "rank")

    def __init__(self, hit: set[int], held: dict[int, int], rank: int):
        self.hit, self.held, self.rank = hit, held, rank

    def __contains__(self, slot: object) -> bool:
        if slot in self.hit:
            return True
        r = self.held.get(slot)  # type: ignore[call-overload]
        return r is not None and r <= self.rank

    def __bool__(self) -> bool:
        return bool(self.hit) or bool(self.held)

    def __iter__(self) -> Iterator[int]:
        """Every protected slot once."""
        hit, rank = self.hit, self.rank
        yield from hit
        for slot, r in self.held.items():
            if r <= rank and slot not in hit:
                yield slot


class PromotionHolds:
    """The hold policy over one host tier (see the module docstring). Not thread-safe: its owner
    calls it under its lock.

    Args:
        host: the host tier (read only: slot states, pins, the policy's eviction order).
        steps: ``promotion_hold_steps``; 0 holds nothing (every promotion takes what room there
            is, a promotion with no room is a MISS).
        cap: the most chunks held at once (at least 1).
        stats: the owner's counters: ``promotion_waits``, ``evicted_holds`` and
            ``expired_holds`` are counted there.
    """

    def __init__(self, host: HostTier, steps: int, cap: int, stats: Stats):
        self.host = host
        self.steps = steps
        self.cap = cap
        self.stats = stats
        #: Slots the engine was told HIT since its last step: it may prepare_load them before
        #: the step ends, so promotions (the engine's, or a peer's) and admissions (which run
        #: between the engine's calls) never evict them. The engine's own stores may: it
        #: prepares them after its loads.
        self.hit_slots: set[int] = set()
        #: key -> [slot, holder, rank, step last seen], in the order their request last looked
        #: them up (oldest first): expiry reads the front.
        self.chunks: OrderedDict[bytes, list] = OrderedDict()
        #: slot -> its holder's rank
        self.slots: dict[int, int] = {}
        self.step_no = 0
        self._held_by: dict[str, set[bytes]] = {}
        self._rank: dict[str, int] = {}
        self._next_rank = 0
        self._waiting_since: dict[str, int] = {}  # request -> step of its first wait for room
        self._blocked_rank = NO_RANK  # requests of this rank or younger found no room this step
        self._oldest_rank: int | None = None  # cache of min(slots.values())

    def __len__(self) -> int:
        """Chunks held now."""
        return len(self.chunks)

    def requests(self) -> set[str]:
        """The requests anything is kept for: a hold, a rank or a wait for room (empty once every
        request has finished: :meth:`forget`, CASES C12)."""
        return set(self._held_by) | set(self._rank) | set(self._waiting_since)

    # -- the engine's steps and lookups -----------------------------------------------------------

    def next_step(self) -> None:
        """A scheduler step ended: the step's host hits are loaded or dropped, waiting requests
        may try again, and holds whose request has not looked their chunk up for ``steps``
        steps lapse (it went elsewhere: the chunk is evictable again). The holds are in the
        order they were last looked up, so only the stale ones at the front are read."""
        self.hit_slots.clear()
        self.step_no += 1
        self._blocked_rank = NO_RANK
        if self.chunks:
            now, limit, holds = self.step_no, self.steps, self.chunks
            stale = list(itertools.takewhile(lambda k: now - holds[k][3] > limit, holds))
            for k in stale:
                self._drop(k)
            self.stats.expired_holds += len(stale)

    def seen(self, key: bytes, req_id: str) -> None:
        """``req_id`` looked ``key`` up and found it in the host tier: a hold its request still
        wants lives on."""
        h = self.chunks.get(key)
        if h is not None and h[1] == req_id:
            h[3] = self.step_no
            self.chunks.move_to_end(key)

    def unblock(self) -> None:
        """Room may have appeared (a transfer ended, a write was published or freed): requests
        that found none this step may try again."""
        self._blocked_rank = NO_RANK

    # -- promotions -------------------------------------------------------------------------------

    def claim(self, req_id: str) -> tuple[int, bool, bool]:
        """A promotion for request ``req_id`` (``steps`` > 0): ``(its rank, whether the chunk is
        held for it, whether it may take a host slot now)``. It may not while an older request
        found no room this step; past ``cap`` held chunks only the oldest holding request
        promotes, and unheld."""
        rank = self._rank.get(req_id, -1)
        if rank < 0:
            rank = self._rank[req_id] = self._next_rank
            self._next_rank += 1
        if rank >= self._blocked_rank:
            return rank, False, False
        if len(self.chunks) >= self.cap:
            return rank, False, rank <= self._oldest_hold_rank()
        return rank, True, True

    def protected(self, rank: int) -> _Protected:
        """Slots a promotion of a request of ``rank`` must not evict: those the engine was told
        HIT since its last step, and those held for this or older requests (every held slot for
        a peer's promotion or an admission, rank :data:`NO_RANK`); a view, never copied."""
        return _Protected(self.hit_slots, self.slots, rank)

    def victim_outside(self, protect: _Protected) -> bool:
        """Whether an evictable host slot is outside ``protect``. Asked of the policy, which
        walks its eviction order from the next victim and stops at the first unprotected slot;
        the slots protected are never counted, which cost one step per held slot for every
        promoted chunk (quadratic in a long prompt)."""
        host = self.host
        if host.num_evictable > len(protect.hit) + len(protect.held):
            return True  # more evictable slots than protected ones
        found = host.has_victim(protect)
        if found is None:  # an out-of-tree policy that cannot tell
            return self.evictable_outside(protect) > 0
        return found

    def evictable_outside(self, protect: Iterable[int]) -> int:
        """Evictable host slots (READY, unpinned) that are not in ``protect``."""
        state, refs = self.host.state, self.host.refs
        return self.host.num_evictable - sum(
            1 for s in protect if state[s] == READY and not refs[s]
        )

    def wait(self, req_id: str, rank: int) -> bool:
        """No host slot for a promotion of ``req_id`` (of ``rank``): whether it should wait
        (RETRY, counted as a ``promotion_waits``): while chunks held for older requests fill the
        host tier (they end once those requests load them, or lapse) and for at most ``steps``
        steps; else it is a MISS. A request is never told to wait for its own chunks or younger
        requests', so no two requests wait for each other."""
        self._blocked_rank = min(self._blocked_rank, rank)
        since = self._waiting_since.setdefault(req_id, self.step_no)
        if self.step_no - since <= self.steps and self._oldest_hold_rank() < rank:
            self.stats.promotion_waits += 1
            return True
        return False

    def promoted(self, key: bytes, slot: int, req_id: str, rank: int, hold: bool) -> None:
        """A promotion of ``key`` for ``req_id`` took ``slot`` (its claim said ``hold``)."""
        if hold:
            self.chunks[key] = [slot, req_id, rank, self.step_no]
            self.chunks.move_to_end(key)
            held = self.slots
            r = self._oldest_rank
            # the cached minimum stays true when a new slot is held (no scan of the holds per
            # promotion); a slot held again may have held the minimum: recomputed when asked
            self._oldest_rank = None if r is None or slot in held else min(r, rank)
            held[slot] = rank
            self._held_by.setdefault(req_id, set()).add(key)
        self._waiting_since.pop(req_id, None)

    def evicted(self, keys: Iterable[bytes]) -> None:
        """``keys`` were evicted (by a store, or another promotion): their holds end, counted
        as ``evicted_holds``."""
        if self.chunks:
            for k in keys:
                if self._drop(k):
                    self.stats.evicted_holds += 1

    def failed(self, keys: Iterable[bytes]) -> None:
        """The promotions of ``keys`` failed: their holds end."""
        if self.chunks:
            for k in keys:
                self._drop(k)

    def loaded(self, req_id: str, keys: Iterable[bytes]) -> None:
        """``req_id`` loaded ``keys`` (its pins dropped: room may have appeared): the holds it
        had on them end."""
        self._blocked_rank = NO_RANK
        held = self._held_by.get(req_id)
        if held:
            for k in [k for k in keys if k in held]:
                self._drop(k)

    def forget(self, req_id: str) -> None:
        """``req_id`` finished (or was aborted): its holds end, nothing is kept for it."""
        if req_id in self._rank or req_id in self._held_by:
            for k in list(self._held_by.get(req_id, ())):
                self._drop(k)
            self._rank.pop(req_id, None)
            self._waiting_since.pop(req_id, None)

    # -- stores -----------------------------------------------------------------------------------

    def store_protect(self, keys: Sequence[bytes]) -> set[int] | tuple[()]:
        """Held slots a store of ``keys`` must not evict (``()`` when none is held): all of
        them when the store fits without them; else all but as many as it lacks, taking the
        chunks of the youngest requests (least recently looked up first)."""
        held = self.slots
        if not held:
            return ()
        host = self.host
        new = sum(1 for k in dict.fromkeys(keys) if not host.is_present(k))
        state, refs = host.state, host.refs
        evictable_held = [s for s in held if state[s] == READY and not refs[s]]
        free = host.num_slots - host.num_used
        unheld = host.room_for(keys) - free - len(evictable_held)
        lack = new - free - max(0, unheld)
        if lack <= 0:
            return set(held)
        holds = self.chunks
        by_age = sorted(
            evictable_held,
            key=lambda s: (
                -held[s],
                holds[k][3] if (k := host.keys[s]) is not None and k in holds else 0,
            ),
        )
        give = set(by_age[:lack])
        return {s for s in held if s not in give}

    # -- reset ------------------------------------------------------------------------------------

    def reset(self) -> None:
        """The host tier forgot every chunk: no slot is held or protected any more, no request
        ranked or waiting."""
        self.hit_slots.clear()
        self.chunks.clear()
        self.slots.clear()
        self._held_by.clear()
        self._rank.clear()
        self._waiting_since.clear()
        self._oldest_rank = None
        self._blocked_rank = NO_RANK

    # -- internals --------------------------------------------------------------------------------

    def _oldest_hold_rank(self) -> int:
        r = self._oldest_rank
        if r is None:
            r = self._oldest_rank = min(self.slots.values(), default=NO_RANK)
        return r

    def _drop(self, key: bytes) -> bool:
        """End the hold on ``key`` (False: none). Room may have appeared for waiting requests."""
        h = self.chunks.pop(key, None)
        if h is None:
            return False
        slot, req_id = h[0], h[1]
        if self.slots.get(slot) == h[2]:
            del self.slots[slot]
        keys = self._held_by.get(req_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._held_by[req_id]
                if req_id not in self._waiting_since:
                    self._rank.pop(req_id, None)  # a later promotion ranks it anew
        self._oldest_rank = None
        self._blocked_rank = NO_RANK
        return True
