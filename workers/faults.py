"""Named fault points inside tier workers, armed from the tier config's ``faults`` list.

Tests and ``kvoffload stress`` use them to pause a worker at a precise point, fail one I/O call, drop a
task or crash the process; with no faults configured :meth:`Faults.hit` is one dict lookup.
"""

from __future__ import annotations

import os
import time

from kvoffload.ipc.messages import Fault


class DropTask(Exception):
    """Raised by a ``drop`` fault: the worker never answers the task."""


# How a ``mangle`` fault spoils the result of the task it fires on (the reply still reaches the
# engine, only its content is wrong): ``short`` drops the last per-key code, ``empty`` sends no
# codes, ``long`` adds an OK code for no key, ``bad_code`` replaces the first code with an unknown
# one (99), ``stray`` sends first a result for a task id never sent, ``duplicate`` sends the result
# twice, ``garbage`` sends first bytes that do not decode.
MANGLE_KINDS = ("short", "empty", "long", "bad_code", "stray", "duplicate", "garbage")


class MangleReply(Exception):
    """Raised by a ``mangle`` fault (point ``reply``): the worker spoils the task's result."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


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
        elif f.action == "drop":
            raise DropTask()
        elif f.action == "mangle":
            if f.arg not in MANGLE_KINDS:
                raise ValueError(f"unknown mangle kind {f.arg!r}; one of {', '.join(MANGLE_KINDS)}")
            raise MangleReply(str(f.arg))
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
