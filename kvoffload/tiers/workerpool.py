"""Engine-side pool of tier worker processes for one direction (loads or stores) of one tier.

::

    tier manager ──submit(task)──▶ queue ──dispatch──▶ worker k (least loaded, ≤ max_inflight tasks)
                 ◀──take(result)── (the tier manager drains the results socket and hands results here)
    check(now): worker exited and reaped (its Supervisor says so) → its tasks re-run (attempt 2) or
                fail WORKER_DIED; after a crash (not a kill from outside) the tasks it was running
                (named by its task marker) fail at once, never re-run (one may be what crashed
                it); replacement started
                task past its deadline → worker SIGKILLed; once it has exited, that task fails TIMEOUT
                and the worker's other tasks re-run
                no hello within hello_timeout_s → worker SIGKILLed (a failed start)

Tasks are addressed to one worker each, so the pool always knows which tasks a worker holds. A task
belonging to a killed worker is reported only after the process has exited: until then the worker
might still write into the task's arena slots, so the slots must not be reused. Each worker runs
under a :class:`~kvoffload.supervisor.Supervisor` (spawned with only the environment it needs:
the base allow-list, plus ``env_allow``; its exit watched through a pidfd; killed and reaped before
its death is reported); the pool keeps the task accounting.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from kvoffload.ipc import messages as m
from kvoffload.ipc.channels import TierChannels
from kvoffload.ipc.names import WORKER_MARKER_FD_ENV, WORKER_SPEC_ENV
from kvoffload.supervisor import Supervisor

log = logging.getLogger("kvoffload.tiers.workerpool")

_RESTART_BACKOFF_S = 0.5
#: Default seconds a new worker has to say hello before it is killed (a failed start).
DEFAULT_HELLO_TIMEOUT_S = 120.0
_BROKEN_AFTER_FAILED_STARTS = 3
_BROKEN_RETRY_S = 10.0


_CRASH_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL}
)


_MARK = struct.Struct("=q")  # one slot of a worker's task marker (see WORKER_MARKER_FD_ENV)
_IDLE = -1


def _crashed(returncode: int | None) -> bool:
    """True when a worker's exit status says it died by itself: a non-zero exit (an uncaught
    error, ``os._exit``) or a crash signal; False for a clean exit or a kill from outside."""
    if returncode is None or returncode == 0:
        return False
    return returncode > 0 or -returncode in _CRASH_SIGNALS


class PoolTask:
    """One task in the pool. ``owner`` is the tier manager's record for it."""

    __slots__ = (
        "task_id",
        "payload",
        "attempt",
        "deadline",
        "worker",
        "owner",
        "timed_out",
        "timeout_s",
    )

    def __init__(self, task_id: int, payload: bytes, owner: Any, timeout_s: float | None = None):
        self.task_id = task_id
        self.payload = payload
        self.owner = owner
        self.timeout_s = timeout_s
        self.attempt = 0
        self.deadline = 0.0
        self.worker: _WorkerProc | None = None
        self.timed_out = False


class _WorkerProc:
    __slots__ = ("wid", "identity", "sup", "ready", "inflight", "killed", "marker")

    def __init__(self, wid: int, identity: bytes, sup: Supervisor, marker: int):
        self.wid = wid
        self.identity = identity
        self.sup = sup
        self.ready = False
        self.inflight: dict[int, PoolTask] = {}
        self.killed = False  # for a task past its deadline (its tasks then time out)
        self.marker = marker  # descriptor of the worker's task marker (memfd), -1 once closed

    @property
    def proc(self) -> Any:
        """The worker's ``subprocess.Popen``."""
        return self.sup.proc

    def running_tasks(self) -> set[int] | None:
        """The ids of the tasks the worker's task marker says it was running (one slot for its
        loop and one per I/O thread; ``_IDLE`` slots name none), or None when the worker never
        wrote it (no marker: started by an older worker module, or it died before its hello)."""
        if self.marker < 0:
            return None
        # a whole number of slots: the pool sized it (_spawn)
        data = os.pread(self.marker, os.fstat(self.marker).st_size, 0)
        slots = [v for (v,) in _MARK.iter_unpack(data)]
        if not any(slots):
            return None
        return {v for v in slots if v > 0}

    def close_marker(self) -> None:
        if self.marker >= 0:
            os.close(self.marker)
            self.marker = -1


