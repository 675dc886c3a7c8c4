"""Tier workers' contracts, in process: contained errors are logged at a bounded rate (C25), fault
specs are checked at config parse, and the worker I/O contract is one typed Protocol. The
containment itself (C25) and a filesystem refusing O_DIRECT half-way (C31), with real worker
processes, are tests/integration/test_worker_containment.py."""

import ast
import logging
import pathlib
import sys
import typing

import numpy as np
import pytest
from helpers import ROW, keys_for, payload

from kvoffload.config import ConfigError, parse_config
from kvoffload.ipc import messages as m
from kvoffload.workers import chunkio
from kvoffload.workers.chunkfile import HEADER_BYTES
from kvoffload.workers.faults import Faults

WORKERS_DIR = pathlib.Path(chunkio.__file__).parent


# -- C25: containment ---------------------------------------------------------------------------


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
        (chunkio.IOOutcome(m.NO_SPACE, 0, "", 0, -2), "free_bytes"),
        (chunkio.IOOutcome(m.NO_SPACE, 0, "", 0, 1.5), "free_bytes"),
    ],
)
def test_an_outcome_outside_the_contract_is_named(outcome, problem):
    assert outcome.problem().startswith(problem)


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
