"""Tier worker process: attaches the host arena, runs one tier's tasks, reports one result per task.

::

    engine ──task──▶ [jobs DEALER] ─▶ handle(task) ─▶ tier I/O module (fs_io, ...) ◀──▶ storage
                                          │  reads/writes arena rows in place (no payload copies)
    engine ◀─result── [results PUSH] ◀────┘

Started by the engine-side worker pool as ``python -m kvoffload.workers.main`` (a fresh interpreter:
spawn, never fork) with its :class:`~kvoffload.ipc.messages.WorkerSpec` as JSON in ``KVOFFLOAD_WORKER``
(:data:`~kvoffload.ipc.names.WORKER_SPEC_ENV`). The spec names the tier's I/O module; its I/O config
(a tagged struct of :mod:`kvoffload.workers.ioconfig`) is decoded here and handed to the module's
``make_io``.
It imports no torch, lowers its own CPU and I/O priority so tier I/O does not steal the scheduler's
core, and exits within a poll interval once its engine process is gone (the engine's janitor, see
``janitor.py``, removes the arena).
"""

from __future__ import annotations

import errno
import importlib
import mmap
import os
import struct
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import msgspec
import psutil
import zmq

from kvoffload.ipc import messages as m
from kvoffload.ipc.arena import Arena, ArenaError
from kvoffload.ipc.channels import WorkerChannels
from kvoffload.ipc.names import TASK_ERRORS, WORKER_MARKER_FD_ENV, WORKER_SPEC_ENV
from kvoffload.workers import counters
from kvoffload.workers.chunkio import ChunkIO, IOOutcome, MakeIO
from kvoffload.workers.faults import DropTask, Faults
from kvoffload.workers.ioconfig import decode_io_config

_POLL_S = 0.2
_IDLE = -1  # the task marker between tasks
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def _lower_priority(nice: int) -> None:
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:
            pass
    try:
        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (OSError, AttributeError, psutil.Error):
        pass


class _ErrorLog:
    """Contained errors on the worker's stderr (with their tracebacks), at most ``burst`` per
    ``window_s`` seconds; the rest are counted, and their number is printed with the first error of
    a later window. Thread-safe. ``clock``: seconds, monotonic."""

    def __init__(self, who: str, burst: int = 5, window_s: float = 60.0, clock=time.monotonic):
        self.who = who
        self.burst = burst
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._window_start: float | None = None
        self._logged = 0
        self._suppressed = 0

    def log(self, what: str, exc: BaseException | None = None, why: str = "") -> None:
        """Report that ``what`` failed, with ``exc``'s traceback or the reason ``why``."""
        now = self.clock()
        with self._lock:
            if self._window_start is None or now - self._window_start >= self.window_s:
                if self._suppressed:
                    print(
                        f"{self.who}: {self._suppressed} more unexpected errors in the last "
                        f"{self.window_s:.0f} s, not shown",
                        file=sys.stderr,
                    )
                self._window_start, self._logged, self._suppressed = now, 0, 0
            if self._logged >= self.burst:
                self._suppressed += 1
                return
            self._logged += 1
        if exc is not None:
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            text = f"{what} failed; the worker goes on\n{tb.rstrip()}"
        else:
            text = f"{what} failed; the worker goes on: {why}"
        print(f"{self.who}: {text}", file=sys.stderr, flush=True)


