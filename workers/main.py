"""Tier worker process: attaches the host arena, runs one tier's tasks, reports one result per task.

::

    engine ──task──▶ [jobs DEALER] ─▶ loop ─chunks─▶ I/O threads ─▶ tier I/O module ◀──▶ storage
                                       ▲  (fs_io, ...) reads/writes arena rows in place (no copies)
    engine ◀─result── [results PUSH] ◀─┴── a task's last chunk done (wake-up pipe)

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
import gc
import importlib
import logging
import mmap
import os
import queue
import struct
import sys
import threading
import time
from collections import deque

import msgspec
import psutil

from kvoffload.ipc import messages as m
from kvoffload.ipc.arena import Arena, ArenaError
from kvoffload.ipc.channels import WorkerChannels
from kvoffload.ipc.names import TASK_ERRORS, WORKER_MARKER_FD_ENV, WORKER_SPEC_ENV
from kvoffload.ipc.ratelimit import RateLimitedLog
from kvoffload.workers import counters
from kvoffload.workers.chunkio import ChunkIO, IOOutcome, MakeIO
from kvoffload.workers.faults import DropTask, Faults
from kvoffload.workers.ioconfig import decode_io_config

_POLL_S = 0.2
_IDLE = -1  # a task marker's slot between tasks
_MARK = struct.Struct("=q")  # one slot of the task marker (WORKER_MARKER_FD_ENV)
_NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_ERRORS_PER_MINUTE = 5  # contained errors logged with their tracebacks; the rest are counted
log = logging.getLogger("kvoffload.worker")


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


def log_contained(
    errors: RateLimitedLog, who: str, what: str, exc: BaseException | None = None, why: str = ""
) -> None:
    """Log on ``errors`` (the worker's stderr) that ``what`` failed and the worker ``who`` goes on,
    with ``exc``'s traceback or the reason ``why``."""
    if exc is not None:
        errors.log(
            logging.ERROR, "contained", "%s: %s failed; the worker goes on", who, what, exc_info=exc
        )
    else:
        errors.log(
            logging.ERROR, "contained", "%s: %s failed; the worker goes on: %s", who, what, why
        )


class Worker:
    """The worker loop: tasks from the jobs socket, one result each. With I/O threads, store and
    load tasks run side by side, started in the order they arrive, each answered when its chunks
    are done; any other task waits for those and runs alone (:meth:`run`).

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
        self.errors = RateLimitedLog(log, burst=_ERRORS_PER_MINUTE)
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
        self._tenant_io: dict[str, ChunkIO] = {}
        self.marker = _open_marker(1 + max(1, spec.io_threads))
        self.chans = WorkerChannels(spec.jobs_endpoint, spec.identity)
        # Chunks in flight at once, of this task and of the next ones: the I/O calls release the
        # GIL, so threads give the disk a deeper queue without more processes.
        self._chunks: queue.SimpleQueue[tuple[_Running, int] | None] = queue.SimpleQueue()
        self._done: deque[_Running] = deque()
        self._done_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._wake_r = self._wake_w = -1
        if spec.io_threads > 1:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self.chans.watch(self._wake_r)
            for i in range(spec.io_threads):
                t = threading.Thread(
                    target=self._io_loop, args=(1 + i,), name=f"io_{i}", daemon=True
                )
                t.start()
                self._threads.append(t)

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

    def mark(self, slot: int, task_id: int) -> None:
        """Publish in slot ``slot`` of the task marker (0: the loop, 1 + i: I/O thread ``i``)
        which task that thread is running now, ``_IDLE`` when none: a plain store into shared
        memory, no system call. The engine reads the marker when this process dies and blames
        the crash on the tasks named there, not on a task whose result was still unsent."""
        if self.marker is not None:
            _MARK.pack_into(self.marker, slot * _MARK.size, task_id)

    def populate_arena(self) -> None:
        """A reader maps the arena's pages writable ahead of use, in a thread of its own at the
        worker's priority, so its loads take no page fault per 4 KiB page the first time a file
        lands in a row (:meth:`~kvoffload.ipc.arena.Arena.populate`; a refusal changes
        nothing). Writers only read rows, and read faults map 16 pages at a time."""
        if self.spec.kind == "loads":
            threading.Thread(target=self.arena.populate, name="populate", daemon=True).start()

    def run(self) -> None:
        """Say hello, then serve tasks until a stop task, the engine's death or the arena's loss.

        With I/O threads, store and load tasks are started as they arrive (their chunks queued to
        the threads, in task order) and answered as they finish, so the next task's chunks keep
        the disk busy while this one's last chunk is still moving. Any other task (probe,
        delete, scan, stop) waits until every started task is answered, then runs alone, so it
        sees what the tasks sent before it did."""
        for slot in range(1 + len(self._threads)):
            self.mark(slot, _IDLE)
        self.chans.say_hello(m.encode(m.Hello(self.spec.worker_id, os.getpid())))
        if not self._threads:
            while True:
                data = self.chans.next_task(_POLL_S)
                if not self.parent_alive():
                    return  # the engine is gone; its janitor removes the arena
                if data is None:
                    self._release_held()
                elif not self._serve(data):
                    return
        running = 0
        held: m.Task | None = None  # a task that waits until the started ones are answered
        while True:
            taking = held is None
            events = self.chans.wait(_POLL_S, tasks=taking)
            if not self.parent_alive():
                return
            if not events:
                self._release_held()
            if self._wake_r in events:
                _drain(self._wake_r)
            while self._done:
                run = self._done.popleft()
                running -= 1
                if not self._finish(run):
                    return
            if held is not None:
                if running:
                    continue
                task, held = held, None
                if not self._serve_task(task):
                    return
                continue
            if self.chans.jobs not in events:
                continue
            while held is None:
                data = self.chans.try_task()
                if data is None:
                    break
                try:
                    task = m.decode_task(data)
                except msgspec.DecodeError:
                    continue  # not ours to answer: the engine fails tasks it never hears back about
                if isinstance(task, (m.StoreTask, m.LoadTask)):
                    started = self._start(task)
                    if started is None:
                        return
                    running += started
                elif running:
                    held = task
                elif not self._serve_task(task):
                    return

    def _serve(self, data: bytes) -> bool:
        """Decode one task, run it here and answer it; False when the worker must stop."""
        try:
            task = m.decode_task(data)
        except msgspec.DecodeError:
            return True  # not ours to answer: the engine fails tasks it never hears back about
        return self._serve_task(task)

    def _serve_task(self, task: m.Task) -> bool:
        """Run one task here and answer it; False when the worker must stop."""
        if isinstance(task, m.StopTask):
            return False
        self.mark(0, task.task_id)
        try:
            result = self.handle(task)
        except DropTask:
            return True
        except Exception as e:
            if self.fatal():
                return False
            result = self.failed_task(task, e)
        finally:
            self.mark(0, _IDLE)
        self._answer(task, result)
        return True

    def _answer(self, task: m.Task, result: m.TaskResult) -> None:
        """Send ``result`` (as the reply faults leave it), with the worker's counts."""
        if self.faults:
            messages = self.faults.release() + self.replies(task, result)
        else:
            messages = [result]
        if messages:
            messages[-1].counters = counters.take()
        self._send(messages)

    def _release_held(self) -> None:
        """Send the replies a ``reply_hold`` fault held back, now that the worker is idle."""
        if self.faults:
            self._send(self.faults.release())

    def _send(self, messages: list[m.TaskResult]) -> None:
        """Send results on the results socket, in order."""
        for msg in messages:
            self.chans.send_result(m.encode(msg))

    def _start(self, task: m.StoreTask | m.LoadTask) -> int | None:
        """Hand a store or load task's chunks to the I/O threads. Returns 1 when started, 0 when
        it was answered (or dropped) at once, None when the worker must stop."""
        self.mark(0, task.task_id)
        try:
            if self.faults:
                first = _first_key(task)
                self.faults.hit("task", first)
                self.faults.hit(type(task).__name__.removesuffix("Task").lower(), first)
            n = min(len(task.keys), len(task.slots))
        except DropTask:
            return 0
        except Exception as e:
            if self.fatal():
                return None
            self._answer(task, self.failed_task(task, e))
            return 0
        finally:
            self.mark(0, _IDLE)
        if n == 0:
            self._answer(task, _result(task.task_id, self.spec.worker_id, [], 0.0))
            return 0
        run = _Running(task, n)
        put = self._chunks.put
        for i in range(n):
            put((run, i))
        return 1

    def _io_loop(self, marker_slot: int) -> None:
        """One I/O thread: moves queued chunks, each under its task's id in slot ``marker_slot``
        of the task marker; the thread that moves a task's last chunk hands the task back to the
        loop and wakes it."""
        get = self._chunks.get
        rows = self.rows
        nrows = len(rows)
        mark = self.mark
        while True:
            item = get()
            if item is None:
                return
            run, i = item
            task = run.task
            slot, key = task.slots[i], task.keys[i]
            mark(marker_slot, task.task_id)
            try:
                io = self.io if not task.tenant else self.io_for(task.tenant)
                if not 0 <= slot < nrows:
                    run.outcomes[i] = IOOutcome(m.REJECTED, 0, f"slot {slot} out of range")
                elif isinstance(io, IOOutcome):
                    run.outcomes[i] = io
                elif run.store:
                    run.outcomes[i] = self.contained("store", key, io.store, memoryview(rows[slot]))
                else:
                    run.outcomes[i] = self.contained("load", key, io.load, memoryview(rows[slot]))
            except DropTask:
                run.dropped = True
            except BaseException as e:
                run.error = e
            mark(marker_slot, _IDLE)
            with self._done_lock:
                run.left -= 1
                last = run.left == 0
            if last:
                self._done.append(run)
                try:
                    os.write(self._wake_w, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full: the loop will wake anyway

    def _finish(self, run: _Running) -> bool:
        """Answer a task whose chunks have all moved; False when the worker must stop."""
        task = run.task
        if run.dropped:
            return True
        if run.error is not None:
            if self.fatal():
                return False
            if not isinstance(run.error, Exception):
                raise run.error
            result = self.failed_task(task, run.error)
        else:
            outcomes: list[IOOutcome] = run.outcomes
            result = _result(
                task.task_id, self.spec.worker_id, outcomes, time.perf_counter() - run.t0
            )
        self._answer(task, result)
        return True

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
            log_contained(self.errors, self.who, what, exc)
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
            log_contained(self.errors, self.who, f"{what} {key.hex()[:16]}", e)
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
            log_contained(
                self.errors,
                self.who,
                f"{what} {key.hex()[:16]}",
                why=f"{self.spec.io_module}: {problem}",
            )
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
        if isinstance(task, m.ScanTask):
            return self._scan(task, t0)
        if isinstance(task, m.StopTask):
            raise TypeError("a stop task is no work to answer")
        io = self.io if not task.tenant else self.io_for(task.tenant)
        if isinstance(io, IOOutcome):  # a tenant this I/O cannot serve: every key fails
            return _result(task.task_id, wid, [io] * len(task.keys), time.perf_counter() - t0)
        if isinstance(task, (m.StoreTask, m.LoadTask)):
            what, op = ("store", io.store) if isinstance(task, m.StoreTask) else ("load", io.load)
            rows = self.rows
            outcomes = []
            for slot, key in zip(task.slots, task.keys):
                if not 0 <= slot < len(rows):
                    outcomes.append(IOOutcome(m.REJECTED, 0, f"slot {slot} out of range"))
                else:
                    outcomes.append(self.contained(what, key, op, memoryview(rows[slot])))
            return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)
        if isinstance(task, m.ProbeTask):
            outcomes = [self.contained("probe", key, io.probe) for key in task.keys]
            return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)
        outcomes = [self.contained("delete", key, io.delete) for key in task.keys]
        return _result(task.task_id, wid, outcomes, time.perf_counter() - t0)

    def _scan(self, task: m.ScanTask, t0: float) -> m.TaskResult:
        """Answer a scan: the namespace's chunks, then each tenant's (``TaskResult.tenants``
        names the tenant of each entry when any is a tenant's)."""
        entries = list(self.io.scan())
        tenants: list[str] = []
        list_tenants = getattr(self.io, "tenant_ids", None)
        for tenant in list_tenants() if callable(list_tenants) else ():
            io = self.io_for(tenant)
            if isinstance(io, IOOutcome):
                continue
            found = io.scan()
            if found and not tenants:
                tenants = [""] * len(entries)
            entries.extend(found)
            tenants.extend([tenant] * len(found))
        return m.TaskResult(
            task.task_id,
            self.spec.worker_id,
            [],
            entries=entries if task.list_entries else [],
            tenants=tenants if task.list_entries else [],
            seconds=time.perf_counter() - t0,
        )

    def io_for(self, tenant: str) -> ChunkIO | IOOutcome:
        """The I/O of tenant ``tenant``'s chunks (the I/O module's ``for_tenant``, kept for the
        worker's life, at most :data:`_MAX_TENANT_IOS` at once), or the ``ERROR`` outcome every
        key of the task gets when the module keeps no tenants apart or ``tenant`` is no tenant
        id: never the namespace's own I/O, where another tenant's chunks would be."""
        io = self._tenant_io.get(tenant)
        if io is not None:
            return io
        make = getattr(self.io, "for_tenant", None)
        if not callable(make):
            return IOOutcome(
                m.ERROR, 0, f"{self.spec.io_module} keeps no tenants apart (no for_tenant)"
            )
        try:
            io = make(tenant)
        except ValueError as e:
            return IOOutcome(m.REJECTED, 0, str(e))
        if len(self._tenant_io) >= _MAX_TENANT_IOS:
            self._tenant_io.clear()
        self._tenant_io[tenant] = io
        return io

    def close(self, join_s: float = 5.0) -> None:
        """Release the I/O threads, sockets and the arena mapping.

        The I/O threads write to the wake pipe and read or write arena rows until they exit, so
        the pipe and the arena are closed only once every one of them has (waiting at most
        ``join_s`` seconds in all, after the chunks queued before): a write into a pipe closed
        under it would land in whatever descriptor took its number next. A thread still in I/O
        past that (a hung mount) keeps them open until the process exits."""
        for _ in self._threads:
            self._chunks.put(None)
        deadline = time.monotonic() + join_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.chans.close()
        if any(t.is_alive() for t in self._threads):
            return  # the pipe and the arena stay open for them (the process is ending)
        if self._wake_r >= 0:
            r, w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1
            os.close(r)
            os.close(w)
        self.arena.close()
        # The task marker stays mapped until the process ends.


