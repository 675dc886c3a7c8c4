"""Named fault points inside tier workers, armed from the tier config's ``faults`` list.

Tests and ``kvoffload stress`` use them to pause a worker at a precise point, fail one I/O call, raise
what a bug would raise, drop a task or crash the process; with no faults configured :meth:`Faults.hit`
is one dict lookup. Points and actions are checked when the config is parsed
(:class:`~kvoffload.ipc.messages.Fault`).
"""

from __future__ import annotations

import os
import struct
import time

from kvoffload.ipc.messages import FAULT_ERRORS, Fault, TaskResult

_ERRORS: dict[str, type[BaseException]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "KeyError": KeyError,
    "RuntimeError": RuntimeError,
    "MemoryError": MemoryError,
    "struct.error": struct.error,
}
assert set(_ERRORS) == set(FAULT_ERRORS)


class DropTask(Exception):
    """Raised by a ``drop`` fault: the worker never answers the task."""


class Faults:
    """The fault hooks of one worker process (``faults`` of the tier config, checked at parse
    time): :meth:`hit` at each named point acts on the faults that fire there for the key
    (sleep, raise, exit, wait for a file, drop the task); counts are per process."""

    def __init__(self, specs: list[Fault]):
        self._by_point: dict[str, list[Fault]] = {}
        self._left: dict[int, int] = {}
        self._held: list[TaskResult] = []
        for f in specs:
            self._by_point.setdefault(f.point, []).append(f)
            self._left[id(f)] = f.count

    def __bool__(self) -> bool:
        return bool(self._by_point)

    def hit(self, point: str, key: bytes | None = None) -> None:
        """Fire the faults armed at ``point`` for ``key``.

        Raises:
            OSError: a ``raise`` fault.
            Exception: a ``raise_error`` fault (the type its ``arg`` names).
            DropTask: a ``drop`` fault.
        """
        if point not in self._by_point:
            return
        for f in self._armed(point, key):
            self._fire(f)

    def reply(
        self, result: TaskResult, key: bytes | None = None, kind: str = ""
    ) -> list[TaskResult]:
        """The messages to send for ``result``: itself, or a malformed form of it when a fault
        at point ``reply`` (any task) or ``<kind>_reply`` (``load_reply``, ``store_reply``,
        ``probe_reply``, ...) fires (CASES C24): ``reply_short`` (the last verdict left out),
        ``reply_empty`` (no verdicts), ``reply_long`` (one verdict too many), ``reply_bad_code``
        (the last verdict an unknown code), ``reply_stray`` (an extra reply for a task id
        never sent, before the real one); ``reply_hold`` keeps the messages back (none now) until
        :meth:`release`."""
        out = [result]
        armed = [*self._armed("reply", key), *self._armed(f"{kind}_reply", key)]
        for f in armed:
            codes = list(result.codes)
            if f.action == "reply_short":
                result.codes = codes[:-1]
            elif f.action == "reply_empty":
                result.codes = []
            elif f.action == "reply_long":
                result.codes = codes + [0]
            elif f.action == "reply_bad_code":
                result.codes = codes[:-1] + [99] if codes else [99]
            elif f.action == "reply_stray":
                out.insert(
                    0,
                    TaskResult(
                        result.task_id + 1_000_000, result.worker_id, [0] * max(1, len(codes))
                    ),
                )
            elif f.action == "reply_hold":
                self._held.extend(out)
                return []
            else:
                self._fire(f)
        return out

    def release(self) -> list[TaskResult]:
        """The replies held back by ``reply_hold`` faults (sent before the worker's next reply, or
        when it is next idle); a worker that crashes meanwhile never sends them (CASES C25)."""
        held, self._held = self._held, []
        return held

    def _armed(self, point: str, key: bytes | None):
        """The faults at ``point`` that fire now for ``key`` (their counts are used up)."""
        for f in self._by_point.get(point, ()):
            if f.key_hex is not None and (key is None or not key.hex().startswith(f.key_hex)):
                continue
            left = self._left[id(f)]
            if left == 0:
                continue
            if left > 0:
                self._left[id(f)] = left - 1
            yield f

    @staticmethod
    def _fire(f: Fault) -> None:
        if f.action == "sleep":
            time.sleep(float(f.arg or 0))
        elif f.action == "raise":
            code = int(f.arg or 5)
            raise OSError(code, f"injected fault: {os.strerror(code)}")
        elif f.action == "raise_error":
            name = str(f.arg or "ValueError")
            raise _ERRORS[name](f"injected fault: {name}")
        elif f.action == "drop":
            raise DropTask()
        elif f.action == "exit":
            os._exit(70)
        elif f.action == "wait_file":
            # Announce the pause (tests wait for this file instead of guessing how long the worker
            # takes to get here), then block until the gate file exists.
            with open(f"{f.arg}.reached", "a") as marker:
                marker.write(f"{os.getpid()}\n")
            deadline = time.monotonic() + 120
            while not os.path.exists(str(f.arg)) and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            raise ValueError(f"unknown fault action {f.action!r}")
