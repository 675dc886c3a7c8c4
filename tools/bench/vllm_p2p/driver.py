"""What both sides of the driver share: the producer process's message loop, the consumer's end of
it (:class:`ProducerPair`: spawn, ask, stop), the chunks' digests, CPU seconds of a process tree, and
a p2p tier bound to a free port.

::

    consumer (this process)                          producer (spawned)
    ProducerPair.ask(("park" | "store", ...)) ──▶  answer(): the side's handler, its reply
                 ask(("stats",))             ──▶  its store counts, CPU seconds of its tree
                 close(): ("stop",)          ──▶  the side shuts its tier down, then "stopped"
"""

from __future__ import annotations

import abc
import hashlib
import multiprocessing as mp
import resource
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import zmq

from kvoffload.tools.ports import free_port

HOST = "127.0.0.1"
TOKENS = 16  # tokens per block and per chunk
POLL_S = 0.001  # vLLM's default tier_poll_interval_s
WAIT_S = 0.0005  # pause between B's steps while it waits on transfers with no step work
REPLY_TIMEOUT_S = 120.0
DONE_TIMEOUT_S = 120.0

_P = TypeVar("_P", bound="ProducerPair")
_T = TypeVar("_T")


def chunk_digest(row_bytes: int, i: int | str) -> bytes:
    """The sha256 digest chunk ``i`` is keyed by on both sides (vLLM's key wraps it; kvoffload's
    key is the digest itself)."""
    return hashlib.sha256(f"kvoffload-bench-vllm-p2p/{row_bytes}/{i}".encode()).digest()


