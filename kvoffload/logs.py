"""Logging for the ``kvoffload`` logger tree: ``KVOFFLOAD_LOG_LEVEL`` (default INFO) to stderr.

Engines such as vLLM configure only their own loggers, so without this kvoffload's messages would
reach stderr only at WARNING and above. The rate-limited log is
:class:`kvoffload.ipc.ratelimit.RateLimitedLog` (the engine side and the tier workers use it).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

__all__ = ["log_at_exit", "setup"]

_configured = False
_last_line: tuple[int, str] | None = None  # what log_at_exit logs when this process ends


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


def log_at_exit(level: int, msg: str) -> None:
    """Log ``msg`` at ``level`` on the ``kvoffload`` logger when this process ends, after
    whatever it prints on its way out (a traceback of the error that ends it): the last line it
    logs. At most one per process, the first asked for (a later error follows from the first).

    Runs in ``threading``'s exit hooks (before the interpreter joins its threads), which a
    ``multiprocessing`` child runs too, after printing its traceback, where ``atexit`` would not
    run in a forked one (it ends with ``os._exit``); ``atexit`` where those hooks are not
    available. A process killed with SIGKILL logs nothing.
    """
    global _last_line
    if _last_line is not None:
        return
    _last_line = (level, msg)
    try:
        # CPython's own hook for this (concurrent.futures registers its thread shutdown there)
        threading._register_atexit(_log_last_line)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # not in this Python, or already shutting down
        atexit.register(_log_last_line)


def _log_last_line() -> None:
    if _last_line is not None:
        setup()
        logging.getLogger("kvoffload").log(*_last_line)
