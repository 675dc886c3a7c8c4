"""Per-tenant byte quotas: the bytes each tenant holds in one tier, against its quota, and its own
chunks in eviction order (DESIGN.md §4 "Tenants", issue 27 item 2).

::

    store of tenant T's chunks ── T's bytes + new > T's quota? ── no ──▶ stored as before
                                          │ yes
                                          ▼
                 T's own lowest-ranked evictable chunks (victims) ── enough? ── no ──▶ refused,
                                          │ yes                                         counted
                                          ▼
                           evicted by the tier as its own evictions are (events, deletes)

One :class:`TenantQuotas` per tier that has a quota: the host tier (:class:`~kvoffload.host
.HostTier`, idents are arena slots) and each capacity-bounded secondary tier
(:class:`~kvoffload.tiers.capacity.Capacity`, idents are its ledger ids). The tier tells it each
chunk it starts and stops counting (:meth:`TenantQuotas.count`, :meth:`TenantQuotas.uncount`) and
asks it for a tenant's victims; it evicts them itself, so a quota eviction is an ordinary eviction
of that tier (its events, its deletes, its ghost lists are not fed: ARC learns nothing from it).

Order: the tier's own ranks (:class:`~kvoffload.policies.PrefixRanks`, CASES C47: a request's
tail before its head), read through ``ranks()`` at each query (a policy's reset replaces them).
Each tenant has a lazily invalidated min-heap of ``(major, minor, ident, serial)``: an entry
whose ident was uncounted or counted again since (``serial``) is dropped when popped; one whose
rank changed is pushed again with the current rank. That is exact because a counted chunk's rank
only ever rises (a rank is set lowest when a chunk is counted and raised by every use), so a
stale entry is never above its chunk's current rank; a query costs O((victims + skipped) log n),
skipped being the tenant's own chunks that may not be evicted now (pinned, being written,
protected), never another tenant's.

Unsalted chunks are no tenant's: they are never counted here and no quota applies to them.
Nothing of this module runs without a quota (the tiers hold None).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

from kvoffload.policies import PrefixRanks

__all__ = ["TenantQuotas"]


class TenantQuotas:
    """Bytes held per tenant in one tier, against a quota per tenant.

    Args:
        default: every tenant's quota (bytes), None: none unless ``overrides`` names the tenant.
        overrides: tenant id -> its own quota (bytes), in place of ``default``.
        ranks: the tier's eviction ranks now (idents index its arrays).
        unit: ``(bytes, what, setting)``: the least a chunk counts in the tier (``what``: its
            name, "host slot", "chunk") and the settings' name (``<setting>_bytes``,
            ``<setting>s``); a quota below it is refused. None: not checked.

    Raises:
        ValueError: a quota smaller than ``unit``'s bytes (that tenant could store nothing);
            the message names the setting and the least it may be.

    Attributes:
        held: bytes counted per tenant (tenants holding none are absent).
        evictions: chunks evicted to keep a tenant under its quota (counted by the tier).
        refusals: chunks refused because their tenant's own chunks could not make room.
    """

    def __init__(
        self,
        default: int | None,
        overrides: Mapping[str, int],
        ranks: Callable[[], PrefixRanks],
        *,
        unit: tuple[int, str, str] | None = None,
    ):
        if unit is not None:
            unit_bytes, what, setting = unit
            for name, q in [(f"{setting}_bytes", default)] + [
                (f"{setting}s[{t!r}]", q) for t, q in overrides.items()
            ]:
                if q is not None and q < unit_bytes:
                    raise ValueError(
                        f"{name}: {q} bytes is smaller than one {what} ({unit_bytes} bytes): "
                        f"that tenant could store nothing; give it at least {unit_bytes} bytes"
                    )
        self.default = default
        self.overrides = dict(overrides)
        self.ranks = ranks
        self.held: dict[str, int] = {}
        self._of: dict[int, tuple[str, int, int]] = {}  # ident -> (tenant, bytes, serial)
        self._members: dict[str, int] = {}  # tenant -> chunks counted
        self._heaps: dict[str, list[tuple[int, int, int, int]]] = {}
        self._serial = 0
        self.evictions = 0
        self.refusals = 0

    def limit(self, tenant: str) -> int | None:
        """``tenant``'s quota (bytes), None: unlimited (no tenant, or no quota for it)."""
        if not tenant:
            return None
        q = self.overrides.get(tenant)
        return self.default if q is None else q

    def tenant(self, ident: int) -> str:
        """The tenant ``ident`` is counted for, "" for none."""
        rec = self._of.get(ident)
        return "" if rec is None else rec[0]

    def count(self, ident: int, tenant: str, nbytes: int) -> None:
        """Count ``ident`` (``nbytes``) for ``tenant`` (nothing for ""; one counted already is
        moved). Call once its rank is set as a new chunk's (the lowest it will have)."""
        if ident in self._of:
            self.uncount(ident)
        self.count_many([ident], [tenant], nbytes)

    def count_many(self, idents: list[int], tenants: list[str], nbytes: int) -> None:
        """:meth:`count` of each ``(idents[i], tenants[i])``, ``nbytes`` each, none counted yet
        (a store batch's new chunks; one Python call for the batch)."""
        of, held, members, heaps = self._of, self.held, self._members, self._heaps
        ranks = self.ranks()
        major, minor = ranks.major, ranks.minor
        serial = self._serial
        push = heapq.heappush
        for ident, tenant in zip(idents, tenants):
            if not tenant:
                continue
            serial += 1
            of[ident] = (tenant, nbytes, serial)
            held[tenant] = held.get(tenant, 0) + nbytes
            n = members[tenant] = members.get(tenant, 0) + 1
            heap = heaps.get(tenant)
            if heap is None:
                heap = heaps[tenant] = []
            push(heap, (major[ident], minor[ident], ident, serial))
            if len(heap) > 2 * n + 64:
                self._serial = serial
                self._rebuild(tenant)
        self._serial = serial

    def uncount(self, ident: int) -> str:
        """Stop counting ``ident``; returns its tenant ("" when it was not counted)."""
        rec = self._of.pop(ident, None)
        if rec is None:
            return ""
        tenant, nbytes, _ = rec
        left = self.held[tenant] - nbytes
        n = self._members[tenant] - 1
        if n:
            self.held[tenant] = left
            self._members[tenant] = n
        else:
            del self.held[tenant], self._members[tenant], self._heaps[tenant]
        return tenant

    def clear(self) -> None:
        """Count nothing (the tier forgot every chunk)."""
        self.held.clear()
        self._of.clear()
        self._members.clear()
        self._heaps.clear()

    def over(self, tenant: str, more: int) -> int:
        """Bytes ``tenant`` would hold past its quota with ``more`` bytes added (<= 0: within)."""
        q = self.limit(tenant)
        if q is None:
            return 0
        return self.held.get(tenant, 0) + more - q

    def victims(self, tenant: str, n: int, may_evict: Callable[[int], bool]) -> list[int]:
        """Up to ``n`` of ``tenant``'s counted idents, lowest rank first, for which
        ``may_evict(ident)`` holds; changes nothing (the tier evicts them, then
        :meth:`uncount`)."""
        heap = self._heaps.get(tenant)
        if not heap or n <= 0:
            return []
        ranks = self.ranks()
        major, minor = ranks.major, ranks.minor
        of = self._of
        out: list[int] = []
        keep: list[tuple[int, int, int, int]] = []
        while heap and len(out) < n:
            e = heapq.heappop(heap)
            ident, serial = e[2], e[3]
            rec = of.get(ident)
            if rec is None or rec[2] != serial:
                continue  # uncounted, or counted again since (it has a newer entry)
            if major[ident] != e[0] or minor[ident] != e[1]:
                # its rank rose since: its entry now, with the rank it has
                heapq.heappush(heap, (major[ident], minor[ident], ident, serial))
                continue
            keep.append(e)
            if may_evict(ident):
                out.append(ident)
        for e in keep:
            heapq.heappush(heap, e)
        return out

    def _rebuild(self, tenant: str) -> None:
        """``tenant``'s heap anew, one entry per counted ident with its current rank: from its
        own entries (each counted ident has exactly one with its serial), O(its heap), not a
        walk over every tenant's counted idents (many small tenants made that one per count)."""
        ranks = self.ranks()
        major, minor = ranks.major, ranks.minor
        of = self._of
        heap = [
            (major[i], minor[i], i, serial)
            for _, _, i, serial in self._heaps.get(tenant, ())
            if (rec := of.get(i)) is not None and rec[2] == serial
        ]
        heapq.heapify(heap)
        self._heaps[tenant] = heap

    def check(self) -> None:
        """Assert the per-tenant sums equal the counted idents' (tests, diagnostics: O(n)).

        Raises:
            AssertionError: naming the tenant whose count is off.
        """
        sums: dict[str, int] = {}
        members: dict[str, int] = {}
        for tenant, nbytes, _ in self._of.values():
            sums[tenant] = sums.get(tenant, 0) + nbytes
            members[tenant] = members.get(tenant, 0) + 1
        assert sums == self.held, f"tenant bytes {self.held} != counted {sums}"
        assert members == self._members, f"tenant chunks {self._members} != counted {members}"
