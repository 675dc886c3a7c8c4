"""Tier workers contain what a task raises (C25), and a filesystem refusing O_DIRECT half-way is
survived (C31).

Real worker processes, real files, real out-of-tree modules (``poison_tier`` / ``poison_io``). The
fault specs checked at config parse and the worker I/O contract, in process, are
tests/unit/test_worker_containment.py."""

import os
import pathlib
import socket

import numpy as np
import psutil
import pytest
from cotenant import as_cotenant
from helpers import HIT, MISS, ROW, TESTS_DIR, Rig, fs_tier, keys_for, payload, wait_until

from kvoffload.ipc import messages as m
from kvoffload.ipc.channels import frame, hello_frame
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name
from kvoffload.workers.fs_io import filesystem_of

_PATIENCE_S = 120.0


def _store_failures(rig: Rig) -> dict[str, int]:
    """Failed store chunks by reason (``kvoffload_tier_failed_chunks``)."""
    return {
        reason: n
        for (_tier, direction, reason), n in rig.tm.stats.failed.items()
        if direction == "store" and n
    }


def _load_failures(rig: Rig) -> dict[str, int]:
    return {
        reason: n
        for (_tier, direction, reason), n in rig.tm.stats.failed.items()
        if direction == "load" and n
    }


def _ready_writer_pid(rig: Rig) -> int:
    """The pid of the tier's one writer, once it is up and has said hello."""

    def ready():
        rig.tm.poll()
        ws = [w for w in rig.fs._writers.workers.values() if w.ready and w.proc.poll() is None]
        return ws[0].proc.pid if len(ws) == 1 else None

    return wait_until(ready, what="the tier's writer to be ready")


def _assert_stored(rig: Rig, root, keys) -> None:
    """``keys`` are on disk whole: evicted from the host tier, each loads back bit-exact."""
    for k in keys:
        path = os.path.join(str(root), rig.ns.id(), relative_name(k))
        assert os.path.getsize(path) == HEADER_BYTES + ROW
    rig.evict_all()
    assert rig.resolve(keys) == [HIT] * len(keys)
    for k, row in zip(keys, rig.read(keys)):
        assert np.array_equal(row, payload(k))


# -- C25: containment ---------------------------------------------------------------------------


@pytest.mark.parametrize("error", ["ValueError", "MemoryError", "struct.error"])
def test_c25_an_out_of_tree_io_error_fails_its_key_and_the_worker_goes_on(
    tmp_path, monkeypatch, capfd, error
):
    """An out-of-tree tier whose worker I/O raises something other than an I/O error for one key:
    that key fails with cause ``error`` and a logged traceback; the three good keys of its batch and
    the next batch are stored, by the same worker process (no restart)."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join([str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    keys = keys_for(4)
    bad = keys[1]
    root = tmp_path / "root"
    tier = fs_tier(
        root,
        type="PoisonTier",
        module_path="poison_tier",
        name="poisoned",
        poison={bad.hex(): error},
    )
    with Rig([tier], num_slots=8) as rig:
        pid = _ready_writer_pid(rig)
        rig.store(keys)  # one task: the bad key and three good ones
        assert _store_failures(rig) == {"error": 1}
        assert rig.fs.counters["store_chunks"] == 3
        assert rig.fs.counters["task_errors"] == 1
        nxt = keys_for(4, seed=1)
        rig.store(nxt)
        assert _store_failures(rig) == {"error": 1}
        assert rig.fs.counters["store_chunks"] == 7
        assert rig.fs.worker_pids()["stores"] == [pid]
        assert rig.fs.counters.get("worker_restarts", 0) == 0
        assert psutil.Process(pid).is_running()
        good = [k for k in keys if k != bad] + nxt
        _assert_stored(rig, root, good[:4])
        assert rig.resolve([bad]) == [MISS]
    err = capfd.readouterr().err
    shown = {"struct.error": "struct.error"}.get(error, error)
    assert "Traceback (most recent call last)" in err
    assert f"{shown}: poisoned store of {bad.hex()[:16]}" in err
    assert f"store {bad.hex()[:16]} failed; the worker goes on" in err


def test_c25_an_injected_non_io_error_fails_its_key_and_the_worker_goes_on(tmp_path, capfd):
    """The same through a ``raise_error`` fault inside the fs tier's own store code."""
    keys = keys_for(4)
    bad = keys[2]
    fault = {
        "point": "before_read_slot",
        "action": "raise_error",
        "arg": "ValueError",
        "key_hex": bad.hex(),
        "count": -1,
    }
    with Rig([fs_tier(tmp_path, faults=[fault])], num_slots=8) as rig:
        pid = _ready_writer_pid(rig)
        rig.store(keys)
        assert _store_failures(rig) == {"error": 1}
        rig.store(keys_for(4, seed=1))
        assert _store_failures(rig) == {"error": 1}
        assert rig.fs.counters["store_chunks"] == 7
        assert rig.fs.worker_pids()["stores"] == [pid]
        assert rig.fs.counters.get("worker_restarts", 0) == 0
    err = capfd.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ValueError: injected fault: ValueError" in err


