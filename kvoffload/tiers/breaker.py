"""The circuit breaker of a tier: stop sending work to a tier that keeps failing, then try it again
with a few trial requests before letting everything through.

::

               failures consecutive failed tasks
    CLOSED ─────────────────────────────────────▶ OPEN ◀──────────── a trial failed
      ▲  ▲                                        │ cooldown_s (×2 each reopening, ≤ max_cooldown_s)
      │  └── any task succeeded ──────────────────┤                      │
      │                                           ▼                      │
      └──── a task succeeded ─────────────── HALF_OPEN ── at most trial_requests admitted at once

- CLOSED: everything goes through; a failed task counts, a successful one resets the count.
- OPEN: nothing is admitted (lookups answer MISS, stores are dropped). Failures of tasks sent before
  the breaker opened arrive late and are ignored (they would reopen it again and again); a task that
  succeeds closes it (the tier answers after all).
- HALF_OPEN (the cooldown has passed): :meth:`CircuitBreaker.admit` lets ``trial_requests`` requests
  through, the rest are refused as while open. A task sent since the breaker went half-open that
  fails reopens it with a doubled cooldown; one that succeeds closes it. A trial that sends nothing
  gives its place back (:meth:`CircuitBreaker.release`); one admitted but never answered gives it
  back after ``trial_timeout_s``, so a lost trial never keeps the tier shut.

Recovery bound (CASES C51): however long the outage, no cooldown is longer than
``max_cooldown_s``, so once the endpoint answers again the breaker turns half-open within
``max_cooldown_s`` and closes on the first trial that answers (at most ``trial_timeout_s`` later,
counted from the first request after the cooldown). An uncapped back-off kept a tier shut for
seconds after its endpoint came back, storing nothing meanwhile.

The clock is injected (``clock``: seconds, monotonic), so the machine is tested without processes or
sleeps. Not thread-safe: one engine thread drives it (the scrape thread only reads :attr:`state`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
#: Every state, in the order the ``kvoffload_tier_breaker_state`` gauge exports them.
STATES = (CLOSED, OPEN, HALF_OPEN)
MAX_COOLDOWN_FACTOR = 4
"""Without ``max_cooldown_s`` the cooldown stops doubling at this many times ``cooldown_s``."""


class CircuitBreaker:
    """Breaker of one tier.

    Args:
        failures: consecutive failed tasks that open it (≥ 1).
        cooldown_s: seconds it stays open the first time; doubled each time it reopens without
            having closed in between, up to ``max_cooldown_s``.
        trial_requests: requests admitted at once while half-open (≥ 1).
        trial_timeout_s: seconds after which an admitted trial with no answer gives its place back
            (the tier's job timeout: a task sent is answered, or failed, within it).
        max_cooldown_s: the longest cooldown (seconds, ≥ ``cooldown_s``; equal: no back-off),
            which bounds how long the breaker stays open after the endpoint recovered. None:
            :data:`MAX_COOLDOWN_FACTOR` × ``cooldown_s``.
        clock: monotonic seconds (``time.monotonic``; tests pass a fake).

    Raises:
        ValueError: a count below 1, a non-positive duration, or ``max_cooldown_s`` below
            ``cooldown_s``.
    """

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        trial_requests: int = 1,
        trial_timeout_s: float = 30.0,
        max_cooldown_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if failures < 1 or trial_requests < 1:
            raise ValueError(
                f"failures ({failures}) and trial_requests ({trial_requests}) must be at least 1"
            )
        if cooldown_s <= 0 or trial_timeout_s <= 0:
            raise ValueError(
                f"cooldown_s ({cooldown_s}) and trial_timeout_s ({trial_timeout_s}) "
                f"must be positive"
            )
        if max_cooldown_s is None:
            max_cooldown_s = MAX_COOLDOWN_FACTOR * cooldown_s
        if not max_cooldown_s >= cooldown_s:  # NaN too
            raise ValueError(
                f"max_cooldown_s ({max_cooldown_s}) must be at least cooldown_s ({cooldown_s})"
            )
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.trial_requests = trial_requests
        self.trial_timeout_s = trial_timeout_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        #: True unless closed: the one check the hot paths make.
        self.tripped = False
        #: Consecutive failed tasks while closed.
        self.consecutive_failures = 0
        #: Openings since it last closed (the back-off exponent).
        self.open_count = 0
        #: Monotonic time the current cooldown ends (meaningful while tripped).
        self.reopens_at = 0.0
        #: Totals since start: openings and closings.
        self.opens = self.closes = 0
        self._trials: deque[float] = deque()  # expiry times of the admitted trials

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half_open``."""
        if not self.tripped:
            return CLOSED
        return OPEN if self.clock() < self.reopens_at else HALF_OPEN

    @property
    def trials_in_flight(self) -> int:
        """Trials admitted while half-open and not yet answered nor expired."""
        self._expire(self.clock())
        return len(self._trials)

    def _expire(self, now: float) -> None:
        trials = self._trials
        while trials and trials[0] <= now:
            trials.popleft()

    def admit(self) -> bool:
        """May one more request (a lookup that needs the tier, a store job) go to the tier now?
        Always while closed, never while open; while half-open only while fewer than
        ``trial_requests`` trials are in flight (this call then admits one more)."""
        if not self.tripped:
            return True
        now = self.clock()
        if now >= self.reopens_at:
            self._expire(now)
            if len(self._trials) < self.trial_requests:
                self._trials.append(now + self.trial_timeout_s)
                return True
        return False

    def release(self) -> None:
        """An admitted request sent nothing to the tier after all (e.g. a store of chunks the tier
        already holds): its trial place is free again."""
        if self._trials:
            self._trials.pop()

    def record(self, ok: bool, sent_at: float) -> str | None:
        """A task sent at monotonic time ``sent_at`` answered: ``ok`` False for a failure of the
        tier itself (timeouts, dead workers, transport errors, 5xx), True for any other answer.

        Returns:
            ``"opened"`` or ``"closed"`` when this answer changed the state, else None.
        """
        if ok:
            self.consecutive_failures = 0
            if not self.tripped:
                return None
            self.tripped = False
            self.open_count = 0
            self._trials.clear()
            self.closes += 1
            return "closed"
        if not self.tripped:
            self.consecutive_failures += 1
            if self.consecutive_failures >= self.failures:
                self._open()
                return "opened"
            return None
        now = self.clock()
        if now < self.reopens_at or sent_at < self.reopens_at:
            return None  # sent before the cooldown ended: a late answer, not a trial
        self._open()
        return "opened"

    def _open(self) -> None:
        self.tripped = True
        self.reopens_at = self.clock() + self.current_cooldown_s()
        self.open_count += 1
        self.opens += 1
        self._trials.clear()

    def current_cooldown_s(self) -> float:
        """The cooldown the next opening gets (seconds): ``cooldown_s`` doubled once per opening
        since the breaker last closed, at most ``max_cooldown_s``."""
        return min(self.max_cooldown_s, self.cooldown_s * 2.0 ** min(self.open_count, 64))
