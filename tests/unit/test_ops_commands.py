"""Operator commands in process: ``kvoffload sweep``'s bad input, ``kvoffload check``'s table of
every setting (its source, secrets masked, no null), and two writers with one PID storing one chunk
at once (CASES C29). The commands on real tier roots (``kvoffload inspect`` of an fs root and of
s3://bucket/prefix on moto, ``kvoffload sweep --fs-root``, instances on one root) are
tests/integration/test_ops_commands.py."""

import json
import os
import time

from click.testing import CliRunner
from helpers import ROW, keys_for, namespace, payload

from kvoffload.config import describe, parse_config
from kvoffload.tools.cli import main
from kvoffload.workers.chunkfile import HEADER_BYTES


def run_cli(*args, env=None):
    """``kvoffload ARGS`` in-process; a wide terminal so rich tables do not fold the values."""
    return CliRunner().invoke(main, list(args), env={"COLUMNS": "250", **(env or {})})


# -- kvoffload sweep --fs-root --------------------------------------------------------------------


def test_sweep_bad_input_exits_2(tmp_path):
    a_file = tmp_path / "kv.json"
    a_file.write_text("{}")
    for args, message in (
        (["--fs-root", str(tmp_path / "missing")], "no such directory"),
        (["--fs-root", str(a_file)], f"--fs-root {a_file}: not a directory"),
        (["--fs-root", str(tmp_path)], "not an fs tier root"),
        (["--older-than", "60"], "--older-than applies to --fs-root"),
    ):
        res = run_cli("sweep", *args)
        assert res.exit_code == 2, (args, res.output)
        assert message in res.output, (args, res.output)
    res = run_cli("sweep", "--fs-root", str(tmp_path), "--older-than", "0")
    assert res.exit_code == 2 and "--older-than" in res.output


# -- kvoffload check ------------------------------------------------------------------------------


def test_check_prints_every_setting_with_its_source_and_masks_secrets(tmp_path):
    raw = {
        "cpu_bytes_to_use": 1 << 30,
        "eviction_policy": "arc",
        "kv_events": {"endpoint": "tcp://*:0"},
        "secondary_tiers": [
            {"type": "fs", "root_dir": str(tmp_path / "kv"), "max_bytes": 10**9},
            {
                "type": "obj",
                "name": "s3",
                "bucket": "b",
                "secret_access_key": "hunter2-secret",
                "access_key_id": "AKIAEXAMPLE",
            },
        ],
    }
    path = tmp_path / "extra.json"
    path.write_text(json.dumps(raw))
    res = run_cli("check", str(path))
    assert res.exit_code == 0, res.output
    rows = table_rows(res.output)
    assert rows["cpu_bytes_to_use"] == (str(1 << 30), "set")
    assert rows["eviction_policy"] == ("arc", "set")
    assert rows["blocks_per_chunk"] == ("1", "default")
    assert rows["tier_pin_fraction"] == ("0.5", "default")
    assert rows["kv_events.endpoint"] == ("tcp://*:0", "set")
    assert rows["kv_events.topic"] == ("kv-events", "default")
    assert rows["secondary_tiers[0].type"] == ("fs", "set")
    assert rows["secondary_tiers[0].name"] == ("fs", "default")
    assert rows["secondary_tiers[0].max_bytes"] == (str(10**9), "set")
    assert rows["secondary_tiers[0].job_timeout_s"] == ("30.0", "default")
    assert rows["secondary_tiers[1].name"] == ("s3", "set")
    assert rows["secondary_tiers[1].secret_access_key"] == ("***", "set")
    assert rows["secondary_tiers[1].access_key_id"] == ("AKIA***", "set")
    assert "hunter2" not in res.output and "AKIAEXAMPLE" not in res.output

    as_json = run_cli("check", str(path), "--json")
    assert as_json.exit_code == 0
    assert json.loads(as_json.stdout) == json.loads(describe(parse_config(raw)))  # warnings: stderr


