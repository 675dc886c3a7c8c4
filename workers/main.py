"""Tier worker process: attaches the host arena, runs one tier's tasks, reports one result per task.

::

    engine ──task──▶ [jobs DEALER] ─▶ handle(task) ─▶ tier I/O module (fs_io, ...) ◀──▶ storage
                                          │  reads/writes arena rows in place (no payload copies)
    engine ◀─result── [results PUSH] ◀────┘

Started by the engine-side worker pool as ``python -m kvoffload.workers.main`` (a fresh interpreter:
spawn, never fork) with its :class:`~kvoffload.ipc.messages.WorkerSpec` as JSON in ``KVOFFLOAD_WORKER``.
It imports no torch, lowers its own CPU and I/O priority so tier I/O does not steal the scheduler's
core, and exits within a poll interval once its engine process is gone (the engine's janitor, see
``janitor.py``, removes the arena).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import psutil
import zmq

from kvoffload.ipc import messages as m
from kvoffload.ipc.arena import Arena, ArenaError
from kvoffload.ipc.channels import WorkerChannels
from kvoffload.workers import counters
from kvoffload.workers.faults import DropTask, Faults, MangleReply

SPEC_ENV = "KVOFFLOAD_WORKER"
_POLL_S = 0.2



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


class Worker:
    def __init__(self, spec: m.WorkerSpec):
        self.spec = spec
        self.faults = Faults(spec.faults)
        self.arena = Arena.attach(spec.arena_name, nonce=spec.arena_nonce)
        self.rows = self.arena.rows
        io_mod = importlib.import_module(spec.io_module)
        self.io = io_mod.make_io(spec.io_config, self.faults)
        # Several chunks of a task in flight at once: the I/O calls release the GIL, so threads
        # give the disk a deeper queue without more processes.
        self.pool = (ThreadPoolExecutor(spec.io_threads, thread_name_prefix="io")
                     if spec.io_threads > 1 else None)
        self.ctx = zmq.Context(1)
        self.chans = WorkerChannels(self.ctx, spec.jobs_endpoint, spec.results_endpoint, spec.identity)

    def parent_alive(self) -> bool:
        return os.getppid() == self.spec.parent_pid

    def run(self) -> None:
        self.chans.say_hello(m.encode(m.Hello(self.spec.worker_id, os.getpid())))
        while True:
            data = self.chans.next_task(_POLL_S)
            if not self.parent_alive():
                return  # the engine is gone; its janitor removes the arena
            if data is None:
                continue
            try:
                task = m.decode_task(data)
            except msgspec.DecodeError:
                continue  # not ours to answer: the engine fails tasks it never hears back about
            if isinstance(task, m.StopTask):
                return
            try:
                result = self.handle(task)
            except DropTask:
                continue
            result.counters = counters.take()
            if self.faults:
                keys = getattr(task, "keys", None)
                first = keys[0] if keys else None
                try:
                    self.faults.hit("reply", first)
                    self.faults.hit(f"reply_{type(task).__name__.removesuffix('Task').lower()}",
                                    first)
                except MangleReply as e:
                    for data in _mangled(result, e.kind):
                        self.chans.send_result(data)
                    continue
            self.chans.send_result(m.encode(result))

    def handle(self, task: m.Task) -> m.TaskResult:
        if self.faults:
            first = task.keys[0] if getattr(task, "keys", None) else None
            self.faults.hit("task", first)
            self.faults.hit(type(task).__name__.removesuffix("Task").lower(), first)
        t0 = time.perf_counter()
        wid = self.spec.worker_id
        if isinstance(task, (m.StoreTask, m.LoadTask)):
            op = self.io.store if isinstance(task, m.StoreTask) else self.io.load
            rows = self.rows

            def one(slot_key: tuple[int, bytes]) -> tuple:
                slot, key = slot_key
                if not 0 <= slot < len(rows):
                    return m.REJECTED, 0, f"slot {slot} out of range"
                try:
                    return op(key, memoryview(rows[slot]))
                except OSError as e:  # injected faults and anything the I/O module let through
                    return m.IO_ERROR, 0, str(e)

            pairs = list(zip(task.slots, task.keys))
            if self.pool is not None and len(pairs) > 1:
                outcomes = list(self.pool.map(one, pairs))
            else:
                outcomes = [one(p) for p in pairs]
            # I/O modules answer (code, bytes, detail) or (code, bytes, detail, protocol status).
            codes = [o[0] for o in outcomes]
            nbytes = sum(o[1] for o in outcomes)
            detail = next((o[2] for o in outcomes if o[2]), "")
            status = [o[3] if len(o) > 3 else 0 for o in outcomes]
            return m.TaskResult(task.task_id, wid, codes, detail, nbytes, time.perf_counter() - t0,
                                status=status if any(status) else [])
        if isinstance(task, m.ProbeTask):
            codes = []
            for key in task.keys:
                try:
                    codes.append(self.io.probe(key))
                except OSError:
                    codes.append(m.IO_ERROR)
            return m.TaskResult(task.task_id, wid, codes, seconds=time.perf_counter() - t0)
        if isinstance(task, m.DeleteTask):
            codes = [self.io.delete(key) for key in task.keys]
            return m.TaskResult(task.task_id, wid, codes, seconds=time.perf_counter() - t0)
        if isinstance(task, m.ScanTask):
            entries = self.io.scan()
            return m.TaskResult(task.task_id, wid, [], entries=entries if task.list_entries else [],
                                seconds=time.perf_counter() - t0)
        raise TypeError(f"unknown task {type(task).__name__}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.chans.close()
        self.ctx.term()
        self.arena.close()


def _mangled(result: m.TaskResult, kind: str) -> list[bytes]:
    """The messages a ``mangle`` fault of ``kind`` sends instead of ``result`` (tests: replies the
    engine must validate against the task they answer, CASES C24)."""
    codes = list(result.codes)
    if kind == "short":
        return [m.encode(msgspec.structs.replace(result, codes=codes[:-1]))]
    if kind == "empty":
        return [m.encode(msgspec.structs.replace(result, codes=[]))]
    if kind == "long":
        return [m.encode(msgspec.structs.replace(result, codes=codes + [m.OK]))]
    if kind == "bad_code":
        return [m.encode(msgspec.structs.replace(result, codes=[99] + codes[1:]))]
    if kind == "stray":
        stray = msgspec.structs.replace(result, task_id=result.task_id + (1 << 40), counters={})
        return [m.encode(stray), m.encode(result)]
    if kind == "duplicate":
        return [m.encode(result), m.encode(msgspec.structs.replace(result, counters={}))]
    if kind == "garbage":
        return [b"\xc1 not msgpack", m.encode(result)]
    raise ValueError(f"unknown mangle kind {kind!r}")


def main() -> int:
    raw = os.environ.get(SPEC_ENV)
    if not raw:
        print(f"kvoffload worker: {SPEC_ENV} is not set; workers are started by the engine",
              file=sys.stderr)
        return 2
    spec = msgspec.json.decode(raw, type=m.WorkerSpec)
    _lower_priority(spec.nice)
    try:
        worker = Worker(spec)
    except ArenaError as e:
        print(f"kvoffload worker {spec.tier_name}/{spec.kind}#{spec.worker_id}: {e}", file=sys.stderr)
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
