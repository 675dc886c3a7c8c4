"""Serving peers from this instance's host tier: the p2p tier's lookups, leases and pushes.

::

    peer Lookup  ─▶ lookup(keys) ─▶ HIT (READY: lease it) / HIT_PENDING (being written or promoted:
                     │                ask again) / MISS per key
                     └ host miss: this instance's own non-PEER tiers ─ HIT ─▶ a promotion for
                                  peers (never held, no request's load) ─▶ HIT_PENDING
    peer Lease   ─▶ lease(keys, holder) ─▶ pinned slots (-1: not READY) ... release(holder)
    peer Offer   ─▶ admit(keys, holder) ─▶ WRITING slots (-1: present, or no room)
                     ... the pull settles ─▶ commit(keys, holder, ok): READY, or freed

The p2p tier's serving role (:class:`kvoffload.tiers.p2p.server.PeerServer`, on its node thread)
reaches the host tier only through the :class:`~kvoffload.tiering.TieringManager`'s entry points
of the same names, which take the manager's lock and call this object; the server encodes the
wire messages. Pins and writes belong to holders (one per lease, one per offer), like a request's
(CASES C28): a completion naming nothing its holder holds is ignored and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from kvoffload.holds import NO_RANK, PromotionHolds
from kvoffload.host import READY, WRITING, HostTier
from kvoffload.kv_events import EventStream
from kvoffload.refusals import Refusals
from kvoffload.stats import HOST, Stats
from kvoffload.tiers.base import LookupResult, SecondaryTierManager

_HIT, _MISS, _PENDING, _RETRY = (
    LookupResult.HIT,
    LookupResult.MISS,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
)
PEER_MEDIUM = "PEER"
"""The ``medium`` of a tier that reaches other instances' host tiers (the p2p tier): a peer's
lookup never asks it (a chunk is served from this instance only)."""


class ServingParent(Protocol):
    """What :class:`PeerServing` needs of its manager (the :class:`~kvoffload.tiering
    .TieringManager`); it calls these under the manager's lock."""

    host: HostTier
    tiers: list[SecondaryTierManager]
    stats: Stats
    holds: PromotionHolds
    events: EventStream
    refusals: Refusals

    def poll_due(self) -> bool:
        """Whether ``poll_interval_s`` has passed since the last :meth:`poll`."""
        ...

    def poll(self, submit: bool = True) -> None:
        """Apply finished tier jobs (a promotion that landed is READY after it); submit the
        queued promotions unless not ``submit``."""
        ...

    def promote_for_peer(self, tier_idx: int, key: bytes) -> bool:
        """Queue a promotion of ``key``, found in tier ``tier_idx``, for peers (True), or not
        (False: no host slot)."""
        ...

    def submit_promotions(self, peers_only: bool = False) -> None:
        """Submit the queued promotions (``peers_only``: those for no request)."""
        ...

    def serving_promotions(self) -> int:
        """Chunks promoted for peers that have not landed yet."""
        ...