def test_c25_an_error_outside_the_per_key_calls_fails_that_task_only(tmp_path, capfd):
    """A load task that raises before any per-key work (``raise_error`` at the ``load`` point)
    fails its keys with ``error``; the reader lives on and the next load succeeds."""
    keys = keys_for(2)
    fault = {"point": "load", "action": "raise_error", "arg": "RuntimeError", "count": 1}
    with Rig([fs_tier(tmp_path, faults=[fault])], num_slots=4) as rig:
        rig.store(keys)
        rig.evict_all()
        reader = rig.fs.worker_pids()["loads"]
        assert rig.resolve(keys[:1]) == [MISS]  # its load task failed
        assert _load_failures(rig) == {"error": 1}
        assert rig.resolve(keys[1:]) == [HIT]
        assert np.array_equal(rig.read(keys[1:])[0], payload(keys[1]))
        assert rig.fs.worker_pids()["loads"] == reader
        assert rig.fs.counters.get("worker_restarts", 0) == 0
    err = capfd.readouterr().err
    assert "RuntimeError: injected fault: RuntimeError" in err and "LoadTask" in err


def test_c25_a_task_that_kills_its_worker_is_not_rerun_on_a_second_worker(tmp_path):
    """A task that takes its worker process down (an ``exit`` fault: what a crash in native code
    does) fails with ``worker_died``; it is not re-run to kill the replacement too. The tasks
    queued behind it are re-run and stored. The result of the task the worker finished just before
    is held back (``reply_hold``) and dies with the process, as an unflushed reply does: the crash
    is still blamed on the task that was running, not on that older one. One I/O thread: the
    worker runs one task at a time (several: the next test)."""
    keys = keys_for(4)
    done, bad = keys[0], keys[1]
    faults = [
        {"point": "store_reply", "action": "reply_hold", "key_hex": done.hex(), "count": 1},
        {"point": "before_read_slot", "action": "exit", "key_hex": bad.hex(), "count": -1},
    ]
    cfg = fs_tier(tmp_path, chunks_per_task=1, io_threads=1, faults=faults)
    with Rig([cfg], num_slots=8) as rig:
        first = _ready_writer_pid(rig)
        rig.store(keys)
        assert _store_failures(rig) == {"worker_died": 1}
        second = _ready_writer_pid(rig)
        assert second != first
        assert rig.fs.counters["worker_restarts"] == 1
        nxt = keys_for(2, seed=1)
        rig.store(nxt)
        assert _store_failures(rig) == {"worker_died": 1}
        assert rig.fs.worker_pids()["stores"] == [second]
        assert rig.fs.counters["worker_restarts"] == 1
        _assert_stored(rig, tmp_path, [k for k in keys if k != bad] + nxt)
        # One task marker per live worker: the dead worker's was closed when it was replaced.
        live = sum(len(pids) for pids in rig.fs.worker_pids().values())
        assert len(_task_markers()) == live
    assert _task_markers() == []


