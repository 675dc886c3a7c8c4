"""``kvoffload check`` where it needs more than its own process: a /dev/shm already partly used
(a tmpfs of its own), endpoints (``--online``: a real S3 server on loopback, a closed port, a real
listening socket), and tables that a pipe gets unfolded (the command run as a process on a pipe
and on a terminal). Shares the helpers of tests/unit/test_check.py, which holds the rest of the
command's tests.
"""

from __future__ import annotations

import json
import os
import pty
import socket
import subprocess
import sys

import pytest
from s3 import Nanio, free_port, new_bucket, obj_tier, start_moto
from unit.test_check import EXTRA, SPEC, error_lines, row, run_check

from kvoffload.namespace import Namespace
from kvoffload.tools import config_check

# -- this machine ----------------------------------------------------------------------------------


def test_a_host_tier_past_the_free_space_of_its_shm_now_is_a_warning():
    """/dev/shm as large as needed but already partly used: the engine would fail if started
    now (a warning: it may be freed by then). A tmpfs of its own stands for /dev/shm."""
    from kvoffload.tools.stress_faults import FaultError, small_tmpfs

    try:
        mount = small_tmpfs(4 << 20)
        mnt = mount.__enter__()
    except FaultError as e:
        pytest.skip(f"needs a small tmpfs of its own (root, mount permitted): {e}")
    try:
        with open(os.path.join(mnt, "other-engine"), "wb") as f:
            f.write(b"\0" * (3 << 20))
        text = json.dumps({**SPEC, "cpu_bytes_to_use": 2 << 20})
        report = config_check.check_text(text, "x.json", config_check.Options(shm_dir=mnt)).report
        (c,) = [c for c in report.checks if c.check == "host tier fits /dev/shm"]
        assert (c.scope, c.result) == ("this machine", "warning")
        assert "free now" in c.detail and "`kvoffload sweep` removes arenas of dead" in c.detail
        assert not report.errors
    finally:
        mount.__exit__(None, None, None)


# -- online ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto():
    srv, endpoint = start_moto()
    yield endpoint
    srv.stop()


def test_online_reaches_each_bucket_and_peer_and_says_whether_they_answer(tmp_path, moto):
    closed = free_port()  # nothing listens there
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    peer_port = listening.getsockname()[1]
    try:
        cfg = {
            **SPEC,
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [
                obj_tier(moto, new_bucket(moto), name="there"),
                obj_tier(moto, "no-such-bucket", name="missing"),
                obj_tier(f"http://127.0.0.1:{closed}", "b", name="refused"),
                {
                    "type": "p2p",
                    "auth": "none",
                    "trust_local_users": True,
                    "peers": [f"127.0.0.1:{peer_port}", f"127.0.0.1:{closed}"],
                },
            ],
        }
        offline = run_check(tmp_path, cfg)
        assert offline.exit_code == 0, offline.output
        assert row(offline.stdout, "secondary_tiers[2].bucket", "bucket answers") == (
            "not checked",
            f"--online reaches http://127.0.0.1:{closed} from here",
        )
        res = run_check(tmp_path, cfg, "--online")
    finally:
        listening.close()
    assert res.exit_code == 1, res.output
    t = "secondary_tiers"
    assert row(res.stdout, f"{t}[0].bucket", "bucket answers")[0] == "online"
    assert row(res.stdout, f"{t}[0].bucket", "bucket answers")[1].startswith("ok: ")
    errors = error_lines(res)
    assert errors[0] == (
        f"{EXTRA}.{t}[1].bucket: 'no-such-bucket' does not exist at {moto} (from here, now): "
        "the engine would stop at start"
    )
    assert errors[1].startswith(
        f"{EXTRA}.{t}[2].endpoint_override: cannot use http://127.0.0.1:{closed} for bucket 'b'"
    )
    assert len(errors) == 2
    only = "only reachability is checked, not the shared secret"
    assert row(res.stdout, f"{t}[3].peers[0]", "peer answers") == (
        "online",
        f"ok: 127.0.0.1:{peer_port} accepts a TCP connection; {only}",
    )
    scope, result = row(res.stdout, f"{t}[3].peers[1]", "peer answers")
    assert result.startswith(f"warning: 127.0.0.1:{closed} does not answer from here (")
    assert only in result


@pytest.mark.slow
def test_online_names_refused_credentials_without_showing_them(tmp_path):
    """A SigV4 server (moto checks no signature): a wrong secret is refused, named by key."""
    server = Nanio(str(tmp_path / "nanio-data"))
    try:
        tier = obj_tier(server.endpoint, new_bucket(server.endpoint), secret_access_key="wrong-one")
        res = run_check(
            tmp_path, {**SPEC, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}, "--online"
        )
    finally:
        server.stop()
    assert res.exit_code == 1, res.output
    (error,) = error_lines(res)
    assert error.startswith(
        f"{EXTRA}.secondary_tiers[0].access_key_id: the credentials were refused by "
        f"{server.endpoint} for bucket "
    )
    assert "wrong-one" not in res.output


# -- output ----------------------------------------------------------------------------------------


def _long_root(tmp_path) -> str:
    root = tmp_path / ("a-directory-with-a-long-name-" * 4) / "kv-cache-root"
    root.mkdir(parents=True)
    return str(root)


def test_tables_on_a_pipe_are_not_folded_so_paths_copy_whole(tmp_path):
    root = _long_root(tmp_path)
    ns = Namespace(
        model="m", kv_dtype="bfloat16", layout="raw-v1", tokens_per_chunk=16, row_bytes=4096
    )
    os.makedirs(os.path.join(root, ns.id()))
    with open(os.path.join(root, ns.id(), "config.json"), "wb") as f:
        f.write(ns.to_json())
    path = tmp_path / "extra.json"
    path.write_text(
        json.dumps(
            {
                **SPEC,
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": [{"type": "fs", "root_dir": root}],
            }
        )
    )
    for args in (["check", str(path)], ["inspect", root]):
        out = subprocess.run(
            [sys.executable, "-m", "kvoffload.tools.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "COLUMNS": "80"},
        )
        assert out.returncode == 0, out.stderr
        assert any(root in line for line in out.stdout.splitlines()), out.stdout
    # a terminal keeps today's look: folded to its width
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.tools.cli", "check", str(path)],
        stdout=slave,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "80", "TERM": "dumb"},
    )
    os.close(slave)
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    proc.stderr.close()
    lines = data.decode().splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    assert not any(root in line for line in lines)  # folded
