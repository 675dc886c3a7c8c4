"""Counts made inside a tier worker process, sent to the engine with the next task result.

An I/O module calls :func:`count` (from any of the worker's I/O threads); the worker loop attaches
:func:`take` to every :class:`~kvoffload.ipc.messages.TaskResult`, and the engine adds the counts to
the tier's counters (``kvoffload_tier_events_total{tier, event}``), or to a metric the tier declared
under that name. Nothing counted in a worker is lost unless the worker dies before its next result.
The names the built-in modules count, and that others read, are defined in
:mod:`kvoffload.ipc.names` (``TASK_ERRORS``, ``RETRIES``, ...).
"""

from __future__ import annotations

import errno
import threading

_lock = threading.Lock()
_counts: dict[str, float] = {}


def count(name: str, n: float = 1) -> None:
    """Add ``n`` to the worker-side counter ``name`` (thread-safe)."""
    with _lock:
        _counts[name] = _counts.get(name, 0) + n


def count_errno(family: str, err: OSError, n: float = 1) -> None:
    """Count ``err`` under ``<family>.<errno name>`` (``eviction_errors.EACCES``; the number when
    the errno has no name, ``unknown`` when the error carries none). The engine exports a family
    listed in :data:`kvoffload.ipc.names.TIER_COUNTER_FAMILIES` as a metric labelled by that name
    (``eviction_errors`` -> ``kvoffload_tier_eviction_errors_total{tier, errno}``)."""
    code = err.errno
    name = "unknown" if code is None else errno.errorcode.get(code, str(code))
    count(f"{family}.{name}", n)


def take() -> dict[str, float]:
    """The counts since the last call (empty dict when none)."""
    global _counts
    if not _counts:
        return {}
    with _lock:
        out, _counts = _counts, {}
    return out