class PeerServing:
    """The serving side's pins and writes over the host tier of ``parent``. Not thread-safe: its
    callers hold the manager's lock. Counted apart from the instance's own lookups and loads
    (``Stats.peer_*``)."""

    def __init__(self, parent: ServingParent):
        self.parent = parent
        self.host = parent.host
        self.stats = parent.stats
        # holder -> slot -> pins (one holder per lease)
        self._leases: dict[str, dict[int, int]] = {}
        # holder -> key -> the slot its write reserved (one holder per offer)
        self._admits: dict[str, dict[bytes, int]] = {}
        self._peer_tier = next((t.name for t in parent.tiers if t.medium == PEER_MEDIUM), "peer")

    def lookup(
        self, keys: Sequence[bytes], requester: str, max_promotions: int | None
    ) -> list[LookupResult]:
        """A peer's lookup of ``keys``: per key HIT (in the host tier, readable: lease it),
        HIT_PENDING (being written or promoted: ask again) or MISS.

        A host miss asks this instance's own secondary tiers, in order, except those of medium
        :data:`PEER_MEDIUM` (a peer is served only what this instance holds): a tier's HIT starts
        a promotion into the host tier (HIT_PENDING; MISS when no host slot is free), a RETRY
        (the tier is still looking) is HIT_PENDING. So a chunk this instance moved to its own fs
        tier is still servable (CASES C18); its host slot never comes from evicting a chunk the
        engine was told HIT since its last step. ``requester`` names the asking peer to those
        tiers (their owed-miss bookkeeping, C36). Counted as ``peer_lookups``, ``peer_hits``,
        ``peer_pending``, ``peer_promotions``. The promotions are submitted at once; with
        ``max_promotions``, no more than that many are in flight at once (a key found beyond it
        is HIT_PENDING, not promoted yet), so peers' lookups cannot churn the host tier."""
        parent = self.parent
        out = [_MISS] * len(keys)
        index, state = self.host.index, self.host.state
        hits = pending = promoted = 0
        budget = (
            len(keys) if max_promotions is None else max_promotions - parent.serving_promotions()
        )
        if parent.poll_due() and any(k not in index for k in keys):
            # a promotion that just landed answers HIT; the engine's own queued promotions wait
            # for its step's end (a request's prefix goes out whole, TieringManager.poll)
            parent.submit_promotions(peers_only=True)
            parent.poll(submit=False)
        for j, key in enumerate(keys):
            slot = index.get(key)
            if slot is not None:
                if state[slot] == READY:
                    out[j] = _HIT
                    hits += 1
                else:
                    out[j] = _PENDING
                    pending += 1
                continue
            any_retry = False
            verdict = _MISS
            for i, tier in enumerate(parent.tiers):
                if tier.medium == PEER_MEDIUM:
                    continue
                r = tier.lookup(key, requester)
                if r is _HIT:
                    if promoted >= budget:  # ask again once promotions have landed
                        verdict = _PENDING
                    elif parent.promote_for_peer(i, key):
                        verdict = _PENDING
                        promoted += 1
                    break
                if r is _RETRY:
                    any_retry = True
            else:
                if any_retry:
                    verdict = _PENDING
            out[j] = verdict
            pending += verdict is _PENDING
        stats = self.stats
        stats.peer_lookups += len(keys)
        stats.peer_hits += hits
        stats.peer_pending += pending
        stats.peer_promotions += promoted
        if promoted:
            parent.submit_promotions(peers_only=True)
        return out

    def lease(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Pin the READY ``keys`` for a peer's read, on behalf of ``holder`` (one holder per
        lease: its pins are dropped together by :meth:`release`): one host slot per key, -1 for
        a key not READY (absent, being written, quarantined), pinned for nothing. Pins are
        counted per holder like a request's (CASES C28): the manager's ``pins_held`` includes
        them, a reset quarantines their slots until released. A lease is a use of the chunks
        (recency), not a load: no movement, no ``loads_from``."""
        host = self.host
        index, state = host.index, host.state
        pins = self._leases.get(holder)
        if pins is None:
            pins = {}
        out: list[int] = []
        used: list[bytes] = []
        for k in keys:
            slot = index.get(k)
            if slot is None or state[slot] != READY:
                out.append(-1)
                continue
            host.pin((k,))
            pins[slot] = pins.get(slot, 0) + 1
            out.append(slot)
            used.append(k)
        if pins:
            self._leases[holder] = pins
        host.access(used)  # a use now, tail first: not a request of the policy's (C47 review)
        self.stats.peer_leased += len(used)
        return out

    def release(self, holder: str) -> None:
        """Drop every pin ``holder`` took with :meth:`lease`; an unknown holder is ignored and
        counted (``stale_peer_completions``)."""
        pins = self._leases.pop(holder, None)
        if pins is None:
            self.stats.stale_peer_completions += 1
            return
        unpin = self.host.unpin_slots
        for slot, n in pins.items():
            unpin((slot,) * n)

    def admit(self, keys: Sequence[bytes], holder: str) -> list[int]:
        """Reserve host slots (WRITING) for a peer's push of ``keys``, on behalf of ``holder``:
        one slot per key, -1 where the key is present already (any state, a quarantined write
        included), repeated earlier in ``keys``, or there is no room. Room is made by evicting
        READY, unpinned chunks (never one of ``keys``, one the engine was told HIT since its last
        step, or one held for a request's load); when not all fit, the first ones get slots
        (keys are prefix ordered). Each reserved write ends with :meth:`commit` by the same
        holder, once the pull into it has settled (never before: a late write could land in a
        reused slot)."""
        host = self.host
        out = [-1] * len(keys)
        new: dict[bytes, int] = {}  # key -> its position in keys
        for j, k in enumerate(keys):
            if k not in new and not host.is_present(k):
                new[k] = j
        if not new:
            return out
        room = host.room_for(keys)
        # evictable slots the engine may still load from, or held for a request's load, are
        # no room
        protect = self.parent.holds.protected(NO_RANK)
        if protect:
            mine = {host.index[k] for k in keys if k in host.index}
            room -= sum(
                1 for s in protect if s not in mine and host.state[s] == READY and not host.refs[s]
            )
        take = list(new)[: max(0, room)]
        present = [k for k in keys if k not in new]
        plan = host.allocate(take + present, protect) if take else None
        if plan is not None and plan.refused:  # a tenant's quota (a tenant this instance knows)
            self.parent.refusals.tenant_quota("store", plan.refused, "")
        if plan is None or not plan.slots:
            return out
        admitted = self._admits.setdefault(holder, {})
        for k, slot in zip(plan.keys, plan.slots):
            out[new[k]] = slot
            admitted[k] = slot
        self.stats.peer_admitted += len(plan.keys)
        return out

    def commit(self, keys: Iterable[bytes], holder: str, ok: bool) -> list[bytes]:
        """End ``holder``'s writes of ``keys`` reserved by :meth:`admit`: publish them (READY, a
        host ``stored`` event and a movement from the p2p tier) when ``ok``, else free their
        slots. A key ``holder`` reserved
        no write for is ignored and counted (``stale_peer_completions``); a write a reset
        quarantined just ends its quarantine. Returns the keys published."""
        host = self.host
        admitted = self._admits.get(holder)
        mine: list[bytes] = []
        stale = 0
        for k in keys:
            slot = admitted.pop(k, None) if admitted else None
            if slot is None:
                stale += 1
            elif host.index.get(k) == slot and host.state[slot] == WRITING:
                mine.append(k)
            else:  # a reset forgot it while the pull ran
                host.end_quarantined_write(slot)
        if admitted is not None and not admitted:
            del self._admits[holder]
        stats = self.stats
        stats.stale_peer_completions += stale
        done = host.complete_write(mine, ok)
        if ok:
            stats.peer_committed += len(done)
            if done:
                self.parent.events.moved(done, self._peer_tier, HOST, locality="remote")
        else:
            stats.peer_commit_failures += len(done)
        return done if ok else []

    # -- what the manager's pin and busy-slot accounts read ---------------------------------------

    def pins(self) -> Iterator[tuple[int, int]]:
        """``(slot, pins)`` of every lease (a slot may come more than once)."""
        for pins in self._leases.values():
            yield from pins.items()

    def busy_slots(self) -> Iterator[int]:
        """Slots a peer is reading (leased) or a pull is writing (admitted)."""
        for pins in self._leases.values():
            yield from pins
        for admitted in self._admits.values():
            yield from admitted.values()