def table_rows(output: str) -> dict[str, tuple[str, str]]:
    """``key -> (value, source)`` of the table ``kvoffload check`` printed."""
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 3:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_check_prints_no_null_for_any_documented_setting(tmp_path):
    """Every built-in tier type, kv_events on, nothing else set: each setting shows the value the
    engine will use, or words saying how it is decided at run time, never null (a fresh user read
    null as 'unset, no default' for settings with documented defaults)."""
    from kvoffload.tools.config_table import NOT_SET

    every_tier = [
        {"type": "fs", "root_dir": str(tmp_path / "kv")},
        {"type": "obj", "bucket": "b"},
        {"type": "memory", "max_bytes": 1 << 20},
        {"type": "p2p"},
    ]
    for top in ({}, {"block_size": 64}):
        raw = {
            "cpu_bytes_to_use": 1 << 30,
            "kv_events": {"endpoint": "tcp://*:0"},
            "secondary_tiers": every_tier,
            **top,
        }
        path = tmp_path / "extra.json"
        path.write_text(json.dumps(raw))
        res = run_cli("check", str(path))
        assert res.exit_code == 0, res.output
        rows = table_rows(res.output)
        assert len(rows) > 100, res.output  # every tier's settings are listed
        unresolved = {k: v for k, (v, _) in rows.items() if v in ("null", "None", "", NOT_SET)}
        assert not unresolved, unresolved
    # The ones the fresh user saw as null, with block_size set and without.
    assert rows["blocks_per_chunk"] == (
        "auto: block_size / the engine's block size (tokens)",
        "set",
    )
    path.write_text(json.dumps({**raw, "block_size": None}))
    rows = table_rows(run_cli("check", str(path)).output)
    assert rows["blocks_per_chunk"] == ("1", "default")
    assert rows["block_size"][0].startswith("auto: blocks_per_chunk x the engine's block size")
    fs, obj, p2p = "secondary_tiers[0].", "secondary_tiers[1].", "secondary_tiers[3]."
    assert rows[fs + "max_bytes"][0].startswith("auto: 50% of the free space on root_dir's")
    assert rows[fs + "locality"] == ("LOCAL", "default")
    assert rows[obj + "locality"] == ("REMOTE", "default")
    assert rows[obj + "io_workers"] == ("2", "default")
    assert rows[fs + "read_io_threads"] == ("16", "default")  # 2 workers x 8 io_threads
    assert rows[obj + "write_io_threads"] == ("16", "default")
    assert rows[fs + "chunks_per_task"][0].startswith("auto: about 8 MiB a task")
    assert rows[obj + "max_bytes"] == ("unbounded: nothing is deleted", "default")
    assert rows[p2p + "secret_env"] == ("KVOFFLOAD_P2P_SECRET", "default")  # a name, not masked
    # --json (the start-up log line) has the same effective values; null only where the table
    # says the value is decided at run time.
    as_json = json.loads(run_cli("check", str(path), "--json").stdout)  # warnings go to stderr
    assert as_json["blocks_per_chunk"] == 1
    assert as_json["secondary_tiers"][0]["locality"] == "LOCAL"
    assert as_json["secondary_tiers"][1]["io_workers"] == 2
    assert as_json["secondary_tiers"][0]["max_bytes"] is None


def test_check_names_the_bad_key(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"cpu_bytes_to_use": 1 << 20, "evicton_policy": "lru"}))
    res = run_cli("check", str(path))
    assert res.exit_code != 0
    assert "evicton_policy" in res.output and "eviction_policy" in res.output


# -- CASES C29 -------------------------------------------------------------------------------------


def test_c29_two_writers_with_one_pid_store_the_same_chunk_at_once(tmp_path):
    """Writers in two containers often have the same PID (PID namespaces number alike). Both write
    the same chunk at once: each uses its own temporary file and both stores succeed."""
    import threading

    from kvoffload.ipc.messages import OK, Fault
    from kvoffload.workers.faults import Faults
    from kvoffload.workers.fs_io import FsIOConfig, make_io

    ns = namespace()
    io_cfg = FsIOConfig(
        root_dir=str(tmp_path),
        namespace_id=ns.id(),
        row_bytes=ROW,
        direct_io="none",
    )
    resume = tmp_path / "resume"
    paused = make_io(
        io_cfg, Faults([Fault(point="before_publish", action="wait_file", arg=str(resume))])
    )
    other = make_io(io_cfg, Faults([]))
    key = keys_for(1, seed=31)[0]
    src = memoryview(payload(key))
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("paused", paused.store(key, src)))
    t.start()
    try:
        deadline = time.monotonic() + 60
        d = os.path.dirname(paused.path(key))
        while not (os.path.isdir(d) and any(n.endswith(".tmp") for n in os.listdir(d))):
            assert time.monotonic() < deadline, "the paused writer never wrote its temporary file"
            time.sleep(0.01)
        results["other"] = other.store(key, src)
    finally:
        resume.touch()
        t.join(60)
    assert results["other"].code == OK and results["paused"].code == OK, results
    with open(paused.path(key), "rb") as f:
        assert f.read()[HEADER_BYTES:] == payload(key).tobytes()
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
