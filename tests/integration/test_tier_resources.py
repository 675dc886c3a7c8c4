"""A worker-backed tier's sockets and worker processes belong to one TierResources, closed by
shutdown() or, for a tier dropped without one, by weakref.finalize: real workers, real sockets."""

import gc
import weakref

import psutil
import pytest
from helpers import ROW, arena_name, keys_for, namespace, wait_until

from kvoffload.ipc import messages as m
from kvoffload.ipc.arena import Arena
from kvoffload.tiers.base import JobMetadata
from kvoffload.tiers.fs import FsTier, FsTierConfig
from kvoffload.tiers.process import TASK_TYPES, TaskKind


@pytest.fixture
def arena():
    a = Arena.create(arena_name(), 4, ROW)
    yield a
    a.close()


def start_tier(arena, root) -> FsTier:
    tier = FsTier(
        name="fs",
        arena_view=arena.memoryview(),
        namespace=namespace(),
        config=FsTierConfig(root_dir=str(root), read_workers=1, write_workers=1),
        arena=arena,
    )
    wait_until(
        lambda: not any(p.awaiting_hello for p in tier.resources.pools),
        what="the tier's workers ready",
        step=tier.get_finished_jobs,
    )
    return tier


def worker_processes(tier: FsTier) -> list[psutil.Process]:
    procs = [psutil.Process(pid) for pids in tier.worker_pids().values() for pid in pids]
    assert len(procs) == 2
    return procs


def sockets(res) -> list:
    """The tier's sockets open now: its two listening sockets and one per worker."""
    socks = res.channels.sockets()
    assert len(socks) == 4
    return socks


def test_a_tier_dropped_without_shutdown_leaves_no_worker_and_no_socket(arena, tmp_path):
    tier = start_tier(arena, tmp_path)
    procs = worker_processes(tier)
    res = tier.resources
    socks = sockets(res)
    key = keys_for(1)[0]
    tier.submit_store(JobMetadata(job_id=1, keys=[key], slots=[0], is_promotion=False))
    dropped = weakref.ref(tier)
    del tier
    gc.collect()
    assert dropped() is None  # nothing the tier owns keeps it alive
    assert res.closed and all(s.fileno() == -1 for s in socks) and not res.channels.sockets()
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"workers left running: {[p.pid for p in alive]}"


def test_shutdown_closes_the_resources_once_and_disarms_the_finalizer(arena, tmp_path):
    tier = start_tier(arena, tmp_path)
    procs = worker_processes(tier)
    res = tier.resources
    socks = sockets(res)
    tier.shutdown()
    assert res.closed and all(s.fileno() == -1 for s in socks) and not res.channels.sockets()
    assert not tier._finalizer.alive
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    assert res.close() == []  # closing again does nothing
    tier.shutdown()


@pytest.mark.parametrize("kind", list(TaskKind))
def test_task_kinds_are_the_wire_tags_of_their_task_structs(kind):
    assert TASK_TYPES[kind].__struct_config__.tag == kind.value
    assert kind == kind.value  # a str enum: compares and formats as its tag
    assert isinstance(m.decode_task(m.encode(_task(kind))), TASK_TYPES[kind])


def _task(kind: TaskKind):
    if kind in (TaskKind.LOAD, TaskKind.STORE):
        return TASK_TYPES[kind](1, [0], [b"k"])
    if kind is TaskKind.SCAN:
        return m.ScanTask(1)
    return TASK_TYPES[kind](1, [b"k"])