def test_c25_a_crash_with_several_tasks_moving_fails_those_and_kills_one_worker_only(tmp_path):
    """With I/O threads the worker moves several tasks' chunks at once. When one of them takes the
    process down, every task whose chunk was moving fails with ``worker_died`` (which one crashed
    it cannot be told) and none of them is re-run: the poison task never reaches the replacement,
    which stores what it is given next."""
    keys = keys_for(8)
    bad = keys[3]
    fault = {"point": "before_read_slot", "action": "exit", "key_hex": bad.hex(), "count": -1}
    cfg = fs_tier(tmp_path, chunks_per_task=1, io_threads=4, faults=[fault])
    with Rig([cfg], num_slots=16) as rig:
        first = _ready_writer_pid(rig)
        rig.store(keys)
        failed = _store_failures(rig)
        assert set(failed) == {"worker_died"}
        assert 1 <= failed["worker_died"] <= 4  # at most one task per I/O thread was moving
        second = _ready_writer_pid(rig)
        assert second != first
        assert rig.fs.counters["worker_restarts"] == 1
        nxt = keys_for(4, seed=1)
        rig.store(nxt)
        assert _store_failures(rig) == failed
        assert rig.fs.worker_pids()["stores"] == [second]
        assert rig.fs.counters["worker_restarts"] == 1
        rig.evict_all()
        got = rig.resolve(keys)
        assert got[3] == MISS
        assert got.count(MISS) == failed["worker_died"]
        _assert_stored(rig, tmp_path, [k for k, r in zip(keys, got) if r == HIT] + nxt)


def _task_markers() -> list[str]:
    """This process's open descriptors that are worker task markers (memfds)."""
    fds = pathlib.Path("/proc/self/fd")
    links = []
    for fd in fds.iterdir():
        try:
            links.append(os.readlink(fd))
        except OSError:
            continue  # the directory's own descriptor, gone by now
    return [link for link in links if link.startswith("/memfd:kvoffload-")]


def test_c25_an_io_module_that_breaks_the_contract_fails_that_key_with_error(
    tmp_path, monkeypatch, capfd
):
    """An out-of-tree I/O module answering a tuple (the old contract) instead of an IOOutcome:
    the key fails with ``error``, named in the worker's log; the worker goes on."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))
    keys = keys_for(2)
    tier = fs_tier(
        tmp_path, type="PoisonTier", module_path="poison_tier", poison={keys[0].hex(): "tuple"}
    )
    with Rig([tier], num_slots=4) as rig:
        pid = _ready_writer_pid(rig)
        rig.store(keys)
        assert _store_failures(rig) == {"error": 1}
        assert rig.fs.counters["store_chunks"] == 1
        assert rig.fs.worker_pids()["stores"] == [pid]
    err = capfd.readouterr().err
    assert "poison_io: answered tuple, not an IOOutcome" in err


# -- C31: a filesystem that refuses O_DIRECT after creating the file ------------------------------


@pytest.mark.parametrize("refused_at", ["direct_open_created", "direct_write"])
def test_c31_a_filesystem_refusing_direct_io_half_way_stores_everything_buffered(
    tmp_path, capfd, refused_at
):
    """``direct_open_created``: the O_DIRECT open creates the file, then fails with EINVAL;
    ``direct_write``: the open succeeds and the first aligned write fails with EINVAL. Either way
    all 6 chunks are stored (buffered), the fallback is logged once with the filesystem, no failure
    is counted, and no temporary file is left. Loads meet the same on their side (``direct_read``)
    and read everything back."""
    faults = [
        {"point": refused_at, "action": "raise", "arg": 22, "count": -1},
        {"point": "direct_read", "action": "raise", "arg": 22, "count": -1},
    ]
    root = tmp_path / "root"
    keys = keys_for(6)
    with Rig([fs_tier(root, direct_io="both", faults=faults)], num_slots=8) as rig:
        rig.store(keys)
        assert _store_failures(rig) == {}
        assert rig.fs.counters["store_chunks"] == 6
        assert rig.fs.counters.get("store_failures", 0) == 0
        assert rig.fs.counters["direct_io_fallbacks"] == 1
        _assert_stored(rig, root, keys)
        assert _load_failures(rig) == {}
        assert rig.fs.counters["direct_io_fallbacks"] == 2  # writes, then reads
        ns_dir = root / rig.ns.id()
        assert not [p for p in ns_dir.rglob("*") if p.name.endswith(".tmp")]
    err = capfd.readouterr().err
    fs_desc = filesystem_of(str(root))
    for transfers in ("writes", "reads"):
        lines = [ln for ln in err.splitlines() if f"refuses O_DIRECT {transfers}" in ln]
        assert len(lines) == 1, err
        assert fs_desc in lines[0] and str(root) in lines[0] and "Invalid argument" in lines[0]


def test_a_worker_closing_while_an_io_thread_still_moves_a_chunk_writes_into_no_reused_descriptor(
    tmp_path,
):
    """Issue 25 item 6: a worker's I/O thread wakes the loop through a pipe when it ends a task.
    Closed while a thread is still storing a chunk (held at a gate), the worker keeps the pipe (and
    the arena) open for it: a pipe opened afterwards, which would take the closed pipe's numbers,
    gets nothing when the thread finishes, and the thread ends without an error. The worker is the
    real worker loop, in this process, attached to a real tier's arena and sockets."""
    import threading

    import msgspec

    from kvoffload.ipc import messages as m
    from kvoffload.workers.main import Worker

    gate = tmp_path / "publish-may-run"
    held = {"point": "before_publish", "action": "wait_file", "arg": str(gate), "count": 1}
    with Rig([fs_tier(tmp_path / "fs")], num_slots=4) as rig:
        spec = msgspec.structs.replace(
            rig.fs._spec(99, b"in-process", "stores"),
            io_threads=2,
            faults=[msgspec.convert(held, m.Fault)],
        )
        errors: list[BaseException] = []
        hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)
        worker = Worker(spec)
        try:
            key = keys_for(1, seed=250)[0]
            rig.arena.rows[0] = payload(key, ROW)
            assert worker._start(m.StoreTask(1, [0], [key])) == 1
            wait_until(lambda: os.path.exists(f"{gate}.reached") or None, what="the held chunk")
            worker.close(join_s=0.2)  # the thread is still in the store
            r, w = os.pipe()  # takes the lowest free numbers: the wake pipe's, had it closed
            try:
                gate.touch()
                wait_until(lambda: not any(t.is_alive() for t in worker._threads) or None)
                os.set_blocking(r, False)
                with pytest.raises(BlockingIOError):
                    os.read(r, 1)  # nothing was written into the new pipe
            finally:
                os.close(r)
                os.close(w)
            assert not errors, errors
            assert (tmp_path / "fs" / rig.ns.id() / relative_name(key)).exists()
        finally:
            threading.excepthook = hook
            if worker._wake_r >= 0:  # the threads are gone: what close() left open for them
                os.close(worker._wake_r)
                os.close(worker._wake_w)
                worker.arena.close()


