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

from kvoffload.ipc.messages import FAULT_ERRORS, Fault

_ERRORS: dict[str, type[BaseException]] = {
    "ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
    "RuntimeError": RuntimeError, "MemoryError": MemoryError, "struct.error": struct.error,
}
assert set(_ERRORS) == set(FAULT_ERRORS)


class DropTask(Exception):
    """Raised by a ``drop`` fault: the worker never answers the task."""


class Faults:
    def __init__(self, specs: list[Fault]):
        self._by_point: dict[str, list[Fault]] = {}
        self._left: dict[int, int] = {}
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
        specs = self._by_point.get(point)
        if not specs:
            return
        for f in specs:
            if f.key_hex is not None and (key is None or not key.hex().startswith(f.key_hex)):
                continue
            left = self._left[id(f)]
            if left == 0:
                continue
            if left > 0:
                self._left[id(f)] = left - 1
            self._fire(f)

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