class Worker:
    """The worker loop: one task at a time from the jobs socket, one result each.

    Containment (CASES C25): whatever a task raises, the worker answers it and goes on. Per key, an
    ``OSError`` from the I/O module fails that key with ``IO_ERROR`` and anything else with
    ``ERROR`` (traceback logged, rate-limited, counted as ``task_errors``); an error outside the
    per-key calls fails every key of the task with ``ERROR``. Only fatal conditions end the worker:
    the engine gone (parent gone), the arena closed, the sockets gone.
    """

    def __init__(self, spec: m.WorkerSpec):
        self.spec = spec
        self.who = (
            f"kvoffload worker {spec.tier_name}/{spec.kind}#{spec.worker_id} (pid {os.getpid()})"
        )
        self.errors = _ErrorLog(self.who)
        self.faults = Faults(spec.faults)
        self.arena = Arena.attach(spec.arena_name, nonce=spec.arena_nonce)
        self.rows = self.arena.rows
        io_mod = importlib.import_module(spec.io_module)
        make_io: MakeIO = io_mod.make_io
        io_config = decode_io_config(spec.io_config, getattr(io_mod, "IO_CONFIG", None))
        self.io: ChunkIO = make_io(io_config, self.faults)
        if not isinstance(self.io, ChunkIO):
            missing = [
                n
                for n in ("store", "load", "probe", "delete", "scan")
                if not callable(getattr(self.io, n, None))
            ]
            raise TypeError(
                f"{spec.io_module}.make_io returned {type(self.io).__name__}, which "
                f"lacks {', '.join(missing)} (see kvoffload.workers.chunkio.ChunkIO)"
            )
        # Several chunks of a task in flight at once: the I/O calls release the GIL, so threads
        # give the disk a deeper queue without more processes.
        self.pool = (
            ThreadPoolExecutor(spec.io_threads, thread_name_prefix="io")
            if spec.io_threads > 1
            else None
        )
        self.marker = _open_marker()
        self.ctx = zmq.Context(1)
        self.chans = WorkerChannels(
            self.ctx, spec.jobs_endpoint, spec.results_endpoint, spec.identity
        )

    def parent_alive(self) -> bool:
        """True while the engine process that spawned this worker is its parent."""
        return os.getppid() == self.spec.parent_pid

    def fatal(self) -> str | None:
        """Why this worker cannot go on (its engine or its arena is gone), or None."""
        if not self.parent_alive():
            return "the engine process is gone"
        if self.arena.closed:
            return "the arena is closed"
        return None

    def mark(self, task_id: int) -> None:
        """Publish which task runs now (``_IDLE`` between tasks) in the task marker the engine
        reads when this process dies (a plain store into shared memory, no system call): a crash
        is then blamed on the task that was running, not on one whose result was still unsent."""
        if self.marker is not None:
            _MARK.pack_into(self.marker, 0, task_id)

    def run(self) -> None:
        """Say hello, then serve tasks until a stop task, the engine's death or the arena's loss."""
        self.mark(_IDLE)
        self.chans.say_hello(m.encode(m.Hello(self.spec.worker_id, os.getpid())))
        while True:
            data = self.chans.next_task(_POLL_S)
            if not self.parent_alive():
                return  # the engine is gone; its janitor removes the arena
            if data is None:
                if self.faults:
                    self.send(self.faults.release())
                continue
            try:
                task = m.decode_task(data)
            except msgspec.DecodeError:
                continue  # not ours to answer: the engine fails tasks it never hears back about
            if isinstance(task, m.StopTask):
                return
            self.mark(task.task_id)
            try:
                result = self.handle(task)
            except DropTask:
                self.mark(_IDLE)
                continue
            except Exception as e:
                if self.fatal():
                    return
                result = self.failed_task(task, e)
            if self.faults:
                messages = self.faults.release() + self.replies(task, result)
            else:
                messages = [result]
            if messages:
                messages[-1].counters = counters.take()
            self.send(messages)
            self.mark(_IDLE)

    def send(self, messages: list[m.TaskResult]) -> None:
        """Send results on the results socket, in order."""
        for msg in messages:
            self.chans.send_result(m.encode(msg))

    def replies(self, task: m.Task, result: m.TaskResult) -> list[m.TaskResult]:
        """The messages that answer ``task``: ``result``, as the faults armed at the reply points
        leave it (malformed, or after a stray one: CASES C24); none for a ``drop``."""
        first = _first_key(task)
        kind = type(task).__name__.removesuffix("Task").lower()
        try:
            return self.faults.reply(result, first, kind)
        except DropTask:
            return []
        except Exception as e:
            return [self.failed_task(task, e)]

    def failed_task(self, task: m.Task, exc: Exception) -> m.TaskResult:
        """The result of a task that raised outside its per-key calls: every key fails, with
        ``IO_ERROR`` / ``NO_SPACE`` for an ``OSError`` and ``ERROR`` (traceback logged) for
        anything else."""
        what = f"{type(task).__name__} {task.task_id}"
        if isinstance(exc, OSError):
            code = m.NO_SPACE if exc.errno in _NO_SPACE_ERRNOS else m.IO_ERROR
        else:
            code = m.ERROR
            self.errors.log(what, exc)
            counters.count(TASK_ERRORS)
        keys = getattr(task, "keys", ())
        return m.TaskResult(
            task.task_id,
            self.spec.worker_id,
            [code] * len(keys),
            f"{what}: {type(exc).__name__}: {exc}",
        )

    def contained(self, what: str, key: bytes, call, *args) -> IOOutcome:
        """``call(key, *args)``, whatever it raises or answers, as an :class:`IOOutcome`."""
        try:
            out = call(key, *args)
        except DropTask:
            raise
        except OSError as e:  # injected faults and anything the I/O module let through
            code = m.NO_SPACE if e.errno in _NO_SPACE_ERRNOS else m.IO_ERROR
            return IOOutcome(code, 0, f"{what} {key.hex()[:16]}: {e}")
        except Exception as e:
            self.errors.log(f"{what} {key.hex()[:16]}", e)
            counters.count(TASK_ERRORS)
            return IOOutcome(m.ERROR, 0, f"{what} {key.hex()[:16]}: {type(e).__name__}: {e}")
        problem = (
            out.problem()
            if isinstance(out, IOOutcome)
            else (f"answered {type(out).__name__}, not an IOOutcome")
        )
        if problem is not None:
            counters.count(TASK_ERRORS)
            detail = f"{what} {key.hex()[:16]}: {self.spec.io_module}: {problem}"
            self.errors.log(f"{what} {key.hex()[:16]}", why=f"{self.spec.io_module}: {problem}")
            return IOOutcome(m.ERROR, 0, detail)
        return out

    def handle(self, task: m.Task) -> m.TaskResult:
        """Run one task (every key contained: an exception fails its key with ``error``) and answer it."""
        if self.faults:
            first = _first_key(task)
            self.faults.hit("task", first)
            self.faults.hit(type(task).__name__.removesuffix("Task").lower(), first)
        t0 = time.perf_counter()
        wid = self.spec.worker_id
        if isinstance(task, (m.StoreTask, m.LoadTask)):
            what, op = (
                ("store", self.io.store)
                if isinstance(task, m.StoreTask)
                else ("load", self.io.load)
            )
            rows = self.rows

            def one(slot_key: tuple[int, bytes]) -> IOOutcome:
                slot, key = slot_key
                if not 0 <= slot < len(rows):
                    return IOOutcome(m.REJECTED, 0, f"slot {slot} out of range")
                return self.contained(what, key, op, memoryview(rows[slot]))

            pairs = list(zip(task.slots, task.keys))
            if self.pool is not None and len(pairs) > 1:
                outcomes = list(self.pool.map(one, pairs))
            else:
                outcomes = [one(p) for p in pairs]
            return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)
        if isinstance(task, m.ProbeTask):
            outcomes = [self.contained("probe", key, self.io.probe) for key in task.keys]
            return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)
        if isinstance(task, m.DeleteTask):
            outcomes = [self.contained("delete", key, self.io.delete) for key in task.keys]
            return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)
        if isinstance(task, m.ScanTask):
            entries = self.io.scan()
            return m.TaskResult(
                task.task_id,
                wid,
                [],
                entries=entries if task.list_entries else [],
                seconds=time.perf_counter() - t0,
            )
        raise TypeError(f"unknown task {type(task).__name__}")

    def close(self) -> None:
        """Release the I/O threads, sockets and the arena mapping."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.chans.close()
        self.ctx.term()
        self.arena.close()
        if self.marker is not None:
            self.marker.close()
            self.marker = None


_MARK = struct.Struct("=q")


def _open_marker() -> mmap.mmap | None:
    """Map the task marker the worker pool passed (its descriptor in
    :data:`~kvoffload.ipc.names.WORKER_MARKER_FD_ENV`; the descriptor is closed once mapped), or
    None when started without one."""
    raw = os.environ.get(WORKER_MARKER_FD_ENV)
    if not raw:
        return None
    fd = int(raw)
    try:
        return mmap.mmap(fd, _MARK.size)
    finally:
        os.close(fd)


def _first_key(task: m.Task) -> bytes | None:
    """The task's first chunk key (what faults armed for a key prefix match), None for a task
    without keys (scan, stop)."""
    keys: list[bytes] | None = getattr(task, "keys", None)
    return keys[0] if keys else None


def _result(task_id: int, wid: int, outcomes: list[IOOutcome], seconds: float) -> m.TaskResult:
    status = [o.status for o in outcomes]
    return m.TaskResult(
        task_id,
        wid,
        [o.code for o in outcomes],
        next((o.detail for o in outcomes if o.detail), ""),
        sum(o.nbytes for o in outcomes),
        seconds,
        status=status if any(status) else [],
    )


def main() -> int:
    """Entry point of a tier worker process (``python -m kvoffload.workers.main``): reads its
    :class:`~kvoffload.ipc.messages.WorkerSpec` from the environment, serves tasks until told to
    stop or its parent is gone. Returns the exit status (2: no spec; 3: the arena cannot be
    attached)."""
    raw = os.environ.get(WORKER_SPEC_ENV)
    if not raw:
        print(
            f"kvoffload worker: {WORKER_SPEC_ENV} is not set; workers are started by the engine",
            file=sys.stderr,
        )
        return 2
    spec = msgspec.json.decode(raw, type=m.WorkerSpec)
    _lower_priority(spec.nice)
    try:
        worker = Worker(spec)
    except ArenaError as e:
        print(
            f"kvoffload worker {spec.tier_name}/{spec.kind}#{spec.worker_id}: {e}", file=sys.stderr
        )
        return 3
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
