"""The host tier's slot table: which chunk is in which arena slot, in what state, pinned how often.

Slot states (DESIGN.md §4 "Host tier")::

    FREE ──allocate──▶ WRITING ──complete_write(ok)──▶ READY ⇄ pinned (ref count > 0)
      ▲                   │ complete_write(failed)       │ evict (only READY, unpinned, not protected)
      └───────────────────┴──────────────────────────────┘

Only READY, unpinned slots are evictable, and never a key of the batch being stored. The policy is
told a batch of keys in prefix order, with the request it is for (``rank_prefix``), so that within
a request the tail of a prefix is evicted before its head (CASES C47; :mod:`kvoffload.policies`).
A reset (:meth:`HostTier.clear`) forgets every chunk at once, but a slot with a transfer still in or out of
it (WRITING, or pinned) is *quarantined*: out of the index and off the free list until its last
transfer ends (:meth:`HostTier.complete_write`, :meth:`HostTier.unpin_slot`), so a late write can
never land in a slot that already holds another chunk (CASES C26). Per stored chunk
the table costs one dict entry and one reference to the key, plus 13 bytes in flat columns
(``array``/``bytearray``), so the engine-side footprint stays small (BENCHMARKS.md).

With a warm restart configured, the table is mirrored into the arena's own slot table
(:mod:`kvoffload.ipc.slot_table`, :meth:`HostTier.mirror_to`): a slot is published there when it
becomes READY and retracted when it stops holding that chunk (evicted, removed, cleared), always
before the slot can be given to another write; a successor engine adopts what it finds sealed
(:meth:`HostTier.adopt`). Without one, nothing of this runs (one ``None`` test per batch).

With per-tenant quotas (:meth:`HostTier.limit_tenants`, :mod:`kvoffload.quotas`), each slot
holding a tenant's chunk (writing, ready or pinned) counts one slot's bytes for that tenant, from
its allocation until it is freed (evicted, removed, a failed write, a reset). A store that would
take a tenant past its quota first evicts that tenant's own lowest-ranked evictable chunks (never
another's for this reason); new chunks it cannot make room for are refused (the batch's longest
prefix that fits is kept, :attr:`StorePlan.refused`). Without quotas, nothing of this runs (one
``None`` test per allocation and per freed slot).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable, Container, Iterable, Sequence

from kvoffload.ipc.slot_table import SlotTable
from kvoffload.policies import ARCPolicy, EvictionPolicy, LRUPolicy, PrefixRanks
from kvoffload.quotas import TenantQuotas
from kvoffload.tiers.base import LookupResult, TierEvent

FREE, WRITING, READY = 0, 1, 2
_HIT, _MISS, _PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def _no_tenant(key: bytes) -> str:
    """No tenant for any key (a host tier without quotas asks none)."""
    return ""


class StorePlan:
    """Result of :meth:`HostTier.allocate`: the keys that need writing, their slots, the keys
    evicted to make room, and how many new keys were refused because their tenant's quota could
    not make room (``refused``: the batch's tail past the first one refused)."""

    __slots__ = ("keys", "slots", "evicted", "refused")

    def __init__(self, keys: list[bytes], slots: list[int], evicted: list[bytes], refused: int = 0):
        self.keys = keys
        self.slots = slots
        self.evicted = evicted
        self.refused = refused


class _Evictable:
    """``may_evict(slot)`` for a tenant's quota victims: READY, unpinned, not quarantined, and
    neither a slot of the batch nor one the caller protects."""

    __slots__ = ("host", "protected", "protect")

    def __init__(self, host: HostTier, protected: Container[int], protect: Container[int]):
        self.host, self.protected, self.protect = host, protected, protect

    def __call__(self, slot: int) -> bool:
        host = self.host
        return (
            host.state[slot] == READY
            and not host.refs[slot]
            and not host.quarantined[slot]
            and slot not in self.protected
            and slot not in self.protect
        )


class _Union:
    """``slot in u``: in either container (neither copied)."""

    __slots__ = ("a", "b")

    def __init__(self, a: Container[int], b: Container[int]):
        self.a, self.b = a, b

    def __contains__(self, slot: object) -> bool:
        return slot in self.a or slot in self.b


class HostTier:
    """Slot table and eviction policy of the host arena (engine process only, not thread-safe).

    Args:
        num_slots: arena slots.
        policy: an :class:`~kvoffload.policies.EvictionPolicy` over those slots.
        record_events: keep stored/removed :class:`TierEvent` s for :meth:`take_events`.
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy, record_events: bool = True):
        self.num_slots = num_slots
        self.policy = policy
        # LRU and ARC (not a subclass: it may keep another order) read ``protected`` by
        # membership alone and walk their own lists: they get the caller's container (no copy)
        # and say whether they have a victim; an out-of-tree policy gets a set, and a count
        self._builtin_policy = type(policy) in (LRUPolicy, ARCPolicy)
        self.index: dict[bytes, int] = {}
        self.keys: list[bytes | None] = [None] * num_slots
        self.state = bytearray(num_slots)
        self.refs = array("i", bytes(4 * num_slots))
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_evictable = 0
        self.num_writing = 0
        self.num_pinned = 0  # slots with ref count > 0
        self.evictions = 0
        # Reset left these slots in use (C26): quarantined slots, and the key -> slot of those
        # still being written, which no new allocation may take until the write ends.
        self.quarantined = bytearray(num_slots)
        self._qwrites: dict[bytes, int] = {}
        self._events: list[TierEvent] | None = [] if record_events else None
        self.table: SlotTable | None = None  # the arena's slot table, with a warm restart
        #: Per-tenant quotas (:meth:`limit_tenants`), None: none (the default).
        self.quotas: TenantQuotas | None = None
        self._slot_bytes = 0
        self._tenant_of: Callable[[bytes], str] = _no_tenant

    def limit_tenants(
        self,
        default: int | None,
        overrides: dict[str, int],
        slot_bytes: int,
        tenant_of: Callable[[bytes], str],
    ) -> TenantQuotas:
        """Hold each tenant to its quota from now on (call before the first store; chunks held
        already count for no tenant until :meth:`attribute`).

        Args:
            default: every tenant's quota (bytes), None: only ``overrides``.
            overrides: tenant id -> its quota (bytes).
            slot_bytes: bytes one slot counts (the arena's row bytes).
            tenant_of: the tenant of a key being stored ("" for none: not counted).

        Raises:
            ValueError: the policy keeps no :class:`~kvoffload.policies.PrefixRanks` (an
                out-of-tree one), or a quota is smaller than one slot; the message names the
                setting.
        """
        if not isinstance(getattr(self.policy, "ranks", None), PrefixRanks):
            raise ValueError(
                "host_tenant_quota_bytes: per-tenant quotas need the lru or arc eviction_policy "
                f"(the tenant's own chunks go in its ranks); {type(self.policy).__name__} keeps "
                "none: use lru or arc, or drop the host tier's tenant quotas"
            )
        policy = self.policy
        self.quotas = TenantQuotas(
            default,
            overrides,
            lambda: policy.ranks,  # type: ignore[attr-defined]
            unit=(slot_bytes, "host slot", "host_tenant_quota"),
        )
        self._slot_bytes = slot_bytes
        self._tenant_of = tenant_of
        return self.quotas

    def attribute(self, key: bytes, tenant: str) -> None:
        """Count ``key``'s slot for ``tenant`` if it counts for none (a chunk adopted by a warm
        restart, or pushed by a peer, whose tenant a request named later). Nothing without
        quotas."""
        q = self.quotas
        if q is None or not tenant:
            return
        slot = self.index.get(key)
        if slot is not None and not q.tenant(slot):
            q.count(slot, tenant, self._slot_bytes)

    # -- queries --------------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        """HIT (READY), HIT_PENDING (WRITING) or MISS."""
        slot = self.index.get(key)
        if slot is None:
            return _MISS
        return _HIT if self.state[slot] == READY else _PENDING

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key`` (any state), or None."""
        return self.index.get(key)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_used(self) -> int:
        """Slots holding a chunk (ready, being written or pinned)."""
        return self.num_slots - len(self._free)

    # -- writes ---------------------------------------------------------------------------------

    def allocate(self, keys: Sequence[bytes], protect: Container[int] = ()) -> StorePlan | None:
        """Reserve WRITING slots for the keys not yet present, evicting as needed.

        Keys already present (in any state) are skipped and, with every other key of ``keys``
        and the slots in ``protect``, protected from eviction. Returns None, changing nothing,
        when not enough slots can be freed.
        """
        index = self.index
        new: list[bytes] = []
        seen: set[bytes] = set(self._qwrites) if self._qwrites else set()
        for k in keys:
            if k not in index and k not in seen:
                new.append(k)
                seen.add(k)
        if not new:
            return StorePlan([], [], [])
        quotas = self.quotas
        tenants: list[str] = []
        mine: list[int] = []  # quota victims: the batch's tenants' own chunks
        refused = 0
        if quotas is not None:
            tenants, mine, refused = self._quota_room(new, keys, protect)
            if refused:
                new = new[: len(new) - refused]
                tenants = tenants[: len(new)]
                if not new:
                    quotas.refusals += refused
                    return StorePlan([], [], [], refused)
        self.policy.prepare(new)
        need = len(new) - len(self._free) - len(mine)
        evicted: list[bytes] = []
        victims: list[int] = []
        if need > 0:
            if need > self.num_evictable - len(mine):
                return None
            protected = {index[k] for k in keys if k in index}
            outside: Container[int] = protected
            if mine:
                protected.update(mine)
            if protect and self._builtin_policy:
                # the caller's container as it is (a promotion's: no key of the batch holds a
                # slot); copying it would cost one step per protected slot
                outside = _Union(protected, protect) if protected else protect
            elif protect:  # an out-of-tree policy gets a set, as the protocol always gave it
                protected.update(protect)  # type: ignore[arg-type]  # iterable too
            chosen = self.policy.evict(need, outside, self.keys)
            if chosen is None:
                return None
            victims = chosen
        if mine:
            assert quotas is not None
            for slot in mine:
                self.policy.remove(slot)  # out of its order: evicted here, not by the policy
            quotas.evictions += len(mine)
            victims = mine + victims
        if victims:
            table = self.table
            for slot in victims:
                key = self.keys[slot]
                assert key is not None  # the policy picks only slots that hold a chunk
                del index[key]
                self.keys[slot] = None
                self.state[slot] = FREE
                self._free.append(slot)
                evicted.append(key)
                if table is not None:  # before the slot is given to this batch's writes
                    table.retract(slot)
                if quotas is not None:
                    quotas.uncount(slot)
            self.num_evictable -= len(victims)
            self.evictions += len(victims)
            if self._events is not None:
                self._events.append(TierEvent(evicted, True))
        slots = []
        free, keys_of, state = self._free, self.keys, self.state
        for k in new:
            slot = free.pop()
            index[k] = slot
            keys_of[slot] = k
            state[slot] = WRITING
            slots.append(slot)
        self.policy.admit_many(slots, new)
        self.num_writing += len(new)
        if quotas is not None:  # after admit_many: counted at a new chunk's rank, the lowest
            quotas.count_many(slots, tenants, self._slot_bytes)
            quotas.refusals += refused
        return StorePlan(new, slots, evicted, refused)

    def _quota_room(
        self, new: list[bytes], keys: Sequence[bytes], protect: Container[int]
    ) -> tuple[list[str], list[int], int]:
        """For a batch whose ``new`` keys are about to be allocated: the tenant of each, the
        slots of their tenants' own chunks to evict so that each stays within its quota, and how
        many of ``new``'s tail are refused (from the first new key whose tenant could not make
        room: nothing past a hole could be served, CASES C48)."""
        quotas = self.quotas
        assert quotas is not None
        tenant_of, unit = self._tenant_of, self._slot_bytes
        tenants = [tenant_of(k) for k in new]
        positions: dict[str, list[int]] = {}  # each limited tenant's positions in new
        for i, t in enumerate(tenants):
            if t and quotas.limit(t) is not None:
                positions.setdefault(t, []).append(i)
        if not positions:
            return tenants, [], 0
        may_evict: _Evictable | None = None
        cut = len(new)
        fits: dict[str, tuple[int, list[int]]] = {}
        for t, pos in positions.items():
            # new chunks that fit under its quota now (negative: it holds more, e.g. adopted
            # chunks attributed to it since), and its own chunks to evict for the rest
            fit_now = -quotas.over(t, 0) // unit
            short = len(pos) - fit_now
            found: list[int] = []
            if short > 0:
                if may_evict is None:
                    index = self.index
                    may_evict = _Evictable(self, {index[k] for k in keys if k in index}, protect)
                found = quotas.victims(t, short, may_evict)
            fits[t] = (fit_now, found)
            allowed = fit_now + len(found)
            if allowed < len(pos):
                cut = min(cut, pos[max(0, allowed)])
        mine: list[int] = []
        for t, pos in positions.items():
            fit_now, found = fits[t]
            before = bisect_left(pos, cut)  # its new chunks the batch keeps
            if before:
                mine += found[: max(0, before - fit_now)]
        return tenants, mine, len(new) - cut

    def has_victim(self, protect: Container[int]) -> bool | None:
        """Whether an evictable slot lies outside ``protect``, from the policy's eviction order
        (:meth:`~kvoffload.policies.EvictionPolicy.has_victim`); None for an out-of-tree policy
        (the caller counts)."""
        return self.policy.has_victim(protect) if self._builtin_policy else None

    def room_for(self, keys: Sequence[bytes]) -> int:
        """How many slots could be filled right now for a batch of ``keys``: free slots plus
        evictable ones that are not keys of the batch."""
        index, state, refs = self.index, self.state, self.refs
        protected = sum(
            1
            for k in set(keys)
            if (s := index.get(k)) is not None and state[s] == READY and refs[s] == 0
        )
        return len(self._free) + self.num_evictable - protected

    def is_present(self, key: bytes) -> bool:
        """True when ``key`` holds a slot: indexed, or a write quarantined by a reset."""
        return key in self.index or key in self._qwrites

    def complete_write(self, keys: Iterable[bytes], success: bool, req_id: str = "") -> list[bytes]:
        """Finish writes of WRITING keys (prefix order; for request ``req_id``, "" for none):
        READY on success, freed on failure. Other keys are ignored; a write a reset quarantined
        ends its quarantine (the chunk stays forgotten). Returns the keys that changed state
        (quarantined ones excluded)."""
        done = []
        ready: list[int] = []
        index, state = self.index, self.state
        for k in keys:
            slot = index.get(k)
            if slot is None or state[slot] != WRITING:
                if slot is None and self._qwrites:
                    qslot = self._qwrites.pop(k, None)
                    if qslot is not None:
                        self.end_quarantined_write(qslot)
                continue
            self.num_writing -= 1
            if success:
                state[slot] = READY
                ready.append(slot)
            else:
                self._release(slot)
            done.append(k)
        if ready:
            if self.table is not None:
                publish, keys_of = self.table.publish, self.keys
                for slot in ready:
                    publish(slot, keys_of[slot])  # READY: it has a key
            self.policy.rank_prefix(ready, req_id, False)
            refs = self.refs
            # tail first (an out-of-tree policy's recency)
            evictable = [slot for slot in reversed(ready) if refs[slot] == 0]
            self.num_evictable += len(evictable)
            self.policy.make_evictable_many(evictable)
        if success and done and self._events is not None:
            self._events.append(TierEvent(done, False))
        return done

    def end_quarantined_write(self, slot: int) -> None:
        """The write into quarantined ``slot`` ended (success or not): free it once unpinned."""
        if not self.quarantined[slot] or self.state[slot] != WRITING:
            return
        key = self.keys[slot]
        assert key is not None  # a quarantined slot keeps its key until it is freed
        if self._qwrites.get(key) == slot:
            del self._qwrites[key]
        self.num_writing -= 1
        self.state[slot] = READY
        if self.refs[slot] == 0:
            self._free_quarantined(slot)

    def _free_quarantined(self, slot: int) -> None:
        self.quarantined[slot] = 0
        self.keys[slot] = None
        self.state[slot] = FREE
        self._free.append(slot)

    def _release(self, slot: int) -> None:
        key = self.keys[slot]
        assert key is not None  # only a slot holding a chunk is released
        if self.quotas is not None:
            self.quotas.uncount(slot)
        if self.table is not None and self.state[slot] == READY:
            self.table.retract(slot)
        del self.index[key]
        self.keys[slot] = None
        self.state[slot] = FREE
        self.policy.remove(slot)
        self._free.append(slot)

    # -- pins -----------------------------------------------------------------------------------

    def pin(self, keys: Iterable[bytes]) -> list[int]:
        """Pin READY keys (ref count + 1) and return their slots.

        Raises:
            KeyError: a key is not present and READY.
        """
        slots = []
        index, state = self.index, self.state
        for k in keys:
            slot = index.get(k)
            if slot is None or state[slot] != READY:
                raise KeyError(f"chunk {k.hex()[:16]} is not ready in the host tier")
            self._pin_slot(slot)
            slots.append(slot)
        return slots

    def _pin_slot(self, slot: int) -> None:
        refs = self.refs
        if refs[slot] == 0:
            self.num_pinned += 1
            if self.state[slot] == READY:
                self.num_evictable -= 1
                self.policy.make_pinned(slot)
        refs[slot] += 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        """Drop one pin of each key. Unknown or unpinned keys are ignored."""
        index = self.index
        for k in keys:
            slot = index.get(k)
            if slot is not None:
                self.unpin_slot(slot)

    def unpin_slots(self, slots: Iterable[int]) -> None:
        """Drop one pin of each slot (batch form of :meth:`unpin_slot`)."""
        refs, state = self.refs, self.state
        evictable: list[int] = []
        for slot in slots:
            r = refs[slot]
            if r <= 0:
                continue
            refs[slot] = r - 1
            if r == 1:
                self.num_pinned -= 1
                if self.quarantined[slot]:
                    if state[slot] == READY:
                        self._free_quarantined(slot)
                elif state[slot] == READY:
                    evictable.append(slot)
        if evictable:
            self.num_evictable += len(evictable)
            evictable.reverse()  # tail first (an out-of-tree policy's recency)
            self.policy.make_evictable_many(evictable)

    def unpin_slot(self, slot: int) -> None:
        """Drop one pin of ``slot``; an unpinned slot is ignored."""
        self.unpin_slots((slot,))

    # -- use, removal ---------------------------------------------------------------------------

    def access(self, keys: Iterable[bytes], req_id: str = "") -> None:
        """Record a use of the present ``keys`` (prefix order; by request ``req_id``, "" for
        none) in the policy's order."""
        self._rank(keys, req_id, True)

    def order(self, keys: Iterable[bytes], req_id: str) -> None:
        """Rank the present ``keys`` (prefix order, any state) as request ``req_id``'s batch,
        without counting a use: a store's batch, its new chunks and those it found present, so
        that their positions in the request follow the prefix."""
        self._rank(keys, req_id, False)

    def _rank(self, keys: Iterable[bytes], req_id: str, use: bool) -> None:
        index = self.index
        slots = [s for k in keys if (s := index.get(k)) is not None]
        if slots:
            self.policy.rank_prefix(slots, req_id, use)

    def request_finished(self, req_id: str) -> None:
        """``req_id`` (a request) is done: the policy ranks its chunks
        afresh (:meth:`~kvoffload.policies.EvictionPolicy.request_finished`)."""
        self.policy.request_finished(req_id)

    def remove(self, keys: Iterable[bytes]) -> list[bytes]:
        """Remove READY, unpinned keys (explicit removal); returns those removed."""
        removed = []
        for k in keys:
            slot = self.index.get(k)
            if slot is None or self.state[slot] != READY or self.refs[slot]:
                continue
            self.num_evictable -= 1
            self._release(slot)
            removed.append(k)
        if removed and self._events is not None:
            self._events.append(TierEvent(removed, True))
        return removed

    def clear(self) -> list[int]:
        """Forget every chunk (reset_cache), without waiting for transfers in flight.

        A slot still WRITING or pinned is quarantined: it leaves the index but is not freed until
        its write ends (:meth:`complete_write` of its key, :meth:`end_quarantined_write`) and its
        last pin drops. Events queued before the reset are kept; the READY chunks (those published
        as stored) are published as removed. Returns the quarantined slots.
        """
        state, refs, keys_of = self.state, self.refs, self.keys
        removed = []
        busy = []
        free = []
        for slot in range(self.num_slots):
            key = keys_of[slot]
            if key is None:
                continue
            if self.quarantined[slot]:
                busy.append(slot)
                continue
            if state[slot] == READY:
                removed.append(key)
                if self.table is not None:  # forgotten, whether or not a load still reads it
                    self.table.retract(slot)
            if state[slot] == WRITING or refs[slot] > 0:
                self.quarantined[slot] = 1
                if state[slot] == WRITING:
                    self._qwrites[key] = slot
                busy.append(slot)
            else:
                keys_of[slot] = None
                state[slot] = FREE
                free.append(slot)
        self.index.clear()
        self._free.extend(free)
        self.num_evictable = 0
        self.policy.clear()
        if self.quotas is not None:  # quarantined slots hold no chunk: no tenant's either
            self.quotas.clear()
        if removed and self._events is not None:
            self._events.append(TierEvent(removed, True))
        return busy

    # -- warm restart -------------------------------------------------------------------------

    def mirror_to(self, table: SlotTable) -> None:
        """Publish every READY chunk in ``table`` from now on, and retract each slot that stops
        holding one (DESIGN.md "Warm restart"). Call before the first store, after
        :meth:`adopt` if there is something to adopt."""
        self.table = table

    def adopt(self, slots: dict[bytes, int]) -> list[bytes]:
        """Take ``slots`` (key -> slot, oldest first: :attr:`SlotTable.adopt`'s order) as READY,
        unpinned chunks, before anything else was stored; the policy learns them oldest first,
        and each is published as stored (KV events). Returns the keys adopted.

        Raises:
            ValueError: the host tier already holds a chunk, or a slot is out of range or given
                twice.
        """
        if self.index or self.num_writing:
            raise ValueError("adopt: the host tier already holds chunks")
        if len(set(slots.values())) != len(slots) or any(
            not 0 <= s < self.num_slots for s in slots.values()
        ):
            raise ValueError("adopt: slots out of range or given twice")
        keys = list(slots)
        order = list(slots.values())
        for k, slot in slots.items():
            self.index[k] = slot
            self.keys[slot] = k
            self.state[slot] = READY
        taken = set(order)
        self._free = [s for s in self._free if s not in taken]
        self.policy.admit_many(order, keys)
        if self.quotas is not None:
            # a tenant key's tenant is not known until a request names it (attribute)
            for k, slot in slots.items():
                t = self._tenant_of(k)
                if t:
                    self.quotas.count(slot, t, self._slot_bytes)
        self.num_evictable += len(order)
        self.policy.make_evictable_many(order)
        if keys and self._events is not None:
            self._events.append(TierEvent(keys, False))
        return keys

    def take_events(self) -> list[TierEvent]:
        """The host tier's store/removal events since the last call (oldest first); empties the list."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out
