"""Host-tier eviction policies over arena slots: ``lru`` and ``arc``.

A policy orders only *evictable* slots (ready, no pins) in intrusive doubly-linked lists kept in
``array('i')`` columns, so every operation is O(1), eviction included, and a full tier whose slots are
all pinned answers "nothing to evict" without scanning (CASES C23). Membership of a chunk (for ARC's
recency/frequency lists) is kept apart from evictability, so a pinned chunk keeps its place in ARC's
bookkeeping.

Protocol (called by :class:`~kvoffload.host.HostTier`):
    prepare(keys)         these new keys are about to be admitted (before any eviction for them)
    admit(slot, key)      a new chunk took the slot (still being written: not evictable)
    make_evictable(slot)  the slot became ready and unpinned: link it at the most-recent end
    make_pinned(slot)     the slot got its first pin: unlink it
    access(slot)          the chunk was used (a hit)
    remove(slot)          the chunk left without eviction (failed write, explicit removal)
    evict(n, protected)   pick n evictable slots, never one in ``protected``; None if impossible
                          (``protected`` is a set for out-of-tree policies; the built-in ones get
                          a container read by ``slot in protected`` alone)

Out-of-tree policies subclass :class:`EvictionPolicy` and are named by ``module.path:ClassName``.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from array import array
from collections import OrderedDict
from collections.abc import Container

from typing_extensions import override


class _Lists:
    """Several intrusive doubly-linked lists over slots ``0..n-1`` sharing one pair of link
    columns; list ``i``'s sentinel is index ``n + i``."""

    __slots__ = ("n", "prev", "next", "linked", "sizes")

    def __init__(self, n: int, num_lists: int):
        self.n = n
        total = n + num_lists
        self.prev = array("i", range(total))
        self.next = array("i", range(total))
        self.linked = bytearray(n)  # 0 = not linked, else list index + 1
        self.sizes = [0] * num_lists

    def push_back(self, lst: int, slot: int) -> None:
        s = self.n + lst
        last = self.prev[s]
        self.prev[slot] = last
        self.next[slot] = s
        self.next[last] = slot
        self.prev[s] = slot
        self.linked[slot] = lst + 1
        self.sizes[lst] += 1

    def unlink(self, slot: int) -> int:
        """Unlink ``slot``; returns the list it was in, or -1."""
        lst = self.linked[slot] - 1
        if lst < 0:
            return -1
        p, nx = self.prev[slot], self.next[slot]
        self.next[p] = nx
        self.prev[nx] = p
        self.linked[slot] = 0
        self.sizes[lst] -= 1
        return lst

    def iter_from_head(self, lst: int):
        s = self.n + lst
        cur = self.next[s]
        nxt = self.next
        while cur != s:
            following = nxt[cur]
            yield cur
            cur = following

    def any_outside(self, lst: int, protected: Container[int]) -> bool:
        """Whether list ``lst`` links a slot not in ``protected`` (walked from its head, the
        next victim's end, where protected slots, recently used or admitted, are rare)."""
        return any(slot not in protected for slot in self.iter_from_head(lst))

    def clear(self) -> None:
        type(self).__init__(self, self.n, len(self.sizes))


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

    @abstractmethod
    def make_evictable(self, slot: int) -> None:
        """``slot`` became ready and unpinned: it may be chosen by :meth:`evict` from now on (linked
        at the most recently used end)."""

    @abstractmethod
    def make_pinned(self, slot: int) -> None:
        """``slot`` got its first pin (a transfer reads it): never evict it until it is evictable
        again."""

    @abstractmethod
    def access(self, slot: int) -> None:
        """The chunk in ``slot`` was used (a lookup hit): refresh its place in the order."""

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
    """Least recently used first."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self._l = _Lists(num_slots, 1)

    @override
    def admit(self, slot: int, key: bytes) -> None:
        pass

    @override
    def make_evictable(self, slot: int) -> None:
        if not self._l.linked[slot]:
            self._l.push_back(0, slot)

    @override
    def make_pinned(self, slot: int) -> None:
        self._l.unlink(slot)

    @override
    def access(self, slot: int) -> None:
        if self._l.linked[slot]:
            self._l.unlink(slot)
            self._l.push_back(0, slot)

    @override
    def remove(self, slot: int) -> None:
        self._l.unlink(slot)

    @override
    def evict(self, n: int, protected: Container[int], keys: list) -> list[int] | None:
        if n > self._l.sizes[0]:
            return None
        out = []
        for slot in self._l.iter_from_head(0):
            if slot in protected:
                continue
            out.append(slot)
            if len(out) == n:
                break
        if len(out) < n:
            return None
        for slot in out:
            self._l.unlink(slot)
        return out

    @override
    def has_victim(self, protected: Container[int]) -> bool:
        return self._l.any_outside(0, protected)

    @override
    def clear(self) -> None:
        self._l.clear()


_T1, _T2 = 0, 1


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST '03) over slots.

    T1 holds chunks seen once recently, T2 chunks seen at least twice; ghost lists B1/B2 remember the
    keys recently evicted from each. A new key found in B1 grows the target size ``p`` of T1, one
    found in B2 shrinks it; eviction takes T1's least recent evictable chunk while T1 exceeds ``p``,
    else T2's (falling back to the other list when one has nothing evictable).
    """

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self.c = num_slots
        self.p = 0.0
        self._l = _Lists(num_slots, 2)
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

    @override
    def make_evictable(self, slot: int) -> None:
        if not self._l.linked[slot] and self._member[slot]:
            self._l.push_back(self._member[slot] - 1, slot)

    @override
    def make_pinned(self, slot: int) -> None:
        self._l.unlink(slot)

    @override
    def access(self, slot: int) -> None:
        lst = self._member[slot] - 1
        if lst < 0:
            return
        was_linked = self._l.unlink(slot) >= 0
        if lst == _T1:
            self._sizes[_T1] -= 1
            self._sizes[_T2] += 1
            self._member[slot] = _T2 + 1
        if was_linked:
            self._l.push_back(_T2, slot)

    @override
    def remove(self, slot: int) -> None:
        self._l.unlink(slot)
        lst = self._member[slot] - 1
        if lst >= 0:
            self._sizes[lst] -= 1
            self._member[slot] = 0

    def _pick(self, lst: int, protected: Container[int], taken: set[int]) -> int | None:
        for slot in self._l.iter_from_head(lst):
            if slot not in protected and slot not in taken:
                return slot
        return None

    @override
    def evict(self, n: int, protected: Container[int], keys: list) -> list[int] | None:
        if n > self._l.sizes[_T1] + self._l.sizes[_T2]:
            return None
        chosen: list[int] = []
        taken: set[int] = set()
        t1 = self._sizes[_T1]
        for _ in range(n):
            first = _T1 if t1 > self.p else _T2
            slot = self._pick(first, protected, taken)
            if slot is None:
                slot = self._pick(1 - first, protected, taken)
            if slot is None:
                return None
            if self._member[slot] - 1 == _T1:
                t1 -= 1
            chosen.append(slot)
            taken.add(slot)
        for slot in chosen:
            lst = self._member[slot] - 1
            self._l.unlink(slot)
            self._sizes[lst] -= 1
            self._member[slot] = 0
            ghost = self.b1 if lst == _T1 else self.b2
            ghost[keys[slot]] = None
        self._trim_ghosts()
        return chosen

    @override
    def has_victim(self, protected: Container[int]) -> bool:
        return self._l.any_outside(_T1, protected) or self._l.any_outside(_T2, protected)

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