# -- the workers' sockets: another local user ---------------------------------------------------


def _connect_and_forge(endpoint: str, wid: int) -> None:
    """As another local user: connect to a tier's worker socket, say hello as a worker and answer
    task 1 as done (the bytes wait in the socket for the engine to read them, or not)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_PATIENCE_S)
    sock.connect("\0" + endpoint[1:])
    forged = m.TaskResult(1, wid, [m.OK], nbytes=ROW, counters={"forged_by_cotenant": 1})
    sock.sendall(hello_frame(b"s0-forger", m.encode(m.Hello(wid, os.getpid()))))
    sock.sendall(frame(m.encode(forged)))
    sock.close()


def test_another_local_user_cannot_connect_to_a_tiers_worker_sockets(tmp_path):
    """The workers' sockets live in the abstract namespace, which has no file permissions: the
    engine closes a connection from another user at once, counts it, and reads nothing from it
    (no Hello taken, no result applied)."""
    rig = Rig([fs_tier(tmp_path)])
    try:
        pools = rig.fs.resources.pools
        wait_until(
            lambda: not any(p.awaiting_hello for p in pools) or None,
            what="every worker connected",
            step=rig.tm.poll,
        )
        ours = 2 + sum(len(p.workers) for p in pools)  # the listening sockets, one per worker
        assert len(rig.fs._chans.sockets()) == ours
        endpoint = rig.fs._chans.endpoints["stores"]
        as_cotenant(_connect_and_forge, endpoint, 0)
        wait_until(
            lambda: rig.fs.counters.get("refused_worker_connections_other_user") or None,
            what="the refusal counted",
            step=rig.tm.poll,
        )
        assert rig.fs.counters["refused_worker_connections_other_user"] == 1
        assert len(rig.fs._chans.sockets()) == ours
        rig.store(keys_for(2, seed=77))  # the tier still works; the forged result was never read
        assert "forged_by_cotenant" not in rig.fs.counters
    finally:
        rig.close()
