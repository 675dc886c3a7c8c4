"""Which chunks of a request a worker-backed tier loads without an existence probe, and which
wait for one probe of the request instead of a probe each (issue 26: an fs reload in one round
trip). No I/O.

::

    lookup_for_load(key, req), no verdict on key and not counted by the tier (process.py):
      req's scout was found, no miss since, < max_chunks expected ──▶ expected: HIT now, the
          promotion's load is the only round trip; a missing file is a clean miss
          (speculative_miss)
      req's scout is still being probed ──▶ deferred: RETRY, no probe of its own
      else ──▶ probe it (it becomes req's scout unless req has one), RETRY

- *Scout*: the first chunk of a request the tier knew nothing of (its lookup sent a probe). While
  its probe is out, the request's other unknown chunks wait for that answer instead of a probe
  each: a reload of N unknown chunks, or a new prompt's N chunks, costs one probe, not N. The
  engine looks a prefix up in order and stops at its first MISS, so when the scout is missing the
  chunks after it are never asked about again.
- *Found*: the request's lookup of its scout answered HIT, or its probe found it while the
  request went on with its other chunks (:meth:`Speculation.open_scout`): the chunk is on the
  medium though this tier had no record of it (stored by another instance sharing the root, or
  before a restart of an unbounded tier), and the chunks after it in the prefix, stored with it
  and evicted after it (tail first, CASES C47), almost always are too. From then on the
  request's unknown chunks are expected. A chunk found from the tier's own records (it stored it, or counted it at start) says
  nothing of the unknown chunks after it: the tier would know them if it held them, and they are
  nearly always a new turn's tail, stored nowhere; they are probed.
- *Missed*: any MISS the request got from this tier (an absent verdict, a miss owed to it), or a
  failed load of one of its chunks: no more expectation or deferral for it; its unknown chunks
  are probed, as without speculation. So nothing is loaded past a chunk the tier lacks, and a
  chunk known absent is never loaded.
- *Bounded*: at most ``max_chunks`` chunks expected per request (each counted once, however often
  it is looked up); past that its unknown chunks are probed. At most ``max_requests`` requests are
  remembered (the first seen goes first; a finished request is forgotten at once). A lookup that
  names no request (``""``) is never expected or deferred.

Only :meth:`~kvoffload.tiers.base.SecondaryTierManager.lookup_for_load` (a chunk the engine
promotes when found) uses this: a plain lookup (a peer's, a sliding-window scan's, which must tell
present chunks from absent ones) probes as before and changes no state here. Not thread-safe: the
engine thread drives it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable

MAX_REQUESTS = 65_536
"""Requests whose state is kept (a request may be aborted and never finish)."""


class _Request:
    __slots__ = ("found", "missed", "scout", "expected")

    def __init__(self) -> None:
        self.found = False
        self.missed = False
        #: The key whose probe the request's other unknown keys wait for.
        self.scout: bytes | None = None
        #: Keys answered HIT on expectation (at most ``max_chunks``).
        self.expected: set[bytes] = set()


class Speculation:
    """The expectations of one tier, per request.

    Args:
        max_chunks: chunks expected per request (0: none, and none deferred: every unknown chunk
            is probed, as without speculation).
        max_requests: requests remembered (>= 1).

    Raises:
        ValueError: a negative ``max_chunks`` or ``max_requests`` below 1.
    """

    def __init__(self, max_chunks: int, max_requests: int = MAX_REQUESTS):
        if max_chunks < 0 or max_requests < 1:
            raise ValueError(
                f"max_chunks ({max_chunks}) must be at least 0 and max_requests "
                f"({max_requests}) at least 1"
            )
        self.max_chunks = max_chunks
        self.max_requests = max_requests
        self._requests: OrderedDict[str, _Request] = OrderedDict()

    def __len__(self) -> int:
        return len(self._requests)

    def answered(self, req_id: str, key: bytes, present: bool) -> None:
        """``req_id``'s lookup of ``key`` was answered from what the tier knows: HIT
        (``present``; found, when ``key`` is its scout) or MISS (missed)."""
        state = self._requests.get(req_id)
        if present:
            if state is not None and key == state.scout:
                state.found = True
        elif self.max_chunks and req_id:
            if state is None:
                state = self._add(req_id)
            state.missed = True

    def load_failed(self, req_id: str) -> None:
        """A load of ``req_id`` failed in this tier: its unknown chunks are probed from now on."""
        state = self._requests.get(req_id)
        if state is not None:
            state.missed = True

    def expects(self, req_id: str, key: bytes) -> bool:
        """Whether ``req_id``'s lookup of ``key`` (unknown to the tier) answers HIT and loads it
        without a probe: the request's scout was found, it missed nothing since, and it has
        fewer than ``max_chunks`` keys expected (``key`` then is one)."""
        state = self._requests.get(req_id)
        if state is None or not state.found or state.missed:
            return False
        expected = state.expected
        if key in expected:
            return True
        if len(expected) >= self.max_chunks:
            return False
        expected.add(key)
        return True

    def open_scout(self, req_id: str) -> bytes | None:
        """``req_id``'s scout while it decides nothing yet (neither found nor missed): the tier
        settles it with :meth:`answered` when its probe has found the chunk since the request
        last asked (its answer landed in the middle of the request's lookups)."""
        state = self._requests.get(req_id)
        if state is None or state.found or state.missed:
            return None
        return state.scout

    def defers(self, req_id: str, key: bytes, probing: Container[bytes]) -> bool:
        """Whether ``req_id``'s lookup of ``key`` (unknown to the tier) waits for the request's
        scout instead of a probe of its own: the scout is another key, still being probed
        (``probing``), and the request missed nothing."""
        state = self._requests.get(req_id)
        if state is None or state.found or state.missed:
            return False
        scout = state.scout
        return scout is not None and scout != key and scout in probing

    def probed(self, req_id: str, key: bytes) -> None:
        """``req_id`` waits for a probe of ``key``: its scout, unless it has one already (found:
        its expectations stand) or missed."""
        if not self.max_chunks or not req_id:
            return
        state = self._requests.get(req_id)
        if state is None:
            state = self._add(req_id)
        if not state.found and not state.missed:
            state.scout = key

    def expected_keys(self, req_id: str, keys: Iterable[bytes]) -> set[bytes]:
        """Those of ``keys`` (a load job of ``req_id``) that were answered HIT on expectation."""
        state = self._requests.get(req_id)
        if state is None or not state.expected:
            return set()
        expected = state.expected
        return {k for k in keys if k in expected}

    def finished(self, req_id: str) -> None:
        """The request finished: forget it."""
        self._requests.pop(req_id, None)

    def _add(self, req_id: str) -> _Request:
        reqs = self._requests
        if len(reqs) >= self.max_requests:
            reqs.popitem(last=False)
        state = reqs[req_id] = _Request()
        return state
