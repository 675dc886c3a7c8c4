"""``kvoffload stress``: a short run with every fault injected, as CI's version of the long one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvoffload.reasons import explain


def _stress(*args: str, timeout: float = 240) -> tuple[int, dict | None, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.tools.cli", "stress", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    try:
        out = json.loads(proc.stdout)
    except json.JSONDecodeError:
        out = None
    return proc.returncode, out, proc.stderr


@pytest.mark.timeout(1800)
def test_stress_with_every_fault_runs_clean():
    """fs and obj tiers; workers killed, chunks corrupted / truncated / deleted, the disk filled,
    the object store flaky and dead for a while: zero corrupt loads, zero hung requests or jobs,
    and every injected fault visible in the summary."""
    faults = ["--kill-workers", "--corrupt", "--obj", "--flaky-s3"]
    root = os.geteuid() == 0
    if root:
        faults.append("--fill-disk")
    # 20 s of load, then on until every fault has taken effect: how soon a damaged chunk is loaded
    # again or a store meets the full disk depends on the machine, that it happens does not. A
    # request or job is hung after 300 s (a hang guard: the default 30 s failed a run beside two
    # vLLM engine lanes, whichever of the two it was).
    rc, out, err = _stress(
        "--duration",
        "20",
        "--until-exercised",
        "600",
        "--hang-after",
        "300",
        "--chunk-kib",
        "64",
        *faults,
        "--json",
        timeout=1700,
    )
    assert out is not None, err[-3000:]
    verdict = {k: out[k] for k in ("corrupt_loads", "hung_requests", "hung_jobs", "failures")}
    assert out["corrupt_loads"] == 0 and out["hung_requests"] == 0 and out["hung_jobs"] == 0, (
        verdict,
        err[-3000:],
    )
    assert rc == 0 and out["ok"], (verdict, err[-3000:])
    assert out["requests"] > 0 and out["chunks_loaded"] > 0  # how many depends on the machine
    assert out["unexercised"] == [], out
    # Every fault is visible on /metrics as a labelled series (read from the registry it serves).
    assert out["unmetered"] == [] and set(out["fault_metrics"]) == {f[2:] for f in faults} - {
        "obj"
    }, out
    s3 = " ".join(out["fault_metrics"]["flaky-s3"])
    assert 'event="retries"' in s3 and 'reason="breaker_open"' in s3, s3
    inj = out["injected"]
    assert inj["worker_killed"] > 0 and sum(out["worker_restarts"].values()) > 0
    assert (
        inj.get("chunk_corrupted", 0) + inj.get("chunk_truncated", 0) + inj.get("chunk_deleted", 0)
        > 0
    )
    assert inj["s3_outage"] > 0 and inj["s3_503"] > 0
    assert out["dropped_stores"]["obj"] > 0  # the breaker dropped stores while the store was dead
    if root:
        assert inj["disk_filled"] > 0 and out["failures"].get("fs.store.no_space", 0) > 0
    failure_causes = {k.rsplit(".", 1)[1] for k in out["failures"]}
    assert failure_causes & {"corrupt", "missing"}, out["failures"]
    # Every reason the run counted is explained to its reader (docs/observability.md, the summary).
    refusals = {k.rsplit(".", 1)[1] for k in out["refused"]}
    assert "breaker_open" in refusals, out["refused"]
    assert all(explain(r) for r in failure_causes), out["failures"]
    assert all(explain(r, refused=True) for r in refusals), out["refused"]


def test_stress_refuses_a_bad_config(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "cpu_bytes_to_use": 1 << 24,
                "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path), "max_byte": 5}],
            }
        )
    )
    rc, out, err = _stress("--config", str(cfg), "--duration", "1")
    assert rc == 2
    assert "secondary_tiers[0]" in err and "max_byte" in err


@pytest.mark.parametrize("flag", ["--flaky-s3", "--fill-disk"])
def test_fault_flags_without_their_tier_are_refused(flag, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"cpu_bytes_to_use": 1 << 24}))
    rc, out, err = _stress("--config", str(cfg), "--duration", "1", flag)
    assert rc == 2 and ("needs an obj tier" in err or "needs an fs tier" in err or "root" in err)


def test_bad_json_and_a_taken_metrics_port_are_bad_input(tmp_path):
    import socket

    cfg = tmp_path / "c.json"
    cfg.write_text("{not json")
    rc, _, err = _stress("--config", str(cfg), "--duration", "1")
    assert rc == 2 and "not JSON" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err = _stress("--duration", "1", "--metrics-port", str(port))
    assert rc == 2 and f"--metrics-port {port}" in err and "Traceback" not in err
