"""Tier workers contain what a task raises (C25), fault specs are checked at config parse, the worker
I/O contract is one typed Protocol, and a filesystem refusing O_DIRECT half-way is survived (C31).

Real worker processes, real files, real out-of-tree modules (``poison_tier`` / ``poison_io``)."""

import ast
import logging
import os
import pathlib
import sys
import typing

import numpy as np
import psutil
import pytest
from helpers import HIT, MISS, ROW, TESTS_DIR, Rig, fs_tier, keys_for, payload, wait_until

from kvoffload.config import ConfigError, parse_config
from kvoffload.ipc import messages as m
from kvoffload.workers import chunkio
from kvoffload.workers.chunkfile import HEADER_BYTES, relative_name
from kvoffload.workers.faults import Faults
from kvoffload.workers.fs_io import filesystem_of

WORKERS_DIR = pathlib.Path(chunkio.__file__).parent


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


def test_contained_errors_are_logged_at_most_burst_per_window_then_summed_up(capsys):
    from kvoffload.ipc.ratelimit import RateLimitedLog
    from kvoffload.workers.main import log_contained

    logger = logging.getLogger("kvoffload.test.worker")
    handler = logging.StreamHandler(sys.stderr)  # as a worker process's main() sets up
    logger.addHandler(handler)
    logger.propagate = False
    try:
        now = [100.0]
        errors = RateLimitedLog(logger, interval_s=60.0, burst=2, clock=lambda: now[0])
        for i in range(5):
            try:
                raise ValueError(f"bug {i}")
            except ValueError as e:
                log_contained(errors, "worker w", f"store k{i}", e)
        err = capsys.readouterr().err
        assert err.count("Traceback (most recent call last)") == 2
        assert "ValueError: bug 0" in err and "ValueError: bug 1" in err and "bug 2" not in err
        now[0] += 59.0
        log_contained(errors, "worker w", "store k5", why="still in the window")
        assert capsys.readouterr().err == ""
        now[0] += 1.0
        log_contained(errors, "worker w", "store k6", why="a new window")
        err = capsys.readouterr().err.splitlines()
        assert err == [
            "worker w: store k6 failed; the worker goes on: a new window "
            "(4 more since the last such line, not logged)",
        ]
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


# -- faults are checked when the config is parsed ------------------------------------------------


def _parse_faults(*faults) -> None:
    parse_config(
        {
            "cpu_bytes_to_use": 16 * ROW,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": "/tmp/kvoffload-faults-never-created",
                    "faults": list(faults),
                }
            ],
        }
    )


@pytest.mark.parametrize(
    "fault, key, allowed",
    [
        ({"point": "read_paylaod", "action": "raise"}, "faults[0].point", ["read_payload", "task"]),
        (
            {"point": "read_payload", "action": "raize"},
            "faults[0].action",
            ["raise", "raise_error"],
        ),
        ({"point": "task", "action": "raise", "arg": "EIO"}, "faults[0].arg", ["errno"]),
        (
            {"point": "task", "action": "raise_error", "arg": "ValuError"},
            "faults[0].arg",
            list(m.FAULT_ERRORS),
        ),
        ({"point": "task", "action": "sleep", "arg": -1}, "faults[0].arg", ["seconds >= 0"]),
        ({"point": "task", "action": "wait_file"}, "faults[0].arg", ["path"]),
        ({"point": "task", "action": "drop", "arg": 3}, "faults[0].arg", ["no argument"]),
        ({"point": "task", "action": "drop", "key_hex": "K1"}, "faults[0].key_hex", ["hex"]),
        ({"point": "task", "action": "drop", "count": -2}, "faults[0].count", [">= -1"]),
        (
            {"point": "load", "action": "reply_short"},
            "faults[0].action",
            ["reply point", "load_reply"],
        ),
    ],
)
def test_fault_typos_are_config_errors_naming_the_key_and_allowed_values(fault, key, allowed):
    with pytest.raises(ConfigError) as e:
        _parse_faults({"point": "task", "action": "sleep", "arg": 0}, fault)
    msg = str(e.value).replace("faults[1]", "faults[0]")
    assert msg.startswith(f"kv_connector_extra_config.secondary_tiers[0].{key}: "), msg
    for word in allowed:
        assert word in msg, msg


def test_every_fault_action_and_valid_argument_parses():
    _parse_faults(
        {"point": "task", "action": "sleep", "arg": 0.5},
        {"point": "store", "action": "raise", "arg": 28, "count": -1},
        {"point": "load", "action": "raise"},
        *[{"point": "probe", "action": "raise_error", "arg": name} for name in m.FAULT_ERRORS],
        {"point": "delete", "action": "drop", "key_hex": "0a1b"},
        {"point": "scan", "action": "exit", "count": 0},
        {"point": "read_payload", "action": "wait_file", "arg": "/tmp/gate"},
        {"point": "reply", "action": "reply_stray"},
        {"point": "load_reply", "action": "reply_short", "count": -1},
        {"point": "probe_reply", "action": "sleep", "arg": 1},
    )


