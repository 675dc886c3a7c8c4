"""What a worker-backed tier believes it holds: the lookup verdicts of
:class:`~kvoffload.tiers.process.ProcessTierManager`, without I/O.

::

    lookup(key, req) ─▶ present? ── HIT
                        absent, not expired? ── MISS
                        a MISS owed to req? ── MISS (once)
                        else ── None: unknown; req waits for the probe the caller sends
    settle(key, found, ttl) ◀── the probe's answer: present, or absent for ttl seconds (the
                                requests that waited are owed a MISS, whatever ttl is)

- Present verdicts (a probe found the chunk, a store wrote it) do not expire: the tier removes them
  when it evicts or removes the chunk. At most ``max_entries`` are kept, the least recently used go
  first (:class:`cachetools.LRUCache`).
- Absent verdicts expire: each has its own lifetime (``negative_ttl_s`` for a probe that found
  nothing, ``failed_load_ttl_s`` for a failed load, at most 1 s after a probe error), so they are a
  :class:`cachetools.TLRUCache` (cachetools' ``TTLCache`` with a time-to-live per entry). At most
  ``max_entries``; when full, expired verdicts go first, then those that expire soonest: a full
  cache forgets one verdict per new one, never all at once. A lifetime of 0 keeps nothing.
- Owed misses (CASES C36): a request told RETRY while a probe was out, or whose load of the key
  failed, gets MISS at its next lookup of the key however short the lifetimes, so it waits at most
  one probe round trip, never a probe after probe. At most ``owed_max`` keys are remembered (a
  request may be aborted and never ask again); the oldest go first (:class:`cachetools.FIFOCache`).

The clock is injected (``timer``: seconds, monotonic), so the lifetimes are tested without sleeps.
Not thread-safe: the engine thread drives it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from cachetools import FIFOCache, LRUCache, TLRUCache

OWED_MAX = 65536
"""Keys with a MISS owed to a request that may never ask again (aborted)."""


def _expires(key: bytes, ttl_s: float, now: float) -> float:
    return now + ttl_s


class VerdictCache:
    """Present / absent verdicts and owed misses of one tier.

    Args:
        max_entries: bound on present verdicts, and separately on absent ones (>= 1).
        owed_max: bound on keys with owed misses (>= 1).
        timer: monotonic seconds (``time.monotonic``; tests pass a fake).

    Raises:
        ValueError: a bound below 1.
    """

    def __init__(
        self,
        max_entries: int,
        *,
        owed_max: int = OWED_MAX,
        timer: Callable[[], float] = time.monotonic,
    ):
        if max_entries < 1 or owed_max < 1:
            raise ValueError(
                f"max_entries ({max_entries}) and owed_max ({owed_max}) must be at least 1"
            )
        #: Keys the tier holds, least recently used first (value unused).
        self.present: LRUCache[bytes, None] = LRUCache(maxsize=max_entries)
        #: Keys the tier does not hold -> the lifetime they were given (seconds).
        self.absent: TLRUCache[bytes, float] = TLRUCache(
            maxsize=max_entries, ttu=_expires, timer=timer
        )
        #: Keys being probed -> requests told RETRY meanwhile.
        self.waiting: dict[bytes, set[str]] = {}
        #: Key -> requests owed a MISS at their next lookup of it.
        self.owed: FIFOCache[bytes, set[str]] = FIFOCache(maxsize=owed_max)

    def lookup(self, key: bytes, req_id: str) -> bool | None:
        """The verdict for ``req_id``'s lookup of ``key``: True (present), False (absent, or a MISS
        owed to this request, which this answer pays), or None (unknown: ``req_id`` now waits for
        the probe the caller sends, and is owed its verdict)."""
        verdict = self.verdict(key, req_id)
        if verdict is None:
            self.wait(key, req_id)
        return verdict

    def verdict(self, key: bytes, req_id: str) -> bool | None:
        """:meth:`lookup` without the wait: None leaves ``req_id`` owed nothing (the caller sends
        no probe for it, or calls :meth:`wait` when it does)."""
        if key in self.present:
            return True
        if key in self.absent:
            return False
        owed = self.owed.get(key)
        if owed is not None and req_id in owed:
            owed.discard(req_id)
            if not owed:
                del self.owed[key]
            return False
        return None

    def wait(self, key: bytes, req_id: str) -> None:
        """``req_id`` waits for the probe of ``key`` the caller sends: it is owed its verdict."""
        waiting = self.waiting.get(key)
        if waiting is None:
            self.waiting[key] = {req_id}
        else:
            waiting.add(req_id)

    def is_present(self, key: bytes) -> bool:
        """True while a present verdict for ``key`` is held (LRU, no expiry)."""
        return key in self.present

    def absent_for(self, key: bytes, req_id: str) -> bool:
        """Whether ``req_id``'s next lookup of ``key`` will be answered MISS (an absent verdict,
        or a MISS owed to it), without paying what is owed."""
        if key in self.absent:
            return True
        owed = self.owed.get(key)
        return owed is not None and req_id in owed

    def is_absent(self, key: bytes) -> bool:
        """True while an absent verdict for ``key`` has not expired."""
        return key in self.absent

    def mark_present(self, keys: Iterable[bytes]) -> None:
        """``keys`` are in the tier (stored, or found by a probe): most recently used now."""
        present, absent = self.present, self.absent
        for key in keys:
            present[key] = None
            if absent:
                absent.pop(key, None)

    def mark_absent(self, key: bytes, ttl_s: float) -> None:
        """``key`` is not in the tier: MISS for ``ttl_s`` seconds (0: forget the present verdict,
        keep no absent one)."""
        self.present.pop(key, None)
        if ttl_s > 0:
            self.absent[key] = ttl_s

    def forget(self, key: bytes) -> None:
        """Drop ``key``'s present verdict (the tier evicted it)."""
        self.present.pop(key, None)

    def touch(self, keys: Iterable[bytes]) -> None:
        """``keys`` were used: the present ones become the most recently used."""
        present = self.present
        for k in keys:
            if k in present:
                present[k]  # an LRUCache read refreshes the entry

    def owe_miss(self, key: bytes, req_ids: Iterable[str]) -> None:
        """The next lookup of ``key`` by each of ``req_ids`` answers MISS, whatever the lifetimes."""
        owed = self.owed.get(key)
        if owed is None:
            self.owed[key] = set(req_ids)
        else:
            owed.update(req_ids)

    def settle(self, key: bytes, found: bool, ttl_s: float = 0.0) -> None:
        """A probe of ``key`` answered: present, or absent for ``ttl_s`` seconds; the requests that
        waited for it are owed a MISS when absent."""
        waiting = self.waiting.pop(key, None)
        if found:
            self.mark_present((key,))
            return
        self.mark_absent(key, ttl_s)
        if waiting:
            self.owe_miss(key, waiting)