class WorkerPool:
    """Worker processes of one kind (``loads`` or ``stores``) for one tier.

    Args:
        tier_name: for process titles and messages.
        kind: ``"loads"`` or ``"stores"`` (the channel it reads tasks from).
        count: number of worker processes (>= 1).
        channels: the tier's :class:`TierChannels`.
        make_spec: ``(worker_id, identity) -> WorkerSpec`` for a new worker.
        task_timeout_s: a task not answered after this long kills its worker (seconds).
        max_inflight: tasks sent to one worker at a time; the rest wait in the engine.
        on_event: called with ``"restart"`` / ``"timeout"`` for the tier's counters.
        env_allow: environment variables (names or ``fnmatch`` patterns) the workers get beyond
            :data:`kvoffload.ipc.childenv.BASE_ENV`: the I/O config's ``worker_env``
            (credentials for an object store). Nothing else of the engine's environment passes.
        env_set: variables set for these workers whatever the allow-list and the withheld names
            say: a secret only they use (the tier's integrity key, under the name the tier's
            ``integrity_key_env`` gives it).
        hello_timeout_s: seconds a new worker has to say hello before it is killed (its start
            then counts as failed).
    """

    def __init__(
        self,
        *,
        tier_name: str,
        kind: str,
        count: int,
        channels: TierChannels,
        make_spec: Callable[[int, bytes], m.WorkerSpec],
        task_timeout_s: float,
        max_inflight: int = 4,
        max_attempts: int = 2,
        on_event: Callable[[str], None] | None = None,
        env_allow: tuple[str, ...] = (),
        env_set: Mapping[str, str] | None = None,
        hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
    ):
        self.tier_name = tier_name
        self.kind = kind
        self.count = count
        self.channels = channels
        self.make_spec = make_spec
        self.task_timeout_s = task_timeout_s
        self.max_inflight = max_inflight
        self.max_attempts = max_attempts
        self.on_event = on_event or (lambda what: None)
        self.env_allow = env_allow
        self.env_set = dict(env_set or {})
        self.hello_timeout_s = hello_timeout_s
        self.queue: deque[PoolTask] = deque()
        self.workers: dict[bytes, _WorkerProc] = {}
        self._by_wid: dict[int, _WorkerProc] = {}
        self._next_wid = 0
        self._failed_starts = 0
        self._broken_since: float | None = None
        self._last_start = 0.0
        self._closed = False
        self.awaiting_hello = 0
        self.inflight_count = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the pool's ``count`` worker processes (they say hello when ready)."""
        for _ in range(self.count):
            self._spawn()

    def _spawn(self) -> None:
        wid = self._next_wid
        self._next_wid += 1
        identity = f"{self.kind[0]}{wid}-{os.getpid()}".encode()
        spec = self.make_spec(wid, identity)
        # The worker's task marker: one slot for its loop and one per I/O thread, where each
        # stores the id of the task it runs (no system call per task); read when the worker
        # crashes, it names the tasks to blame even when the result of a task finished just
        # before was still unsent (CASES C25). Close-on-exec: only this worker inherits it.
        marker = os.memfd_create(f"kvoffload-{identity.decode()}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(marker, _MARK.size * (1 + max(1, spec.io_threads)))
            sup = Supervisor(
                [sys.executable, "-m", "kvoffload.workers.main"],
                name=f"kvoffload tier {self.tier_name}: {self.kind} worker {wid}",
                env_allow=self.env_allow,
                env_set={
                    **self.env_set,
                    WORKER_SPEC_ENV: msgspec.json.encode(spec).decode(),
                    WORKER_MARKER_FD_ENV: str(marker),
                },
                pass_fds=(marker,),
                hello_timeout_s=self.hello_timeout_s,
            )
        except BaseException:
            os.close(marker)
            raise
        self.workers[identity] = self._by_wid[wid] = _WorkerProc(wid, identity, sup, marker)
        self.awaiting_hello += 1
        self._last_start = time.monotonic()

    def on_hello(self, identity: bytes) -> None:
        """Worker ``identity`` said hello: it is ready; send it queued tasks."""
        w = self.workers.get(identity)
        if w is None or w.ready:
            return
        w.ready = True
        w.sup.hello()
        self.awaiting_hello -= 1
        self._failed_starts = 0
        self._broken_since = None
        self.dispatch()

    @property
    def broken(self) -> bool:
        """True after workers repeatedly died before becoming ready (tasks then fail at once)."""
        return self._broken_since is not None

    def pids(self) -> list[int]:
        """Process ids of the pool's workers (ready or starting)."""
        return [w.sup.pid for w in self.workers.values()]

    def alive(self) -> int:
        """How many of the pool's workers run (started, not exited). Reads only: safe from a
        metrics scrape's thread."""
        return sum(w.sup.running for w in list(self.workers.values()))

    # -- tasks ----------------------------------------------------------------------------------

    def submit(self, task: PoolTask) -> None:
        """Queue ``task`` and send what can be sent now."""
        self.queue.append(task)
        self.dispatch()

    def dispatch(self) -> None:
        """Send queued tasks, each to the ready worker holding the fewest."""
        queue = self.queue
        if not queue:
            return
        ready = [w for w in self.workers.values() if w.ready and not w.killed]
        limit = self.max_inflight
        now = time.monotonic()
        send = self.channels.send_task
        while queue and ready:
            w = min(ready, key=lambda w: len(w.inflight))
            if len(w.inflight) >= limit:
                return
            task = queue.popleft()
            if not send(self.kind, w.identity, task.payload):
                queue.appendleft(task)
                ready.remove(w)
                continue
            task.attempt += 1
            task.worker = w
            task.deadline = now + (task.timeout_s or self.task_timeout_s)
            w.inflight[task.task_id] = task
            self.inflight_count += 1

    def take(self, task_id: int, wid: int) -> PoolTask | None:
        """Claim the task a result answers. None when the result is stale (the task was already
        failed, re-run elsewhere, or belongs to a killed worker)."""
        w = self._by_wid.get(wid)
        if w is None or w.killed:
            return None
        inflight = w.inflight
        was_head = bool(inflight) and next(iter(inflight)) == task_id
        task = inflight.pop(task_id, None)
        if task is not None:
            self.inflight_count -= 1
            if was_head and inflight:
                # A worker starts its tasks in order: the next one has started by now, and its
                # deadline counts from now rather than from when it was queued behind this one.
                head = next(iter(inflight.values()))
                head.deadline = max(
                    head.deadline, time.monotonic() + (head.timeout_s or self.task_timeout_s)
                )
            if self.queue:
                self.dispatch()
        return task

    def busy(self) -> bool:
        """True while a task is queued or in flight."""
        return bool(self.queue) or self.inflight_count > 0

    def check(self, now: float) -> list[tuple[PoolTask, int]]:
        """Find dead and hung workers. Returns ``(task, code)`` for tasks that failed for good."""
        failed: list[tuple[PoolTask, int]] = []
        for identity, w in list(self.workers.items()):
            rc = w.sup.poll(now)  # reaped, or None (a worker silent past its hello is killed)
            if rc is not None:
                w.sup.close()
                del self.workers[identity]
                del self._by_wid[w.wid]
                if not w.ready:
                    self.awaiting_hello -= 1
                    self._failed_starts += 1
                    if (
                        self._failed_starts >= _BROKEN_AFTER_FAILED_STARTS
                        and self._broken_since is None
                    ):
                        self._broken_since = now
                        log.error(
                            "kvoffload tier %s: %s workers exit before becoming ready "
                            "(exit code %s); failing its tasks",
                            self.tier_name,
                            self.kind,
                            rc,
                        )
                elif not w.killed:
                    log.warning(
                        "kvoffload tier %s: %s worker %d (pid %d) died with code %s; replacing it",
                        self.tier_name,
                        self.kind,
                        w.wid,
                        w.sup.pid,
                        rc,
                    )
                rerun = []
                # A worker that crashed (exited by itself, or on a crash signal) may have been
                # killed by a task it was running: those fail, never re-run, so a poison task
                # cannot kill a second worker (C25). Its task marker names them (with I/O
                # threads, the tasks whose chunks were moving); the oldest task it holds is not
                # enough, as the result of a task finished just before may not have reached us
                # (lost with the process). Idle, none is blamed. Without a marker, the oldest it
                # holds. One killed from outside (SIGKILL / SIGTERM: an operator, the OOM killer)
                # has its tasks re-run.
                crashed = not w.killed and _crashed(rc)
                marked = w.running_tasks() if crashed else set()
                running = {next(iter(w.inflight), -1)} if marked is None else marked
                w.close_marker()
                for task in w.inflight.values():
                    self.inflight_count -= 1
                    task.worker = None
                    if task.timed_out:
                        failed.append((task, m.TIMEOUT))
                    elif task.task_id in running:
                        failed.append((task, m.WORKER_DIED))
                    elif task.attempt < self.max_attempts:
                        rerun.append(task)
                    else:
                        failed.append((task, m.WORKER_DIED))
                self.queue.extendleft(reversed(rerun))  # first in line, in their original order
                w.inflight.clear()
                if not self._closed:
                    self.on_event("restart")
            elif not w.killed and w.inflight:
                # Only the task the worker is running (the oldest it holds) can be late; the ones
                # queued behind it are re-run elsewhere when the worker is killed.
                head = next(iter(w.inflight.values()))
                if now > head.deadline:
                    head.timed_out = True
                    w.killed = True
                    self.on_event("timeout")
                    w.sup.kill(f"it did not answer within {self.task_timeout_s:.1f} s")
        if not self._closed:
            live = len(self.workers)
            if self._broken_since is not None:
                while self.queue:
                    failed.append((self.queue.popleft(), m.WORKER_DIED))
                if now - self._broken_since > _BROKEN_RETRY_S and live < self.count:
                    self._broken_since = now
                    self._spawn()
            elif live < self.count and now - self._last_start > (
                _RESTART_BACKOFF_S if self._failed_starts else 0
            ):
                for _ in range(self.count - live):
                    self._spawn()
        if self.queue:
            self.dispatch()
        return failed

    # -- shutdown -------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 5.0) -> list[PoolTask]:
        """Stop every worker (a StopTask, then SIGKILL after ``timeout_s``) and return the tasks that
        never got an answer, for the caller to fail with CANCELLED."""
        self._closed = True
        leftover = list(self.queue)
        self.queue.clear()
        stop = m.encode(m.StopTask())
        for w in self.workers.values():
            leftover.extend(w.inflight.values())
            w.inflight.clear()
            if w.sup.running and not (
                w.ready and self.channels.send_task(self.kind, w.identity, stop)
            ):
                w.sup.kill()  # not connected yet, or gone: nothing to finish
        deadline = time.monotonic() + timeout_s
        for w in self.workers.values():
            w.sup.close(deadline)  # killed if still busy in a task at the deadline; reaped
            w.close_marker()
        self.workers.clear()
        self._by_wid.clear()
        self.inflight_count = 0
        return leftover