@pytest.mark.parametrize("name", m.FAULT_ERRORS)
def test_a_raise_error_fault_raises_the_named_exception_type(name):
    import builtins
    import struct

    expected = struct.error if name == "struct.error" else getattr(builtins, name)
    faults = Faults([m.Fault(point="task", action="raise_error", arg=name)])
    with pytest.raises(expected) as e:
        faults.hit("task", b"\x01" * 16)
    assert not isinstance(e.value, OSError)
    faults.hit("task", b"\x01" * 16)  # count 1: fired once


def _fault_points_in_workers() -> set[str]:
    """The point names of every ``faults.hit("<point>", ...)`` and ``self._armed("<point>", ...)``
    call in the worker code."""
    found = set()
    for path in WORKERS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("hit", "_armed")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                found.add(node.args[0].value)
    return found


def test_fault_points_are_exactly_those_the_workers_fire():
    declared = set(typing.get_args(m.FaultPoint))
    kinds = {t.__name__.removesuffix("Task").lower() for t in typing.get_args(m.Task)} - {"stop"}
    # main.py fires each task kind's name; Faults.reply fires "<kind>_reply"
    fired = _fault_points_in_workers() | kinds | {f"{k}_reply" for k in kinds}
    assert declared == fired


# -- the worker I/O contract ----------------------------------------------------------------------


def test_the_built_in_io_modules_implement_the_chunk_io_protocol(tmp_path):
    from kvoffload.workers import fs_io, obj_io

    ns_id = "00" * 16
    fs = fs_io.make_io(
        fs_io.FsIOConfig(root_dir=str(tmp_path), namespace_id=ns_id, row_bytes=ROW), Faults([])
    )
    obj = obj_io.make_io(
        obj_io.ObjIOConfig(
            bucket="b",
            namespace_id=ns_id,
            row_bytes=ROW,
            endpoint_url="http://127.0.0.1:9",
            access_key_id="k",
            secret_access_key="s",
            region="us-east-1",
        ),
        Faults([]),
    )
    for io in (fs, obj):
        assert isinstance(io, chunkio.ChunkIO)
        for name in ("store", "load", "probe", "delete"):
            hints = typing.get_type_hints(getattr(type(io), name))
            assert hints["return"] is chunkio.IOOutcome, (type(io).__name__, name)
    key = keys_for(1)[0]
    row = payload(key)
    out = fs.store(key, memoryview(row))
    assert out == chunkio.IOOutcome(m.OK, HEADER_BYTES + ROW) and out.problem() is None
    assert fs.probe(key) == chunkio.IOOutcome(m.OK)
    dst = np.zeros(ROW, np.uint8)
    assert fs.load(key, memoryview(dst)) == chunkio.IOOutcome(m.OK, HEADER_BYTES + ROW)
    assert np.array_equal(dst, row)
    assert fs.delete(key) == chunkio.IOOutcome(m.OK)
    assert fs.probe(key).code == m.MISSING
    assert fs.load(key, memoryview(dst)).code == m.MISSING


@pytest.mark.parametrize(
    "outcome, problem",
    [
        (chunkio.IOOutcome(m.TIMEOUT), "code"),
        (chunkio.IOOutcome(42), "code"),
        (chunkio.IOOutcome("0"), "code"),
        (chunkio.IOOutcome(m.OK, -1), "nbytes"),
        (chunkio.IOOutcome(m.OK, 0, None), "detail"),
        (chunkio.IOOutcome(m.OK, 0, "", "200"), "status"),
    ],
)
def test_an_outcome_outside_the_contract_is_named(outcome, problem):
    assert outcome.problem().startswith(problem)


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


def test_the_io_config_is_a_tagged_struct_checked_against_its_module(tmp_path):
    import msgspec
    from poison_io import PoisonIOConfig

    from kvoffload.workers.ioconfig import (
        FsIOConfig,
        ObjIOConfig,
        decode_io_config,
        encode_io_config,
    )

    fs = FsIOConfig(root_dir=str(tmp_path), namespace_id="00" * 16, row_bytes=ROW)
    raw = encode_io_config(fs)
    assert msgspec.json.decode(raw)["io"] == "fs"
    assert decode_io_config(raw, FsIOConfig) == fs
    with pytest.raises(TypeError, match=r"takes ObjIOConfig \(io: 'obj'\), got FsIOConfig"):
        decode_io_config(raw, ObjIOConfig)
    with pytest.raises(msgspec.ValidationError, match=r"\$\.row_bytes"):
        decode_io_config(
            b'{"io": "fs", "root_dir": "/x", "namespace_id": "a", "row_bytes": "1"}', None
        )
    poison = PoisonIOConfig(**msgspec.structs.asdict(fs), poison={"ab": "tuple"})
    assert decode_io_config(encode_io_config(poison), PoisonIOConfig) == poison
    with pytest.raises(msgspec.ValidationError):  # an out-of-tree tag the module does not declare
        decode_io_config(encode_io_config(poison), FsIOConfig)