def _cpu_s() -> float:
    """User + system CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def cpu_tree(exclude: int | None = None) -> tuple[float, list[str]]:
    """User + system CPU seconds of this process (all threads) plus every live descendant
    process (a tier's worker processes), leaving out the process ``exclude`` and its descendants
    (the consumer's own spawned producer). Returns (seconds, the descendants' names counted)."""
    import psutil

    me = psutil.Process()
    skip: set[int] = set()
    if exclude is not None:
        skip.add(exclude)
        try:
            skip.update(c.pid for c in psutil.Process(exclude).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    total, names = _cpu_s(), []
    for child in me.children(recursive=True):
        if child.pid in skip:
            continue
        try:
            t = child.cpu_times()
            total += t.user + t.system
            cmd = child.cmdline()
            label = child.name()
            for a in cmd:
                if "kvoffload.workers" in a:
                    label = a
                elif "resource_tracker" in a:
                    label = "multiprocessing.resource_tracker"
            names.append(label)
        except psutil.NoSuchProcess:  # exited between the listing and the read
            pass
    return total, names


def on_free_port(make: Callable[[int], _T], tries: int = 5) -> tuple[_T, int]:
    """``(make(port), port)`` for a free port on :data:`HOST`, tried again on another port when
    the bind fails (a free port can be taken between the probe and the bind).

    Raises:
        zmq.ZMQError: the last try's bind failed.
    """
    for attempt in range(tries):
        port = free_port()
        try:
            return make(port), port
        except zmq.ZMQError:  # the tier's control socket's bind
            if attempt == tries - 1:
                raise
    raise ValueError(f"tries must be at least 1, got {tries}")


def answer(
    conn: Any,
    handlers: Mapping[str, Callable[[tuple], tuple]],
    poll_s: float = 0.01,
    between: Callable[[], None] | None = None,
    counts: Callable[[], dict] | None = None,
) -> None:
    """The producer's loop: answers the consumer's messages on ``conn`` until ``stop``. A message
    ``(kind, ...)`` goes to ``handlers[kind]``, whose return value is the reply; ``stats`` is
    answered with ``counts()`` (``ok`` / ``failed`` store jobs; 0 / 0 without it) and the CPU
    seconds and worker processes of this process tree. ``between()`` runs before each wait of
    ``poll_s`` for the next message (a side that steps its tier meanwhile)."""
    while True:
        if between is not None:
            between()
        if not conn.poll(poll_s):
            continue
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "stats":
            cpu, procs = cpu_tree()
            got = counts() if counts is not None else {"ok": 0, "failed": 0}
            conn.send(("stats", got | {"cpu_s": cpu, "procs": procs}))
        else:
            conn.send(handlers[msg[0]](msg))


class ProducerPair:
    """A spawned producer A (``target(conn, *args)``, a function of a module the child imports by
    name, that sends ``("ready", x)`` first and runs :func:`answer`) and this process's end of the
    pipe to it; the consumer B is the subclass's. :meth:`close` stops A, then calls
    :meth:`close_consumer`. Use as a context manager."""

    row_bytes: int
    rows: int

    def __init__(self, target: Callable[..., None], *args: Any):
        self._kv = 0
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def __enter__(self: _P) -> _P:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ask(self, msg: tuple, expect: str) -> Any:
        """Send ``msg`` to A (none for ``hello``) and return the payload of its ``expect`` reply."""
        if msg[0] != "hello":
            self._conn.send(msg)
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not self._conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"producer process exited (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"producer did not answer {msg[0]!r}")
        kind, payload = self._conn.recv()
        if kind != expect:
            raise RuntimeError(f"producer answered {kind!r} to {msg[0]!r}")
        return payload

    def kv_id(self, tag: str) -> str:
        """A new ``kv_request_id`` tagged ``tag``."""
        self._kv += 1
        return f"{tag}-{self._kv}"

    def a_stats(self) -> dict:
        """A's counts and ``cpu_s``: CPU seconds of A and its worker processes (``procs``)."""
        return self.ask(("stats",), expect="stats")

    def b_cpu(self) -> tuple[float, list[str]]:
        """CPU seconds of B (this process and its worker processes, not the producer)."""
        return cpu_tree(exclude=self.proc.pid)

    def park(self, jobs: list[tuple[str, int, int]]) -> None:
        """A stores chunks ``first .. first + count - 1`` per job under its ``kv_request_id``."""
        self.ask(("park", jobs), expect="parked")

    def close_consumer(self) -> None:
        """Shut B down (after A has stopped)."""

    def close(self) -> None:
        """Stop A (its tier shut down), then B's; the producer is killed if it does not stop."""
        try:
            if self.proc.is_alive():
                self._conn.send(("stop",))
                deadline = time.monotonic() + 30
                while self.proc.is_alive() and time.monotonic() < deadline:
                    if self._conn.poll(0.1):
                        self._conn.recv()
                        break
        except (OSError, EOFError):
            pass
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()
        self.close_consumer()


class LoadingPair(ProducerPair, abc.ABC):
    """A :class:`ProducerPair` whose consumer B loads what A parked: B's side is :meth:`submit`,
    :meth:`step` and :meth:`settle`; :meth:`load` and :meth:`wait` drive them."""

    @abc.abstractmethod
    def submit(self, jobs: list[tuple[str, int, int]], out: dict) -> None:
        """B starts a request per job; what it waits on goes into ``out``, keyed as :meth:`step`
        and :meth:`settle` report it."""

    @abc.abstractmethod
    def step(self, inflight: dict) -> list:
        """One scheduler step of B: the requests of ``inflight`` whose loads are done."""

    @abc.abstractmethod
    def settle(self, results: list, inflight: dict, latencies: list | None = None) -> int:
        """Finish B's requests of ``results`` (dropped from ``inflight``, their seconds since
        submitted appended to ``latencies``); returns the chunks they loaded."""

    def load(self, jobs: list[tuple[str, int, int]], pause_s: float = WAIT_S) -> None:
        """Park ``jobs`` on A and load them on B, stepping B every ``pause_s`` until all are done."""
        self.park(jobs)
        inflight: dict = {}
        self.submit(jobs, inflight)
        self.wait(inflight, pause_s)

    def wait(self, inflight: dict, pause_s: float = WAIT_S, latencies: list | None = None) -> None:
        """Step B every ``pause_s`` until every request of ``inflight`` is done.

        Raises:
            TimeoutError: some are not done after ``DONE_TIMEOUT_S``.
        """
        deadline = time.monotonic() + DONE_TIMEOUT_S
        while inflight:
            self.settle(self.step(inflight), inflight, latencies)
            if inflight:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(inflight)} vLLM p2p load jobs did not finish")
                time.sleep(pause_s)
