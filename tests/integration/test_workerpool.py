"""The worker pool of a worker-backed tier (``kvoffload.tiers.workerpool.WorkerPool``) over real
worker processes, each under its ``Supervisor``: a worker's death is reported only once the process
is reaped (a SIGKILL from outside, a kill for a task past its deadline), a worker that never says
hello is killed and counted as a failed start, and a pool that cannot start workers fails its tasks
instead of holding them; shutdown leaves no process and no descriptor."""

from __future__ import annotations

import os
import signal
import socket
import time

import msgspec
import psutil
import pytest
from helpers import (
    NO_FLOOR,
    ROW,
    arena_name,
    keys_for,
    namespace,
    no_child_or_descriptor_left,
    open_descriptors,
    wait_paused,
    wait_until,
)

from kvoffload.ipc import messages as m
from kvoffload.ipc import names
from kvoffload.ipc.arena import Arena
from kvoffload.tiers.base import JobMetadata, JobResult
from kvoffload.tiers.fs import FsTier, FsTierConfig
from kvoffload.tiers.workerpool import PoolTask, WorkerPool

PATIENCE_S = 120.0


@pytest.fixture
def arena():
    a = Arena.create(arena_name(), 4, ROW)
    yield a
    a.close()


@pytest.fixture
def leaves_nothing():
    """No worker process, pidfd or task marker (memfd) is left."""
    with no_child_or_descriptor_left("pidfd", "memfd:kvoffload"):
        yield


def start_tier(arena, root, **cfg) -> FsTier:
    tier = FsTier(
        name="fs",
        arena_view=arena.memoryview(),
        namespace=namespace(),
        config=msgspec.convert(
            {"root_dir": str(root), "read_workers": 1, "write_workers": 1, **NO_FLOOR, **cfg},
            FsTierConfig,
        ),
        arena=arena,
    )
    wait_until(tier.workers_ready, PATIENCE_S, "the tier's workers ready", tier.get_finished_jobs)
    return tier


def result_of(tier: FsTier, job_id: int) -> JobResult:
    return wait_until(
        lambda: next((r for r in tier.get_finished_jobs() if r.job_id == job_id), None),
        PATIENCE_S,
        f"job {job_id}'s result",
    )


def test_a_worker_killed_from_outside_is_reaped_before_its_task_reruns_on_a_new_one(
    arena, tmp_path, leaves_nothing
):
    gate = tmp_path / "gate"
    fault = {"point": "store", "action": "wait_file", "arg": str(gate)}
    tier = start_tier(arena, tmp_path / "root", faults=[fault])
    try:
        key = keys_for(1)[0]
        tier.submit_store(JobMetadata(job_id=1, keys=[key], slots=[0], is_promotion=False))
        (pid,) = wait_paused(gate, step=tier.get_finished_jobs)
        os.kill(pid, signal.SIGKILL)
        gate.touch()  # the replacement's store goes through

        def replaced():
            tier.get_finished_jobs()
            return pid not in tier.worker_pids()["stores"]

        wait_until(replaced, PATIENCE_S, "the killed worker dropped from the pool")
        # The pool handed its task on in the same check: the process was reaped by then.
        assert not psutil.pid_exists(pid), "the death was reported before the worker was reaped"
        result = result_of(tier, 1)
        assert result.success, result
        assert tier.counters[names.WORKER_RESTARTS] == 1
        assert names.JOB_TIMEOUTS not in tier.counters
    finally:
        tier.shutdown()


def test_a_worker_past_its_task_deadline_is_killed_and_reaped_before_the_task_fails(
    arena, tmp_path, leaves_nothing
):
    gate = tmp_path / "gate"  # never created: the worker sits in its store past the deadline
    fault = {"point": "store", "action": "wait_file", "arg": str(gate)}
    tier = start_tier(arena, tmp_path / "root", faults=[fault], job_timeout_s=1.0)
    try:
        key = keys_for(1)[0]
        tier.submit_store(JobMetadata(job_id=1, keys=[key], slots=[0], is_promotion=False))
        (pid,) = wait_paused(gate, step=tier.get_finished_jobs)
        result = result_of(tier, 1)
        assert not psutil.pid_exists(pid), "the task failed before its worker was reaped"
        assert result.failed == {key: "timeout"}
        assert tier.counters[names.JOB_TIMEOUTS] == 1
    finally:
        tier.shutdown()


def test_workers_that_never_say_hello_are_killed_and_their_pool_fails_its_tasks(
    arena, tmp_path, leaves_nothing
):
    tier = start_tier(arena, tmp_path / "root")
    res = tier.resources
    base = tier._spec(0, b"", "stores")
    events: list[str] = []
    # Its workers connect and say hello to a socket no one accepts or reads: the pool never hears
    # them.
    nobody = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    nobody.bind(f"\0kvoffload-test-nobody-{os.getpid()}")
    nobody.listen(8)
    pool = WorkerPool(
        tier_name="fs",
        kind="stores",
        count=1,
        channels=res.channels,
        make_spec=lambda wid, ident: msgspec.structs.replace(
            base,
            worker_id=100 + wid,
            identity=ident,
            jobs_endpoint=f"@kvoffload-test-nobody-{os.getpid()}",
        ),
        task_timeout_s=PATIENCE_S,
        on_event=events.append,
        hello_timeout_s=0.5,
    )
    try:
        pool.start()
        (first,) = pool.pids()
        task = PoolTask(1, m.encode(m.StopTask()), owner="held")
        pool.submit(task)

        def failed_tasks():
            return pool.check(time.monotonic()) or None

        failed = wait_until(failed_tasks, PATIENCE_S, "the pool to give up", interval_s=0.02)
        assert failed == [(task, m.WORKER_DIED)]
        assert pool.broken and pool.awaiting_hello == len(pool.workers)
        assert not psutil.pid_exists(first), "a silent worker was left running or unreaped"
        assert events.count("restart") >= 3  # three failed starts make it broken
    finally:
        assert pool.shutdown() == []
        tier.shutdown()
        nobody.close()
    assert not pool.workers and pool.pids() == []


def test_shutdown_stops_every_worker_and_closes_their_descriptors(arena, tmp_path, leaves_nothing):
    tier = start_tier(arena, tmp_path / "root", read_workers=2, write_workers=2)
    procs = [psutil.Process(pid) for pids in tier.worker_pids().values() for pid in pids]
    assert len(procs) == 4
    assert len(open_descriptors("memfd:kvoffload")) >= 4  # a task marker each
    tier.shutdown()
    assert not any(psutil.pid_exists(p.pid) for p in procs)