_MAX_TENANT_IOS = 4096
"""Tenants' I/O objects a worker keeps at once (:meth:`Worker.io_for`); more start afresh."""


class _Running:
    """A store or load task whose chunks are with the I/O threads."""

    __slots__ = ("task", "store", "outcomes", "left", "error", "dropped", "t0")

    def __init__(self, task: m.StoreTask | m.LoadTask, n: int):
        self.task = task
        self.store = isinstance(task, m.StoreTask)
        self.outcomes: list[IOOutcome | None] = [None] * n
        self.left = n
        self.error: BaseException | None = None
        self.dropped = False
        self.t0 = time.perf_counter()


def _open_marker(slots: int) -> mmap.mmap | None:
    """Map the task marker the worker pool passed (its descriptor in
    :data:`~kvoffload.ipc.names.WORKER_MARKER_FD_ENV`; closed once mapped): its first ``slots``
    slots. None when started without one.

    Raises:
        ValueError: the marker holds fewer than ``slots`` slots.
    """
    raw = os.environ.get(WORKER_MARKER_FD_ENV)
    if not raw:
        return None
    fd = int(raw)
    try:
        return mmap.mmap(fd, slots * _MARK.size)
    finally:
        os.close(fd)


def _drain(fd: int) -> None:
    """Read the wake-up pipe empty."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _first_key(task: m.Task) -> bytes | None:
    """The task's first chunk key (what faults armed for a key prefix match), None for a task
    without keys (scan, stop)."""
    keys: list[bytes] | None = getattr(task, "keys", None)
    return keys[0] if keys else None


def _result(task_id: int, wid: int, outcomes: list[IOOutcome], seconds: float) -> m.TaskResult:
    status = [o.status for o in outcomes]
    free = [o.free_bytes for o in outcomes if o.code == m.NO_SPACE]  # -1 (not measured) wins
    return m.TaskResult(
        task_id,
        wid,
        [o.code for o in outcomes],
        next((o.detail for o in outcomes if o.detail), ""),
        sum(o.nbytes for o in outcomes),
        seconds,
        status=status if any(status) else [],
        free_bytes=(-1 if -1 in free else min(free)) if free else -1,
        present=sum(o.present for o in outcomes),
        done_at=time.monotonic(),
    )


def main() -> int:
    """Entry point of a tier worker process (``python -m kvoffload.workers.main``): reads its
    :class:`~kvoffload.ipc.messages.WorkerSpec` from the environment, serves tasks until told to
    stop or its parent is gone. Returns the exit status (2: no spec; 3: the arena cannot be
    attached)."""
    # the worker's log lines go to stderr as they are (each names the worker), like its prints
    log.addHandler(logging.StreamHandler(sys.stderr))
    log.propagate = False
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
    # What the imports and the set-up allocated lives as long as the worker: freeze it, so the
    # cyclic collector, triggered by what the tasks allocate, never walks it again (walking it
    # costs a tenth of a busy worker's CPU time).
    gc.collect()
    gc.freeze()
    worker.populate_arena()
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
