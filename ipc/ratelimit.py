"""A rate-limited log, for both sides: the engine (refused stores, dropped chunks, bad worker replies)
and the tier worker processes (errors a worker contained). Standard library only, like the rest of
``ipc``, so a worker process can import it without the engine's modules (or torch).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most ``burst`` log lines per reason every ``interval_s`` seconds, for things that may happen
    thousands of times a second: the first occurrence of a reason is logged at once and opens its
    interval; occurrences beyond ``burst`` within it are counted, and the next line logged for that
    reason (in a later interval) says how many were not. Thread-safe.

    Args:
        logger: where the lines go.
        interval_s: seconds a reason's interval lasts (60 by default).
        burst: lines of one reason logged per interval (1 by default).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        burst: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.interval_s = interval_s
        self.burst = burst
        self.clock = clock
        self._lock = threading.Lock()
        # reason -> (monotonic time its interval ends, lines logged in it)
        self._intervals: dict[str, tuple[float, int]] = {}
        self._quiet: dict[str, int] = {}  # reason -> occurrences not logged since its last line

    def log(
        self,
        level: int,
        reason: str,
        msg: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> bool:
        """Log ``msg % args`` at ``level`` (with ``exc_info``'s traceback, when given) unless
        ``burst`` lines for ``reason`` went out in its interval. Returns True when a line was
        written."""
        now = self.clock()
        with self._lock:
            end, logged = self._intervals.get(reason, (float("-inf"), 0))
            if now >= end:
                end, logged = now + self.interval_s, 0
            if logged >= self.burst:
                self._quiet[reason] = self._quiet.get(reason, 0) + 1
                return False
            self._intervals[reason] = (end, logged + 1)
            quiet = self._quiet.pop(reason, 0)
        if quiet:
            msg = f"{msg} ({quiet} more since the last such line, not logged)"
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True
