"""Logging for the ``kvoffload`` logger tree: ``KVOFFLOAD_LOG_LEVEL`` (default INFO) to stderr.

Engines such as vLLM configure only their own loggers, so without this kvoffload's messages would
reach stderr only at WARNING and above.
"""

from __future__ import annotations

import logging
import os
import time

_configured = False


def setup() -> None:
    """Attach one stderr handler to the ``kvoffload`` logger (idempotent)."""
    global _configured
    if _configured:
        return
    _configured = True
    level = os.environ.get("KVOFFLOAD_LOG_LEVEL", "INFO").upper()
    logger = logging.getLogger("kvoffload")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s kvoffload %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


class RateLimitedLog:
    """At most one log line per reason every ``interval_s`` seconds, for things that may happen
    thousands of times a second (refused stores, dropped chunks): the first occurrence of a reason
    is logged at once; later ones within the interval are counted, and the next line logged for
    that reason says how many were not.

    Args:
        logger: where the lines go.
        interval_s: seconds between two lines of one reason (60 by default).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0, clock=None):
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock or time.monotonic
        self._next: dict[str, float] = {}  # reason -> monotonic time its next line may go out
        self._quiet: dict[str, int] = {}  # reason -> occurrences not logged since its last line

    def log(self, level: int, reason: str, msg: str, *args) -> bool:
        """Log ``msg % args`` at ``level`` unless a line for ``reason`` went out less than
        ``interval_s`` ago. Returns True when a line was written."""
        now = self.clock()
        if now < self._next.get(reason, float("-inf")):
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            return False
        self._next[reason] = now + self.interval_s
        quiet = self._quiet.pop(reason, 0)
        if quiet:
            msg = f"{msg} ({quiet} more since the last such line, not logged)"
        self.logger.log(level, msg, *args)
        return True
